"""`jaxperf generate`: continue a prompt with a trained run's newest checkpoint (or a Hugging Face model directory),
printing text as it is produced.

    jaxperf generate --checkpoint runs/tiny --prompt "def " --max-tokens 200 --temperature 0.8 --top-p 0.95
"""

from __future__ import annotations

import argparse
import sys

from jaxperf.cli._load import load_generator
from jaxperf.config import ConfigError
from jaxperf.generate.engine import TextStream
from jaxperf.generate.sampling import check_settings
from jaxperf.interop import HFCheckpointError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxperf generate", description="Generate text from a training run's checkpoint.")
    p.add_argument("--checkpoint", required=True, help="run_dir of a `jaxperf train` run (config.json + checkpoints/), "
                                                        "or a Hugging Face GPT-2 / Llama directory")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk", type=int, default=16, help="decode steps per compiled call between prints")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    try:
        check_settings(args.temperature, args.top_k, args.top_p)
    except ValueError as e:
        print(f"jaxperf generate: {e}", file=sys.stderr)
        return 2
    try:
        gen = load_generator(args.checkpoint)
    except (ConfigError, HFCheckpointError) as e:
        print(f"jaxperf generate: {e}", file=sys.stderr)
        return 2
    print(args.prompt, end="", flush=True)
    text = TextStream(gen.tokenizer)
    stream = gen.stream([args.prompt], args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                        top_p=args.top_p, seed=args.seed, chunk=args.chunk)
    while True:
        try:
            new = next(stream)
        except StopIteration as e:
            result = e.value
            break
        print(text.push(new[0]), end="", flush=True)
    print(text.finish(), flush=True)
    print(f"[{result.prefill_tokens} prompt tokens at {result.prefill_tokens_per_s:,.0f} tok/s, "
          f"{result.decode_tokens} new tokens at {result.decode_tokens_per_s:,.0f} tok/s, "
          f"compile {result.compile_s:.1f} s, finish: {result[0].finish_reason}]", flush=True)
    return 0

