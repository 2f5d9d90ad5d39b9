"""Flash attention in Pallas: forward, dq and dk/dv kernels, a custom_vjp and the public wrapper.

Legend: B batch, L query length, S key length, H query heads, K kv heads, G = H // K query heads per kv head,
Dh head dim; a `_pad` suffix is a length padded up to a block multiple.

Portable shape: every kernel is a `pl.pallas_call` over a fully parallel grid with BlockSpecs, and walks the other
sequence axis with an in-kernel `fori_loop` (the Triton lowering has no sequential grid axes). So one kernel body runs
in interpret mode on CPU, lowers to Mosaic on TPU, and to Triton on NVIDIA GPUs. Under causal masking the loop bounds
skip the blocks that are fully masked, so causal attention costs about half. Internally we work in [B, H, L, Dh].
Per-row vectors (lse, delta, query segment ids) carry a trailing unit dim, [.., L, 1], and key segment ids a leading
one, [B, 1, S], so every block is rank 2 in the kernel and TPU's (8, 128)-or-full tiling rule holds.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _util

from .reference import SegmentIds, as_segment_ids, flash_attention_reference
_SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
_COMPILED_HEAD_DIMS = (64, 128, 256)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes. Lengths are padded up to a multiple of the largest q (k) block; the others must divide it."""

    block_q: int  # forward: query rows per program
    block_k: int  # forward: keys per inner-loop step
    block_q_dq: int  # dq kernel: query rows per program
    block_k_dq: int  # dq kernel: keys per inner-loop step
    block_q_dkv: int  # dk/dv kernel: query rows per inner-loop step
    block_k_dkv: int  # dk/dv kernel: keys per program

    @classmethod
    def get_default(cls, backend: str | None = None) -> "BlockSizes":
        """Defaults per backend: "cpu" (interpret mode), "gpu" (Triton), "tpu" (Mosaic). None: the default backend."""
        backend = backend or jax.default_backend()
        if backend == "tpu":
            return cls(block_q=128, block_k=128, block_q_dq=128, block_k_dq=128, block_q_dkv=128, block_k_dkv=128)
        if backend == "gpu":
            return cls(block_q=64, block_k=64, block_q_dq=64, block_k_dq=64, block_q_dkv=64, block_k_dkv=64)
        # Interpret mode pays per grid step and per loop step: big tiles are faster on CPU.
        return cls(block_q=128, block_k=128, block_q_dq=128, block_k_dq=128, block_q_dkv=128, block_k_dkv=128)


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static facts shared by the forward and backward kernels (hashable: it rides in nondiff_argnums)."""

    causal: bool
    sm_scale: float
    q_len: int
    kv_len: int
    q_len_pad: int
    kv_len_pad: int
    blocks: BlockSizes
    interpret: object
    backend: str
    backward: str
    has_segments: bool


def _fit_blocks(blocks: BlockSizes, q_len: int, kv_len: int, backend: str):
    """Shrink blocks to short sequences, check them, and return (blocks, q_len_pad, kv_len_pad)."""
    # TPU slices key blocks along lanes (key segment ids), so keep them >= 128; elsewhere 16 is the floor.
    q_floor, k_floor = (8, 128) if backend == "tpu" else (16, 16)
    q_cap = max(q_floor, _util.next_pow2(q_len))
    k_cap = max(k_floor, _util.next_pow2(kv_len))
    sizes = dataclasses.asdict(blocks)
    for name, size in sizes.items():
        if not isinstance(size, int) or size <= 0:
            raise ValueError(f"BlockSizes.{name}={size!r} must be a positive int")
        if backend == "gpu" and size & (size - 1):
            raise ValueError(f"BlockSizes.{name}={size} must be a power of two for the Triton lowering")
        if backend == "tpu" and size % (128 if "_k" in name else 8):
            raise ValueError(f"BlockSizes.{name}={size} must be a multiple of {128 if '_k' in name else 8} on TPU")
    sizes = {n: min(s, q_cap if "_q" in n else k_cap) for n, s in sizes.items()}
    q_blocks = [sizes["block_q"], sizes["block_q_dq"], sizes["block_q_dkv"]]
    k_blocks = [sizes["block_k"], sizes["block_k_dq"], sizes["block_k_dkv"]]
    q_len_pad = _util.round_up(q_len, max(q_blocks))
    kv_len_pad = _util.round_up(kv_len, max(k_blocks))
    for name in sizes:
        padded, which = (q_len_pad, "query") if "_q" in name else (kv_len_pad, "key")
        if padded % sizes[name]:
            raise ValueError(
                f"BlockSizes.{name}={sizes[name]} must divide the padded {which} length {padded} "
                f"(the length padded to the largest {which} block); use block sizes that divide each other"
            )
    return BlockSizes(**sizes), q_len_pad, kv_len_pad


def _compiler_params(cfg: _Config, dimension_semantics: tuple[str, ...]):
    return _util.compiler_params(cfg.backend, cfg.interpret, dimension_semantics, num_warps=4, num_stages=2)


# ----------------------------------------------------------------------------------------------------------------
# Kernel bodies. Refs are rank 2 (batch and head dims are squeezed), except the dk/dv kernel's [G, L_pad, ..] refs.


def _mask(cfg: _Config, row0, col0, shape, q_seg, kv_seg):
    """Boolean [bq, bk] mask for the query block starting at row0 and key block at col0, or None if nothing masks."""
    mask = None

    def conj(a, b):
        return b if a is None else a & b

    if cfg.causal or cfg.kv_len_pad != cfg.kv_len or cfg.q_len_pad != cfg.q_len:
        cols = col0 + lax.broadcasted_iota(jnp.int32, shape, 1)
        if cfg.causal:
            rows = row0 + lax.broadcasted_iota(jnp.int32, shape, 0)
            mask = conj(mask, rows + (cfg.kv_len - cfg.q_len) >= cols)
        if cfg.kv_len_pad != cfg.kv_len:
            mask = conj(mask, cols < cfg.kv_len)
    if q_seg is not None:
        mask = conj(mask, q_seg == kv_seg)  # [bq, 1] == [1, bk]
    return mask


def _num_kv_blocks(cfg: _Config, q_block_idx, block_q: int, block_k: int):
    """Key blocks the query block sees: all of them, or under causal masking those up to its last row's diagonal."""
    n = cfg.kv_len_pad // block_k
    if not cfg.causal:
        return n
    last_col = (q_block_idx + 1) * block_q - 1 + (cfg.kv_len - cfg.q_len)
    return jnp.minimum(n, lax.div(last_col, block_k) + 1)


def _first_q_block(cfg: _Config, kv_block_idx, block_q: int, block_k: int):
    """First query block that sees the key block (causal), else 0."""
    if not cfg.causal:
        return 0
    first_row = kv_block_idx * block_k - (cfg.kv_len - cfg.q_len)
    return jnp.maximum(0, lax.div(jnp.maximum(first_row, 0), block_q))


def _dot_nt(a, b):  # a [m, d] @ b[n, d]^T -> [m, n] fp32
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _dot_tn(a, b):  # a[m, n]^T @ b[m, d] -> [n, d] fp32
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _dot(a, b):  # a[m, n] @ b[n, d] -> [m, d] fp32
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _fwd_kernel(*refs, cfg: _Config):
    if cfg.has_segments:
        q_ref, k_ref, v_ref, qs_ref, ks_ref, o_ref, lse_ref = refs
    else:
        (q_ref, k_ref, v_ref, o_ref, lse_ref), qs_ref, ks_ref = refs, None, None
    bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
    qi = pl.program_id(2)
    q = q_ref[...]
    q_seg = qs_ref[...] if qs_ref is not None else None

    def body(j, carry):
        m, l, acc = carry
        col0 = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(col0, bk), :]
        v = v_ref[pl.ds(col0, bk), :]
        s = _dot_nt(q, k) * cfg.sm_scale
        kv_seg = ks_ref[:, pl.ds(col0, bk)] if ks_ref is not None else None
        mask = _mask(cfg, qi * bq, col0, (bq, bk), q_seg, kv_seg)
        if mask is not None:
            s = jnp.where(mask, s, _util.MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new)
        l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
        acc = alpha * acc + _dot(p.astype(v.dtype), v)
        return m_new, l, acc

    dh = q.shape[-1]
    init = (
        jnp.full((bq, 1), -jnp.inf, jnp.float32),
        jnp.zeros((bq, 1), jnp.float32),
        jnp.zeros((bq, dh), jnp.float32),
    )
    m, l, acc = lax.fori_loop(0, _num_kv_blocks(cfg, qi, bq, bk), body, init)
    l = jnp.where(l == 0.0, 1.0, l)  # only rows that saw no block at all
    o_ref[...] = (acc / l).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l)


def _probs_and_dscores(cfg, q, k, v, do, lse, delta, row0, col0, q_seg, kv_seg, shape):
    """Recompute p = exp(s - lse) and ds = p * (do v^T - delta) for one [bq, bk] tile (ds without sm_scale)."""
    s = _dot_nt(q, k) * cfg.sm_scale
    p = jnp.exp(s - lse)
    mask = _mask(cfg, row0, col0, shape, q_seg, kv_seg)
    if cfg.q_len_pad != cfg.q_len:  # padded queries must not leak into dk, dv
        rows = row0 + lax.broadcasted_iota(jnp.int32, shape, 0)
        mask = rows < cfg.q_len if mask is None else mask & (rows < cfg.q_len)
    if mask is not None:
        p = jnp.where(mask, p, 0.0)
    dp = _dot_nt(do, v)
    return p, p * (dp - delta)


def _dq_kernel(*refs, cfg: _Config):
    if cfg.has_segments:
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qs_ref, ks_ref, dq_ref = refs
    else:
        (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref), qs_ref, ks_ref = refs, None, None
    bq, bk = cfg.blocks.block_q_dq, cfg.blocks.block_k_dq
    qi = pl.program_id(2)
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    q_seg = qs_ref[...] if qs_ref is not None else None

    def body(j, dq):
        col0 = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(col0, bk), :]
        v = v_ref[pl.ds(col0, bk), :]
        kv_seg = ks_ref[:, pl.ds(col0, bk)] if ks_ref is not None else None
        _, ds = _probs_and_dscores(cfg, q, k, v, do, lse, delta, qi * bq, col0, q_seg, kv_seg, (bq, bk))
        return dq + _dot(ds.astype(k.dtype), k)

    dq = lax.fori_loop(0, _num_kv_blocks(cfg, qi, bq, bk), body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * cfg.sm_scale).astype(dq_ref.dtype)


def _dkv_kernel(*refs, cfg: _Config, group: int):
    if cfg.has_segments:
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qs_ref, ks_ref, dk_ref, dv_ref = refs
    else:
        (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref), qs_ref, ks_ref = refs, None, None
    bq, bk = cfg.blocks.block_q_dkv, cfg.blocks.block_k_dkv
    ki = pl.program_id(2)
    k, v = k_ref[...], v_ref[...]
    kv_seg = ks_ref[...] if ks_ref is not None else None
    lo = _first_q_block(cfg, ki, bq, bk)
    hi = cfg.q_len_pad // bq

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
            p, ds = _probs_and_dscores(cfg, q, k, v, do, lse, delta, row0, ki * bk, q_seg, kv_seg, (bq, bk))
            dv = dv + _dot_tn(p.astype(do.dtype), do)
            dk = dk + _dot_tn(ds.astype(q.dtype), q)
            return dk, dv

        return lax.fori_loop(lo, hi, body, carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, group, head_body, (zeros, zeros))
    dk_ref[...] = (dk * cfg.sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# ----------------------------------------------------------------------------------------------------------------
# pallas_call wrappers on padded [B, H, L_pad, Dh] / [B, K, S_pad, Dh] arrays.


def _fwd_call(cfg: _Config, q, k, v, q_seg, kv_seg):
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
    out, lse = pl.pallas_call(
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
        compiler_params=_compiler_params(cfg, ("parallel",) * 3),
        interpret=cfg.interpret,
        name="flash_attention_fwd",
    )(*args)
    return out, lse


def _bwd_call(cfg: _Config, q, k, v, q_seg, kv_seg, do, lse, delta):
    B, H, L_pad, Dh = q.shape
    K, S_pad = k.shape[1], k.shape[2]
    G = H // K
    seg_args = [q_seg, kv_seg] if cfg.has_segments else []

    bq = cfg.blocks.block_q_dq
    row_spec = pl.BlockSpec((None, None, bq, 1), lambda b, h, i: (b, h, i, 0))
    q_spec = pl.BlockSpec((None, None, bq, Dh), lambda b, h, i: (b, h, i, 0))
    kv_spec = pl.BlockSpec((None, None, S_pad, Dh), lambda b, h, i: (b, lax.div(h, G), 0, 0))
    seg_specs = [
        pl.BlockSpec((None, bq, 1), lambda b, h, i: (b, i, 0)),
        pl.BlockSpec((None, 1, S_pad), lambda b, h, i: (b, 0, 0)),
    ]
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg),
        grid=(B, H, L_pad // bq),
        in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec] + (seg_specs if cfg.has_segments else []),
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_compiler_params(cfg, ("parallel",) * 3),
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
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, cfg=cfg, group=G),
        grid=(B, K, S_pad // bk),
        in_specs=[qg_spec, kblk_spec, kblk_spec, qg_spec, rowg_spec, rowg_spec]
        + (seg_specs if cfg.has_segments else []),
        out_specs=[kblk_spec, kblk_spec],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=_compiler_params(cfg, ("parallel",) * 3),
        interpret=cfg.interpret,
        name="flash_attention_dkv",
    )(q, k, v, do, lse, delta, *seg_args)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------------------------
# custom_vjp on the model's [B, L, H, Dh] layout.


def _to_kernel_layout(cfg: _Config, q, k, v, segs: SegmentIds | None):
    """[B, L, H, Dh] -> padded [B, H, L_pad, Dh]; segment ids -> q_seg [B, L_pad, 1] and kv_seg [B, 1, S_pad]."""
    dl, ds = cfg.q_len_pad - cfg.q_len, cfg.kv_len_pad - cfg.kv_len
    q = jnp.pad(jnp.swapaxes(q, 1, 2), ((0, 0), (0, 0), (0, dl), (0, 0)))
    k = jnp.pad(jnp.swapaxes(k, 1, 2), ((0, 0), (0, 0), (0, ds), (0, 0)))
    v = jnp.pad(jnp.swapaxes(v, 1, 2), ((0, 0), (0, 0), (0, ds), (0, 0)))
    q_seg = kv_seg = None
    if segs is not None:
        q_seg = jnp.pad(segs.q.astype(jnp.int32), ((0, 0), (0, dl)))[:, :, None]
        kv_seg = jnp.pad(segs.kv.astype(jnp.int32), ((0, 0), (0, ds)))[:, None, :]
    return q, k, v, q_seg, kv_seg


def _forward(cfg: _Config, q, k, v, segs: SegmentIds | None):
    qt, kt, vt, qs, ks = _to_kernel_layout(cfg, q, k, v, segs)
    out_pad, lse_pad = _fwd_call(cfg, qt, kt, vt, qs, ks)
    out = jnp.swapaxes(out_pad[:, :, : cfg.q_len], 1, 2)
    lse = lse_pad[:, :, : cfg.q_len, 0]
    return (out, lse), (qt, kt, vt, qs, ks, out_pad, lse_pad)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg: _Config, q, k, v, segs: SegmentIds | None):
    return _forward(cfg, q, k, v, segs)[0]


def _flash_fwd(cfg: _Config, q, k, v, segs: SegmentIds | None):
    outs, residuals = _forward(cfg, q, k, v, segs)
    if cfg.backward == "reference":
        residuals = (q, k, v, segs)
    return outs, residuals


def _flash_bwd(cfg: _Config, residuals, cotangents):
    d_out, d_lse = cotangents
    if cfg.backward == "reference":
        q, k, v, segs = residuals
        fn = functools.partial(
            flash_attention_reference, causal=cfg.causal, segment_ids=segs, sm_scale=cfg.sm_scale, return_lse=True
        )
        _, vjp = jax.vjp(fn, q, k, v)
        return (*vjp((d_out, d_lse)), None)
    qt, kt, vt, qs, ks, out_pad, lse_pad = residuals
    pad = ((0, 0), (0, 0), (0, cfg.q_len_pad - cfg.q_len), (0, 0))
    do = jnp.pad(jnp.swapaxes(d_out, 1, 2), pad).astype(qt.dtype)
    # d lse / d s = p, so a cotangent on lse just shifts delta: ds = p * (dp - (delta - d_lse)).
    delta = jnp.sum(out_pad.astype(jnp.float32) * do.astype(jnp.float32), axis=-1, keepdims=True)
    delta = delta - jnp.pad(d_lse.astype(jnp.float32)[..., None], pad)
    dq, dk, dv = _bwd_call(cfg, qt, kt, vt, qs, ks, do, lse_pad, delta)
    dq = jnp.swapaxes(dq[:, :, : cfg.q_len], 1, 2)
    dk = jnp.swapaxes(dk[:, :, : cfg.kv_len], 1, 2)
    dv = jnp.swapaxes(dv[:, :, : cfg.kv_len], 1, 2)
    return dq, dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# ----------------------------------------------------------------------------------------------------------------
# Public API.


def _check_inputs(q, k, v, segs: SegmentIds | None, causal: bool):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be rank 4 [B, L, H, Dh] / [B, S, K, Dh]; got {q.shape=} {k.shape=} {v.shape=}")
    B, L, H, Dh = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes must match: {k.shape=} {v.shape=}")
    Bk, S, K, Dk = k.shape
    if Bk != B:
        raise ValueError(f"batch sizes differ: q has {B}, k/v have {Bk}")
    if Dk != Dh:
        raise ValueError(f"head dims differ: q has {Dh}, k/v have {Dk}")
    if H % K:
        raise ValueError(f"query heads {H} must be a multiple of kv heads {K}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"dtype {q.dtype} is not supported; use float32, bfloat16 or float16")
    if causal and S < L:
        raise ValueError(f"causal attention needs kv length >= query length, got {S=} < {L=}")
    if segs is not None:
        if segs.q.shape != (B, L) or segs.kv.shape != (B, S):
            raise ValueError(
                f"segment ids must be [B, L] = {(B, L)} for queries and [B, S] = {(B, S)} for keys; "
                f"got {tuple(segs.q.shape)} and {tuple(segs.kv.shape)}"
                + ("" if L == S else " (with L != S pass SegmentIds(q=..., kv=...) or a (q_seg, kv_seg) pair)")
            )
        if not jnp.issubdtype(segs.q.dtype, jnp.integer) or not jnp.issubdtype(segs.kv.dtype, jnp.integer):
            raise ValueError(f"segment ids must be integers, got {segs.q.dtype} and {segs.kv.dtype}")


def flash_attention(
    q,
    k,
    v,
    *,
    causal=True,
    segment_ids=None,
    sm_scale=None,
    block_sizes: BlockSizes | None = None,
    interpret=None,
    return_lse=False,
    backward="pallas",
    backend: str | None = None,
):
    """Flash attention with Pallas forward and backward kernels; same contract as `flash_attention_reference`.

    Args:
      q: [B, L, H, Dh]. k, v: [B, S, K, Dh] with H % K == 0 (GQA/MQA without repeating k/v).
      causal: causal mask, the query block aligned to the end of the keys (needs S >= L).
      segment_ids: None, int [B, L] (needs L == S), a (q_seg [B, L], kv_seg [B, S]) pair or a `SegmentIds`;
        query i sees key j only where their ids are equal.
      sm_scale: score scale, default Dh ** -0.5.
      block_sizes: tiles; default `BlockSizes.get_default(backend)`, shrunk for short sequences.
      interpret: None means True on CPU, else False; True or a `pltpu.InterpretParams()` runs the kernel on CPU.
      return_lse: also return lse [B, H, L] float32 (differentiable).
      backward: "pallas" (dq and dk/dv kernels) or "reference" (the reference's VJP, to test the backward alone).
      backend: platform the kernel is built for ("cpu", "gpu", "tpu"); default `jax.default_backend()`. Set "tpu"
        to compile for TPU devices from a CPU host (AOT against a topology).

    Returns:
      out [B, L, H, Dh] in q.dtype, and lse [B, H, L] float32 if return_lse.

    Example:
      out = flash_attention(q, k, v, causal=True)  # q [2, 1024, 8, 128] bf16, k/v [2, 1024, 2, 128]
    """
    if backward not in ("pallas", "reference"):
        raise ValueError(f"backward must be 'pallas' or 'reference', got {backward!r}")
    segs = as_segment_ids(segment_ids)
    _check_inputs(q, k, v, segs, causal)
    backend = _util.resolve_backend(backend)
    interpret = _util.resolve_interpret(interpret, backend)
    B, L, H, Dh = q.shape
    S = k.shape[1]
    if not interpret and Dh not in _COMPILED_HEAD_DIMS:
        raise ValueError(f"head dim {Dh} is not supported when compiled; use one of {_COMPILED_HEAD_DIMS}")
    blocks, L_pad, S_pad = _fit_blocks(block_sizes or BlockSizes.get_default(backend), L, S, backend)
    cfg = _Config(
        causal=bool(causal),
        sm_scale=float(Dh**-0.5 if sm_scale is None else sm_scale),
        q_len=L,
        kv_len=S,
        q_len_pad=L_pad,
        kv_len_pad=S_pad,
        blocks=blocks,
        interpret=interpret,
        backend=backend,
        backward=backward,
        has_segments=segs is not None,
    )
    out, lse = _flash(cfg, q, k, v, segs)
    return (out, lse) if return_lse else out


def unavailable_reason(q, k, v) -> str | None:
    """None if `flash_attention` can run for these inputs on the default backend, else a short reason."""
    backend = jax.default_backend()
    if q.dtype not in _SUPPORTED_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"unsupported dtypes {q.dtype}/{k.dtype}/{v.dtype}; need float32, bfloat16 or float16 for all three"
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        return f"need q [B, L, H, Dh] and k, v [B, S, K, Dh], got {q.shape}, {k.shape}, {v.shape}"
    if q.shape[-1] != k.shape[-1]:
        return f"head dims differ: {q.shape[-1]} vs {k.shape[-1]}"
    if q.shape[2] % k.shape[2]:
        return f"query heads {q.shape[2]} not a multiple of kv heads {k.shape[2]}"
    if backend not in ("cpu", "gpu", "tpu"):
        return f"no Pallas lowering chosen for backend {backend!r}"
    if backend != "cpu" and q.shape[-1] not in _COMPILED_HEAD_DIMS:
        return f"head dim {q.shape[-1]} not in {_COMPILED_HEAD_DIMS}"
    if q.shape[1] > k.shape[1]:
        return f"query length {q.shape[1]} > kv length {k.shape[1]} (causal alignment needs S >= L)"
    return None
