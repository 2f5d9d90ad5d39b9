"""Does XLA run independent work at the same time, and does copying the next batch overlap with the current step?

    python benchmarks/bench_auto_parallel.py
    python benchmarks/bench_auto_parallel.py --tiny

- chains: `c` independent chains of `m` matmuls in one jitted function. `independent` leaves XLA free to schedule them
  as it likes (interleave, run on several streams or threads); `sequential` threads an optimization barrier from the
  end of chain i to the start of chain i+1, so chain i+1 cannot begin before chain i is done. Same FLOPs, same result.
  On a GPU a single big matmul already fills the chip, so the gain shows with small matmuls; on CPU each matmul uses
  all cores and little is expected.
- prefetch: a loop over host batches. `no_prefetch` copies batch i to the device and then runs step i;
  `prefetch` starts the copy of batch i+1 (`jax.device_put`, asynchronous) before dispatching step i, so the copy
  overlaps the compute. On CPU "device" memory is host memory and the copy is cheap or aliased.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxperf.perf.cpu_host import reexec_with_huge_pages
from jaxperf.benchmarks._common import check_close, emit, peak_flops, record
from jaxperf.perf.timing import benchmark

NAME = "auto_parallel"


def _chain(x_NxN, w_NxN, m: int):
    for _ in range(m):
        x_NxN = jnp.tanh(x_NxN @ w_NxN)
    return x_NxN


def make_chains(m: int, sequential: bool):
    """jit(f)(xs_CxNxN, w_NxN) -> C chain outputs stacked; `sequential` forces chain order with barriers."""

    def f(xs_CxNxN, w_NxN):
        outs = []
        prev = None
        for i in range(xs_CxNxN.shape[0]):
            x = xs_CxNxN[i]
            if sequential and prev is not None:
                prev, x = jax.lax.optimization_barrier((prev, x))  # x is "produced" only once prev exists
            prev = _chain(x, w_NxN, m)
            outs.append(prev)
        return jnp.stack(outs)

    return jax.jit(f)


def bench_chains(c: int, m: int, n: int, iters: int) -> list[dict]:
    k1, k2 = jax.random.split(jax.random.key(0))
    xs = jax.random.normal(k1, (c, n, n), jnp.float32)
    w = jax.random.normal(k2, (n, n), jnp.float32) / n**0.5
    indep, seq = make_chains(m, False), make_chains(m, True)
    check_close("sequential vs independent chains", seq(xs, w), indep(xs, w), rtol=1e-5, atol=1e-6)
    t_ind = benchmark(indep, xs, w, warmup=2, iters=iters)
    t_seq = benchmark(seq, xs, w, warmup=2, iters=iters)
    flops = c * m * 2 * n**3
    peak, source = peak_flops("float32")
    shape = {"chains": c, "chain_len": m, "n": n, "dtype": "float32"}
    return [
        record(NAME, "chains/independent", t_ind.median_s, "s", timing=t_ind.as_dict(), **shape,
               value_per_s=flops / t_ind.median_s, peak_per_s=peak, peak_source=source),
        record(NAME, "chains/sequential", t_seq.median_s, "s", timing=t_seq.as_dict(), **shape,
               value_per_s=flops / t_seq.median_s, peak_per_s=peak, peak_source=source),
        record(NAME, "chains/sequential_over_independent", t_seq.median_s / t_ind.median_s, "x", **shape),
    ]


def _loop(step, w, host_batches, prefetch: bool):
    device = jax.devices()[0]
    t0 = time.perf_counter()
    if prefetch:
        nxt = jax.device_put(host_batches[0], device)
        for i in range(len(host_batches)):
            cur = nxt
            if i + 1 < len(host_batches):
                nxt = jax.device_put(host_batches[i + 1], device)  # the copy starts before step i is dispatched
            w = step(w, cur)
    else:
        for hb in host_batches:
            cur = jax.device_put(hb, device)
            jax.block_until_ready(cur)  # a loader that hands over a batch only once it is on the device
            w = step(w, cur)
    jax.block_until_ready(w)
    return time.perf_counter() - t0, w


def bench_prefetch(b: int, d: int, steps: int) -> list[dict]:
    rng = np.random.default_rng(0)
    host_batches = [rng.standard_normal((b, d), dtype=np.float32) for _ in range(steps)]
    step = jax.jit(lambda w_DxD, x_BxD: w_DxD + 1e-3 * (x_BxD.T @ jnp.tanh(x_BxD @ w_DxD)) / x_BxD.shape[0])
    w0 = jnp.eye(d, dtype=jnp.float32)
    _loop(step, w0, host_batches[:2], prefetch=True)  # compile and warm up
    t_plain, w_plain = _loop(step, w0, host_batches, prefetch=False)
    t_pre, w_pre = _loop(step, w0, host_batches, prefetch=True)
    check_close("prefetch vs no prefetch", w_pre, w_plain, rtol=1e-5, atol=1e-6)
    mb = b * d * 4 / 2**20
    shape = {"batch": b, "d": d, "steps": steps, "batch_MiB": round(mb, 3)}
    return [
        record(NAME, "prefetch/no_prefetch", steps / t_plain, "steps/s", **shape),
        record(NAME, "prefetch/prefetch", steps / t_pre, "steps/s", **shape),
        record(NAME, "prefetch/prefetch_over_no_prefetch", t_plain / t_pre, "x", **shape),
    ]


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="small shapes: a few seconds on CPU (CI)")
    a = p.parse_args(argv)
    big = jax.default_backend() != "cpu"
    if a.tiny:
        recs = bench_chains(c=4, m=4, n=64, iters=5) + bench_prefetch(b=256, d=128, steps=10)
    else:
        recs = (bench_chains(c=8, m=8, n=512 if big else 256, iters=20)
                + bench_prefetch(b=16384 if big else 2048, d=2048 if big else 512, steps=50))
    return [emit(r) for r in recs]


if __name__ == "__main__":
    reexec_with_huge_pages()  # XLA:CPU step buffers on huge pages (jaxperf.perf.cpu_host)
    main(sys.argv[1:])
