"""How fast does jaxperf train, and how does that compare with the same model in PyTorch? Tokens/s, MFU, ratio.

    python benchmarks/bench_train.py                                  # tiny preset, jaxperf and the torch peer
    python benchmarks/bench_train.py --presets tiny gpt2-small --peer-python /path/to/venv/bin/python
    python benchmarks/bench_train.py --tiny                           # a smaller tiny model, few steps (CI)

jaxperf side: benchmarks/bench_train_step.py (the Task train step of the preset on all devices: forward, backward,
AdamW, health checks), median of timed steps after warm-up, each step blocked on. MFU = tokens/s x FLOPs/token
(jaxperf.perf.flops) / (devices x peak); it is also the record's pct_of_peak. The two sides take turns, `--rounds`
times (default 3), and each reports its best round; every round's figure is in the records.

Peer: benchmarks/peers/torch_gpt.py, the same architecture, initialisation, AdamW settings, learning-rate schedule,
batch and sequence length, timed the same way, in a subprocess (so its threads and ours never compete) run by
`--peer-python` (default: $JAXPERF_PEER_PYTHON, else this interpreter when it can import torch; with neither, a
record says the peer was skipped and why). Modes: on CPU eager and torch.compile, on GPU torch.compile. A failing
mode is reported with its error string. Host memory is matched: where jaxperf runs with transparent huge pages, so
does the peer (`peer.host_env` in its record). The ratio record is jaxperf tokens/s / peer tokens/s.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import jax

from jaxperf.benchmarks import bench_train_step
from jaxperf.benchmarks._common import emit, record
from jaxperf.perf.cpu_host import reexec_with_huge_pages

HERE = Path(__file__).resolve().parent

NAME = "train"
PEER_SCRIPT = HERE / "peers" / "torch_gpt.py"
TINY_OVERRIDES = ["model.n_layers=2", "model.d_model=64", "model.n_heads=2", "batch_size=8", "seq_len=32"]


def peer_python(explicit: str | None) -> tuple[str | None, str]:
    """(interpreter for the torch peer or None, how it was chosen or why there is none)."""
    if explicit:
        return explicit, "--peer-python"
    env = os.environ.get("JAXPERF_PEER_PYTHON")
    if env:
        return env, "$JAXPERF_PEER_PYTHON"
    if importlib.util.find_spec("torch") is not None:
        return sys.executable, "this interpreter"
    return None, ("torch not installed in this interpreter; pass --peer-python PATH (an interpreter with torch and "
                  "numpy) or set JAXPERF_PEER_PYTHON")


def peer_config(cfg, steps: int, warmup: int, mode: str, device: str) -> dict:
    """The JSON the peer script takes: the resolved model, optimizer, batch and timing of a jaxperf TrainConfig."""
    m = dataclasses.asdict(cfg.model.resolved())
    m["padded_vocab"] = cfg.model.padded_vocab
    return {"model": m, "optim": dataclasses.asdict(cfg.optim), "batch_size": cfg.batch_size,
            "seq_len": cfg.train_seq_len, "steps": steps, "warmup": warmup, "max_steps": cfg.max_steps,
            "mode": mode, "device": device, "seed": 0}


def peer_env() -> tuple[dict[str, str], dict[str, str]]:
    """(environment for the peer, the host-memory settings in it that differ from this process's).

    Where this process has transparent huge pages (jaxperf.perf.cpu_host), the peer gets them too: it inherits
    GLIBC_TUNABLES, and PyTorch's own switch THP_MEM_ALLOC_ENABLE=1 puts its large CPU tensors on huge pages.
    """
    from jaxperf.perf.cpu_host import host_memory

    env, changed = dict(os.environ), {}
    if host_memory().huge_pages and "THP_MEM_ALLOC_ENABLE" not in env:
        env["THP_MEM_ALLOC_ENABLE"] = changed["THP_MEM_ALLOC_ENABLE"] = "1"
    return env, changed


def run_peer(python: str, config: dict, timeout_s: float) -> dict:
    """Run the peer script; its JSON line, or {"error": ...} when it could not run or printed none."""
    cmd = [python, str(PEER_SCRIPT), "--config", json.dumps(config)]
    env, changed = peer_env()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"the peer ran past --peer-timeout={timeout_s:g} s"}
    except OSError as e:
        return {"error": f"cannot start the peer interpreter {python!r}: {e}"}
    for line in reversed(proc.stdout.strip().splitlines()):
        if line.startswith("{"):
            return {**json.loads(line), "host_env": {"GLIBC_TUNABLES": env.get("GLIBC_TUNABLES", ""), **changed}}
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"error": f"the peer exited with {proc.returncode} and printed no result: {' | '.join(tail)}"}


def bench_jaxperf(preset: str, overrides: list[str], steps: int, warmup: int) -> dict:
    with contextlib.redirect_stdout(io.StringIO()):  # its own JSON line is replaced by ours
        return bench_train_step.main(["--preset", preset, "--steps", str(steps), "--warmup", str(warmup), *overrides])


def bench_preset(preset: str, overrides: list[str], steps: int, warmup: int, modes: list[str], python: str | None,
                 why: str, timeout_s: float, rounds: int = 1) -> list[dict]:
    """jaxperf and each peer mode, `rounds` times in turn (jaxperf, peer modes, jaxperf, ...).

    Each side's figure is its best round (the highest median tokens/s); every round's figure is kept in the record. On
    a shared machine the load moves over tens of seconds: taking turns exposes both sides to it alike, and the best
    round is the one least disturbed.
    """
    from jaxperf.config import get_config

    cfg = get_config(preset, overrides)
    device = "cuda" if jax.default_backend() == "gpu" else "cpu"
    mine: list[dict] = []
    peers: dict[str, list[dict]] = {mode: [] for mode in modes} if python is not None else {}
    for _ in range(rounds):
        mine.append(bench_jaxperf(preset, overrides, steps, warmup))
        for mode in peers:
            peers[mode].append(run_peer(python, peer_config(cfg, steps, warmup, mode, device), timeout_s))
    r = max(mine, key=lambda x: x["tokens_per_s"])
    n, peak, fpt = r["devices"], r["peak_flops_per_device"], r["flops_per_token"]
    common = {"preset": preset, "overrides": overrides, "batch_size": cfg.batch_size, "seq_len": cfg.train_seq_len,
              "dtype": cfg.model.dtype, "flops_per_token": fpt, "peak_source": r["peak_source"]}
    jx = r["tokens_per_s"]
    out = [record(NAME, f"{preset}/jaxperf", jx, "tokens/s", value_per_s=jx * fpt, peak_per_s=n * peak, mfu=r["mfu"],
                  step_time_s=r["step_time_s"], compile_s=r["compile_s"], loss_first_last=r["loss_first_last"],
                  rounds=[x["tokens_per_s"] for x in mine], **common)]
    if python is None:
        out.append(record(NAME, f"{preset}/torch", None, "tokens/s", skipped=why, **common))
        return out
    for mode, runs in peers.items():
        name = f"{preset}/torch_{mode}"
        ok = [p for p in runs if "error" not in p and p.get("tokens_per_s")]
        if not ok:
            p = runs[0]
            out.append(record(NAME, name, None, "tokens/s", peer_python=python, peer=p,
                              error=p.get("error", "no tokens_per_s in the peer's output"), **common))
            continue
        p = max(ok, key=lambda x: x["tokens_per_s"])
        tp = p["tokens_per_s"]
        out.append(record(NAME, name, tp, "tokens/s", value_per_s=tp * fpt, peak_per_s=peak, mfu=tp * fpt / peak,
                          peer_python=python, peer=p, rounds=[x.get("tokens_per_s") for x in runs], **common))
        out.append(record(NAME, f"{preset}/jaxperf_over_torch_{mode}", jx / tp, "x", jaxperf_tokens_per_s=jx,
                          torch_tokens_per_s=tp, **common))
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="a smaller tiny model and few steps (CI); peer eager only")
    p.add_argument("--presets", nargs="*", default=["tiny"], help="tiny (default), gpt2-small, ...")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 10, --tiny 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 2, --tiny 1)")
    p.add_argument("--peer", choices=("auto", "none"), default="auto", help="none: jaxperf only")
    p.add_argument("--peer-modes", nargs="*", default=None, choices=("eager", "compile"),
                   help="default: CPU eager and compile, GPU compile (--tiny: eager)")
    p.add_argument("--peer-python", default=None, help="interpreter with torch for the peer (see module doc)")
    p.add_argument("--peer-timeout", type=float, default=1800.0, help="seconds allowed per peer run")
    p.add_argument("--rounds", type=int, default=None,
                   help="turns of jaxperf then each peer mode; each side reports its best (default 3, --tiny 1)")
    p.add_argument("overrides", nargs="*", help="config overrides for every preset (key=value)")
    a = p.parse_args(argv)
    steps = a.steps or (3 if a.tiny else 10)
    warmup = a.warmup or (1 if a.tiny else 2)
    rounds = a.rounds or (1 if a.tiny else 3)
    if steps < 1 or warmup < 1 or rounds < 1:
        raise SystemExit(f"--steps={steps}, --warmup={warmup} and --rounds={rounds} must all be at least 1")
    overrides = (TINY_OVERRIDES if a.tiny else []) + list(a.overrides)
    if a.peer_modes is not None:
        modes = a.peer_modes
    elif a.tiny:
        modes = ["eager"]
    else:
        modes = ["compile"] if jax.default_backend() == "gpu" else ["eager", "compile"]
    if a.peer == "none":
        python, why = None, "--peer none"
    else:
        python, why = peer_python(a.peer_python)
    recs = []
    for preset in a.presets:
        recs += bench_preset(preset, overrides, steps, warmup, modes, python, why, a.peer_timeout, rounds)
    return [emit(r) for r in recs]


if __name__ == "__main__":
    reexec_with_huge_pages()  # XLA:CPU step buffers on huge pages (jaxperf.perf.cpu_host)
    main(sys.argv[1:])
