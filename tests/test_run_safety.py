"""Nothing is lost and nothing is recorded falsely: one writer per run directory, saves that fail loudly, refusals
that change nothing, checksums over the metadata, every number checked, clear errors for a broken environment.

Each test injects one fault the way it happens in practice (a second process, a file size limit, a read-only
directory, a flipped digit, a truncated file) and checks that what was there is unchanged, that the exit is bounded
and non-zero, and that the message names the path or setting and the fix. Permission faults need another user than
root: as root they run the job as `nobody` through setpriv (skipped where that is not possible).
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import functools
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import SMALL_RUN, cli_env, losses, run_cli, start_train, wait_for_steps

from jaxperf import cli
from jaxperf.checkpoint import Checkpointer, CheckpointPermissionError, CheckpointSaveError, CorruptCheckpointError
from jaxperf.config import get_config
from jaxperf.train import hooks
from jaxperf.train.hooks import MetricsWriteError
from jaxperf.train.rundir import LOCK_NAME
from jaxperf.train.trainer import Trainer

RUN = [*SMALL_RUN, "optim.decay_steps=50"]


def _train(tmp_path, *args, timeout=240, **env):
    return run_cli(tmp_path, "train", *RUN, *args, timeout=timeout, **env)


def _snapshot(root: Path) -> dict[str, bytes]:
    """Every file under root with its bytes (what "unchanged" is checked against); a save still being written
    (Orbax's `*.orbax-checkpoint-tmp`) is not part of it."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
            and p.name != LOCK_NAME and "orbax-checkpoint-tmp" not in str(p)}


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.startswith("jaxperf train:")]
    assert len(lines) == 1, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


# ---------------------------------------------------------------------------------------------------------------------
# 1. One writer per run directory


@pytest.mark.slow
def test_a_second_run_on_a_locked_run_dir_is_refused_and_changes_nothing(tmp_path):
    first = start_train(tmp_path, [*RUN, "max_steps=100000", "checkpoint_every=2", "run_dir=run"])
    try:
        wait_for_steps(tmp_path / "run", 4, first)
        second = _train(tmp_path, "max_steps=50", "run_dir=run", "lr=5e-3", timeout=120)
        assert second.returncode == 2
        line = _one_line(second.stderr)
        assert f"run_dir run is in use by pid {first.pid} on host" in line and "another run_dir" in line, line
        config = json.loads((tmp_path / "run" / "config.json").read_text())
        assert config["optim"]["lr"] != 5e-3  # the refused run wrote nothing
        first.send_signal(signal.SIGTERM)
        out, err = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, err[-3000:]
    steps = losses(tmp_path / "run")
    assert sorted(steps) == list(range(1, max(steps) + 1))  # one writer: every step once, in order


@pytest.mark.slow
def test_a_lock_left_by_a_dead_process_does_not_block_the_next_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_NAME).write_text(json.dumps({"host": "gone", "pid": 999999, "started": "2026-01-01T00:00:00"}))
    out = _train(tmp_path, "max_steps=2", "run_dir=run", devices=1)
    assert out.returncode == 0, out.stderr[-3000:]


# ---------------------------------------------------------------------------------------------------------------------
# 2. resume=false on a run directory that holds checkpoints


@pytest.mark.slow
def test_resume_false_on_an_earlier_run_is_refused_and_start_over_moves_it_aside(tmp_path):
    assert _train(tmp_path, "max_steps=2", "run_dir=run", devices=1).returncode == 0
    before = _snapshot(tmp_path / "run")
    refused = _train(tmp_path, "max_steps=3", "run_dir=run", "resume=false", "lr=5e-3", devices=1)
    assert refused.returncode == 2
    line = _one_line(refused.stderr)
    assert "already holds a run and resume=false" in line and "start_over=true" in line, line
    assert _snapshot(tmp_path / "run") == before
    fresh = _train(tmp_path, "max_steps=3", "run_dir=run", "start_over=true", devices=1)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert "resumed" not in fresh.stdout and sorted(losses(tmp_path / "run")) == [1, 2, 3]
    (moved,) = (tmp_path / "run" / "previous").iterdir()
    assert _snapshot(moved) == before  # the earlier run, byte for byte, out of the way


# ---------------------------------------------------------------------------------------------------------------------
# 3. A checkpoint write that fails


@pytest.mark.slow
def test_a_failing_save_stops_the_run_at_once_and_the_next_start_resumes_from_the_last_good_step(tmp_path):
    assert _train(tmp_path, "max_steps=2", "checkpoint_every=2", "run_dir=run", devices=1).returncode == 0
    t0 = time.time()
    # A file size limit of 24 KiB (ulimit -f counts KiB; SIGXFSZ ignored, so a write past it fails with EFBIG).
    command = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "jaxperf.cli", "train", *RUN, "max_steps=40",
                                                "checkpoint_every=2", "run_dir=run"])
    failed = subprocess.run(["sh", "-c", f"trap '' XFSZ; ulimit -f 24; exec {command}"], capture_output=True,
                            text=True, env=cli_env(tmp_path, 1), cwd=tmp_path, timeout=240)
    assert failed.returncode == 3, failed.stderr[-3000:]
    assert time.time() - t0 < 200
    line = _one_line(failed.stderr)
    assert "checkpoint step 4 could not be saved in" in line and "File too large [errno 27]" in line, line
    assert "run/checkpoints/4.orbax-checkpoint-tmp/" in line and len(line) < 400, line
    assert "step 2 is the last good checkpoint" in line, line
    assert max(losses(tmp_path / "run")) < 10  # it stopped at the failing step, not 40
    with Checkpointer(tmp_path / "run" / "checkpoints") as ckpt:
        assert ckpt.all_steps() == [2]
    again = _train(tmp_path, "max_steps=4", "checkpoint_every=2", "run_dir=run", devices=1)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "at step 2" in again.stdout


def _as_other_user() -> list[str]:
    """Command prefix that runs a job as a user that permission bits apply to (root ignores them)."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("permission faults need a non-root user: running as root without setpriv")
    prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    why = _other_user_cannot_run(tuple(prefix))
    if why:
        pytest.skip(f"permission faults need this Python runnable by uid 65534, and it is not: {why}")
    return prefix


@functools.cache
def _other_user_cannot_run(prefix: tuple[str, ...]) -> str:
    """"" when the other user can start this interpreter; else its error (e.g. a Python built under /root)."""
    probe = subprocess.run([*prefix, sys.executable, "-c", "import jax"], capture_output=True, text=True, timeout=120)
    return "" if probe.returncode == 0 else (probe.stderr.strip().splitlines() or ["exit %d" % probe.returncode])[-1]


@pytest.fixture
def shared_dir():
    """A directory the other user may write (pytest's tmp_path is private to root)."""
    path = Path(tempfile.mkdtemp(prefix="jaxperf-perm-"))
    path.chmod(0o777)
    yield path
    subprocess.run(["chmod", "-R", "u+rwx", str(path)], check=False)
    shutil.rmtree(path, ignore_errors=True)


def _run_as_other(path: Path, *args, timeout=240):
    env = {**cli_env(path, 1), "HOME": str(path), "XDG_CACHE_HOME": str(path / "cache")}
    return subprocess.run([*_as_other_user(), sys.executable, "-m", "jaxperf.cli", "train", *RUN, *args],
                          capture_output=True, text=True, env=env, cwd=path, timeout=timeout)


@pytest.mark.slow
def test_a_checkpoint_directory_made_read_only_stops_the_run_with_the_path_and_the_last_good_step(shared_dir):
    first = _run_as_other(shared_dir, "max_steps=2", "checkpoint_every=2", "run_dir=run")
    assert first.returncode == 0, first.stderr[-3000:]
    ckpts = shared_dir / "run" / "checkpoints"
    ckpts.chmod(0o555)  # read-only before the start: refused at once, nothing trained
    refused = _run_as_other(shared_dir, "max_steps=4", "run_dir=run", timeout=120)
    assert refused.returncode == 2 and "cannot be read and written by this user" in _one_line(refused.stderr)
    ckpts.chmod(0o777)
    env = {**cli_env(shared_dir, 1), "HOME": str(shared_dir), "XDG_CACHE_HOME": str(shared_dir / "cache")}
    proc = subprocess.Popen([*_as_other_user(), sys.executable, "-m", "jaxperf.cli", "train", *RUN, "max_steps=100000",
                             "checkpoint_every=4", "run_dir=run"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=shared_dir)
    try:
        wait_for_steps(shared_dir / "run", 4, proc)  # past step 2's checkpoint, before step 4's save
        ckpts.chmod(0o555)  # read-only while it trains
        before = _snapshot(ckpts)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 3, err[-3000:]
    line = _one_line(err)
    assert "could not be saved in" in line and "Permission denied [errno 13]" in line, line
    assert "is the last good checkpoint" in line, line
    assert _snapshot(ckpts) == before  # nothing of the good checkpoints touched


# ---------------------------------------------------------------------------------------------------------------------
# 4. config.json describes the checkpoints


@pytest.mark.slow
def test_a_refused_resume_leaves_config_json_and_a_changed_resume_is_recorded(tmp_path):
    assert _train(tmp_path, "max_steps=2", "run_dir=run", devices=1).returncode == 0
    config = (tmp_path / "run" / "config.json").read_text()
    other = _train(tmp_path, "max_steps=4", "run_dir=run", "model.d_model=48", devices=1)
    assert other.returncode == 2 and "another configuration" in _one_line(other.stderr)
    assert (tmp_path / "run" / "config.json").read_text() == config
    changed = _train(tmp_path, "max_steps=4", "run_dir=run", "lr=5e-4", devices=1)
    assert changed.returncode == 0, changed.stderr[-3000:]
    assert "settings changed at step 2: max_steps 2 -> 4, optim.lr 0.002 -> 0.0005" in changed.stdout, changed.stdout
    (entry,) = [json.loads(x) for x in (tmp_path / "run" / "config_history.jsonl").read_text().splitlines()]
    assert entry["step"] == 2 and entry["changes"]["optim.lr"] == {"old": 2e-3, "new": 5e-4}
    assert json.loads((tmp_path / "run" / "config.json").read_text())["optim"]["lr"] == 5e-4


# ---------------------------------------------------------------------------------------------------------------------
# 5. Nothing intact, and permission errors


def _flip_data(step_dir: Path):
    big = max((p for p in (step_dir / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(big.read_bytes())
    for i in range(len(data) // 3, len(data) // 3 + 8):
        data[i] ^= 0xFF
    big.write_bytes(bytes(data))


@pytest.mark.slow
def test_when_every_checkpoint_is_corrupt_every_start_refuses_until_start_over(tmp_path):
    assert _train(tmp_path, "max_steps=4", "checkpoint_every=2", "run_dir=run", devices=1).returncode == 0
    for step in (2, 4):
        _flip_data(tmp_path / "run" / "checkpoints" / str(step))
    for attempt in range(2):  # the first start moves them aside, the second must not start from step 0 either
        out = _train(tmp_path, "max_steps=6", "run_dir=run", devices=1)
        assert out.returncode == 2, out.stderr[-3000:]
        line = _one_line(out.stderr)
        assert "no intact checkpoint" in line and "2.corrupt, 4.corrupt" in line and "start_over=true" in line, line
        assert "step 1" not in out.stdout and not (tmp_path / "run" / "checkpoints" / "6").exists()
    fresh = _train(tmp_path, "max_steps=2", "run_dir=run", "start_over=true", devices=1)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    (moved,) = (tmp_path / "run" / "previous").iterdir()
    assert sorted(p.name for p in (moved / "checkpoints").iterdir()) == ["2.corrupt", "4.corrupt"]


def _tree(seed):
    x = jax.random.normal(jax.random.key(seed), (64, 32))
    return {"params": {"w": x}, "step": np.int32(seed)}


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                        if isinstance(x, jax.Array) else x, tree)


def test_an_unreadable_step_is_a_permission_error_and_nothing_is_moved(shared_dir):
    prefix = _as_other_user()
    with Checkpointer(shared_dir / "ck") as ckpt:
        ckpt.save(1, _tree(1), metadata={"data_step": 1})
        ckpt.save(2, _tree(2), metadata={"data_step": 2})
    subprocess.run(["chmod", "-R", "a+rwX", str(shared_dir / "ck")], check=True)
    (shared_dir / "ck" / "2").chmod(0o000)
    probe = ("import jax, numpy as np\nfrom jaxperf.checkpoint import Checkpointer, CheckpointPermissionError\n"
             "t = {'params': {'w': jax.ShapeDtypeStruct((64, 32), np.float32)}, 'step': np.int32(0)}\n"
             f"c = Checkpointer({str(shared_dir / 'ck')!r})\n"
             "try:\n    c.restore_latest(t)\nexcept CheckpointPermissionError as e:\n    print('PERM', e)\n")
    out = subprocess.run([*prefix, sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         env={**cli_env(shared_dir, 1), "HOME": str(shared_dir)})
    assert out.stdout.startswith("PERM checkpoint step 2:"), out.stdout + out.stderr[-2000:]
    assert "permission denied" in out.stdout and "chmod -R u+rX" in out.stdout
    assert sorted(os.listdir(shared_dir / "ck")) == ["1", "2"]  # intact steps are never moved aside
    if not prefix:  # as this user, the same error in-process too
        with Checkpointer(shared_dir / "ck") as ckpt, pytest.raises(CheckpointPermissionError):
            ckpt.restore_latest(_abstract(_tree(0)))


# ---------------------------------------------------------------------------------------------------------------------
# 6. The metadata is covered by the checksums


def test_a_flipped_digit_in_the_data_position_is_caught_and_the_older_step_used(tmp_path):
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(10, _tree(1), metadata={"data_step": 10, "seed": 0})
        ckpt.save(20, _tree(2), metadata={"data_step": 20, "seed": 0})
    meta = tmp_path / "20" / "meta" / "metadata"
    text = meta.read_text()
    assert '"data_step": 20' in text
    meta.write_text(text.replace('"data_step": 20', '"data_step": 21'))
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(CorruptCheckpointError, match=r"step 20 .*metadata .* does not match the checksum"):
            ckpt.restore(20, _abstract(_tree(0)))
        state, meta_back, step = ckpt.restore_latest(_abstract(_tree(0)))
    assert step == 10 and meta_back["data_step"] == 10 and int(state["step"]) == 1


# ---------------------------------------------------------------------------------------------------------------------
# 7. Every number checked before anything compiles


@pytest.mark.parametrize("override, message", [
    ("lr=-1e-3", "optim.lr=-0.001 must be greater than 0 (peak learning rate): e.g. optim.lr=0.001"),
    ("lr=nan", "optim.lr=nan must be a finite number"),
    ("checkpoint_every=-1", "checkpoint_every=-1 must be at least 0"),
    ("log_every=0", "log_every=0 must be at least 1"),
    ("batch_size=0", "batch_size=0 must be at least 1"),
    ("n_heads=0", "model.n_heads=0 must be at least 1"),
    ("d_model=0", "model.d_model=0 must be at least 1"),
    ("n_layers=0", "model.n_layers=0 must be at least 1"),
    ("keep_checkpoints=0", "keep_checkpoints=0 must be at least 1"),
    ("prefetch=0", "data.prefetch=0 must be at least 1"),
    ("seq_len=0", "seq_len=0 must be at least 1"),
    ("max_steps=-5", "max_steps=-5 must be at least 1"),
    ("fsdp=2", "uses 2 of the 8 devices, leaving 6 idle: set one axis to -1"),
    ("val_fraction=1.5", "data.val_fraction=1.5 must be in [0, 1)"),
    ("b2=1", "optim.b2=1.0 must be in [0, 1)"),
])
def test_every_number_is_checked_before_anything_happens(tmp_path, override, message):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = cli.main(["train", f"run_dir={tmp_path / 'run'}", override])
    assert code == 2
    (line,) = err.getvalue().strip().splitlines()
    assert message in line, line
    assert not (tmp_path / "run").exists()  # refused before anything was written


# ---------------------------------------------------------------------------------------------------------------------
# 8. A broken environment gets one clear line


def test_a_run_dir_that_is_a_file_is_one_clear_line(tmp_path):
    (tmp_path / "run").write_text("not a directory")
    out = _train(tmp_path, "max_steps=2", "run_dir=run", devices=1, timeout=120)
    assert out.returncode == 2
    assert "run_dir run is a file, not a directory: choose another run_dir" in _one_line(out.stderr)


def test_an_unwritable_run_dir_is_one_clear_line(shared_dir):
    (shared_dir / "run").mkdir()
    (shared_dir / "run").chmod(0o555)
    out = _run_as_other(shared_dir, "max_steps=2", "run_dir=run", timeout=120)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "run_dir run is not writable by this user" in _one_line(out.stderr)


def test_a_read_only_metrics_file_is_refused_before_anything_is_written(shared_dir):
    (shared_dir / "run").mkdir()
    (shared_dir / "run").chmod(0o777)
    (shared_dir / "run" / "metrics.jsonl").write_text("")
    (shared_dir / "run" / "metrics.jsonl").chmod(0o444)
    out = _run_as_other(shared_dir, "max_steps=2", "run_dir=run", timeout=120)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "cannot write run/metrics.jsonl: Permission denied [errno 13]" in _one_line(out.stderr)
    assert not (shared_dir / "run" / "config.json").exists() and not (shared_dir / "run" / "checkpoints").exists()


def test_an_unwritable_data_cache_dir_is_one_line_naming_the_setting(shared_dir):
    (shared_dir / "cache-ro").mkdir()
    (shared_dir / "cache-ro").chmod(0o555)
    out = _run_as_other(shared_dir, "max_steps=2", "run_dir=run", "data.cache_dir=cache-ro", timeout=120)
    assert out.returncode == 2, out.stderr[-3000:]
    line = _one_line(out.stderr)
    assert "data.cache_dir=cache-ro cannot be used: cache-ro/" in line and "Permission denied [errno 13]" in line
    assert line.endswith("make it writable by this user or choose another data.cache_dir"), line


def test_a_second_ctrl_c_that_lands_in_a_gc_callback_still_interrupts(capsys):
    # A signal handler runs between any two bytecodes: in a garbage-collector callback (JAX has one) its
    # KeyboardInterrupt would be printed as "Exception ignored" and lost, and the run would go on.
    import gc

    request = hooks.StopRequest()

    def second_ctrl_c_during_gc(phase, info):
        if phase == "start":
            gc.callbacks.remove(second_ctrl_c_during_gc)
            request._handle(signal.SIGINT, None)

    with request:
        request._handle(signal.SIGINT, None)  # the first: stop after the current step
        gc.callbacks.append(second_ctrl_c_during_gc)
        try:
            with pytest.raises(KeyboardInterrupt):
                gc.collect()
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:  # the signal, sent again from a thread, is handled here
                    time.sleep(0.01)
        finally:
            with contextlib.suppress(ValueError):
                gc.callbacks.remove(second_ctrl_c_during_gc)
    assert "Exception ignored" not in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) != request._handle and sys.unraisablehook != request._unraisable


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once_in_one_line(tmp_path):
    proc = start_train(tmp_path, [*RUN, "max_steps=100000", "run_dir=run"], devices=1)
    try:
        wait_for_steps(tmp_path / "run", 3, proc)
        proc.send_signal(signal.SIGINT)  # saves after the current step...
        time.sleep(0.1)
        proc.send_signal(signal.SIGINT)  # ...unless a second one comes first
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, (proc.returncode, err[-3000:])
    assert "stopped at once by a second Ctrl-C, without saving" in _one_line(err)
    assert len(err.strip().splitlines()) == 2, err[-3000:]  # the first Ctrl-C's note and that line


@pytest.mark.slow
def test_a_token_file_truncated_during_training_stops_with_its_name_not_sigbus(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 256, 400_000).astype(np.uint16)
    path = tmp_path / "tokens.bin"
    tokens.tofile(path)
    proc = start_train(tmp_path, [*RUN, "max_steps=100000", "run_dir=run", f"data.source={path}"], devices=1)
    try:
        wait_for_steps(tmp_path / "run", 3, proc)
        with open(path, "r+b") as f:
            f.truncate(1000)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 4, (proc.returncode, err[-3000:])  # not -SIGBUS
    line = _one_line(err)
    assert f"token file {path} shrank from 800000 to 1000 bytes" in line, line


def test_unreadable_array_files_are_named(tmp_path):
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, _tree(1))
        ckpt.save(2, _tree(2))
    data = max((p for p in (tmp_path / "2" / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 3)
    with Checkpointer(tmp_path) as ckpt, pytest.raises(CorruptCheckpointError) as info:
        ckpt.restore(2, _abstract(_tree(0)))
    msg = str(info.value)
    assert "array params['w'] in" in msg and f"{tmp_path}/2/params" in msg and len(msg) < 600, msg
    assert "{" not in msg.split("cannot be read:")[1]  # no TensorStore spec
    shutil.rmtree(tmp_path / "1" / "params" / "ocdbt.process_0", ignore_errors=True)
    for f in (tmp_path / "1" / "params").glob("*manifest*"):
        f.unlink()
    with Checkpointer(tmp_path) as ckpt, pytest.raises(CorruptCheckpointError) as info:
        ckpt.restore(1, _abstract(_tree(0)))
    assert f"{tmp_path}/1/params" in str(info.value) and "NoneType" not in str(info.value), str(info.value)


# ---------------------------------------------------------------------------------------------------------------------
# 9. The record: whole lines, a torn tail cut off at resume, a full disk stops the run like a failed save


def _trainer(tmp_path, *extra) -> Trainer:
    cfg = get_config("tiny", [*RUN, f"run_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}", *extra])
    return Trainer(cfg, devices=jax.devices()[:1])


def _records(run_dir: Path) -> list[dict]:
    text = (run_dir / "metrics.jsonl").read_text()
    assert text.endswith("\n"), text[-200:]
    return [json.loads(line) for line in text.splitlines()]  # every line a whole record


class _FullDisk:
    """The os module for jaxperf.train.hooks, whose writes run out of space from the record of step `step` on: half
    of that line is written, then ENOSPC (a disk filling up in the middle of a write), and every write after it."""

    def __init__(self, step: int):
        self.marker, self.full = f'{{"step": {step},'.encode(), False

    def write(self, fd, data):
        if self.full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if bytes(data).startswith(self.marker):
            self.full = True
            return os.write(fd, bytes(data)[: len(data) // 2])
        return os.write(fd, data)

    def __getattr__(self, name):
        return getattr(os, name)


@pytest.mark.slow
def test_a_full_disk_while_writing_the_record_saves_a_checkpoint_and_stops(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path, "max_steps=6")
    monkeypatch.setattr(hooks, "os", _FullDisk(step=3))
    with pytest.raises(MetricsWriteError) as info:
        trainer.fit()
    monkeypatch.undo()
    message = str(info.value)
    assert isinstance(info.value, CheckpointSaveError)  # jaxperf train exits with status 3, as for a failed save
    assert message == (f"the record {tmp_path}/run/metrics.jsonl could not be written at step 3: No space left on "
                       f"device [errno 28]; saved a checkpoint at step 4: fix that and run the same command again to "
                       f"continue from it"), message
    assert [r["step"] for r in _records(tmp_path / "run")] == [1, 2]  # the half-written line was taken back
    with Checkpointer(tmp_path / "run" / "checkpoints", read_only=True) as ckpt:
        assert ckpt.all_steps() == [4]
    trainer.fit()  # the disk has room again: on from step 4
    assert [r["step"] for r in _records(tmp_path / "run")] == [1, 2, 5, 6]


def test_a_torn_last_line_is_cut_off_at_resume_and_said_once(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    # Two whole records and what a kill inside the write of the third leaves.
    (tmp_path / "run" / "metrics.jsonl").write_bytes(b'{"step": 1, "loss": 5.5}\n{"step": 2, "loss": 5.3}\n'
                                                     b'{"step": 3, "loss": 5.12')
    _trainer(tmp_path, "max_steps=2").fit()
    out = capsys.readouterr().out
    assert out.count("cut off a torn last line (24 bytes") == 1, out
    assert [r["step"] for r in _records(tmp_path / "run")] == [1, 2, 1, 2]  # the new records on lines of their own


@pytest.mark.slow
def test_a_full_disk_while_writing_the_record_exits_3_with_one_line(tmp_path):
    probe = ("import sys\nsys.path.insert(0, {tests!r})\nfrom test_run_safety import _FullDisk\n"
             "from jaxperf.train import hooks\nhooks.os = _FullDisk(step=3)\nfrom jaxperf.cli import main\n"
             "sys.exit(main(['train', *{args!r}]))\n").format(tests=str(Path(__file__).parent),
                                                          args=[*RUN, "max_steps=6", "run_dir=run"])
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, timeout=240,
                         env=cli_env(tmp_path, 1))
    assert out.returncode == 3, out.stderr[-3000:]
    line = _one_line(out.stderr)
    assert "run/metrics.jsonl could not be written at step 3: No space left on device [errno 28]" in line, line
    assert "saved a checkpoint at step 4" in line, line


# ---------------------------------------------------------------------------------------------------------------------
# 10. No number that was not measured, no setting dropped without a word


def test_eval_batches_0_turns_evaluation_off_and_says_so_once(tmp_path, capsys):
    trainer = _trainer(tmp_path, "max_steps=4", "eval_every=2", "eval_batches=0")
    summary = trainer.fit()
    out = capsys.readouterr().out
    assert out.count("eval_batches=0: evaluation is off") == 1, out
    assert re.search(r"val_loss \d", out) is None, out  # no "val_loss 0.0000" that nothing measured
    assert not any("val_loss" in r for r in _records(tmp_path / "run")) and "val_loss" not in summary
    with pytest.raises(ValueError, match="nothing to evaluate on: eval_batches=0"):
        trainer.evaluate(summary["state"])


def test_a_vocab_size_the_byte_tokenizer_does_not_have_is_said_not_dropped_silently(tmp_path, capsys):
    trainer = _trainer(tmp_path, "model.vocab_size=512")  # e.g. at a resume of a byte-level run
    line = [x for x in capsys.readouterr().out.splitlines() if "vocab_size" in x]
    assert line == ["model.vocab_size=512 is not used: the byte tokenizer has 256 ids and the model's vocabulary "
                    "follows its tokenizer (256); drop the setting, or choose a tokenizer of 512 ids "
                    "(data.tokenizer=bpe trains one)"], line
    assert trainer.cfg.model.vocab_size == 256
    _trainer(tmp_path)
    assert "vocab_size" not in capsys.readouterr().out
