"""Several processes on localhost (gloo on CPU): the same training as one process, and no hang when one dies."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest
from helpers import SMALL_RUN, finish, metrics_by_step, start_pair, start_train

RUN = [*SMALL_RUN, "optim.decay_steps=50", "compile_cache_dir="]


def _start(tmp_path, args, devices: int, **env):
    return start_train(tmp_path, [*RUN, *args], devices, **env)


def _pair(tmp_path, args, **env):
    return start_pair(tmp_path, [*RUN, *args], **env)


@pytest.mark.slow
def test_two_processes_of_four_devices_train_like_one_process_of_eight(tmp_path):
    steps = 4
    one = finish([_start(tmp_path, [f"max_steps={steps}", "run_dir=one"], 8)])
    two = finish(_pair(tmp_path, [f"max_steps={steps}", "run_dir=two"]))
    for code, out, err in one + two:
        assert code == 0, err[-3000:]
    assert "loss" in two[0][1] and "loss" not in two[1][1], two[1][1][-2000:]  # progress from process 0 only
    a, b = metrics_by_step(tmp_path / "one"), metrics_by_step(tmp_path / "two")
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
