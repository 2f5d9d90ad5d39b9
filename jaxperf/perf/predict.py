"""Per-chip step time predicted from a compiled program: three times, each at its hardware limit, and how they combine.

    p = predict_step(compiled.as_text(), model_flops=..., hardware_flops=..., chip=chip_for(device))
    p["step_s"], p["mfu"], p["bound_by"]

    compute     hardware FLOPs per chip (jaxperf.perf.flops: the model's matmuls plus what remat recomputes) / the
                chip's dense peak for the compute dtype
    HBM         bytes every kernel reads and writes (jaxperf.perf.hlo_cost: loop bodies times their trip counts,
                Pallas kernels charged their operands and results) / HBM bandwidth
    collective  bytes each chip sends over ICI for every all-gather, reduce-scatter, all-reduce, all-to-all and
                collective-permute in the program (loop bodies times their trip counts; (n-1)/n of the array for a
                ring over n chips, 2(n-1)/n for an all-reduce) / the chip's ICI bandwidth (all links, one direction)

`step_s` is the roofline bound max(compute, HBM, collective): every unit busy all the time, collectives fully hidden
behind compute (XLA's TPU scheduler runs them asynchronously, and FSDP's weight gathers for layer i+1 overlap layer
i's matmuls). No real step is faster, so the MFU it implies (model FLOPs / (step_s x peak)) is a ceiling; the model
FLOPs leave out the remat recomputation, so even a compute-bound step's ceiling is model / hardware FLOPs.
`step_s_no_overlap` = max(compute, HBM) + collective is the other end: nothing hidden. A measured step lands between
the two; the gap says how much depends on overlap. Both leave out latency (per-collective start-up, small ops, the
host), so small programs are slower than either.
"""

from __future__ import annotations

from typing import Any

from jaxperf.perf.hardware import Chip
from jaxperf.perf.hlo_cost import hlo_costs


def predict_step(hlo_text: str, *, model_flops: float, hardware_flops: float, chip: Chip | None,
                 dtype: str = "bfloat16") -> dict[str, Any]:
    """Predicted per-chip step time of a compiled program (`compiled.as_text()`); see the module docstring.

    Args:
      hlo_text: the optimized HLO of one chip's program.
      model_flops: FLOPs per chip per step that count towards MFU (no recomputation).
      hardware_flops: FLOPs per chip per step the chip executes (with the remat recomputation).
      chip: the hardware table entry; None (an unknown chip) gives the byte counts and no times.
      dtype: compute dtype, picks the peak ("float32" uses `fp32_flops`).
    Returns:
      a JSON-friendly dict: the three times in seconds, `step_s` (the bound), `step_s_no_overlap`, `mfu`,
      `mfu_no_overlap`, `bound_by`, the byte counts behind them and the loops found with their trip counts.
    """
    costs = hlo_costs(hlo_text)
    out: dict[str, Any] = {
        "hbm_bytes": costs.hbm_bytes,
        "custom_call_hbm_bytes": costs.custom_call_bytes,
        "collectives": {k: v for k, v in costs.collectives.items() if v["ops"]},
        "collective_wire_bytes": costs.wire_bytes,
        "loops": costs.loops,
        "unknown_trip_counts": costs.unknown_trip_counts,
        "top_hbm_ops": [[name, b] for name, b in costs.top_ops[:5]],
        "model_flops": model_flops,
        "hardware_flops": hardware_flops,
    }
    if chip is None:
        return out
    peak = chip.fp32_flops if dtype == "float32" else chip.bf16_flops
    times = {"compute": hardware_flops / peak, "hbm": costs.hbm_bytes / chip.hbm_bw,
             "collective": costs.wire_bytes / chip.interconnect_bw}
    step = max(times.values())
    serial = max(times["compute"], times["hbm"]) + times["collective"]
    out.update(
        peak_flops=peak, hbm_bw=chip.hbm_bw, ici_bw=chip.interconnect_bw,
        compute_s=times["compute"], hbm_s=times["hbm"], collective_s=times["collective"],
        step_s=step, step_s_no_overlap=serial, bound_by=max(times, key=times.get),
        mfu=model_flops / (step * peak) if step else None,
        mfu_no_overlap=model_flops / (serial * peak) if serial else None,
    )
    return out


def format_prediction(p: dict[str, Any]) -> list[str]:
    """Report lines for a `predict_step` dict."""
    gb = 1e9
    coll = ", ".join(f"{k} {v['ops']:.0f} ops {v['wire_bytes'] / gb:.2f} GB" for k, v in p["collectives"].items())
    lines = [f"traffic per chip per step: HBM {p['hbm_bytes'] / gb:.2f} GB (loops x trip count; Pallas kernels "
             f"{p['custom_call_hbm_bytes'] / gb:.2f} GB), ICI {p['collective_wire_bytes'] / gb:.2f} GB sent"
             + (f" ({coll})" if coll else "")]
    if p.get("unknown_trip_counts"):
        lines.append(f"  loops counted once (trip count not readable): {', '.join(p['unknown_trip_counts'])}")
    if "step_s" in p:
        ms = 1e3
        lines.append(f"predicted step: compute {p['compute_s'] * ms:.1f} ms, HBM {p['hbm_s'] * ms:.1f} ms, "
                     f"collectives {p['collective_s'] * ms:.1f} ms -> bound max() {p['step_s'] * ms:.1f} ms "
                     f"({p['bound_by']}-bound, MFU <= {100 * p['mfu']:.1f}%); no overlap "
                     f"{p['step_s_no_overlap'] * ms:.1f} ms (MFU {100 * p['mfu_no_overlap']:.1f}%)")
    return lines
