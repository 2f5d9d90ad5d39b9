"""Transformer building blocks as Flax NNX modules whose parameters carry logical axis names.

Legend: B batch, L length, D embed, H heads, K kv heads, G = H / K query heads per KV head, Dh head dim, F mlp, V vocab,
S cache slots, T new tokens.
Parameters are stored in `param_dtype` and cast to the compute `dtype` where used; norms, softmax and RoPE run in fp32.
A weight may also be an int8 `jaxperf.models.quant.Int8Weight`: `dense` and `embed_lookup` dequantise it.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxperf._compat import no_eager_sharding
from jaxperf.config.schema import REMAT_NAMES  # noqa: F401 (re-exported: the names the policies below use)
from jaxperf.models import kernels
from jaxperf.models.attention import attention
from jaxperf.models.hooks import DEFAULT_HOOKS, LayerHooks
from jaxperf.models.quant import Int8Weight
from jaxperf.models.registry import implementation, register
from jaxperf.parallel.collective_matmul import sequence_parallel_column, sequence_parallel_row
from jaxperf.parallel.ring_attention import ring_attention_ambient
from jaxperf.parallel.rules import cast_table_rows, constrain, gather_weight, gathers, sequence_is_split
from pallas_kernels.norms import unavailable_reason as norm_unavailable_reason

Axes = tuple[str | None, ...]


# The layers tag their activations with the names of jaxperf.config.schema.REMAT_NAMES, MaxText's, so a MaxText
# remat_policy value means the same thing here.
_QKV = ("query_proj", "key_proj", "value_proj")
_PROJECTIONS = (*_QKV, "out_proj", "mlpwi_0", "mlpwi_1", "mlpwi", "mlpwo")


def saving(saved=(), offloaded=()):
    """The policy that keeps the activations named in `saved` in device memory, moves those in `offloaded` to pinned
    host memory for the backward (where the backend has it: TPU and GPU), and recomputes everything else."""
    if not offloaded:
        return jax.checkpoint_policies.save_only_these_names(*saved)
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=list(saved), names_which_can_be_offloaded=list(offloaded),
        offload_src="device", offload_dst="pinned_host")


# What each `model.remat` saves (device) or offloads (host) for the backward, as (saved, offloaded) names; the
# dot-based policies save by op instead. "custom" takes the two lists from model.remat_save and model.remat_offload.
REMAT_SAVES = {
    "full": ((), ()),
    "minimal": (_PROJECTIONS, ()),
    "minimal_with_context": ((*_PROJECTIONS, "context"), ()),
    "save_dot_with_context_except_mlp": ((*_QKV, "context", "out_proj"), ()),
    "save_dot_except_mlpwi": ((*_QKV, "out_proj", "mlpwo"), ()),
    "save_dot_except_mlp": ((*_QKV, "out_proj"), ()),
    "save_qkv_proj": (_QKV, ()),
    "save_out_proj": (("out_proj",), ()),
    "qkv_proj_offloaded": ((), _QKV),
    "minimal_offloaded": ((), _PROJECTIONS),
    "save_attn_proj": ((*_QKV, "out_proj", "mlpwo"), ()),  # the older name of save_dot_except_mlpwi
}
REMAT_POLICIES = {
    "none": None,
    "save_dots": jax.checkpoint_policies.checkpoint_dots,
    "save_dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    **{name: saving(*lists) for name, lists in REMAT_SAVES.items()},
}
REMAT_POLICIES["full"] = jax.checkpoint_policies.nothing_saveable


def remat_saves(cfg) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """(saved, offloaded) activation names under `cfg.remat`; None for the policies that save by op (none,
    save_dots, save_dots_no_batch)."""
    if cfg.remat == "custom":
        return tuple(cfg.remat_save), tuple(cfg.remat_offload)
    return REMAT_SAVES.get(cfg.remat)


def remat_policy(cfg):
    """The jax.checkpoint policy of `cfg.remat` (None for "none": the layer is not rematerialised)."""
    if cfg.remat == "custom":
        return saving(cfg.remat_save, cfg.remat_offload)
    return REMAT_POLICIES[cfg.remat]


def _param(rngs: nnx.Rngs, init, shape: tuple[int, ...], axes: Axes, dtype) -> nnx.Param:
    """A parameter annotated with logical axes. Placement on devices happens later, through jit out_shardings."""
    with no_eager_sharding():
        return nnx.Param(nnx.with_partitioning(init, axes)(rngs.params(), shape, dtype))


def _bcast(v: jax.Array, ndim: int) -> jax.Array:
    """Lift a parameter to broadcast against trailing dims explicitly (tests run with rank promotion 'raise')."""
    return v.reshape((1,) * (ndim - v.ndim) + v.shape)


@jax.custom_vjp
def _materialise_cotangent(y: jax.Array) -> jax.Array:
    """Identity; its cotangent passes through an optimization barrier (see `dense`)."""
    return y


_materialise_cotangent.defvjp(lambda y: (y, None), lambda _, dy: (jax.lax.optimization_barrier(dy),))


def dense(x: jax.Array, w: jax.Array, n_in: int = 1, *, grad_barrier: bool = False,
          keep_dims: bool = False) -> jax.Array:
    """x [..., *In] @ w [*In, *Out] -> [..., *Out]: the last `n_in` dims of x contract with the first of w.

    Computed as one 2-D matmul [prod(...), prod(In)] x [prod(In), prod(Out)], so every backend sees the plain GEMM
    shape, and its backward is two plain GEMMs; when the step splits the sequence over `seq`, as a contraction of the
    trailing dims that keeps the leading dims (and their sharding) apart. `grad_barrier` makes the output's cotangent a materialised array
    before the backward matmuls use it. XLA:CPU otherwise fuses the elementwise gradient of the following op (GELU,
    bias, softmax) into a transposing copy for the weight gradient, which costs more than the matmuls; GPU and TPU
    compilers fuse that well, so the model config turns it on for CPU meshes only (`model.matmul_grad_barrier`,
    settled by jaxperf.models.platform). `keep_dims` contracts the trailing dims in place, the weight kept in its
    own shape (one dot_general): the attention projections use it on TPU, where flattening an fsdp-sharded
    [D, H, Dh] weight to [D, H*Dh] leaves the backward's recomputed projection and its dx unable to share one gather
    of the weight, so the compiler gathers it twice, each time in a collective-matmul loop that rewrites the whole
    output per step.

    An int8 weight (`Int8Weight`, one scale per output channel) is multiplied as int8 values converted to x's dtype,
    and the [.., out] result is scaled afterwards: the fp32 weight is never rebuilt.
    """
    in_shape, out_shape = tuple(w.shape[:n_in]), tuple(w.shape[n_in:])
    if x.shape[x.ndim - n_in:] != in_shape:
        raise ValueError(f"dense: x {x.shape} does not end in the weight's input dims {in_shape} (w {w.shape})")
    lead = x.shape[: x.ndim - n_in]
    k, n = math.prod(in_shape), math.prod(out_shape)
    if isinstance(w, Int8Weight):
        if any(d != 1 for d in w.scale.shape[:n_in]):
            raise ValueError(f"dense: int8 scales {w.scale.shape} must be per output channel (1 on the input dims)")
        y = x.reshape(math.prod(lead), k) @ w.q.reshape(k, n).astype(x.dtype)
        y = y * w.scale.reshape(1, n).astype(y.dtype)
    elif len(lead) > 1 and (keep_dims or sequence_is_split()):
        # Rows split over the batch axes and the sequence over `seq` do not merge into one split dim: a 2-D reshape
        # would gather the sequence onto every device. Contract the trailing dims in place instead.
        y = jax.lax.dot_general(x, w, ((tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in))), ((), ())))
        return _materialise_cotangent(y) if grad_barrier else y
    else:
        y = x.reshape(math.prod(lead), k) @ w.reshape(k, n)
    if grad_barrier:
        y = _materialise_cotangent(y)
    return y.reshape(*lead, *out_shape)


def to_compute(w, dt, *, round_first: bool = False):
    """A layer weight `w` cast to the compute dtype `dt`. With `round_first` (model.round_weights_before_cast)
    an fp32 weight bound for bf16 is rounded by `reduce_precision` to bf16's bits first: the same values (and
    gradients) as the plain cast. The TPU compiler turns a plain cast of a scanned layer's slice of the stacked
    weights into a cast of the whole stacked shard before the layer loop, a bf16 copy of every layer's weights live
    through the step (Llama2-7B over 16 v5p chips: 772 MiB per chip); the rounding needs the fp32 slice, which keeps
    the cast inside the loop, on one layer's shard."""
    if not round_first or not isinstance(w, jax.Array) or w.dtype != jnp.float32 or jnp.dtype(dt) != jnp.bfloat16:
        return w.astype(dt)
    return jax.lax.reduce_precision(w, exponent_bits=8, mantissa_bits=7).astype(dt)


def _column(x_BxLxD, w, hooks: LayerHooks, grad_barrier: bool, keep_dims: bool = False):
    """A column-parallel matmul (its output dims split over `tensor`); under sequence parallelism it gathers the
    sequence while it multiplies."""
    if hooks.sequence_parallel is not None:
        return sequence_parallel_column(x_BxLxD, w, hooks.sequence_parallel)
    return dense(x_BxLxD, w, grad_barrier=grad_barrier, keep_dims=keep_dims)


def _row(h, w, n_in: int, hooks: LayerHooks, grad_barrier: bool, keep_dims: bool = False):
    """A row-parallel matmul (its contracted dims split over `tensor`): partial sums added up, and under sequence
    parallelism split along the sequence again while they are computed."""
    if hooks.sequence_parallel is not None:
        return sequence_parallel_row(h, w, hooks.sequence_parallel, n_in)
    return hooks.row_parallel(dense(h, w, n_in, grad_barrier=grad_barrier, keep_dims=keep_dims))


def embed_lookup(table, ids: jax.Array, dtype, *, mode=None, axes=("batch", "residual_seq")) -> jax.Array:
    """Rows `ids` of an embedding table [V, D] (an array or an int8 table with one scale per row) in `dtype`.

    `axes` name the dims of `ids`: the gradient of the rows is sent to the table's D shard in `dtype` before it is
    cast to the table's precision (`jaxperf.parallel.rules.cast_table_rows`)."""
    if isinstance(table, Int8Weight):
        rows = jnp.take(table.q, ids, axis=0, mode=mode).astype(jnp.float32)
        return (rows * jnp.take(table.scale, ids, axis=0, mode=mode)).astype(dtype)
    return cast_table_rows(jnp.take(table, ids, axis=0, mode=mode), dtype, (*axes, "embed"))


def _ones(key, shape, dtype):
    return jnp.ones(shape, dtype)


def _zeros(key, shape, dtype):
    return jnp.zeros(shape, dtype)


class Norm(nnx.Module):
    """LayerNorm (scale and optional bias) or RMSNorm (scale only), computed in fp32.

    `impl`: any norm implementation of jaxperf.models.registry ("xla", "pallas"; "auto" in a config never settled is
    "xla"), built for `platform` (the model config's settled platform). With `residual`, normalises x + residual and returns (normed, x + residual): the pre-norm
    residual pattern, fused into one pass by the Pallas kernel.

    `grad_dtype` (model.norm_grads_in_compute_dtype): the XLA norm sums its scale's and bias's gradients over the
    batch rows in this dtype (`xla_norm`); None keeps fp32 throughout.
    """

    def __init__(self, dim: int, kind: str, *, eps: float, use_bias: bool, param_dtype, rngs: nnx.Rngs,
                 impl: str = "auto", platform: str | None = None, grad_dtype=None):
        self.kind, self.eps, self.impl, self.platform = kind, eps, impl, platform
        self.grad_dtype = None if grad_dtype is None else jnp.dtype(grad_dtype)
        self.scale = _param(rngs, _ones, (dim,), ("norm",), param_dtype)
        self.bias = _param(rngs, _zeros, (dim,), ("norm",), param_dtype) if use_bias and kind == "layernorm" else None

    def __call__(self, x_BxLxD: jax.Array, residual: jax.Array | None = None):
        norm = implementation("norm", self.impl, x_BxLxD, platform=self.platform)
        bias = None if self.bias is None else self.bias[...]
        # the Pallas kernel sums its own gradients (model.norm_grads_in_compute_dtype is refused with norm_impl=pallas)
        extra = {"grad_dtype": self.grad_dtype} if self.grad_dtype is not None and norm is xla_norm else {}
        return norm(x_BxLxD, self.scale[...], bias, kind=self.kind, eps=self.eps, residual=residual,
                    platform=self.platform, **extra)


def norm_grad_dtype(cfg):
    """The dtype the norms sum their scales' gradients over the batch rows in: the compute dtype with
    model.norm_grads_in_compute_dtype where it is narrower than fp32, else None (fp32, autodiff's sum)."""
    dtype = jnp.dtype(cfg.dtype)
    return dtype if cfg.norm_grads_in_compute_dtype and dtype.itemsize < 4 else None


def xla_norm(x_BxLxD, scale, bias, *, kind: str, eps: float, residual=None, platform=None, grad_dtype=None):
    """LayerNorm or RMSNorm over the last dim in fp32 (the "xla" norm impl); with `residual`, of x + residual,
    returning (normed, x + residual).

    `grad_dtype` (a [B, L, D] input): the same forward, but the scale's and bias's gradients are each row's fp32 sum
    over its positions, rounded to `grad_dtype` and summed over the rows there (`_affine`), so that the reduction
    over the batch's devices sends `grad_dtype` values (bf16: half the bytes; MaxText, which multiplies by the scale
    in bf16, reduces bf16 gradients too).
    """
    if residual is not None:
        h = x_BxLxD + residual
        return xla_norm(h, scale, bias, kind=kind, eps=eps, grad_dtype=grad_dtype), h
    x = x_BxLxD.astype(jnp.float32)
    if kind == "layernorm":
        x = x - jnp.mean(x, axis=-1, keepdims=True)
    x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)
    scale = scale.astype(jnp.float32)
    bias = None if bias is None else bias.astype(jnp.float32)
    if grad_dtype is not None and x.ndim >= 3:
        return _affine(x, scale, bias, jnp.dtype(grad_dtype)).astype(x_BxLxD.dtype)
    x = x * _bcast(scale, x.ndim)
    if bias is not None:
        x = x + _bcast(bias, x.ndim)
    return x.astype(x_BxLxD.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _affine(x, scale, bias, grad_dtype):
    """x * scale (+ bias) over the last dim of an fp32 [B, ..., D] x, whose backward sums the scale's and bias's
    gradients over the rows B in `grad_dtype` (each row's positions in fp32 first)."""
    y = x * _bcast(scale, x.ndim)
    return y if bias is None else y + _bcast(bias, x.ndim)


def _affine_fwd(x, scale, bias, grad_dtype):
    return _affine(x, scale, bias, grad_dtype), (x, scale, bias is not None)


def _rows_sum(g, dtype):
    # fp32 over each row's positions, then `dtype` over the rows: the sum over B, where the batch's devices meet, is
    # a reduce in `dtype`, so the partitioner's all-reduce of it is too
    per_row = jnp.sum(g, axis=tuple(range(1, g.ndim - 1))).astype(dtype)
    return jax.lax.reduce(per_row, jnp.zeros((), dtype), jax.lax.add, (0,)).astype(jnp.float32)


def _affine_bwd(grad_dtype, res, ct):
    x, scale, has_bias = res
    dscale = _rows_sum(ct * x, grad_dtype)
    return ct * _bcast(scale, x.ndim), dscale, (_rows_sum(ct, grad_dtype) if has_bias else None)


_affine.defvjp(_affine_fwd, _affine_bwd)


register("norm", "xla", xla_norm)
register("norm", "pallas", kernels.pallas_norm, lambda x, *, platform: norm_unavailable_reason(x, backend=platform))


def rope(x_BxLxNxDh: jax.Array, positions_BxL: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding (rotate-half form) applied in fp32."""
    half = x_BxLxNxDh.shape[-1] // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle_BxLx1xHalf = (positions_BxL.astype(jnp.float32)[..., None] * freq[None, None, :])[:, :, None, :]
    return _rotate(x_BxLxNxDh, jnp.sin(angle_BxLx1xHalf), jnp.cos(angle_BxLx1xHalf))


@jax.custom_vjp
def _rotate(x, sin, cos):
    # halve before the fp32 cast (the same values): XLA:TPU fuses the cast into the rotation instead of writing an
    # fp32 copy of q and k to HBM first
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _rotate_fwd(x, sin, cos):
    return _rotate(x, sin, cos), (sin, cos)


def _rotate_bwd(res, dy):
    # The rotation's transpose is the rotation by the opposite angle: one fused pass over dy. Autodiff of the
    # forward instead casts each half's cotangent on its own, pads both to the full width and sums them: more HBM
    # traffic on TPU (-1.6% of a 7B step at 2 x 4096 per chip on v6e without it; benchmarks/RESULTS.md).
    sin, cos = res
    return _rotate(dy, -sin, cos), None, None


_rotate.defvjp(_rotate_fwd, _rotate_bwd)


class Attention(nnx.Module):
    """Multi-head, grouped-query or multi-query causal self-attention."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        D, H, K, Dh = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        init = nnx.initializers.normal(cfg.init_std)
        out_init = nnx.initializers.normal(cfg.init_std / (2 * cfg.n_layers) ** 0.5)
        pd = jnp.dtype(cfg.param_dtype)
        self.cfg = cfg
        self.grad_barrier = bool(cfg.matmul_grad_barrier)
        self.keep_dims = bool(cfg.keep_head_dims)  # contract in place (`dense` keep_dims)
        self.round_weights = bool(cfg.round_weights_before_cast)  # see `to_compute`
        self.wq_DxHxDh = _param(rngs, init, (D, H, Dh), ("embed", "heads", "head_dim"), pd)
        self.wk_DxKxDh = _param(rngs, init, (D, K, Dh), ("embed", "kv_heads", "head_dim"), pd)
        self.wv_DxKxDh = _param(rngs, init, (D, K, Dh), ("embed", "kv_heads", "head_dim"), pd)
        self.wo_HxDhxD = _param(rngs, out_init, (H, Dh, D), ("heads", "head_dim", "embed"), pd)
        if cfg.use_bias if cfg.qkv_bias is None else cfg.qkv_bias:  # with use_bias false: q/k/v alone (Qwen2)
            self.bias_q_HxDh = _param(rngs, _zeros, (H, Dh), ("heads", "head_dim"), pd)
            self.bias_k_KxDh = _param(rngs, _zeros, (K, Dh), ("kv_heads", "head_dim"), pd)
            self.bias_v_KxDh = _param(rngs, _zeros, (K, Dh), ("kv_heads", "head_dim"), pd)
        else:
            self.bias_q_HxDh = self.bias_k_KxDh = self.bias_v_KxDh = None
        self.bias_o_D = _param(rngs, _zeros, (D,), ("embed",), pd) if cfg.use_bias else None

    def _qkv(self, x_BxLxD: jax.Array, positions_BxL: jax.Array, hooks: LayerHooks = DEFAULT_HOOKS):
        """Projections q [B, L, H, Dh], k and v [B, L, K, Dh], with RoPE applied where the style uses it."""
        cfg, dt = self.cfg, x_BxLxD.dtype

        def proj(w, b, heads_axis):
            y = _column(x_BxLxD, to_compute(w[...], dt, round_first=self.round_weights), hooks, self.grad_barrier,
                        self.keep_dims)
            if b is not None:
                y = y + _bcast(b[...].astype(dt), y.ndim)
            return constrain(y, ("batch", "seq", heads_axis, "head_dim"))

        q = checkpoint_name(proj(self.wq_DxHxDh, self.bias_q_HxDh, "heads"), "query_proj")
        k = checkpoint_name(proj(self.wk_DxKxDh, self.bias_k_KxDh, "kv_heads"), "key_proj")
        v = checkpoint_name(proj(self.wv_DxKxDh, self.bias_v_KxDh, "kv_heads"), "value_proj")
        if cfg.position == "rope":
            q, k = rope(q, positions_BxL, cfg.rope_theta), rope(k, positions_BxL, cfg.rope_theta)
        return q, k, v

    def _out(self, o_BxLxHxDh: jax.Array, hooks: LayerHooks) -> jax.Array:
        dt = o_BxLxHxDh.dtype
        o_BxLxHxDh = constrain(o_BxLxHxDh, ("batch", "seq", "heads", "head_dim"))
        wo = to_compute(self.wo_HxDhxD[...], dt, round_first=self.round_weights)
        y = _row(o_BxLxHxDh, wo, 2, hooks, self.grad_barrier, self.keep_dims)
        if self.bias_o_D is not None:
            y = y + _bcast(self.bias_o_D[...].astype(dt), y.ndim)
        return checkpoint_name(y, "out_proj")

    def __call__(self, x_BxLxD: jax.Array, positions_BxL: jax.Array, segment_ids_BxL: jax.Array | None = None,
                 hooks: LayerHooks = DEFAULT_HOOKS):
        q, k, v = self._qkv(x_BxLxD, positions_BxL, hooks)
        if hooks.context is not None:  # context parallelism: the sequence is split, attention goes round a ring
            o_BxLxHxDh = ring_attention_ambient(q, k, v, causal=True, segment_ids=segment_ids_BxL,
                                                layout=hooks.context.layout)
        else:
            o_BxLxHxDh = attention(q, k, v, causal=True, segment_ids=segment_ids_BxL, impl=self.cfg.attention_impl,
                                   platform=self.cfg.platform)
        return self._out(checkpoint_name(o_BxLxHxDh, "context"), hooks)

    def cached(self, x_BxTxD, positions_BxT, k_cache_BxKxSxDh, v_cache_BxKxSxDh, index_B=None, *, attend=None):
        """Attention that reads and extends one layer's KV cache: (y [B, T, D], k_cache, v_cache).

        The cache is [B, K, S, Dh]: for each row and KV head the S slots are contiguous, the layout decode attention
        reads (a batched matmul over (B, K) with Dh or S as the contracted dim), so a decode step reads the cache in
        place and never transposes it. Prefill (`index_B` None): the T new keys and values go to slots [0, T) of
        every row and the queries attend causally among themselves, exactly as in `__call__`. Decode (`index_B`
        given, T == 1): row b's key and value go to slot index_B[b] and its query attends to slots
        [0, index_B[b]] through `attend` (default `decode_attention`; a kernel with the same signature can take its
        place).
        """
        q, k, v = self._qkv(x_BxTxD, positions_BxT)
        k, v = k.astype(k_cache_BxKxSxDh.dtype), v.astype(v_cache_BxKxSxDh.dtype)
        cache_axes = ("batch", "kv_heads", "seq", "head_dim")
        if index_B is None:
            k_BxKxTxDh, v_BxKxTxDh = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
            k_cache = jax.lax.dynamic_update_slice_in_dim(k_cache_BxKxSxDh, k_BxKxTxDh, 0, axis=2)
            v_cache = jax.lax.dynamic_update_slice_in_dim(v_cache_BxKxSxDh, v_BxKxTxDh, 0, axis=2)
            o = attention(q, k, v, causal=True, impl=self.cfg.attention_impl, platform=self.cfg.platform)
        else:
            if q.shape[1] != 1:
                raise ValueError(f"decode takes one new token per row, got {q.shape[1]}; prefill with index_B=None")
            rows_B = jnp.arange(q.shape[0])
            # Advanced indices on axes 0 and 2 around a slice: the update is [B, K, Dh], one slot per row.
            k_cache = k_cache_BxKxSxDh.at[rows_B, :, index_B].set(k[:, 0], mode="drop")
            v_cache = v_cache_BxKxSxDh.at[rows_B, :, index_B].set(v[:, 0], mode="drop")
            k_cache, v_cache = constrain(k_cache, cache_axes), constrain(v_cache, cache_axes)
            o = (attend or decode_attention)(q, k_cache, v_cache, index_B + 1)
        return (self._out(o.astype(x_BxTxD.dtype), DEFAULT_HOOKS), constrain(k_cache, cache_axes),
                constrain(v_cache, cache_axes))


def decode_attention(q_Bx1xHxDh, k_cache_BxKxSxDh, v_cache_BxKxSxDh, lengths_B):
    """One query per row against a cache [B, K, S, Dh]: row b attends to slots [0, lengths_B[b]) (the XLA reference).

    The math is that of `xla_attention` (fp32 scores and softmax, grouped-query heads), with the causal mask replaced
    by per-row lengths, so a decode step reproduces the full forward; a row of length 0 sees no slot and outputs
    zeros, as a fully masked query does there. Both matmuls are batched over (B, K) and
    contract the cache's minor dims as they lie in memory (Dh for the scores, S for the values). A Pallas decode
    kernel that takes the same arguments and returns [B, 1, H, Dh] can replace it (`Attention.cached(attend=...)`).
    """
    B, _, H, Dh = q_Bx1xHxDh.shape
    K, S = k_cache_BxKxSxDh.shape[1], k_cache_BxKxSxDh.shape[2]
    if H % K:
        raise ValueError(f"query heads {H} must be a multiple of kv heads {K}")
    q_BxKxGxDh = q_Bx1xHxDh.reshape(B, K, H // K, Dh)
    scores_BxKxGxS = jnp.einsum("bkgd,bksd->bkgs", q_BxKxGxDh, k_cache_BxKxSxDh, preferred_element_type=jnp.float32)
    scores_BxKxGxS = scores_BxKxGxS * (Dh**-0.5)
    valid_BxS = jnp.arange(S, dtype=jnp.int32)[None, :] < lengths_B.astype(jnp.int32)[:, None]
    scores_BxKxGxS = jnp.where(valid_BxS[:, None, None, :], scores_BxKxGxS, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores_BxKxGxS, axis=-1).astype(v_cache_BxKxSxDh.dtype)
    out = jnp.einsum("bkgs,bksd->bkgd", probs, v_cache_BxKxSxDh, preferred_element_type=jnp.float32)
    out = jnp.where((lengths_B > 0)[:, None, None, None], out, 0.0)
    return out.reshape(B, 1, H, Dh).astype(q_Bx1xHxDh.dtype)


def _act(act: str):
    """The MLP's activation on (h, gate): SwiGLU silu(gate) * h, or GELU of h (gate None)."""
    if act == "swiglu":
        return lambda h, gate: jax.nn.silu(gate) * h
    return lambda h, gate: jax.nn.gelu(h, approximate=act != "gelu_exact")


def _contract(a, b, dims, out=jnp.float32):
    # a matmul of compute-dtype operands; fp32 out where slices' partial sums are added up, else the operands' dtype
    # (the plain matmul's output: a weight gradient sent over ICI in it)
    return jax.lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def sliced_mlp(x, w_in, w_gate, w_out, b_in, act: str, slices: int):
    """The MLP x [..., D] -> [..., D] (w_in, w_gate [D, F], w_out [F, D], b_in [F]; w_gate and b_in may be None)
    computed over `slices` equal slices of its hidden width F in turn: each slice's hidden values are live only
    while it is computed, and the output sums the slices in fp32.

    The backward keeps x and the weights only and computes each slice again (under remat full the layer's
    backward recomputes its forward anyway, and XLA drops that recomputed output as unused); each weight gradient is
    written slice by slice, whole in one contraction over the tokens, so its values are the plain MLP's; the input's
    gradient sums the slices in fp32.
    """
    return _sliced_fwd(x, w_in, w_gate, w_out, b_in, act, slices)[0]


def _slice(w, c, f, axis):
    return None if w is None else jax.lax.dynamic_slice_in_dim(w, c * f, f, axis=axis)


def _slice_hidden(x, w_in, w_gate, b_in, c, f):
    """Slice `c` (of width f) of the MLP's hidden values before the activation: (h, gate), gate None without w_gate."""
    lead = x.ndim - 1
    h = _contract(x, _slice(w_in, c, f, 1), ((lead,), (0,)), x.dtype)
    if b_in is not None:
        h = h + _bcast(_slice(b_in, c, f, 0), h.ndim)
    gate = None if w_gate is None else _contract(x, _slice(w_gate, c, f, 1), ((lead,), (0,)), x.dtype)
    return h, gate


def _sliced_fwd(x, w_in, w_gate, w_out, b_in, act, slices):
    if w_in.shape[1] % slices:
        raise ValueError(f"sliced_mlp: {slices} slices do not cut the hidden width {w_in.shape[1]} evenly")
    f = w_in.shape[1] // slices
    fn, lead = _act(act), x.ndim - 1

    def body(c, y):
        return y + _contract(fn(*_slice_hidden(x, w_in, w_gate, b_in, c, f)), _slice(w_out, c, f, 0), ((lead,), (0,)))

    y = jax.lax.fori_loop(0, slices, body, jnp.zeros((*x.shape[:-1], w_out.shape[1]), jnp.float32))
    return y.astype(x.dtype), (x, w_in, w_gate, w_out, b_in)


def _sliced_bwd(act, slices, res, dy):
    x, w_in, w_gate, w_out, b_in = res
    f = w_in.shape[1] // slices
    fn, lead = _act(act), x.ndim - 1
    rows = tuple(range(lead))

    def body(dx, c):
        wi, wg, wo = _slice(w_in, c, f, 1), _slice(w_gate, c, f, 1), _slice(w_out, c, f, 0)
        a, act_vjp = jax.vjp(fn, *_slice_hidden(x, w_in, w_gate, b_in, c, f))
        dh, dgate = act_vjp(_contract(dy, wo, ((lead,), (1,)), dy.dtype))
        dx = dx + _contract(dh, wi, ((lead,), (1,)))
        grads = {"in": _contract(x, dh, (rows, rows), w_in.dtype), "out": _contract(a, dy, (rows, rows), w_out.dtype)}
        if wg is not None:
            dx = dx + _contract(dgate, wg, ((lead,), (1,)))
            grads["gate"] = _contract(x, dgate, (rows, rows), w_gate.dtype)
        if b_in is not None:
            grads["b"] = jnp.sum(dh, rows, dtype=jnp.float32).astype(b_in.dtype)
        return dx, grads

    # each weight gradient comes out of the loop whole ([slices, D, f] -> [D, F]), so the step reduces it once
    dx, g = jax.lax.scan(body, jnp.zeros(x.shape, jnp.float32), jnp.arange(slices))
    columns = lambda s_DxF: jnp.moveaxis(s_DxF, 0, 1).reshape(s_DxF.shape[1], -1)  # noqa: E731
    return (dx.astype(x.dtype), columns(g["in"]), columns(g["gate"]) if "gate" in g else None,
            g["out"].reshape(w_out.shape), g["b"].reshape(b_in.shape) if "b" in g else None)


sliced_mlp.defvjp(_sliced_fwd, _sliced_bwd)


class MLP(nnx.Module):
    """GELU MLP (GPT-2) or SwiGLU (Llama).

    `mlp_act="gelu"` is the tanh approximation of GELU (GPT-2's own, HF `gelu_new`); `"gelu_exact"` the erf form (HF
    `gelu`), which checkpoints trained with PyTorch's default `nn.GELU` need to reproduce their logits. With
    `model.gather_mlp_weights` (on for TPU) each weight is gathered whole before its matmul and its gradient sent
    straight back to the weight's own sharding (`jaxperf.parallel.rules.gather_weight`).
    """

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        D, F = cfg.d_model, cfg.mlp_dim
        init = nnx.initializers.normal(cfg.init_std)
        out_init = nnx.initializers.normal(cfg.init_std / (2 * cfg.n_layers) ** 0.5)
        pd = jnp.dtype(cfg.param_dtype)
        self.act = cfg.mlp_act
        self.grad_barrier = bool(cfg.matmul_grad_barrier)
        self.round_weights = bool(cfg.round_weights_before_cast)  # see `to_compute`
        self.gather_weights = bool(cfg.gather_mlp_weights)  # see `jaxperf.parallel.rules.gather_weight`
        self.scanned = bool(cfg.scan_layers)
        slices = int(cfg.mlp_slices or 1) if cfg.remat == "full" else 1  # see `sliced_mlp`
        self.slices = slices if F % slices == 0 else 1  # a shared expert of another width runs whole
        self.w_in_DxF = _param(rngs, init, (D, F), ("embed", "mlp"), pd)
        self.w_gate_DxF = _param(rngs, init, (D, F), ("embed", "mlp"), pd) if self.act == "swiglu" else None
        self.w_out_FxD = _param(rngs, out_init, (F, D), ("mlp", "embed"), pd)
        use_bias = cfg.use_bias
        self.bias_in_F = _param(rngs, _zeros, (F,), ("mlp",), pd) if use_bias else None
        self.bias_out_D = _param(rngs, _zeros, (D,), ("embed",), pd) if use_bias else None

    def _matmul(self, fn, x, w, dt, logical_axes):
        """fn(x, w) with `w` cast to the compute dtype; with `gather_weights`, where that changes its layout, gathered
        whole inside a checkpoint of its own, so the backward gathers it again rather than keep the gathered copy as
        the matmul's residual (without remat, every layer's gathered weights would stay live until its backward).
        Under a Python loop over the layers the checkpoint keeps XLA from merging the two gathers (`prevent_cse`);
        under the layer scan, forward and backward are different loops and the barrier is not needed."""
        w = to_compute(w[...], dt, round_first=self.round_weights)
        if not (self.gather_weights and isinstance(w, jax.Array) and gathers(w, logical_axes)):
            return fn(x, w)
        return jax.checkpoint(lambda x, w: fn(x, gather_weight(w, logical_axes)),
                              prevent_cse=not self.scanned)(x, w)

    def _sliced(self, x_BxLxD, hooks: LayerHooks) -> jax.Array:
        """The MLP over `self.slices` slices of its hidden width (`sliced_mlp`), each weight gathered whole first
        where gather_mlp_weights says so."""
        dt = x_BxLxD.dtype

        def weight(w, axes):
            w = to_compute(w[...], dt, round_first=self.round_weights)
            return gather_weight(w, axes) if self.gather_weights and gathers(w, axes) else w

        w_in = weight(self.w_in_DxF, ("embed", "mlp"))
        w_gate = None if self.w_gate_DxF is None else weight(self.w_gate_DxF, ("embed", "mlp"))
        b_in = None if self.bias_in_F is None else self.bias_in_F[...].astype(dt)
        y = sliced_mlp(x_BxLxD, w_in, w_gate, weight(self.w_out_FxD, ("mlp", "embed")), b_in, self.act, self.slices)
        y = hooks.row_parallel(y)
        if self.bias_out_D is not None:
            y = y + _bcast(self.bias_out_D[...].astype(dt), y.ndim)
        return checkpoint_name(y, "mlpwo")

    def __call__(self, x_BxLxD: jax.Array, hooks: LayerHooks = DEFAULT_HOOKS) -> jax.Array:
        dt = x_BxLxD.dtype
        if self.slices > 1 and hooks.sequence_parallel is None and not isinstance(self.w_in_DxF[...], Int8Weight):
            return self._sliced(x_BxLxD, hooks)
        def column(x, w):
            return _column(x, w, hooks, self.grad_barrier)

        h = self._matmul(column, x_BxLxD, self.w_in_DxF, dt, ("embed", "mlp"))
        if self.bias_in_F is not None:
            h = h + _bcast(self.bias_in_F[...].astype(dt), h.ndim)
        if self.act == "swiglu":
            gate = self._matmul(column, x_BxLxD, self.w_gate_DxF, dt, ("embed", "mlp"))
            h = _act(self.act)(checkpoint_name(h, "mlpwi_1"), checkpoint_name(gate, "mlpwi_0"))
        else:
            h = _act(self.act)(checkpoint_name(h, "mlpwi"), None)
        h_BxLxF = constrain(h, ("batch", "seq", "mlp"))
        y = self._matmul(lambda h, w: _row(h, w, 1, hooks, self.grad_barrier), h_BxLxF, self.w_out_FxD, dt,
                         ("mlp", "embed"))
        if self.bias_out_D is not None:
            y = y + _bcast(self.bias_out_D[...].astype(dt), y.ndim)
        return checkpoint_name(y, "mlpwo")


class Block(nnx.Module):
    """Pre-norm Transformer layer: x + attn(norm(x)), then x + mlp(norm(x)).

    `make_mlp(cfg, rngs=)` builds the MLP (default `MLP`); one that returns (y, stats), as `jaxperf.models.moe.MoE`
    does, has its stats handed out by `forward`.
    """

    def __init__(self, cfg, *, rngs: nnx.Rngs, make_mlp=None):
        kw = dict(eps=cfg.norm_eps, use_bias=cfg.use_bias, param_dtype=jnp.dtype(cfg.param_dtype), rngs=rngs,
                  impl=cfg.norm_impl, platform=cfg.platform, grad_dtype=norm_grad_dtype(cfg))
        self.attn_norm = Norm(cfg.d_model, cfg.norm, **kw)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = Norm(cfg.d_model, cfg.norm, **kw)
        self.mlp = (make_mlp or MLP)(cfg, rngs=rngs)

    def _mlp(self, normed, hooks: LayerHooks) -> tuple[jax.Array, dict]:
        out = self.mlp(normed, hooks)
        return out if isinstance(out, tuple) else (out, {})

    def forward(self, x_BxLxD, positions_BxL, segment_ids_BxL=None, hooks: LayerHooks = DEFAULT_HOOKS):
        """(x [B, L, D], the MLP's stats: {} for a dense MLP, the router's for an MoE one)."""
        attn_out = self.attn(self.attn_norm(x_BxLxD), positions_BxL, segment_ids_BxL, hooks)
        normed, x_BxLxD = self.mlp_norm(attn_out, residual=x_BxLxD)  # x + attn, normalised in the same pass
        x_BxLxD = constrain(x_BxLxD, ("batch", "residual_seq", "embed"))
        mlp_out, stats = self._mlp(normed, hooks)
        return constrain(x_BxLxD + mlp_out, ("batch", "residual_seq", "embed")), stats

    def __call__(self, x_BxLxD, positions_BxL, segment_ids_BxL=None, hooks: LayerHooks = DEFAULT_HOOKS):
        return self.forward(x_BxLxD, positions_BxL, segment_ids_BxL, hooks)[0]

    def cached(self, x_BxTxD, positions_BxT, k_cache, v_cache, index_B=None, *, attend=None):
        """The layer over a KV cache (see `Attention.cached`): (x [B, T, D], k_cache, v_cache)."""
        attn_out, k_cache, v_cache = self.attn.cached(self.attn_norm(x_BxTxD), positions_BxT, k_cache, v_cache,
                                                      index_B, attend=attend)
        normed, x_BxTxD = self.mlp_norm(attn_out, residual=x_BxTxD)
        x_BxTxD = constrain(x_BxTxD, ("batch", "seq", "embed"))
        x_BxTxD = x_BxTxD + self._mlp(normed, DEFAULT_HOOKS)[0]
        return constrain(x_BxTxD, ("batch", "seq", "embed")), k_cache, v_cache
