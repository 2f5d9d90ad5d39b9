"""Several processes on localhost (gloo on CPU): the same training as one process, and no hang when one dies."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

RUN = [
    "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.max_seq_len=32", "batch_size=8",
    "data.max_bytes=300000", "optim.decay_steps=50", "optim.warmup_steps=2", "log_every=1", "eval_every=0",
    "checkpoint_every=0", "sample_tokens=0", "tensorboard=false", "compile_cache_dir=",
]


def _env(tmp_path, devices: int, **extra) -> dict:
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
            "XDG_CACHE_HOME": str(tmp_path / "cache"), **extra}


def _start(tmp_path, args, devices: int, **env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "jaxperf.cli", "train", *RUN, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(tmp_path, devices, **env), cwd=tmp_path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _pair(tmp_path, args, **env) -> list[subprocess.Popen]:
    port = _free_port()
    return [_start(tmp_path, args, 4, JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES="2",
                   JAX_PROCESS_ID=str(i), **env) for i in range(2)]


def _finish(procs, timeout=300):
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs


def _losses(run_dir: Path) -> dict[int, dict]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "loss" in r:
            out[r["step"]] = r
    return out


@pytest.mark.slow
def test_two_processes_of_four_devices_train_like_one_process_of_eight(tmp_path):
    steps = 4
    one = _finish([_start(tmp_path, [f"max_steps={steps}", "run_dir=one"], 8)])
    two = _finish(_pair(tmp_path, [f"max_steps={steps}", "run_dir=two"]))
    for code, out, err in one + two:
        assert code == 0, err[-3000:]
    assert "loss" in two[0][1] and "loss" not in two[1][1], two[1][1][-2000:]  # progress from process 0 only
    a, b = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert sorted(a) == sorted(b) == list(range(1, steps + 1))
    for s in range(1, steps + 1):
        # The same global batch (each process reads its half) and the same math; only the order of the
        # cross-device sums may differ.
        assert b[s]["loss"] == pytest.approx(a[s]["loss"], rel=1e-5, abs=1e-6), (s, a[s]["loss"], b[s]["loss"])
        assert b[s]["grad_norm"] == pytest.approx(a[s]["grad_norm"], rel=1e-4), s


@pytest.mark.slow
def test_when_one_process_dies_the_other_exits_with_an_error_instead_of_hanging(tmp_path):
    procs = _pair(tmp_path, ["max_steps=100000", "run_dir=run", "handle_signals=false"],
                  JAXPERF_HEARTBEAT_TIMEOUT_S="10")
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert time.time() < deadline and all(p.poll() is None for p in procs), procs[0].communicate()[1][-3000:]
        time.sleep(0.2)
    procs[1].send_signal(signal.SIGKILL)
    killed_at = time.time()
    try:
        procs[0].wait(timeout=120)  # heartbeat timeout 10 s, plus the time to notice and shut down
    except subprocess.TimeoutExpired:
        procs[0].kill()
        pytest.fail("the surviving process was still running 120 s after its peer died")
    waited = time.time() - killed_at
    assert procs[0].returncode != 0, procs[0].communicate()[1][-3000:]
    assert waited < 120, waited
