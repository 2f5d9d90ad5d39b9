"""`jaxperf serve --checkpoint DIR`: an HTTP API over a run's newest checkpoint or a Hugging Face model directory
(jaxperf.generate.server)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jaxperf.cli._load import load_generator
from jaxperf.config import ConfigError
from jaxperf.generate.server import create_app
from jaxperf.interop import HFCheckpointError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxperf serve", description="Serve a training run's checkpoint over HTTP.")
    p.add_argument("--checkpoint", required=True, help="run_dir of a `jaxperf train` run (config.json + checkpoints/), "
                                                        "or a Hugging Face GPT-2 / Llama directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together at most")
    p.add_argument("--batch-window-ms", type=float, default=10.0, help="wait this long for more requests")
    p.add_argument("--chunk", type=int, default=8, help="decode steps between sends to streaming clients")
    p.add_argument("--max-tokens-limit", type=int, default=512, help="largest max_tokens a request may ask for")
    p.add_argument("--no-warmup", action="store_true", help="compile on the first request instead of at start")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        import uvicorn  # an optional dependency: the serve extra
    except ImportError:
        print("jaxperf serve needs starlette and uvicorn: pip install 'jaxperf[serve]'", file=sys.stderr)
        return 2
    if not (Path(args.checkpoint) / "config.json").exists():
        print(f"jaxperf serve: {args.checkpoint}/config.json not found; --checkpoint takes the run_dir of a "
              "`jaxperf train` run or a Hugging Face model directory", file=sys.stderr)
        return 2
    try:
        gen = load_generator(args.checkpoint)
    except (ConfigError, HFCheckpointError) as e:
        print(f"jaxperf serve: {e}", file=sys.stderr)
        return 2
    app = create_app(gen, max_batch=args.max_batch, batch_window_s=args.batch_window_ms / 1000, chunk=args.chunk,
                     max_tokens_limit=args.max_tokens_limit)
    if not args.no_warmup:
        s = app.state.batcher.warmup(gen.tokenizer.encode("Once upon a time"), max_tokens=16)
        print(f"compiled the one-row programs in {s:.1f} s", flush=True)
    print(f"serving {args.checkpoint} on http://{args.host}:{args.port}/", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
