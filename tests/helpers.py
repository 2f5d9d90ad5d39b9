"""Helpers for tests that run `jaxperf train` in subprocesses: the environment, one or two processes, their outputs,
and the metrics a run wrote. Every wait is bounded."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path


def cli_env(tmp_path, devices: int = 8, **extra) -> dict:
    """The environment of a CPU run with `devices` simulated devices and its own cache folder."""
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
            "XDG_CACHE_HOME": str(tmp_path / "cache"), **extra}


def start_train(tmp_path, args, devices: int = 8, **env) -> subprocess.Popen:
    """`jaxperf train *args` in tmp_path, output captured."""
    return subprocess.Popen([sys.executable, "-m", "jaxperf.cli", "train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=cli_env(tmp_path, devices, **env), cwd=tmp_path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def start_pair(tmp_path, args, devices: int = 4, **env) -> list[subprocess.Popen]:
    """Two processes of one job (a coordinator on a free localhost port), `devices` CPU devices each."""
    port = free_port()
    return [start_train(tmp_path, args, devices, JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES="2",
                        JAX_PROCESS_ID=str(i), **env) for i in range(2)]


def finish(procs, timeout: float = 300) -> list[tuple[int, str, str]]:
    """(return code, stdout, stderr) of each process; on a timeout every process is killed and the error raised."""
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


def metrics_by_step(run_dir: Path) -> dict[int, dict]:
    """step -> the last metrics record of that step (a resumed run appends to the same file)."""
    out = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "loss" in r:
            out[r["step"]] = r
    return out
