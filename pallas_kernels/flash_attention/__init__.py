"""Flash attention: a Pallas kernel (forward + backward) for [B, L, H, Dh] inputs, GQA/MQA, causal and segment masks.

    out = flash_attention(q_BxLxHxDh, k_BxSxKxDh, v_BxSxKxDh, causal=True, segment_ids=None)

`segment_ids` is None, one [B, L] array, a (q, kv) pair or a `SegmentIds`; `as_segment_ids` normalises them.

A query that sees no key outputs zeros, with lse `MASKED_ROW_LSE`.

`flash_attention_reference` is the pure-jnp spec; `unavailable_reason` says why the kernel cannot run here (or None).
"""

from .kernel import BlockSizes, flash_attention, unavailable_reason
from .reference import MASKED_ROW_LSE, SegmentIds, as_segment_ids, flash_attention_reference

__all__ = [
    "BlockSizes",
    "MASKED_ROW_LSE",
    "SegmentIds",
    "as_segment_ids",
    "flash_attention",
    "flash_attention_reference",
    "unavailable_reason",
]
