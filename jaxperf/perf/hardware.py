"""What the devices we run on can do: a table for known accelerators, a measured probe for the rest.

    peak, source = peak_flops("bfloat16")      # per device; source "table:H100 SXM" or "measured"
    d = describe()                              # kind, platform, count, peaks, HBM, bandwidths, and where each came from
    print(format_info(d))                       # the hardware part of `jaxperf info`

Table figures are dense (no 2:4 sparsity) per chip, from the vendors' data sheets. NVIDIA quotes bandwidths in
decimal units (3.35 TB/s = 3.35e12 B/s) and NVLink as the sum of both directions; `interconnect_bw` here is one
direction, the figure a ring all-reduce runs at. Google quotes ICI per chip in Gbps over all links.

CPUs (and any device the table does not know) get measured figures instead: the best FLOP/s of a few fp32 n x n
matmuls, and the memory bandwidth of a large array copy. They are lower bounds of the real peaks, which is what a
roofline on a CPU needs (the ridge point between the two is where the measured machine really turns compute-bound).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class Chip:
    """Per-chip peaks. FLOP/s are dense; bytes/s are decimal; `hbm_bytes` is the capacity the runtime reports."""

    name: str
    bf16_flops: float  # dense bf16 FLOP/s on the matrix units
    fp32_flops: float  # GPUs: fp32 without TF32. TPUs: the bf16 rate (XLA's default precision runs fp32 as bf16 passes)
    fp8_flops: float | None  # dense fp8 FLOP/s (None where the chip has no fp8 matrix unit)
    hbm_bytes: float
    hbm_bw: float  # bytes/s
    interconnect_bw: float  # bytes/s per chip, one direction (NVLink / ICI; PCIe where no NVLink)
    int8_ops: float | None = None  # dense int8 OP/s
    platform: str = "tpu"  # "gpu": its kernels run one after another (jaxperf.perf.predict times them so)


T, G, GiB = 1e12, 1e9, 2**30


def _gpu(*args: Any) -> Chip:
    return Chip(*args, platform="gpu")


# Matched against jax.Device.device_kind: every substring of a key must appear (case-insensitive); first hit wins, so
# the more specific keys come first. Known device_kind strings: "NVIDIA H100 80GB HBM3" (SXM), "NVIDIA H100 PCIe",
# "NVIDIA H200", "NVIDIA A100-SXM4-40GB", "NVIDIA A100 80GB PCIe", "NVIDIA L4", "TPU v4", "TPU v5 lite" (v5e),
# "TPU v5" / "TPU v5p", "TPU v6 lite" (v6e).
CHIPS: tuple[tuple[tuple[str, ...], Chip], ...] = (
    # H100 PCIe: HBM2e 2.0 TB/s, PCIe Gen5 x16 (64 GB/s each way).
    (("H100", "PCIe"), _gpu("H100 PCIe", 756 * T, 51 * T, 1513 * T, 80 * GiB, 2.0e12, 64 * G, 1513 * T)),
    # H100 SXM: HBM3 3.35 TB/s, NVLink 4 900 GB/s both ways.
    (("H100",), _gpu("H100 SXM", 989 * T, 67 * T, 1979 * T, 80 * GiB, 3.35e12, 450 * G, 1979 * T)),
    # H200 SXM: same compute as H100 SXM, 141 GB HBM3e (nvidia-smi: 143771 MiB) at 4.8 TB/s.
    (("H200",), _gpu("H200 SXM", 989 * T, 67 * T, 1979 * T, 143771 * 2**20, 4.8e12, 450 * G, 1979 * T)),
    # A100: no fp8; 40GB HBM2 1.555 TB/s, 80GB HBM2e 2.039 TB/s (SXM; PCIe 1.935), NVLink 3 600 GB/s both ways.
    (("A100", "40GB"), _gpu("A100 40GB", 312 * T, 19.5 * T, None, 40 * GiB, 1.555e12, 300 * G, 624 * T)),
    (("A100", "PCIe"), _gpu("A100 80GB PCIe", 312 * T, 19.5 * T, None, 80 * GiB, 1.935e12, 300 * G, 624 * T)),
    (("A100",), _gpu("A100 80GB", 312 * T, 19.5 * T, None, 80 * GiB, 2.039e12, 300 * G, 624 * T)),
    # L4: 24 GB GDDR6 at 300 GB/s, PCIe Gen4 x16 (32 GB/s each way). Data sheet figures with sparsity are twice these.
    (("L4",), _gpu("L4", 121 * T, 30.3 * T, 242 * T, 24 * GiB, 0.3e12, 32 * G, 242 * T)),
    # TPUs: int8 but no fp8 matrix units up to v6e. ICI per chip (`interconnect_bw`: all links of a chip, one
    # direction; jaxperf.perf.predict divides collective bytes by it), from Google Cloud's TPU pages
    # (cloud.google.com/tpu/docs/<version>): v4 2400 Gbps (6 links), v5e 1600 Gbps (4 ports), v5p 4800 Gbps (6
    # links; the same page now also gives "bidirectional ICI bandwidth per chip 1200 GBps", i.e. 600 GB/s each way,
    # which is how the Gbps figures are read here), v6e 3584 Gbps (4 ports). Bytes/s = Gbps / 8.
    (("TPU v4",), Chip("TPU v4", 275 * T, 275 * T, None, 32 * GiB, 1.2e12, 300 * G, 275 * T)),
    (("TPU v5 lite",), Chip("TPU v5e", 197 * T, 197 * T, None, 16 * GiB, 0.819e12, 200 * G, 394 * T)),
    (("TPU v5e",), Chip("TPU v5e", 197 * T, 197 * T, None, 16 * GiB, 0.819e12, 200 * G, 394 * T)),
    (("TPU v5",), Chip("TPU v5p", 459 * T, 459 * T, None, 95 * GiB, 2.765e12, 600 * G, 918 * T)),
    (("TPU v6",), Chip("TPU v6e", 918 * T, 918 * T, None, 32 * GiB, 1.64e12, 448 * G, 1836 * T)),
)


def chip_for(device: jax.Device | None = None) -> Chip | None:
    """The table entry for a device (default: the first device), or None when unknown (CPUs)."""
    kind = (device or jax.devices()[0]).device_kind.lower()
    for keys, chip in CHIPS:
        if all(k.lower() in kind for k in keys):
            return chip
    return None


def _best_seconds(f, x, repeats: int) -> float:
    jax.block_until_ready(f(x))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        best = min(best, time.perf_counter() - t0)
    return best


@functools.lru_cache(maxsize=None)
def measured_flops(dtype: str = "float32", n: int = 1024, repeats: int = 5) -> float:
    """A quick matmul probe on the first device: best FLOP/s over a few n x n products."""
    x = jnp.ones((n, n), dtype)
    return 2 * n**3 / _best_seconds(jax.jit(lambda a: a @ a), x, repeats)


@functools.lru_cache(maxsize=None)
def measured_bandwidth(nbytes: int = 64 * 2**20, repeats: int = 5) -> float:
    """A quick memory probe on the first device: the better of `y = x * 2` (reads and writes every byte: 2 * nbytes of
    traffic) and `sum(x)` (reads every byte once) over an fp32 array of `nbytes`, in bytes/s.

    Both do about one operation per 4-8 bytes, so they are bound by memory on every machine; the reduction writes
    nothing, so on a CPU it is not slowed by the page faults of a freshly allocated output. 64 MiB is well past the
    last-level caches of current CPUs.
    """
    n = nbytes // 4
    x = jnp.ones((n,), jnp.float32)
    scale = 2 * n * 4 / _best_seconds(jax.jit(lambda a: a * 2.0), x, repeats)
    reduce = n * 4 / _best_seconds(jax.jit(jnp.sum), x, repeats)
    return max(scale, reduce)


def peak_flops(dtype: str = "bfloat16", device: jax.Device | None = None) -> tuple[float, str]:
    """(peak FLOP/s per device, where the number came from: "table:<chip>" or "measured")."""
    chip = chip_for(device)
    if chip is not None:
        if dtype == "float32":
            return chip.fp32_flops, f"table:{chip.name}"
        if dtype in ("float8_e4m3fn", "float8_e5m2", "fp8") and chip.fp8_flops:
            return chip.fp8_flops, f"table:{chip.name}"
        return chip.bf16_flops, f"table:{chip.name}"
    # CPUs run bf16 matmuls no faster than fp32; the fp32 probe is the honest ceiling for both.
    return measured_flops("float32"), "measured"


def peak_bandwidth(device: jax.Device | None = None) -> tuple[float, str]:
    """(memory bandwidth in bytes/s per device, "table:<chip>" or "measured")."""
    chip = chip_for(device)
    if chip is not None:
        return chip.hbm_bw, f"table:{chip.name}"
    return measured_bandwidth(), "measured"


def describe(device: jax.Device | None = None) -> dict[str, Any]:
    """Everything known about the device (default: the first) as a flat, JSON-friendly dict.

    Keys: kind, platform, count (devices of this kind visible to the process), local_count, name (table name or
    None), source ("table" or "measured"), bf16_flops, fp32_flops, fp8_flops, int8_ops, hbm_bytes, hbm_bw,
    interconnect_bw (None where unknown). Measured entries fill fp32_flops, bf16_flops (= the fp32 probe) and hbm_bw.
    """
    device = device or jax.devices()[0]
    same = [d for d in jax.devices() if d.device_kind == device.device_kind]
    out: dict[str, Any] = {
        "kind": device.device_kind,
        "platform": device.platform,
        "count": len(same),
        "local_count": len([d for d in same if d.process_index == jax.process_index()]),
    }
    chip = chip_for(device)
    if chip is not None:
        out.update(name=chip.name, source="table", bf16_flops=chip.bf16_flops, fp32_flops=chip.fp32_flops,
                   fp8_flops=chip.fp8_flops, int8_ops=chip.int8_ops, hbm_bytes=chip.hbm_bytes, hbm_bw=chip.hbm_bw,
                   interconnect_bw=chip.interconnect_bw)
    else:
        flops = measured_flops("float32")
        out.update(name=None, source="measured", bf16_flops=flops, fp32_flops=flops, fp8_flops=None, int8_ops=None,
                   hbm_bytes=None, hbm_bw=measured_bandwidth(), interconnect_bw=None)
    return out


def _fmt(value: float | None, unit: float, suffix: str, digits: int = 1) -> str:
    if value is None:
        return "n/a"
    if unit == T and value < 1e11:  # CPUs: GFLOP/s reads better than 0.0 TFLOP/s
        return f"{value / G:.{digits}f} G{suffix[1:]}"
    return f"{value / unit:.{digits}f} {suffix}"


def format_info(d: dict[str, Any]) -> str:
    """A few human lines for a `describe()` dict (the hardware section of `jaxperf info`)."""
    head = f"{d['count']} x {d['kind']} ({d['platform']})"
    if d["source"] == "table":
        head += f" = {d['name']} from the hardware table"
    else:
        head += ": not in the hardware table, figures measured on this machine"
    lines = [head]
    lines.append(f"  peak: bf16 {_fmt(d['bf16_flops'], T, 'TFLOP/s')}, fp32 {_fmt(d['fp32_flops'], T, 'TFLOP/s')}, "
                 f"fp8 {_fmt(d['fp8_flops'], T, 'TFLOP/s')}")
    lines.append(f"  memory: {_fmt(d['hbm_bytes'], GiB, 'GiB')} at {_fmt(d['hbm_bw'], 1e9, 'GB/s')}; "
                 f"interconnect {_fmt(d['interconnect_bw'], 1e9, 'GB/s')} per direction")
    if d["hbm_bw"]:
        lines.append(f"  ridge point (bf16): {d['bf16_flops'] / d['hbm_bw']:.0f} FLOP/byte: "
                     "kernels below it are memory-bound")
    return "\n".join(lines)
