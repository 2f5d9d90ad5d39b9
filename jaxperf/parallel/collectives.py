"""Hand-written collectives for use inside `shard_map`, an alpha-beta cost model for them, and collective matmuls.

    f = _compat.shard_map(lambda x: ring_all_reduce(x, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    predict("ring", nbytes=4 << 20, n=8, link=LinkModel(alpha_s=5e-6, beta_s_per_byte=1 / 50e9))

`lax.psum` hands the whole all-reduce to the backend (NCCL, the TPU ICI runtime, gloo on CPU). The functions here spell
the classic algorithms out as `lax.ppermute` steps, so that each message is visible in the program, the cost model
below can be checked against them step by step, and the same pattern can be fused with compute (the collective
matmuls at the end: the transfer of the next block overlaps the matmul of the current one).

Every function takes the name of one mesh axis and must run inside `shard_map` (or another context that binds that
axis). Sums are accumulated in the input dtype, as a real ring does when the wire format is the input dtype: a bf16
ring all-reduce rounds after each of its n-1 additions, like NCCL with bf16 buffers. Upcast first for fp32 sums.

The n-1 steps are unrolled in Python: the program then has one ppermute per step, which is what a latency-hiding
scheduler needs to overlap them with compute, at the cost of a longer program for very large axes.

Legend: N devices on the axis, C elements per chunk, M elements per device buffer, L rows per device (sequence or
batch), D contracted dim, F output features per device.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def axis_size(axis_name) -> int:
    """Number of devices along `axis_name`, as a Python int (inside shard_map)."""
    if hasattr(lax, "axis_size"):
        return int(lax.axis_size(axis_name))
    return int(lax.psum(1, axis_name))  # pragma: no cover - older jax: psum of a constant is folded to an int


def _shift(x, axis_name, n: int, step: int):
    """Every device i sends `x` to device (i + step) mod n (and receives from (i - step) mod n)."""
    return lax.ppermute(x, axis_name, perm=[(j, (j + step) % n) for j in range(n)])


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
        acc_C = _shift(acc_C, axis_name, n, direction) + chunk(s + 2)
    return acc_C


def _ring_all_gather_C(x_C, axis_name, n: int, direction: int):
    """All devices' chunks stacked in device order, (N, C), after n-1 ring steps that pass on what just arrived."""
    i = lax.axis_index(axis_name)
    out_NxC = jnp.zeros((n,) + x_C.shape, x_C.dtype)
    out_NxC = lax.dynamic_update_index_in_dim(out_NxC, x_C, i, 0)
    piece_C = x_C
    for s in range(n - 1):
        piece_C = _shift(piece_C, axis_name, n, direction)  # device i - d(s+1)'s chunk
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


def _check_power_of_two(n: int, where: str) -> None:
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
    _check_power_of_two(n, f"halving_doubling_all_reduce over axis {axis_name!r}")
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


# ---------------------------------------------------------------------------------------------------------------------
# Alpha-beta cost model.


@dataclasses.dataclass(frozen=True)
class LinkModel:
    """A link that takes alpha_s + nbytes * beta_s_per_byte seconds to deliver one message of nbytes."""

    alpha_s: float  # latency per message: launch, synchronisation, the first byte's trip
    beta_s_per_byte: float  # 1 / bandwidth of one link in one direction

    @classmethod
    def from_bandwidth(cls, alpha_s: float, bytes_per_s: float) -> LinkModel:
        return cls(alpha_s, 1.0 / bytes_per_s)

    @property
    def bandwidth(self) -> float:
        """Bytes per second of one link in one direction (inf when beta is 0)."""
        return 1.0 / self.beta_s_per_byte if self.beta_s_per_byte > 0 else math.inf


PREDICTED = ("naive", "psum", "ring", "bidirectional_ring", "halving_doubling")


def cost_terms(algorithm: str, nbytes: float, n: int) -> tuple[float, float]:
    """(messages, bytes) on the critical path of an all-reduce of `nbytes` per device: time = m*alpha + b*beta.

    See `predict` for the formulas.
    """
    if n < 1:
        raise ValueError(f"n={n}: need at least one device")
    if algorithm not in PREDICTED:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose from {', '.join(PREDICTED)}")
    if n == 1:
        return 0.0, 0.0
    ring_bytes = 2 * (n - 1) / n * nbytes
    if algorithm == "naive":
        return float(n - 1), float((n - 1) * nbytes)
    if algorithm in ("psum", "ring"):
        return float(2 * (n - 1)), ring_bytes
    if algorithm == "bidirectional_ring":
        return float(2 * (n - 1)), ring_bytes / 2
    _check_power_of_two(n, "the halving_doubling cost model")
    return float(2 * int(math.log2(n))), ring_bytes


def predict(algorithm: str, nbytes: float, n: int, link: LinkModel) -> float:
    """Predicted seconds for an all-reduce of `nbytes` per device over `n` devices (alpha-beta model).

    With alpha the per-message latency and beta the seconds per byte of one link direction:

      naive (each device sends its whole buffer to each other device, one after the other, and sums locally):
                            (n-1)*alpha + (n-1)*nbytes*beta
      ring, psum (psum modelled as a ring, what NCCL and most runtimes use for large buffers):
                            2(n-1)*alpha + 2(n-1)/n*nbytes*beta
      bidirectional_ring (half each way on full-duplex links):
                            2(n-1)*alpha + (n-1)/n*nbytes*beta
      halving_doubling (n a power of two; every pair one hop apart, no link contention):
                            2*log2(n)*alpha + 2(n-1)/n*nbytes*beta

    The model ignores the time of the additions, topology (a ring laid on a torus uses one dimension's links) and
    congestion; it is a first-order guide to which algorithm should win, and where latency gives way to bandwidth.
    """
    messages, nbytes_sent = cost_terms(algorithm, nbytes, n)
    return messages * link.alpha_s + nbytes_sent * link.beta_s_per_byte


def bus_bandwidth(nbytes: float, n: int, seconds: float) -> float:
    """Bus bandwidth in bytes/s: nbytes / seconds * 2(n-1)/n (the nccl-tests convention for all-reduce).

    The factor is the share of the buffer each device must send in a bandwidth-optimal all-reduce, so the figure is
    comparable across n and with the link's bandwidth: a ring that saturates its links reports the link bandwidth.
    """
    return nbytes / seconds * 2 * (n - 1) / n


def fit_link(measurements: Iterable[tuple[float, float]], *, n: int, algorithm: str = "psum") -> LinkModel:
    """The LinkModel whose `predict(algorithm, ., n, .)` best fits measured (nbytes, seconds) pairs.

    Least squares in relative error (each row divided by its measured time): message sizes span orders of magnitude,
    and an absolute fit would let the largest messages decide alpha too. alpha and beta are kept >= 0 (a negative
    latency fitted to noise means "no measurable latency").

    Raises:
      ValueError: fewer than two distinct sizes, or a non-positive time.
    """
    pairs = [(float(b), float(t)) for b, t in measurements]
    if len({b for b, _ in pairs}) < 2:
        raise ValueError(f"fit_link needs measurements at two or more message sizes, got {len(pairs)} pair(s) "
                         f"with sizes {sorted({b for b, _ in pairs})}")
    if any(t <= 0 for _, t in pairs):
        raise ValueError(f"fit_link needs positive times, got {[t for _, t in pairs]}")
    a_Px2 = np.array([cost_terms(algorithm, b, n) for b, _ in pairs], np.float64)
    t_P = np.array([t for _, t in pairs], np.float64)
    a_Px2, rhs_P = a_Px2 / t_P[:, None], np.ones_like(t_P)  # relative residuals
    (alpha, beta), *_ = np.linalg.lstsq(a_Px2, rhs_P, rcond=None)
    if alpha < 0 or beta < 0:  # two unknowns: the constrained optimum has one of them at zero
        fits = []
        for col in (0, 1):
            coef = max(float(a_Px2[:, col] @ rhs_P / (a_Px2[:, col] @ a_Px2[:, col])), 0.0)
            fits.append((float(np.sum((a_Px2[:, col] * coef - rhs_P) ** 2)), col, coef))
        _, col, coef = min(fits)
        alpha, beta = (coef, 0.0) if col == 0 else (0.0, coef)
    return LinkModel(float(alpha), float(beta))


# ---------------------------------------------------------------------------------------------------------------------
# Collective matmuls for tensor parallelism: the gather (or scatter) is split into ring steps, each overlapped with the
# matmul of a block that is already here.


def _matmul(x_LxD, w_DxF):
    """x @ w contracting x's last dim with w's first (x may have more dims; no broadcasting)."""
    return jnp.tensordot(x_LxD, w_DxF, axes=1)


def all_gather_matmul(x_LxD, w_DxF, axis_name, *, axis: int = 0):
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
    Returns:
      (..., N*L, ..., F): x gathered along `axis` in device order, times w_DxF.
    """
    axis = axis % x_LxD.ndim
    if axis == x_LxD.ndim - 1:
        raise ValueError(f"all_gather_matmul: the gathered axis ({axis}) cannot be x's contracted last dim")
    n = axis_size(axis_name)
    if n == 1:
        return _matmul(x_LxD, w_DxF)
    i = lax.axis_index(axis_name)
    rows = x_LxD.shape[axis]
    block_LxD, out_NLxF = x_LxD, None
    for s in range(n):
        # Send the block on before multiplying it: the next block's transfer does not wait for this matmul.
        nxt_LxD = _shift(block_LxD, axis_name, n, 1) if s < n - 1 else None
        y_LxF = _matmul(block_LxD, w_DxF)  # rows of device (i - s)
        if out_NLxF is None:
            shape = y_LxF.shape[:axis] + (n * rows,) + y_LxF.shape[axis + 1:]
            out_NLxF = jnp.zeros(shape, y_LxF.dtype)
        out_NLxF = lax.dynamic_update_slice_in_dim(out_NLxF, y_LxF, jnp.mod(i - s, n) * rows, axis)
        block_LxD = nxt_LxD
    return out_NLxF


def matmul_reduce_scatter(x_LxD, w_DxF, axis_name, *, axis: int = 0):
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
    i = lax.axis_index(axis_name)
    rows = x_LxD.shape[axis] // n
    block = lambda k: lax.dynamic_slice_in_dim(x_LxD, jnp.mod(i - k, n) * rows, rows, axis)  # noqa: E731
    acc_LxF = _matmul(block(1), w_DxF)
    for s in range(n - 1):  # the same schedule as the ring reduce-scatter, direction +1
        acc_LxF = _shift(acc_LxF, axis_name, n, 1) + _matmul(block(s + 2), w_DxF)
    return acc_LxF
