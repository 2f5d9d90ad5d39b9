"""Sequence parallelism: ring attention over a mesh axis that splits the sequence.

    out_BxLcxHxDh = ring_attention(q_BxLcxHxDh, k_BxLcxKxDh, v_BxLcxKxDh, "seq")          # inside shard_map
    out_BxLxHxDh = ring_attention_sharded(q, k, v, mesh, seq_axis="seq", batch_axes="data")  # whole arrays

With the sequence split over n devices, device i holds queries, keys and values for positions [i C, (i + 1) C) where
C = L / n. Keys and values travel around the ring: on step s device i holds the key/value block of device (i - s) mod n,
combines it into its queries' result with an online softmax (running max and sum in fp32), and passes it to device
i + 1. After n steps every query has seen every key, and no device ever holds more than two key/value blocks.

Causal masking works on chunks of the sequence: a (query chunk, key chunk) pair wholly in the future is skipped, the
same chunk gets a causal mask, a chunk wholly in the past needs none. With contiguous blocks the last device computes
n chunk pairs and the first one, so the ring is as slow as its busiest device; the zigzag layout gives device i
chunks i and 2n - 1 - i of 2n (one from each end of the sequence), and every device computes 2n + 1 chunk pairs.

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


def _block_update(carry, kv_block, *, q_BxCxKxGxDh, q_seg_BxC, mode):
    """Fold one key/value chunk into the running (acc, max, sum) of the online softmax of one query chunk.

    `mode`: 0 the keys lie wholly in the queries' future (nothing to add), 1 the same chunk (causal mask inside it),
    2 the keys lie wholly in the past (or attention is not causal: no position mask)."""
    acc_BxKxGxCxDh, m_BxKxGxC, l_BxKxGxC = carry
    k_BxSxKxDh, v_BxSxKxDh, kv_seg_BxS = kv_block
    C, S, Dh = q_BxCxKxGxDh.shape[1], k_BxSxKxDh.shape[1], q_BxCxKxGxDh.shape[-1]

    def add(causal_diagonal: bool):
        s_BxKxGxCxS = jnp.einsum("bckgd,bskd->bkgcs", q_BxCxKxGxDh, k_BxSxKxDh, preferred_element_type=jnp.float32)
        s_BxKxGxCxS = s_BxKxGxCxS * (Dh**-0.5)
        mask = jnp.ones((1, 1, 1, C, S), dtype=bool)
        if causal_diagonal:
            mask = (jnp.arange(C)[:, None] >= jnp.arange(S)[None, :])[None, None, None]
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
        return acc_BxKxGxCxDh * rescale[..., None] + pv, m_new, l_new

    return jax.lax.switch(mode, (lambda: carry, lambda: add(True), lambda: add(False)))


LAYOUTS = ("contiguous", "zigzag")


def chunk_ids(layout: str, n: int, device):
    """The global sequence chunks a device of an n-device ring holds, in its local order: [device] (contiguous: L
    split into n chunks), or [device, 2n - 1 - device] (zigzag: 2n chunks, one from each end, so that every device
    has the same causal work)."""
    if layout == "zigzag":
        return (device, 2 * n - 1 - device)
    if layout == "contiguous":
        return (device,)
    raise ValueError(f"unknown context layout {layout!r}; choose one of {', '.join(LAYOUTS)}")


def zigzag_order(length: int, n: int) -> np.ndarray:
    """The token order that puts, after a contiguous split into n blocks, chunks (d, 2n - 1 - d) on device d: a
    permutation of range(length) (length must be a multiple of 2n)."""
    if length % (2 * n):
        raise ValueError(f"sequence length {length} does not split into 2 x {n} = {2 * n} equal chunks for the zigzag "
                         f"layout: use a length that is a multiple of {2 * n}")
    c = length // (2 * n)
    return np.concatenate([np.arange(a * c, (a + 1) * c) for d in range(n) for a in (d, 2 * n - 1 - d)])


def ring_attention(q_BxCxHxDh, k_BxCxKxDh, v_BxCxKxDh, axis_name: str, *, causal: bool = True, segment_ids=None,
                   layout: str = "contiguous", return_work: bool = False, index=None):
    """Attention over a sequence split along `axis_name`; call inside shard_map. Matches `xla_attention` on the whole
    sequence (in the layout's token order).

    Args:
      q_BxCxHxDh: this device's query block: global chunks `chunk_ids(layout, n, i)` on ring position i.
      k_BxCxKxDh, v_BxCxKxDh: this device's key and value blocks, same positions; H % K == 0 (grouped-query heads).
      axis_name: the mesh axis the sequence is split over (ring order = position along that axis).
      causal: position p attends to positions <= p (global positions).
      segment_ids: optional [B, C] ids of this device's positions (or a (q_ids, kv_ids) pair); attention stays within
        equal ids. The kv ids travel around the ring with the keys.
      layout: "contiguous" (device i holds positions [i C, (i + 1) C)) or "zigzag" (device i holds chunks i and
        2n - 1 - i of 2n; `zigzag_order` is the token order that gives it). Chunk pairs wholly in the future are
        skipped, so with zigzag every device computes the same number of chunk pairs under a causal mask.
      return_work: also return the number of (query chunk, key chunk) pairs this device computed.
      index: this device's ring position (default `lax.axis_index`; `ring_attention_sharded` passes it as data, which
        also holds inside a region where only some mesh axes are manual).

    Returns:
      [B, C, H, Dh] in q's dtype: this device's block of the attention output (and the work count).
    """
    B, C, H, Dh = q_BxCxHxDh.shape
    K = k_BxCxKxDh.shape[2]
    if H % K:
        raise ValueError(f"query heads {H} must be a multiple of kv heads {K}")
    if k_BxCxKxDh.shape[1] != C:
        raise ValueError(f"ring attention needs equal query and key block lengths, got {C} and {k_BxCxKxDh.shape[1]}")
    n_chunks = len(chunk_ids(layout, 1, 0))
    if C % n_chunks:
        raise ValueError(f"the local block of {C} positions does not split into {n_chunks} chunks for the {layout} "
                         f"layout: use a sequence length that is a multiple of {n_chunks} x the ring size")
    G, c = H // K, C // n_chunks
    n = jax.lax.axis_size(axis_name)
    me = jax.lax.axis_index(axis_name) if index is None else index
    if segment_ids is None:
        # A dummy rider keeps the loop's structure fixed (zeros_like keeps k's per-device type for shard_map's check).
        q_seg, kv_seg = None, jnp.zeros_like(k_BxCxKxDh[:, :, 0, 0], dtype=jnp.int32)
    else:
        q_seg, kv_seg = as_segment_ids(segment_ids)
    q_BxCxKxGxDh = q_BxCxHxDh.reshape(B, C, K, G, Dh)
    mine = chunk_ids(layout, n, me)

    def fold(state, kv, src):
        """Fold the key/value block of ring position `src` into every query chunk."""
        carries, work = state
        k_all, v_all, seg_all = kv
        theirs = chunk_ids(layout, n, src)
        new = []
        for a, qa in enumerate(mine):
            carry = carries[a]
            for b, kb in enumerate(theirs):
                mode = jnp.where(kb == qa, 1, jnp.where(kb < qa, 2, 0)) if causal else jnp.asarray(2)
                block = (k_all[:, b * c:(b + 1) * c], v_all[:, b * c:(b + 1) * c], seg_all[:, b * c:(b + 1) * c])
                carry = _block_update(carry, block, q_BxCxKxGxDh=q_BxCxKxGxDh[:, a * c:(a + 1) * c],
                                      q_seg_BxC=None if q_seg is None else q_seg[:, a * c:(a + 1) * c], mode=mode)
                work = work + (mode > 0).astype(jnp.int32)
            new.append(carry)
        return tuple(new), work

    update = jax.checkpoint(fold)
    to_next = [(i, (i + 1) % n) for i in range(n)]

    def step(state, s):
        acc, kv = state
        # Issued before the compute so the two can overlap. One ppermute per array: a single call on the tuple lowers
        # to one variadic collective-permute, which XLA:CPU splits into ops sharing one channel id and then deadlocks
        # on when the surrounding program has other collectives (seen with fsdp x stage x seq, contiguous layout).
        sent = tuple(jax.lax.ppermute(a, axis_name, to_next) for a in kv)
        acc = update(acc, kv, (me - s) % n)  # the block held on step s came from ring position me - s
        return (acc, sent), None

    # Built from q so the carry varies over the same mesh axes as q (the seq axis and any batch / head axes).
    zeros_BxKxGxcxDh = jnp.zeros_like(q_BxCxKxGxDh[:, :c], dtype=jnp.float32).transpose(0, 2, 3, 1, 4)
    one = (zeros_BxKxGxcxDh, zeros_BxKxGxcxDh[..., 0] + jnp.finfo(jnp.float32).min, zeros_BxKxGxcxDh[..., 0])
    work0 = jnp.zeros_like(kv_seg[0, 0])
    state = ((one,) * n_chunks, work0)
    kv = (k_BxCxKxDh, v_BxCxKxDh, kv_seg)
    (state, kv), _ = jax.lax.scan(step, (state, kv), jnp.arange(n - 1))
    carries, work = update(state, kv, (me - (n - 1)) % n)  # the last block needs no send
    outs = []
    for acc_BxKxGxcxDh, _, l_BxKxGxc in carries:
        # A row that saw no key has l = 0 and acc = 0: it outputs zeros, like `xla_attention`. Dividing it by 1, not
        # by a tiny floor, keeps its gradient (do / l) finite; every other row has l >= 1.
        o = acc_BxKxGxcxDh / jnp.where(l_BxKxGxc > 0, l_BxKxGxc, 1.0)[..., None]
        outs.append(o.transpose(0, 3, 1, 2, 4).reshape(B, c, H, Dh))
    out = jnp.concatenate(outs, axis=1).astype(q_BxCxHxDh.dtype)
    return (out, work) if return_work else out


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
                           causal: bool = True, segment_ids=None, head_axes=None, layout: str = "contiguous"):
    """`ring_attention` on whole arrays: shard_map over `mesh` with the sequence dim split over `seq_axis`.

    Args:
      q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh: full arrays; L must be a multiple of mesh.shape[seq_axis].
      mesh: the device mesh (a concrete Mesh or the ambient abstract mesh inside jit).
      seq_axis: mesh axis that splits the sequence.
      batch_axes: mesh axes that split the batch (data parallelism), or None (replicated).
      causal: causal mask over global positions.
      segment_ids: optional [B, L] ids (or a (q_ids, kv_ids) pair), split like the sequence.
      head_axes: mesh axes that split the heads (query and kv heads alike; both counts must divide), or None.
      layout: "contiguous" or "zigzag" (the arrays are then in `zigzag_order`: see `ring_attention`).

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
    fn = lambda q, k, v, seg, i: ring_attention(q, k, v, seq_axis, causal=causal, segment_ids=seg,  # noqa: E731
                                                layout=layout, index=i[0])
    segs = as_segment_ids(segment_ids)
    seg_args = None if segs is None else tuple(segs)
    seg_specs = None if segs is None else (seg_spec, seg_spec)
    run = _compat.shard_map(fn, mesh=_compat.context_mesh(mesh),
                            in_specs=(q_spec, q_spec, q_spec, seg_specs, P(seq_axis)), out_specs=q_spec)
    return run(q_BxLxHxDh, k_BxLxKxDh, v_BxLxKxDh, seg_args, jnp.arange(mesh.shape[seq_axis], dtype=jnp.int32))


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


def ring_attention_ambient(q, k, v, *, causal: bool = True, segment_ids=None, layout: str = "contiguous"):
    """The "ring" registry impl: `ring_attention_sharded` over the ambient mesh's "seq" axis."""
    problem = ring_unavailable(q, k, v)
    if problem:
        raise ValueError(problem)
    mesh = _ambient_mesh()
    batch_axes, head_axes = _ring_specs(mesh, q, k)
    return ring_attention_sharded(q, k, v, mesh, RING_AXIS, batch_axes, causal, segment_ids, head_axes, layout)
