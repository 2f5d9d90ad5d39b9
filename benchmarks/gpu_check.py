"""One script for a GPU: is jaxperf correct on it, how fast is it, and how does it compare with its peer?

    python benchmarks/gpu_check.py --out DIR                         # the default pass (under 7 minutes)
    python benchmarks/gpu_check.py --out DIR --only decode,serve     # named stages, in the order below
    python benchmarks/gpu_check.py --out DIR --full                  # every stage, variant and size (longer)
    python benchmarks/gpu_check.py --out DIR --dry-run               # every stage on the CPU at tiny shapes (CI)

Stages, in priority order (what matters most runs first, so a run cut short keeps it):

  env          device, driver, versions (nvidia-smi, jax, jaxlib, flax, torch)
  correctness  the `gpu` tests (tests/test_gpu.py): every Pallas kernel forward and backward against its reference on
               the device, cuDNN against XLA, a train step and greedy generation against the CPU's, a checkpoint
               saved from the device restored bitwise, fully masked query rows
  train        train-step tokens/s, MFU (jaxperf's FLOP count and nanoGPT's) and peak device memory of gpt2-small
               (seq 1024) and llama-1b (seq 2048), bf16, at a few batch sizes and settings
  peer         nanoGPT's own GPT-2 with torch.compile at gpt2-small's dimensions, random data, set beside the best
               jaxperf gpt2-small figure of this run (benchmarks/peers/nanogpt.py; nanoGPT's model.py in --nanogpt-dir,
               never in this repository)
  attention    flash attention (Pallas), cuDNN, XLA and what `auto` picks: forward and forward+backward, causal, bf16,
               head dims 64 and 128, sequences 1k to 16k
  decode       decode tokens/s at batch 1, 32 and 128 (benchmarks/bench_generate.py)
  serve        continuous-batching goodput (benchmarks/bench_serve.py)
  memory       the memory estimate against the device's measured peak, and the step time predicted from the
               compiled program against the measured step (bench_train_step.py --analyze)

Every stage runs its jobs as subprocesses, each under a time limit, inside the stage's own limit; a job that fails,
runs out of time or memory is recorded with its reason and the next one runs. Output under --out: `gpu.jsonl` (one
JSON object per figure: `bench`, `preset` or `op`, `device_kind`, `jax`, `jaxlib`, `date`, the settings and the
figures), `gpu_check.log` (every job's command and output) and `junit.xml` (the correctness tests); a short table is
printed last. `--dry-run` runs every stage on the CPU at tiny shapes, so the script and the tests it runs never rot
between GPU runs. This process never initialises a GPU itself: each job gets the whole device.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import fnmatch
import importlib.metadata
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
STAGES = ("env", "correctness", "train", "peer", "attention", "decode", "serve", "memory")
# What the default pass runs, and each stage's limit in seconds there (the sum fits 7 minutes with start-up); the
# limits leave room over the stages' times on an H200 (benchmarks/RESULTS.md, "GPU").
DEFAULT_STAGES = ("env", "correctness", "train", "peer", "attention", "memory")
STAGE_LIMIT_S = {"env": 15, "correctness": 85, "train": 90, "peer": 55, "attention": 80, "decode": 120,
                 "serve": 300, "memory": 60}
DEFAULT_BUDGET_S = 390  # the default pass, whatever the stages' own limits leave
# MaxText's single-host GPU flags (its configs/gpu); measured here as a train-stage variant before any is adopted.
MAXTEXT_GPU_FLAGS = ("--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_enable_triton_gemm=false "
                     "--xla_gpu_enable_command_buffer=")
NO_TRITON_GEMM_FLAGS = "--xla_gpu_enable_triton_gemm=false"
# Every job of the dry run: XLA:CPU without LLVM's optimisations (what the dry run proves does not depend on them).
DRY_RUN_XLA_FLAGS = "--xla_backend_optimization_level=0"


@dataclasses.dataclass
class Job:
    stage: str
    name: str
    argv: list[str]  # after the interpreter
    timeout_s: float
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)


def _py(script: str, *args: str) -> list[str]:
    return [str(BENCH / script), *args]


def _train_job(stage, name, preset, overrides, *, dry, timeout_s, analyze=False, flags=None, steps=8, extra=()):
    tiny = ["model.n_layers=2", "batch_size=4", "seq_len=64"] if dry else []
    args = ["--preset", "tiny" if dry else preset, "--steps", "2" if dry else str(steps),
            "--warmup", "1" if dry else "2"]
    if analyze:
        args.append("--analyze")
    args += list(extra)
    env = {"XLA_FLAGS": flags} if flags else {}
    return Job(stage, name, _py("bench_train_step.py", *args, *overrides, *tiny), timeout_s, env,
               {"preset": preset, "overrides": list(overrides), "xla_flags": flags or ""})


def plan(stages: list[str], *, dry: bool, full: bool, nanogpt_dir: Path, out: Path = Path("gpu_out")) -> list[Job]:
    """The jobs of each selected stage, in order (files they write go under `out`)."""
    jobs: list[Job] = []
    for stage in stages:
        if stage == "env":
            jobs.append(Job(stage, "env", ["-c", ENV_PROBE], 60))
        elif stage == "correctness":
            args = ["-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                    str(ROOT / "tests" / "test_gpu.py"), "-rfEs"]
            # Several workers compile Triton kernels side by side; none preallocates the GPU's memory.
            env = {"JAXPERF_GPU_DRY_RUN": "1"} if dry else {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
            jobs.append(Job(stage, "gpu_tests", args + ([] if dry else ["-n", "4"]),
                            300 if full else STAGE_LIMIT_S["correctness"], env))
        elif stage == "train":
            runs = [("gpt2-small_b32", "gpt2-small", ["batch_size=32"]),
                    ("llama-1b_b8", "llama-1b", ["batch_size=8"]),
                    ("gpt2-small_b16", "gpt2-small", ["batch_size=16"]),
                    ("llama-1b_b16_full", "llama-1b", ["batch_size=16", "model.remat=full"])]
            if full:  # what a MaxText or Levanter user would try on a GPU, one change at a time, then together
                runs += [("gpt2-small_b32_fullloss", "gpt2-small", ["batch_size=32", "model.loss_impl=xla"]),
                         ("gpt2-small_b32_unrolled", "gpt2-small", ["batch_size=32", "model.scan_layers=false"]),
                         ("gpt2-small_b32_pallas", "gpt2-small", ["batch_size=32", "model.attention_impl=pallas"]),
                         ("gpt2-small_b64", "gpt2-small", ["batch_size=64"]),
                         ("llama-1b_b8_fullloss", "llama-1b", ["batch_size=8", "model.loss_impl=xla"]),
                         ("llama-1b_b8_noremat", "llama-1b", ["batch_size=8", "model.remat=none"]),
                         ("llama-1b_b16", "llama-1b", ["batch_size=16"]),
                         # The GPU default runs the whole stack in one scan iteration; against a rolled scan
                         ("gpt2-small_b32_rolled", "gpt2-small", ["batch_size=32", "model.scan_unroll=1"]),
                         ("llama-1b_b8_rolled", "llama-1b", ["batch_size=8", "model.scan_unroll=1"]),
                         ("llama-1b_b8_unrolled", "llama-1b", ["batch_size=8", "model.scan_layers=false"]),
                         # nanoGPT's vocabulary, padded to a multiple of 64 (GPT-2's 50257 is odd).
                         ("gpt2-small_b32_vocab50304", "gpt2-small", ["batch_size=32", "model.vocab_size=50304"])]
            for name, preset, overrides in runs[:1] if dry else runs:
                jobs.append(_train_job(stage, name, preset, overrides, dry=dry, timeout_s=150))
            if full:
                for name, preset, overrides in (
                        ("gpt2-small_b32_maxtext_flags", "gpt2-small", ["batch_size=32"]),
                        ("gpt2-small_b32_combined", "gpt2-small", ["batch_size=32", "model.loss_impl=xla",
                                                                   "model.scan_layers=false"]),
                        ("llama-1b_b8_maxtext_flags", "llama-1b", ["batch_size=8"])):
                    jobs.append(_train_job(stage, name, preset, overrides, dry=dry, timeout_s=150,
                                           flags=MAXTEXT_GPU_FLAGS))
                # cuBLAS for every matmul: XLA's Triton GEMM fusions are the one flag MaxText sets that changes
                # which kernels a single-GPU step runs.
                for name, preset, overrides in (("gpt2-small_b32_cublas", "gpt2-small", ["batch_size=32"]),
                                                ("llama-1b_b8_cublas", "llama-1b", ["batch_size=8"])):
                    jobs.append(_train_job(stage, name, preset, overrides, dry=dry, timeout_s=150,
                                           flags=NO_TRITON_GEMM_FLAGS))
            # Where the device time goes: kernel time per XLA op over a few traced steps (the memory stage traces too).
            profiled = (("gpt2-small_b32_profile", "gpt2-small", ["batch_size=32"]),
                        ("llama-1b_b8_profile", "llama-1b", ["batch_size=8"]))
            # (The dry run leaves them to the memory stage, whose job traces the same steps with --analyze.)
            for name, preset, overrides in () if dry else profiled if full else ():
                jobs.append(_train_job(stage, name, preset, overrides, dry=dry, timeout_s=150, steps=5, analyze=True,
                                       extra=["--profile-steps", "3"]))
        elif stage == "peer":
            dims = (["--n-layer", "2", "--n-head", "2", "--n-embd", "64", "--block-size", "64", "--vocab-size", "512",
                     "--batch", "4", "--steps", "2", "--warmup", "1", "--device", "cpu", "--compile", "0"] if dry else
                    ["--n-layer", "12", "--n-head", "12", "--n-embd", "768", "--block-size", "1024",
                     "--vocab-size", "50304", "--batch", "32", "--steps", "10", "--warmup", "3", "--compile", "1"])
            jobs.append(Job(stage, "nanogpt_b32", [str(BENCH / "peers" / "nanogpt.py"), "--nanogpt-dir",
                                                   str(nanogpt_dir), *dims], 180,
                            settings={"preset": "gpt2-small", "batch_size": 4 if dry else 32}))
        elif stage == "attention":
            if dry:
                args = ["--tiny", "--ops", "attention", "--seq", "64", "--passes", "forward", "both"]
            else:
                seqs = ["1024", "2048", "4096", "8192", "16384"] if full else ["1024", "4096", "16384"]
                args = ["--ops", "attention", "--seq", *seqs, "--head-dim", "64", "128", "--dtype", "bfloat16",
                        "--tokens", "16384", "--heads", "16", "--passes", "forward", "both", "--iters", "10"]
            jobs.append(Job(stage, "attention", _py("bench_kernels.py", *args), 300 if full else 90))
        elif stage == "decode":
            for preset in ("gpt2-small", "llama-1b"):
                args = (["--tiny", "--batch-sizes", "1,4", "--max-tokens", "8", "--repeats", "1"] if dry else
                        ["--preset", preset, "--batch-sizes", "1,32,128", "--prompt-len", "64", "--max-tokens", "128",
                         "--repeats", "3"])
                jobs.append(Job(stage, f"decode_{preset}", _py("bench_generate.py", *args), 120,
                                settings={"preset": preset}))
                if dry:
                    break
        elif stage == "serve":
            args = ["--tiny", "--requests", "8"] if dry else ["--preset", "gpt2-small", "--replicas", "1"]
            jobs.append(Job(stage, "serve_gpt2-small", _py("bench_serve.py", *args), 150 if dry else 300,
                            settings={"preset": "gpt2-small"}))
        elif stage == "memory":
            for name, preset, overrides in (("gpt2-small_b32", "gpt2-small", ["batch_size=32"]),
                                            ("llama-1b_b8", "llama-1b", ["batch_size=8"])):
                jobs.append(_train_job(stage, name, preset, overrides, dry=dry, timeout_s=100, analyze=True, steps=5,
                                       extra=["--profile-steps", "3", "--hlo-out", str(out / "hlo" / f"{name}.txt.gz")]))
                if dry:
                    break
    return jobs


ENV_PROBE = r"""
import json, subprocess, importlib.metadata as md
import jax
def v(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
d = jax.devices()[0]
smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
                      "--format=csv,noheader"], capture_output=True, text=True) if d.platform == "gpu" else None
print(json.dumps({"bench": "env", "device_kind": d.device_kind, "platform": d.platform, "devices": jax.device_count(),
                  "nvidia_smi": smi.stdout.strip() if smi else None,
                  "versions": {n: v(n) for n in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax",
                                                  "optax", "orbax-checkpoint", "numpy", "torch", "triton")}}))
"""


# ---------------------------------------------------------------------------------------------------------------------
# Running a job


@dataclasses.dataclass
class Outcome:
    job: Job
    rc: int | None  # None: killed at its time limit
    seconds: float
    lines: list[dict]
    tail: str


def _json_lines(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def run_job(job: Job, limit_s: float, log, base_env: dict[str, str]) -> Outcome:
    env = {**os.environ, **base_env, **job.env}
    cmd = [sys.executable, *job.argv]
    log.write(f"\n===== {job.stage}/{job.name}: {' '.join(cmd)}\n")
    log.write("".join(f"  {k}={v}\n" for k, v in {**base_env, **job.env}.items()))
    log.flush()
    t0 = time.perf_counter()
    # A session of its own, so a job past its limit is killed with everything it started.
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=limit_s)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        rc = None
    seconds = time.perf_counter() - t0
    log.write(out)
    log.write(f"===== {job.stage}/{job.name}: rc={rc} after {seconds:.1f} s\n")
    log.flush()
    return Outcome(job, rc, seconds, _json_lines(out), out[-2000:])


# ---------------------------------------------------------------------------------------------------------------------
# Records: one JSON object per figure in gpu.jsonl


def _short(x: float | None, digits: int = 4):
    return None if x is None else round(float(x), digits)


def normalize(o: Outcome, env: dict, junit: Path) -> list[dict]:
    """gpu.jsonl records from a job's output: the figures RESULTS.md reads (`bench`, `preset` or `op`, the device and
    versions, the settings, tokens/s, MFU, peak bytes...), whatever the benchmark's own record layout."""
    job = o.job
    base = {"stage": job.stage, "job": job.name, "device_kind": env.get("device_kind"), "jax": env.get("jax"),
            "jaxlib": env.get("jaxlib"), "date": env.get("date"), **job.settings}
    if job.env.get("XLA_FLAGS"):
        base["xla_flags"] = job.env["XLA_FLAGS"]
    status = "ok" if o.rc == 0 else ("timeout" if o.rc is None else f"rc={o.rc}")
    recs: list[dict] = []
    if job.stage == "env":
        recs += [{**base, **line, "bench": "env"} for line in o.lines]
    elif job.stage == "correctness":
        recs += _junit_records(junit, base)
    elif job.stage in ("train", "memory"):
        for line in o.lines:
            if line.get("benchmark") != "train_step":
                continue
            rec = {**base, "bench": "train_step" if job.stage == "train" else "memory",
                   "preset": job.settings["preset"],
                   "batch_size": line["batch_size"], "seq_len": line["seq_len"], "dtype": line["dtype"],
                   "remat": line["remat"], "attention_impl": line["config"]["model"]["attention_impl"],
                   "loss_impl": line["config"]["model"]["loss_impl"],
                   "scan_layers": line["config"]["model"]["scan_layers"],
                   "tokens_per_s": _short(line["tokens_per_s"], 1), "mfu": _short(line["mfu"]),
                   "mfu_nanogpt_count": _short(line["mfu_nanogpt_count"]),
                   "flops_per_token": line["flops_per_token"],
                   "flops_per_token_nanogpt": line["flops_per_token_nanogpt"],
                   "step_s": line["step_time_s"]["median"], "step_s_min": line["step_time_s"]["min"],
                   "compile_s": line["compile_s"], "peak_bytes": line["peak_bytes"],
                   "compiled_bytes": line["compiled_bytes"], "loss_first_last": line["loss_first_last"],
                   "settled": line.get("settled")}
            if "profile" in line:
                rec["profile"] = line["profile"]
            if "analysis" in line:
                a = line["analysis"]
                p = a["prediction"]
                rec.update(estimate_bytes=a["estimate_bytes"], estimate_over_peak=_short(a["estimate_over_peak"]),
                           estimate_over_compiled_bound=_short(a["estimate_over_compiled_bound"]),
                           predicted_step_s=p.get("step_s"), predicted_bound_by=p.get("bound_by"),
                           predicted_no_overlap_s=p.get("step_s_no_overlap"),
                           predicted_over_measured=_short(a.get("predicted_over_measured")),
                           predicted_times_s={k: p.get(k) for k in ("compute_s", "hbm_s", "collective_s")},
                           hbm_bytes=p.get("hbm_bytes"), estimate_parts=a["estimate_parts"])
            recs.append(rec)
    elif job.stage == "peer":
        for line in o.lines:
            if line.get("error"):
                continue
            recs.append({**base, "bench": "train_step", "peer": line.get("peer"),
                         "peer_tokens_per_s": _short(line.get("tokens_per_s"), 1), "peer_mfu": _short(line.get("mfu")),
                         "peer_peak_bytes": line.get("peak_bytes"), "torch": line.get("torch"),
                         "seq_len": line.get("block_size"), "batch_size": line.get("batch"),
                         "flops_per_token_nanogpt": line.get("flops_per_token_nanogpt"),
                         "peer_step_s": (line.get("step_time_s") or {}).get("median"),
                         "peer_compile_s": line.get("compile_s")})
    elif job.stage == "attention":
        for line in o.lines:
            if line.get("benchmark") != "kernels":
                continue
            t = line.get("timing") or {}
            recs.append({**base, "bench": "attention", "op": "attention", "impl": line.get("impl"),
                         "pass": line.get("pass_name"), "batch": line.get("batch"), "heads": line.get("heads"),
                         "seq": line.get("seq"), "head_dim": line.get("head_dim"), "dtype": line.get("dtype"),
                         "causal": line.get("causal"), "tflops": _short(line.get("value")),
                         "ms": _short(t["median_s"] * 1e3) if t.get("median_s") else None,
                         "pct_of_peak": line.get("pct_of_peak"),
                         **({"error": line["error"]} if line.get("error") else {})})
    elif job.stage == "decode":
        for line in o.lines:
            if line.get("benchmark") != "generate":
                continue
            recs.append({**base, "bench": "decode" if line["name"].startswith("decode") else "prefill",
                         "preset": line.get("preset"), "batch": line.get("batch"),
                         "tokens_per_s": _short(line.get("value"), 1),
                         "pct_of_bandwidth_floor": line.get("pct_of_peak"),
                         "step_s": line.get("step_s"), "prompt_len": line.get("prompt_len"),
                         "max_tokens": line.get("max_tokens"), "compile_s": line.get("compile_s")})
    elif job.stage == "serve":
        for line in o.lines:
            if line.get("benchmark") != "serve":
                continue
            keep = {k: v for k, v in line.items() if k not in ("versions", "host_huge_pages", "device", "platform",
                                                                "n_devices", "date", "benchmark")}
            recs.append({**base, "bench": "serve", **keep})
    if o.rc != 0 or (not recs and job.stage not in ("correctness",)):
        recs.append({**base, "bench": job.stage, "error": status if o.rc != 0 else "no records",
                     "tail": o.tail[-600:]})
    return recs


def _junit_records(path: Path, base: dict) -> list[dict]:
    if not path.exists():
        return [{**base, "bench": "correctness", "error": "no junit report (pytest did not finish)"}]
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", None
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (el.get("message") or "").splitlines()[0][:300] if el.get("message") else None
        out.append({**base, "bench": "correctness", "test": case.get("name"), "outcome": outcome,
                    "seconds": _short(float(case.get("time") or 0), 2), "message": message})
    return out


def _peer_ratio(recs: list[dict]) -> None:
    """Beside the peer's figure, the best jaxperf gpt2-small figure of this run at the same batch and sequence."""
    ours = [r for r in recs if r.get("bench") == "train_step" and r.get("preset") == "gpt2-small"
            and r.get("tokens_per_s") and not r.get("peer") and r.get("stage") == "train"]
    for r in recs:
        same = [o for o in ours if (o.get("batch_size"), o.get("seq_len")) == (r.get("batch_size"), r.get("seq_len"))]
        if r.get("peer") and r.get("peer_tokens_per_s") and same and not r.get("ratio"):
            best = max(same, key=lambda x: x["tokens_per_s"])
            r.update(tokens_per_s=best["tokens_per_s"], jaxperf_job=best["job"], jaxperf_mfu=best["mfu"],
                     jaxperf_mfu_nanogpt_count=best["mfu_nanogpt_count"],
                     ratio=_short(best["tokens_per_s"] / r["peer_tokens_per_s"], 3))


def _attention_auto(recs: list[dict]) -> list[dict]:
    """Per shape and pass: the fastest implementation, and `auto` against it (auto's goal: within 5%)."""
    shapes: dict[tuple, dict[str, float]] = {}
    for r in recs:
        if r.get("bench") == "attention" and r.get("ms"):
            shapes.setdefault((r["seq"], r["head_dim"], r["pass"]), {})[r["impl"]] = r["ms"]
    out = []
    for (seq, dh, pass_name), times in sorted(shapes.items()):
        fastest = min(times, key=times.get)
        row = {"bench": "attention_auto", "seq": seq, "head_dim": dh, "pass": pass_name, "fastest": fastest,
               "ms": times}
        if "auto" in times:
            row["auto_over_fastest"] = _short(times["auto"] / times[fastest], 3)
        out.append(row)
    return out


def summarize(recs: list[dict]) -> list[str]:
    """A short table: one line per job or figure that matters."""
    lines = [f"{'stage':<12} {'what':<34} result"]
    for r in recs:
        b, what, res = r.get("bench"), r.get("job", ""), ""
        if r.get("error") and not r.get("impl"):
            res = f"ERROR {r['error']}"
        elif r.get("skipped"):
            res = f"skipped: {r['skipped']}"[:120]
        elif b == "env":
            res = f"{r.get('device_kind')} | {r.get('nvidia_smi')} | jax {r['versions'].get('jax')}"
        elif b == "correctness":
            if r["outcome"] == "passed":
                continue
            what, res = r["test"][:34], f"{r['outcome']}: {r.get('message') or ''}"[:90]
        elif b in ("train_step", "memory") and not r.get("peer"):
            res = (f"{r['tokens_per_s']:>10.0f} tok/s  MFU {100 * r['mfu']:.1f}% (nanoGPT count "
                   f"{100 * r['mfu_nanogpt_count']:.1f}%)  peak {(r['peak_bytes'] or 0) / 2**30:.1f} GiB  "
                   f"step {r['step_s'] * 1e3:.1f} ms")
            if r.get("profile"):
                top = r["profile"]["ops"][0] if r["profile"]["ops"] else ["-", 0]
                res += f"  kernels {r['profile']['kernel_ms_per_step']:.1f} ms/step, top {top[0]} {top[1]:.1f} ms"
            if b == "memory":
                res += (f"  est/peak {r.get('estimate_over_peak')}  pred/meas {r.get('predicted_over_measured')} "
                        f"({r.get('predicted_bound_by')})")
        elif r.get("peer"):
            res = (f"peer {r['peer_tokens_per_s']:.0f} tok/s (MFU {100 * (r.get('peer_mfu') or 0):.1f}%), jaxperf "
                   f"{r.get('tokens_per_s') or 0:.0f}: {r.get('ratio')}x")
        elif b == "attention_auto":
            what = f"attention L={r['seq']} Dh={r['head_dim']} {r['pass']}"
            res = " ".join(f"{k} {v:.2f}ms" for k, v in r["ms"].items()) + f" -> {r['fastest']}"
            if "auto_over_fastest" in r:
                res += f", auto {r['auto_over_fastest']}x"
        elif b == "decode":
            what = f"decode {r['preset']} b{r['batch']}"
            res = f"{r['tokens_per_s']:.0f} tok/s"
        elif b == "serve" and r.get("unit") == "requests/s":
            what = f"serve {r.get('name')}"
            res = f"{r.get('value'):.1f} req/s, goodput {_short(r.get('goodput_rps'), 1)}/s"
        else:
            continue
        lines.append(f"{r.get('stage', b):<12} {what:<34} {res}")
    return lines


def _git_version() -> str | None:
    """HEAD's short hash, with '+dirty' when tracked files differ from it (where the code was copied without its git
    history, pass --label)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                               text=True)
    except OSError:
        return None
    if head.returncode:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def _cannot_run(job: Job, nanogpt_dir: Path) -> str | None:
    """Why a job is skipped rather than run (the peer needs torch and nanoGPT's source), or None."""
    if job.stage != "peer":
        return None
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed (pip install torch, or the 'peer' extra)"
    if not (nanogpt_dir / "model.py").is_file():
        return (f"{nanogpt_dir / 'model.py'} is absent: put nanoGPT's model.py there (from a checkout of nanoGPT; it "
                "is kept out of this repository)")
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for gpu.jsonl, gpu_check.log and junit.xml")
    p.add_argument("--only", default=None, help=f"comma-separated stages from {','.join(STAGES)} (default: "
                                                f"{','.join(DEFAULT_STAGES)})")
    p.add_argument("--full", action="store_true", help="every variant and size (several times the default pass)")
    p.add_argument("--dry-run", action="store_true", help="every stage on the CPU at tiny shapes")
    p.add_argument("--nanogpt-dir", default=str(ROOT / ".peer" / "nanogpt"),
                   help="folder holding nanoGPT's model.py (kept out of this repository)")
    p.add_argument("--budget-s", type=float, default=None,
                   help=f"stop every job after this many seconds in all (default pass: {DEFAULT_BUDGET_S})")
    p.add_argument("--jobs", default=None, help="comma-separated stage/job globs to keep, e.g. 'train/llama-1b_*'")
    p.add_argument("--tests", default=None, help="correctness: a pytest -k expression selecting the gpu tests")
    p.add_argument("--label", default=None, help="the code's version as the records should name it (default: git "
                                                 "HEAD, '+dirty' with uncommitted changes; name it where the copy of "
                                                 "the code has no matching git history)")
    a = p.parse_args(argv)
    stages = a.only.split(",") if a.only else list(STAGES if (a.full or a.dry_run) else DEFAULT_STAGES)
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        p.error(f"unknown stage(s) {unknown}; choose from {','.join(STAGES)}")
    if "env" not in stages:
        stages.insert(0, "env")
    stages = [s for s in STAGES if s in stages]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    junit = out / "junit.xml"
    junit.unlink(missing_ok=True)
    jobs = plan(stages, dry=a.dry_run, full=a.full, nanogpt_dir=Path(a.nanogpt_dir), out=out)
    if a.jobs:
        keep = a.jobs.split(",")
        jobs = [j for j in jobs if j.stage == "env" or any(fnmatch.fnmatch(f"{j.stage}/{j.name}", k) for k in keep)]
    for job in jobs:
        if job.stage == "correctness":
            job.argv += [f"--junitxml={junit}"] + (["-k", a.tests] if a.tests else [])
    base_env = {"JAX_PLATFORMS": "cpu" if a.dry_run else "cuda,cpu", "PYTHONUNBUFFERED": "1",
                "TF_CPP_MIN_LOG_LEVEL": "2", "JAX_COMPILATION_CACHE_DIR": "", "JAXPERF_HUGE_PAGES": "0"}
    if a.dry_run:  # tiny shapes: compiling is most of each job, and LLVM's optimisations most of compiling (-20%)
        base_env["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {DRY_RUN_XLA_FLAGS}".strip()
    env_info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    for name in ("jax", "jaxlib"):
        try:
            env_info[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            env_info[name] = None
    env_info["commit"] = a.label or _git_version()

    default_pass = not (a.only or a.full or a.dry_run)
    budget = a.budget_s if a.budget_s is not None else (DEFAULT_BUDGET_S if default_pass else float("inf"))
    t_start = time.perf_counter()
    stage_start: dict[str, float] = {}
    records: list[dict] = []
    with open(out / "gpu_check.log", "a") as log, open(out / "gpu.jsonl", "a") as sink:
        for job in jobs:
            now = time.perf_counter()
            stage_start.setdefault(job.stage, now)
            stage_left = STAGE_LIMIT_S[job.stage] * (3 if a.full else 1) - (now - stage_start[job.stage])
            total_left = budget - (now - t_start)
            limit = min(job.timeout_s, max(stage_left, 0), total_left)
            if a.dry_run:
                limit = min(job.timeout_s * 4, max(total_left, 0))  # CPU speed is not the question of a dry run
            why_not = _cannot_run(job, Path(a.nanogpt_dir))
            if why_not or limit < 10:
                rec = {"stage": job.stage, "job": job.name, "bench": job.stage, **env_info}
                rec.update({"skipped": why_not} if why_not else {"error": "skipped: stage limit reached"})
                recs = [rec]
            else:
                outcome = run_job(job, limit, log, base_env)
                if job.stage == "env":
                    for line in outcome.lines:
                        env_info["device_kind"] = line.get("device_kind")
                        env_info.update({k: v for k, v in line.get("versions", {}).items() if k in ("jax", "jaxlib")})
                try:
                    recs = normalize(outcome, env_info, junit)
                except Exception as e:  # noqa: BLE001 - an odd output line costs this job's records, not the run
                    recs = [{"stage": job.stage, "job": job.name, "bench": job.stage, **env_info,
                             "error": f"could not read the job's records: {type(e).__name__}: {e}"[:300],
                             "tail": outcome.tail[-600:]}]
                if job.stage == "correctness" and not a.dry_run and not any(
                        r.get("outcome") == "passed" for r in recs):
                    recs.append({"stage": job.stage, "job": job.name, "bench": "correctness", **env_info,
                                 "error": "no gpu test passed (is a GPU visible to jax?)"})
                for r in recs:
                    r.setdefault("commit", env_info.get("commit"))
                if job.stage == "peer":
                    _peer_ratio(records + recs)
            records += recs
            for r in recs:  # written as they come: a run cut short keeps what it measured
                sink.write(json.dumps(r) + "\n")
            sink.flush()
        auto = [{**r, "stage": "attention", "device_kind": env_info.get("device_kind"), "jax": env_info.get("jax"),
                 "date": env_info["date"], "commit": env_info.get("commit")} for r in _attention_auto(records)]
        records += auto
        for r in auto:
            sink.write(json.dumps(r) + "\n")
    print("\n".join(summarize(records)))
    print(f"total {time.perf_counter() - t_start:.0f} s; records in {out / 'gpu.jsonl'}")
    failed = [r for r in records if r.get("bench") == "correctness" and r.get("outcome") in ("failed", "error")]
    return 1 if failed or any(r.get("error") and not r.get("impl") for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
