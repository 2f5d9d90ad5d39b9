"""The roofline model: is a program limited by the device's arithmetic or by its memory bandwidth?

    p = analyze(jax.jit(f), x, y)                       # XLA's FLOP and byte counts of the compiled program
    p = analyze(jax.jit(f), x, y, time_s=t.median_s)    # ... plus the measured time: achieved FLOP/s, % of attainable
    plot([p1, p2], "roofline.png")                      # log-log chart with the device's roof and the points

A program that does F FLOPs while moving B bytes between memory and the chip has arithmetic intensity I = F / B. The
device can do at most `peak_flops` per second and move at most `peak_bw` bytes per second, so the best it can reach is
min(peak_flops, I * peak_bw). The intensity where the two limits meet, peak_flops / peak_bw, is the ridge point: a
program left of it is memory-bound (a faster matmul unit would not help), right of it compute-bound.

The counts come from XLA's cost analysis of the compiled program (per device for a sharded program). `bytes accessed`
is XLA's estimate of the traffic of each fused operation's operands and results; data reused from caches or kept in
registers across a fusion does not count, so it is the traffic to main memory a good schedule would have. Two known
limits of the counts: a `lax.scan`/`while` body is counted once rather than once per iteration, and custom calls
(cuDNN, Pallas kernels) count zero FLOPs. For the built-in GPT use jaxperf.perf.flops for the model's true count.

The peaks default to the device's (jaxperf.perf.hardware: the data sheet for known accelerators, a measured probe on
CPUs); pass a `DeviceSpec` to analyse against another device or a fixed synthetic one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

import jax

from jaxperf.perf import hardware


@dataclass(frozen=True)
class DeviceSpec:
    """The two roofs: peak FLOP/s and memory bytes/s of one device."""

    name: str
    peak_flops: float
    peak_bw: float

    @property
    def ridge(self) -> float:
        """FLOP per byte where the memory roof meets the compute roof."""
        return self.peak_flops / self.peak_bw

    @classmethod
    def for_device(cls, dtype: str = "bfloat16", device: jax.Device | None = None) -> "DeviceSpec":
        """The spec of a real device from jaxperf.perf.hardware (table or measured)."""
        flops, fsrc = hardware.peak_flops(dtype, device)
        bw, _ = hardware.peak_bandwidth(device)
        kind = (device or jax.devices()[0]).device_kind
        return cls(f"{kind} ({fsrc}, {dtype})", flops, bw)


@dataclass(frozen=True)
class RooflinePoint:
    """One program on the roofline. FLOPs and bytes are per device, per call."""

    name: str
    flops: float
    bytes_accessed: float
    intensity: float  # FLOP / byte
    attainable_flops: float  # min(peak_flops, intensity * peak_bw)
    bound: str  # "compute" or "memory"
    device: DeviceSpec
    time_s: float | None = None
    achieved_flops: float | None = None  # flops / time_s
    fraction_of_attainable: float | None = None  # achieved / attainable (1.0 = on the roof)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["device"] = asdict(self.device)
        return d

    def __str__(self) -> str:
        s = (f"{self.name}: {self.flops:.3g} FLOP, {self.bytes_accessed:.3g} B, {self.intensity:.2f} FLOP/B "
             f"({self.bound}-bound; ridge {self.device.ridge:.1f}), attainable {self.attainable_flops / 1e12:.3g} "
             "TFLOP/s")
        if self.achieved_flops is not None:
            s += f", achieved {self.achieved_flops / 1e12:.3g} TFLOP/s = {100 * self.fraction_of_attainable:.1f}%"
        return s


def cost_analysis(compiled) -> dict[str, float]:
    """XLA's cost analysis of a compiled program as one flat dict (jax versions differ: dict, or a list of dicts,
    one per computation, that we sum)."""
    ca = compiled.cost_analysis()
    if ca is None:
        raise ValueError("this backend's compiled program reports no cost analysis (cost_analysis() returned None)")
    if isinstance(ca, dict):
        return {k: float(v) for k, v in ca.items()}
    total: dict[str, float] = {}
    for part in ca:
        for k, v in (part or {}).items():
            total[k] = total.get(k, 0.0) + float(v)
    return total


def _compile(fn_or_compiled, args, kwargs):
    if hasattr(fn_or_compiled, "cost_analysis"):  # already compiled (jax.stages.Compiled)
        if args or kwargs:
            raise TypeError("analyze(compiled): a compiled program takes no example arguments; pass the jitted function "
                            "with its arguments instead, or the compiled program alone")
        return fn_or_compiled
    if hasattr(fn_or_compiled, "lower"):  # jax.jit(f)
        return fn_or_compiled.lower(*args, **kwargs).compile()
    raise TypeError(f"analyze wants a jax.jit-ed function or a compiled program, got {type(fn_or_compiled).__name__}: "
                    "wrap it as analyze(jax.jit(f), *args)")


def point(name: str, flops: float, bytes_accessed: float, device: DeviceSpec,
          time_s: float | None = None) -> RooflinePoint:
    """A RooflinePoint from counts you already have (e.g. a model's analytic FLOPs)."""
    if bytes_accessed <= 0:
        raise ValueError(f"{name}: bytes_accessed={bytes_accessed}; a program must touch memory to be on a roofline")
    intensity = flops / bytes_accessed
    attainable = min(device.peak_flops, intensity * device.peak_bw)
    bound = "compute" if intensity >= device.ridge else "memory"
    achieved = frac = None
    if time_s is not None:
        if time_s <= 0:
            raise ValueError(f"{name}: time_s={time_s} must be positive (a median from jaxperf.perf.timing.benchmark)")
        achieved = flops / time_s
        frac = achieved / attainable if attainable > 0 else None
    return RooflinePoint(name, float(flops), float(bytes_accessed), intensity, attainable, bound, device, time_s,
                         achieved, frac)


def analyze(fn_or_compiled, *args, name: str | None = None, device: DeviceSpec | None = None,
            time_s: float | None = None, dtype: str = "bfloat16", **kwargs) -> RooflinePoint:
    """Place a program on the roofline from XLA's cost analysis.

    Args:
      fn_or_compiled: a `jax.jit`-ed function (compiled here for `*args, **kwargs`) or a compiled program.
      name: label for reports and plots (default: the function's name).
      device: the roofs to compare against (default: `DeviceSpec.for_device(dtype)` of the first device).
      time_s: measured seconds per call (e.g. `benchmark(f, *args).median_s`) for achieved FLOP/s.
      dtype: which compute peak to use when `device` is None ("bfloat16", "float32", "fp8").
    """
    compiled = _compile(fn_or_compiled, args, kwargs)
    ca = cost_analysis(compiled)
    flops, nbytes = ca.get("flops", 0.0), ca.get("bytes accessed", 0.0)
    if name is None:
        name = getattr(fn_or_compiled, "__name__", None) or getattr(getattr(fn_or_compiled, "__wrapped__", None),
                                                                    "__name__", "program")
    return point(name, flops, nbytes, device or DeviceSpec.for_device(dtype), time_s)


def plot(points: Sequence[RooflinePoint], path: str, *, peak_flops: float | None = None, peak_bw: float | None = None,
         title: str | None = None) -> str:
    """Write a log-log roofline PNG with the device's roofs and each point (at its achieved FLOP/s where measured,
    else at its attainable FLOP/s, drawn hollow). Peaks default to the first point's device. Returns `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not points and (peak_flops is None or peak_bw is None):
        raise ValueError("plot needs points, or peak_flops and peak_bw to draw an empty roofline")
    peak_flops = peak_flops or points[0].device.peak_flops
    peak_bw = peak_bw or points[0].device.peak_bw
    ridge = peak_flops / peak_bw
    xs = [p.intensity for p in points if p.intensity > 0] + [ridge]
    lo, hi = min(xs) / 10, max(xs) * 10
    grid = [lo * (hi / lo) ** (i / 199) for i in range(200)]
    fig, ax = plt.subplots(figsize=(7, 5))
    ax.loglog(grid, [min(peak_flops, x * peak_bw) for x in grid], "k-", lw=2,
              label=f"roof: {peak_flops / 1e12:.3g} TFLOP/s, {peak_bw / 1e9:.3g} GB/s")
    ax.axvline(ridge, color="gray", ls=":", lw=1)
    ax.annotate(f"ridge {ridge:.3g} FLOP/B", (ridge, peak_flops), textcoords="offset points", xytext=(4, -14),
                fontsize=8, color="gray")
    for p in points:
        y = p.achieved_flops if p.achieved_flops is not None else min(peak_flops, p.intensity * peak_bw)
        if p.intensity <= 0 or y <= 0:
            continue
        measured = p.achieved_flops is not None
        ax.plot([p.intensity], [y], "o", mfc="C1" if measured else "none", mec="C1")
        label = p.name + (f" ({100 * p.fraction_of_attainable:.0f}%)" if measured and p.fraction_of_attainable else "")
        ax.annotate(label, (p.intensity, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("FLOP/s")
    ax.set_title(title or (points[0].device.name if points else "roofline"), fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

