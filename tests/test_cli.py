"""One error discipline for every command: a user error is one line naming the flag or setting, its value and the fix,
with the documented exit status (jaxperf.cli._errors); a command that only reads a run leaves it as it was.

Most cases run the command in this process on a run directory made here (config.json and a checkpoint of random
weights of a one-layer model); the zero-byte checkpoint file needs a process of its own, whose stderr is what counts.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import subprocess
import sys
from pathlib import Path

import pytest
from flax import nnx
from helpers import cli_env

from jaxperf import cli
from jaxperf.checkpoint import Checkpointer, NoIntactCheckpointError
from jaxperf.cli._errors import CommandError, run_command
from jaxperf.config import ConfigError, get_config, to_dict, validate_model
from jaxperf.models import GPT

CONTEXT = 32


def _run(tmp_path: Path, steps=(1, 2)) -> Path:
    """A run directory as `jaxperf train` leaves it: config.json and one checkpoint per step (random weights)."""
    cfg = get_config("tiny", ["model.n_layers=1", "model.d_model=32", "model.n_heads=2",
                              f"model.max_seq_len={CONTEXT}"])
    cfg = dataclasses.replace(cfg, model=validate_model(cfg.model))
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(to_dict(cfg)))
    params = nnx.to_pure_dict(nnx.state(GPT(cfg.model, rngs=nnx.Rngs(0)), nnx.Param))
    with Checkpointer(run / "checkpoints") as ckpt:
        for step in steps:
            ckpt.save(step, {"params": params}, force=True)
    return run


def _corrupt(step_dir: Path) -> None:
    """Cut the largest array file of a step to a third: the step cannot be read back."""
    data = max((p for p in (step_dir / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 3)


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _refused(capsys, *argv: str, code: int = 2) -> str:
    """Run `jaxperf *argv` here; assert it exits with `code`, printed nothing on stdout and one line on stderr."""
    capsys.readouterr()
    assert cli.main(list(argv)) == code
    out, err = capsys.readouterr()
    assert out == "", out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"jaxperf {argv[0]}: "), err[-3000:]
    return lines[0]


# ---------------------------------------------------------------------------------------------------------------------
# The wrapper every command runs through


@pytest.mark.parametrize("raised, code, text", [
    (CommandError("--max-batch 0 must be at least 1"), 2, "--max-batch 0 must be at least 1"),
    (CommandError("stopped", 130), 130, "stopped"),
    (ConfigError("lr=-1 must be greater than 0\nsecond line"), 2, "lr=-1 must be greater than 0 second line"),
    (NoIntactCheckpointError("no intact checkpoint in x"), 2, "no intact checkpoint in x"),
    (PermissionError(errno.EACCES, "Permission denied", "ro/x.tmp"), 2, "ro/x.tmp: Permission denied [errno 13]"),
    (OSError(errno.ENOSPC, "No space left on device", "out/model.safetensors"), 3,
     "out/model.safetensors: No space left on device [errno 28]"),
    (KeyboardInterrupt(), 130, "interrupted (Ctrl-C)"),
])
def test_user_errors_are_one_line_and_a_documented_exit_status(capsys, raised, code, text):
    def main(argv):
        raise raised

    assert run_command("x", main, []) == code
    assert capsys.readouterr().err == f"jaxperf x: {text}\n"


def test_a_reader_that_went_away_ends_the_command_quietly(tmp_path):
    # `jaxperf info | head -1`: the rest of the output has nowhere to go; no traceback, no line about it.
    out = subprocess.run(f"{sys.executable} -m jaxperf.cli info | head -1", shell=True, capture_output=True, text=True,
                         env={**cli_env(tmp_path, 1), "JAXPERF_HUGE_PAGES": "0"}, cwd=tmp_path, timeout=120)
    assert out.stdout.startswith("jax ") and len(out.stdout.splitlines()) == 1, out
    assert out.stderr == "", out.stderr[-3000:]


def test_a_bug_keeps_its_traceback():
    def main(argv):
        raise ZeroDivisionError("a bug")

    with pytest.raises(ZeroDivisionError):
        run_command("x", main, [])


# ---------------------------------------------------------------------------------------------------------------------
# generate


@pytest.mark.parametrize("flags, message", [
    (["--max-tokens", "-5"], "--max-tokens -5 must be at least 1"),
    (["--chunk", "0"], "--chunk 0 must be at least 1"),
    (["--top-p", "0"], "--top-p 0.0 must lie in (0, 1]"),
    (["--temperature", "-1"], "--temperature -1.0 must lie in"),
    (["--top-k", "1000"], "--top-k 1000 must be an integer in [0, 256]"),
    (["--prompt", "x" * 40], f"--prompt is 40 tokens: the model's context is {CONTEXT} tokens"),
    (["--prompt", ""], "--prompt: an empty prompt has no last token"),
])
def test_generate_refuses_a_bad_flag_in_one_line_before_printing(tmp_path, capsys, flags, message):
    run = _run(tmp_path, steps=(1,))
    line = _refused(capsys, "generate", "--checkpoint", str(run), "--prompt", "ab", *flags)
    assert message in line, line


def test_a_truncated_safetensors_file_is_one_line(tmp_path, capsys):
    run = _run(tmp_path, steps=(1,))
    capsys.readouterr()
    assert cli.main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "hf")]) == 0
    weights = tmp_path / "hf" / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size // 2)
    line = _refused(capsys, "generate", "--checkpoint", str(tmp_path / "hf"), "--prompt", "ab")
    assert f"{weights} is truncated: tensor" in line and f"the file has {size // 2} bytes" in line, line


# ---------------------------------------------------------------------------------------------------------------------
# Readers of a corrupt run: one line, nothing changed


@pytest.mark.parametrize("command", [
    ["generate", "--prompt", "ab"],
    ["export", "--out", "{tmp}/hf"],
    ["quantize", "--out", "{tmp}/int8", "--eval-batches", "0"],
    ["serve", "--no-warmup", "--port", "0"],
])
def test_every_reader_of_a_run_with_no_intact_step_says_so_in_one_line(tmp_path, capsys, command):
    run = _run(tmp_path)
    for step in (1, 2):
        _corrupt(run / "checkpoints" / str(step))
    before = _snapshot(run)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in command]
    line = _refused(capsys, argv[0], "--checkpoint", str(run), *argv[1:])
    assert f"no intact checkpoint in {run / 'checkpoints'}" in line, line
    assert _snapshot(run) == before


def test_init_from_a_run_with_no_intact_step_is_one_line(tmp_path, capsys):
    run = _run(tmp_path)
    for step in (1, 2):
        _corrupt(run / "checkpoints" / str(step))
    before = _snapshot(run)
    line = _refused(capsys, "train", f"init_from={run}", f"run_dir={tmp_path / 'new'}")
    assert f"no intact checkpoint in {run / 'checkpoints'}" in line, line
    assert _snapshot(run) == before and not (tmp_path / "new" / "checkpoints").exists()


def test_export_of_a_corrupt_step_is_one_line_and_changes_nothing(tmp_path, capsys):
    run = _run(tmp_path)
    _corrupt(run / "checkpoints" / "2")
    before = _snapshot(run)
    line = _refused(capsys, "export", "--checkpoint", str(run), "--out", str(tmp_path / "hf"), "--step", "2")
    assert line.startswith(f"jaxperf export: checkpoint step 2 in {run / 'checkpoints'} is corrupt: "), line
    assert _snapshot(run) == before


@pytest.mark.parametrize("command", ["export", "quantize"])
def test_an_out_that_is_an_existing_file_is_one_line(tmp_path, capsys, command):
    run = _run(tmp_path, steps=(1,))
    (tmp_path / "taken").write_text("mine")
    line = _refused(capsys, command, "--checkpoint", str(run), "--out", str(tmp_path / "taken"))
    assert f"--out {tmp_path / 'taken'} is a file: give a" in line, line
    assert (tmp_path / "taken").read_text() == "mine"


@pytest.mark.parametrize("argv, message", [
    (["quantize", "--checkpoint", "run", "--out", "q", "--batch-size", "0"], "--batch-size 0 must be at least 1"),
    (["export", "--checkpoint", "run", "--out", "hf", "--max-shard-size", "lots"], "--max-shard-size 'lots' is not"),
    (["compile", "--topology", "v5p:2x2x1", "--slices", "0"], "--slices 0 must be at least 1"),
    (["compile", "--topology", "v5p:2x2x1", "--buffers", "-1"], "--buffers -1 must be 0 (no buffer list) or more"),
    (["info", "no_such_key=1"], "no_such_key"),
])
def test_other_commands_name_the_flag(tmp_path, capsys, argv, message):
    line = _refused(capsys, *argv)
    assert message in line, line


# ---------------------------------------------------------------------------------------------------------------------
# A checkpoint file cut to zero bytes: the step is skipped in one line, not a flood of Orbax tracebacks


# A read Orbax started and dropped when another array failed: closing it raises, as its TensorStore read does.
DROPPED_READ = """
import types
from jaxperf import checkpoint

checkpoint._quiet_orbax_logging()
source = ("async def _read_array_index_and_device_put(pending):\\n    try:\\n        await pending\\n"
          "    finally:\\n        raise Exception('Encountered error while reading array index: ' + 'spec ' * 50)\\n")
scope = {}
exec(compile(source, "/site-packages/orbax/checkpoint/_src/serialization/serialization.py", "exec"), scope)
pending = types.coroutine(lambda: (yield))()
read = scope["_read_array_index_and_device_put"](pending)
read.send(None)
del read  # closed unfinished: Python reports the exception through sys.unraisablehook
never = scope["_read_array_index_and_device_put"](pending)
del never  # created, never started: Python warns "coroutine ... was never awaited"
print("done")
"""


def test_reads_orbax_dropped_after_a_failed_restore_print_nothing(tmp_path):
    out = subprocess.run([sys.executable, "-c", DROPPED_READ], capture_output=True, text=True,
                         env=cli_env(tmp_path, 1), cwd=tmp_path, timeout=120)
    assert out.returncode == 0 and out.stdout == "done\n", out.stderr[-3000:]
    assert out.stderr == "", out.stderr[-3000:]


@pytest.mark.slow
def test_an_array_index_cut_to_zero_bytes_is_one_line(tmp_path):
    # Orbax's dropped reads print (or not) depending on timing: with the filter above, never.
    run = _run(tmp_path)
    (run / "checkpoints" / "2" / "params" / "array_metadatas" / "process_0").write_bytes(b"")
    out = subprocess.run([sys.executable, "-m", "jaxperf.cli", "generate", "--checkpoint", str(run), "--prompt", "ab",
                          "--max-tokens", "2"], capture_output=True, text=True, env=cli_env(tmp_path, 1),
                         cwd=tmp_path, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "step 2" in lines[0] and "using step 1" in lines[0], lines[0]
