"""`jaxperf train [--preset NAME] [key=value ...]`: train a model end to end (jaxperf.train.Trainer).

Exit codes: 0 trained (or stopped by a signal after saving), 2 refused before training (a bad setting, a run
directory that cannot be used as asked, a checkpoint of another model), 3 a checkpoint could not be saved (the run
stopped at once; the message names the last good step), 4 the run stopped on numerical trouble or bad data.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax

from jaxperf.config import ConfigError, TrainConfig, get_config
from jaxperf.config.overrides import keys, parse_overrides, resolve_key
from jaxperf.data.loader import DataError
from jaxperf.parallel import distributed
from jaxperf.checkpoint import CheckpointPermissionError, CheckpointSaveError, IncompatibleCheckpointError
from jaxperf.train.pretrained import InitSource
from jaxperf.train.rundir import RunDirError
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
    print(f"jaxperf train: {message}", file=sys.stderr, flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = get_config(args.preset, args.overrides)
        if cfg.init_from:  # an override that contradicts the checkpoint is refused, even one equal to a default
            cfg = InitSource.open(cfg.init_from).configure(cfg, _named_model_fields(args.overrides))
        distributed.initialize()  # a no-op unless the environment describes several processes
        trainer = Trainer(cfg)
    except (ConfigError, DataError, ValueError) as e:
        return _fail(str(e), 2)
    try:
        summary = trainer.fit()
    except IncompatibleCheckpointError as e:
        return _fail(f"cannot resume: {e}", 2)
    except (RunDirError, CheckpointPermissionError) as e:
        return _fail(str(e), 2)
    except CheckpointSaveError as e:
        # Orbax's writer threads may still hold the failed write: leave without waiting for them.
        _fail(str(e), 3)
        sys.stdout.flush()
        os._exit(3)
    except (FloatingPointError, DataError) as e:
        return _fail(str(e), 4)
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
