"""Reliability of whole runs: bitwise resume, crashes during a save, SIGTERM / Ctrl-C, other meshes, two processes.

The crash tests start `jaxperf train` (or a small driver) in subprocesses and kill them; every subprocess is bounded by
a timeout. Runs use a small model on the byte-level corpus and a fixed decay horizon (optim.decay_steps), so that runs
with different max_steps follow the same schedule and their common steps can be compared exactly.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from helpers import SMALL_RUN, cli_env, finish, metrics_by_step, run_cli, start_pair, start_train, wait_for_steps

from jaxperf.config import get_config
from jaxperf.checkpoint import Checkpointer
from jaxperf.train.trainer import Trainer

RUN = [*SMALL_RUN, "optim.decay_steps=50"]


def _train(tmp_path, args, timeout=240, **env):
    return run_cli(tmp_path, "train", *RUN, *args, timeout=timeout, **env)


def _assert_same_steps(a: dict[int, dict], b: dict[int, dict], steps):
    for s in steps:
        assert a[s]["loss"] == b[s]["loss"], (s, a[s]["loss"], b[s]["loss"])  # exact
        assert a[s]["batch_crc32"] == b[s]["batch_crc32"], s


def _start(tmp_path, args, devices=8, **env):
    return start_train(tmp_path, [*RUN, *args], devices, **env)


def _stopped_at(stdout: str) -> int:
    for line in stdout.splitlines():
        if "saved a checkpoint at step" in line:
            return int(line.split("saved a checkpoint at step")[1].split()[0])
    raise AssertionError(f"no 'saved a checkpoint' line in:\n{stdout[-2000:]}")


@pytest.mark.slow
def test_sigterm_then_ctrl_c_then_resume_match_an_uninterrupted_run(tmp_path):
    run = tmp_path / "run"
    stops = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        proc = _start(tmp_path, ["max_steps=100000", "run_dir=run"])
        wait_for_steps(run, (stops[-1] if stops else 0) + 3, proc)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        stops.append(_stopped_at(out))
        with Checkpointer(run / "checkpoints") as ckpt:
            assert ckpt.latest_step() == stops[-1]
    assert stops[1] > stops[0] >= 3
    end = stops[1] + 3
    last = _train(tmp_path, [f"max_steps={end}", "run_dir=run"])
    assert last.returncode == 0, last.stderr[-3000:]
    assert f"at step {stops[1]}" in last.stdout
    straight = _train(tmp_path, [f"max_steps={end}", "run_dir=straight"])
    assert straight.returncode == 0, straight.stderr[-3000:]
    a, b = metrics_by_step(tmp_path / "straight"), metrics_by_step(run)
    assert sorted(a) == sorted(b) == list(range(1, end + 1))
    _assert_same_steps(a, b, range(1, end + 1))


_CRASH_DRIVER = textwrap.dedent("""
    import os, signal, sys
    from orbax.checkpoint._src.path import atomicity
    from jaxperf.config import get_config
    from jaxperf.train.trainer import Trainer

    crash_step = sys.argv[1]
    original = atomicity.AtomicRenameTemporaryPath.finalize

    async def finalize(self, *args, **kwargs):
        if self.get_final().name == crash_step:  # written, not yet committed: die here
            os.kill(os.getpid(), signal.SIGKILL)
        return await original(self, *args, **kwargs)

    atomicity.AtomicRenameTemporaryPath.finalize = finalize
    Trainer(get_config(None, sys.argv[2:])).fit()
""")


@pytest.mark.slow
def test_kill_9_during_async_save_restarts_from_previous_commit(tmp_path):
    driver = tmp_path / "crash.py"
    driver.write_text(_CRASH_DRIVER)
    args = [*RUN, "max_steps=8", "checkpoint_every=2", "run_dir=run"]
    crashed = subprocess.run([sys.executable, str(driver), "4", *args], capture_output=True, text=True,
                             env=cli_env(tmp_path), cwd=tmp_path, timeout=240)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-3000:]
    leftovers = os.listdir(tmp_path / "run" / "checkpoints")
    assert any(name.startswith("4") and name != "4" for name in leftovers), leftovers  # the uncommitted write
    with Checkpointer(tmp_path / "run" / "checkpoints") as ckpt:
        assert ckpt.all_steps() == [2]  # never reported as the latest
    resumed = _train(tmp_path, ["max_steps=8", "checkpoint_every=2", "run_dir=run"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at step 2" in resumed.stdout
    assert _train(tmp_path, ["max_steps=8", "run_dir=straight"]).returncode == 0
    _assert_same_steps(metrics_by_step(tmp_path / "straight"), metrics_by_step(tmp_path / "run"), range(1, 9))
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["4", "6", "8"]  # the temporary write is gone


def _trainer(tmp_path, devices, *extra):
    cfg = get_config(None, [*RUN, "run_dir=" + str(tmp_path / "run"), "parallel.strategy=fsdp", *extra])
    return Trainer(cfg, devices=devices)


def _host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


# One move onto fewer devices runs at both ends of the jax range; the others are slow tests: one Python version runs
# them.
@pytest.mark.parametrize("first, second", [
    pytest.param(("8", []), ("4", []), id="8to4"),
    pytest.param(("4", []), ("8", []), id="4to8", marks=pytest.mark.slow),
    pytest.param(("8", []), ("8", ["parallel.data=2", "parallel.fsdp=4"]), id="1dto2d", marks=pytest.mark.slow),
    pytest.param(("8", ["model.n_layers=2", "parallel.stage=2", "microbatches=2"]), ("8", ["model.n_layers=2"]),
                 id="stage2_to_fsdp", marks=pytest.mark.slow),
    pytest.param(("8", ["model.n_layers=2"]), ("8", ["model.n_layers=2", "parallel.stage=2", "microbatches=2"]),
                 id="fsdp_to_stage2", marks=pytest.mark.slow),
])
def test_resume_onto_another_mesh_is_bitwise_and_trains_on(tmp_path, first, second):
    devices = lambda n: jax.devices()[: int(n)]  # noqa: E731
    t1 = _trainer(tmp_path, devices(first[0]), "max_steps=3", *first[1])
    s1 = t1.fit()
    saved = _host({"params": s1["state"].params, "opt_state": s1["state"].opt_state})

    t2 = _trainer(tmp_path, devices(second[0]), "max_steps=5", *second[1])
    with Checkpointer(t2.run_dir / "checkpoints") as ckpt:
        state, start = t2.init_or_restore(ckpt)
    assert start == 3
    for got, want in zip(_host({"params": state.params, "opt_state": state.opt_state}), saved):
        np.testing.assert_array_equal(got, want, strict=True)
    for leaf in jax.tree.leaves(state.params):
        assert leaf.sharding.mesh.devices.size == int(second[0])
    layers = state.params["blocks"]["attn"]["wq_DxHxDh"].addressable_shards[0].data.shape[0]
    assert layers == (1 if "parallel.stage=2" in second[1] else state.params["blocks"]["attn"]["wq_DxHxDh"].shape[0])
    s2 = t2.fit()
    assert sorted(s2["losses"]) == [3, 4] and all(np.isfinite(v) for v in s2["losses"].values())
    # The same steps on the first mesh, for comparison: equal up to the reduction order of another mesh.
    t3 = _trainer(tmp_path / "ref", devices(first[0]), "max_steps=5", *first[1])
    s3 = t3.fit()
    np.testing.assert_allclose([s2["losses"][k] for k in (3, 4)], [s3["losses"][k] for k in (3, 4)], rtol=2e-5)


def _start_pair(tmp_path, args):
    return start_pair(tmp_path, [*RUN, *args])


@pytest.mark.slow
def test_sigterm_to_one_of_two_processes_saves_the_same_step_everywhere(tmp_path):
    procs = _start_pair(tmp_path, ["max_steps=100000", "run_dir=run"])
    wait_for_steps(tmp_path / "run", 3, procs[0])
    procs[1].send_signal(signal.SIGTERM)  # the process that does not log: the notice must reach the other
    results = finish(procs)
    for code, out, err in results:
        assert code == 0, err[-3000:]
    stop = _stopped_at(results[0][1])
    with Checkpointer(tmp_path / "run" / "checkpoints") as ckpt:
        assert ckpt.all_steps()[-1] == stop
    end = stop + 3
    resumed = finish(_start_pair(tmp_path, [f"max_steps={end}", "run_dir=run"]))
    straight = finish(_start_pair(tmp_path, [f"max_steps={end}", "run_dir=straight"]))
    for code, out, err in resumed + straight:
        assert code == 0, err[-3000:]
    assert f"at step {stop}" in resumed[0][1]
    a, b = metrics_by_step(tmp_path / "straight"), metrics_by_step(tmp_path / "run")
    _assert_same_steps(a, b, range(1, end + 1))


@pytest.mark.slow
def test_checkpoint_of_another_model_is_a_clear_error(tmp_path):
    first = _train(tmp_path, ["max_steps=2", "run_dir=run"])
    assert first.returncode == 0, first.stderr[-3000:]
    other = _train(tmp_path, ["max_steps=4", "run_dir=run", "model.d_model=48"])
    assert other.returncode == 2, other.stderr[-3000:]
    assert "cannot resume" in other.stderr and "another configuration" in other.stderr, other.stderr[-2000:]
    assert re.search(r"saved \([\d, ]*32[\d, ]*\), target \([\d, ]*48", other.stderr), other.stderr[-2000:]
    with Checkpointer(tmp_path / "run" / "checkpoints") as ckpt:
        assert ckpt.all_steps() == [2]  # nothing lost, nothing moved aside
