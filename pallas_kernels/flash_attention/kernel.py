"""Flash attention in Pallas: the custom_vjp over the forward, dq and dk/dv kernels, and the public wrapper.

Two kernel sets share one contract and the per-tile maths (`_common`):
- `_portable`: fully parallel grids whose programs walk the other sequence axis with an in-kernel `fori_loop`
  (Triton has no sequential grid axes). Used on GPUs (Triton) and in plain interpret mode on CPU.
- `_tpu`: the reduced sequence axis is a sequential grid axis and the running statistics sit in VMEM scratch, so
  VMEM holds one tile per operand whatever the sequence length. Used for backend "tpu" and under
  `interpret=pltpu.InterpretParams()`.

Internally we work in [B, H, L, Dh]. lse and delta pass between the kernel sets' calls as [B, H, L_pad]; in the
kernels, per-row vectors are rank-2 blocks so that TPU's (8, 128)-or-full tiling rule holds: the portable kernels take
[.., L, 1] columns, the TPU kernels lane-dense [B, H, 1, L] rows (a column pads each value to 128 lanes in HBM;
`_tpu`). Query segment ids are [B, L, 1] and key segment ids [B, 1, S].

Legend: B batch, L query length, S key length, H query heads, K kv heads, G = H // K query heads per kv head,
Dh head dim; a `_pad` suffix is a length padded up to a block multiple.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _util

from . import _portable
from ._common import BlockSizes, Config
from .reference import SegmentIds, as_segment_ids, flash_attention_reference

_SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
_COMPILED_HEAD_DIMS = (64, 128, 256)


def _fit_blocks(blocks: BlockSizes, q_len: int, kv_len: int, backend: str):
    """Shrink blocks to short sequences, check them, and return (blocks, q_len_pad, kv_len_pad)."""
    # TPU slices key blocks (key segment ids) and query blocks (the lse and delta rows) along lanes, so keeps them
    # multiples of 128; elsewhere 16 is the floor.
    floor = 128 if backend == "tpu" else 16
    q_cap = max(floor, _util.next_pow2(q_len))
    k_cap = max(floor, _util.next_pow2(kv_len))
    sizes = dataclasses.asdict(blocks)
    for name, size in sizes.items():
        if not isinstance(size, int) or size <= 0:
            raise ValueError(f"BlockSizes.{name}={size!r} must be a positive int")
        if backend == "gpu" and size & (size - 1):
            raise ValueError(
                f"BlockSizes.{name}={size} must be a power of two for the Triton lowering; use {_util.next_pow2(size)}"
            )
        if backend == "tpu" and size % 128:
            raise ValueError(f"BlockSizes.{name}={size} must be a multiple of 128 on TPU; use {_util.round_up(size, 128)}")
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


def _kernels(cfg: Config):
    """The module whose fwd_call / bwd_call run this configuration (see the module docstring)."""
    if cfg.streams_kv:
        from . import _tpu  # imports the Mosaic TPU Pallas module, which only this path needs

        return _tpu
    return _portable


# ----------------------------------------------------------------------------------------------------------------
# custom_vjp on the model's [B, L, H, Dh] layout.


def _to_kernel_layout(cfg: Config, q, k, v, segs: SegmentIds | None):
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


def _forward(cfg: Config, q, k, v, segs: SegmentIds | None):
    qt, kt, vt, qs, ks = _to_kernel_layout(cfg, q, k, v, segs)
    out_pad, lse_pad = _kernels(cfg).fwd_call(cfg, qt, kt, vt, qs, ks)
    out = jnp.swapaxes(out_pad[:, :, : cfg.q_len], 1, 2)
    lse = lse_pad[:, :, : cfg.q_len]
    return (out, lse), (qt, kt, vt, qs, ks, out_pad, lse_pad)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg: Config, q, k, v, segs: SegmentIds | None):
    return _forward(cfg, q, k, v, segs)[0]


def _flash_fwd(cfg: Config, q, k, v, segs: SegmentIds | None):
    outs, residuals = _forward(cfg, q, k, v, segs)
    if cfg.backward == "reference":
        residuals = (q, k, v, segs)
    return outs, residuals


def _flash_bwd(cfg: Config, residuals, cotangents):
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
    delta = jnp.sum(out_pad.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
    delta = delta - jnp.pad(d_lse.astype(jnp.float32), pad[:3])
    dq, dk, dv = _kernels(cfg).bwd_call(cfg, qt, kt, vt, qs, ks, do, lse_pad, delta)
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

    A query that sees no key (its segment id is in no key) outputs zeros, as in FlashAttention, with lse
    `MASKED_ROW_LSE`, and adds nothing to dq, dk or dv.

    Args:
      q: [B, L, H, Dh]. k, v: [B, S, K, Dh] with H % K == 0 (GQA/MQA without repeating k/v).
      causal: causal mask, the query block aligned to the end of the keys (needs S >= L).
      segment_ids: None, int [B, L] (needs L == S), a (q_seg [B, L], kv_seg [B, S]) pair or a `SegmentIds`;
        query i sees key j only where their ids are equal.
      sm_scale: score scale, default Dh ** -0.5.
      block_sizes: tiles; default `BlockSizes.get_default(backend)`, shrunk for short sequences.
      interpret: None means True on CPU, else False. True runs the portable kernels on CPU; `pltpu.InterpretParams()`
        runs the TPU kernels (sequential grid axes, VMEM scratch) on CPU with the TPU interpreter.
      return_lse: also return lse [B, H, L] float32 (differentiable).
      backward: "pallas" (dq and dk/dv kernels) or "reference" (the reference's VJP, to test the backward alone).
      backend: platform the kernel is built for ("cpu", "gpu", "tpu"); default `jax.default_backend()`. Set "tpu"
        to compile for TPU devices from a CPU host (AOT against a topology).

    Returns:
      out [B, L, H, Dh] in q.dtype, and lse [B, H, L] float32 if return_lse (`MASKED_ROW_LSE` for a fully masked
      query).

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
    cfg = Config(
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


def unavailable_reason(q, k, v, *, backend: str | None = None) -> str | None:
    """None if `flash_attention` can run for these inputs on `backend` (default: JAX's), else a short reason."""
    backend = _util.resolve_backend(backend)
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
