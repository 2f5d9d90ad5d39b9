"""The portable flash-attention kernels: fully parallel grids, the other sequence axis walked by an in-kernel loop.

The Triton lowering has no sequential grid axes, so each program holds the whole other sequence axis of its head in
its block ([S_pad, Dh] keys and values for the forward and dq kernels, [G, L_pad, Dh] queries for the dk/dv kernel)
and loops over it with `fori_loop`. The same bodies run in plain interpret mode on CPU and lower to Triton on GPUs.
Under causal masking the loop bounds skip the fully masked blocks, so causal attention costs about half.

Legend: B batch, H query heads, K kv heads, G = H // K, Dh head dim, L_pad / S_pad padded query / key lengths.
Refs are rank 2 (batch and head dims are squeezed), except the dk/dv kernel's [G, L_pad, ..] refs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _util

from . import _common as c


def _fwd_kernel(*refs, cfg: c.Config):
    (q_ref, k_ref, v_ref), qs_ref, ks_ref, (o_ref, lse_ref) = c.split_refs(refs, 3, cfg.has_segments)
    bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
    qi = pl.program_id(2)
    q = q_ref[...]
    q_seg = qs_ref[...] if qs_ref is not None else None

    def body(j, carry):
        col0 = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(col0, bk), :]
        v = v_ref[pl.ds(col0, bk), :]
        kv_seg = ks_ref[:, pl.ds(col0, bk)] if ks_ref is not None else None
        return c.softmax_step(cfg, q, k, v, qi * bq, col0, q_seg, kv_seg, *carry)

    init = c.softmax_init(bq, q.shape[-1])
    m, l, acc = lax.fori_loop(0, c.num_kv_blocks(cfg, qi, bq, bk), body, init)
    o_ref[...], lse_ref[...] = c.softmax_finish(m, l, acc, o_ref.dtype)


def _dq_kernel(*refs, cfg: c.Config):
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), qs_ref, ks_ref, (dq_ref,) = c.split_refs(
        refs, 6, cfg.has_segments
    )
    bq, bk = cfg.blocks.block_q_dq, cfg.blocks.block_k_dq
    qi = pl.program_id(2)
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    q_seg = qs_ref[...] if qs_ref is not None else None

    def body(j, dq):
        col0 = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(col0, bk), :]
        v = v_ref[pl.ds(col0, bk), :]
        kv_seg = ks_ref[:, pl.ds(col0, bk)] if ks_ref is not None else None
        _, ds = c.probs_and_dscores(cfg, q, k, v, do, lse, delta, qi * bq, col0, q_seg, kv_seg)
        return dq + c.dot(ds.astype(k.dtype), k)

    dq = lax.fori_loop(0, c.num_kv_blocks(cfg, qi, bq, bk), body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * cfg.sm_scale).astype(dq_ref.dtype)


def _dkv_kernel(*refs, cfg: c.Config, group: int):
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), qs_ref, ks_ref, (dk_ref, dv_ref) = c.split_refs(
        refs, 6, cfg.has_segments
    )
    bq, bk = cfg.blocks.block_q_dkv, cfg.blocks.block_k_dkv
    ki = pl.program_id(2)
    k, v = k_ref[...], v_ref[...]
    kv_seg = ks_ref[...] if ks_ref is not None else None
    lo = c.first_q_block(cfg, ki, bq, bk)
    hi = c.num_q_blocks(cfg, bq)

    # The G query heads of this kv head are summed here, so repeated k/v never exist and dk/dv are written once.
    def head_body(g, carry):
        def body(i, carry):
            dk, dv = carry
            row0 = pl.multiple_of(i * bq, bq)
            q = q_ref[g, pl.ds(row0, bq), :]
            do = do_ref[g, pl.ds(row0, bq), :]
            lse = lse_ref[g, pl.ds(row0, bq), :]
            delta = delta_ref[g, pl.ds(row0, bq), :]
            q_seg = qs_ref[pl.ds(row0, bq), :] if qs_ref is not None else None
            p, ds = c.probs_and_dscores(cfg, q, k, v, do, lse, delta, row0, ki * bk, q_seg, kv_seg)
            dv = dv + c.dot_tn(p.astype(do.dtype), do)
            dk = dk + c.dot_tn(ds.astype(q.dtype), q)
            return dk, dv

        return lax.fori_loop(lo, hi, body, carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, group, head_body, (zeros, zeros))
    dk_ref[...] = (dk * cfg.sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# ----------------------------------------------------------------------------------------------------------------
# pallas_call wrappers on padded [B, H, L_pad, Dh] / [B, K, S_pad, Dh] arrays; q_seg [B, L_pad, 1], kv_seg
# [B, 1, S_pad].


def fwd_call(cfg: c.Config, q, k, v, q_seg, kv_seg):
    B, H, L_pad, Dh = q.shape
    K, S_pad = k.shape[1], k.shape[2]
    G = H // K
    bq = cfg.blocks.block_q
    in_specs = [
        pl.BlockSpec((None, None, bq, Dh), lambda b, h, i: (b, h, i, 0)),
        pl.BlockSpec((None, None, S_pad, Dh), lambda b, h, i: (b, lax.div(h, G), 0, 0)),
        pl.BlockSpec((None, None, S_pad, Dh), lambda b, h, i: (b, lax.div(h, G), 0, 0)),
    ]
    args = [q, k, v]
    if cfg.has_segments:
        in_specs += [
            pl.BlockSpec((None, bq, 1), lambda b, h, i: (b, i, 0)),
            pl.BlockSpec((None, 1, S_pad), lambda b, h, i: (b, 0, 0)),
        ]
        args += [q_seg, kv_seg]
    out, lse = _util.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg),
        grid=(B, H, L_pad // bq),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, bq, Dh), lambda b, h, i: (b, h, i, 0)),
            pl.BlockSpec((None, None, bq, 1), lambda b, h, i: (b, h, i, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((B, H, L_pad, 1), jnp.float32),
        ],
        compiler_params=c.compiler_params(cfg, ("parallel",) * 3),
        interpret=cfg.interpret,
        name="flash_attention_fwd",
    )(*args)
    return out, lse[..., 0]


def bwd_call(cfg: c.Config, q, k, v, q_seg, kv_seg, do, lse, delta):
    B, H, L_pad, Dh = q.shape
    K, S_pad = k.shape[1], k.shape[2]
    G = H // K
    seg_args = [q_seg, kv_seg] if cfg.has_segments else []
    lse, delta = lse[..., None], delta[..., None]  # [B, H, L_pad, 1] columns

    bq = cfg.blocks.block_q_dq
    row_spec = pl.BlockSpec((None, None, bq, 1), lambda b, h, i: (b, h, i, 0))
    q_spec = pl.BlockSpec((None, None, bq, Dh), lambda b, h, i: (b, h, i, 0))
    kv_spec = pl.BlockSpec((None, None, S_pad, Dh), lambda b, h, i: (b, lax.div(h, G), 0, 0))
    seg_specs = [
        pl.BlockSpec((None, bq, 1), lambda b, h, i: (b, i, 0)),
        pl.BlockSpec((None, 1, S_pad), lambda b, h, i: (b, 0, 0)),
    ]
    dq = _util.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg),
        grid=(B, H, L_pad // bq),
        in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec] + (seg_specs if cfg.has_segments else []),
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=c.compiler_params(cfg, ("parallel",) * 3),
        interpret=cfg.interpret,
        name="flash_attention_dq",
    )(q, k, v, do, lse, delta, *seg_args)

    bk = cfg.blocks.block_k_dkv
    # One program per (batch, kv head, key block); it reads the whole query range of its G query heads.
    qg_spec = pl.BlockSpec((None, G, L_pad, Dh), lambda b, kh, j: (b, kh, 0, 0))
    rowg_spec = pl.BlockSpec((None, G, L_pad, 1), lambda b, kh, j: (b, kh, 0, 0))
    kblk_spec = pl.BlockSpec((None, None, bk, Dh), lambda b, kh, j: (b, kh, j, 0))
    seg_specs = [
        pl.BlockSpec((None, L_pad, 1), lambda b, kh, j: (b, 0, 0)),
        pl.BlockSpec((None, 1, bk), lambda b, kh, j: (b, 0, j)),
    ]
    dk, dv = _util.pallas_call(
        functools.partial(_dkv_kernel, cfg=cfg, group=G),
        grid=(B, K, S_pad // bk),
        in_specs=[qg_spec, kblk_spec, kblk_spec, qg_spec, rowg_spec, rowg_spec]
        + (seg_specs if cfg.has_segments else []),
        out_specs=[kblk_spec, kblk_spec],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=c.compiler_params(cfg, ("parallel",) * 3),
        interpret=cfg.interpret,
        name="flash_attention_dkv",
    )(q, k, v, do, lse, delta, *seg_args)
    return dq, dk, dv
