"""Will a run fit a TPU slice? Compile its train step for the slice's topology on this (CPU) machine and read back
XLA's own memory and cost analyses.

    jaxperf compile --topology v5p:4x4x4 --preset gpt2-medium strategy=fsdp_tp tensor=4
    report = compile_for_topology(get_config("llama-1b"), "v5e:4x4")

With `libtpu` installed (`pip install 'jax[tpu]'`), `jax.experimental.topologies.get_topology_desc` describes the
devices of a slice that is not attached; the train step is lowered against abstract arrays placed on a mesh of those
devices and compiled by the TPU compiler. The figures are those of the real program: bytes per chip for arguments
(parameters, optimizer state, batch), outputs, temporaries and code. FLOPs per chip per step come from jaxperf's
model count (jaxperf.perf.flops, remat recomputation included), since XLA's cost analysis counts the body of a scanned
layer stack once; both are reported. The step time is predicted from the compiled program (jaxperf.perf.predict):
compute, HBM traffic and ICI traffic each at the chip's peak, loops counted by their trip counts. With `buffers=N`
the report also lists the largest buffers of each kind from the compiler's buffer assignment (jaxperf.perf.buffers).
Nothing is allocated and nothing runs; a 4x4x4 slice compiles in seconds to minutes on a laptop-class CPU.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import topologies

from jaxperf.config import mesh_shape, validate
from jaxperf.config.validate import compiler_option_entries
from jaxperf.step.flavours import build_train_step
from jaxperf.models.platform import SETTLED_FIELDS, implementation_choices, layers_per_iteration, settle
from jaxperf.parallel.mesh import make_mesh, platform_of
from jaxperf.perf.buffers import buffer_report, dump_options, format_buffers, read_dump
from jaxperf.perf.flops import flops_per_token
from jaxperf.perf.hardware import chip_for
from jaxperf.perf.memory import estimate
from jaxperf.perf.predict import format_prediction, predict_step
from jaxperf.step.task import build_task, step_microbatches

GiB = 2**30


class TopologyError(RuntimeError):
    """The topology cannot be described here (no libtpu, or an unknown name)."""


# The chips of 3D slices (v4, v5p): tori from 4x4x4 up (`topology_wrap`), each chip's two TensorCores one JAX device
# (megacore), as JAX sees an attached slice. libtpu describes a v4 slice core by core unless told: "v4:2x2x2" came
# out as 16 devices, not 8 chips.
MEGACORE_CHIPS = ("v4", "v5p", "v5")


def topology_wrap(topology: str) -> tuple[bool, bool, bool] | None:
    """Which dimensions of the slice `topology` close into rings (wraparound ICI links), as a provisioned slice has
    them: a v4 or v5p slice is a torus in all three dimensions once each is a multiple of 4 (4x4x4 and up; smaller
    slices are open meshes), a v5e or v6e slice wraps a dimension of 16 chips (8x16 along the 16, 16x16 both ways).
    None for a name this does not parse (libtpu's own default then applies).

    libtpu describes every slice as an open mesh unless told. Described so (or with the mesh in libtpu's listing
    order, `jaxperf.parallel.mesh.physical_order`), 4x4x4 got every 64-chip fsdp all-gather compiled as a
    dynamic-update-slice of a zeroed full-size buffer plus an all-reduce: twice the ICI bytes and a zeroed copy of
    each gathered weight among the temporaries, a program no provisioned 4x4x4 slice runs.
    """
    chip, _, shape = topology.partition(":")
    try:
        dims = [int(d) for d in shape.lower().split("x")]
    except ValueError:
        return None
    if chip.lower() in MEGACORE_CHIPS and len(dims) == 3:
        torus = all(d % 4 == 0 for d in dims)
        return (torus, torus, torus)
    if chip.lower() in ("v5e", "v6e") and len(dims) == 2:
        return (dims[0] == 16, dims[1] == 16, False)
    return None


def topology_devices(topology: str, slices: int = 1) -> list:
    """The devices of a TPU slice such as "v5p:4x4x4", "v5e:4x4" or "v4:2x2x2" (or of `slices` such slices), from
    libtpu (no TPU needed), one per chip, with the slice's wraparound links (`topology_wrap`)."""
    if ":" not in topology:
        raise TopologyError(f"topology {topology!r} should look like v5p:4x4x4 (chip:shape)")
    if importlib.util.find_spec("libtpu") is None:
        raise TopologyError(f"describing {topology!r} needs libtpu, which is not installed: pip install 'jax[tpu]' "
                            "(the version matching your jax), then retry; no TPU is needed")
    try:
        kwargs: dict[str, Any] = {"num_slices": slices} if slices > 1 else {}
        wrap = topology_wrap(topology)
        if wrap is not None and any(wrap):
            kwargs["wrap"] = wrap
        if topology.partition(":")[0].lower() in MEGACORE_CHIPS:
            kwargs["chip_config_name"] = "megacore"
        desc = topologies.get_topology_desc(topology, platform="tpu", **kwargs)
    except Exception as e:
        raise TopologyError(f"cannot describe {topology!r}: {e}") from None
    return list(desc.devices)


def _compile_with_buffers(lowered, top: int) -> tuple[Any, float, dict[str, Any] | None]:
    """Compile `lowered`: (compiled, seconds, buffers). With top > 0 the compiler also dumps its buffer assignment
    for this program alone (the `xla_dump_to` compiler option), read back as `buffer_report(..., top)`. A compiler
    that refuses the option compiles without it, and `buffers` says why it holds no list."""
    t0 = time.perf_counter()
    if top <= 0:
        return lowered.compile(), time.perf_counter() - t0, None
    with tempfile.TemporaryDirectory(prefix="jaxperf-buffers-") as d:
        try:
            compiled = lowered.compile(compiler_options=dump_options(d))
        except Exception as e:  # noqa: BLE001 - an option this compiler does not take; the compile itself is retried
            t0 = time.perf_counter()
            return lowered.compile(), time.perf_counter() - t0, {"error": f"the compiler refused the dump option: {e}"}
        seconds = time.perf_counter() - t0
        try:
            assignment = read_dump(d)
        except ValueError as e:
            return compiled, seconds, {"error": str(e)}
    if assignment is None:
        return compiled, seconds, {"error": "the compiler wrote no buffer assignment"}
    return compiled, seconds, buffer_report(assignment, compiled.memory_analysis(), top)


def compile_for_topology(cfg, topology: str, slices: int = 1, hlo_out: str | None = None,
                         buffers: int = 0) -> dict[str, Any]:
    """Compile cfg's train step for every chip of `topology` (times `slices`); returns a report (`format_report`).
    `hlo_out`: a path to write the compiled program's optimized HLO text to (for jaxperf.perf.hlo_cost or a reader).
    `buffers`: with N > 0, the report's "buffers" holds the N largest buffers of each kind (parameters, outputs,
    temporaries, constants) from the compiler's buffer assignment (jaxperf.perf.buffers).

    With several slices the run is data parallel across them (`parallel.dcn_data` is set to `slices`). The step is
    the one `parallel.flavour` trains with (jit or shard_map; pmap needs attached devices).
    """
    if slices < 1:
        raise TopologyError(f"--slices {slices} must be >= 1")
    if cfg.parallel.flavour == "pmap":
        raise TopologyError("parallel.flavour=pmap compiles only for attached devices; compile the same dp step with "
                            "parallel.flavour=shard_map (or jit)")
    if slices > 1:
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dcn_data=slices))
    devices = topology_devices(topology, slices)
    shape = mesh_shape(cfg.parallel, len(devices))
    validate(cfg, len(devices), shape)
    mesh = make_mesh(cfg.parallel, devices)
    task = build_task(cfg, mesh)
    step = build_train_step(task, task.loss_fn, cfg.parallel.flavour, microbatches=step_microbatches(cfg),
                            overlap_grad_reduce=cfg.parallel.overlap_grad_reduce).fn
    state = task.abstract_state()
    B, L = cfg.batch_size, cfg.train_seq_len
    tok = task.batch_sharding(2)
    batch = {"inputs": jax.ShapeDtypeStruct((B, L), jnp.int32, sharding=tok),
             "targets": jax.ShapeDtypeStruct((B, L), jnp.int32, sharding=tok),
             "mask": jax.ShapeDtypeStruct((B, L), jnp.float32, sharding=tok)}
    compiled, compile_s, buffer_kinds = _compile_with_buffers(step.lower(state, batch), buffers)

    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    chip = chip_for(devices[0])
    arg = int(getattr(mem, "argument_size_in_bytes", 0))
    out = int(getattr(mem, "output_size_in_bytes", 0))
    alias = int(getattr(mem, "alias_size_in_bytes", 0))
    temp = int(getattr(mem, "temp_size_in_bytes", 0))
    code = int(getattr(mem, "generated_code_size_in_bytes", 0))
    total = arg + out - alias + temp + code
    host_temp = int(getattr(mem, "host_temp_size_in_bytes", 0) or 0)  # activations a remat policy offloads
    xla_flops = float((cost or {}).get("flops", 0.0))
    # XLA's cost analysis counts the body of a loop once, so a scanned layer stack is under-counted n_layers times;
    # the step time at peak uses jaxperf's count (jaxperf.perf.flops, with the remat recomputation) instead.
    flops = flops_per_token(cfg.model, L, hardware=True) * B * L / len(devices)
    model_flops = flops_per_token(cfg.model, L) * B * L / len(devices)
    peak = chip.bf16_flops if chip and cfg.model.dtype != "float32" else (chip.fp32_flops if chip else None)
    platform = platform_of(mesh)
    est = estimate(cfg, shape, platform=platform)
    choices = implementation_choices(cfg, shape, platform)
    settled = settle(cfg, shape, platform)
    hlo = compiled.as_text()
    if hlo_out:
        with open(hlo_out, "w") as f:
            f.write(hlo)
    prediction = predict_step(hlo, model_flops=model_flops, hardware_flops=flops, chip=chip,
                              dtype=cfg.model.dtype)
    report = {
        "topology": topology, "slices": slices, "chips": len(devices), "device_kind": devices[0].device_kind,
        "mesh": {a: int(n) for a, n in mesh.shape.items()},
        # the slice(s) each index of the data axis lives on: one slice per index when fsdp/tensor stay inside a slice
        "slices_per_data_index": [sorted({int(getattr(d, "slice_index", 0)) for d in row.flat})
                                  for row in mesh.devices], "strategy": cfg.parallel.strategy,
        "flavour": cfg.parallel.flavour,
        "batch": B, "seq_len": L, "compile_s": compile_s,
        "implementations": {c.op: {"impl": c.impl, "why": c.why} for c in choices},
        # the model fields the platform decides, as this program was built with them
        "settled": {f: getattr(settled, f) for f in SETTLED_FIELDS},
        "compiler_options": dict(task.compiler_options or {}),  # given to this program's compile alone
        # layers per loop iteration: with remat, that many layers' recomputed activations are live at once
        "layers": {"n": cfg.model.n_layers, "scanned": cfg.model.scan_layers,
                   "per_iteration": layers_per_iteration(cfg.model, platform) if cfg.model.scan_layers
                   else cfg.model.n_layers},
        "bytes_per_chip": {"arguments": arg, "outputs": out, "aliased": alias, "temp": temp, "code": code,
                           "total": total, "host_temp": host_temp},
        "hbm_bytes": chip.hbm_bytes if chip else None,
        "fits": (total <= chip.hbm_bytes) if chip else None,
        "estimated_bytes_per_chip": int(est.total) if est else None,
        "estimated_parts": est.components() if est else None,
        "flops_per_chip": flops,
        "xla_cost_analysis_flops_per_chip": xla_flops,
        "step_s_at_peak": flops / peak if peak and flops else None,
        "tokens_per_s_at_peak": B * L / (flops / peak) if peak and flops else None,
        "model_flops_per_chip": model_flops,
        "prediction": prediction,
        "predicted_step_s": prediction.get("step_s"),
        "predicted_mfu": prediction.get("mfu"),
    }
    if buffer_kinds is not None:
        report["buffers"] = buffer_kinds
    return report


def _layers_line(layers: dict[str, Any]) -> str:
    n, per = layers["n"], layers["per_iteration"]
    if not layers["scanned"]:
        return f"layers: {n}, unrolled in Python (model.scan_layers=false)"
    line = f"layers: {n} under a scan, {per} per iteration"
    if per > 1:
        line += (f" (model.scan_unroll={per}: the backward holds parts of {per} layers' working sets at once, "
                 "which the estimate counts; model.scan_unroll=1 needs the least memory)")
    return line


def format_report(r: dict[str, Any]) -> str:
    b = r["bytes_per_chip"]
    mesh = " ".join(f"{a}={n}" for a, n in r["mesh"].items())
    where = f" x {r['slices']} slices" if r.get("slices", 1) > 1 else ""
    flavour = "" if r.get("flavour", "jit") == "jit" else f" ({r['flavour']})"
    lines = [
        f"{r['topology']}{where}: {r['chips']} x {r['device_kind']}, mesh {mesh}, strategy {r['strategy']}{flavour}, "
        f"batch {r['batch']} x {r['seq_len']} (compiled in {r['compile_s']:.1f} s)",
        "implementations: " + "; ".join(f"{op}={c['impl']} ({c['why']})" for op, c in r["implementations"].items()),
        _layers_line(r["layers"]),
        *(["compiler options: " + ", ".join(compiler_option_entries(r["compiler_options"]))]
          if r.get("compiler_options") else []),
        f"per chip: arguments {b['arguments'] / GiB:.2f} GiB, outputs {b['outputs'] / GiB:.2f} GiB "
        f"(aliased {b['aliased'] / GiB:.2f}), temporaries {b['temp'] / GiB:.2f} GiB, code {b['code'] / 2**20:.1f} MiB"
        f" -> {b['total'] / GiB:.2f} GiB" + (f"; host memory {b['host_temp'] / GiB:.2f} GiB (offloaded activations)"
                                              if b.get("host_temp") else ""),
    ]
    if r["hbm_bytes"]:
        verdict = "fits" if r["fits"] else "DOES NOT FIT"
        lines.append(f"HBM per chip {r['hbm_bytes'] / GiB:.1f} GiB: {verdict} "
                     f"({100 * b['total'] / r['hbm_bytes']:.0f}% used)")
    if r.get("estimated_bytes_per_chip"):
        lines.append(f"jaxperf's own estimate before compiling: {r['estimated_bytes_per_chip'] / GiB:.2f} GiB per chip")
    lines.append(f"FLOPs per chip per step {r['flops_per_chip']:.3e} (model count with remat recomputation; XLA's "
                 f"cost analysis, which counts a scanned layer once: {r['xla_cost_analysis_flops_per_chip']:.3e})")
    if r["step_s_at_peak"]:
        lines.append(f"at peak FLOP/s a step takes >= {1e3 * r['step_s_at_peak']:.3g} ms, "
                     f"<= {r['tokens_per_s_at_peak']:,.0f} tokens/s for the slice")
    if r.get("prediction"):
        lines += format_prediction(r["prediction"])
    if r.get("buffers"):
        lines += ([f"no buffer report: {r['buffers']['error']}"] if "error" in r["buffers"]
                  else format_buffers(r["buffers"]))
    return "\n".join(lines)
