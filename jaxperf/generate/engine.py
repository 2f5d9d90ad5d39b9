"""Text generation with a KV cache: prompts are inserted into rows of a decode state, then a compiled loop decodes.

    gen = Generator.from_checkpoint("runs/tiny")                 # config.json + newest checkpoint (or an int8 one)
    gen = Generator(model, tokenizer, quantize="int8")           # any built-in GPT module, optionally int8 weights
    out = gen.generate(["def ", "class "], max_tokens=64, temperature=0.8, top_p=0.95, seed=0)
    out[0].text, out.prefill_tokens_per_s, out.decode_tokens_per_s
    for new_tokens in gen.stream(["def "], max_tokens=64): ...   # lists of new ids per row, chunk by chunk

    state = gen.new_state(batch=8, max_len=256)                  # the engine API a server schedules with
    state = gen.insert(state, [ids], slots=[3], seeds=[7], ...)  # prefill one request into slot 3
    state, out = gen.decode(state, steps=8)                      # up to 8 steps of every running row

Three programs do all the work. `new_state` makes an empty state of B rows (all free). `insert` runs n right-padded
prompts through the model once, writes their keys and values into cache slots [0, P) of the rows they are given, and
sets those rows' logits (at each prompt's last token), settings, budget and key. `decode` is a `lax.while_loop` that
samples a token per running row, writes it to the row's next cache slot and runs the one-token forward against the
cache, for up to `steps` steps (at most `max_chunk`, the width of its output buffer), stopping early when every row
is done or, if asked, when any row finishes. Settings are per-row arrays of the state, so the programs compile once
per (rows, prompt bucket, cache length) and never per token or setting. `generate` and `stream` are a static batch
on these programs: one insert of all prompts, then decode calls until every row is done; a server
(jaxperf.generate.scheduler) inserts requests into free rows between decode calls instead.

Parameters are held in a serving layout: a model with stacked layers (`scan_layers`) is unstacked once, so each layer
reads its own weights and its own cache buffer in place, and int8 weights (`quantize="int8"`, an `Int8Weight` per
matmul weight and embedding table, jaxperf.models.quant) are kept as int8 values with per-channel scales.

Row i of a call with `seed=s` draws its t-th token with `fold_in(fold_in(key(s), i), t)`; with a list of seeds (one per
row, as a server passes them) row i uses `fold_in(fold_in(key(seeds[i]), 0), t)`. So a seed gives the same text whether
it is produced in one call or streamed in chunks, and a one-prompt request gives the same text alone or batched with
others, in whichever row it lands. Sampling settings may also differ per row.

Legend: B rows, n inserted rows, P prompt bucket, S cache slots, V padded vocabulary, C steps per decode call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import time
from collections.abc import Iterator, Sequence
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
from jaxperf.generate.cache import N_STOP, DecodeState, bucket
from jaxperf.generate.quantize import is_quantized_dir, restore_quantized
from jaxperf.generate.sampling import check_settings, sample
from jaxperf.models.gpt import CACHE_AXES
from jaxperf.models.layers import dense
from jaxperf.models.quant import Int8Weight, is_int8, quantize_params, scale_axes
from jaxperf.parallel.rules import Rules, activation_sharding, constrain, get_rules, logical_to_spec
from jaxperf.step.task import build_task
from jaxperf.checkpoint import Checkpointer

PAD_ID = 0
NO_TOKEN = -1  # in decode's output buffer: the row produced nothing at that step
MIN_PROMPT_BUCKET = 8
MAX_CHUNK = 32  # decode steps per call at most (the width of the output buffer)
_INSERT_COLUMNS = 8  # per-row settings between the prompt tokens and the stop ids in `insert`'s packed array


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


@dataclasses.dataclass
class DecodeOutput:
    """What one `decode` call produced, on the host: tokens[b] are row b's new ids (stop tokens left out)."""

    tokens: list[list[int]]
    generated: np.ndarray  # int32 [B]: tokens produced so far per row
    done: np.ndarray  # bool [B]
    stopped: np.ndarray  # bool [B]: ended on a stop token
    steps: int  # decode steps this call ran
    seconds: float  # wall clock of the call


def _default_strategy(mesh: Mesh) -> str:
    return "fsdp_tp" if mesh.shape.get("fsdp", 1) > 1 else "tp"


def _single_device_mesh() -> Mesh:
    return _compat.make_mesh((1, 1, 1), ("data", "fsdp", "tensor"), devices=jax.devices()[:1])


def unstack_layers(params: dict, n_layers: int) -> dict:
    """Stacked layer parameters {"blocks": {leaf: [N, ...]}} as a list of layers {"blocks": {0: {...}, 1: ...}}."""
    out = dict(params)
    out["blocks"] = {i: jax.tree.map(lambda x, i=i: x[i], params["blocks"]) for i in range(n_layers)}
    return out


class Generator:
    """Generation from a built-in GPT (`jaxperf.models.GPT`) on one device or a mesh.

    Args:
      model: the GPT module (its parameters are used unless `params` is given, e.g. an abstract module from
        `nnx.eval_shape` together with restored parameters).
      tokenizer: an object with `encode(text)` and `decode(ids)` (jaxperf.data tokenizers); needed for text prompts.
      mesh: a mesh with axes data / fsdp / tensor (default: the first device alone).
      strategy: the rule table for parameters and activations (default "tp", or "fsdp_tp" when fsdp > 1). Rows are
        split over the data axes and KV heads over `tensor`.
      params: a pure dict of parameter values replacing the module's (fp32, or already int8 from a quantized
        checkpoint; stacked or unstacked layers as the model has them).
      cache_dtype: dtype of the KV cache (default the model's compute dtype).
      quantize: None, or "int8" for weight-only int8 with per-channel scales (jaxperf.models.quant).
      max_chunk: decode steps one `decode` call can run (the width of its output buffer).
    """

    def __init__(self, model, tokenizer=None, *, mesh: Mesh | None = None, strategy: str | Rules | None = None,
                 params: Any = None, cache_dtype: Any = None, quantize: str | None = None, max_chunk: int = MAX_CHUNK):
        if quantize not in (None, "int8"):
            raise ValueError(f"quantize={quantize!r}: choose None or 'int8'")
        if max_chunk < 1:
            raise ValueError(f"max_chunk={max_chunk} must be >= 1")
        self.tokenizer = tokenizer
        self.mesh = mesh if mesh is not None else _single_device_mesh()
        self.rules = get_rules(strategy or _default_strategy(self.mesh), self.mesh)
        self.max_chunk = int(max_chunk)
        cfg = model.cfg
        _, param_state, _ = nnx.split(model, nnx.Param, ...)
        values = nnx.to_pure_dict(param_state) if params is None else params
        # The serving layout: one set of weights per layer, read in place; and no whole-weight gathers for the MLP (a
        # train-step choice, `model.gather_mlp_weights`: a decode step's few rows are cheaper to move than weights).
        serving = dataclasses.replace(cfg, scan_layers=False, gather_mlp_weights=False)
        if serving != cfg:
            model = nnx.eval_shape(lambda: type(model)(serving, rngs=nnx.Rngs(0)))
            if cfg.scan_layers:
                values = unstack_layers(values, cfg.n_layers)
            cfg = serving
        if quantize == "int8":
            values = quantize_params(values)
        self.cfg = cfg
        self.cache_dtype = jnp.dtype(cache_dtype or cfg.dtype)
        self._model_type = type(model)
        self._graphdef, self._template, self._other = nnx.split(model, nnx.Param, ...)
        axes = jax.tree.map(_compat.variable_logical_axes, self._template,
                            is_leaf=lambda v: isinstance(v, nnx.Variable))
        self._axes = nnx.to_pure_dict(axes) if isinstance(axes, nnx.State) else axes
        self.param_shardings = self._shardings(values)
        self.params = jax.device_put(values, self.param_shardings)
        self.quantized = any(is_int8(x) for x in jax.tree.leaves(self.params, is_leaf=is_int8))
        self._replicated = NamedSharding(self.mesh, P())
        self._compiled: dict[tuple, Any] = {}
        self.compile_s = 0.0

    def _shardings(self, values):
        def one(axes, x):
            if is_int8(x):
                return Int8Weight(self._named(axes, x.q.shape), self._named(scale_axes(axes, x.scale.shape),
                                                                            x.scale.shape))
            return self._named(axes, x.shape)

        return jax.tree.map(one, self._axes, values, is_leaf=lambda a: isinstance(a, tuple) or a is None)

    def _named(self, axes, shape) -> NamedSharding:
        return NamedSharding(self.mesh, logical_to_spec(axes, self.rules.params, self.mesh, shape))

    @property
    def weight_bytes(self) -> int:
        """Bytes of the parameters as held (int8 values and scales counted as such)."""
        return int(sum(x.nbytes for x in jax.tree.leaves(self.params)))

    def on(self, mesh: Mesh | None = None, *, strategy: str | Rules | None = None,
           quantize: str | None = None) -> "Generator":
        """The same model and parameters on another mesh (a replica), or int8 (`quantize="int8"`): the parameters
        are copied, the programs compiled anew."""
        model = nnx.merge(self._graphdef, self._template, self._other)
        return Generator(model, self.tokenizer, mesh=mesh if mesh is not None else self.mesh, strategy=strategy,
                         params=jax.device_get(self.params), cache_dtype=self.cache_dtype, quantize=quantize,
                         max_chunk=self.max_chunk)

    # ----------------------------------------------------------------------------------------------------------------
    @classmethod
    def from_checkpoint(cls, run_dir: str | Path, *, mesh: Mesh | None = None, strategy: str | None = None,
                        step: int | None = None, **kwargs) -> "Generator":
        """A Generator for a training run: run_dir/config.json and its newest intact checkpoint (or `step`).

        The run is only read: a corrupt step is skipped where it lies (one warning names it and the step used), never
        moved aside, and nothing in run_dir is created or changed.

        A directory written by `jaxperf quantize` is read as int8 (its scales are verified: a damaged one raises
        CorruptCheckpointError or ValueError naming the weight).
        """
        run_dir = Path(run_dir)
        cfg_file = run_dir / "config.json"
        if not cfg_file.exists():
            raise FileNotFoundError(f"{cfg_file} not found: --checkpoint takes the run_dir of a `jaxperf train` run "
                                    f"or the --out of `jaxperf quantize`")
        cfg = from_dict(json.loads(cfg_file.read_text()))
        mesh = mesh if mesh is not None else _single_device_mesh()
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel,
                                                                    strategy=strategy or _default_strategy(mesh)))
        task = build_task(cfg, mesh, with_optimizer=False)  # the parameters alone: no optimizer is built
        model = nnx.merge(task.graphdef, task.param_template, task.model_state)
        if is_quantized_dir(run_dir):
            params = restore_quantized(run_dir, task.abstract_params_sharded(), step=step)
        else:
            target = {"params": task.abstract_params_sharded()}
            with Checkpointer(run_dir / "checkpoints", read_only=True) as ckpt:
                restored, _, _ = ckpt.restore_step_or_latest(step, target)
            params = restored["params"]
        return cls(model, tokenizer_for(cfg), mesh=mesh, strategy=task.rules, params=params, **kwargs)

    # ----------------------------------------------------------------------------------------------------------------
    def _merge(self, params):
        template = jax.tree.map(lambda x: x, self._template)
        nnx.replace_by_pure_dict(template, params)
        return nnx.merge(self._graphdef, template, self._other)

    def _logits(self, model, h_BxD):
        if model.head_DxV is None:  # tied: contract with the table's D axis, never transposing [V, D] per step
            table = model.embed_VxD[...]
            q = table.q if is_int8(table) else table
            logits_BxV = jnp.einsum("bd,vd->bv", h_BxD, q.astype(h_BxD.dtype), preferred_element_type=jnp.float32)
            if is_int8(table):
                logits_BxV = logits_BxV * table.scale.reshape(1, -1)
        else:
            logits_BxV = dense(h_BxD, model.output_weights().astype(h_BxD.dtype)).astype(jnp.float32)
        real = jnp.arange(logits_BxV.shape[-1]) < self.cfg.vocab_size  # never sample the vocabulary's padding
        return jnp.where(real[None, :], logits_BxV, -jnp.inf)

    def _rows(self, x, *rest):
        return constrain(x, ("batch", *rest))

    def _empty_fn(self, *, batch: int, max_len: int) -> DecodeState:
        B = batch
        with activation_sharding(self.mesh, self.rules):
            k, v = self._merge_abstract().init_cache(B, max_len, self.cache_dtype)
        zeros_i = jnp.zeros((B,), jnp.int32)
        return self._constrained(DecodeState(
            k, v, zeros_i, zeros_i, jnp.ones((B,), bool), jnp.zeros((B,), bool),
            jnp.zeros((B, self.cfg.padded_vocab), jnp.float32), jax.random.split(jax.random.key(0), B),
            jnp.zeros((B,), jnp.float32), zeros_i, jnp.ones((B,), jnp.float32), zeros_i,
            jnp.full((B, N_STOP), -1, jnp.int32)))

    def _constrained(self, s: DecodeState) -> DecodeState:
        """Every field of a state with its sharding (caches per CACHE_AXES, rows over the data axes), so the three
        programs hand states to each other with identical shardings."""
        with activation_sharding(self.mesh, self.rules):
            rows = {f.name: self._rows(getattr(s, f.name), *([None] * (getattr(s, f.name).ndim - 1)))
                    for f in dataclasses.fields(s) if f.name not in ("k_cache", "v_cache")}
            return s.replace(k_cache=tuple(constrain(c, CACHE_AXES) for c in s.k_cache),
                             v_cache=tuple(constrain(c, CACHE_AXES) for c in s.v_cache), **rows)

    def _merge_abstract(self):
        return nnx.merge(self._graphdef, self._template, self._other)

    def _insert_packed(self, params, state: DecodeState, packed_nxC) -> DecodeState:
        """`_insert_fn` on its host arguments packed into one int32 array (see `insert`): the prompt tokens [n, P],
        then the columns prompt length, slot, seed (uint32 bits), fold, temperature (float32 bits), top_k, top_p
        (float32 bits), max_tokens, then the stop ids [n, N_STOP]."""
        Pb = packed_nxC.shape[1] - _INSERT_COLUMNS - N_STOP
        length, slot, seed, fold, temperature, top_k, top_p, max_tokens = (
            packed_nxC[:, Pb + i] for i in range(_INSERT_COLUMNS))
        f32 = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.float32)
        return self._insert_fn(params, state, packed_nxC[:, :Pb], length, slot,
                               jax.lax.bitcast_convert_type(seed, jnp.uint32), fold, f32(temperature), top_k,
                               f32(top_p), max_tokens, packed_nxC[:, Pb + _INSERT_COLUMNS:])

    def _insert_fn(self, params, state: DecodeState, tokens_nxP, prompt_len_n, slot_n, seed_n, fold_n, temperature_n,
                   top_k_n, top_p_n, max_tokens_n, stop_ids_nxNS) -> DecodeState:
        n, Pb = tokens_nxP.shape
        with activation_sharding(self.mesh, self.rules):
            model = self._merge(params)
            k0, v0 = model.init_cache(n, Pb, self.cache_dtype)
            positions = jnp.broadcast_to(jnp.arange(Pb, dtype=jnp.int32)[None], (n, Pb))
            h_nxPxD, k0, v0 = model.cached(tokens_nxP, positions, k0, v0)
            last_nxD = jnp.take_along_axis(h_nxPxD, (prompt_len_n - 1)[:, None, None], axis=1)[:, 0]
            logits_n = self._logits(model, last_nxD)
            # Rows of padding (slot == B) are dropped by every scatter below.
            k = tuple(c.at[slot_n, :, :Pb].set(new, mode="drop") for c, new in zip(state.k_cache, k0))
            v = tuple(c.at[slot_n, :, :Pb].set(new, mode="drop") for c, new in zip(state.v_cache, v0))
            k = tuple(constrain(c, CACHE_AXES) for c in k)
            v = tuple(constrain(c, CACHE_AXES) for c in v)
        key_n = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seed_n, fold_n)

        def put(x, new):
            return x.at[slot_n].set(new, mode="drop")

        return self._constrained(DecodeState(
            k, v, put(state.lengths_B, prompt_len_n), put(state.generated_B, jnp.zeros_like(prompt_len_n)),
            put(state.done_B, jnp.zeros(slot_n.shape, bool)), put(state.stopped_B, jnp.zeros(slot_n.shape, bool)),
            put(state.logits_BxV, logits_n), put(state.key_B, key_n), put(state.temperature_B, temperature_n),
            put(state.top_k_B, top_k_n), put(state.top_p_B, top_p_n), put(state.max_tokens_B, max_tokens_n),
            put(state.stop_ids_BxNS, stop_ids_nxNS)))

    def _rows_local(self) -> bool:
        """True when rows are all the mesh splits (its `tensor` axis is 1): each device then holds whole rows and
        whole weights, and runs its own decode loop (`_decode_fn`)."""
        return self.mesh.shape.get("tensor", 1) == 1

    def _decode_fn(self, params, state: DecodeState, packed) -> tuple[DecodeState, Any]:
        """The decode loop over the whole state, or, when rows are all the mesh splits, one loop per device.

        `packed` is the host's [steps, exit_on_finish, cancel_B...] in one int32 array (see `decode`).

        Per-device loops (a shard_map over the rows) share nothing while they run: each device decodes its own rows,
        tests its own rows for the loop's exit and stops on its own, so no step waits on a cross-device reduction
        and the devices decode in parallel. A row's tokens do not depend on which loop runs it. With the weights
        split over `tensor`, one loop spans the mesh instead.
        """
        if not self._rows_local():
            state, report = self._decode_loop(params, state, packed[0], packed[1] != 0, packed[2:] != 0,
                                              constrained=True)
            return self._constrained(state), report
        rows = logical_to_spec(("batch",), self.rules.activations, self.mesh, (state.batch,))
        row_axes = rows[0] if len(rows) else None
        row_spec = P(row_axes)
        state_specs = jax.tree.map(lambda _: row_spec, state)

        def local(p, s, packed):
            # Every device gets the whole packed array and takes its own rows' cancel flags: no resharding.
            first = jax.lax.axis_index(row_axes) * s.batch if row_axes is not None else 0
            cancel = jax.lax.dynamic_slice_in_dim(packed[2:], first, s.batch) != 0
            return self._decode_loop(p, s, packed[0], packed[1] != 0, cancel, constrained=False)

        loop = _compat.shard_map(local, mesh=self.mesh, in_specs=(P(), state_specs, P()),
                                 out_specs=(state_specs, row_spec), check_vma=False)
        state, report = loop(params, state, packed)
        return self._constrained(state), report

    def _decode_loop(self, params, state: DecodeState, steps, exit_on_finish, cancel_B, *,
                     constrained: bool) -> tuple[DecodeState, Any]:
        B, S, C = state.batch, state.max_len, self.max_chunk
        state = state.replace(done_B=state.done_B | cancel_B)
        sharding = activation_sharding(self.mesh, self.rules) if constrained else contextlib.nullcontext()
        out_BxC = jnp.full((B, C), NO_TOKEN, jnp.int32)

        def cond(carry):
            i, s, _, finished = carry
            return (i < jnp.minimum(steps, C)) & jnp.any(~s.done_B) & ~(exit_on_finish & finished)

        def body(carry):
            i, s, out, finished = carry
            with sharding:
                model = self._merge(params)
                key_B = jax.vmap(jax.random.fold_in)(s.key_B, s.generated_B)
                tok_B = sample(key_B, s.logits_BxV, s.temperature_B, s.top_k_B, s.top_p_B)
                active = ~s.done_B
                tok_B = jnp.where(active, tok_B, PAD_ID)
                hit_stop = active & jnp.any(tok_B[:, None] == s.stop_ids_BxNS, axis=-1)
                out = out.at[:, i].set(jnp.where(active & ~hit_stop, tok_B, NO_TOKEN))
                generated = s.generated_B + active.astype(jnp.int32)
                lengths = s.lengths_B + active.astype(jnp.int32)
                done = s.done_B | hit_stop | (lengths >= S) | (generated >= s.max_tokens_B)
                write_B = jnp.minimum(s.lengths_B, S - 1)  # this token's position = its cache slot
                h, k, v = model.cached(tok_B[:, None], write_B[:, None], s.k_cache, s.v_cache, write_B)
                logits = self._logits(model, h[:, 0])
            new = s.replace(k_cache=k, v_cache=v, lengths_B=lengths, generated_B=generated, done_B=done,
                            stopped_B=s.stopped_B | hit_stop, logits_BxV=logits)
            return i + 1, new, out, finished | jnp.any(done & active)

        i, state, out_BxC, _ = jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), state, out_BxC,
                                                                jnp.zeros((), bool)))
        # Everything the host reads, in one array (one transfer): tokens, generated, done, stopped, steps run.
        report_Bx4 = jnp.stack([state.generated_B, state.done_B.astype(jnp.int32), state.stopped_B.astype(jnp.int32),
                                jnp.broadcast_to(i, (B,))], axis=1)
        return state, jnp.concatenate([out_BxC, report_Bx4], axis=1)

    # ----------------------------------------------------------------------------------------------------------------
    def _executable(self, name: str, fn, args, static: dict, donate=()):
        """Ahead-of-time compiled `fn` for these argument shapes; compiled once per shape key, timed apart.

        The parameters (always the first argument) never change shape, so the key leaves them out: it is built on
        every call, and a serving loop calls often.
        """
        rest = args[1:] if args and args[0] is self.params else args
        key = (name, tuple((a.shape, a.dtype) for a in jax.tree.leaves(rest)), tuple(sorted(static.items())))
        exe = self._compiled.get(key)
        if exe is None:
            t0 = time.perf_counter()
            exe = jax.jit(lambda *a: fn(*a, **static), donate_argnums=donate).lower(*args).compile()
            self.compile_s += time.perf_counter() - t0
            self._compiled[key] = exe
        return exe

    @property
    def compilations(self) -> int:
        """Programs compiled so far (an empty state, an insert per (rows, prompt) bucket, a decode per state shape)."""
        return len(self._compiled)

    def _row_sharding(self, shape) -> NamedSharding:
        axes = ("batch",) + (None,) * (len(shape) - 1)
        return NamedSharding(self.mesh, logical_to_spec(axes, self.rules.activations, self.mesh, shape))

    def _data_parallel(self) -> int:
        dp = 1
        for a in ("data", "fsdp"):
            dp *= self.mesh.shape.get(a, 1)
        return dp

    def rows_for(self, n: int) -> int:
        """The row bucket for n rows: a power of two, rounded up to a multiple of the data-parallel devices."""
        dp = self._data_parallel()
        return dp * -(-bucket(n) // dp)

    def new_state(self, batch: int, max_len: int) -> DecodeState:
        """An empty decode state: `batch` free rows, a KV cache of `max_len` slots per row."""
        if max_len > self.cfg.max_seq_len:
            raise ValueError(f"max_len={max_len} is above model.max_seq_len={self.cfg.max_seq_len}")
        if batch % self._data_parallel():
            raise ValueError(f"batch={batch} must be a multiple of the mesh's data-parallel size "
                             f"{self._data_parallel()}")
        exe = self._executable("empty", self._empty_fn, (), {"batch": int(batch), "max_len": int(max_len)})
        return exe()

    def insert(self, state: DecodeState, prompts: Sequence[Sequence[int]], slots: Sequence[int], *,
               seeds: Sequence[int], folds: Sequence[int] | None = None, temperature: Sequence[float],
               top_k: Sequence[int], top_p: Sequence[float], max_tokens: Sequence[int],
               stop_ids: np.ndarray | None = None) -> DecodeState:
        """Prefill `prompts` (token-id lists, already validated) into rows `slots` of `state`; returns the new state.

        The old state is donated (its buffers are reused in place). Row i draws its t-th token with
        fold_in(fold_in(key(seeds[i]), folds[i]), t) (folds default to 0). `stop_ids` is [n, N_STOP] (-1 padded) or
        None. Compiles once per (row bucket, prompt bucket) for this state's shape.
        """
        n, B, S = len(prompts), state.batch, state.max_len
        if n != len(slots) or not n:
            raise ValueError(f"{n} prompts for {len(slots)} slots: give one slot per prompt")
        longest = max(len(p) for p in prompts)
        if longest >= S:
            raise ValueError(f"a prompt of {longest} tokens leaves no room in a cache of {S} slots")
        nb = min(bucket(n), bucket(B))
        Pb = min(bucket(longest, MIN_PROMPT_BUCKET), S)
        tokens = np.full((nb, Pb), PAD_ID, np.int32)
        lengths = np.ones((nb,), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = p
            lengths[i] = len(p)

        def col(values, dtype, pad):
            return np.asarray(list(values) + [pad] * (nb - n), dtype)

        stops = np.full((nb, N_STOP), -1, np.int32)
        if stop_ids is not None:
            stops[:n] = stop_ids
        columns = [lengths, col(slots, np.int32, B), col([int(s) % 2**32 for s in seeds], np.uint32, 0),
                   col(folds or [0] * n, np.int32, 0), col(temperature, np.float32, 0.0), col(top_k, np.int32, 0),
                   col(top_p, np.float32, 1.0), col(max_tokens, np.int32, 1)]
        # One int32 array (floats and seeds by their bits): each host array put on a device costs tens of us.
        packed = np.concatenate([tokens] + [c.view(np.int32)[:, None] for c in columns] + [stops], axis=1)
        args = (self.params, state, jax.device_put(packed, self._replicated))
        exe = self._executable("insert", self._insert_packed, args, {}, donate=(1,))
        return exe(*args)

    def decode(self, state: DecodeState, steps: int | None = None, *, exit_on_finish: bool = False,
               cancel: Sequence[int] = ()) -> tuple[DecodeState, DecodeOutput]:
        """Up to `steps` (<= max_chunk) decode steps of every running row; returns (new state, DecodeOutput).

        Stops early when every row is done, or with `exit_on_finish` as soon as some row finishes (a server then
        reuses its slot at once). When the rows are split over devices that each run their own loop (a mesh whose
        `tensor` axis is 1), "every row" and "some row" mean those of one device: a device stops on its own, and
        the call returns when all have stopped (`steps` is the most any ran). Rows in `cancel` are marked done
        first. The old state is donated.
        """
        B = state.batch
        steps = self.max_chunk if steps is None else int(steps)
        if not 1 <= steps <= self.max_chunk:
            raise ValueError(f"steps={steps} must lie in [1, {self.max_chunk}] (max_chunk)")
        cancel_B = np.zeros((B,), bool)
        cancel_B[list(cancel)] = True
        packed = np.concatenate([np.array([steps, exit_on_finish], np.int32), cancel_B.astype(np.int32)])
        args = (self.params, state, jax.device_put(packed, self._replicated))  # one host array: one transfer
        exe = self._executable("decode", self._decode_fn, args, {}, donate=(1,))
        t0 = time.perf_counter()
        state, report = exe(*args)
        report = np.asarray(report)
        seconds = time.perf_counter() - t0
        out, C = report[:, : self.max_chunk], self.max_chunk
        tokens = [row[row != NO_TOKEN].tolist() for row in out]
        # Per-device loops may run different numbers of steps: the call ran as many as the longest.
        return state, DecodeOutput(tokens, report[:, C], report[:, C + 1].astype(bool), report[:, C + 2].astype(bool),
                                   int(report[:, C + 3].max()) if B else 0, seconds)

    # ----------------------------------------------------------------------------------------------------------------
    def encode(self, prompts) -> list[list[int]]:
        """Token-id lists for a list of prompts (strings need the tokenizer), checked against the vocabulary."""
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

    def stop_ids(self, stop) -> np.ndarray:
        """[N_STOP] int32 ids (-1 padded) for token ids or single-token strings."""
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
        if len(ids) > N_STOP:
            raise ValueError(f"{len(ids)} stop ids given; at most {N_STOP}")
        out = np.full((N_STOP,), -1, np.int32)
        out[: len(ids)] = ids
        return out

    def _shapes(self, rows: list[list[int]], max_tokens: int) -> dict[str, int]:
        max_seq = self.cfg.max_seq_len
        longest = max(len(r) for r in rows)
        if longest >= max_seq:
            raise ValueError(f"a prompt of {longest} tokens leaves no room to generate in model.max_seq_len={max_seq}: "
                             f"shorten it to at most {max_seq - 1} tokens")
        S = min(bucket(longest + max_tokens, MIN_PROMPT_BUCKET), max_seq)
        return {"batch": self.rows_for(len(rows)), "prompt": min(bucket(longest, MIN_PROMPT_BUCKET), S),
                "max_len": S}

    # ----------------------------------------------------------------------------------------------------------------
    def stream(self, prompts, max_tokens=64, *, temperature=1.0, top_k=0, top_p=1.0, stop=None, seed=0,
               chunk: int = 8) -> Iterator[list[list[int]]]:
        """Yield, after each compiled call of up to `chunk` decode steps (at most max_chunk), every row's new ids.

        Stop tokens are not yielded. The generator's return value (StopIteration.value) is the GenerationBatch
        `generate` would return. Arguments as in `generate`.
        """
        rows = self.encode(prompts)
        n = len(rows)
        per_row = {}
        for name, value in (("max_tokens", max_tokens), ("temperature", temperature), ("top_k", top_k),
                            ("top_p", top_p), ("seed", seed)):
            values = list(value) if isinstance(value, (list, tuple, np.ndarray)) else [value] * n
            if len(values) != n:
                raise ValueError(f"{name} has {len(values)} values for {n} prompts: give one value or one per prompt")
            per_row[name] = values
        for t, k, p in zip(per_row["temperature"], per_row["top_k"], per_row["top_p"]):
            check_settings(t, k, p, self.cfg.vocab_size)
        if min(per_row["max_tokens"]) < 1 or chunk < 1:
            raise ValueError(f"max_tokens={max_tokens} and chunk={chunk} must be >= 1")
        shapes = self._shapes(rows, max(int(m) for m in per_row["max_tokens"]))
        stops = np.tile(self.stop_ids(stop), (n, 1))
        folds = list(range(n)) if not isinstance(seed, (list, tuple, np.ndarray)) else [0] * n
        compile_before = self.compile_s
        state = self.new_state(shapes["batch"], shapes["max_len"])
        compile_insert, t0 = self.compile_s, time.perf_counter()
        state = jax.block_until_ready(self.insert(
            state, rows, list(range(n)), seeds=per_row["seed"], folds=folds, temperature=per_row["temperature"],
            top_k=per_row["top_k"], top_p=per_row["top_p"], max_tokens=per_row["max_tokens"], stop_ids=stops))
        prefill_s = time.perf_counter() - t0 - (self.compile_s - compile_insert)
        decode_s, got = 0.0, [[] for _ in rows]
        while True:
            state, out = self.decode(state, min(chunk, self.max_chunk))
            decode_s += out.seconds
            new = out.tokens[:n]
            for g, ids in zip(got, new):
                g.extend(ids)
            if any(new):
                yield new
            if out.done[:n].all():
                break
        result = []
        for ids, r, stopped in zip(got, rows, out.stopped):
            text = self.tokenizer.decode(np.asarray(ids, np.int64)) if self.tokenizer is not None else None
            result.append(Generation(ids, text, len(r), "stop" if stopped else "length"))
        return GenerationBatch(result, max(prefill_s, 0.0), max(decode_s, 0.0), self.compile_s - compile_before,
                               sum(len(r) for r in rows), int(out.generated[:n].sum()), shapes)

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
                         seed=seed, chunk=self.max_chunk)
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


__all__ = ["DecodeOutput", "Generation", "GenerationBatch", "Generator", "TextStream", "unstack_layers"]
