"""`jaxperf train [--preset NAME] [key=value ...]`: train a model end to end (jaxperf.train.Trainer).

Exit codes: 0 trained (or stopped by a signal after saving), 2 refused before training (a bad setting, a run
directory, cache or data path that cannot be used as asked, a checkpoint of another model, no intact checkpoint),
3 a checkpoint or the metrics could not be saved (the run stopped at once; the message names the last good step),
4 the run stopped on numerical trouble or bad data, 130 a second Ctrl-C stopped it at once without saving. Each is
one line on stderr (jaxperf.cli._errors).
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from pathlib import Path

import jax

from jaxperf.checkpoint import CheckpointSaveError, IncompatibleCheckpointError
from jaxperf.cli._errors import INTERRUPTED, REFUSALS, CommandError, describe_os_error, fail, os_error_code
from jaxperf.config import TrainConfig, get_config
from jaxperf.config.overrides import keys, parse_overrides, resolve_key
from jaxperf.data.loader import DataError
from jaxperf.parallel import distributed
from jaxperf.train.pretrained import InitSource
from jaxperf.train.trainer import Trainer


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxperf train", description="Train a model, or fine-tune one with init_from=DIR "
                                                                  "(a Hugging Face GPT-2 / Llama directory or a "
                                                                  "jaxperf run directory).")
    p.add_argument("--preset", default=None, help="tiny (default), gpt2-small, gpt2-medium, llama-1b")
    p.add_argument("overrides", nargs="*", help="config overrides, key=value (e.g. max_steps=20 model.n_layers=2)")
    return p


def _named_model_fields(overrides: list[str]) -> set[str]:
    """The model fields the command line sets (with init_from, the preset's model gives way to the checkpoint's)."""
    known = keys(TrainConfig())
    named = (resolve_key(k, known) for k in parse_overrides(overrides))
    return {k.removeprefix("model.") for k in named if k.startswith("model.")}


def _fail(message: str, code: int) -> int:
    return fail("train", message, code)


# Settings that name paths: an OSError on a file under one of them is reported as that setting's.
PATH_SETTINGS = ("run_dir", "data.cache_dir", "compile_cache_dir", "data.source", "data.tokenizer_path", "init_from")


def _setting_of(path: str, cfg: TrainConfig) -> tuple[str, str] | None:
    """(setting, value) of the path setting that `path` lies under (the most specific one), or None."""
    where = Path(os.path.abspath(os.path.expanduser(path)))
    best = None
    for key in PATH_SETTINGS:
        value = cfg
        for part in key.split("."):
            value = getattr(value, part, None)
        if not isinstance(value, str) or not value:
            continue
        root = Path(os.path.abspath(os.path.expanduser(value.split(":")[0] if key == "data.source" else value)))
        if (where == root or root in where.parents) and (best is None or len(str(root)) > len(best[2])):
            best = (key, value, str(root))
    return best[:2] if best else None


def _setup_os_error(e: OSError, cfg: TrainConfig) -> CommandError:
    """An OSError met before training, in one line naming the setting whose path it concerns, and the fix."""
    found = _setting_of(str(e.filename), cfg) if e.filename is not None else None
    if found is None:
        return CommandError(describe_os_error(e), os_error_code(e))
    key, value = found
    fix = (f"make it writable by this user or choose another {key}" if e.errno in (errno.EACCES, errno.EPERM,
                                                                                     errno.EROFS)
           else f"choose another {key}")
    return CommandError(f"{key}={value} cannot be used: {describe_os_error(e)}; {fix}", os_error_code(e))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = get_config(args.preset, args.overrides)  # a bad setting: one line, exit 2 (cli._errors)
    try:
        if cfg.init_from:  # an override that contradicts the checkpoint is refused, even one equal to a default
            cfg = InitSource.open(cfg.init_from).configure(cfg, _named_model_fields(args.overrides))
        distributed.initialize()  # a no-op unless the environment describes several processes
        trainer = Trainer(cfg)
    except ValueError as e:  # ConfigError and the checks of the data and the model
        return _fail(str(e), 2)
    except OSError as e:
        if isinstance(e, REFUSALS):
            raise
        raise _setup_os_error(e, cfg) from None
    try:
        summary = trainer.fit()
    except IncompatibleCheckpointError as e:
        return _fail(f"cannot resume: {e}", 2)
    except CheckpointSaveError as e:
        # Orbax's writer threads may still hold the failed write: leave without waiting for them.
        _fail(str(e), 3)
        sys.stdout.flush()
        os._exit(3)
    except (FloatingPointError, DataError) as e:
        return _fail(str(e), 4)
    except KeyboardInterrupt:  # the first Ctrl-C saves after the current step; a second one stops at once
        _fail(f"stopped at once by a second Ctrl-C, without saving: the next start resumes from the newest "
              f"checkpoint in {trainer.run_dir / 'checkpoints'}", INTERRUPTED)
        # As after a failed save: a save or prefetch may be under way in other threads, and tearing the interpreter
        # down under them can crash it (SIGSEGV); the lock goes with the process.
        sys.stdout.flush()
        os._exit(INTERRUPTED)
    if "stopped_at" in summary:
        return 0  # preempted or interrupted: the checkpoint is saved, the next start continues from it
    main_process = jax.process_index() == 0  # every process trains; only the first one reports
    losses = summary["losses"]
    if losses and main_process:
        first, last = losses[min(losses)], losses[max(losses)]
        print(f"loss {first:.4f} -> {last:.4f} over {len(losses)} steps; checkpoint in {trainer.run_dir / 'checkpoints'}")
    if cfg.sample_tokens and trainer.tokenizer is not None:
        text = trainer.sample(summary["state"], cfg.sample_prompt, cfg.sample_tokens)  # a collective: all processes
        if main_process:
            print("---- sample ----")
            print(text)
            print("----------------")
    return 0
