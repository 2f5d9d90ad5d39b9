"""The spec: attention in pure jnp with fp32 math.

Legend: B batch, L query length, S key length, H query heads, K kv heads, G = H // K, Dh head dim.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import _util

# The lse of a query row that sees no key: a finite stand-in for log(0) (-0.7 x the float32 max, the kernels' mask
# value). Finite, so the backward (exp(s - lse) on masked entries is selected away, never inf - inf) and a logsumexp
# merge of partial results (weight exp(MASKED_ROW_LSE - lse) = 0 next to any real row, 1 between two empty ones)
# stay free of NaN.
MASKED_ROW_LSE = _util.MASK_VALUE


class SegmentIds(NamedTuple):
    """Segment ids of packed sequences: query i of row b sees key j only where q[b, i] == kv[b, j].

    q: int [B, L] for the queries; kv: int [B, S] for the keys (the same array when L == S and they are shared).
    A NamedTuple, so it is a pytree and passes through jit, shard_map and custom_vjp as its two arrays.
    """

    q: jax.Array
    kv: jax.Array


def as_segment_ids(segment_ids) -> SegmentIds | None:
    """Normalise every accepted form to a `SegmentIds` (or None).

    Accepts None, one [B, L] int array (queries and keys share it, so L == S), a (q [B, L], kv [B, S]) tuple or list,
    or a `SegmentIds`.
    """
    if segment_ids is None or isinstance(segment_ids, SegmentIds):
        return segment_ids
    if isinstance(segment_ids, (tuple, list)):
        if len(segment_ids) != 2:
            raise ValueError(
                f"segment_ids as a sequence must be a (q_seg [B, L], kv_seg [B, S]) pair, got {len(segment_ids)} "
                "items; pass SegmentIds(q=..., kv=...) or one [B, L] array shared by queries and keys"
            )
        return SegmentIds(*segment_ids)
    return SegmentIds(segment_ids, segment_ids)


def flash_attention_reference(q, k, v, *, causal=True, segment_ids=None, sm_scale=None, return_lse=False):
    """Softmax attention, the spec for `flash_attention`.

    Query i attends key j when (not causal or j <= i + S - L) and the segment ids match; the query block is aligned
    to the end of the key block. A query that sees no key at all (its segment id is in no key, or a causal row before
    the first key when S < L) outputs zeros, as in FlashAttention, and passes no gradient to q, k or v; its lse is
    `MASKED_ROW_LSE` (finite, see there).

    Args:
      q: [B, L, H, Dh]. k, v: [B, S, K, Dh] with H % K == 0 (each kv head serves H // K query heads).
      causal: causal mask.
      segment_ids: None, int32 [B, L] (needs L == S), a (q_seg [B, L], kv_seg [B, S]) tuple or a `SegmentIds`.
      sm_scale: score scale, default Dh ** -0.5.
      return_lse: also return the logsumexp of the scaled, masked scores.

    Returns:
      out [B, L, H, Dh] in q.dtype, and lse [B, H, L] float32 when return_lse (`MASKED_ROW_LSE` for a fully masked row).

    Example:
      out = flash_attention_reference(q, k, v, causal=True)
    """
    B, L, H, Dh = q.shape
    S, K = k.shape[1], k.shape[2]
    G = H // K
    scale = Dh**-0.5 if sm_scale is None else sm_scale
    q_BxLxKxGxDh = q.astype(jnp.float32).reshape(B, L, K, G, Dh)
    s_BxKxGxLxS = jnp.einsum("blkgd,bskd->bkgls", q_BxLxKxGxDh, k.astype(jnp.float32)) * scale
    mask_BxKxGxLxS = jnp.ones((1, 1, 1, L, S), dtype=bool)
    if causal:
        mask_LxS = (jnp.arange(L)[:, None] + (S - L)) >= jnp.arange(S)[None, :]
        mask_BxKxGxLxS = mask_BxKxGxLxS & mask_LxS[None, None, None]
    segs = as_segment_ids(segment_ids)
    if segs is not None:
        mask_BxKxGxLxS = mask_BxKxGxLxS & (segs.q[:, None, None, :, None] == segs.kv[:, None, None, None, :])
    s_BxKxGxLxS = jnp.where(mask_BxKxGxLxS, s_BxKxGxLxS, jnp.finfo(jnp.float32).min)
    lse_BxKxGxL = jax.nn.logsumexp(s_BxKxGxLxS, axis=-1)
    # A row with no visible key would put all its weight on masked keys: zero it. Elsewhere the masked
    # weights are exactly 0 already. Both `where`s select finite values, so their gradients stay finite.
    p_BxKxGxLxS = jnp.where(mask_BxKxGxLxS, jnp.exp(s_BxKxGxLxS - lse_BxKxGxL[..., None]), 0.0)
    lse_BxKxGxL = jnp.where(jnp.any(mask_BxKxGxLxS, axis=-1), lse_BxKxGxL, MASKED_ROW_LSE)
    out = jnp.einsum("bkgls,bskd->blkgd", p_BxKxGxLxS, v.astype(jnp.float32))
    out_BxLxHxDh = out.reshape(B, L, H, Dh).astype(q.dtype)
    if return_lse:
        return out_BxLxHxDh, lse_BxKxGxL.reshape(B, H, L)
    return out_BxLxHxDh
