"""Hand-written collectives for use inside `shard_map`: ring, bidirectional ring and halving-doubling all-reduces.

    f = _compat.shard_map(lambda x: ring_all_reduce(x, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    predict("ring", nbytes=4 << 20, n=8, link=LinkModel(alpha_s=5e-6, beta_s_per_byte=1 / 50e9))

`lax.psum` hands the whole all-reduce to the backend (NCCL, the TPU ICI runtime, gloo on CPU). The functions here spell
the classic algorithms out as `lax.ppermute` steps, so that each message is visible in the program, the cost model
in jaxperf.explicit.cost_model can be checked against them step by step, and the same pattern can be fused with
compute (jaxperf.parallel.collective_matmul: the transfer of the next block overlaps the matmul of the current one).

Every function takes the name of one mesh axis and must run inside `shard_map` (or another context that binds that
axis). Sums are accumulated in the input dtype, as a real ring does when the wire format is the input dtype: a bf16
ring all-reduce rounds after each of its n-1 additions, like NCCL with bf16 buffers. Upcast first for fp32 sums.

The n-1 steps are unrolled in Python: the program then has one ppermute per step, which is what a latency-hiding
scheduler needs to overlap them with compute, at the cost of a longer program for very large axes.

Legend: N devices on the axis, C elements per chunk, M elements per device buffer.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxperf.parallel.collective_matmul import ring_shift, axis_size


def _exchange(x, axis_name, n: int, dist: int):
    """Every device i swaps `x` with device i XOR dist (a pairwise exchange; dist is a power of two)."""
    return lax.ppermute(x, axis_name, perm=[(j, j ^ dist) for j in range(n)])


# ---------------------------------------------------------------------------------------------------------------------
# Ring: reduce-scatter, all-gather, all-reduce. `direction` +1 sends to the next device (clockwise), -1 to the previous.


def _ring_reduce_scatter_NxC(x_NxC, axis_name, n: int, direction: int):
    """Chunk i of the sum over devices, on device i, after n-1 ring steps.

    At step s device i sends its running partial of chunk (i - d(s+1)) and adds its own copy of chunk (i - d(s+2))
    to the partial it receives; after the last step (s = n-2) that is chunk i, summed over all n devices.
    """
    i = lax.axis_index(axis_name)
    chunk = lambda k: lax.dynamic_index_in_dim(x_NxC, jnp.mod(i - direction * k, n), 0, keepdims=False)  # noqa: E731
    acc_C = chunk(1)
    for s in range(n - 1):
        acc_C = ring_shift(acc_C, axis_name, n, direction) + chunk(s + 2)
    return acc_C


def _ring_all_gather_C(x_C, axis_name, n: int, direction: int):
    """All devices' chunks stacked in device order, (N, C), after n-1 ring steps that pass on what just arrived."""
    i = lax.axis_index(axis_name)
    out_NxC = jnp.zeros((n,) + x_C.shape, x_C.dtype)
    out_NxC = lax.dynamic_update_index_in_dim(out_NxC, x_C, i, 0)
    piece_C = x_C
    for s in range(n - 1):
        piece_C = ring_shift(piece_C, axis_name, n, direction)  # device i - d(s+1)'s chunk
        out_NxC = lax.dynamic_update_index_in_dim(out_NxC, piece_C, jnp.mod(i - direction * (s + 1), n), 0)
    return out_NxC


def _leading_split(x, n: int, tiled: bool, op: str):
    if x.ndim == 0:
        raise ValueError(f"{op} needs an array with a leading dim to scatter, got a scalar")
    if tiled and x.shape[0] % n:
        raise ValueError(f"{op}(tiled=True): the leading dim {x.shape[0]} must be a multiple of the {n} devices")
    if not tiled and x.shape[0] != n:
        raise ValueError(f"{op}(tiled=False): the leading dim {x.shape[0]} must equal the {n} devices "
                         f"(or pass tiled=True to split it into {n} blocks)")
    return (x.shape[0] // n,) + x.shape[1:] if tiled else x.shape[1:]


def ring_reduce_scatter(x, axis_name, *, tiled: bool = False, direction: int = 1):
    """Sum `x` over the devices of `axis_name` and keep block i of the leading dim on device i (n-1 ring steps).

    The same contract as `lax.psum_scatter(x, axis_name, scatter_dimension=0, tiled=tiled)`.

    Args:
      x: this device's buffer. tiled=False: shape (N, ...), returns x.shape[1:]; tiled=True: shape (N*K, ...),
        returns (K, ...).
      axis_name: the mesh axis to reduce over.
      direction: +1 passes partials to the next device, -1 to the previous one.
    """
    n = axis_size(axis_name)
    out_shape = _leading_split(x, n, tiled, "ring_reduce_scatter")
    if n == 1:
        return x.reshape(out_shape)
    return _ring_reduce_scatter_NxC(x.reshape(n, -1), axis_name, n, direction).reshape(out_shape)


def ring_all_gather(x, axis_name, *, tiled: bool = False, direction: int = 1):
    """Every device's `x`, in device order, on every device (n-1 ring steps).

    The same contract as `lax.all_gather(x, axis_name, axis=0, tiled=tiled)`: (N, *x.shape), or with tiled=True the
    blocks concatenated along the leading dim, (N * x.shape[0], *x.shape[1:]).
    """
    n = axis_size(axis_name)
    if tiled and x.ndim == 0:
        raise ValueError("ring_all_gather(tiled=True) needs an array with a leading dim, got a scalar")
    out_shape = (n * x.shape[0],) + x.shape[1:] if tiled else (n,) + x.shape
    if n == 1:
        return x.reshape(out_shape)
    return _ring_all_gather_C(x.reshape(-1), axis_name, n, direction).reshape(out_shape)


def _pad_flat(x, multiple: int):
    """x flattened and zero-padded to a multiple of `multiple` elements (zeros do not change a sum)."""
    flat_M = x.reshape(-1)
    pad = -flat_M.shape[0] % multiple
    return jnp.pad(flat_M, (0, pad)) if pad else flat_M


def _unpad(flat_M, like):
    return flat_M[: like.size].reshape(like.shape)


def ring_all_reduce(x, axis_name):
    """`lax.psum(x, axis_name)` as a ring: reduce-scatter then all-gather, each n-1 `ppermute` steps.

    Any shape and size: the flattened buffer is padded to N equal chunks and unpadded after. Each device sends
    2(N-1)/N of the buffer in total, the bandwidth optimum for an all-reduce, in 2(N-1) messages.

    Args:
      x: this device's buffer, any shape, a float dtype (summed in that dtype).
      axis_name: the mesh axis to reduce over.
    Returns:
      The elementwise sum over the devices of `axis_name`, the shape and dtype of `x`, on every device.
    """
    n = axis_size(axis_name)
    if n == 1:
        return x
    x_NxC = _pad_flat(x, n).reshape(n, -1)
    chunk_C = _ring_reduce_scatter_NxC(x_NxC, axis_name, n, 1)
    return _unpad(_ring_all_gather_C(chunk_C, axis_name, n, 1).reshape(-1), x)


def bidirectional_ring_all_reduce(x, axis_name):
    """A ring all-reduce with half the buffer going clockwise and the other half counter-clockwise at the same time.

    On full-duplex links (NVLink, ICI, Ethernet) a one-way ring leaves the reverse direction idle; two rings in
    opposite directions halve the bytes each direction carries, for the same number of steps. The two rings are
    independent in the program, so their ppermutes of one step can be in flight together.
    """
    n = axis_size(axis_name)
    if n == 1:
        return x
    x_2xNxC = _pad_flat(x, 2 * n).reshape(2, n, -1)
    halves = []
    for half, direction in ((0, 1), (1, -1)):
        chunk_C = _ring_reduce_scatter_NxC(x_2xNxC[half], axis_name, n, direction)
        halves.append(_ring_all_gather_C(chunk_C, axis_name, n, direction).reshape(-1))
    return _unpad(jnp.concatenate(halves), x)


def check_power_of_two(n: int, where: str) -> None:
    if n & (n - 1):
        lo = 1 << (n.bit_length() - 1)
        raise ValueError(f"{where} needs a power-of-two number of devices, got n={n}: use ring_all_reduce (any n), "
                         f"or a mesh axis of {lo} or {lo * 2} devices")


def halving_doubling_all_reduce(x, axis_name):
    """All-reduce by recursive halving (reduce-scatter) then recursive doubling (all-gather); n must be a power of 2.

    Halving: in step k devices i and i XOR N/2^(k+1) swap halves of their current segment; each keeps the half its
    bit selects and adds the partner's copy of it. After log2(N) steps device i holds chunk i, fully summed. Doubling
    runs the same exchanges in reverse order, concatenating instead of adding. The same 2(N-1)/N of the buffer is sent
    as in a ring, but in 2 log2(N) messages instead of 2(N-1): the better choice when latency dominates (small
    buffers, many devices), on networks where any pair of devices is one hop apart.

    Raises:
      ValueError: the axis size is not a power of two (at trace time, naming n).
    """
    n = axis_size(axis_name)
    check_power_of_two(n, f"halving_doubling_all_reduce over axis {axis_name!r}")
    if n == 1:
        return x
    i = lax.axis_index(axis_name)
    seg = _pad_flat(x, n)
    dist = n // 2
    while dist >= 1:  # recursive halving: the segment halves each step, ending as chunk i
        half = seg.shape[0] // 2
        upper = jnp.bitwise_and(i, dist) != 0
        keep, send = jnp.where(upper, seg[half:], seg[:half]), jnp.where(upper, seg[:half], seg[half:])
        seg = keep + _exchange(send, axis_name, n, dist)
        dist //= 2
    dist = 1
    while dist < n:  # recursive doubling: undo the halving in reverse, concatenating
        other = _exchange(seg, axis_name, n, dist)
        upper = jnp.bitwise_and(i, dist) != 0
        seg = jnp.where(upper, jnp.concatenate([other, seg]), jnp.concatenate([seg, other]))
        dist *= 2
    return _unpad(seg, x)


# name -> fn(x, axis_name): the all-reduces the benchmark and the tests compare (psum is the backend's own).
ALL_REDUCES = {
    "psum": lambda x, axis_name: lax.psum(x, axis_name),
    "ring": ring_all_reduce,
    "bidirectional_ring": bidirectional_ring_all_reduce,
    "halving_doubling": halving_doubling_all_reduce,
}
