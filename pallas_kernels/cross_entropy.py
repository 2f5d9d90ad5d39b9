"""Fused output projection + softmax cross-entropy that never builds the [N, V] logits, forward or backward.

    loss_sum, count = linear_cross_entropy(h_NxD, w_DxV, targets_N, mask_N, z_loss=1e-4)
    loss = loss_sum / jnp.maximum(count, 1.0)

Why: for a GPT-2 sized vocabulary the logits of one batch dwarf every other activation (8192 tokens x 50304 vocab in
fp32 is 1.6 GB, and the naive backward keeps a second copy for the softmax). Both implementations here hold one tile
of logits at a time and recompute it in the backward instead of saving it:

- "pallas": kernels that stream vocabulary blocks with an online max / sum (the flash-attention trick applied to the
  softmax over V). The forward writes per-row max, sum and target logit; the backward recomputes each logits tile and
  forms dlogits = c * (softmax * (1 + 2 z lse) - onehot) on the fly, for dh = dlogits @ w^T (one program per row
  block) and dw = h^T @ dlogits (one program per vocab block), so nothing needs an atomic add.
- "xla": the same maths in plain JAX under a `custom_vjp`: a `lax.map` over row chunks forward; backward, a loop over
  vocabulary blocks around a `lax.scan` over row chunks, so it holds one [chunk, block] logits tile and one fp32
  [D, block] dw accumulator (`BlockSizes.chunk_v`). It compiles well on every backend and is what "auto" picks.
  Inside shard_map it takes w as a shard of rows (FSDP's split, `w_axes`): forward and backward then walk the same
  vocabulary blocks, each all-gathered when its turn comes and its dw reduce-scattered when done, so the whole w is
  never gathered on one device. With `keep_gathered` the forward of a differentiated call gathers w whole once and
  keeps it for the backward, which then walks its blocks without gathering them again: one all-gather of w a step
  instead of two, for a whole w held from the forward to the backward.

Reductions: on TPU the reduced axis (vocab in the forward and dh, rows in dw) is a sequential ("arbitrary") grid
axis whose output block stays resident and accumulates, so a tile of w or h is all that sits in VMEM. Triton has no
sequential grid axes, so on GPU (and by default in interpret mode) each program loops over the reduced axis with a
`fori_loop` instead. `BlockSizes.grid_reduction` picks one; both run in interpret mode, which is how CPU tests cover
the TPU layout.

Per token: loss = lse - logit[target] + z_loss * lse**2 (z-loss keeps the normaliser near 1, as in PaLM), weighted by
the mask (0 ignores a token; its target may then be any value, e.g. -1: an id outside [0, V) matches no column, so its
target logit counts as 0). Padded rows get weight 0; padded vocabulary
columns get a large negative finite logit, so they vanish from the softmax without inf - inf = nan.

Legend: N tokens (rows), D model width, V vocabulary; a `_pad` suffix is a size padded to a block multiple.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _util

_F32 = jnp.float32
_SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
IMPLS = ("auto", "pallas", "xla", "reference")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiling of both implementations. Sizes above the (padded) problem are shrunk to fit it.

    block_n: rows per Pallas tile; TPU wants a multiple of 8, Triton a power of two.
    block_v: vocabulary columns per Pallas tile; TPU wants a multiple of 128, Triton a power of two.
    chunk_n: rows per chunk of the "xla" path; one fp32 [chunk_n, V] tile is its forward's peak temporary.
    chunk_v: widest vocabulary block of the "xla" backward, which keeps one fp32 [D, block] dw accumulator and one
      [chunk_n, block] logits tile; the block is the widest divisor of V up to chunk_v (V when none is at least a
      quarter of chunk_v).
    grid_reduction: reduce over a sequential grid axis (True, the TPU layout) or with an in-kernel loop (False, the
      Triton layout); None picks True on TPU only.
    """

    block_n: int
    block_v: int
    chunk_n: int = 1024
    chunk_v: int = 8192
    grid_reduction: bool | None = None

    @classmethod
    def get_default(cls, backend: str | None = None) -> "BlockSizes":
        """Defaults per backend: "cpu" (interpret mode), "gpu" (Triton), "tpu" (Mosaic). None: the default backend."""
        backend = _util.resolve_backend(backend)
        if backend == "tpu":
            return cls(block_n=256, block_v=512)
        if backend == "gpu":
            return cls(block_n=64, block_v=128)
        # Interpret mode pays per grid step and per loop step: big tiles are faster on CPU.
        return cls(block_n=128, block_v=512)


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static facts shared by forward and backward (hashable: it rides in nondiff_argnums)."""

    engine: str  # "pallas" | "xla"
    z_loss: float
    rows: int
    rows_pad: int
    dim_pad: int
    vocab: int
    vocab_pad: int
    block_n: int
    block_v: int
    grid_reduction: bool
    interpret: object  # bool, or pltpu.InterpretParams (the TPU interpreter)
    backend: str
    w_axes: tuple[str, ...] = ()  # mesh axes w's rows are split over (inside shard_map); () for a whole w
    # with w_axes, "xla": a differentiated call gathers w whole once and keeps it for the backward (`_fused_fwd`)
    keep_gathered: bool = False


# ---------------------------------------------------------------------------------------------------------------------
# The spec.


def linear_cross_entropy_reference(h_NxD, w_DxV, targets_N, mask=None, *, z_loss: float = 0.0):
    """Pure-jnp spec: materialises fp32 logits = h @ w and returns (sum of mask * token loss, sum of mask), fp32."""
    logits_NxV = jnp.dot(h_NxD, w_DxV, preferred_element_type=_F32)
    lse_N = jax.nn.logsumexp(logits_NxV, axis=-1)
    t_N = targets_N.astype(jnp.int32)
    valid_N = (t_N >= 0) & (t_N < w_DxV.shape[1])
    picked_N = jnp.take_along_axis(logits_NxV, jnp.where(valid_N, t_N, 0)[:, None], axis=-1)[:, 0]
    target_N = jnp.where(valid_N, picked_N, 0.0)  # an id outside [0, V) matches no column, as in the kernels
    loss_N = lse_N - target_N + z_loss * jnp.square(lse_N)
    weight_N = jnp.ones(targets_N.shape, _F32) if mask is None else mask.astype(_F32)
    return jnp.sum(loss_N * weight_N), jnp.sum(weight_N)


# ---------------------------------------------------------------------------------------------------------------------
# Kernel bodies. Per-row vectors are [rows, 1] so every block is rank 2 (TPU's (8, 128)-or-full rule holds).


def _dot(a, b):  # a[m, k] @ b[k, n] -> [m, n] fp32
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=_F32)


def _dot_nt(a, b):  # a[m, k] @ b[n, k]^T -> [m, n] fp32
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=_F32)


def _dot_tn(a, b):  # a[k, m]^T @ b[k, n] -> [m, n] fp32
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=_F32)


def _logits_tile(cfg: _Config, h, w, col0):
    """fp32 logits of one [rows, bv] tile with padded vocabulary columns pushed to the (finite) mask value, and the
    column ids."""
    logits = _dot(h, w)
    cols = col0 + lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    if cfg.vocab_pad != cfg.vocab:
        logits = jnp.where(cols < cfg.vocab, logits, _util.MASK_VALUE)
    return logits, cols


def _dlogits_tile(cfg: _Config, h, w, col0, t, lse, coef, scale):
    """dloss/dlogits of one tile: scale * softmax - coef * onehot, scale = coef * (1 + 2 z lse), coef = ct * mask."""
    logits, cols = _logits_tile(cfg, h, w, col0)
    p = jnp.exp(logits - lse)
    return scale * p - jnp.where(cols == t, coef, 0.0)


def _accumulator(cfg: _Config, grid_step, refs, fills):
    """Start values of a reduction: the refs themselves when the reduction runs over grid steps (TPU: the output
    block stays resident and is zeroed at step 0), else fresh constants (one program covers the whole reduction, and
    Triton must not read back what it just stored)."""
    if not cfg.grid_reduction:
        return tuple(jnp.full(ref.shape, fill, _F32) for ref, fill in zip(refs, fills))

    @pl.when(grid_step == 0)
    def _init():
        for ref, fill in zip(refs, fills):
            ref[...] = jnp.full(ref.shape, fill, _F32)

    return tuple(ref[...] for ref in refs)


def _fwd_kernel(h_ref, w_ref, t_ref, m_ref, l_ref, tl_ref, *, cfg: _Config):
    """Online max m, sum l = sum exp(logits - m) and target logit of a row block, over this program's vocab span."""
    j = pl.program_id(1)
    m0, l0, tl0 = _accumulator(cfg, j, (m_ref, l_ref, tl_ref), (-jnp.inf, 0.0, 0.0))
    bv = cfg.block_v
    span = w_ref.shape[1]
    h, t = h_ref[...], t_ref[...]

    def body(k, carry):
        m, l, tl = carry
        c0 = pl.multiple_of(k * bv, bv)
        logits, cols = _logits_tile(cfg, h, w_ref[:, pl.ds(c0, bv)], j * span + c0)
        tl = tl + jnp.sum(jnp.where(cols == t, logits, 0.0), axis=1, keepdims=True)
        m_new = jnp.maximum(m, jnp.max(logits, axis=1, keepdims=True))
        l = jnp.exp(m - m_new) * l + jnp.sum(jnp.exp(logits - m_new), axis=1, keepdims=True)
        return m_new, l, tl

    m, l, tl = lax.fori_loop(0, span // bv, body, (m0, l0, tl0))
    m_ref[...], l_ref[...], tl_ref[...] = m, l, tl


def _dh_kernel(h_ref, w_ref, t_ref, lse_ref, coef_ref, scale_ref, dh_ref, *, cfg: _Config):
    """dh = dlogits @ w^T for a row block, accumulated over this program's vocab span (fp32 out)."""
    j = pl.program_id(1)
    (dh0,) = _accumulator(cfg, j, (dh_ref,), (0.0,))
    bv = cfg.block_v
    span = w_ref.shape[1]
    h, t, lse, coef, scale = h_ref[...], t_ref[...], lse_ref[...], coef_ref[...], scale_ref[...]

    def body(k, dh):
        c0 = pl.multiple_of(k * bv, bv)
        w = w_ref[:, pl.ds(c0, bv)]
        dlogits = _dlogits_tile(cfg, h, w, j * span + c0, t, lse, coef, scale)
        return dh + _dot_nt(dlogits.astype(w.dtype), w)

    dh_ref[...] = lax.fori_loop(0, span // bv, body, dh0)


def _dw_kernel(h_ref, w_ref, t_ref, lse_ref, coef_ref, scale_ref, dw_ref, *, cfg: _Config):
    """dw = h^T @ dlogits for a vocab block, accumulated over this program's row span (fp32 out)."""
    (dw0,) = _accumulator(cfg, pl.program_id(1), (dw_ref,), (0.0,))
    bn = cfg.block_n
    w = w_ref[...]
    col0 = pl.program_id(0) * cfg.block_v

    def body(k, dw):
        r0 = pl.multiple_of(k * bn, bn)
        rows = pl.ds(r0, bn)
        h = h_ref[rows, :]
        dlogits = _dlogits_tile(
            cfg, h, w, col0, t_ref[rows, :], lse_ref[rows, :], coef_ref[rows, :], scale_ref[rows, :]
        )
        return dw + _dot_tn(h, dlogits.astype(h.dtype))

    dw_ref[...] = lax.fori_loop(0, h_ref.shape[0] // bn, body, dw0)


# ---------------------------------------------------------------------------------------------------------------------
# pallas_call wrappers on padded [N_pad, D_pad] / [D_pad, V_pad] arrays; row vectors are [N_pad, 1].


def _call(cfg: _Config, kernel, grid, in_specs, out_specs, out_shape, name):
    return _util.pallas_call(
        functools.partial(kernel, cfg=cfg),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_util.compiler_params(cfg.backend, cfg.interpret, ("parallel", "arbitrary")),
        interpret=cfg.interpret,
        name=name,
    )


def _row_major_specs(cfg: _Config, n_row_vectors: int):
    """Grid (row blocks, vocab steps): a row block of h and row vectors, a vocab span of w (one block or all)."""
    bn, D = cfg.block_n, cfg.dim_pad
    span = cfg.block_v if cfg.grid_reduction else cfg.vocab_pad
    grid = (cfg.rows_pad // bn, cfg.vocab_pad // span)
    vec = pl.BlockSpec((bn, 1), lambda i, j: (i, 0))
    specs = [pl.BlockSpec((bn, D), lambda i, j: (i, 0)), pl.BlockSpec((D, span), lambda i, j: (0, j))]
    return grid, specs + [vec] * n_row_vectors, vec


def _fwd_pallas(cfg: _Config, h, w, t):
    grid, in_specs, vec = _row_major_specs(cfg, 1)
    row = jax.ShapeDtypeStruct((cfg.rows_pad, 1), _F32)
    m, l, tl = _call(cfg, _fwd_kernel, grid, in_specs, [vec] * 3, [row] * 3, "linear_cross_entropy_fwd")(h, w, t)
    return (m + jnp.log(l))[:, 0], tl[:, 0]


def _bwd_pallas(cfg: _Config, h, w, t, lse, coef, scale):
    grid, in_specs, _ = _row_major_specs(cfg, 4)
    bn, D = cfg.block_n, cfg.dim_pad
    dh_spec = pl.BlockSpec((bn, D), lambda i, j: (i, 0))
    dh = _call(
        cfg, _dh_kernel, grid, in_specs, dh_spec, jax.ShapeDtypeStruct(h.shape, _F32), "linear_cross_entropy_dh"
    )(h, w, t, lse, coef, scale)

    # Grid (vocab blocks, row steps): a vocab block of w, and a span of rows (one block or all).
    span = bn if cfg.grid_reduction else cfg.rows_pad
    grid = (cfg.vocab_pad // cfg.block_v, cfg.rows_pad // span)
    vec = pl.BlockSpec((span, 1), lambda v, r: (r, 0))
    w_spec = pl.BlockSpec((D, cfg.block_v), lambda v, r: (0, v))
    in_specs = [pl.BlockSpec((span, D), lambda v, r: (r, 0)), w_spec] + [vec] * 4
    dw = _call(
        cfg, _dw_kernel, grid, in_specs, w_spec, jax.ShapeDtypeStruct(w.shape, _F32), "linear_cross_entropy_dw"
    )(h, w, t, lse, coef, scale)
    return dh, dw


# ---------------------------------------------------------------------------------------------------------------------
# The "xla" engine: the same maths over row chunks of [chunk, D]; row vectors are [n_chunks, chunk].


def _chunks(cfg: _Config, x):
    chunk = cfg.block_n
    return x.reshape((cfg.rows_pad // chunk, chunk) + x.shape[1:])


def _w_block(cfg: _Config, w, col0, width: int, whole: bool = False):
    """Columns [col0, col0 + width) of w, every row of them: gathered over `cfg.w_axes` when w is this device's shard
    of the rows, so no more than one block of the whole w is ever live; `whole`: w is gathered already."""
    block = lax.dynamic_slice_in_dim(w, col0, width, axis=1)
    return lax.all_gather(block, cfg.w_axes, axis=0, tiled=True) if cfg.w_axes and not whole else block


def _dw_shard(cfg: _Config, dw_block):
    """The transpose of `_w_block`'s gather: a [D, width] gradient summed over `cfg.w_axes`, each device keeping the
    rows of its own shard."""
    if not cfg.w_axes:
        return dw_block
    return lax.psum_scatter(dw_block, cfg.w_axes, scatter_dimension=0, tiled=True)


def _fwd_xla(cfg: _Config, h, w, t, whole: bool = False):
    """Per-row lse and target logit: a map over row chunks with a running max and sum per row, inside a loop over
    vocabulary blocks. With w whole the block is all of V (one [chunk, V] logits tile live); with w a shard of rows
    it is the backward's block, so one gathered [D, block] block of w and one [chunk, block] tile are live (`whole`:
    a shard's w gathered whole already, walked by the same blocks)."""
    block = cfg.block_v if cfg.w_axes else cfg.vocab_pad
    xs = (_chunks(cfg, h), _chunks(cfg, t[:, 0]))
    shape = (cfg.rows_pad // cfg.block_n, cfg.block_n)

    def vocab_block(j, carry):
        col0 = j * block
        w_blk = _w_block(cfg, w, col0, block, whole)

        def one(args):
            h_c, t_c, m_c, s_c, tl_c = args
            logits = _dot(h_c, w_blk)
            cols = lax.broadcasted_iota(jnp.int32, logits.shape, 1) + col0
            tl_c = tl_c + jnp.sum(jnp.where(cols == t_c[:, None], logits, 0.0), axis=1)
            m_new = jnp.maximum(m_c, jnp.max(logits, axis=1))
            s_c = s_c * jnp.exp(m_c - m_new) + jnp.sum(jnp.exp(logits - m_new[:, None]), axis=1)
            return m_new, s_c, tl_c

        return lax.map(one, (*xs, *carry))

    init = (jnp.full(shape, -jnp.inf, _F32), jnp.zeros(shape, _F32), jnp.zeros(shape, _F32))
    m, s, tl = lax.fori_loop(0, cfg.vocab_pad // block, vocab_block, init)
    return (m + jnp.log(s)).reshape(-1), tl.reshape(-1)


def xla_vocab_block(V: int, widest: int) -> int:
    """The widest divisor of V up to `widest` columns (V itself when it is no wider, or has no divisor of at least a
    quarter of that width: blocks that narrow would make small matmuls)."""
    if V <= widest:
        return V
    for width in range(widest, max(widest // 4, 1) - 1, -1):
        if V % width == 0:
            return width
    return V


def _bwd_xla(cfg: _Config, h, w, t, lse, coef, scale, whole: bool = False):
    """dh (fp32) and dw (w's dtype), one vocabulary block of dw at a time.

    The outer loop walks the vocabulary blocks; the inner scan walks the row chunks, recomputing each [chunk, block]
    logits tile once, and sums that block's dw in fp32 before storing it in w's dtype. So the fp32 accumulator is
    [D, block], not [D, V] (2 GB for Llama-3's 128256 x 4096), and each element of dw is summed over the same row
    chunks in the same order as a whole-vocabulary accumulator would; dh adds up over the blocks in one fp32 [N, D]
    accumulator whose chunks are updated in place. With w a shard of rows (`cfg.w_axes`), each block is gathered on
    its way in and its dw reduce-scattered on its way out; with `whole` (w gathered whole by the forward, kept for
    the backward) only the reduce-scatter remains.
    """
    D, V = cfg.dim_pad, cfg.vocab_pad
    block = cfg.block_v
    chunk = cfg.block_n
    xs = (jnp.arange(cfg.rows_pad // chunk), *(_chunks(cfg, x) for x in (h, t, lse, coef, scale)))

    def vocab_block(j, carry):
        dh, dw = carry
        col0 = j * block
        w_blk = _w_block(cfg, w, col0, block, whole)

        def step(acc, args):
            # dh is carried and each chunk's rows updated in place: a stacked [chunks, chunk, D] output added to dh
            # after the scan would be a second fp32 [N, D] buffer live beside it
            dw_blk, dh = acc
            c, h_c, t_c, lse_c, coef_c, scale_c = args
            logits = _dot(h_c, w_blk)
            cols = lax.broadcasted_iota(jnp.int32, logits.shape, 1) + col0
            dlogits = scale_c * jnp.exp(logits - lse_c) - jnp.where(cols == t_c, coef_c, 0.0)
            dh_c = lax.dynamic_slice_in_dim(dh, c * chunk, chunk) + _dot_nt(dlogits.astype(w.dtype), w_blk)
            dh = lax.dynamic_update_slice_in_dim(dh, dh_c, c * chunk, axis=0)
            return (dw_blk + _dot_tn(h_c, dlogits.astype(h.dtype)), dh), None

        (dw_blk, dh), _ = lax.scan(step, (jnp.zeros((D, block), _F32), dh), xs)
        dw = lax.dynamic_update_slice_in_dim(dw, _dw_shard(cfg, dw_blk.astype(w.dtype)), col0, axis=1)
        return dh, dw

    dw_rows = w.shape[0] // _axes_size(cfg.w_axes) if whole else w.shape[0]  # dw is this device's shard of rows
    return lax.fori_loop(0, V // block, vocab_block,
                         (jnp.zeros(h.shape, _F32), jnp.zeros((dw_rows, w.shape[1]), w.dtype)))


# ---------------------------------------------------------------------------------------------------------------------
# custom_vjp on padded inputs: h [N_pad, D_pad], w [D_pad, V_pad], targets [N_pad, 1] int32, weights [N_pad] fp32.


def _forward(cfg: _Config, h, w, t):
    return (_fwd_pallas if cfg.engine == "pallas" else _fwd_xla)(cfg, h, w, t)


def _token_losses(cfg: _Config, lse, tl):
    return lse - tl + cfg.z_loss * jnp.square(lse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(cfg: _Config, h, w, t, weight):
    lse, tl = _forward(cfg, h, w, t)
    return jnp.sum(_token_losses(cfg, lse, tl) * weight), jnp.sum(weight)


def _kept(cfg: _Config) -> bool:
    return cfg.keep_gathered and bool(cfg.w_axes) and cfg.engine == "xla"


def _fused_fwd(cfg: _Config, h, w, t, weight):
    if _kept(cfg):  # one gather for both passes; the residual is the whole w
        w = lax.all_gather(w, cfg.w_axes, axis=0, tiled=True)
        lse, tl = _fwd_xla(cfg, h, w, t, whole=True)
    else:
        lse, tl = _forward(cfg, h, w, t)
    loss = _token_losses(cfg, lse, tl)
    return (jnp.sum(loss * weight), jnp.sum(weight)), (h, w, t, weight, lse, loss)


def _fused_bwd(cfg: _Config, residuals, cotangents):
    h, w, t, weight, lse, loss = residuals
    ct_sum, ct_count = cotangents
    coef = (ct_sum * weight)[:, None]
    scale = coef * (1.0 + 2.0 * cfg.z_loss * lse[:, None])
    args = (h, w, t, lse[:, None], coef, scale)
    if _kept(cfg):
        dh, dw = _bwd_xla(cfg, *args, whole=True)
    else:
        dh, dw = (_bwd_pallas if cfg.engine == "pallas" else _bwd_xla)(cfg, *args)
    d_weight = ct_sum * loss + ct_count
    return dh.astype(h.dtype), dw.astype(w.dtype), None, d_weight


_fused.defvjp(_fused_fwd, _fused_bwd)


# ---------------------------------------------------------------------------------------------------------------------
# Public API.


def _axes_size(axes: tuple[str, ...]) -> int:
    """Devices along these mesh axes (inside shard_map)."""
    size = 1
    for name in axes:
        size *= int(lax.axis_size(name)) if hasattr(lax, "axis_size") else int(lax.psum(1, name))
    return size


def _check_inputs(h_NxD, w_DxV, targets_N, mask, z_loss, w_shards: int = 1):
    if h_NxD.ndim != 2 or w_DxV.ndim != 2:
        raise ValueError(
            f"h must be [N, D] and w [D, V]; got h.shape={tuple(h_NxD.shape)}, w.shape={tuple(w_DxV.shape)} "
            "(flatten batch and sequence first: h.reshape(-1, D))"
        )
    N, D = h_NxD.shape
    if w_shards > 1 and w_DxV.shape[0] * w_shards != D:
        raise ValueError(
            f"w holds {w_DxV.shape[0]} rows split over {w_shards} devices (w_axes), {w_DxV.shape[0] * w_shards} in "
            f"all, but h has D={D} features; pass each device its [D / {w_shards}, V] shard of w"
        )
    if w_shards == 1 and w_DxV.shape[0] != D:
        raise ValueError(
            f"h has D={D} features but w has {w_DxV.shape[0]} rows; w must be [D, V] = [{D}, vocab] "
            "(pass the embedding table transposed, embed_VxD.T)"
        )
    if h_NxD.dtype != w_DxV.dtype:
        raise ValueError(f"h and w dtypes differ ({h_NxD.dtype} vs {w_DxV.dtype}); cast w with w.astype(h.dtype)")
    if jnp.dtype(h_NxD.dtype).name not in _SUPPORTED_DTYPES:
        raise ValueError(f"dtype {h_NxD.dtype} is not supported; use one of {_SUPPORTED_DTYPES}")
    if tuple(targets_N.shape) != (N,):
        raise ValueError(f"targets must be [N] = ({N},) to match h; got {tuple(targets_N.shape)}")
    if not jnp.issubdtype(targets_N.dtype, jnp.integer):
        raise ValueError(f"targets must be integer token ids, got dtype {targets_N.dtype}")
    if mask is not None and tuple(mask.shape) != (N,):
        raise ValueError(f"mask must be [N] = ({N},) to match h; got {tuple(mask.shape)}")
    if isinstance(z_loss, jax.Array) or not float(z_loss) >= 0.0:
        raise ValueError(f"z_loss must be a non-negative Python float, got {z_loss!r}")


# Triton keeps a program's operand tiles in shared memory, each spanning the whole padded width D (a power of two):
# the h rows [block_n, D] and the w columns [D, block_v], about (block_n + block_v) x D x itemsize bytes, though the
# compiler asks for more at some sizes. Seen on an H200 (jax 0.11.2, D=768 padded to 1024), against 227 KiB a block
# may have: block_n=64, block_v=128 asked for 384 KiB in bf16 and 768 KiB in fp32 (the estimate, exactly);
# block_n=32, block_v=64 in bf16 asked for 256 KiB (the estimate says 192); block_n=16, block_v=32 in fp32
# (estimate 192 KiB) compiled and matched the reference. The budget keeps the estimate under two thirds of the
# hardware's limit, so that neither seen excess overflows it.
GPU_SHARED_MEMORY_BUDGET = 144 * 2**10
_GPU_MIN_TILE = 16  # Triton's dot needs at least 16 along each dim


def _gpu_tile_bytes(block_n: int, block_v: int, d: int, itemsize: int) -> int:
    return (block_n + block_v) * d * itemsize


def _fit_gpu_shared_memory(block_n: int, block_v: int, d: int, itemsize: int) -> tuple[int, int]:
    """Halve the tiles (the wider first) until `_gpu_tile_bytes` fits GPU_SHARED_MEMORY_BUDGET."""
    while _gpu_tile_bytes(block_n, block_v, d, itemsize) > GPU_SHARED_MEMORY_BUDGET:
        if block_v > block_n and block_v // 2 >= _GPU_MIN_TILE:
            block_v //= 2
        elif block_n // 2 >= _GPU_MIN_TILE:
            block_n //= 2
        elif block_v // 2 >= _GPU_MIN_TILE:
            block_v //= 2
        else:
            raise ValueError(_gpu_too_wide(d, itemsize))
    return block_n, block_v


def _gpu_too_wide(d: int, itemsize: int) -> str:
    least = _gpu_tile_bytes(_GPU_MIN_TILE, _GPU_MIN_TILE, d, itemsize)
    return (f"width D={d} at {itemsize} bytes per element needs {least // 1024} KiB of GPU shared memory even at "
            f"{_GPU_MIN_TILE}x{_GPU_MIN_TILE} tiles (budget {GPU_SHARED_MEMORY_BUDGET // 1024} KiB); use impl='xla' "
            "(the chunked path)")


def _fit(blocks: BlockSizes, N: int, D: int, V: int, engine: str, backend: str, interpret,
         itemsize: int = 4) -> _Config:
    """Check block sizes, shrink them to the problem (and, for Triton, to GPU shared memory), and work out the padded
    sizes. `itemsize`: bytes per element of h and w."""
    for name in ("block_n", "block_v", "chunk_n", "chunk_v"):
        size = getattr(blocks, name)
        if not isinstance(size, int) or size <= 0:
            raise ValueError(f"BlockSizes.{name}={size!r} must be a positive int")
    compiled = engine == "pallas" and not interpret
    if compiled and backend == "gpu":
        for name in ("block_n", "block_v"):
            size = getattr(blocks, name)
            if size & (size - 1):
                raise ValueError(f"BlockSizes.{name}={size} must be a power of two for the Triton lowering")
    if engine == "pallas" and backend == "tpu":
        for name, multiple in (("block_n", 8), ("block_v", 128)):
            if getattr(blocks, name) % multiple:
                raise ValueError(f"BlockSizes.{name}={getattr(blocks, name)} must be a multiple of {multiple} on TPU")
    n_floor, v_floor = (8, 128) if backend == "tpu" else (8, 16)
    if engine == "pallas":
        block_n = min(blocks.block_n, max(n_floor, _util.next_pow2(N)))
        block_v = min(blocks.block_v, max(v_floor, _util.next_pow2(V)))
        # Padding V copies all of w (148 MiB for GPT-2 in fp32): a block up to 4x narrower that divides V avoids it.
        for narrower in (block_v // 2, block_v // 4):
            if V % block_v and narrower >= v_floor and narrower % v_floor == 0 and V % narrower == 0:
                block_v = narrower
        dim_pad = _util.padded_lanes(D, backend, interpret)
        if compiled and backend == "gpu":
            block_n, block_v = _fit_gpu_shared_memory(block_n, block_v, dim_pad, itemsize)
        vocab_pad = _util.round_up(V, block_v)
    else:  # the xla engine keeps V and D as they are, chunks rows by chunk_n and (backward) columns by chunk_v
        block_n = min(blocks.chunk_n, _util.round_up(N, 8))
        block_v, vocab_pad, dim_pad = xla_vocab_block(V, blocks.chunk_v), V, D
    tpu_layout = backend == "tpu" or _util.is_tpu_interpret(interpret)
    grid_reduction = tpu_layout if blocks.grid_reduction is None else bool(blocks.grid_reduction)
    if compiled and backend == "gpu" and grid_reduction:
        raise ValueError("BlockSizes.grid_reduction=True needs sequential grid axes, which Triton lacks; use False")
    return _Config(
        engine=engine, z_loss=0.0, rows=N, rows_pad=_util.round_up(N, block_n), dim_pad=dim_pad, vocab=V,
        vocab_pad=vocab_pad, block_n=block_n, block_v=block_v, grid_reduction=grid_reduction, interpret=interpret,
        backend=backend,
    )


def _resolve_impl(impl: str, h_NxD, w_DxV, backend: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {IMPLS}")
    if impl == "auto":
        # The chunked XLA path until a benchmark on the device shows the kernel faster (benchmarks/bench_kernels.py).
        return "xla"
    if impl == "pallas":
        why = unavailable_reason(h_NxD, w_DxV, backend=backend)
        if why is not None:
            raise RuntimeError(f"linear_cross_entropy impl='pallas' cannot run here: {why}. Use impl='xla'.")
    return impl


def linear_cross_entropy(
    h_NxD,
    w_DxV,
    targets_N,
    mask=None,
    *,
    z_loss: float = 0.0,
    impl: str = "auto",
    block_sizes: BlockSizes | None = None,
    interpret: bool | None = None,
    backend: str | None = None,
    w_axes: str | tuple[str, ...] = (),
    keep_gathered: bool = False,
):
    """Masked softmax cross-entropy of logits = h @ w without materialising them; same contract as the reference.

    Args:
      h_NxD: hidden states [N, D] (float32, bfloat16 or float16). Any N: rows are padded internally.
      w_DxV: output projection [D, V] of the same dtype. Any V: the vocabulary is padded and masked internally.
      targets_N: int token ids in [0, V) where the mask is non-zero (masked rows may hold anything, e.g. -1).
      mask: None (every token counts) or [N] weights (bool or float); 0 ignores a token.
      z_loss: coefficient of the z-loss term z * lse**2 added to each token's loss.
      impl: "auto" (the "xla" path for now), "pallas" (the kernels; interpret mode on CPU), "xla" (chunked jnp),
        "reference" (materialises the logits).
      block_sizes: tiles; default `BlockSizes.get_default(backend)`, shrunk for small inputs.
      interpret: None means True on CPU, else False; True runs the Pallas kernels on CPU, and
        `pltpu.InterpretParams()` runs them there with TPU semantics (the TPU layout, grid_reduction=True).
      backend: platform the kernels are built for ("cpu", "gpu", "tpu"); default `jax.default_backend()`. Set "tpu"
        to compile for TPU devices from a CPU host (AOT against a topology).
      w_axes: inside shard_map, the mesh axes w's rows are split over (FSDP); w_DxV is then this device's
        [D / n, V] shard and dw comes back as the same shard, summed over those axes. "xla" gathers one vocabulary
        block of w at a time, "pallas" and "reference" the whole of it up front.
      keep_gathered: with `w_axes` and "xla": under differentiation the forward gathers w whole once and keeps it
        for the backward (one all-gather of w instead of one per pass, for D x V of w live between the passes).

    Returns:
      (loss_sum, count): fp32 scalars, sum over tokens of mask * (lse - logit[target] + z_loss * lse**2) and
      sum(mask). Differentiable in h, w and mask (fp32 math; dh, dw in the input dtypes).

    Example:
      total, count = linear_cross_entropy(h.reshape(B * L, D), w, targets.reshape(B * L), mask.reshape(B * L))
      loss = total / jnp.maximum(count, 1.0)
    """
    w_axes = (w_axes,) if isinstance(w_axes, str) else tuple(w_axes)
    _check_inputs(h_NxD, w_DxV, targets_N, mask, z_loss, _axes_size(w_axes))
    backend = _util.resolve_backend(backend)
    which = _resolve_impl(impl, h_NxD, jax.ShapeDtypeStruct(h_NxD.shape[1:] + w_DxV.shape[1:], w_DxV.dtype), backend)
    if w_axes and which != "xla":  # its transpose, a reduce-scatter, is dw's
        w_DxV, w_axes = lax.all_gather(w_DxV, w_axes, axis=0, tiled=True), ()
    if which == "reference":
        return linear_cross_entropy_reference(h_NxD, w_DxV, targets_N, mask, z_loss=z_loss)
    interpret = _util.resolve_interpret(interpret, backend) if which == "pallas" else False
    if which == "pallas":
        _util.check_runnable(interpret, backend, "linear_cross_entropy")
    N, D = h_NxD.shape
    V = w_DxV.shape[1]
    cfg = _fit(block_sizes or BlockSizes.get_default(backend), N, D, V, which, backend, interpret,
               itemsize=jnp.dtype(h_NxD.dtype).itemsize)
    cfg = dataclasses.replace(cfg, z_loss=float(z_loss), w_axes=w_axes, keep_gathered=bool(keep_gathered))
    weight_N = jnp.ones((N,), _F32) if mask is None else mask.astype(_F32)
    h = _util.pad_axis(_util.pad_axis(h_NxD, 0, cfg.rows_pad), 1, cfg.dim_pad)
    w = w_DxV if w_axes else _util.pad_axis(_util.pad_axis(w_DxV, 0, cfg.dim_pad), 1, cfg.vocab_pad)
    t = _util.pad_axis(targets_N.astype(jnp.int32), 0, cfg.rows_pad)[:, None]
    weight = _util.pad_axis(weight_N, 0, cfg.rows_pad)
    total, count = _fused(cfg, h, w, t, weight)
    return total, count


def unavailable_reason(h_NxD, w_DxV, *, backend: str | None = None) -> str | None:
    """None if the Pallas kernels can run for these inputs on `backend` (default: JAX's), else a short reason."""
    backend = _util.resolve_backend(backend)
    if h_NxD.ndim != 2 or w_DxV.ndim != 2 or h_NxD.shape[1] != w_DxV.shape[0]:
        return f"need h [N, D] and w [D, V], got {tuple(h_NxD.shape)} and {tuple(w_DxV.shape)}"
    if jnp.dtype(h_NxD.dtype).name not in _SUPPORTED_DTYPES or h_NxD.dtype != w_DxV.dtype:
        return f"unsupported dtypes {h_NxD.dtype}/{w_DxV.dtype}; need matching float32, bfloat16 or float16"
    if backend not in ("cpu",) + _util.SUPPORTED_BACKENDS:
        return f"no Pallas lowering chosen for backend {backend!r}"
    itemsize = jnp.dtype(h_NxD.dtype).itemsize
    d_pad = _util.padded_lanes(h_NxD.shape[1], backend, False)
    if backend == "gpu" and _gpu_tile_bytes(_GPU_MIN_TILE, _GPU_MIN_TILE, d_pad, itemsize) > GPU_SHARED_MEMORY_BUDGET:
        return _gpu_too_wide(d_pad, itemsize)
    return None
