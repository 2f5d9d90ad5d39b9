"""How much does compiling buy? The same work run op by op (eager) and as one XLA program (jit).

    python benchmarks/bench_compiled_vs_eager.py            # MLP and the tiny preset's train step
    python benchmarks/bench_compiled_vs_eager.py --tiny     # smaller shapes, a few seconds on CPU

Eager JAX dispatches every primitive as its own small program: each pays Python and dispatch overhead, and every
intermediate goes through memory. Under `jit` XLA sees the whole function, fuses elementwise work into the matmuls'
neighbours and runs it with one dispatch. Two workloads:

- an MLP's forward + backward (`jax.grad` of a squared error), eager = the un-jitted `jax.grad`;
- the jaxperf GPT train step (forward, backward, AdamW) of a preset, eager = the same step under `jax.disable_jit()`
  (the layer scan then runs as a Python loop).

Each eager result is checked against the jitted one before anything is timed. Records: seconds per call for each
mode, the jit mode's FLOP/s as % of peak where FLOPs are known, and the speedup eager / jit.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp

from jaxperf.perf.cpu_host import reexec_with_huge_pages
from jaxperf.benchmarks._common import check_close, emit, make_train_step, peak_flops, record
from jaxperf.perf.timing import benchmark

NAME = "compiled_vs_eager"


def mlp_loss(params, x_BxD, y_BxD):
    h = x_BxD
    for w_in_DxF, w_out_FxD in params:
        h = h + jnp.dot(jax.nn.gelu(jnp.dot(h, w_in_DxF)), w_out_FxD)
    return jnp.mean(jnp.square(h - y_BxD))


def bench_mlp(B: int, D: int, F: int, n_layers: int, iters: int) -> list[dict]:
    keys = jax.random.split(jax.random.key(0), 2 * n_layers + 2)
    params = [(jax.random.normal(keys[2 * i], (D, F)) * D**-0.5, jax.random.normal(keys[2 * i + 1], (F, D)) * F**-0.5)
              for i in range(n_layers)]
    x = jax.random.normal(keys[-2], (B, D))
    y = jax.random.normal(keys[-1], (B, D))
    grad_eager = jax.grad(mlp_loss)
    grad_jit = jax.jit(jax.grad(mlp_loss))
    check_close("mlp grad eager vs jit", jax.tree.leaves(grad_eager(params, x, y))[0],
                jax.tree.leaves(grad_jit(params, x, y))[0], rtol=1e-3, atol=1e-5)
    t_eager = benchmark(grad_eager, params, x, y, warmup=1, iters=iters)
    t_jit = benchmark(grad_jit, params, x, y, warmup=2, iters=max(iters, 10))
    flops = 3 * n_layers * 2 * (2 * B * D * F)  # forward: two matmuls per layer; backward: twice the forward
    peak, source = peak_flops("float32")
    shape = {"batch": B, "d": D, "f": F, "layers": n_layers, "dtype": "float32"}
    return [
        record(NAME, "mlp_fwd_bwd/eager", t_eager.median_s, "s", timing=t_eager.as_dict(), **shape,
               flops_per_s=flops / t_eager.median_s, value_per_s=flops / t_eager.median_s, peak_per_s=peak,
               peak_source=source),
        record(NAME, "mlp_fwd_bwd/jit", t_jit.median_s, "s", timing=t_jit.as_dict(), **shape,
               flops_per_s=flops / t_jit.median_s, value_per_s=flops / t_jit.median_s, peak_per_s=peak,
               peak_source=source),
        record(NAME, "mlp_fwd_bwd/speedup", t_eager.median_s / t_jit.median_s, "x", **shape),
    ]


def bench_train_step(preset: str, overrides: list[str], iters: int) -> list[dict]:
    from jaxperf.perf.flops import flops_per_token

    step, state, batch, cfg = make_train_step(preset, overrides, donate=False)

    def eager(s, b):
        with jax.disable_jit():
            return step(s, b)

    t0 = time.perf_counter()
    compiled = step.lower(state, batch).compile()  # compiled once, used for the check and the timing
    compile_s = time.perf_counter() - t0
    _, m_jit = compiled(state, batch)
    _, m_eager = eager(state, batch)  # also the eager warm-up: each primitive's first call compiles it
    check_close("train step loss eager vs jit", m_eager["loss"], m_jit["loss"], rtol=1e-4)
    t_eager = benchmark(eager, state, batch, warmup=0, iters=iters)
    t_jit = benchmark(compiled, state, batch, warmup=2, iters=max(iters, 10))
    B, L = cfg.batch_size, cfg.train_seq_len
    flops = flops_per_token(cfg.model, L) * B * L
    peak, source = peak_flops(cfg.model.dtype)
    peak_all = peak * jax.device_count()
    shape = {"preset": preset, "overrides": overrides, "batch": B, "seq_len": L, "dtype": cfg.model.dtype}
    return [
        record(NAME, "train_step/eager", t_eager.median_s, "s", timing=t_eager.as_dict(), **shape,
               value_per_s=flops / t_eager.median_s, peak_per_s=peak_all, peak_source=source),
        record(NAME, "train_step/jit", t_jit.median_s, "s", timing={**t_jit.as_dict(), "compile_s": compile_s}, **shape,
               tokens_per_s=B * L / t_jit.median_s, value_per_s=flops / t_jit.median_s, peak_per_s=peak_all,
               peak_source=source),
        record(NAME, "train_step/speedup", t_eager.median_s / t_jit.median_s, "x", **shape),
    ]


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="small shapes: a few seconds on CPU (CI)")
    p.add_argument("--preset", default="tiny", help="model preset for the train-step comparison")
    p.add_argument("--iters", type=int, default=None, help="timed eager calls (jit gets at least 10)")
    p.add_argument("overrides", nargs="*", help="config overrides for the train step (key=value)")
    a = p.parse_args(argv)
    iters = a.iters or (1 if a.tiny else 5)
    if a.tiny:
        mlp = dict(B=32, D=64, F=256, n_layers=2)
        overrides = ["model.n_layers=1", "model.d_model=64", "model.n_heads=2", "batch_size=8", "seq_len=32",
                     *a.overrides]
    else:
        mlp = dict(B=256, D=512, F=2048, n_layers=4)
        overrides = list(a.overrides)
    records = bench_mlp(**mlp, iters=iters) + bench_train_step(a.preset, overrides, iters)
    return [emit(r) for r in records]


if __name__ == "__main__":
    reexec_with_huge_pages()  # XLA:CPU step buffers on huge pages (jaxperf.perf.cpu_host)
    main(sys.argv[1:])
