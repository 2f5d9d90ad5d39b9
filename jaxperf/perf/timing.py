"""Timing JAX code honestly: compile apart from run, warm-up, block_until_ready, median and spread.

    t = benchmark(f, x, y)            # f: any callable; jit it yourself or pass jit=True
    t.median_s, t.p10_s, t.p90_s, t.compile_s

JAX dispatches asynchronously: a call returns as soon as the work is queued, so a timer around a call without
`jax.block_until_ready` measures dispatch, not compute. `benchmark` blocks on every output of every timed call.
The first call of a jitted function traces and compiles; that time is reported as `compile_s` (for a `jax.jit`
function we lower and compile ahead of time, so it is compile only) and never mixed into the run times.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class Timing:
    """Wall-clock seconds per call, over `iters` timed calls after `warmup` untimed ones."""

    times_s: tuple[float, ...]
    compile_s: float | None  # lower + compile (None when `fn` is not a jitted function and jit=False)
    warmup: int

    @property
    def iters(self) -> int:
        return len(self.times_s)

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)

    @property
    def mean_s(self) -> float:
        return statistics.fmean(self.times_s)

    @property
    def min_s(self) -> float:
        return min(self.times_s)

    @property
    def p10_s(self) -> float:
        return float(np.percentile(self.times_s, 10))

    @property
    def p90_s(self) -> float:
        return float(np.percentile(self.times_s, 90))

    @property
    def spread(self) -> float:
        """(p90 - p10) / median: how noisy the measurement is."""
        return (self.p90_s - self.p10_s) / self.median_s if self.median_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "median_s": self.median_s,
            "p10_s": self.p10_s,
            "p90_s": self.p90_s,
            "min_s": self.min_s,
            "iters": self.iters,
            "warmup": self.warmup,
            "compile_s": self.compile_s,
        }


def _is_jitted(fn) -> bool:
    return hasattr(fn, "lower") and callable(getattr(fn, "lower"))


def benchmark(
    fn: Callable, *args, warmup: int = 2, iters: int = 20, jit: bool = False, min_time_s: float = 0.0, **kwargs
) -> Timing:
    """Time `fn(*args, **kwargs)`.

    warmup: untimed calls after compilation (caches, allocator, autotuning).
    iters: timed calls (at least 1); with `min_time_s`, more calls are made until their total reaches it.
    jit: wrap `fn` in `jax.jit` first. A jitted `fn` is compiled ahead of time and the compiled executable is timed.
    """
    if iters < 1:
        raise ValueError(f"iters={iters}: need at least one timed call")
    if jit:
        fn = jax.jit(fn)
    compile_s = None
    if _is_jitted(fn):
        t0 = time.perf_counter()
        compiled = fn.lower(*args, **kwargs).compile()
        compile_s = time.perf_counter() - t0
        call = lambda: compiled(*args, **kwargs)  # noqa: E731
    else:
        call = lambda: fn(*args, **kwargs)  # noqa: E731
    for _ in range(warmup):
        jax.block_until_ready(call())
    times: list[float] = []
    total = 0.0
    while len(times) < iters or total < min_time_s:
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        dt = time.perf_counter() - t0
        times.append(dt)
        total += dt
    return Timing(tuple(times), compile_s, warmup)
