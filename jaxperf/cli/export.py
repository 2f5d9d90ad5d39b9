"""`jaxperf export --checkpoint RUN_DIR --out DIR`: a run's newest checkpoint as a Hugging Face directory.

    jaxperf export --checkpoint runs/finetune --out exported/ [--max-shard-size 2GB] [--dtype bfloat16]

The directory loads with transformers' `from_pretrained` (config.json with the special token ids,
generation_config.json, the weights in safetensors shards with their index, the tokenizer files); the weights are
streamed one tensor at a time (jaxperf.train.pretrained.export_run).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from jaxperf.cli._errors import CommandError
from jaxperf.interop import EXPORT_DTYPES, SUPPORTED
from jaxperf.interop._safetensors import parse_size
from jaxperf.train.pretrained import export_run


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxperf export",
                                description="Write a training run's checkpoint as a Hugging Face model directory.")
    p.add_argument("--checkpoint", required=True, help="run_dir of a `jaxperf train` run (config.json + checkpoints/)")
    p.add_argument("--out", required=True, help="the directory to write (created; its weights and configs replaced)")
    p.add_argument("--step", type=int, default=None, help="the checkpoint step (default: the newest intact one)")
    p.add_argument("--arch", choices=sorted(SUPPORTED), default=None,
                   help="default: qwen2_moe for an MoE model with shared experts, mixtral for one without, qwen2 for a "
                   "model with q/k/v biases alone, else the model's style")
    p.add_argument("--max-shard-size", default="2GB", help="largest weight file, e.g. 2GB, 500MB")
    p.add_argument("--dtype", choices=EXPORT_DTYPES, default="float32", help="dtype of the written weights")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        shard_bytes = parse_size(args.max_shard_size)
    except ValueError:
        raise CommandError(f"--max-shard-size {args.max_shard_size!r} is not a size: write e.g. 2GB, 500MB or a "
                           f"number of bytes") from None
    if shard_bytes < 1:
        raise CommandError(f"--max-shard-size {args.max_shard_size!r} must be at least 1 byte")
    if args.step is not None and args.step < 0:
        raise CommandError(f"--step {args.step} must be a checkpoint step (>= 0); leave it out for the newest")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise CommandError(f"--out {out} is a file: give a directory (it is created if missing)")
    files = export_run(args.checkpoint, out, step=args.step, arch=args.arch, max_shard_size=args.max_shard_size,
                       dtype=args.dtype)
    print(f"wrote {args.out}: {len(files)} weight file(s), config.json, generation_config.json", flush=True)
    return 0
