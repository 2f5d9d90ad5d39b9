"""Collective matmuls for tensor parallelism: the gather (or scatter) of one operand split into ring steps, each
overlapped with the matmul of a block that is already here.

    y = all_gather_matmul(x_LxD, w_DxF, "tensor")        # inside shard_map: gather rows of x while multiplying
    y = matmul_reduce_scatter(x_LxD, w_DxF, "tensor")    # a row-parallel matmul summed and split back over rows

They equal the plain `all_gather` + matmul (or matmul + `psum_scatter`) and are what sequence-parallel tensor
parallelism uses to hide its communication behind the matmuls. Run inside `shard_map` over the named axis.

Legend: N devices on the axis, L rows per device (sequence or batch), D contracted dim, F output features per device.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxperf import _compat


def axis_size(axis_name) -> int:
    """Number of devices along `axis_name`, as a Python int (inside shard_map)."""
    if hasattr(lax, "axis_size"):
        return int(lax.axis_size(axis_name))
    return int(lax.psum(1, axis_name))  # pragma: no cover - older jax: psum of a constant is folded to an int


def ring_shift(x, axis_name, n: int, step: int):
    """Every device i sends `x` to device (i + step) mod n (and receives from (i - step) mod n)."""
    return lax.ppermute(x, axis_name, perm=[(j, (j + step) % n) for j in range(n)])


def _matmul(x_LxD, w_DxF):
    """x @ w contracting x's last dim with w's first (x may have more dims; no broadcasting)."""
    return jnp.tensordot(x_LxD, w_DxF, axes=1)


def all_gather_matmul(x_LxD, w_DxF, axis_name, *, axis: int = 0, index=None):
    """`all_gather(x, tiled, along axis) @ w` without waiting for the whole gather first.

    Tensor parallelism with sequence-sharded activations: each device holds L rows of x and a column block of w
    (D x F). The plain way gathers all N*L rows, then multiplies. Here the rows travel around the ring one block per
    step, and each step multiplies the block that has arrived while sending it on: N matmuls of L rows and N-1
    ppermutes, the transfer of step s+1's block independent of step s's matmul, so a scheduler can overlap them.

    Args:
      x_LxD: this device's rows, shape (..., L, ..., D) with the gathered dim at `axis` (not the last).
      w_DxF: this device's weight block, (D, F).
      axis_name: the mesh axis x is sharded over.
      axis: x's gathered dim.
      index: this device's position on the axis (default `lax.axis_index`; pass it as data where only some mesh axes
        are manual, since the partitioner cannot place a partition-id there).
    Returns:
      (..., N*L, ..., F): x gathered along `axis` in device order, times w_DxF.
    """
    axis = axis % x_LxD.ndim
    if axis == x_LxD.ndim - 1:
        raise ValueError(f"all_gather_matmul: the gathered axis ({axis}) cannot be x's contracted last dim")
    n = axis_size(axis_name)
    if n == 1:
        return _matmul(x_LxD, w_DxF)
    i = lax.axis_index(axis_name) if index is None else index
    rows = x_LxD.shape[axis]
    block_LxD, out_NLxF = x_LxD, None
    for s in range(n):
        # Send the block on before multiplying it: the next block's transfer does not wait for this matmul.
        nxt_LxD = ring_shift(block_LxD, axis_name, n, 1) if s < n - 1 else None
        y_LxF = _matmul(block_LxD, w_DxF)  # rows of device (i - s)
        if out_NLxF is None:
            shape = y_LxF.shape[:axis] + (n * rows,) + y_LxF.shape[axis + 1:]
            out_NLxF = jnp.zeros(shape, y_LxF.dtype)
        out_NLxF = lax.dynamic_update_slice_in_dim(out_NLxF, y_LxF, jnp.mod(i - s, n) * rows, axis)
        block_LxD = nxt_LxD
    return out_NLxF


def matmul_reduce_scatter(x_LxD, w_DxF, axis_name, *, axis: int = 0, index=None):
    """`psum_scatter(x @ w, tiled, along axis)` with the partial products computed one block per ring step.

    The dual of `all_gather_matmul`: x's contracted dim D and w's rows are sharded (a row-parallel layer), so each
    device's x @ w is a partial sum; the result is summed over devices and split along `axis` (back to sequence
    sharding). The ring reduce-scatter's partial sum for block k is computed just before it is sent, so the matmul
    of the next block overlaps the transfer of the current partial.

    Args:
      x_LxD: (..., N*L, ..., D_local): all rows, this device's slice of the contracted dim.
      w_DxF: (D_local, F): this device's rows of the weight.
      axis_name: the mesh axis D is sharded over.
      axis: x's dim to scatter (not the last); its size must be a multiple of N.
      index: as for `all_gather_matmul`.
    Returns:
      (..., L, ..., F): block i (along `axis`) of the sum over devices of x @ w, on device i.
    """
    axis = axis % x_LxD.ndim
    if axis == x_LxD.ndim - 1:
        raise ValueError(f"matmul_reduce_scatter: the scattered axis ({axis}) cannot be x's contracted last dim")
    n = axis_size(axis_name)
    if x_LxD.shape[axis] % n:
        raise ValueError(f"matmul_reduce_scatter: x's dim {axis} has {x_LxD.shape[axis]} rows, not a multiple of the "
                         f"{n} devices of axis {axis_name!r}")
    if n == 1:
        return _matmul(x_LxD, w_DxF)
    i = lax.axis_index(axis_name) if index is None else index
    rows = x_LxD.shape[axis] // n
    block = lambda k: lax.dynamic_slice_in_dim(x_LxD, jnp.mod(i - k, n) * rows, rows, axis)  # noqa: E731
    acc_LxF = _matmul(block(1), w_DxF)
    for s in range(n - 1):  # the same schedule as the ring reduce-scatter, direction +1
        acc_LxF = ring_shift(acc_LxF, axis_name, n, 1) + _matmul(block(s + 2), w_DxF)
    return acc_LxF


# ---------------------------------------------------------------------------------------------------------------------
# Sequence-parallel tensor parallelism (Megatron-SP): between layers the activations are split along the sequence over
# the tensor axis; the column-parallel matmul gathers the sequence while it multiplies, the row-parallel one
# reduce-scatters it back. Only the tensor axis is run by hand: batch, fsdp and the rest stay with the partitioner.


def sequence_parallel_column(x_BxLxD, w_DxOut, mesh, axis: str = "tensor"):
    """x [B, L, D] (L split over `axis`) @ w [D, O1, ...] (O1 split over `axis`) -> [B, L, O1, ...] with the whole
    sequence and this device's columns, the gather of x overlapped with the matmul (`all_gather_matmul`)."""
    rest = (None,) * (w_DxOut.ndim - 2)

    def body(x, w, index):
        y = all_gather_matmul(x, w.reshape(w.shape[0], -1), axis, axis=1, index=index[0])
        return y.reshape(*y.shape[:2], *w.shape[1:])

    run = _compat.shard_map(body, mesh=_compat.context_mesh(mesh),
                            in_specs=(P(None, axis, None), P(None, axis, *rest), P(axis)),
                            out_specs=P(None, None, axis, *rest), check_vma=False, axis_names={axis})
    return run(x_BxLxD, w_DxOut, jnp.arange(mesh.shape[axis], dtype=jnp.int32))


def sequence_parallel_row(h_BxLxIn, w_InxD, mesh, n_in: int = 1, axis: str = "tensor"):
    """h [B, L, I1, ...] (I1 split over `axis`) @ w [I1, ..., D] -> [B, L, D] summed over `axis` and split along L
    over it again, the partial products computed one block per ring step (`matmul_reduce_scatter`)."""
    rest_h, rest_w = (None,) * (h_BxLxIn.ndim - 3), (None,) * (w_InxD.ndim - 1)

    def body(h, w, index):
        return matmul_reduce_scatter(h.reshape(*h.shape[:2], -1), w.reshape(-1, w.shape[-1]), axis, axis=1,
                                     index=index[0])

    run = _compat.shard_map(body, mesh=_compat.context_mesh(mesh),
                            in_specs=(P(None, None, axis, *rest_h), P(axis, *rest_w), P(axis)),
                            out_specs=P(None, axis, None), check_vma=False, axis_names={axis})
    return run(h_BxLxIn, w_InxD, jnp.arange(mesh.shape[axis], dtype=jnp.int32))
