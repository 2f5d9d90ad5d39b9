"""How fast is one train step of a preset on these devices? Tokens/s, step time and MFU as one JSON line.

    python benchmarks/bench_train_step.py --preset tiny
    python benchmarks/bench_train_step.py --preset gpt2-small batch_size=16 model.remat=save_dots --steps 20

Random tokens stand in for data (the step's cost does not depend on them). Compile time is reported apart from run
time; run time is the median of `--steps` timed steps after `--warmup` untimed ones, each timed to completion with
block_until_ready. MFU = tokens/s x FLOPs/token (jaxperf.perf.flops) / (devices x peak FLOP/s per device); the record
also carries nanoGPT's own count, 6 N + 12 n_layers L D per token with N the parameters less the position table, so a
figure can be set beside nanoGPT's. On devices that keep memory counters (GPUs, TPUs) `peak_bytes` is the runtime's
peak of the first device over compile and steps; `compiled_bytes` is XLA's accounting of the step.

`--analyze` adds what jaxperf predicts before running: the memory estimate (jaxperf.perf.memory) against the
measured peak, and the step time predicted from the compiled program (jaxperf.perf.predict: compute, HBM and
collective times at the device's peaks) against the measured median.
"""

from __future__ import annotations

import argparse
import gzip
import json
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import flax
import jax
import numpy as np
import optax

from jaxperf.config import get_config, to_dict, validate
from jaxperf.models.platform import describe_settled
from jaxperf.parallel.mesh import make_mesh, platform_of
from jaxperf.perf.flops import flops_per_token
from jaxperf.perf.hardware import chip_for, peak_flops
from jaxperf.perf.cpu_host import reexec_with_huge_pages
from jaxperf.perf.memory import compiled_memory, estimate, live_device_memory
from jaxperf.perf.predict import predict_step
from jaxperf.perf.profile import device_time_by_op, trace
from jaxperf.step.task import build_task, step_microbatches


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="trace this many more steps and report device time per XLA op (jaxperf.perf.profile)")
    parser.add_argument("--analyze", action="store_true",
                        help="add the memory estimate and the step time predicted from the compiled program")
    parser.add_argument("--hlo-out", default=None,
                        help="write the compiled program's optimized HLO text to this file (the step prediction's "
                             "input, to study off the device)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)

    cfg = get_config(args.preset, args.overrides)
    validate(cfg, jax.device_count())
    mesh = make_mesh(cfg.parallel)
    task = build_task(cfg, mesh)
    state = task.init_state()
    step = task.train_step(microbatches=step_microbatches(cfg))

    B, L = cfg.batch_size, cfg.train_seq_len
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.model.vocab_size, (B, L + 1)).astype(np.int32)
    batch = jax.device_put(
        {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": np.ones((B, L), np.float32)}, task.batch_sharding()
    )

    t0 = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0

    first_loss = None
    for _ in range(args.warmup):
        state, metrics = compiled(state, batch)
        first_loss = first_loss if first_loss is not None else float(metrics["loss"])
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    last_loss = float(metrics["loss"])
    if not np.isfinite(last_loss):
        raise SystemExit(f"the step produced a non-finite loss ({last_loss}); refusing to report a speed")

    median = statistics.median(times)
    tokens_per_s = B * L / median
    fpt = flops_per_token(cfg.model, L)
    m = cfg.model.resolved()
    pos_params = m.max_seq_len * m.d_model if m.position == "learned" else 0
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
    fpt_nanogpt = 6 * (n_params - pos_params) + 12 * m.n_layers * L * m.d_model
    live = live_device_memory(mesh.devices.flat[0]) or {}
    peak, peak_source = peak_flops(cfg.model.dtype)
    n = mesh.devices.size
    result = {
        "benchmark": "train_step",
        "preset": args.preset,
        "overrides": args.overrides,
        "device": jax.devices()[0].device_kind,
        "platform": jax.default_backend(),
        "devices": n,
        "mesh": dict(mesh.shape),
        "strategy": cfg.parallel.strategy,
        "versions": {"jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__,
                     "python": platform.python_version()},
        "batch_size": B,
        "seq_len": L,
        "dtype": cfg.model.dtype,
        "remat": cfg.model.remat,
        "compile_s": round(compile_s, 3),
        "step_time_s": {"median": median, "min": min(times), "max": max(times),
                        "stdev": statistics.stdev(times) if len(times) > 1 else 0.0},
        "tokens_per_s": tokens_per_s,
        "flops_per_token": fpt,
        "peak_flops_per_device": peak,
        "peak_source": peak_source,
        "mfu": tokens_per_s * fpt / (n * peak),
        "n_params": n_params,
        "flops_per_token_nanogpt": fpt_nanogpt,
        "mfu_nanogpt_count": tokens_per_s * fpt_nanogpt / (n * peak),
        "peak_bytes": live.get("peak_bytes_in_use"),
        "bytes_limit": live.get("bytes_limit"),
        "compiled_bytes": compiled_memory(compiled),
        "loss_first_last": [first_loss, last_loss],
        "config": to_dict(cfg),
        "settled": describe_settled(cfg, dict(mesh.shape), platform_of(mesh)),
    }
    if args.profile_steps > 0:
        with tempfile.TemporaryDirectory() as logdir:
            with trace(logdir):
                for _ in range(args.profile_steps):
                    state, metrics = compiled(state, batch)
                jax.block_until_ready((state, metrics))
            result["profile"] = device_time_by_op(logdir, steps=args.profile_steps)
        hlo = {}
        for line in compiled.as_text().splitlines():
            head = line.strip().removeprefix("ROOT ")
            if head.startswith("%"):
                hlo.setdefault(head[1:].split(" ", 1)[0], head)
        for row in result["profile"]["ops"]:  # what each op is: its result, kind and source op, from the program
            line = hlo.get(row[0], "")
            kind = re.search(r"kind=(\w+)", line)
            op_name = re.search(r'op_name="([^"]*)"', line)
            row.append(" ".join(x for x in (line.split("(", 1)[0][:120], kind and kind.group(1),
                                            op_name and op_name.group(1)[-160:]) if x))
    if args.hlo_out:
        Path(args.hlo_out).parent.mkdir(parents=True, exist_ok=True)
        text = compiled.as_text()
        if args.hlo_out.endswith(".gz"):  # an unrolled stack's program runs to megabytes of text
            Path(args.hlo_out).write_bytes(gzip.compress(text.encode()))
        else:
            Path(args.hlo_out).write_text(text)
        result["hlo_out"] = args.hlo_out
    if args.analyze:
        result["analysis"] = analyze(cfg, mesh, compiled, median, live.get("peak_bytes_in_use"))
    print(json.dumps(result))
    return result


def analyze(cfg, mesh, compiled, measured_step_s: float, peak_bytes: int | None) -> dict:
    """The memory estimate and the predicted step beside what was measured (ratios > 1: the model over-predicts)."""
    n = mesh.devices.size
    B, L = cfg.batch_size, cfg.train_seq_len
    est = estimate(cfg, mesh)
    mem = compiled_memory(compiled)
    compiled_peak, compiled_bound = mem["peak"], mem["bound"]
    pred = predict_step(compiled.as_text(), model_flops=flops_per_token(cfg.model, L) * B * L / n,
                        hardware_flops=flops_per_token(cfg.model, L, hardware=True) * B * L / n,
                        chip=chip_for(mesh.devices.flat[0]), dtype=cfg.model.dtype)
    out = {"estimate_bytes": int(est.total), "estimate_parts": est.components(),
           "estimate_over_compiled": est.total / compiled_peak if compiled_peak else None,
           "estimate_over_compiled_bound": est.total / compiled_bound if compiled_bound else None,
           "estimate_over_peak": est.total / peak_bytes if peak_bytes else None,
           "prediction": {k: v for k, v in pred.items() if k not in ("loops", "top_hbm_ops")},
           "top_hbm_ops": pred.get("top_hbm_ops")}
    if pred.get("step_s"):
        out["predicted_over_measured"] = pred["step_s"] / measured_step_s
        out["predicted_no_overlap_over_measured"] = pred["step_s_no_overlap"] / measured_step_s
    return out


if __name__ == "__main__":
    reexec_with_huge_pages()  # XLA:CPU step buffers on huge pages (jaxperf.perf.cpu_host)
    main(sys.argv[1:])
