"""Peak throughput of the devices we run on: a table for known accelerators, a measured probe for the rest.

Figures are dense (no sparsity) per chip, from the vendors' data sheets. `peak_flops()` is what MFU divides by.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class Chip:
    name: str
    bf16_flops: float  # dense bf16 FLOP/s
    fp32_flops: float  # fp32 FLOP/s without TF32 tricks (TPUs: the bf16 passes XLA uses by default)
    fp8_flops: float | None
    hbm_bytes: float
    hbm_bw: float  # bytes/s
    interconnect_bw: float  # bytes/s per chip, one direction (NVLink / ICI)


T, G = 1e12, 1e9
# Matched against jax.Device.device_kind, first hit wins (so the longer names come first).
CHIPS: tuple[tuple[str, Chip], ...] = (
    ("H100 PCIe", Chip("H100 PCIe", 756 * T, 51 * T, 1513 * T, 80 * 2**30, 2.0e12, 64 * G)),
    ("H100", Chip("H100 SXM", 989 * T, 67 * T, 1979 * T, 80 * 2**30, 3.35e12, 450 * G)),
    ("H200", Chip("H200 SXM", 989 * T, 67 * T, 1979 * T, 141 * 2**30, 4.8e12, 450 * G)),
    ("A100-SXM4-40GB", Chip("A100 40GB", 312 * T, 19.5 * T, None, 40 * 2**30, 1.555e12, 300 * G)),
    ("A100", Chip("A100 80GB", 312 * T, 19.5 * T, None, 80 * 2**30, 2.039e12, 300 * G)),
    ("L4", Chip("L4", 121 * T, 30.3 * T, 242 * T, 24 * 2**30, 0.3e12, 32 * G)),
    ("TPU v4", Chip("TPU v4", 275 * T, 275 * T, None, 32 * 2**30, 1.2e12, 270 * G)),
    ("TPU v5 lite", Chip("TPU v5e", 197 * T, 197 * T, 394 * T, 16 * 2**30, 0.819e12, 200 * G)),
    ("TPU v5e", Chip("TPU v5e", 197 * T, 197 * T, 394 * T, 16 * 2**30, 0.819e12, 200 * G)),
    ("TPU v5", Chip("TPU v5p", 459 * T, 459 * T, 918 * T, 95 * 2**30, 2.765e12, 600 * G)),
    ("TPU v6", Chip("TPU v6e", 918 * T, 918 * T, 1836 * T, 32 * 2**30, 1.64e12, 400 * G)),
)


def chip_for(device: jax.Device | None = None) -> Chip | None:
    """The table entry for a device, or None when unknown (CPUs)."""
    kind = (device or jax.devices()[0]).device_kind
    for key, chip in CHIPS:
        if key.lower() in kind.lower():
            return chip
    return None


@functools.lru_cache(maxsize=None)
def measured_flops(dtype: str = "float32", n: int = 1024, repeats: int = 5) -> float:
    """A quick matmul probe on the first device: best FLOP/s over a few n x n products."""
    x = jnp.ones((n, n), dtype)
    f = jax.jit(lambda a: a @ a)
    f(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def peak_flops(dtype: str = "bfloat16", device: jax.Device | None = None) -> tuple[float, str]:
    """(peak FLOP/s per device, where the number came from: the table or a measurement)."""
    chip = chip_for(device)
    if chip is not None:
        return (chip.fp32_flops if dtype == "float32" else chip.bf16_flops), f"table:{chip.name}"
    # CPUs run bf16 matmuls no faster than fp32; the fp32 probe is the honest ceiling for both.
    return measured_flops("float32"), "measured"
