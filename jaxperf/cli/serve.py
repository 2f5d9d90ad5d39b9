"""`jaxperf serve --checkpoint DIR`: an HTTP API (also OpenAI's /v1/completions) over a run's newest checkpoint or a
Hugging Face GPT-2 / Llama directory, with continuous batching over one or more replicas (jaxperf.generate.server, jaxperf.generate.scheduler).

    jaxperf serve --checkpoint runs/tiny --replicas 2 --max-batch 16
    jaxperf serve --checkpoint runs/tiny-int8            # a `jaxperf quantize` output is served as int8
    jaxperf serve --checkpoint runs/tiny --quantize int8 # or quantize the run's weights at start-up
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax

from jaxperf.cli._load import load_generator
from jaxperf.config import ConfigError
from jaxperf.generate.quantize import is_quantized_dir
from jaxperf.generate.scheduler import replica_meshes
from jaxperf.generate.server import create_app
from jaxperf.interop import HFCheckpointError
from jaxperf.checkpoint import CorruptCheckpointError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxperf serve", description="Serve a training run's checkpoint over HTTP.")
    p.add_argument("--checkpoint", required=True, help="run_dir of a `jaxperf train` run, a `jaxperf quantize` "
                                                       "output, or a Hugging Face GPT-2 / Llama directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--replicas", type=int, default=1, help="engines, each on its own device(s); requests go to the "
                                                           "least loaded")
    p.add_argument("--devices-per-replica", type=int, default=1, help="devices of one replica's mesh")
    p.add_argument("--replica-axis", choices=("tensor", "data"), default="tensor",
                   help="what a replica's devices split: its weights (tensor) or its rows (data: each device decodes "
                        "its rows in a loop of its own; --max-batch must be a multiple of --devices-per-replica)")
    p.add_argument("--max-batch", type=int, default=8, help="rows (slots) one replica decodes together")
    p.add_argument("--max-len", type=int, default=None, help="cache slots per row (default: the model's context)")
    p.add_argument("--chunk", type=int, default=8, help="decode steps between boundaries (admission, streaming)")
    p.add_argument("--batching", choices=("continuous", "static"), default="continuous",
                   help="continuous: requests join and leave at chunk boundaries; static: whole batches")
    p.add_argument("--batch-window-ms", type=float, default=10.0, help="static batching: wait this long to fill")
    p.add_argument("--prefill-budget", type=int, default=2048, help="padded prompt tokens one admission prefills")
    p.add_argument("--max-tokens-limit", type=int, default=512, help="largest max_tokens a request may ask for")
    p.add_argument("--request-timeout-s", type=float, default=120.0, help="answer 504 and free the slot after this")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    p.add_argument("--quantize", choices=("int8",), default=None, help="serve int8 weights (per-channel scales)")
    p.add_argument("--model-name", default=None, help="the name /v1 answers to (default: the checkpoint's folder)")
    p.add_argument("--no-warmup", action="store_true", help="compile on the first request instead of at start")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        import uvicorn  # an optional dependency: the serve extra
    except ImportError:
        print("jaxperf serve needs starlette and uvicorn: pip install 'jaxperf[serve]'", file=sys.stderr)
        return 2
    ckpt = Path(args.checkpoint)
    if not (ckpt / "config.json").exists():
        print(f"jaxperf serve: {ckpt}/config.json not found; --checkpoint takes the run_dir of a `jaxperf train` "
              "run, the --out of `jaxperf quantize` or a Hugging Face model directory", file=sys.stderr)
        return 2
    try:
        if args.replica_axis == "data" and args.max_batch % args.devices_per_replica:
            raise ValueError(f"--max-batch {args.max_batch} rows do not split over --devices-per-replica "
                             f"{args.devices_per_replica} (--replica-axis data): give a multiple of "
                             f"{args.devices_per_replica}")
        meshes = replica_meshes(args.replicas, args.devices_per_replica, jax.devices(), axis=args.replica_axis)
        first = load_generator(ckpt, mesh=meshes[0], quantize=None if is_quantized_dir(ckpt) else args.quantize)
    except (ValueError, ConfigError, HFCheckpointError, CorruptCheckpointError) as e:
        print(f"jaxperf serve: {e}", file=sys.stderr)
        return 2
    gens = [first] + [first.on(m) for m in meshes[1:]]
    try:
        app = create_app(gens, max_batch=args.max_batch, max_len=args.max_len, chunk=args.chunk,
                         batching=args.batching, batch_window_s=args.batch_window_ms / 1000,
                         prefill_budget=args.prefill_budget, max_tokens_limit=args.max_tokens_limit,
                         request_timeout_s=args.request_timeout_s, max_body_bytes=args.max_body_bytes,
                         model_name=args.model_name or ckpt.resolve().name)
    except ValueError as e:
        print(f"jaxperf serve: {e}", file=sys.stderr)
        return 2
    if not args.no_warmup:
        s = app.state.scheduler.warmup(prompt_lengths=(8, 32))
        print(f"compiled the programs of {len(gens)} replica(s) in {s:.1f} s", flush=True)
    weights = "int8" if first.quantized else str(first.cfg.param_dtype)
    print(f"serving {ckpt} ({weights} weights, {first.weight_bytes / 2**20:.1f} MiB) with {len(gens)} replica(s) on "
          f"http://{args.host}:{args.port}/ (also /v1/completions)", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
