"""What every benchmark script shares: one JSON record per measurement, with the context needed to compare runs.

    rec = record("hardware", "matmul", 12.3, "TFLOP/s", peak=989e12, value_per_s=12.3e12, dtype="bfloat16")
    emit(rec)        # one JSON line on stdout

A record always carries the device kind, platform, number of devices, jax/flax versions, whether host memory had
transparent huge pages (jaxperf.perf.cpu_host) and the date, so a results.jsonl collected on several machines stays
readable. `pct_of_peak` is present only where a hardware limit is known (jaxperf.perf.hardware): a figure without a
ceiling is not given a made-up one.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import platform
from typing import Any

import flax
import jax
import numpy as np

from jaxperf.config import get_config, validate
from jaxperf.step.flavours import build_train_step
from jaxperf.parallel.mesh import make_mesh
from jaxperf.perf.hardware import chip_for
from jaxperf.perf.hardware import peak_flops as _peak
from jaxperf.perf.cpu_host import host_memory
from jaxperf.step.task import build_task, step_microbatches


def context() -> dict[str, Any]:
    """Device, platform, device count, versions and date: the part of a record that says where it was measured."""
    devices = jax.devices()
    return {
        "device": devices[0].device_kind,
        "platform": jax.default_backend(),
        "n_devices": len(devices),
        "versions": {"jax": jax.__version__, "flax": flax.__version__, "python": platform.python_version()},
        "host_huge_pages": host_memory().huge_pages,  # XLA:CPU figures depend on it (jaxperf.perf.cpu_host)
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def record(benchmark: str, name: str, value: float | None, unit: str, *, peak: float | None = None,
           peak_per_s: float | None = None, value_per_s: float | None = None, **extra: Any) -> dict[str, Any]:
    """One measurement.

    Args:
      benchmark: the script's question (e.g. "hardware").
      name: what was measured (e.g. "matmul_bf16_n4096").
      value, unit: the figure as reported (e.g. 312.5, "TFLOP/s"). None only for records that carry an error.
      peak: the hardware limit in the same unit as `value`; adds pct_of_peak.
      peak_per_s, value_per_s: the same in base units (FLOP/s, bytes/s) when that is easier; used when `peak` is None.
      extra: anything else worth keeping (sizes, dtype, timings, the peak's source).
    """
    rec: dict[str, Any] = {"benchmark": benchmark, "name": name, "value": value, "unit": unit, **context()}
    pct = None
    if value is not None and peak:
        pct = 100.0 * value / peak
    elif value_per_s is not None and peak_per_s:
        pct = 100.0 * value_per_s / peak_per_s
    if pct is not None:
        rec["pct_of_peak"] = round(pct, 3)
    rec.update(extra)
    return rec


def strict_json(x):
    """NaN and inf become None (recursively), so every line of results.jsonl is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: strict_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [strict_json(v) for v in x]
    return x


def emit(rec: dict[str, Any]) -> dict[str, Any]:
    """Print a record as one JSON line (NaN/inf become null, so every line is strict JSON) and return it."""
    print(json.dumps(strict_json(rec)), flush=True)
    return rec


def peak_flops(dtype: str) -> tuple[float, str]:
    """(peak FLOP/s per device, source) from jaxperf.perf.hardware."""
    return _peak(dtype)


def peak_bandwidth() -> tuple[float | None, str]:
    """(memory bytes/s per device, source): the data sheet's HBM figure for known chips; None elsewhere.

    A measured CPU figure is not used as a ceiling here: a bandwidth benchmark compared with a probe of itself would
    report ~100% whatever the memory system can do.
    """
    chip = chip_for()
    if chip is None:
        return None, "unknown"
    return chip.hbm_bw, f"table:{chip.name}"


def check_close(name: str, got, want, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """Refuse to time a variant whose result disagrees with the reference (a fast wrong answer is no result)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape or not np.allclose(got, want, rtol=rtol, atol=atol):
        err = float(np.max(np.abs(got - want))) if got.shape == want.shape else float("nan")
        raise RuntimeError(f"{name}: result differs from the reference (shapes {got.shape} vs {want.shape}, max abs "
                           f"diff {err:.3g}, rtol={rtol}, atol={atol}); not timing a wrong answer")


def _same_layout(state: Any, task) -> bool:
    """Whether `state` has the tree, shapes and dtypes of the task's TrainState."""
    want = jax.eval_shape(task.init_state)
    got_leaves, got_tree = jax.tree.flatten(state)
    want_leaves, want_tree = jax.tree.flatten(want)
    return got_tree == want_tree and all(
        np.shape(g) == w.shape and np.result_type(g) == w.dtype for g, w in zip(got_leaves, want_leaves))


def make_train_step(preset: str = "tiny", overrides: list[str] | None = None, *, donate: bool = True, seed: int = 0,
                    init: Any = None):
    """The jaxperf train step of a preset, its initial state and one random batch (tokens do not change the cost).

    Returns (step, state, batch, cfg); `step` is `(state, batch) -> (state, metrics)` over all visible devices with
    the preset's strategy: the jitted Task step for `parallel.flavour=jit`, else the flavour's step from
    jaxperf.explicit.flavours (with `state` already in its layout). `init`: a TrainState to start from instead of a
    fresh one (e.g. another layout's initial state fetched to the host), placed in this step's shards; used only
    where its leaves have this task's shapes and dtypes, so a caller can offer it to every variant of a preset and
    skip compiling the initialisation again.
    """
    cfg = dataclasses.replace(get_config(preset, overrides or []), seed=seed)
    validate(cfg, jax.device_count())
    task = build_task(cfg, make_mesh(cfg.parallel))
    initial = task.init_state() if init is None or not _same_layout(init, task) else jax.device_put(
        init, task.state_shardings())
    if cfg.parallel.flavour == "jit":  # the jitted function itself, so callers can lower and compile it
        step, state = task.train_step(microbatches=step_microbatches(cfg), donate=donate), initial
    else:
        step = build_train_step(task, task.loss_fn, cfg.parallel.flavour, microbatches=step_microbatches(cfg),
                                donate=donate, overlap_grad_reduce=cfg.parallel.overlap_grad_reduce)
        state = step.to_step(initial)
    B, L = cfg.batch_size, cfg.train_seq_len
    tokens = np.random.default_rng(seed).integers(0, cfg.model.vocab_size, (B, L + 1)).astype(np.int32)
    batch = jax.device_put(
        {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": np.ones((B, L), np.float32)}, task.batch_sharding()
    )
    return step, state, batch, cfg
