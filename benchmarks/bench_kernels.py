"""How fast are the Pallas kernels against XLA (and cuDNN for attention)? One JSON line per op, pass and implementation.

    python benchmarks/bench_kernels.py                 # full sizes on the current device
    python benchmarks/bench_kernels.py --tiny          # small sizes; on CPU the kernels run in interpret mode
    python benchmarks/bench_kernels.py --ops attention --seq 1024 2048 4096 8192 --head-dim 64 128

Attention also times `auto`, the implementation the model picks on this platform, so its choice can be checked
against the fastest at each shape. Figures: attention and cross-entropy in TFLOP/s of model FLOPs (attention
forward 4*B*H*L*S*Dh, halved when causal, backward 2.5x the forward; cross-entropy forward 2*N*D*V, backward 4*N*D*V), norms in GB/s of memory traffic (forward:
read x, write y; backward: read x and dy, write dx). Each is given as % of the device's peak (jaxperf.perf.hardware)
where one is known, and as a ratio to the XLA reference and, for attention on GPUs, to cuDNN through
`jax.nn.dot_product_attention`. Every implementation's output is checked against the reference before it is timed;
a mismatch is reported as an error record and not timed. Cross-entropy records also carry the compiled temporary +
output bytes of forward+backward (memory_analysis), the figure the fused paths exist to shrink.
On CPU the Pallas kernels run under the interpreter: those figures say nothing about GPU/TPU speed.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxperf.parallel.mesh import normalize_platform
from jaxperf.perf.cpu_host import reexec_with_huge_pages
from jaxperf.benchmarks._common import emit, peak_bandwidth, peak_flops, record
from jaxperf.perf.timing import benchmark

NAME = "kernels"


def _close(a, b, dtype) -> bool:
    tol = 3e-2 if jnp.dtype(dtype) != jnp.float32 else 2e-3
    return bool(np.allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol, atol=tol))


def _temp_bytes(fn, args) -> int | None:
    try:
        m = jax.jit(fn).lower(*args).compile().memory_analysis()
        return int(m.temp_size_in_bytes + m.output_size_in_bytes)
    except Exception:  # noqa: BLE001 - memory analysis is not available on every backend
        return None


PASSES = ("forward", "backward", "both")


def _first_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def _time_passes(op, impls, args, loss_of, amounts, unit, iters, dtype, extra, *, peak, peak_source, memory=False,
                 passes=PASSES):
    """Forward, backward (grad of a scalar) and both, for every impl, after checking each against "xla" (the first
    impl that runs is the reference when "xla" cannot, e.g. out of memory at long sequences). An impl that fails to
    compile or run is recorded with the error and the others go on."""
    argnums = tuple(range(len(args)))
    rows = []
    ref = None
    for impl, fn in impls.items():
        base = dict(op=op, impl=impl, dtype=dtype, peak_source=peak_source, **extra)
        try:
            out = jax.block_until_ready(jax.jit(fn)(*args))
        except Exception as e:  # noqa: BLE001 - out of memory, an unsupported shape: recorded, the others go on
            rows.append(record(NAME, f"{op}/{impl}", None, unit, error=_first_line(e), **base))
            continue
        if ref is None:
            ref = out
        elif not _close(out, ref, dtype):
            rows.append(record(NAME, f"{op}/{impl}", None, unit, error="output does not match the reference", **base))
            continue
        del out
        scalar = lambda *a, fn=fn: loss_of(fn(*a))  # noqa: E731
        fns = {"forward": (jax.jit(fn), amounts["forward"]),
               "backward": (jax.jit(jax.grad(scalar, argnums=argnums)), amounts["backward"]),
               "both": (jax.jit(jax.value_and_grad(scalar, argnums=argnums)), amounts["forward"] + amounts["backward"])}
        mem = _temp_bytes(jax.value_and_grad(scalar, argnums=argnums), args) if memory else None
        for pass_name in passes:
            f, amount = fns[pass_name]
            try:
                t = benchmark(f, *args, warmup=2, iters=iters)
            except Exception as e:  # noqa: BLE001
                rows.append(record(NAME, f"{op}/{impl}/{pass_name}", None, unit, error=_first_line(e),
                                   pass_name=pass_name, **base))
                continue
            per_s = amount / t.median_s
            scale = 1e12 if unit == "TFLOP/s" else 1e9
            rec = record(NAME, f"{op}/{impl}/{pass_name}", per_s / scale, unit, value_per_s=per_s, peak_per_s=peak,
                         pass_name=pass_name, timing=t.as_dict(), **base)
            if mem is not None:
                rec["fwd_bwd_temp_plus_output_bytes"] = mem
            rows.append(rec)
    by = {(r["impl"], r.get("pass_name")): r for r in rows if r.get("value") is not None}
    for r in rows:
        if r.get("value") is None:
            continue
        for other in ("xla", "cudnn"):
            base = by.get((other, r["pass_name"]))
            if base and other != r["impl"]:
                r[f"speed_vs_{other}"] = base["timing"]["median_s"] / r["timing"]["median_s"]
    return rows


def bench_attention(seqs, head_dims, dtype, iters, batch, heads, tokens=None, passes=PASSES):
    """Causal attention, q/k/v [batch, L, heads, Dh]; with `tokens`, batch = max(1, tokens // L) at each length (the
    same work per token whatever the length, and room for the [L, L] scores of the XLA path)."""
    from jaxperf.models.attention import attention, xla_attention
    from pallas_kernels.flash_attention import flash_attention

    peak, source = peak_flops(dtype)
    platform = normalize_platform(jax.default_backend())
    out = []
    for L in seqs:
        rows = max(1, tokens // L) if tokens else batch
        for Dh in head_dims:
            ks = jax.random.split(jax.random.key(0), 3)
            args = [jax.random.normal(k, (rows, L, heads, Dh), dtype) for k in ks]
            impls = {"xla": lambda q, k, v: xla_attention(q, k, v, causal=True),
                     "pallas": lambda q, k, v: flash_attention(q, k, v, causal=True)}
            if jax.default_backend() == "gpu" and dtype != "float32":
                impls["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                              implementation="cudnn")
            # What the model runs with model.attention_impl=auto on this platform (jaxperf.models.platform).
            impls["auto"] = lambda q, k, v: attention(q, k, v, causal=True, impl="auto", platform=platform)
            fwd = 4 * rows * heads * L * L * Dh / 2
            out += _time_passes("attention", impls, args, lambda o: jnp.sum(o.astype(jnp.float32)),
                                {"forward": fwd, "backward": 2.5 * fwd}, "TFLOP/s", iters, dtype,
                                dict(batch=rows, heads=heads, seq=L, head_dim=Dh, causal=True),
                                peak=peak, peak_source=source, passes=passes)
            del args
    return out


def bench_norm(rows, dims, dtype, iters):
    from pallas_kernels.norms import rms_norm, rms_norm_reference

    bw, source = peak_bandwidth()
    out = []
    for D in dims:
        args = [jax.random.normal(jax.random.key(1), (rows, D), dtype), jnp.ones((D,), jnp.float32)]
        impls = {"xla": lambda x, s: rms_norm_reference(x, s), "pallas": lambda x, s: rms_norm(x, s)}
        size = rows * D * jnp.dtype(dtype).itemsize
        out += _time_passes("rms_norm", impls, args, lambda o: jnp.sum(o.astype(jnp.float32)),
                            {"forward": 2 * size, "backward": 3 * size}, "GB/s", iters, dtype,
                            dict(rows=rows, hidden=D), peak=bw, peak_source=source)
    return out


def bench_cross_entropy(n, d, v, dtype, iters):
    from pallas_kernels.cross_entropy import linear_cross_entropy

    peak, source = peak_flops(dtype)
    kh, kw, kt = jax.random.split(jax.random.key(2), 3)
    h = jax.random.normal(kh, (n, d), dtype)
    w = (jax.random.normal(kw, (d, v), jnp.float32) * d**-0.5).astype(dtype)
    targets = jax.random.randint(kt, (n,), 0, v)

    def loss(impl):
        return lambda h, w: linear_cross_entropy(h, w, targets, impl=impl)[0] / n

    # "xla" here is the naive path that builds the [N, V] logits (the reference), the baseline of the ratios.
    impls = {"xla": loss("reference"), "chunked": loss("xla"), "pallas": loss("pallas")}
    return _time_passes("linear_cross_entropy", impls, [h, w], lambda o: o,
                        {"forward": 2 * n * d * v, "backward": 4 * n * d * v}, "TFLOP/s", iters, dtype,
                        dict(n=n, d=d, v=v), peak=peak, peak_source=source, memory=True)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="small sizes (CPU / CI)")
    p.add_argument("--ops", nargs="*", default=["attention", "rms_norm", "cross_entropy"])
    p.add_argument("--seq", type=int, nargs="*", default=None)
    p.add_argument("--head-dim", type=int, nargs="*", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--tokens", type=int, default=None,
                   help="attention: batch = tokens // seq at each length (default: a fixed batch)")
    p.add_argument("--heads", type=int, default=None, help="attention: query heads (default 16, 2 when small)")
    p.add_argument("--passes", nargs="*", choices=PASSES, default=list(PASSES))
    a = p.parse_args(argv)
    cpu = jax.default_backend() == "cpu"
    dtype = a.dtype or ("float32" if a.tiny or cpu else "bfloat16")
    iters = a.iters or (3 if a.tiny else 20)
    small = a.tiny or cpu  # interpret mode on CPU: full GPU sizes would take hours
    results = []
    if "attention" in a.ops:
        results += bench_attention(a.seq or ([128] if a.tiny else [256] if cpu else [1024, 2048, 4096, 8192]),
                                   a.head_dim or ([64] if small else [64, 128]), dtype, iters,
                                   batch=1 if small else 4, heads=a.heads or (2 if small else 16), tokens=a.tokens,
                                   passes=tuple(a.passes))
    if "rms_norm" in a.ops:
        results += bench_norm(256 if a.tiny else 2048 if cpu else 16384, [256] if small else [4096, 8192], dtype,
                              iters)
    if "cross_entropy" in a.ops:
        results += bench_cross_entropy(*((256, 64, 1024) if a.tiny else (1024, 256, 8192) if cpu
                                         else (8192, 768, 50304)), dtype, iters)
    for r in results:
        emit(r)
    return results


if __name__ == "__main__":
    reexec_with_huge_pages()  # XLA:CPU step buffers on huge pages (jaxperf.perf.cpu_host)
    main(sys.argv[1:])
