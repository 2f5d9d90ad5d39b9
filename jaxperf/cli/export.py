"""`jaxperf export --checkpoint RUN_DIR --out DIR`: a run's newest checkpoint as a Hugging Face directory.

    jaxperf export --checkpoint runs/finetune --out exported/ [--max-shard-size 2GB] [--dtype bfloat16]

The directory loads with transformers' `from_pretrained` (config.json with the special token ids,
generation_config.json, the weights in safetensors shards with their index, the tokenizer files); the weights are
streamed one tensor at a time (jaxperf.train.pretrained.export_run).
"""

from __future__ import annotations

import argparse
import sys

from jaxperf.config import ConfigError
from jaxperf.interop import EXPORT_DTYPES, SUPPORTED, HFCheckpointError
from jaxperf.train.pretrained import export_run


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxperf export",
                                description="Write a training run's checkpoint as a Hugging Face model directory.")
    p.add_argument("--checkpoint", required=True, help="run_dir of a `jaxperf train` run (config.json + checkpoints/)")
    p.add_argument("--out", required=True, help="the directory to write (created; its weights and configs replaced)")
    p.add_argument("--step", type=int, default=None, help="the checkpoint step (default: the newest intact one)")
    p.add_argument("--arch", choices=sorted(SUPPORTED), default=None, help="default: the model's style")
    p.add_argument("--max-shard-size", default="2GB", help="largest weight file, e.g. 2GB, 500MB")
    p.add_argument("--dtype", choices=EXPORT_DTYPES, default="float32", help="dtype of the written weights")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        files = export_run(args.checkpoint, args.out, step=args.step, arch=args.arch,
                           max_shard_size=args.max_shard_size, dtype=args.dtype)
    except (ConfigError, HFCheckpointError, FileNotFoundError, ValueError) as e:
        print(f"jaxperf export: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {len(files)} weight file(s), config.json, generation_config.json", flush=True)
    return 0
