"""`jaxperf serve --checkpoint DIR`: an HTTP API (also OpenAI's /v1/completions) over a run's newest checkpoint or a
Hugging Face GPT-2 / Llama directory, with continuous batching over one or more replicas (jaxperf.generate.server, jaxperf.generate.scheduler).

    jaxperf serve --checkpoint runs/tiny --replicas 2 --max-batch 16
    jaxperf serve --checkpoint runs/tiny-int8            # a `jaxperf quantize` output is served as int8
    jaxperf serve --checkpoint runs/tiny --quantize int8 # or quantize the run's weights at start-up

Every flag is checked and the port bound before the checkpoint is read or anything compiles, so a bad flag or a busy
port is one line naming it, exit 2 (jaxperf.cli._errors), and "serving ... on http://..." means the port is held.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import math
import socket
from pathlib import Path

import jax

from jaxperf.cli._errors import CommandError, refused
from jaxperf.cli._load import load_generator
from jaxperf.generate.quantize import is_quantized_dir
from jaxperf.generate.scheduler import replica_meshes
from jaxperf.generate.server import create_app

BACKLOG = 2048  # connections the kernel queues while the programs compile, before uvicorn accepts them


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


# flag -> (smallest value, what it is)
AT_LEAST = {"--port": (0, "0 picks a free port"), "--replicas": (1, "engines"),
            "--devices-per-replica": (1, "devices of one replica's mesh"),
            "--max-batch": (1, "rows one replica decodes together"), "--max-len": (2, "cache slots per row"),
            "--chunk": (1, "decode steps between boundaries"), "--prefill-budget": (1, "padded prompt tokens"),
            "--max-tokens-limit": (1, "the largest max_tokens a request may ask for"),
            "--max-body-bytes": (1, "bytes of a request body")}


def check_flags(args: argparse.Namespace) -> None:
    """CommandError naming the flag for a value that cannot mean anything, before anything is read or bound."""
    for flag, (low, what) in AT_LEAST.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and value < low:
            raise CommandError(f"{flag} {value} must be at least {low} ({what})")
    if args.port > 65535:
        raise CommandError(f"--port {args.port} must be at most 65535")
    if not (args.request_timeout_s > 0):
        raise CommandError(f"--request-timeout-s {args.request_timeout_s} must be a positive number of seconds")
    if not (0 <= args.batch_window_ms < math.inf):
        raise CommandError(f"--batch-window-ms {args.batch_window_ms} must be a number of milliseconds >= 0")
    if args.replica_axis == "data" and args.max_batch % args.devices_per_replica:
        raise CommandError(f"--max-batch {args.max_batch} rows do not split over --devices-per-replica "
                           f"{args.devices_per_replica} (--replica-axis data): give a multiple of "
                           f"{args.devices_per_replica}")


def bind(host: str, port: int) -> socket.socket:
    """A socket listening on (host, port), or CommandError naming the flag and the fix (a port in use, say)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError as e:
        sock.close()
        reason = f"{e.strerror or e} [errno {e.errno}]"
        if e.errno == errno.EADDRINUSE:
            raise CommandError(f"--port {port} on {host} is in use by another process ({reason}): stop it, or "
                               f"choose another --port (--port 0 picks a free one)") from None
        if e.errno in (errno.EACCES, errno.EPERM):
            raise CommandError(f"--port {port} on {host} may not be used by this user ({reason}): choose a port "
                               f"from 1024 up") from None
        raise CommandError(f"--host {host} --port {port} cannot be listened on ({reason}): give an address of this "
                           f"machine, e.g. --host 127.0.0.1 or --host 0.0.0.0") from None
    return sock


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_flags(args)
    try:
        import uvicorn  # an optional dependency: the serve extra
    except ImportError:
        raise CommandError("jaxperf serve needs starlette and uvicorn: pip install 'jaxperf[serve]'") from None
    ckpt = Path(args.checkpoint)
    if not (ckpt / "config.json").exists():
        raise CommandError(f"{ckpt}/config.json not found: --checkpoint takes the run_dir of a `jaxperf train` run, "
                           f"the --out of `jaxperf quantize` or a Hugging Face model directory")
    with contextlib.closing(bind(args.host, args.port)) as sock:
        with refused(ValueError, prefix=f"--replicas {args.replicas} --devices-per-replica "
                                        f"{args.devices_per_replica}: "):
            meshes = replica_meshes(args.replicas, args.devices_per_replica, jax.devices(), axis=args.replica_axis)
        with refused(ValueError):  # a config.json or int8 scales that cannot be used
            first = load_generator(ckpt, mesh=meshes[0], quantize=None if is_quantized_dir(ckpt) else args.quantize)
        if args.chunk > first.max_chunk:
            raise CommandError(f"--chunk {args.chunk} must be at most {first.max_chunk} (decode steps one call runs)")
        if args.max_len is not None and args.max_len > first.cfg.max_seq_len:
            raise CommandError(f"--max-len {args.max_len} must be at most {first.cfg.max_seq_len}, the model's "
                               f"context (model.max_seq_len); leave it out for the whole context")
        gens = [first] + [first.on(m) for m in meshes[1:]]
        app = create_app(gens, max_batch=args.max_batch, max_len=args.max_len, chunk=args.chunk,
                         batching=args.batching, batch_window_s=args.batch_window_ms / 1000,
                         prefill_budget=args.prefill_budget, max_tokens_limit=args.max_tokens_limit,
                         request_timeout_s=args.request_timeout_s, max_body_bytes=args.max_body_bytes,
                         model_name=args.model_name or ckpt.resolve().name)
        if not args.no_warmup:
            s = app.state.scheduler.warmup(prompt_lengths=(8, 32))
            print(f"compiled the programs of {len(gens)} replica(s) in {s:.1f} s", flush=True)
        weights = "int8" if first.quantized else str(first.cfg.param_dtype)
        host, port = args.host, sock.getsockname()[1]
        url = f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"
        print(f"serving {ckpt} ({weights} weights, {first.weight_bytes / 2**20:.1f} MiB) with {len(gens)} replica(s) "
              f"on {url} (also /v1/completions)", flush=True)
        uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
    return 0
