"""Sequence parallelism: ring attention over a mesh axis that splits the sequence.

    out_BxLcxHxDh = ring_attention(q_BxLcxHxDh, k_BxLcxKxDh, v_BxLcxKxDh, "seq")          # inside shard_map
    out_BxLxHxDh = ring_attention_sharded(q, k, v, mesh, seq_axis="seq", batch_axes="data")  # whole arrays

With the sequence split over n devices, device i holds queries, keys and values for positions [i C, (i + 1) C) where
C = L / n. Keys and values travel around the ring: on step s device i holds the key/value block of device (i - s) mod n,
combines it into its queries' result with an online softmax (running max and sum in fp32), and passes it to device
i + 1. After n steps every query has seen every key, and no device ever holds more than two key/value blocks.

Causal masking compares global positions (block index times C plus the offset in the block). Blocks that lie wholly
in a query block's future add nothing: their scores are masked and their probabilities forced to zero, so the running
max and sum stay untouched. Their compute is not skipped: with contiguous blocks the last device needs every block, so
skipping would not shorten a ring step (a striped or zig-zag layout balances that; not done here).

Gradients come from JAX autodiff through the loop (the transpose of each ppermute sends the key/value cotangents back
around the ring); each step is rematerialised, so the backward keeps only the carries, not the [C, C] probabilities.

Legend: B batch, L length, Lc = C local length, H query heads, K kv heads, G = H / K, Dh head dim, n ring size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from jaxperf import _compat
from pallas_kernels.flash_attention import as_segment_ids
from jaxperf.parallel.rules import activation_spec, current


def _block_update(carry, kv_block, *, q_BxCxKxGxDh, q_seg_BxC, q_start, k_start, causal: bool):
    """Fold one key/value block into the running (acc, max, sum) of the online softmax."""
    acc_BxKxGxCxDh, m_BxKxGxC, l_BxKxGxC = carry
    k_BxSxKxDh, v_BxSxKxDh, kv_seg_BxS = kv_block
    C, S, Dh = q_BxCxKxGxDh.shape[1], k_BxSxKxDh.shape[1], q_BxCxKxGxDh.shape[-1]
    s_BxKxGxCxS = jnp.einsum("bckgd,bskd->bkgcs", q_BxCxKxGxDh, k_BxSxKxDh, preferred_element_type=jnp.float32)
    s_BxKxGxCxS = s_BxKxGxCxS * (Dh**-0.5)
    mask = jnp.ones((1, 1, 1, C, S), dtype=bool)
    if causal:
        q_pos_C = q_start + jnp.arange(C)
        k_pos_S = k_start + jnp.arange(S)
        mask = (q_pos_C[:, None] >= k_pos_S[None, :])[None, None, None]
    if q_seg_BxC is not None:
        mask = mask & (q_seg_BxC[:, None, None, :, None] == kv_seg_BxS[:, None, None, None, :])
    neg = jnp.finfo(jnp.float32).min  # finite: a row with nothing visible yet keeps max = min and adds exactly 0
    s_BxKxGxCxS = jnp.where(mask, s_BxKxGxCxS, neg)
    m_new = jnp.maximum(m_BxKxGxC, jnp.max(s_BxKxGxCxS, axis=-1))
    p_BxKxGxCxS = jnp.where(mask, jnp.exp(s_BxKxGxCxS - m_new[..., None]), 0.0)
    rescale = jnp.exp(m_BxKxGxC - m_new)
    l_new = l_BxKxGxC * rescale + jnp.sum(p_BxKxGxCxS, axis=-1)
    pv = jnp.einsum("bkgcs,bskd->bkgcd", p_BxKxGxCxS.astype(v_BxSxKxDh.dtype), v_BxSxKxDh,
                    preferred_element_type=jnp.float32)
    acc_new = acc_BxKxGxCxDh * rescale[..., None] + pv
    return acc_new, m_new, l_new


def ring_attention(q_BxCxHxDh, k_BxCxKxDh, v_BxCxKxDh, axis_name: str, *, causal: bool = True, segment_ids=None):
    """Attention over a sequence split along `axis_name`; call inside shard_map. Matches `xla_attention` on the whole.

    Args:
      q_BxCxHxDh: this device's query block (global positions [i C, (i + 1) C) on ring position i).
      k_BxCxKxDh, v_BxCxKxDh: this device's key and value blocks, same positions; H % K == 0 (grouped-query heads).
      axis_name: the mesh axis the sequence is split over (ring order = position along that axis).
      causal: position p attends to positions <= p (global positions).
      segment_ids: optional [B, C] ids of this device's positions (or a (q_ids, kv_ids) pair); attention stays within
        equal ids. The kv ids travel around the ring with the keys.

    Returns:
      [B, C, H, Dh] in q's dtype: this device's block of the attention output.
    """
    B, C, H, Dh = q_BxCxHxDh.shape
    K = k_BxCxKxDh.shape[2]
    if H % K:
        raise ValueError(f"query heads {H} must be a multiple of kv heads {K}")
    if k_BxCxKxDh.shape[1] != C:
        raise ValueError(f"ring attention needs equal query and key block lengths, got {C} and {k_BxCxKxDh.shape[1]}")
    G = H // K
    n = jax.lax.axis_size(axis_name)
    me = jax.lax.axis_index(axis_name)
    if segment_ids is None:
        # A dummy rider keeps the loop's structure fixed (zeros_like keeps k's per-device type for shard_map's check).
        q_seg, kv_seg = None, jnp.zeros_like(k_BxCxKxDh[:, :, 0, 0], dtype=jnp.int32)
    else:
        q_seg, kv_seg = as_segment_ids(segment_ids)
    update = jax.checkpoint(
        lambda carry, kv, k_start: _block_update(
            carry, kv, q_BxCxKxGxDh=q_BxCxHxDh.reshape(B, C, K, G, Dh), q_seg_BxC=q_seg, q_start=me * C,
            k_start=k_start, causal=causal)
    )
    to_next = [(i, (i + 1) % n) for i in range(n)]

    def step(state, s):
        carry, kv = state
        sent = jax.lax.ppermute(kv, axis_name, to_next)  # issued before the compute so the two can overlap
        carry = update(carry, kv, ((me - s) % n) * C)  # block held on step s came from ring position me - s
        return (carry, sent), None

    # Built from q so the carry varies over the same mesh axes as q (the seq axis and any batch / head axes).
    zeros_BxKxGxCxDh = jnp.zeros_like(q_BxCxHxDh, dtype=jnp.float32).reshape(B, C, K, G, Dh).transpose(0, 2, 3, 1, 4)
    carry = (zeros_BxKxGxCxDh, zeros_BxKxGxCxDh[..., 0] + jnp.finfo(jnp.float32).min, zeros_BxKxGxCxDh[..., 0])
    kv = (k_BxCxKxDh, v_BxCxKxDh, kv_seg)
    (carry, kv), _ = jax.lax.scan(step, (carry, kv), jnp.arange(n - 1))
    acc_BxKxGxCxDh, _, l_BxKxGxC = update(carry, kv, ((me - (n - 1)) % n) * C)  # the last block needs no send
    out_BxKxGxCxDh = acc_BxKxGxCxDh / jnp.maximum(l_BxKxGxC, jnp.finfo(jnp.float32).tiny)[..., None]
    return out_BxKxGxCxDh.transpose(0, 3, 1, 2, 4).reshape(B, C, H, Dh).astype(q_BxCxHxDh.dtype)


def check_ring_shapes(q, k, v, mesh: Mesh, seq_axis: str) -> None:
    """ValueError (with the numbers and the fix) unless q, k, v can be split along the sequence over `seq_axis`."""
    if seq_axis not in mesh.shape:
        raise ValueError(f"mesh axes {tuple(mesh.shape)} have no sequence axis {seq_axis!r}")
    n = mesh.shape[seq_axis]
    L, S = q.shape[1], k.shape[1]
    if k.shape != v.shape:
        raise ValueError(f"keys {k.shape} and values {v.shape} must have the same shape")
    if L != S:
        raise ValueError(f"ring attention needs equal query and key lengths, got {L=} and {S=} (no KV-cache decoding)")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads {q.shape[2]} must be a multiple of kv heads {k.shape[2]}")
    if L % n:
        raise ValueError(
            f"sequence length {L} does not split over {n} devices of mesh axis {seq_axis!r} ({L} % {n} = {L % n}): "
            f"pad the sequence to a multiple of {n} (e.g. {n * -(-L // n)}) or use a {seq_axis!r} axis size that "
            f"divides {L}"
        )


def ring_attention_sharded(q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh, mesh: Mesh, seq_axis: str = "seq", batch_axes=None,
                           causal: bool = True, segment_ids=None, head_axes=None):
    """`ring_attention` on whole arrays: shard_map over `mesh` with the sequence dim split over `seq_axis`.

    Args:
      q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh: full arrays; L must be a multiple of mesh.shape[seq_axis].
      mesh: the device mesh (a concrete Mesh or the ambient abstract mesh inside jit).
      seq_axis: mesh axis that splits the sequence.
      batch_axes: mesh axes that split the batch (data parallelism), or None (replicated).
      causal: causal mask over global positions.
      segment_ids: optional [B, L] ids (or a (q_ids, kv_ids) pair), split like the sequence.
      head_axes: mesh axes that split the heads (query and kv heads alike; both counts must divide), or None.

    Returns:
      [B, L, H, Dh], equal to `xla_attention(q, k, v, causal=causal, segment_ids=segment_ids)`.

    Example:
      mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("seq",))
      out = jax.jit(lambda q, k, v: ring_attention_sharded(q, k, v, mesh))(q, k, v)
    """
    check_ring_shapes(q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh, mesh, seq_axis)
    for what, n, axes in (("batch", q_BxLxHxDh.shape[0], batch_axes), ("kv heads", k_BxLxKxDh.shape[2], head_axes)):
        names = (axes,) if isinstance(axes, str) else tuple(axes or ())
        split = int(np.prod([mesh.shape[a] for a in names]))
        if n % split:
            raise ValueError(f"{what} {n} does not split over {split} devices of mesh axes {names}: pass axes whose "
                             f"size divides {n}, or None")
    q_spec = P(batch_axes, seq_axis, head_axes, None)
    seg_spec = P(batch_axes, seq_axis)
    fn = lambda q, k, v, seg: ring_attention(q, k, v, seq_axis, causal=causal, segment_ids=seg)  # noqa: E731
    segs = as_segment_ids(segment_ids)
    seg_args = None if segs is None else tuple(segs)
    seg_specs = None if segs is None else (seg_spec, seg_spec)
    run = _compat.shard_map(fn, mesh=mesh, in_specs=(q_spec, q_spec, q_spec, seg_specs), out_specs=q_spec)
    return run(q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh, seg_args)


# --------------------------------------------------------------------------------------------------------------------
# Attention registry entry "ring": explicit only, uses the ambient mesh's "seq" axis.

RING_AXIS = "seq"


def _ambient_mesh():
    """The mesh the model is traced under: jaxperf's activation-sharding mesh, else JAX's ambient (set_mesh) mesh."""
    active = current()
    if active is not None:
        return active[0]
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh is None or mesh.empty else mesh


def _ring_specs(mesh, q, k):
    """(batch_axes, head_axes) from jaxperf's activation rules when they are installed and usable, else (None, None)."""
    q_spec = activation_spec(("batch", "seq", "heads", "head_dim"), q.shape)
    kv_spec = activation_spec(("batch", "seq", "kv_heads", "head_dim"), k.shape)
    if q_spec is None:
        return None, None

    def at(spec, i):
        axes = spec[i] if len(spec) > i else None
        axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
        return tuple(a for a in axes if a != RING_AXIS) or None

    batch = at(q_spec, 0)
    heads = at(q_spec, 2) if at(q_spec, 2) == at(kv_spec, 2) else None  # split heads only when kv heads split alike
    return batch, heads


def ring_unavailable(q, k, v) -> str | None:
    """None when the "ring" attention impl can run on these operands, else why not."""
    mesh = _ambient_mesh()
    if mesh is None or RING_AXIS not in mesh.shape:
        return (f"ring attention needs an ambient mesh with a {RING_AXIS!r} axis (jax.set_mesh or the step's "
                f"activation sharding); found {None if mesh is None else tuple(mesh.shape)}")
    try:
        check_ring_shapes(q, k, v, mesh, RING_AXIS)
    except ValueError as e:
        return str(e)
    return None


def ring_attention_ambient(q, k, v, *, causal: bool = True, segment_ids=None):
    """The "ring" registry impl: `ring_attention_sharded` over the ambient mesh's "seq" axis."""
    mesh = _ambient_mesh()
    batch_axes, head_axes = _ring_specs(mesh, q, k)
    return ring_attention_sharded(q, k, v, mesh, RING_AXIS, batch_axes, causal, segment_ids, head_axes)
