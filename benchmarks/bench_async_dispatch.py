"""What does asynchronous dispatch hide? Host time per call vs device time, and a loop that syncs vs one that does not.

    python benchmarks/bench_async_dispatch.py
    python benchmarks/bench_async_dispatch.py --tiny

A jitted call returns as soon as its work is queued; the host is free until something reads a result. Two questions:

- chain: k calls `x = f(x)` in a row. `dispatch_s` is the host time until the k-th call returns, `device_s` the time
  until its result is ready (block_until_ready). dispatch << device means the host ran ahead of the device.
- loop: a training-like loop where the host also prepares the next batch (numpy work, like a data loader) each step.
  `sync` reads the loss with float() right after each step, so host work and device work take turns; `lagged` reads
  step n-1's loss after dispatching step n (as jaxperf's Trainer does), so they overlap. Both step rates are reported.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxperf.perf.cpu_host import reexec_with_huge_pages
from jaxperf.benchmarks._common import emit, record

NAME = "async_dispatch"


def bench_chain(n: int, k: int, repeats: int) -> list[dict]:
    f = jax.jit(lambda x_NxN: jnp.tanh(x_NxN @ x_NxN) * 0.5)
    x0 = jax.random.normal(jax.random.key(0), (n, n), jnp.float32) / n**0.5
    jax.block_until_ready(f(x0))
    dispatch, device = [], []
    for _ in range(repeats):
        x = x0
        t0 = time.perf_counter()
        for _ in range(k):
            x = f(x)
        t1 = time.perf_counter()
        jax.block_until_ready(x)
        t2 = time.perf_counter()
        dispatch.append((t1 - t0) / k)
        device.append((t2 - t0) / k)
    d_s, dev_s = float(np.median(dispatch)), float(np.median(device))
    shape = {"n": n, "chain": k, "repeats": repeats}
    return [
        record(NAME, "chain/dispatch_per_call", d_s, "s", **shape),
        record(NAME, "chain/device_per_call", dev_s, "s", **shape),
        record(NAME, "chain/device_over_dispatch", dev_s / d_s, "x", **shape),
    ]


def _make_step(d: int):
    def loss_fn(w_DxD, x_BxD, y_BxD):
        return jnp.mean(jnp.square(jnp.tanh(x_BxD @ w_DxD) @ w_DxD - y_BxD))

    @jax.jit
    def step(w_DxD, x_BxD, y_BxD):
        loss, g = jax.value_and_grad(loss_fn)(w_DxD, x_BxD, y_BxD)
        return w_DxD - 0.01 * g, loss

    return step


def _host_batch(rng: np.random.Generator, b: int, d: int, host_work: int):
    # Stand-in for a data loader: real numpy work of a size chosen to be comparable to the device step.
    x = rng.standard_normal((b, d), dtype=np.float32)
    for _ in range(host_work):
        x = np.tanh(x) + 0.1 * rng.standard_normal((b, d), dtype=np.float32)
    return x, np.roll(x, 1, axis=1)


def _run_loop(step, w, b, d, steps, host_work, lagged: bool) -> tuple[float, list[float]]:
    rng = np.random.default_rng(0)
    losses: list[float] = []
    pending = None
    x, y = _host_batch(rng, b, d, host_work)
    t0 = time.perf_counter()
    for _ in range(steps):
        w, loss = step(w, x, y)
        if lagged:
            if pending is not None:
                losses.append(float(pending))  # the previous step's loss: long finished, or nearly
            pending = loss
        else:
            losses.append(float(loss))  # waits for this step before the host may go on
        x, y = _host_batch(rng, b, d, host_work)
    if pending is not None:
        losses.append(float(pending))
    return time.perf_counter() - t0, losses


def bench_loop(b: int, d: int, steps: int, host_work: int) -> list[dict]:
    step = _make_step(d)
    w0 = jax.random.normal(jax.random.key(1), (d, d), jnp.float32) / d**0.5
    x, y = _host_batch(np.random.default_rng(0), b, d, host_work)
    jax.block_until_ready(step(w0, x, y))
    _run_loop(step, w0, b, d, 2, host_work, lagged=True)  # warm-up: transfers, allocator
    t_sync, l_sync = _run_loop(step, w0, b, d, steps, host_work, lagged=False)
    t_lag, l_lag = _run_loop(step, w0, b, d, steps, host_work, lagged=True)
    if not np.allclose(l_sync, l_lag, rtol=1e-5):
        raise RuntimeError(f"the synced and lagged loops disagree on the losses ({l_sync[:3]} vs {l_lag[:3]}): the "
                           "lagged read must only change when the loss is read, not what it is")
    shape = {"batch": b, "d": d, "steps": steps, "host_work": host_work}
    return [
        record(NAME, "loop/sync_every_step", steps / t_sync, "steps/s", **shape),
        record(NAME, "loop/lagged_metrics", steps / t_lag, "steps/s", **shape),
        record(NAME, "loop/lagged_over_sync", t_sync / t_lag, "x", **shape),
    ]


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="small shapes: a few seconds on CPU (CI)")
    a = p.parse_args(argv)
    if a.tiny:
        recs = bench_chain(n=128, k=20, repeats=3) + bench_loop(b=64, d=128, steps=20, host_work=2)
    else:
        big = jax.default_backend() != "cpu"
        recs = (bench_chain(n=4096 if big else 512, k=50, repeats=5)
                + bench_loop(b=4096 if big else 256, d=2048 if big else 512, steps=100, host_work=4))
    return [emit(r) for r in recs]


if __name__ == "__main__":
    reexec_with_huge_pages()  # XLA:CPU step buffers on huge pages (jaxperf.perf.cpu_host)
    main(sys.argv[1:])
