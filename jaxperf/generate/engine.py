"""Text generation with a KV cache: one prefill of the prompts, then a compiled decode loop.

    gen = Generator.from_checkpoint("runs/tiny")                 # config.json + newest checkpoint of a run
    gen = Generator(model, tokenizer)                            # any built-in GPT module
    out = gen.generate(["def ", "class "], max_tokens=64, temperature=0.8, top_p=0.95, seed=0)
    out[0].text, out.prefill_tokens_per_s, out.decode_tokens_per_s
    for new_tokens in gen.stream(["def "], max_tokens=64): ...   # lists of new ids per row, chunk by chunk

Two programs do all the work. `prefill` runs the right-padded prompts through the model once, filling cache slots
[0, P), and takes each row's logits at its last real token. `decode` is a `lax.while_loop` that samples a token per
row, writes it to the row's next slot and runs the one-token forward against the cache, until every row is done or
`chunk` steps have run. Settings (temperature, top-k, top-p, budget, stop ids, chunk) are traced arrays, so the
programs compile once per (row bucket, prompt bucket, cache length) and never per token: `generate` calls `decode`
once with the whole budget, `stream` calls the same compiled `decode` repeatedly with a chunk of steps.

Row i of a call with `seed=s` draws its t-th token with `fold_in(fold_in(key(s), i), t)`; with a list of seeds (one per
row, as a server passes them) row i uses `fold_in(fold_in(key(seeds[i]), 0), t)`. So a seed gives the same text whether
it is produced in one call or streamed in chunks, and a one-prompt request gives the same text alone or batched with
others. Sampling settings may also differ per row.

Legend: B rows (bucket), P prompt bucket, S cache slots, V padded vocabulary.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxperf import _compat
from jaxperf.config import from_dict
from jaxperf.data import tokenizer_for
from jaxperf.generate.cache import DecodeState, Settings, bucket, cache_sharding, cache_shape
from jaxperf.generate.sampling import check_settings, sample
from jaxperf.parallel.rules import Rules, activation_sharding, get_rules, logical_to_spec
from jaxperf.parallel.sharding import tree_shardings
from jaxperf.step.task import build_task
from jaxperf.train.checkpoint import Checkpointer

PAD_ID = 0
MIN_PROMPT_BUCKET = 8


@dataclasses.dataclass
class Generation:
    """One row's output: new token ids (a final stop token excluded), their text, and why it ended."""

    tokens: list[int]
    text: str | None
    prompt_tokens: int
    finish_reason: str  # "stop" | "length"


@dataclasses.dataclass
class GenerationBatch:
    """The rows of one `generate` call (indexable and iterable) with timings.

    prefill_s / decode_s are wall-clock seconds of the compiled calls (compilation excluded, reported in compile_s).
    """

    rows: list[Generation]
    prefill_s: float
    decode_s: float
    compile_s: float
    prefill_tokens: int
    decode_tokens: int
    shapes: dict[str, int]

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_s if self.prefill_s > 0 else float("inf")

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else float("inf")

    def __getitem__(self, i: int) -> Generation:
        return self.rows[i]

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self):
        return iter(self.rows)

    def timings(self) -> dict[str, float]:
        return {"prefill_s": self.prefill_s, "decode_s": self.decode_s, "compile_s": self.compile_s,
                "prefill_tokens": self.prefill_tokens, "decode_tokens": self.decode_tokens,
                "prefill_tokens_per_s": self.prefill_tokens_per_s, "decode_tokens_per_s": self.decode_tokens_per_s}


def _default_strategy(mesh: Mesh) -> str:
    return "fsdp_tp" if mesh.shape.get("fsdp", 1) > 1 else "tp"


class Generator:
    """Generation from a built-in GPT (`jaxperf.models.GPT`) on one device or a mesh.

    Args:
      model: the GPT module (its parameters are used unless `params` is given, e.g. an abstract module from
        `nnx.eval_shape` together with restored parameters).
      tokenizer: an object with `encode(text)` and `decode(ids)` (jaxperf.data tokenizers); needed for text prompts.
      mesh: a mesh with axes data / fsdp / tensor (default: the first device alone).
      strategy: the rule table for parameters and activations (default "tp", or "fsdp_tp" when fsdp > 1). Rows are
        split over the data axes and KV heads over `tensor`.
      params: a pure dict of parameter values replacing the module's.
      cache_dtype: dtype of the KV cache (default the model's compute dtype).
    """

    def __init__(self, model, tokenizer=None, *, mesh: Mesh | None = None, strategy: str | Rules | None = None,
                 params: Any = None, cache_dtype: Any = None):
        self.cfg = model.cfg
        self.tokenizer = tokenizer
        self.mesh = mesh if mesh is not None else _compat.make_mesh((1, 1, 1), ("data", "fsdp", "tensor"),
                                                                     devices=jax.devices()[:1])
        self.rules = get_rules(strategy or _default_strategy(self.mesh), self.mesh)
        self.cache_dtype = jnp.dtype(cache_dtype or self.cfg.dtype)
        self._graphdef, param_state, self._other = nnx.split(model, nnx.Param, ...)
        self._template = param_state
        axes = jax.tree.map(_compat.variable_logical_axes, param_state, is_leaf=lambda v: isinstance(v, nnx.Variable))
        axes = nnx.to_pure_dict(axes) if isinstance(axes, nnx.State) else axes
        values = nnx.to_pure_dict(param_state) if params is None else params
        self.param_shardings = tree_shardings(values, axes, self.mesh, self.rules)
        self.params = jax.device_put(values, self.param_shardings)
        self._replicated = NamedSharding(self.mesh, P())
        self._compiled: dict[tuple, Any] = {}
        self.compile_s = 0.0

    # ----------------------------------------------------------------------------------------------------------------
    @classmethod
    def from_checkpoint(cls, run_dir: str | Path, *, mesh: Mesh | None = None, strategy: str | None = None,
                        step: int | None = None, **kwargs) -> "Generator":
        """A Generator for a training run: run_dir/config.json and its newest intact checkpoint (or `step`)."""
        run_dir = Path(run_dir)
        cfg_file = run_dir / "config.json"
        if not cfg_file.exists():
            raise FileNotFoundError(f"{cfg_file} not found: --checkpoint takes the run_dir of a `jaxperf train` run")
        cfg = from_dict(json.loads(cfg_file.read_text()))
        mesh = mesh if mesh is not None else _compat.make_mesh((1, 1, 1), ("data", "fsdp", "tensor"),
                                                               devices=jax.devices()[:1])
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel,
                                                                    strategy=strategy or _default_strategy(mesh)))
        task = build_task(cfg, mesh, with_optimizer=False)  # the parameters alone: no optimizer is built
        target = {"params": task.abstract_params_sharded()}
        with Checkpointer(run_dir / "checkpoints") as ckpt:
            if step is None:
                restored, _, _ = ckpt.restore_latest(target)
            else:
                restored, _ = ckpt.restore(step, target)
        model = nnx.merge(task.graphdef, task.param_template, task.model_state)
        return cls(model, tokenizer_for(cfg), mesh=mesh, strategy=task.rules, params=restored["params"], **kwargs)

    # ----------------------------------------------------------------------------------------------------------------
    def _merge(self, params):
        template = jax.tree.map(lambda x: x, self._template)
        nnx.replace_by_pure_dict(template, params)
        return nnx.merge(self._graphdef, template, self._other)

    def _prefill_fn(self, params, tokens_BxP, prompt_len_B, done_B, seed_B, seed_row_B, *, max_len: int) -> DecodeState:
        B, Pb = tokens_BxP.shape
        with activation_sharding(self.mesh, self.rules):
            model = self._merge(params)
            k, v = model.init_cache(B, max_len, self.cache_dtype)
            positions = jnp.broadcast_to(jnp.arange(Pb, dtype=jnp.int32)[None], (B, Pb))
            h_BxPxD, k, v = model.cached(tokens_BxP, positions, k, v)
            last_BxD = jnp.take_along_axis(h_BxPxD, (prompt_len_B - 1)[:, None, None], axis=1)[:, 0]
            logits = self._logits(model, last_BxD)
        tokens_BxS = jnp.zeros((B, max_len), jnp.int32).at[:, :Pb].set(tokens_BxP)
        zeros = jnp.zeros((B,), jnp.int32)
        key_B = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seed_B, seed_row_B)
        return DecodeState(k, v, tokens_BxS, prompt_len_B, prompt_len_B, zeros, done_B, jnp.zeros((B,), bool),
                           logits, jnp.zeros((), jnp.int32), key_B)

    def _logits(self, model, h_BxD):
        logits_BxV = jnp.einsum("bd,dv->bv", h_BxD, model.output_weights().astype(h_BxD.dtype)).astype(jnp.float32)
        real = jnp.arange(logits_BxV.shape[-1]) < self.cfg.vocab_size  # never sample the vocabulary's padding
        return jnp.where(real[None, :], logits_BxV, -jnp.inf)

    def _decode_fn(self, params, state: DecodeState, settings: Settings, chunk) -> DecodeState:
        B, S = state.tokens_BxS.shape
        rows_B = jnp.arange(B)

        def cond(carry):
            i, s = carry
            return (i < chunk) & jnp.any(~s.done_B)

        def body(carry):
            i, s = carry
            with activation_sharding(self.mesh, self.rules):
                model = self._merge(params)
                key_B = jax.vmap(jax.random.fold_in)(s.key_B, s.generated_B)
                tok_B = sample(key_B, s.logits_BxV, settings.temperature, settings.top_k, settings.top_p)
                active = ~s.done_B
                tok_B = jnp.where(active, tok_B, PAD_ID)
                slot_B = s.lengths_B
                tokens = s.tokens_BxS.at[rows_B, slot_B].set(tok_B, mode="drop")  # past a done row's content
                hit_stop = active & jnp.any(tok_B[:, None] == settings.stop_ids[None, :], axis=-1)
                generated = s.generated_B + active.astype(jnp.int32)
                lengths = s.lengths_B + active.astype(jnp.int32)
                done = s.done_B | hit_stop | (lengths >= S) | (generated >= settings.max_tokens)
                write_B = jnp.minimum(slot_B, S - 1)
                h, k, v = model.cached(tok_B[:, None], write_B[:, None], s.k_cache, s.v_cache, write_B)
                logits = self._logits(model, h[:, 0])
            new = DecodeState(k, v, tokens, lengths, s.prompt_len_B, generated, done, s.stopped_B | hit_stop, logits,
                              s.step + 1, s.key_B)
            return i + 1, new

        _, state = jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), state))
        return state

    # ----------------------------------------------------------------------------------------------------------------
    def _executable(self, name: str, fn, args, static: dict, donate=()):
        """Ahead-of-time compiled `fn` for these argument shapes; compiled once per shape key, timed apart."""
        key = (name, tuple((a.shape, str(a.dtype)) for a in jax.tree.leaves(args)), tuple(sorted(static.items())))
        exe = self._compiled.get(key)
        if exe is None:
            t0 = time.perf_counter()
            exe = jax.jit(lambda *a: fn(*a, **static), donate_argnums=donate).lower(*args).compile()
            self.compile_s += time.perf_counter() - t0
            self._compiled[key] = exe
        return exe

    @property
    def compilations(self) -> int:
        """Programs compiled so far (one prefill and one decode per shape bucket)."""
        return len(self._compiled)

    def _encode(self, prompts) -> list[list[int]]:
        if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], (int, np.integer))):
            raise TypeError("prompts must be a list of strings or a list of token lists (wrap a single prompt in [])")
        rows = []
        for p in prompts:
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError("text prompts need a tokenizer: Generator(model, tokenizer) or pass token ids")
                p = self.tokenizer.encode(p)
            ids = [int(t) for t in np.asarray(p).reshape(-1)]
            if not ids:
                raise ValueError("an empty prompt has no last token to continue from: give at least one token")
            bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
            if bad:
                raise ValueError(f"token ids {bad[:5]} are outside the model's vocabulary [0, {self.cfg.vocab_size})")
            rows.append(ids)
        if not rows:
            raise ValueError("no prompts given")
        return rows

    def _stop_ids(self, stop) -> np.ndarray:
        ids = []
        for s in [] if stop is None else ([stop] if isinstance(stop, (int, str)) else stop):
            if isinstance(s, str):
                if self.tokenizer is None:
                    raise ValueError("a text stop needs a tokenizer; pass token ids instead")
                enc = [int(t) for t in self.tokenizer.encode(s)]
                if len(enc) != 1:
                    raise ValueError(f"stop {s!r} encodes to {len(enc)} tokens {enc}; stops are single tokens")
                s = enc[0]
            ids.append(int(s))
        out = np.full((bucket(len(ids), 8),), -1, np.int32)  # up to 8 stops share one shape
        out[: len(ids)] = ids
        return out

    def _shapes(self, rows: list[list[int]], max_tokens: int) -> dict[str, int]:
        max_seq = self.cfg.max_seq_len
        longest = max(len(r) for r in rows)
        if longest >= max_seq:
            raise ValueError(f"a prompt of {longest} tokens leaves no room to generate in model.max_seq_len={max_seq}: "
                             f"shorten it to at most {max_seq - 1} tokens")
        dp = 1
        for a in ("data", "fsdp"):
            dp *= self.mesh.shape.get(a, 1)
        B = bucket(len(rows))
        B = dp * -(-B // dp)
        S = min(bucket(longest + max_tokens, MIN_PROMPT_BUCKET), max_seq)
        Pb = min(bucket(longest, MIN_PROMPT_BUCKET), S)
        return {"batch": B, "prompt": Pb, "max_len": S}

    # ----------------------------------------------------------------------------------------------------------------
    def stream(self, prompts, max_tokens=64, *, temperature=1.0, top_k=0, top_p=1.0, stop=None, seed=0,
               chunk: int = 8) -> Iterator[list[list[int]]]:
        """Yield, after each compiled chunk of up to `chunk` decode steps, the new token ids of every row.

        Stop tokens are not yielded. The generator's return value (StopIteration.value) is the GenerationBatch
        `generate` would return. Arguments as in `generate`.
        """
        rows = self._encode(prompts)
        n = len(rows)
        per_row = {}
        for name, value in (("max_tokens", max_tokens), ("temperature", temperature), ("top_k", top_k),
                            ("top_p", top_p), ("seed", seed)):
            values = list(value) if isinstance(value, (list, tuple, np.ndarray)) else [value] * n
            if len(values) != n:
                raise ValueError(f"{name} has {len(values)} values for {n} prompts: give one value or one per prompt")
            per_row[name] = values
        for t, k, p in zip(per_row["temperature"], per_row["top_k"], per_row["top_p"]):
            check_settings(t, k, p)
        if min(per_row["max_tokens"]) < 1 or chunk < 1:
            raise ValueError(f"max_tokens={max_tokens} and chunk={chunk} must be >= 1")
        longest_budget = max(int(m) for m in per_row["max_tokens"])
        shapes = self._shapes(rows, longest_budget)
        B, Pb, S = shapes["batch"], shapes["prompt"], shapes["max_len"]
        tokens = np.full((B, Pb), PAD_ID, np.int32)
        lengths = np.ones((B,), np.int32)
        for i, r in enumerate(rows):
            tokens[i, : len(r)] = r
            lengths[i] = len(r)
        done = np.arange(B) >= n  # batch padding rows never decode

        def column(name, dtype, pad):
            return np.asarray(per_row[name] + [pad] * (B - n), dtype)

        per_row["seed"] = [int(x) % 2**32 for x in per_row["seed"]]
        seed_B = column("seed", np.uint32, 0)
        seed_row_B = np.arange(B, dtype=np.int32) if not isinstance(seed, (list, tuple, np.ndarray)) else \
            np.zeros((B,), np.int32)
        batch_sh = NamedSharding(self.mesh, logical_to_spec(("batch", None), self.rules.activations, self.mesh, (B, Pb)))
        row_sh = NamedSharding(self.mesh, logical_to_spec(("batch",), self.rules.activations, self.mesh, (B,)))
        rep = self._replicated
        args = (self.params, jax.device_put(tokens, batch_sh), jax.device_put(lengths, row_sh),
                jax.device_put(done, row_sh), jax.device_put(seed_B, rep), jax.device_put(seed_row_B, rep))
        compile_before = self.compile_s
        prefill = self._executable("prefill", self._prefill_fn, args, {"max_len": S})
        t0 = time.perf_counter()
        state = jax.block_until_ready(prefill(*args))
        prefill_s = time.perf_counter() - t0

        settings = jax.device_put(Settings(column("temperature", np.float32, 0.0), column("top_k", np.int32, 0),
                                           column("top_p", np.float32, 1.0), column("max_tokens", np.int32, 1),
                                           self._stop_ids(stop)), rep)
        chunk_arr = jax.device_put(np.int32(min(chunk, longest_budget)), rep)
        decode = self._executable("decode", self._decode_fn, (self.params, state, settings, chunk_arr), {},
                                  donate=(1,))
        decode_s = 0.0
        seen = [0] * len(rows)
        while True:
            t0 = time.perf_counter()
            state = jax.block_until_ready(decode(self.params, state, settings, chunk_arr))
            decode_s += time.perf_counter() - t0
            host = jax.device_get((state.tokens_BxS, state.generated_B, state.stopped_B, state.done_B))
            toks, gen, stopped, done_now = host
            new = []
            for i, r in enumerate(rows):
                n = int(gen[i]) - int(stopped[i] and done_now[i])
                new.append([int(t) for t in toks[i, len(r) + seen[i]: len(r) + n]])
                seen[i] = n
            if any(new):
                yield new
            if done_now[: len(rows)].all():
                break
        out = []
        for i, r in enumerate(rows):
            ids = [int(t) for t in toks[i, len(r): len(r) + seen[i]]]
            text = self.tokenizer.decode(np.asarray(ids, np.int64)) if self.tokenizer is not None else None
            out.append(Generation(ids, text, len(r), "stop" if stopped[i] else "length"))
        return GenerationBatch(out, prefill_s, decode_s, self.compile_s - compile_before,
                               sum(len(r) for r in rows), int(gen[: len(rows)].sum()), shapes)

    def generate(self, prompts, max_tokens=64, *, temperature=1.0, top_k=0, top_p=1.0, stop=None,
                 seed=0) -> GenerationBatch:
        """Continue each prompt by up to `max_tokens` tokens.

        Args:
          prompts: a list of strings (needs the tokenizer) or of token-id lists; lengths may differ.
          max_tokens: new tokens per row (generation also ends at model.max_seq_len).
          temperature: 0 = greedy; top_k: 0 = off; top_p: 1 = off (applied in that order, see sampling.py).
          stop: token ids (or single-token strings) that end a row; the stop token is not part of the output.
          seed: the same seed, prompts and settings give the same tokens.
          max_tokens, temperature, top_k, top_p and seed each take one value for all rows or a list, one per prompt.
        Returns:
          a GenerationBatch: rows of Generation(tokens, text, prompt_tokens, finish_reason) plus timings.
        """
        it = self.stream(prompts, max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, stop=stop,
                         seed=seed, chunk=max(1, int(np.max(max_tokens))))
        while True:
            try:
                next(it)
            except StopIteration as e:
                return e.value


class TextStream:
    """Turns a growing list of token ids into text pieces, holding back a character whose bytes are incomplete."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.sent = tokenizer, [], 0

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids)
        ready = len(text.rstrip("\ufffd"))
        piece, self.sent = text[self.sent:ready], max(self.sent, ready)
        return piece

    def finish(self) -> str:
        text = self.tokenizer.decode(self.ids)
        piece, self.sent = text[self.sent:], len(text)
        return piece


__all__ = ["Generation", "GenerationBatch", "Generator", "TextStream", "cache_shape", "cache_sharding"]
