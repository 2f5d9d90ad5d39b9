"""`jaxperf compile --topology v5p:4x4x4 [--slices N] [--preset NAME] [--buffers N] [key=value ...] [--json]`.

Compiles a run's train step for a TPU slice on this machine (needs libtpu) and reports memory and FLOPs per chip
(jaxperf.train.topology), then the largest buffers of each kind from the compiler's buffer assignment
(jaxperf.perf.buffers). Exit code 1 when the step does not fit the chip's memory, 2 for a bad flag or setting
or a missing libtpu.
"""

from __future__ import annotations

import argparse
import json

from jaxperf.cli._errors import CommandError
from jaxperf.config import get_config
from jaxperf.train.topology import compile_for_topology, format_report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxperf compile",
                                description="Compile a run's train step for a TPU slice on this machine and report "
                                            "memory and FLOPs per chip (needs libtpu: pip install 'jax[tpu]').")
    p.add_argument("--topology", required=True, help="chip:shape, e.g. v5p:4x4x4, v5e:4x4, v4:2x2x2")
    p.add_argument("--slices", type=int, default=1, help="slices of a multi-slice job (data parallel across them)")
    p.add_argument("--preset", default=None)
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--hlo-out", default=None, help="also write the compiled program's optimized HLO text here")
    p.add_argument("--buffers", type=int, default=10, metavar="N",
                   help="list the N largest buffers per chip of each kind the TPU compiler assigned: parameters "
                        "(weights, optimizer state, batch; donated ones are shared with the outputs), outputs, "
                        "temporaries (the slots of the preallocated block, named by the HLO op that writes them, "
                        "grouped by shape) and constants; read from its buffer-assignment dump; 0 turns it off "
                        "(default %(default)s)")
    p.add_argument("overrides", nargs="*")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.slices < 1:
        raise CommandError(f"--slices {args.slices} must be at least 1")
    if args.buffers < 0:
        raise CommandError(f"--buffers {args.buffers} must be 0 (no buffer list) or more")
    cfg = get_config(args.preset, args.overrides)  # ConfigError and TopologyError: one line, exit 2 (cli._errors)
    report = compile_for_topology(cfg, args.topology, args.slices, hlo_out=args.hlo_out, buffers=args.buffers)
    print(json.dumps(report) if args.json else format_report(report))
    return 0 if report["fits"] is not False else 1
