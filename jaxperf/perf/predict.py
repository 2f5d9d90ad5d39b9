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

GPUs (`chip.platform == "gpu"`) run a program's kernels one after another on one stream, so there a step is a sum,
not a max: each kernel (jaxperf.perf.hlo_cost's `kernels`) takes max(its FLOPs / the matrix rate its kind sustains,
its bytes / the bandwidth its kind sustains), and `kernels_s` adds them up. The rates are fractions of the data sheet
(`GPU_SUSTAINED`), each measured on an H100 or H200: a large bf16 matmul runs at 0.80 of the dense peak (788-798 of
989 TFLOP/s for 8192^3), cuDNN's flash attention at head dim 64 and 1-2k tokens at about 0.3 (benchmarks/RESULTS.md,
"GPU": 250-310 TFLOP/s in the train steps), a device-to-device copy moves 0.9 of the HBM bandwidth (3.0 of 3.35 TB/s,
4.3 of 4.8) and XLA's fused elementwise and reduction kernels 0.5-0.85 of it (0.7 taken). `step_s` = max(kernels_s,
collective) (NCCL runs on streams of its own), `step_s_no_overlap` their sum; `compute_s` and `hbm_s` stay the
whole-program terms at the data sheet's peaks, the floor no schedule goes under. On an H200 this predicts 0.88x and
0.94x the measured gpt2-small and llama-1b steps (tests/test_predict.py, from their compiled programs).
"""

from __future__ import annotations

from typing import Any

from jaxperf.perf.hardware import Chip
from jaxperf.perf.hlo_cost import Kernel, hlo_costs

# What a GPU kernel of each kind sustains, as fractions of the data sheet: (of the dense matrix peak, of the HBM
# bandwidth). Sources in the module docstring.
GPU_SUSTAINED = {"matmul": (0.80, 0.90), "attention": (0.30, 0.90), "fusion": (0.0, 0.70), "other": (0.0, 0.90)}


def gpu_kernel_s(k: Kernel, peak: float, hbm_bw: float) -> float:
    """Seconds one kernel (all its launches) takes on a GPU: the slower of its FLOPs and its bytes at the rates its
    kind sustains (`GPU_SUSTAINED`)."""
    flops_frac, bw_frac = GPU_SUSTAINED.get(k.kind, GPU_SUSTAINED["other"])
    compute = k.flops / (peak * flops_frac) if k.flops and flops_frac else 0.0
    return max(compute, k.hbm_bytes / (hbm_bw * bw_frac))


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
    bound = max(times, key=times.get)
    out["model"] = "roofline"
    if chip.platform == "gpu":
        per_kind: dict[str, float] = {}
        for k in costs.kernels:
            per_kind[k.kind] = per_kind.get(k.kind, 0.0) + gpu_kernel_s(k, peak, chip.hbm_bw)
        kernels = sum(per_kind.values())
        step, serial = max(kernels, times["collective"]), kernels + times["collective"]
        matrix = per_kind.get("matmul", 0.0) + per_kind.get("attention", 0.0)
        bound = "collective" if times["collective"] > kernels else "compute" if matrix >= kernels / 2 else "hbm"
        out.update(model="gpu kernels in series", kernels_s=kernels, kernels_by_kind_s=per_kind,
                   launches=sum(k.launches for k in costs.kernels))
    out.update(
        peak_flops=peak, hbm_bw=chip.hbm_bw, ici_bw=chip.interconnect_bw,
        compute_s=times["compute"], hbm_s=times["hbm"], collective_s=times["collective"],
        step_s=step, step_s_no_overlap=serial, bound_by=bound,
        mfu=model_flops / (step * peak) if step else None,
        mfu_no_overlap=model_flops / (serial * peak) if serial else None,
    )
    return out


def format_prediction(p: dict[str, Any]) -> list[str]:
    """Report lines for a `predict_step` dict."""
    gb = 1e9
    coll = ", ".join(f"{k} {v['ops']:.0f} ops {v['wire_bytes'] / gb:.2f} GB" for k, v in p["collectives"].items())
    lines = [f"traffic per chip per step: HBM {p['hbm_bytes'] / gb:.2f} GB (loops x trip count; custom calls: "
             f"Pallas, cuBLAS, cuDNN {p['custom_call_hbm_bytes'] / gb:.2f} GB), ICI "
             f"{p['collective_wire_bytes'] / gb:.2f} GB sent"
             + (f" ({coll})" if coll else "")]
    if p.get("unknown_trip_counts"):
        lines.append(f"  loops counted once (trip count not readable): {', '.join(p['unknown_trip_counts'])}")
    if "kernels_s" in p:
        ms = 1e3
        kinds = ", ".join(f"{k} {v * ms:.1f}" for k, v in sorted(p["kernels_by_kind_s"].items(), key=lambda kv: -kv[1]))
        lines.append(f"predicted step (GPU, {p['launches']:.0f} kernels in series): {p['kernels_s'] * ms:.1f} ms "
                     f"({kinds} ms), collectives {p['collective_s'] * ms:.1f} ms -> {p['step_s'] * ms:.1f} ms "
                     f"(MFU {100 * p['mfu']:.1f}%); floor at the data sheet's peaks: compute "
                     f"{p['compute_s'] * ms:.1f} ms, HBM {p['hbm_s'] * ms:.1f} ms")
    elif "step_s" in p:
        ms = 1e3
        lines.append(f"predicted step: compute {p['compute_s'] * ms:.1f} ms, HBM {p['hbm_s'] * ms:.1f} ms, "
                     f"collectives {p['collective_s'] * ms:.1f} ms -> bound max() {p['step_s'] * ms:.1f} ms "
                     f"({p['bound_by']}-bound, MFU <= {100 * p['mfu']:.1f}%); no overlap "
                     f"{p['step_s_no_overlap'] * ms:.1f} ms (MFU {100 * p['mfu_no_overlap']:.1f}%)")
    return lines
