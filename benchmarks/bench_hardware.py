"""How close do simple programs get to the device's limits? Matmul FLOP/s, memory bandwidth, host <-> device copies.

    python benchmarks/bench_hardware.py
    python benchmarks/bench_hardware.py --tiny
    python benchmarks/bench_hardware.py --sizes 1024 4096 8192 --dtypes bfloat16

- matmul: n x n @ n x n for each size and dtype; 2 n^3 FLOPs; % of the peak of that dtype (jaxperf.perf.hardware:
  the data sheet for known accelerators, a measured fp32 probe on CPUs). Small n is limited by memory and launch cost,
  large n should approach the peak: the roofline in miniature. Each record carries its FLOPs and bytes for a roofline.
- memory: `y = x + 1` (reads and writes every byte: 2 x size of traffic) and `sum(x)` (reads every byte once) on an
  fp32 array; GB/s and % of the HBM bandwidth where the chip is in the table (none is claimed for CPUs).
- transfers: `jax.device_put` of a host array (host -> device) and `np.asarray` of a fresh device array (device ->
  host), GB/s. On CPU the "device" is host memory: copies are memcpy-speed or even aliased.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxperf.perf.cpu_host import reexec_with_huge_pages
from jaxperf.benchmarks._common import check_close, emit, peak_bandwidth, peak_flops, record
from jaxperf.perf.timing import benchmark

NAME = "hardware"


def bench_matmul(sizes: list[int], dtypes: list[str], iters: int) -> list[dict]:
    out = []
    for dtype in dtypes:
        peak, source = peak_flops(dtype)
        f = jax.jit(lambda a, b: a @ b)
        for n in sizes:
            ka, kb = jax.random.split(jax.random.key(n))
            a = jax.random.normal(ka, (n, n), jnp.float32).astype(dtype)
            b = jax.random.normal(kb, (n, n), jnp.float32).astype(dtype)
            if n <= 1024:  # the check itself costs a float64 matmul on the host
                tol = 2e-2 if dtype != "float32" else 1e-3
                ref = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
                check_close(f"matmul {dtype} n={n}", np.asarray(f(a, b), np.float64) / n**0.5, ref / n**0.5,
                            rtol=tol, atol=tol)
            t = benchmark(f, a, b, warmup=2, iters=iters)
            flops = 2 * n**3
            nbytes = 3 * n * n * jnp.dtype(dtype).itemsize
            out.append(record(NAME, f"matmul/{dtype}/n{n}", flops / t.median_s / 1e12, "TFLOP/s", peak=peak / 1e12,
                              peak_source=source, dtype=dtype, n=n, timing=t.as_dict(),
                              roofline={"flops": flops, "bytes": nbytes, "time_s": t.median_s, "dtype": dtype}))
    return out


def bench_memory(nbytes: int, iters: int) -> list[dict]:
    n = nbytes // 4
    x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
    peak, source = peak_bandwidth()
    copy = jax.jit(lambda v: v + 1.0)
    reduce = jax.jit(lambda v: jnp.sum(v))
    check_close("reduction", reduce(x), np.sum(np.asarray(x, np.float64)), rtol=1e-3, atol=1e-2 * n**0.5)
    out = []
    for name, fn, traffic, flops in (("copy", copy, 2 * n * 4, n), ("reduce", reduce, n * 4, n)):
        t = benchmark(fn, x, warmup=2, iters=iters)
        gbs = traffic / t.median_s / 1e9
        out.append(record(NAME, f"memory/{name}", gbs, "GB/s", peak=peak / 1e9 if peak else None,
                          peak_source=source, bytes=traffic, array_MiB=nbytes / 2**20, timing=t.as_dict(),
                          roofline={"flops": flops, "bytes": traffic, "time_s": t.median_s, "dtype": "float32"}))
    return out


def bench_transfers(nbytes: int, iters: int) -> list[dict]:
    n = nbytes // 4
    host = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
    device = jax.devices()[0]
    h2d = []
    for _ in range(iters + 1):
        t0 = time.perf_counter()
        jax.block_until_ready(jax.device_put(host, device))
        h2d.append(time.perf_counter() - t0)
    make = jax.jit(lambda v, i: v * i)
    src = jax.device_put(host, device)
    fresh = [make(src, float(i + 1)) for i in range(iters + 1)]  # distinct arrays: nothing cached on the host side
    jax.block_until_ready(fresh)
    d2h = []
    for i, arr in enumerate(fresh):
        t0 = time.perf_counter()
        back = np.asarray(arr)
        d2h.append(time.perf_counter() - t0)
        if i == 0:
            check_close("device to host", back[:1000], host[:1000] * 1.0, rtol=1e-6)
    out = []
    for name, times in (("host_to_device", h2d[1:]), ("device_to_host", d2h[1:])):
        med = float(np.median(times))
        extra = {"note": "CPU: device memory is host memory; device->host may alias instead of copying"} \
            if jax.default_backend() == "cpu" else {}
        out.append(record(NAME, f"transfer/{name}", nbytes / med / 1e9, "GB/s", bytes=nbytes, median_s=med,
                          iters=len(times), **extra))
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="small shapes: a few seconds on CPU (CI)")
    p.add_argument("--sizes", type=int, nargs="*", default=None, help="matmul sizes n")
    p.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"])
    p.add_argument("--iters", type=int, default=None)
    a = p.parse_args(argv)
    big = jax.default_backend() != "cpu"
    if a.tiny:
        sizes, mem, iters = a.sizes or [64, 256], 4 * 2**20, a.iters or 3
    elif big:
        sizes, mem, iters = a.sizes or [1024, 2048, 4096, 8192], 1024 * 2**20, a.iters or 20
    else:
        sizes, mem, iters = a.sizes or [256, 512, 1024], 256 * 2**20, a.iters or 5
    for d in a.dtypes:
        if d not in ("float32", "bfloat16", "float16"):
            raise SystemExit(f"--dtypes: {d!r} is not one of float32, bfloat16, float16")
    recs = bench_matmul(sizes, a.dtypes, iters) + bench_memory(mem, iters) + bench_transfers(mem, iters)
    return [emit(r) for r in recs]


if __name__ == "__main__":
    reexec_with_huge_pages()  # XLA:CPU step buffers on huge pages (jaxperf.perf.cpu_host)
    main(sys.argv[1:])
