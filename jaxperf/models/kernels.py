"""The Pallas kernels behind the model's "pallas" (and "chunked" loss) implementations, placed on the mesh.

They enter the model through jaxperf.models.registry: attention.py, layers.py (norms) and gpt.py (the loss) register
them beside their XLA twins. A Pallas kernel is a custom call that GSPMD cannot split, so under a mesh (inside `activation_sharding`) each kernel
runs in a `shard_map` over the axes its operands are sharded on: the batch over the data-parallel axes, heads over
`tensor`. Without a mesh the kernel is called directly.

Every kernel is built for the `platform` it is handed: the model's settled `cfg.platform`, that of the mesh's devices,
so a TPU topology compiled on a CPU host gets Mosaic kernels, not the CPU interpreter (None, for a config never
settled: the kernel's own default, JAX's backend). What "auto" settles to per platform is jaxperf.models.platform's
table.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxperf import _compat
from pallas_kernels import cross_entropy as ce
from pallas_kernels import norms
from pallas_kernels.flash_attention import SegmentIds, as_segment_ids, flash_attention
from pallas_kernels.flash_attention import unavailable_reason as flash_unavailable_reason
from jaxperf.parallel.rules import activation_spec, current, param_spec

def _batch_axes(spec: P | None):
    return spec[0] if spec is not None and len(spec) > 0 else None


def _flat_axes(axes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def sharded(fn, in_specs, out_specs):
    """Run `fn` per shard when a mesh is active, else directly."""
    active = current()
    if active is None:
        return fn
    mesh, _ = active
    return _compat.shard_map(fn, mesh=_compat.context_mesh(mesh), in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)


# ---------------------------------------------------------------------------------------------------------------------
# Attention: registered with the model's attention dispatch as impl "pallas".


def pallas_attention(q, k, v, *, causal: bool = True, segment_ids=None, platform: str | None = None):
    q_spec = activation_spec(("batch", "seq", "heads", "head_dim"), q.shape)
    kv_spec = activation_spec(("batch", "seq", "kv_heads", "head_dim"), k.shape)
    backend = platform
    if q_spec is None:
        return flash_attention(q, k, v, causal=causal, segment_ids=segment_ids, backend=backend)
    q_spec, kv_spec = _pad_spec(q_spec, 4), _pad_spec(kv_spec, 4)
    seg_spec = P(q_spec[0], None)
    segs = as_segment_ids(segment_ids)
    if segs is None:
        fn = lambda q, k, v: flash_attention(q, k, v, causal=causal, backend=backend)  # noqa: E731
        return sharded(fn, (q_spec, kv_spec, kv_spec), q_spec)(q, k, v)
    fn = lambda q, k, v, qs, ks: flash_attention(q, k, v, causal=causal, segment_ids=SegmentIds(qs, ks),  # noqa: E731
                                                 backend=backend)
    return sharded(fn, (q_spec, kv_spec, kv_spec, seg_spec, seg_spec), q_spec)(q, k, v, *segs)


def pallas_attention_unavailable(q, k, v, *, platform: str | None = None):
    return flash_unavailable_reason(q, k, v, backend=platform)


def _pad_spec(spec: P, ndim: int) -> P:
    return P(*(tuple(spec) + (None,) * (ndim - len(spec))))


# ---------------------------------------------------------------------------------------------------------------------
# Norms


def pallas_norm(x, scale, bias, *, kind: str, eps: float, residual=None, platform: str | None = None):
    """The Pallas LayerNorm / RMSNorm over the last dim (the XLA path lives in jaxperf.models.layers.Norm); with
    `residual`, normalises x + residual and returns (normed, sum)."""
    backend = platform
    if kind == "layernorm":
        call = lambda x, s, b, r: norms.layer_norm(x, s, b, eps=eps, residual=r, backend=backend)  # noqa: E731
    else:
        call = lambda x, s, b, r: norms.rms_norm(x, s, eps=eps, residual=r, backend=backend)  # noqa: E731
    x_spec = activation_spec(("batch",) + (None,) * (x.ndim - 1), x.shape)
    if x_spec is None:
        return call(x, scale, bias, residual)
    x_spec = _pad_spec(x_spec, x.ndim)
    out_specs = (x_spec, x_spec) if residual is not None else x_spec
    args = (x, scale, bias, residual)
    specs = (x_spec, P(), None if bias is None else P(), None if residual is None else x_spec)
    keep = [i for i, a in enumerate(args) if a is not None]

    def per_shard(*present):
        full = [None] * 4
        for i, a in zip(keep, present):
            full[i] = a
        return call(*full)

    return sharded(per_shard, tuple(specs[i] for i in keep), out_specs)(*(args[i] for i in keep))


# ---------------------------------------------------------------------------------------------------------------------
# Fused linear + cross-entropy


def linear_cross_entropy(h_NxD, w_DxV, targets_N, mask_N, *, impl: str, platform: str | None = None,
                         gather_once: bool = False):
    """(sum of masked token losses, number of unmasked tokens) without [N, V] logits.

    impl "pallas": the fused Pallas kernel; "chunked": the pure-JAX path over row chunks and vocabulary blocks (one
    [chunk, block] tile live at a time, in forward and backward). Under a mesh both run per batch shard, and the sums
    are psum-ed over the data-parallel axes. w goes in as the parameter rules split its rows (FSDP's `embed`): the
    chunked path gathers one vocabulary block of it at a time and reduce-scatters that block's gradient, so neither
    the whole w nor its whole gradient is ever live on a device (`gather_once`: the forward gathers it whole and
    keeps it for the backward, one gather instead of two); the kernel gathers it whole.
    """
    backend = platform
    which = {"chunked": "xla", "pallas": "pallas"}[impl]  # the kernel module's names: "xla" is its chunked loop
    mask_N = mask_N.astype(jnp.float32)
    row = activation_spec(("batch",), (h_NxD.shape[0],))
    if row is None:
        return ce.linear_cross_entropy(h_NxD, w_DxV, targets_N, mask=mask_N, impl=which, backend=backend)
    rows = _pad_spec(row, 1)
    axes = _flat_axes(rows[0])
    w_spec = param_spec(("embed", None), w_DxV.shape)
    w_rows = _flat_axes(w_spec[0] if len(w_spec) else None)

    def per_shard(h, w, t, m):
        total, count = ce.linear_cross_entropy(h, w, t, mask=m, impl=which, backend=backend, w_axes=w_rows,
                                               keep_gathered=gather_once)
        if axes:
            total, count = jax.lax.psum(total, axes), jax.lax.psum(count, axes)
        return total, count

    fn = sharded(per_shard, (P(rows[0], None), P(w_rows or None, None), rows, rows), (P(), P()))
    return fn(h_NxD, w_DxV, targets_N, mask_N)
