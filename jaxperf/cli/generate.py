"""`jaxperf generate`: continue a prompt with a trained run's newest checkpoint (or a Hugging Face model directory),
printing text as it is produced.

    jaxperf generate --checkpoint runs/tiny --prompt "def " --max-tokens 200 --temperature 0.8 --top-p 0.95

Every flag is checked before the checkpoint is read, the prompt's length before anything is printed; a bad one is
one line naming the flag, exit 2 (jaxperf.cli._errors).
"""

from __future__ import annotations

import argparse

from jaxperf.cli._errors import CommandError, refused
from jaxperf.cli._load import load_generator
from jaxperf.generate.engine import TextStream
from jaxperf.generate.sampling import check_settings


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


def _as_flags(message: str) -> str:
    """A library message about sampling settings in the flags' names (`top_k=0` -> `--top-k 0`)."""
    for name in ("temperature", "top_k", "top_p"):
        message = message.replace(f"{name}=", f"--{name.replace('_', '-')} ")
    return message


def check_sampling(args: argparse.Namespace, vocab_size: int | None = None) -> None:
    """CommandError naming the flag for a sampling setting that cannot mean anything (for this vocabulary)."""
    try:
        check_settings(args.temperature, args.top_k, args.top_p, vocab_size)
    except ValueError as e:
        raise CommandError(_as_flags(str(e))) from None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for flag, value in (("--max-tokens", args.max_tokens), ("--chunk", args.chunk)):
        if value < 1:
            raise CommandError(f"{flag} {value} must be at least 1")
    check_sampling(args)  # before the checkpoint is read
    with refused(ValueError):  # a config.json or int8 scales that cannot be used
        gen = load_generator(args.checkpoint)
    with refused(ValueError, prefix="--prompt: "):  # an empty prompt, or ids outside the vocabulary
        (ids,) = gen.encode([args.prompt])
    context = gen.cfg.max_seq_len
    if len(ids) >= context:
        raise CommandError(f"--prompt is {len(ids)} tokens: the model's context is {context} tokens "
                           f"(model.max_seq_len), so a prompt may be at most {context - 1} tokens to leave room "
                           f"to generate: shorten it")
    check_sampling(args, gen.cfg.vocab_size)
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

