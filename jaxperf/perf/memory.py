"""Device memory: what a compiled program needs, what the runtime holds, and an estimate before compiling anything.

    est = estimate(cfg, mesh)                 # per-device bytes of params, optimizer, grads, activations, batch
    print(est)                                # a table; est.total, est.largest()
    check_fits(est, capacity_bytes)           # raises OutOfMemoryAdvice naming the largest part and what to change
    compiled_memory(step.lower(state, batch).compile())   # XLA's own accounting of the compiled step
    live_device_memory()                      # the runtime's counters (GPU/TPU), None on CPU

The estimate is a model of the jaxperf train step, per device, for the platform it is compiled for (a TPU topology
described on a CPU host is "tpu"), after the model config is settled for that platform as the step settles it
(jaxperf.models.platform), so "auto" attention and loss become the implementations that will run. Its parts:
params, opt_state, grads, batch, gathered (FSDP's one gathered layer), activations (what the backward keeps from
the forward, read off `jax.vjp` of one layer under the remat policy, plus the largest working set on top) and code.
docs/performance.md ("How the memory estimate is made") says what each part counts on TPU, GPU and CPU, and what is
not modelled; tests/test_perf.py checks the CPU model against the compiled step, tests/test_memory_tpu.py the
accelerator model against the TPU compiler, benchmarks/gpu_check.py against a GPU's allocator.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import math
import re
import types
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core
from jax.sharding import Mesh

from flax import nnx

from jaxperf import _compat
from jaxperf.config import MESH_AXES, ConfigError, ModelConfig, TrainConfig, mesh_shape, validate
from jaxperf.models.gpt import GPT, compact_layer_grads
from jaxperf.models.hooks import DEFAULT_HOOKS
from jaxperf.models.layer_scan import exact_grads
from jaxperf.models.layers import Block, remat_policy, remat_saves
from jaxperf.models.moe import MoE, is_moe_layer, routes_per_device
from jaxperf.models.platform import layers_per_iteration, settle
from jaxperf.parallel.expert import dropless_block_rows
from jaxperf.parallel.mesh import normalize_platform, platform_of
from jaxperf.parallel.pipeline import schedule_ticks
from jaxperf.parallel.rules import get_rules, logical_to_spec, mesh_rules
from pallas_kernels.cross_entropy import BlockSizes, xla_vocab_block

GiB = 2**30


def _settled(cfg: TrainConfig, shape: dict[str, int], platform: str) -> ModelConfig:
    """cfg.model as the step on `platform` runs it (jaxperf.models.platform.settle). Under a ring (seq > 1) an "auto"
    attention is counted as XLA's: each ring step attends one block of keys with the XLA attention's residuals."""
    model = settle(cfg, shape, platform)
    if shape.get("seq", 1) > 1 and cfg.model.attention_impl == "auto":
        model = dataclasses.replace(model, attention_impl="xla")
    return model


@dataclasses.dataclass(frozen=True)
class Fitted:
    """A constant of the estimate read off a compiler rather than derived from the config, with the measurement it
    came from (docs/performance.md has the runs)."""

    value: Any
    measured: str


FITTED: dict[str, Fitted] = {
    "accelerator_code_bytes": Fitted(
        24 * 2**20,
        "the compiled train step's own instructions in device memory: the TPU compiler (libtpu 0.0.42) emits 9-30 MiB "
        "per chip for the presets' steps (more for wider models); a middle value"),
    "loss_overlap_libtpu": Fitted(
        (0, 0, 52),
        "the libtpu from which the TPU compiler places the loss's working set where the weight gradients and the "
        "gathered layer weights later go: seen with 0.0.52; 0.0.42.1 and 0.0.50.1 (what jax 0.10.2 and 0.12.0.1 pin "
        "for their tpu extra) keep them apart"),
    "unroll_shares": Fitted(
        {False: (0.4, 1.2), True: (0.3, 0.5)},
        "with k layers per scan iteration, what the TPU compiler holds for each layer beyond the first, as shares of "
        "(one layer's recomputed activations, the XLA attention's [H, L, L] gradient buffers), keyed by whether the "
        "compiler is libtpu 0.0.52 or later: its buffer report shows the backward slicing k layers' saved arrays out "
        "of the scan's stack at once and giving each layer's fp32 attention gradients buffers of their own; v5p, "
        "gpt2-medium and llama-1b (XLA attention under save_dots, Pallas attention under remat full), k = 1, 2, 4"),
    "unroll_shares_split_loss": Fitted(
        {False: (1.2, 1.2), True: (0.6, 0.5)},
        "the same where the chunked loss takes FSDP's shard of the output weights and reduce-scatters their gradient "
        "a vocabulary block at a time: the compilers then hold more of each extra layer's recomputation. llama-1b, "
        "Pallas attention, chunked loss, remat full, k = 4, one row per chip: +0.88 GB on v5p:2x2x1 and +0.75 GB on "
        "v6e:2x2 with libtpu 0.0.50.1, +0.33 GB on v6e:2x2 with 0.0.52, over the whole-weight loss (fitted on the "
        "first and the last)"),
    "unroll_compact_grads": Fitted(
        {False: 0.58, True: 0.96},
        "the share of those extra layers' term that stays where the backward loop is jaxperf's own (remat full with "
        "the weight-gradient stacks in the compute dtype, `layer_scan.remat_full_scan`), keyed as above: llama-1b, "
        "Pallas attention, chunked loss, remat full, one row per chip on v6e:2x2, k = 4 over k = 1: +724 MiB against "
        "+1245 with autodiff's scan (libtpu 0.0.50.1), +656 against +683 (0.0.52)"),
    "backward_recompute_share": Fitted(
        {False: 1.0, True: 0.65},
        "the share of one scanned layer's recomputed activations (what its remat policy does not save) the TPU "
        "compiler holds at once in the layer's backward, keyed by whether it is libtpu 0.0.52 or later (fitted on the "
        "totals, not traced slot by slot, with gathered_beside_backward): the Llama-family cases of "
        "benchmarks/bench_tpu_compile.py --matrix at remat full (7B to 13B, 2,048 to 32,768 tokens per chip, v5p, "
        "v6e and v5e slices of 8 to 64 chips, 2026-11-28 to 2026-12-01; one with a compiler option). "
        "Dense layers only: Mixtral-8x7B's MoE layers on v5p:2x4x4 (fsdp 32, and expert 8) sit at 0.96x counting "
        "all, 0.93-0.94x counting three quarters"),
    "gathered_beside_backward": Fitted(
        {False: 0.0, True: 0.2},
        "from libtpu 0.0.52 the layer weights FSDP gathers share addresses with a layer's backward working set, but "
        "not all of them: the compiler holds this share of the smaller of the two beyond the larger. Read where the "
        "gathered weights outweigh the backward, at one row per chip on 64 chips (v6e:8x8 and v5e:8x8, llama2-7b, "
        "mistral-7b and llama2-13b at 2,048 and 4,096 tokens), fitted with backward_recompute_share on the 52 dense "
        "matrix cases as last compiled on 2026-12-01 (every 32k-vocabulary case at 2,048 tokens per chip on the "
        "chunked loss): 0.954-1.056x (0.3, fitted on the records before that move, gave 0.948-1.043x on those and "
        "gives 0.972-1.066x on these)"),
    "kept_loss_weights_beside": Fitted(
        {False: 0.0, True: 0.1},
        "with model.loss_gather_once the chunked loss keeps the whole gathered output weights from its forward to "
        "its backward; from libtpu 0.0.52 the compiler holds them and this share of the gathered layer weights "
        "beyond the loss's other working set (11 Llama-3-family matrix cases compiled so, 2026-12-01: 0.972-1.027x "
        "the compiled bytes; the two 64-chip cases at one row, where the loss is at the peak, decide it: counting "
        "neither, 0.916 and 0.954x, the weights alone 0.948, a quarter of the gathered layer weights 1.051). The "
        "older compilers hold no more for it: Llama-3.1-8B shapes over 32 v5p chips at 1 x 8192 compile to 9.45 GB "
        "without it and 9.44 GB with it (libtpu 0.0.50.1)"),
}
ACCELERATOR_CODE_BYTES = FITTED["accelerator_code_bytes"].value
LOSS_OVERLAP_LIBTPU = FITTED["loss_overlap_libtpu"].value
UNROLL_SHARES = FITTED["unroll_shares"].value
UNROLL_SHARES_SPLIT_LOSS = FITTED["unroll_shares_split_loss"].value
UNROLL_COMPACT_GRADS = FITTED["unroll_compact_grads"].value
BACKWARD_RECOMPUTE_SHARE = FITTED["backward_recompute_share"].value
GATHERED_BESIDE_BACKWARD = FITTED["gathered_beside_backward"].value
KEPT_LOSS_WEIGHTS_BESIDE = FITTED["kept_loss_weights_beside"].value


def compiled_memory(compiled) -> dict[str, int]:
    """XLA's memory accounting of a compiled program, per device, in bytes.

    Keys: argument, output, alias (output bytes that reuse donated argument buffers), temp (scratch and intermediates),
    generated_code, bound: argument + output - alias + temp (every live buffer at once: an upper bound of the true
    peak), and peak: XLA's own peak where the backend reports it, else the bound.
    """
    ma = compiled.memory_analysis()
    if ma is None:
        raise ValueError("this backend reports no memory analysis for compiled programs (memory_analysis() is None)")
    out = {
        "argument": int(ma.argument_size_in_bytes),
        "output": int(ma.output_size_in_bytes),
        "alias": int(ma.alias_size_in_bytes),
        "temp": int(ma.temp_size_in_bytes),
        "generated_code": int(ma.generated_code_size_in_bytes),
    }
    out["bound"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    peak = int(getattr(ma, "peak_memory_in_bytes", 0) or 0)
    out["peak"] = peak if peak > 0 else out["bound"]
    return out


def live_device_memory(device: jax.Device | None = None) -> dict[str, int] | None:
    """The runtime's memory counters of a device (bytes_in_use, peak_bytes_in_use, bytes_limit...), or None where the
    platform keeps none (CPU)."""
    device = device or jax.local_devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - platforms without memory stats raise various errors
        return None
    return dict(stats) if stats else None


class OutOfMemoryAdvice(ConfigError):
    """The estimated per-device memory does not fit; the message names the largest part and what to change."""


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Per-device bytes of a training step, before compiling (see the module docstring for each part)."""

    params: int
    opt_state: int
    grads: int
    activations: int
    batch: int
    gathered: int
    cfg: TrainConfig
    mesh_shape: dict[str, int]
    code: int = 0

    COMPONENTS = ("params", "opt_state", "grads", "activations", "batch", "gathered", "code")

    @property
    def total(self) -> int:
        return sum(self.components().values())

    def components(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in self.COMPONENTS}

    def largest(self) -> str:
        c = self.components()
        return max(c, key=c.get)

    def __str__(self) -> str:
        mesh = " ".join(f"{a}={s}" for a, s in self.mesh_shape.items())
        lines = [f"memory per device, strategy {self.cfg.parallel.strategy}, mesh {mesh}, remat {self.cfg.model.remat}, "
                 f"microbatches {self.cfg.microbatches}:"]
        for k, v in self.components().items():
            lines.append(f"  {k:<12} {v / GiB:10.4f} GiB")
        lines.append(f"  {'total':<12} {self.total / GiB:10.4f} GiB")
        return "\n".join(lines)


def _resolve_mesh(cfg: TrainConfig, mesh: Mesh | int | dict[str, int] | None) -> dict[str, int]:
    if mesh is None:
        mesh = len(jax.devices())
    if isinstance(mesh, int):
        return mesh_shape(cfg.parallel, mesh)
    shape = dict(mesh.shape) if isinstance(mesh, Mesh) else dict(mesh)
    return {a: int(shape.get(a, 1)) for a in MESH_AXES}


@functools.lru_cache(maxsize=32)
def _param_leaves(model_cfg: ModelConfig) -> tuple[tuple[tuple[int, ...], str, tuple | None], ...]:
    """(shape, dtype, logical axes) of every parameter of the built-in GPT, traced abstractly (no memory used)."""
    with _compat.no_eager_sharding():
        abstract = nnx.eval_shape(lambda: GPT(model_cfg, rngs=nnx.Rngs(0)))
    params = nnx.state(abstract, nnx.Param)
    leaves = jax.tree.leaves(params, is_leaf=lambda v: isinstance(v, nnx.Variable))
    out = []
    for var in leaves:
        x = _compat.variable_value(var)
        out.append((tuple(x.shape), str(x.dtype), _compat.variable_logical_axes(var)))
    return tuple(out)


@functools.lru_cache(maxsize=16)
def _compact_grad_leaves(model_cfg: ModelConfig, seq: int) -> tuple[tuple[tuple[int, ...], str, tuple | None], ...]:
    """(shape, dtype, logical axes) of the stacked layer parameters whose gradients `layer_scan.remat_full_scan`
    stacks in the compute dtype (model.layer_grads_in_compute_dtype), found by tracing one layer's backward."""
    with _compat.no_eager_sharding():
        abstract = nnx.eval_shape(lambda: GPT(model_cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract.blocks)

    def layer(s, x, pos, seg):
        return nnx.merge(graphdef, s).forward(x, pos, seg, DEFAULT_HOOKS)

    one = jax.tree.map(lambda t: jax.ShapeDtypeStruct(t.shape[1:], t.dtype), state)
    x = jax.ShapeDtypeStruct((1, seq, model_cfg.d_model), jnp.dtype(model_cfg.dtype))
    flags = exact_grads(layer, one, x, (jax.ShapeDtypeStruct((1, seq), jnp.int32), None), jnp.dtype(model_cfg.dtype))
    variables = jax.tree.leaves(state, is_leaf=lambda v: isinstance(v, nnx.Variable))
    return tuple((tuple(_compat.variable_value(v).shape), str(_compat.variable_value(v).dtype),
                  _compat.variable_logical_axes(v)) for v, c in zip(variables, jax.tree.leaves(flags)) if c)


def _shard_factor(shape, axes, table, mesh_shape: dict[str, int]) -> int:
    spec = logical_to_spec(axes, table, types.SimpleNamespace(shape=mesh_shape), shape)
    factor = 1
    for entry in spec:
        for a in (entry,) if isinstance(entry, str) else (entry or ()):
            factor *= mesh_shape[a]
    return factor


def _split(n: int, parts: int) -> float:
    """n over `parts` devices when it divides evenly (the rule shards it), else whole (the rule leaves it replicated)."""
    return n / parts if parts > 1 and n % parts == 0 else float(n)


def _saved_per_token_layer(r: ModelConfig, L: int, t: int, sp: bool = False) -> tuple[float, float]:
    """(bytes saved per token per layer under r.remat, bytes of one layer's full working set per token).

    `L`: the keys each query meets at once (the local block under a ring); `sp`: the residual stream and norms split
    over `t` (Megatron sequence parallelism)."""
    s = jnp.dtype(r.dtype).itemsize
    D, H, K, Dh, F = r.d_model, r.n_heads, r.n_kv_heads, r.head_dim, r.mlp_dim
    d = D / t if sp else D
    gate = 2 if r.mlp_act == "swiglu" else 1
    qkv = _split(H * Dh, t) + 2 * _split(K * Dh, t)
    o = _split(H * Dh, t)
    f = _split(F, t)
    scores = 12 * _split(H * L, t)  # fp32 scores (masked in place), probabilities, and their gradient
    full = s * (6 * d + qkv + o + (gate + 1) * f) + scores
    names = remat_saves(r)
    if names is not None:  # the layer's input, and the named activations kept on the device (offloaded: host)
        width = {"query_proj": _split(H * Dh, t), "key_proj": _split(K * Dh, t), "value_proj": _split(K * Dh, t),
                 "context": o, "out_proj": d, "mlpwo": d, "mlpwi": f if gate == 1 else 0,
                 "mlpwi_0": f if gate == 2 else 0, "mlpwi_1": f if gate == 2 else 0}
        return s * (d + sum(width[n] for n in names[0])), full
    saved = {
        "none": full,
        "save_dots": full,
        "save_dots_no_batch": s * (3 * d + qkv + gate * f),
    }[r.remat]
    return saved, full


def _platform(mesh, platform: str | None) -> str:
    if platform is not None:
        return platform
    return platform_of(mesh) if isinstance(mesh, Mesh) else normalize_platform(jax.default_backend())



def _release(version: str) -> tuple[int, ...]:
    """"0.12.0.1" -> (0, 12, 0, 1); stops at the first piece that does not start with a digit ("0.13.0rc1" ->
    (0, 13, 0), "0.0.52.dev2026" -> (0, 0, 52))."""
    parts = []
    for piece in version.split("."):
        digits = re.match(r"\d+", piece)
        if digits is None:
            break
        parts.append(int(digits.group()))
        if digits.group() != piece:
            break
    return tuple(parts)




@functools.cache
def tpu_compiler_overlaps_loss() -> bool:
    """Whether the TPU compiler at hand reuses the loss's buffers for the weight gradients and the gathered layer
    weights: the installed libtpu's version decides, else (estimating without libtpu) the libtpu the installed jax
    pins for its "tpu" extra (jax 0.12.0.1 pins 0.0.50.*, which does not), else jax's version (a release after
    0.12.0.1 is taken to pin 0.0.52 or later)."""
    try:
        return _release(importlib.metadata.version("libtpu")) >= LOSS_OVERLAP_LIBTPU
    except importlib.metadata.PackageNotFoundError:
        pinned = _pinned_libtpu()
        return _release(pinned) >= LOSS_OVERLAP_LIBTPU if pinned else _release(jax.__version__) > (0, 12, 0, 1)


def _pinned_libtpu() -> str | None:
    """The libtpu version the installed jax's "tpu" extra pins ("libtpu==0.0.50.*; extra == 'tpu'" -> "0.0.50"),
    or None when its metadata names none."""
    try:
        requires = importlib.metadata.requires("jax") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for spec in requires:
        m = re.match(r"""\s*libtpu\s*(?:\[[^\]]*\])?\s*(?:==|~=|>=)\s*([0-9][0-9.]*)""", spec)
        if m and re.search(r"""extra\s*==\s*["']tpu["']""", spec):
            return m.group(1).rstrip(".")
    return None


# Primitives XLA fuses into the ops that read their results (elementwise math, casts, selects and layout changes):
# in a program whose layers are unrolled, the backward recomputes such a value inside the fusion that consumes it
# rather than keeping it from the forward pass.
_FUSIBLE = frozenset({
    "abs", "add", "and", "broadcast_in_dim", "cbrt", "clamp", "convert_element_type", "copy", "copy_p", "cos", "div",
    "eq", "erf", "erf_inv", "exp", "exp2", "expand_dims", "ge", "gt", "integer_pow", "iota", "le", "log", "log1p",
    "logistic", "lt", "max", "min", "mul", "ne", "neg", "not", "one_minus_square", "or", "pow", "reshape", "rsqrt",
    "select_n", "sign", "sin", "sqrt", "square", "squeeze", "stop_gradient", "sub", "tanh", "transpose",
})


def _fusible(eqn) -> bool:
    """Whether `eqn` is elementwise or a layout change (a nested jit counts when everything inside it does)."""
    if eqn.primitive.name in _FUSIBLE:
        return True
    if eqn.primitive.name not in ("pjit", "jit", "closed_call", "custom_jvp_call", "checkpoint", "remat"):
        return False
    inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    inner = getattr(inner, "jaxpr", inner)
    return inner is not None and hasattr(inner, "eqns") and all(_fusible(e) for e in inner.eqns)


def _residuals(fn, *args, fused: bool = False) -> list:
    """The arrays `jax.vjp(fn, *args)` keeps for the backward, as XLA ends up holding them: identical computations
    merged (XLA's CSE), boolean masks dropped (iota comparisons XLA recomputes inside the fusion that uses them), and
    an `exp` of another residual of the same shape dropped (the softmax numerator: XLA recomputes it from the saved
    scores in the backward fusion, so one fp32 copy of the scores is kept, not two).

    `fused`: the layers are unrolled into one program (a Python loop), where XLA recomputes elementwise values in the
    backward's fusions. A residual made by elementwise ops (`_FUSIBLE`) is then replaced by the values its chain of
    such ops starts from (a matmul's or a reduction's output, the layer's input), unless a matmul reads it: XLA keeps
    matmul operands (measured, TPU compiler: a norm's fp32 intermediates and a tanh GELU's are not kept, the scores,
    the MLP's pre-activation and the operands of the matmuls are). Under a scan the saved arrays are the loop's
    outputs, fixed before XLA sees them, so a scanned layer keeps every residual."""
    leaves, tree = jax.tree.flatten(args)
    closed, out_shape = jax.make_jaxpr(lambda *xs: jax.vjp(lambda *a: fn(*jax.tree.unflatten(tree, a)), *xs),
                                       return_shape=True)(*leaves)
    jaxpr = closed.jaxpr
    n_res = len(jax.tree.leaves(out_shape[1]))
    canon, seen, made_by, matmul_operands = {}, {}, {}, set()
    for e in jaxpr.eqns:
        ins = tuple(("literal", str(v)) if isinstance(v, jex_core.Literal) else id(canon.get(v, v)) for v in e.invars)
        key = (e.primitive.name, repr(sorted((k, repr(p)) for k, p in e.params.items())), ins)
        if e.primitive.name == "dot_general":
            matmul_operands.update(i for i in ins if not isinstance(i, tuple))
        if len(e.outvars) == 1:
            if key in seen:
                canon[e.outvars[0]] = seen[key]
                continue
            seen[key] = e.outvars[0]
        made_by.update((o, e) for o in e.outvars)

    def recomputed(c) -> bool:
        return fused and c in made_by and _fusible(made_by[c]) and id(c) not in matmul_operands

    def starts(c, out: dict, visited: set) -> None:  # the values a fusible chain ending in c starts from
        if id(c) in visited:
            return
        visited.add(id(c))
        if not recomputed(c):
            out[id(c)] = c
            return
        for v in made_by[c].invars:
            if not isinstance(v, jex_core.Literal):
                starts(canon.get(v, v), out, visited)

    kept = {}
    for v in jaxpr.outvars[len(jaxpr.outvars) - n_res:]:
        if isinstance(v, jex_core.Literal):
            continue
        found = {}
        starts(canon.get(v, v), found, set())
        kept.update((k, c) for k, c in found.items() if c.aval.dtype != jnp.bool_)
    # a residual the policy offloads lives in host memory until the backward: it takes no device memory
    avals = [(c.aval, made_by[c].primitive.name if c in made_by else None) for c in kept.values()
             if not str(getattr(c.aval, "memory_space", "")).endswith("Host")]
    shapes = [(a.shape, a.dtype) for a, _ in avals]
    return [a for a, prim in avals if not (prim == "exp" and shapes.count((a.shape, a.dtype)) > 1)]


def _per_device_model(r: ModelConfig, t: int) -> ModelConfig:
    """The layer one device runs when heads, KV heads and MLP columns are split over `t` (where they divide)."""
    div = lambda n: n // t if t > 1 and n % t == 0 else n  # noqa: E731
    return dataclasses.replace(r, n_heads=div(r.n_heads), n_kv_heads=div(r.n_kv_heads), mlp_dim=div(r.mlp_dim),
                               moe_mlp_dim=div(r.moe_mlp_dim) if r.moe_mlp_dim else r.moe_mlp_dim,
                               shared_mlp_dim=div(r.shared_mlp_dim) if r.shared_mlp_dim else r.shared_mlp_dim)


def _layer_kinds(r: ModelConfig) -> dict[bool, int]:
    """{is MoE: how many of the model's layers} (an MoE model with moe_every > 1 has both kinds)."""
    moe = sum(is_moe_layer(r, i) for i in range(r.n_layers))
    return {k: n for k, n in ((False, r.n_layers - moe), (True, moe)) if n}


@functools.lru_cache(maxsize=64)
def _layer_bytes_per_row(model_cfg: ModelConfig, seq: int, remat: str, fused: bool = False,
                         moe: bool = False, lanes: bool = False) -> float:
    """Bytes one layer keeps for its backward per batch row of `seq` positions under `remat` (the arrays of
    `_residuals`, traced abstractly on 1 and 2 rows: the difference is what grows with the batch, so the layer's
    weights, gathered and counted apart, drop out); `fused`: the layers are unrolled (`_residuals`); `moe`: the
    layer's MLP is the mixture of experts (its sorted token slots or capacity buffers are among the residuals);
    `lanes`: an array with head_dim minor (q, k, v, the attention output) is laid out in whole 128-lane tiles, as
    the TPU lays out the Pallas attention's operands."""
    cfg = dataclasses.replace(model_cfg, remat=remat)
    if cfg.attention_impl == "cudnn" and jax.default_backend() != "gpu":
        # cuDNN attention traces only where a GPU is attached. Elsewhere (a CPU host estimating a GPU step) the flash
        # kernel stands in: it keeps the same residuals (q, k, v, the output, the row logsumexp) plus padded copies
        # in its own layout, so the estimate comes out a few percent higher than on the GPU (benchmarks/RESULTS.md).
        cfg = dataclasses.replace(cfg, attention_impl="pallas")
    with _compat.no_eager_sharding():
        block = nnx.eval_shape(lambda: Block(cfg, rngs=nnx.Rngs(0), make_mlp=MoE if moe else None))
    graphdef, state = nnx.split(block)

    def layer(st, x, pos):
        return nnx.merge(graphdef, st)(x, pos, None)

    if remat != "none":
        layer = jax.checkpoint(layer, policy=remat_policy(cfg))
    Dh = cfg.resolved().head_dim
    tile = 128 * math.ceil(Dh / 128) if lanes else Dh

    def size(a) -> int:
        minor = tile if a.ndim >= 2 and a.shape[-1] == Dh else a.shape[-1] if a.ndim else 1
        return math.prod(a.shape[:-1]) * minor * a.dtype.itemsize

    sizes = []
    for rows in (1, 2):
        x = jax.ShapeDtypeStruct((rows, seq, cfg.d_model), jnp.dtype(cfg.dtype))
        pos = jax.ShapeDtypeStruct((rows, seq), jnp.int32)
        sizes.append(sum(size(a) for a in _residuals(layer, state, x, pos, fused=fused)))
    return float(sizes[1] - sizes[0])


@functools.lru_cache(maxsize=16)
def _moe_bytes_per_row(model_cfg: ModelConfig, seq: int, remat: str) -> float:
    """Bytes the MoE MLP alone keeps for its backward per batch row of `seq` positions under `remat` (as
    `_layer_bytes_per_row`): its token slots, the experts' hidden states and outputs, the router's scores."""
    cfg = dataclasses.replace(model_cfg, remat=remat)
    with _compat.no_eager_sharding():
        moe = nnx.eval_shape(lambda: MoE(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(moe)

    def mlp(st, x):
        return nnx.merge(graphdef, st)(x)

    if remat != "none":
        mlp = jax.checkpoint(mlp, policy=remat_policy(cfg))
    sizes = []
    for rows in (1, 2):
        x = jax.ShapeDtypeStruct((rows, seq, cfg.d_model), jnp.dtype(cfg.dtype))
        sizes.append(sum(math.prod(a.shape) * a.dtype.itemsize for a in _residuals(mlp, state, x, fused=True)))
    return float(sizes[1] - sizes[0])


def estimate(cfg: TrainConfig, mesh: Mesh | int | dict[str, int] | None = None, *,
             platform: str | None = None) -> MemoryEstimate:
    """Per-device memory of the jaxperf train step for `cfg` on `mesh` (a Mesh, a device count, or axis sizes),
    compiled for `platform` ("cpu", "gpu", "tpu"; default: that of the mesh's devices, or of JAX's default backend).

    Nothing is compiled or allocated: the model is traced abstractly once per model config. The model's choices left
    to the platform (attention and loss implementations...) are settled as the step settles them
    (jaxperf.models.platform.settle). Under a pipeline (stage > 1) a device holds its stage's layers and works
    on one microbatch at a time, plus the stage inputs the schedule stashes; under a ring (seq > 1) it holds L / seq
    positions and meets L / seq keys at a time. The module docstring names every part, per platform.
    """
    platform = _platform(mesh, platform)
    shape = _resolve_mesh(cfg, mesh)
    validate(cfg, math.prod(shape.values()), shape)
    if cfg.model.n_experts and platform != "tpu":
        # the MoE terms are read off the TPU compiler; XLA:CPU's programs of the same layers need 1.1-2.4x the
        # estimate (moe-tiny), and no GPU has checked them: no number beats a wrong one
        raise ConfigError(f"the memory estimate models MoE layers (model.n_experts={cfg.model.n_experts}) for TPU "
                          f"only, not {platform}: compile the step and read its memory analysis instead (jaxperf "
                          f"compile)")
    cfg = dataclasses.replace(cfg, model=_settled(cfg, shape, platform))
    sp = cfg.parallel.sequence_parallel and shape["tensor"] > 1
    rules = mesh_rules(get_rules(cfg.parallel.strategy), types.SimpleNamespace(shape=shape), sequence_parallel=sp)
    r = cfg.model.resolved()
    params = layer_weights = 0.0  # per device; layer_weights: the scanned layers' but the experts'
    for leaf_shape, dtype, axes in _param_leaves(cfg.model):
        size = math.prod(leaf_shape) * jnp.dtype(dtype).itemsize / _shard_factor(leaf_shape, axes, rules.params, shape)
        params += size
        if axes and axes[0] == "layers" and "expert" not in axes:
            layer_weights += size
    kinds = _layer_kinds(r)
    # What FSDP holds gathered, of the larger layer kind: two layers' weights (the one running and the next one's
    # gather), but an MoE layer's experts once (the TPU compiler's buffer report for Mixtral-8x7B over 32 v5p chips:
    # one layer's gathered experts in the backward loop, none prefetched), and only the largest expert weight where
    # each device routes its own tokens dropless (each grouped matmul gathers its weight where it runs, forward and
    # backward: `moe._regathered`). A Python loop's layers are gathered one at a time as well, so their weights are
    # read off a stacked model of each kind.
    one_expert_weight = not r.capacity_factor and routes_per_device(cfg, shape)
    gathered_layers = 0.0
    for moe in kinds:
        stacked = dataclasses.replace(cfg.model, scan_layers=True, moe_every=1,
                                      n_experts=cfg.model.n_experts if moe else 0)
        held, experts = 0.0, []
        for leaf_shape, dtype, axes in _param_leaves(stacked):
            if axes and axes[0] == "layers":
                size = (math.prod(leaf_shape[1:]) * jnp.dtype(dtype).itemsize
                        / _shard_factor(leaf_shape[1:], axes[1:], rules.params, {**shape, "fsdp": 1}))
                if "expert" in axes:
                    experts.append(size)
                else:
                    held += 2 * size
        held += (max(experts) if one_expert_weight else sum(experts)) if experts else 0.0
        gathered_layers = max(gathered_layers, held)
    # the batch splits over data and fsdp, and over expert too (outside the MoE layers the axis is data parallel)
    dp = shape["data"] * shape["fsdp"] * shape.get("expert", 1)
    t, stages, ring = shape["tensor"], shape["stage"], shape["seq"]
    L = cfg.train_seq_len
    positions = L / ring  # a device's share of the sequence
    micro_rows = cfg.batch_size // cfg.microbatches / dp
    tokens = micro_rows * positions
    s = jnp.dtype(r.dtype).itemsize
    layers = r.n_layers / stages
    accumulates = cfg.microbatches > 1 and stages == 1  # a pipeline's microbatches are not the step's accumulation
    grads = params * (2 if accumulates else 1)
    # remat full over scanned layers with model.layer_grads_in_compute_dtype: the backward loop, where the peak is,
    # stacks the weight gradients that are exactly representable in the compute dtype in it (cast to param_dtype
    # after the loop). The experts too: they enter the MoE layer's shard_map cast, so their gradients come out of it
    # in the compute dtype as well.
    compact_grads = 0.0
    if r.scan_layers and compact_layer_grads(r):
        for leaf_shape, dtype, axes in _compact_grad_leaves(cfg.model, int(cfg.train_seq_len / shape["seq"])):
            size = math.prod(leaf_shape) / _shard_factor(leaf_shape, axes, rules.params, shape)
            compact_grads += size * (jnp.dtype(dtype).itemsize - jnp.dtype(r.dtype).itemsize)
    batch = cfg.batch_size / dp * L * 3 * 4
    compute = s / jnp.dtype(r.param_dtype).itemsize
    gathered = gathered_layers * compute if shape["fsdp"] > 1 and "fsdp" in rules.mesh_axes_used() else 0.0
    fsdp_gathered = gathered
    if platform == "tpu" and r.scan_layers and not r.round_weights_before_cast and compute < 1:
        # The plain cast of a scanned layer's weight slice: the TPU compiler casts the whole stacked shard once before
        # the layer loop instead, a compute-dtype copy of every layer's weights (but the experts: the MoE layer
        # rounds its own slice) live through the step. Plain minus rounded compiled bytes, libtpu 0.0.50.1: llama-1b
        # on 4 chips 450-464 MiB against 464 counted here, Llama-3.1-8B shapes on 32 chips 414 against 416
        # (docs/performance.md)
        gathered += layer_weights * compute
    stash = 0.0
    if stages > 1:  # the stage inputs held between a microbatch's forward and backward
        _, slots = schedule_ticks(cfg.parallel.schedule, stages, cfg.microbatches)
        stash = slots * tokens * (r.d_model / t if sp else r.d_model) * s
    if platform == "cpu":
        saved, full = _saved_per_token_layer(r, positions, t, sp)
        logits = 3 * 4 * _split(r.padded_vocab, t)  # fp32 logits, softmax and their gradient
        activations = tokens * (layers * saved + (full if r.remat != "none" else 0) + logits) + stash
        return MemoryEstimate(int(params), int(2 * params), int(grads - compact_grads), int(activations), int(batch),
                              int(gathered), cfg, shape)
    local = _per_device_model(r, t)
    seq = int(positions)
    per_iteration = min(layers_per_iteration(r, platform), math.ceil(layers)) if r.scan_layers else 1
    # A Python loop: XLA recomputes elementwise values in the backward. On GPU a scan that runs all its layers in one
    # iteration (the GPU default) compiles to the same program and peak (measured: gpt2-small on an H100, 19.1 GiB
    # both ways; benchmarks/RESULTS.md, "GPU")
    unrolled_layers = not r.scan_layers or (platform == "gpu" and per_iteration >= layers)
    if unrolled_layers:
        per_iteration = 1
    # per layer kind (dense, MoE): what one layer saves, and what its backward recomputes beyond that ...
    newer_tpu_compiler = platform == "tpu" and tpu_compiler_overlaps_loss()
    # The Mosaic kernel takes [L, Dh] blocks, so its q, k, v and output are laid out with Dh minor, padded to whole
    # 128-lane tiles (XLA picks other layouts for the arrays the XLA attention saves). The TPU compiler from libtpu
    # 0.0.52 on pads exactly what a layer keeps (its buffer report: q saved under save_qkv_proj is bf16[.., 32, 64] in
    # 128 lanes, 2x its values; under remat full no layer keeps any): `lanes` counts each such residual in its tiles.
    # The older compilers report temporaries beyond their own buffer assignment (1.5-2.1 GiB for llama-1b at 4 rows
    # per chip), which a fixed share of q, k, v and the output padded in every layer stands for (`pad_saved`).
    pallas_lanes = platform == "tpu" and r.attention_impl == "pallas" and bool(r.head_dim % 128)
    lanes = pallas_lanes and newer_tpu_compiler
    saved_by, recompute_by = {}, {}
    for moe in kinds:
        saved_by[moe] = micro_rows * _layer_bytes_per_row(local, seq, r.remat, unrolled_layers, moe, lanes)
        recompute_by[moe] = (micro_rows * _layer_bytes_per_row(local, seq, "none", unrolled_layers, moe, lanes)
                             - saved_by[moe])
    n_ep = shape.get("expert", 1)
    if True in kinds and n_ep > 1 and not r.capacity_factor:
        # Dropless expert parallelism: each device's experts take a block from every device in the all-to-all,
        # room for all the slots one device can route to them whatever the routing (jaxperf.parallel.expert:
        # T x min(k, E/n) rows for T tokens of k slots), so the routed MLP's arrays hold n x T x min(k, E/n) rows
        # where one device routing alone holds S = T x k. The extra rows are counted as XLA holds the recomputed
        # arrays (elementwise values inside the backward's fusions), less the MLP's input, which the layer's own
        # trace counts. Mixtral-8x7B over v5p:2x4x4, expert=8 x fsdp=4: 1.001x the compiled bytes.
        k = r.experts_per_token
        more = n_ep * dropless_block_rows(1, k, r.n_experts // n_ep) / k - 1
        own_input = seq * r.d_model * s
        saved_more = more * micro_rows * max(0.0, _moe_bytes_per_row(local, seq, r.remat) - own_input)
        saved_by[True] += saved_more
        recompute_by[True] += more * micro_rows * (_moe_bytes_per_row(local, seq, "none") - own_input) - saved_more
    pad_saved = 0.0
    if pallas_lanes and not lanes:
        pad = 128 * math.ceil(r.head_dim / 128) - r.head_dim
        pad_saved = micro_rows * seq * (2 * local.n_heads + 2 * local.n_kv_heads) * pad * s
    stack = sum(n / stages * (saved_by[moe] + pad_saved) for moe, n in kinds.items())
    widest = max(kinds, key=lambda moe: recompute_by[moe])  # the layer kind whose backward needs the most
    saved, recompute = saved_by[widest] + pad_saved, recompute_by[widest]
    attention_grads = 0.0
    if r.attention_impl not in ("pallas", "cudnn"):
        # ... and the XLA attention's [H, L, L] gradients (flash attention's backward works in on-chip memory):
        # the scores' gradient in fp32 always; where the policy saved the probabilities (none) their gradient needs
        # a buffer of its own in the compute dtype, where it saved only the scores (save_dots, a matmul output) the
        # probabilities are recomputed from them in fp32 as well; otherwise the gradients take over the buffers of
        # the recomputed scores and probabilities
        per_score = {"none": 4 + s, "save_dots": 8 + s}.get(r.remat, 4)
        attention_grads = micro_rows * local.n_heads * seq * seq * per_score
    # what a scanned dense layer's backward holds of its recomputation (the older compilers, and MoE layers: all)
    share = 1.0 if unrolled_layers or widest else BACKWARD_RECOMPUTE_SHARE[newer_tpu_compiler]
    layer_bwd = share * recompute + attention_grads
    if unrolled_layers:
        # unstacked, a layer's saved arrays are freed as its backward reads them, and its gradients take their
        # buffers (a scan frees its stacked buffer only whole)
        layer_bwd = max(0.0, layer_bwd - saved)
    # k layers per scan iteration: the layers after the first add shares of their backward working sets, on top of
    # everything else (the compiler gives them no buffer the loss uses)
    V, D = _split(r.padded_vocab, t), r.d_model
    loss_impl = r.loss_impl if r.loss_impl in ("chunked", "pallas") else "xla"
    # the chunked loss takes the output weights as FSDP splits them (jaxperf.models.kernels.linear_cross_entropy)
    w_split = _shard_factor((D, V), ("embed", None), rules.params, shape) if loss_impl == "chunked" else 1
    shares = UNROLL_SHARES_SPLIT_LOSS if w_split > 1 else UNROLL_SHARES
    share_recompute, share_attention = shares[newer_tpu_compiler]
    unrolled = (per_iteration - 1) * (share_recompute * recompute + share_attention * attention_grads)
    if compact_grads:
        unrolled *= UNROLL_COMPACT_GRADS[newer_tpu_compiler]
    # the "xla" and "pallas" losses: the output weights gathered whole (and a transposed copy) in the compute dtype,
    # and their fp32 gradient before it is reduce-scattered back to the shards (the chunked loss's term replaces it)
    loss = D * V * (4 + 2 * s)
    if loss_impl == "xla":
        # the logits in the compute dtype, kept for the backward; XLA fuses the fp32 softmax and its gradient into
        # the reductions and matmuls that read them. Beside unrolled layers XLA:GPU keeps the logits in fp32 instead
        # (measured on an H200: the full logits cost gpt2-small 5.7 GiB over the chunked loss there, against 4.5
        # beside a rolled scan; 32 x 1024 fp32 logits are 6.1 GiB)
        loss += tokens * V * (4 if platform == "gpu" and unrolled_layers else s)
    elif loss_impl == "chunked":
        # The backward's [chunk, block] tile and fp32 [D, block] dw accumulator, and ...
        chunk, block = min(1024, 8 * math.ceil(tokens / 8)), xla_vocab_block(int(V), BlockSizes.chunk_v)
        loss = chunk * block * (4 + s) + D * block * 4
        if w_split > 1:
            # ... with the output weights as FSDP splits them, the forward walking the backward's blocks: the fp32
            # dh; the shard and its gradient's in the compute dtype; a gathered [D, block] block, the next one's,
            # and a block of dw on its way to the reduce-scatter (with `loss_gather_once` the whole gathered weights
            # are live from the loss's forward to its backward as well: `kept_loss_weights` below on TPU; on GPU,
            # where nothing has measured it, counted whole in the loss's working set)
            loss += tokens * D * 4 + 2 * D * V / w_split * s + 3 * D * block * s
            if r.loss_gather_once and platform == "gpu":
                loss += D * V * s
        else:
            # ... with the output weights whole: the compute-dtype copy, their gradient and its reduction; the
            # forward's [chunk, V] fp32 logits tile, whose buffer the backward's fp32 dh reuses
            loss += D * V * 3 * s + max(chunk * V, tokens * D) * 4
    else:
        # the fp32 gradient of the hidden states (the kernel's tiles live in on-chip memory)
        loss += tokens * D * 4
    if newer_tpu_compiler:
        # libtpu 0.0.52 and later: whatever the loss, its working set shares addresses with the weight gradients
        # (counted apart), which are not live while it runs, and the layer weights FSDP gathers (counted apart) take
        # no room beyond the larger of the layer's backward and the loss (2 rows x 4096 per chip on v5p:2x2x4, remat
        # full: llama2-7b, mistral-7b and llama2-13b compile to 0.96-0.98x of what counts them apart), but for a
        # share of the smaller of the gathered weights and the layer's backward (GATHERED_BESIDE_BACKWARD)
        # With `loss_gather_once` the chunked loss's kept copy of the output weights joins its working set, with a
        # share of the gathered layer weights beside it (KEPT_LOSS_WEIGHTS_BESIDE); the older compilers hold no more
        # for it (the FITTED entry)
        kept_loss_weights = (D * V * s + KEPT_LOSS_WEIGHTS_BESIDE[True] * fsdp_gathered
                             if loss_impl == "chunked" and w_split > 1 and r.loss_gather_once else 0.0)
        activations = (stack + max(0.0, max(layer_bwd, loss + kept_loss_weights - grads) - fsdp_gathered) + unrolled
                       + stash + GATHERED_BESIDE_BACKWARD[True] * min(layer_bwd, fsdp_gathered))
    elif loss_impl == "xla" or stack < grads:
        activations = stack + max(layer_bwd, loss) + unrolled + stash
    else:
        # The chunked and fused losses hold their fp32 weight gradient across a loop. Where the forward's saved
        # stack outweighs the weight gradients, the older compilers' peak is at the loss, the whole stack live, and
        # their reported temporaries exceed their own buffer assignment by about a layer's backward working set on
        # top of the loss's (llama-1b at 4 rows per chip on v5p:2x2x1, the Pallas attention and chunked loss: 2.04
        # GiB outside the assignment), so the two add up. Where the gradient stacks outweigh it (remat full at one
        # row per chip), the peak is in the layers' backward, beside the gradient stacks, and the loss's working
        # set is gone by then (the buffer report of the same model on v6e:2x2 with the fused loss)
        activations = stack + layer_bwd + loss + unrolled + stash
    return MemoryEstimate(int(params), int(2 * params), int(grads - compact_grads), int(activations), int(batch),
                          int(gathered), cfg, shape, code=ACCELERATOR_CODE_BYTES)


def _with(cfg: TrainConfig, **changes) -> TrainConfig:
    sections = {k: dataclasses.replace(getattr(cfg, k), **v) for k, v in changes.items() if isinstance(v, dict)}
    top = {k: v for k, v in changes.items() if not isinstance(v, dict)}
    return dataclasses.replace(cfg, **sections, **top)


def _remedies(est: MemoryEstimate) -> list[tuple[str, MemoryEstimate]]:
    """(change, estimate after it) for the changes that address the largest component."""
    cfg, shape = est.cfg, est.mesh_shape
    n = math.prod(shape.values())
    out: list[tuple[str, TrainConfig, dict]] = []
    largest = est.largest()
    if largest in ("activations", "batch"):
        if cfg.model.remat != "full":
            out.append(("model.remat=full", _with(cfg, model={"remat": "full"}), shape))
        dp = shape["data"] * shape["fsdp"]
        m = cfg.microbatches * 2
        if cfg.batch_size % (m * dp) == 0:
            out.append((f"microbatches={m}", _with(cfg, microbatches=m), shape))
        if cfg.batch_size // 2 >= dp * cfg.microbatches and (cfg.batch_size // 2) % (dp * cfg.microbatches) == 0:
            out.append((f"batch_size={cfg.batch_size // 2}", _with(cfg, batch_size=cfg.batch_size // 2), shape))
    else:
        if cfg.parallel.strategy in ("dp", "tp") and n > 1:
            strategy = "fsdp" if cfg.parallel.strategy == "dp" else "fsdp_tp"
            new_shape = {**shape, "data": 1, "fsdp": shape["data"] * shape["fsdp"]}
            new = _with(cfg, parallel={"strategy": strategy, "data": 1, "fsdp": new_shape["fsdp"]})
            out.append((f"parallel.strategy={strategy} parallel.data=1 parallel.fsdp={new_shape['fsdp']}", new,
                        new_shape))
        elif shape["data"] > 1:
            new_shape = {**shape, "data": 1, "fsdp": shape["data"] * shape["fsdp"]}
            out.append((f"parallel.data=1 parallel.fsdp={new_shape['fsdp']}",
                        _with(cfg, parallel={"data": 1, "fsdp": new_shape["fsdp"]}), new_shape))
    results = []
    for change, new_cfg, new_shape in out:
        try:
            results.append((change, estimate(new_cfg, new_shape)))
        except ConfigError:
            continue
    return results


def advise(est: MemoryEstimate, capacity_bytes: float) -> str:
    """A short report: whether `est` fits `capacity_bytes` per device, its largest component, and what to change (with
    the estimate after each change)."""
    comps = est.components()
    largest = est.largest()
    share = comps[largest] / est.total if est.total else 0.0
    head = (f"estimated {est.total / GiB:.3f} GiB per device of {capacity_bytes / GiB:.3f} GiB "
            f"({'fits' if est.total <= capacity_bytes else 'does NOT fit'}); largest: {largest} "
            f"{comps[largest] / GiB:.3f} GiB ({100 * share:.0f}%)")
    lines = [head]
    remedies = _remedies(est)
    if largest in ("params", "opt_state", "grads", "gathered") and not remedies:
        lines.append("  parameters, optimizer state and gradients are already sharded as far as this mesh allows: "
                     "add devices to the fsdp axis, use param_dtype=bfloat16, or a smaller model")
    for change, new in remedies:
        lines.append(f"  try {change}: {new.total / GiB:.3f} GiB ({new.largest()} becomes largest)")
    return "\n".join(lines)


def check_fits(est: MemoryEstimate, capacity_bytes: float, *, headroom: float = 0.9) -> MemoryEstimate:
    """Return `est` when it fits `headroom * capacity_bytes`, else raise OutOfMemoryAdvice with `advise`'s text."""
    if est.total > headroom * capacity_bytes:
        raise OutOfMemoryAdvice(advise(est, headroom * capacity_bytes))
    return est


__all__ = ["MemoryEstimate", "OutOfMemoryAdvice", "advise", "check_fits", "compiled_memory", "estimate",
           "live_device_memory"]

