"""How fast does a GPT generate, and how close is a decode step to the memory-bandwidth limit? JSON lines.

    python benchmarks/bench_generate.py --tiny                      # CPU-sized model, batch sizes 1 and 4
    python benchmarks/bench_generate.py --preset gpt2-small --batch-sizes 1,8,32 --max-tokens 128
    python benchmarks/bench_generate.py --quantize int8              # weight-only int8 (jaxperf.models.quant)
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python benchmarks/bench_generate.py --data 2   # 2 CPU cores

For each batch size: prefill tokens/s (prompt tokens / prefill time) and decode tokens/s (new tokens / decode time),
the medians over `--repeats` generations after one warm-up that compiles (compile time reported apart). A decode step
has to read every weight and the whole KV cache once (the reference decode attention reads all S slots of each row,
where each row's slots lie contiguously per KV head), so its floor is (weight bytes + cache bytes) / HBM bandwidth; `pct_of_peak` is that floor over the measured step time.
`--data N` splits the rows over N devices (one engine, a mesh data=N): each device decodes its rows in a loop of its
own (jaxperf.generate.engine), so on a CPU each simulated device is a core at work. Batch 1 then takes N rows (the
row bucket is a multiple of N), of which one is used; the figures count the used rows only.
Greedy decoding with no stop tokens, so every row produces exactly `--max-tokens` tokens. Random weights: speed does not
depend on them. Before timing, the greedy tokens of the first row are checked against a full forward of the model.
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from jaxperf.perf.cpu_host import reexec_with_huge_pages
from jaxperf.benchmarks._common import emit, record


def _check(model, gen, prompt: list[int], vocab: int) -> None:
    """The engine's greedy tokens equal the argmax of the full forward, step by step (a wrong cache fails here)."""
    out = gen.generate([prompt], max_tokens=4, temperature=0.0)[0].tokens
    seq = list(prompt)
    for tok in out:
        want = int(jnp.argmax(model(jnp.asarray([seq]))[0, -1, :vocab]))
        if tok != want:
            raise AssertionError(f"cached decode chose {tok} where the full forward chooses {want} after {seq}")
        seq.append(tok)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--tiny", action="store_true", help="a small model and short runs for CPU")
    parser.add_argument("--batch-sizes", default=None, help="comma-separated (default 1,4 with --tiny, else 1,8,32)")
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--quantize", choices=("int8",), default=None, help="weight-only int8 weights")
    parser.add_argument("--data", type=int, default=1, help="devices the rows are split over (default 1)")
    parser.add_argument("overrides", nargs="*", help="config key=value, e.g. model.dtype=bfloat16")
    args = parser.parse_args(argv)

    from flax import nnx

    from jaxperf import _compat
    from jaxperf.config import get_config, validate_model
    from jaxperf.generate import Generator, cache_bytes
    from jaxperf.models import GPT
    from jaxperf.perf.hardware import peak_bandwidth

    tiny = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.max_seq_len=128"] if args.tiny else []
    cfg = get_config(args.preset, tiny + list(args.overrides))
    mcfg = validate_model(cfg.model)
    batch_sizes = [int(b) for b in (args.batch_sizes or ("1,4" if args.tiny else "1,8,32")).split(",")]
    # Defaults fit the model's context: a quarter of it for the prompt, up to 128 new tokens in the rest.
    prompt_len = args.prompt_len or (16 if args.tiny else min(128, mcfg.max_seq_len // 4))
    max_tokens = args.max_tokens or (32 if args.tiny else min(128, mcfg.max_seq_len - prompt_len))
    if prompt_len + max_tokens > mcfg.max_seq_len:
        parser.error(f"--prompt-len {prompt_len} + --max-tokens {max_tokens} exceed model.max_seq_len="
                     f"{mcfg.max_seq_len}: every row must be able to produce all its tokens for the figures to hold")
    repeats = args.repeats or (3 if args.tiny else 5)

    if not 1 <= args.data <= jax.device_count():
        parser.error(f"--data {args.data} needs that many devices, {jax.device_count()} are visible: on CPU set "
                     f"XLA_FLAGS=--xla_force_host_platform_device_count={max(args.data, 1)}")
    mesh = _compat.make_mesh((args.data, 1, 1), ("data", "fsdp", "tensor"), devices=jax.devices()[: args.data])
    model = GPT(mcfg, rngs=nnx.Rngs(0))
    gen = Generator(model, mesh=mesh, quantize=args.quantize)
    rng = np.random.default_rng(0)
    if args.quantize is None:  # the int8 engine is checked against the int8 model in tests/test_quantize.py
        _check(model, gen, [int(t) for t in rng.integers(0, mcfg.vocab_size, 5)], mcfg.vocab_size)
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(gen.params))
    bw, bw_source = peak_bandwidth()

    records = []
    for B in batch_sizes:
        prompts = [[int(t) for t in rng.integers(0, mcfg.vocab_size, prompt_len)] for _ in range(B)]
        first = gen.generate(prompts, max_tokens, temperature=0.0)  # compiles this bucket
        runs = [gen.generate(prompts, max_tokens, temperature=0.0) for _ in range(repeats)]
        prefill_s = statistics.median(r.prefill_s for r in runs)
        decode_s = statistics.median(r.decode_s for r in runs)
        steps = max_tokens
        step_s = decode_s / steps
        S = first.shapes["max_len"]
        bytes_per_step = weight_bytes + cache_bytes(mcfg, first.shapes["batch"], S)
        floor_s = bytes_per_step / bw
        common = dict(batch=B, prompt_len=prompt_len, max_tokens=max_tokens, shapes=first.shapes,
                      compile_s=first.compile_s, repeats=repeats, dtype=mcfg.dtype, preset=args.preset,
                      weights=args.quantize or "fp32", data=args.data,
                      tiny=args.tiny, n_params=int(sum(x.size for x in jax.tree.leaves(gen.params))))
        records.append(emit(record("generate", f"prefill_b{B}", B * prompt_len / prefill_s, "tokens/s",
                                   prefill_s=prefill_s, **common)))
        records.append(emit(record(
            "generate", f"decode_b{B}", B * steps / decode_s, "tokens/s", peak_per_s=1.0 / floor_s,
            value_per_s=1.0 / step_s, decode_s=decode_s, step_s=step_s, bandwidth_floor_s=floor_s,
            weight_bytes=weight_bytes, cache_bytes=cache_bytes(mcfg, first.shapes["batch"], S),
            hbm_bw=bw, hbm_bw_source=bw_source, **common)))
    return records


if __name__ == "__main__":
    reexec_with_huge_pages()  # XLA:CPU step buffers on huge pages (jaxperf.perf.cpu_host)
    main()
