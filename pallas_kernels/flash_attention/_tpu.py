"""The TPU flash-attention kernels: the reduced sequence axis is a sequential grid axis, so VMEM holds one tile.

The portable kernels give each program the whole other sequence axis of its head, so their VMEM grows with the
sequence length. Here the axis a kernel reduces over is the innermost grid axis with "arbitrary" (sequential)
dimension semantics: each grid step gets one (block, Dh) tile of it through its BlockSpec, Mosaic's pipeline fetches
the next tile while this one is used, and the running statistics live in VMEM scratch. They are set up at the first
step of the reduction and written to the output block, which stays resident across the reduction, at the last.

- forward: grid (B, H, q blocks, k blocks); scratch running max, sum and [bq, Dh] accumulator.
- dq: grid (B, H, q blocks, k blocks); scratch [bq, Dh] dq accumulator.
- dk/dv: grid (B, K, k blocks, G, q blocks); the G query heads of a kv head and their query blocks are both
  sequential, so GQA sums into one [bk, Dh] dk and dv accumulator without repeating k and v.

Causal masking skips the blocks past the diagonal with `pl.when`, and their index map returns the last block that
is used (or the first, walking queries), so the pipeline sees an unchanged block index and issues no copy for them.
The same kernels run on CPU under `interpret=pltpu.InterpretParams()`.

Legend: B batch, H query heads, K kv heads, G = H // K, Dh head dim, L_pad / S_pad padded query / key lengths.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import _util

from . import _common as c

_F32 = jnp.float32
_FWD_SEMANTICS = ("parallel", "parallel", "parallel", "arbitrary")
_DKV_SEMANTICS = ("parallel", "parallel", "parallel", "arbitrary", "arbitrary")
_LANES = 128


# The per-row vectors (lse, delta) live in HBM as [B, H, 1, L_pad] rows, lane-dense: as [B, H, L_pad, 1] columns, the
# TPU's (8, 128) tiling pads each row's one value to 128 lanes, and the two arrays take 128x their bytes (256 MiB at
# 2 x 4096 tokens and 32 heads, where they hold 2 MiB). The kernels use them as [bq, 1] columns beside their [bq, bk]
# tiles, so each block is turned round in VMEM: broadcast to 128 rows (lanes) and transposed (the XLU's square
# transpose; bq is a multiple of 128 on TPU). dq does it once per query block, dk/dv (whose query block changes every
# step) at each step.
def _as_row(col):
    """[bq, 1] -> [1, bq]."""
    return jnp.broadcast_to(col, (col.shape[0], _LANES)).T[:1]


def _as_col(row):
    """[1, bq] -> [bq, 1]."""
    return jnp.broadcast_to(row, (_LANES, row.shape[1])).T[:, :1]


def _fwd_kernel(*refs, cfg: c.Config):
    (q_ref, k_ref, v_ref), qs_ref, ks_ref, rest = c.split_refs(refs, 3, cfg.has_segments)
    o_ref, lse_ref, m_scratch, l_scratch, acc_scratch = rest
    bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
    qi, kj = pl.program_id(2), pl.program_id(3)

    @pl.when(kj == 0)
    def _init():
        m_scratch[...], l_scratch[...], acc_scratch[...] = c.softmax_init(bq, acc_scratch.shape[-1])

    @pl.when(kj < c.num_kv_blocks(cfg, qi, bq, bk))
    def _step():
        q_seg = qs_ref[...] if qs_ref is not None else None
        kv_seg = ks_ref[...] if ks_ref is not None else None
        carry = (m_scratch[...], l_scratch[...], acc_scratch[...])
        m, l, acc = c.softmax_step(cfg, q_ref[...], k_ref[...], v_ref[...], qi * bq, kj * bk, q_seg, kv_seg, *carry)
        m_scratch[...], l_scratch[...], acc_scratch[...] = m, l, acc

    @pl.when(kj == pl.num_programs(3) - 1)
    def _finish():
        o_ref[...], lse = c.softmax_finish(m_scratch[...], l_scratch[...], acc_scratch[...], o_ref.dtype)
        lse_ref[...] = _as_row(lse)


def _dq_kernel(*refs, cfg: c.Config):
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), qs_ref, ks_ref, rest = c.split_refs(refs, 6, cfg.has_segments)
    dq_ref, dq_scratch, lse_scratch, delta_scratch = rest
    bq, bk = cfg.blocks.block_q_dq, cfg.blocks.block_k_dq
    qi, kj = pl.program_id(2), pl.program_id(3)

    @pl.when(kj == 0)
    def _init():
        dq_scratch[...] = jnp.zeros(dq_scratch.shape, _F32)
        # the query block's rows stay put while the key blocks go by: turned into columns once
        lse_scratch[...], delta_scratch[...] = _as_col(lse_ref[...]), _as_col(delta_ref[...])

    @pl.when(kj < c.num_kv_blocks(cfg, qi, bq, bk))
    def _step():
        k = k_ref[...]
        q_seg = qs_ref[...] if qs_ref is not None else None
        kv_seg = ks_ref[...] if ks_ref is not None else None
        _, ds = c.probs_and_dscores(
            cfg, q_ref[...], k, v_ref[...], do_ref[...], lse_scratch[...], delta_scratch[...], qi * bq, kj * bk, q_seg,
            kv_seg,
        )
        dq_scratch[...] += c.dot(ds.astype(k.dtype), k)

    @pl.when(kj == pl.num_programs(3) - 1)
    def _finish():
        dq_ref[...] = (dq_scratch[...] * cfg.sm_scale).astype(dq_ref.dtype)


def _dkv_kernel(*refs, cfg: c.Config):
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), qs_ref, ks_ref, rest = c.split_refs(refs, 6, cfg.has_segments)
    dk_ref, dv_ref, dk_scratch, dv_scratch = rest
    bq, bk = cfg.blocks.block_q_dkv, cfg.blocks.block_k_dkv
    kj, g, qi = pl.program_id(2), pl.program_id(3), pl.program_id(4)

    @pl.when((g == 0) & (qi == 0))
    def _init():
        dk_scratch[...] = jnp.zeros(dk_scratch.shape, _F32)
        dv_scratch[...] = jnp.zeros(dv_scratch.shape, _F32)

    @pl.when((qi >= c.first_q_block(cfg, kj, bq, bk)) & (qi < c.num_q_blocks(cfg, bq)))
    def _step():
        q, do = q_ref[...], do_ref[...]
        q_seg = qs_ref[...] if qs_ref is not None else None
        kv_seg = ks_ref[...] if ks_ref is not None else None
        p, ds = c.probs_and_dscores(
            cfg, q, k_ref[...], v_ref[...], do, _as_col(lse_ref[...]), _as_col(delta_ref[...]), qi * bq, kj * bk, q_seg,
            kv_seg,
        )
        dv_scratch[...] += c.dot_tn(p.astype(do.dtype), do)
        dk_scratch[...] += c.dot_tn(ds.astype(q.dtype), q)

    @pl.when((g == pl.num_programs(3) - 1) & (qi == pl.num_programs(4) - 1))
    def _finish():
        dk_ref[...] = (dk_scratch[...] * cfg.sm_scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_scratch[...].astype(dv_ref.dtype)


# ----------------------------------------------------------------------------------------------------------------
# pallas_call wrappers on padded [B, H, L_pad, Dh] / [B, K, S_pad, Dh] arrays; q_seg [B, L_pad, 1], kv_seg
# [B, 1, S_pad]. Every BlockSpec is one tile: nothing in VMEM depends on L or S.


def _call(cfg: c.Config, kernel, grid, in_specs, out_specs, out_shape, scratch_shapes, semantics, name):
    return _util.pallas_call(
        functools.partial(kernel, cfg=cfg),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=0,
            grid=grid,
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=scratch_shapes,
        ),
        out_shape=out_shape,
        compiler_params=c.compiler_params(cfg, semantics),
        interpret=cfg.interpret,
        name=name,
    )


def _walk_keys_specs(cfg: c.Config, G: int, Dh: int, bq: int, bk: int):
    """BlockSpecs on grid (b, h, i, j) of a kernel that walks key blocks j for query block i: [bq, Dh] query-side
    tiles, [bk, Dh] key/value tiles, [1, bq] per-row vectors, and the segment-id tiles (none without segments).

    The key-side index is clamped to the last key block the query block sees: the causally skipped steps keep the
    block already in VMEM, so the pipeline copies nothing for them."""

    def kv_block(i, j):
        return jnp.minimum(j, c.num_kv_blocks(cfg, i, bq, bk) - 1)

    q_spec = pl.BlockSpec((None, None, bq, Dh), lambda b, h, i, j: (b, h, i, 0))
    kv_spec = pl.BlockSpec((None, None, bk, Dh), lambda b, h, i, j: (b, lax.div(h, G), kv_block(i, j), 0))
    row_spec = pl.BlockSpec((None, None, 1, bq), lambda b, h, i, j: (b, h, 0, i))
    seg_specs = [
        pl.BlockSpec((None, bq, 1), lambda b, h, i, j: (b, i, 0)),
        pl.BlockSpec((None, 1, bk), lambda b, h, i, j: (b, 0, kv_block(i, j))),
    ]
    return q_spec, kv_spec, row_spec, (seg_specs if cfg.has_segments else [])


def fwd_call(cfg: c.Config, q, k, v, q_seg, kv_seg):
    B, H, L_pad, Dh = q.shape
    K, S_pad = k.shape[1], k.shape[2]
    bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
    q_spec, kv_spec, row_spec, seg_specs = _walk_keys_specs(cfg, H // K, Dh, bq, bk)
    call = _call(
        cfg,
        _fwd_kernel,
        grid=(B, H, L_pad // bq, S_pad // bk),
        in_specs=[q_spec, kv_spec, kv_spec] + seg_specs,
        out_specs=[q_spec, row_spec],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((B, H, 1, L_pad), _F32)],
        scratch_shapes=[pltpu.VMEM((bq, 1), _F32), pltpu.VMEM((bq, 1), _F32), pltpu.VMEM((bq, Dh), _F32)],
        semantics=_FWD_SEMANTICS,
        name="flash_attention_fwd",
    )
    seg_args = [q_seg, kv_seg] if cfg.has_segments else []
    out, lse = call(q, k, v, *seg_args)
    return out, lse[:, :, 0]


def bwd_call(cfg: c.Config, q, k, v, q_seg, kv_seg, do, lse, delta):
    B, H, L_pad, Dh = q.shape
    K, S_pad = k.shape[1], k.shape[2]
    G = H // K
    seg_args = [q_seg, kv_seg] if cfg.has_segments else []
    lse, delta = lse[:, :, None], delta[:, :, None]  # [B, H, 1, L_pad] rows

    bq, bk = cfg.blocks.block_q_dq, cfg.blocks.block_k_dq
    q_spec, kv_spec, row_spec, seg_specs = _walk_keys_specs(cfg, G, Dh, bq, bk)
    dq = _call(
        cfg,
        _dq_kernel,
        grid=(B, H, L_pad // bq, S_pad // bk),
        in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec] + seg_specs,
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        scratch_shapes=[pltpu.VMEM((bq, Dh), _F32), pltpu.VMEM((bq, 1), _F32), pltpu.VMEM((bq, 1), _F32)],
        semantics=_FWD_SEMANTICS,
        name="flash_attention_dq",
    )(q, k, v, do, lse, delta, *seg_args)

    # Grid (b, kv head, key block j, query head g of the group, query block i): walks (g, i) for key block j.
    bq, bk = cfg.blocks.block_q_dkv, cfg.blocks.block_k_dkv

    def q_block(j, i):
        lo = c.first_q_block(cfg, j, bq, bk)
        hi = c.num_q_blocks(cfg, bq)
        return jnp.minimum(jnp.maximum(i, lo), hi - 1)

    qg_spec = pl.BlockSpec((None, None, bq, Dh), lambda b, kh, j, g, i: (b, kh * G + g, q_block(j, i), 0))
    rowg_spec = pl.BlockSpec((None, None, 1, bq), lambda b, kh, j, g, i: (b, kh * G + g, 0, q_block(j, i)))
    kblk_spec = pl.BlockSpec((None, None, bk, Dh), lambda b, kh, j, g, i: (b, kh, j, 0))
    seg_specs = [
        pl.BlockSpec((None, bq, 1), lambda b, kh, j, g, i: (b, q_block(j, i), 0)),
        pl.BlockSpec((None, 1, bk), lambda b, kh, j, g, i: (b, 0, j)),
    ]
    dk, dv = _call(
        cfg,
        _dkv_kernel,
        grid=(B, K, S_pad // bk, G, L_pad // bq),
        in_specs=[qg_spec, kblk_spec, kblk_spec, qg_spec, rowg_spec, rowg_spec]
        + (seg_specs if cfg.has_segments else []),
        out_specs=[kblk_spec, kblk_spec],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        scratch_shapes=[pltpu.VMEM((bk, Dh), _F32), pltpu.VMEM((bk, Dh), _F32)],
        semantics=_DKV_SEMANTICS,
        name="flash_attention_dkv",
    )(q, k, v, do, lse, delta, *seg_args)
    return dq, dk, dv
