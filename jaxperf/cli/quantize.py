"""`jaxperf quantize --checkpoint DIR --out DIR2`: int8 weights (per-channel scales) of a run's newest checkpoint.

    jaxperf quantize --checkpoint runs/tiny --out runs/tiny-int8
    jaxperf serve --checkpoint runs/tiny-int8

Prints the weight bytes before and after and the perplexity of both on the run's held-out tokens; the same report
is written to DIR2/quantization.json (jaxperf.generate.quantize).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from jaxperf.cli._errors import CommandError, refused
from jaxperf.generate.quantize import quantize_run


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxperf quantize", description="Write int8 weights of a run's checkpoint.")
    p.add_argument("--checkpoint", required=True, help="run_dir of a `jaxperf train` run (config.json + checkpoints/)")
    p.add_argument("--out", required=True, help="a new directory for the int8 checkpoint")
    p.add_argument("--step", type=int, default=None, help="the step to quantize (default: the newest intact one)")
    p.add_argument("--eval-batches", type=int, default=8, help="held-out batches for perplexity (0: skip)")
    p.add_argument("--batch-size", type=int, default=8)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.eval_batches < 0:
        raise CommandError(f"--eval-batches {args.eval_batches} must be at least 0 (0: skip the perplexity)")
    if args.batch_size < 1:
        raise CommandError(f"--batch-size {args.batch_size} must be at least 1")
    if args.step is not None and args.step < 0:
        raise CommandError(f"--step {args.step} must be a checkpoint step (>= 0); leave it out for the newest")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise CommandError(f"--out {args.out} is a file: give a new directory")
    with refused(ValueError):  # quantize_run's refusals: an input already int8, --out the same as --checkpoint
        report = quantize_run(args.checkpoint, args.out, step=args.step, eval_batches=args.eval_batches,
                              batch_size=args.batch_size)
    before, after = report["weight_bytes_before"], report["weight_bytes_after"]
    print(f"int8 weights of step {report['source_step']}: {len(report['quantized'])} tensors; weight bytes "
          f"{before:,} -> {after:,} ({after / before:.3f}x)")
    if "perplexity_before" in report:
        pb, pa = report["perplexity_before"], report["perplexity_after"]
        print(f"perplexity on {report['eval_tokens']:,} held-out tokens: {pb:.4f} -> {pa:.4f} "
              f"({100 * (pa - pb) / pb:+.2f}%)")
    else:
        print("perplexity not measured (--eval-batches 0 or no held-out split)")
    print(f"wrote {args.out} (serve it with: jaxperf serve --checkpoint {args.out})")
    return 0
