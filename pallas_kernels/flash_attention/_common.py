"""What the portable and the TPU flash-attention kernels share: tiles, static config, masks, block bounds, and the
per-tile maths (the online-softmax step of the forward, the recomputed probabilities of the backward).

Legend: B batch, L query length, S key length, H query heads, K kv heads, G = H // K query heads per kv head,
Dh head dim; bq / bk are the query / key rows of one tile; a `_pad` suffix is a length padded to a block multiple.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _util


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes. Lengths are padded up to a multiple of the largest q (k) block; the others must divide it."""

    block_q: int  # forward: query rows per program
    block_k: int  # forward: keys per step (inner loop, or the sequential grid axis on TPU)
    block_q_dq: int  # dq kernel: query rows per program
    block_k_dq: int  # dq kernel: keys per step
    block_q_dkv: int  # dk/dv kernel: query rows per step
    block_k_dkv: int  # dk/dv kernel: keys per program

    @classmethod
    def get_default(cls, backend: str | None = None) -> "BlockSizes":
        """Defaults per backend: "cpu" (interpret mode), "gpu" (Triton), "tpu" (Mosaic). None: the default backend."""
        backend = _util.resolve_backend(backend)
        if backend == "tpu":
            return cls(block_q=128, block_k=128, block_q_dq=128, block_k_dq=128, block_q_dkv=128, block_k_dkv=128)
        if backend == "gpu":
            return cls(block_q=64, block_k=64, block_q_dq=64, block_k_dq=64, block_q_dkv=64, block_k_dkv=64)
        # Interpret mode pays per grid step and per loop step: big tiles are faster on CPU.
        return cls(block_q=128, block_k=128, block_q_dq=128, block_k_dq=128, block_q_dkv=128, block_k_dkv=128)


@dataclasses.dataclass(frozen=True)
class Config:
    """Static facts shared by the forward and backward kernels (hashable: it rides in nondiff_argnums)."""

    causal: bool
    sm_scale: float
    q_len: int
    kv_len: int
    q_len_pad: int
    kv_len_pad: int
    blocks: BlockSizes
    interpret: object  # bool, or pltpu.InterpretParams (the TPU interpreter)
    backend: str
    backward: str
    has_segments: bool

    @property
    def streams_kv(self) -> bool:
        """The TPU kernels (sequential grid axes, VMEM scratch) instead of the portable in-kernel loops: when
        compiling for TPU, and under the TPU interpreter, which runs the same kernels on CPU."""
        return self.backend == "tpu" or _util.is_tpu_interpret(self.interpret)


def compiler_params(cfg: Config, dimension_semantics: tuple[str, ...]):
    return _util.compiler_params(cfg.backend, cfg.interpret, dimension_semantics, num_warps=4, num_stages=2)


def mask(cfg: Config, row0, col0, shape, q_seg, kv_seg):
    """Boolean [bq, bk] mask for the query block starting at row0 and key block at col0, or None if nothing masks."""
    out = None

    def conj(a, b):
        return b if a is None else a & b

    if cfg.causal or cfg.kv_len_pad != cfg.kv_len:
        cols = col0 + lax.broadcasted_iota(jnp.int32, shape, 1)
        if cfg.causal:
            rows = row0 + lax.broadcasted_iota(jnp.int32, shape, 0)
            out = conj(out, rows + (cfg.kv_len - cfg.q_len) >= cols)
        if cfg.kv_len_pad != cfg.kv_len:
            out = conj(out, cols < cfg.kv_len)
    if q_seg is not None:
        out = conj(out, q_seg == kv_seg)  # [bq, 1] == [1, bk]
    return out


def num_kv_blocks(cfg: Config, q_block_idx, block_q: int, block_k: int):
    """Key blocks the query block sees: those holding real keys, and under causal masking only those up to its last
    row's diagonal. Blocks from this index on are skipped."""
    n = pl.cdiv(cfg.kv_len, block_k)
    if not cfg.causal:
        return n
    last_col = (q_block_idx + 1) * block_q - 1 + (cfg.kv_len - cfg.q_len)
    return jnp.minimum(n, lax.div(last_col, block_k) + 1)


def first_q_block(cfg: Config, kv_block_idx, block_q: int, block_k: int):
    """First query block that sees the key block (causal), else 0."""
    if not cfg.causal:
        return 0
    first_row = kv_block_idx * block_k - (cfg.kv_len - cfg.q_len)
    return jnp.maximum(0, lax.div(jnp.maximum(first_row, 0), block_q))


def num_q_blocks(cfg: Config, block_q: int) -> int:
    """Query blocks holding real queries: blocks of padding alone add nothing to dk, dv and are skipped."""
    return pl.cdiv(cfg.q_len, block_q)


def dot_nt(a, b):  # a [m, d] @ b[n, d]^T -> [m, n] fp32
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def dot_tn(a, b):  # a[m, n]^T @ b[m, d] -> [n, d] fp32
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def dot(a, b):  # a[m, n] @ b[n, d] -> [m, d] fp32
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def softmax_init(block_q: int, head_dim: int):
    """Running max m [bq, 1], sum l [bq, 1] and accumulator acc [bq, Dh] before the first key block."""
    return (
        jnp.full((block_q, 1), -jnp.inf, jnp.float32),
        jnp.zeros((block_q, 1), jnp.float32),
        jnp.zeros((block_q, head_dim), jnp.float32),
    )


def softmax_step(cfg: Config, q, k, v, row0, col0, q_seg, kv_seg, m, l, acc):
    """One key block of the online softmax: fold the [bq, bk] tile of scores into (m, l, acc), rescaling what was
    accumulated under the old running max by exp(m_old - m_new)."""
    bq, bk = q.shape[0], k.shape[0]
    s = dot_nt(q, k) * cfg.sm_scale
    tile_mask = mask(cfg, row0, col0, (bq, bk), q_seg, kv_seg)
    if tile_mask is not None:
        s = jnp.where(tile_mask, s, _util.MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new)
    l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
    acc = alpha * acc + dot(p.astype(v.dtype), v)
    return m_new, l, acc


def softmax_finish(m, l, acc, out_dtype):
    """(out [bq, Dh], lse [bq, 1]) from the running statistics after the last key block.

    A row that saw no visible key ends with its running max at MASK_VALUE (any visible score is above it; -inf if it
    saw no block) and its sums over masked keys: it outputs zeros and lse = MASK_VALUE instead (FlashAttention's
    rule; the reference's `MASKED_ROW_LSE`). The backward masks its p to 0, so it adds nothing to dq, dk, dv."""
    visible = m > _util.MASK_VALUE
    l = jnp.where(visible, l, 1.0)
    out = jnp.where(visible, acc / l, 0.0)
    return out.astype(out_dtype), jnp.where(visible, m + jnp.log(l), _util.MASK_VALUE)


def probs_and_dscores(cfg: Config, q, k, v, do, lse, delta, row0, col0, q_seg, kv_seg):
    """Recompute p = exp(s - lse) and ds = p * (do v^T - delta) for one [bq, bk] tile (ds without sm_scale)."""
    shape = (q.shape[0], k.shape[0])
    s = dot_nt(q, k) * cfg.sm_scale
    p = jnp.exp(s - lse)
    tile_mask = mask(cfg, row0, col0, shape, q_seg, kv_seg)
    if cfg.q_len_pad != cfg.q_len:  # padded queries must not leak into dk, dv
        rows = row0 + lax.broadcasted_iota(jnp.int32, shape, 0)
        tile_mask = rows < cfg.q_len if tile_mask is None else tile_mask & (rows < cfg.q_len)
    if tile_mask is not None:
        p = jnp.where(tile_mask, p, 0.0)
    dp = dot_nt(do, v)
    return p, p * (dp - delta)


def split_refs(refs, n_inputs: int, has_segments: bool):
    """(inputs, q_seg_ref | None, kv_seg_ref | None, rest): the segment refs follow the `n_inputs` input refs."""
    inputs = refs[:n_inputs]
    if has_segments:
        return inputs, refs[n_inputs], refs[n_inputs + 1], refs[n_inputs + 2 :]
    return inputs, None, None, refs[n_inputs:]

