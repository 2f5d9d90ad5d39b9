"""Expert parallelism: the experts of an MoE layer split over a mesh axis, tokens sent to their experts and back with
all-to-all.

Inside a shard_map that splits the experts over `axis` (n shards of E / n experts each) and the tokens over every
data-parallel axis, each device routes its own tokens, then:

    plan = send_plan(experts_S, n, E // n)                      # where each of its token slots goes
    rows_x, rows_e = dispatch(x_SxD, plan, axis)                # all-to-all: the slots each device's experts take
    rows_y = grouped(rows_x, rows_e)                            # its experts on them (local expert ids, E/n = none)
    y_SxD = combine(rows_y, plan, axis)                         # all-to-all back: every slot's output, in slot order

A device sends each other device one block of `plan.rows` rows. Dropless (`capacity=None`), a block has room for all
the slots the sender can route to one device, whatever the routing: its S slots, or, told that they are T tokens of k
slots each with k distinct experts (`slots_per_token`, as top-k routes), T x min(k, E/n), since a token sends at most
one slot to each expert. Nothing is dropped, at the price of n blocks of buffer per device. With `ragged=True` (the
TPU default; XLA:CPU has no ragged all-to-all) the dropless dispatch and combine send only the rows routed, with
`jax.lax.ragged_all_to_all`: the send buffer holds the S slots in destination order instead of n blocks, the receive
buffer keeps the blocks' layout (rows past what a sender routed stay empty), and the links carry S rows a device
instead of n x rows. Mixtral (8 experts, top-2) over expert=8: blocks of T rows, half of S; dense, 8 blocks (4 x S)
leave each device, ragged S. With a capacity C per expert (GShard) a block holds E/n x C rows, slot rank
within its expert decides who is dropped (every token's first choice before any token's second), and a dropped
slot's output is zero: the residual carries the token.

Legend: S token slots (tokens x experts per token), D embed, n shards on the expert axis, R rows a device receives.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxperf import _compat


@dataclass(frozen=True)
class SendPlan:
    """Where each token slot goes: device `dest_S`, row `row_S` of the block sent there, `keep_S` False for a slot
    dropped by the capacity; `local_expert_S` the expert's index on its device; `rows` per block; `experts_per_shard`
    (also the local id of an empty row); `dropless` False for a plan with a capacity."""

    dest_S: jax.Array
    row_S: jax.Array
    keep_S: jax.Array
    local_expert_S: jax.Array
    rows: int
    experts_per_shard: int
    dropless: bool = True


def send_plan(experts_S: jax.Array, n_shards: int, experts_per_shard: int, *, capacity: int | None = None,
              priority_S: jax.Array | None = None, slots_per_token: int = 1) -> SendPlan:
    """The plan for slots routed to global experts `experts_S` [S] (expert e lives on device e // experts_per_shard).

    Dropless (`capacity` None): a slot's row is its rank among the slots sent to the same device, ordered by expert,
    so each expert's rows are contiguous. A block has S / k x min(k, experts_per_shard) rows for k =
    `slots_per_token`: the slots are S / k tokens' k distinct experts each (top-k), so a token sends at most
    min(k, experts_per_shard) of them to one device. With `capacity` C: row = local expert x C + the slot's rank
    within its expert in `priority_S` order (default: slot order); ranks >= C are dropped.
    """
    S = experts_S.shape[0]
    if S % slots_per_token:
        raise ValueError(f"{S} slots are not whole tokens of slots_per_token={slots_per_token}")
    dest_S = experts_S // experts_per_shard
    local_S = experts_S % experts_per_shard
    if capacity is None:
        order_S = jnp.argsort(experts_S, stable=True)
        rank_S = jnp.zeros(S, jnp.int32).at[order_S].set(jnp.arange(S, dtype=jnp.int32))  # place in expert order
        counts_N = jnp.bincount(dest_S, length=n_shards)
        row_S = rank_S - (jnp.cumsum(counts_N) - counts_N)[dest_S].astype(jnp.int32)
        rows = dropless_block_rows(S // slots_per_token, slots_per_token, experts_per_shard)
        return SendPlan(dest_S, row_S, jnp.ones(S, bool), local_S, rows, experts_per_shard)
    if priority_S is None:
        rank_S = ranks_within_groups(experts_S, n_shards * experts_per_shard)
    else:
        rank_S = jnp.zeros(S, jnp.int32).at[priority_S].set(
            ranks_within_groups(experts_S[priority_S], n_shards * experts_per_shard))
    keep_S = rank_S < capacity
    row_S = local_S * capacity + jnp.minimum(rank_S, capacity - 1)
    return SendPlan(dest_S, row_S, keep_S, local_S, experts_per_shard * capacity, experts_per_shard, dropless=False)


def dropless_block_rows(tokens: int, slots_per_token: int, experts_per_shard: int) -> int:
    """Rows of a dropless block: room for every slot `tokens` tokens can send to one device, each token's
    `slots_per_token` slots going to distinct experts, at most one to each of the device's `experts_per_shard`."""
    return tokens * min(slots_per_token, experts_per_shard)


def dispatch(x_SxD: jax.Array, plan: SendPlan, axis: str, *, ragged: bool = False) -> tuple[jax.Array, jax.Array]:
    """All-to-all over `axis`: (rows [n x rows, D] this device's experts take, their local expert ids [n x rows],
    `experts_per_shard` for an empty row). Block i of the result came from device i. `ragged` (a dropless plan only)
    sends only the slots routed (module docstring)."""
    if ragged:
        return _dispatch_ragged(x_SxD, plan, axis)
    n = jax.lax.axis_size(axis)
    D = x_SxD.shape[-1]
    # a dropped slot is written nowhere: its (dest, row) is pointed out of the buffer and the scatter drops it
    dest_S = jnp.where(plan.keep_S, plan.dest_S, n)
    send_x = jnp.zeros((n, plan.rows, D), x_SxD.dtype).at[dest_S, plan.row_S].set(x_SxD, mode="drop")
    send_e = jnp.full((n, plan.rows), plan.experts_per_shard, jnp.int32).at[dest_S, plan.row_S].set(
        plan.local_expert_S, mode="drop")
    recv_x = jax.lax.all_to_all(send_x, axis, 0, 0, tiled=True)
    recv_e = jax.lax.all_to_all(send_e, axis, 0, 0, tiled=True)
    return recv_x.reshape(n * plan.rows, D), recv_e.reshape(n * plan.rows)


def combine(rows_y: jax.Array, plan: SendPlan, axis: str, *, ragged: bool = False) -> jax.Array:
    """All-to-all back over `axis`: every slot's output [S, D] in slot order, zero for a dropped slot. `ragged` as
    `dispatch` was."""
    if ragged:
        return _combine_ragged(rows_y, plan, axis)
    n = jax.lax.axis_size(axis)
    back = jax.lax.all_to_all(rows_y.reshape(n, plan.rows, -1), axis, 0, 0, tiled=True)
    y_SxD = back[plan.dest_S, plan.row_S]
    return jnp.where(plan.keep_S[:, None], y_SxD, jnp.zeros((), y_SxD.dtype))


# The collective the ragged paths call (tests put an emulation in its place on CPU, where XLA has none)
_ragged_all_to_all = jax.lax.ragged_all_to_all


@dataclass(frozen=True)
class _RaggedLayout:
    """Where a dropless plan's slots lie in the ragged all-to-all: `send_pos_S` each slot's row in the send buffer
    (destination order), `order_S` the slot in each row of it (the inverse permutation), and per device of the axis:
    `send_sizes_N` the rows sent to it, `input_offsets_N` where they start in the send buffer, `recv_sizes_N` the rows
    received from it, `their_offsets_N` where the rows it sent here start in its own send buffer (the combine writes
    them back there)."""

    send_pos_S: jax.Array
    order_S: jax.Array
    send_sizes_N: jax.Array
    input_offsets_N: jax.Array
    recv_sizes_N: jax.Array
    their_offsets_N: jax.Array


def _ragged_layout(plan: SendPlan, axis: str) -> _RaggedLayout:
    if not plan.dropless:
        raise ValueError("the ragged all-to-all takes a dropless plan: a capacity's blocks are already its bound")
    n = jax.lax.axis_size(axis)
    sizes_N = jnp.bincount(plan.dest_S, length=n).astype(jnp.int32)
    offsets_N = (jnp.cumsum(sizes_N) - sizes_N).astype(jnp.int32)
    # a dropless slot's row is its rank among the slots sent to its device: rows 0..size-1 of each destination
    send_pos_S = offsets_N[plan.dest_S] + plan.row_S
    order_S = jnp.zeros_like(send_pos_S).at[send_pos_S].set(jnp.arange(send_pos_S.shape[0], dtype=send_pos_S.dtype))
    # one int per pair of devices: what each sender routes here and where that starts in its send buffer
    recv_sizes_N = jax.lax.all_to_all(sizes_N, axis, 0, 0, tiled=True)
    their_offsets_N = jax.lax.all_to_all(offsets_N, axis, 0, 0, tiled=True)
    return _RaggedLayout(send_pos_S, order_S, sizes_N, offsets_N, recv_sizes_N, their_offsets_N)


def _buffer(shape, fill, dtype, like: jax.Array, axis: str) -> jax.Array:
    """A ragged all-to-all's output buffer, varying over `axis` and the mesh axes `like` (its data) varies over: the
    collective's result takes the buffer's type, and an unvarying result would have autodiff sum its cotangent over
    the axis (a psum of every expert's rows in the backward, and wrong gradients)."""
    buf = jnp.full(shape, fill, dtype)
    missing = tuple((_compat.varying_axes(like) | {axis}) - _compat.varying_axes(buf))
    return jax.lax.pcast(buf, missing, to="varying") if missing else buf


def _dispatch_ragged(x_SxD: jax.Array, plan: SendPlan, axis: str) -> tuple[jax.Array, jax.Array]:
    n, me = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    D = x_SxD.shape[-1]
    lay = _ragged_layout(plan, axis)
    send_SxD, send_S = x_SxD[lay.order_S], plan.local_expert_S[lay.order_S]  # destination order
    # this device's rows land in block `me` of every receiver, as in the dense layout
    out_offsets_N = jnp.full((n,), me * plan.rows, jnp.int32)
    args = (lay.input_offsets_N, lay.send_sizes_N, out_offsets_N, lay.recv_sizes_N)
    recv_RxD = _ragged_all_to_all(send_SxD, _buffer((n * plan.rows, D), 0, x_SxD.dtype, send_SxD, axis), *args,
                                  axis_name=axis)
    recv_R = _ragged_all_to_all(send_S, _buffer((n * plan.rows,), plan.experts_per_shard, jnp.int32, send_S, axis),
                                *args, axis_name=axis)
    return recv_RxD, recv_R


def _combine_ragged(rows_RxD: jax.Array, plan: SendPlan, axis: str) -> jax.Array:
    n = jax.lax.axis_size(axis)
    S = plan.dest_S.shape[0]
    lay = _ragged_layout(plan, axis)
    # block i's routed rows go back to device i, where its slots left from
    back_SxD = _ragged_all_to_all(rows_RxD, _buffer((S, rows_RxD.shape[-1]), 0, rows_RxD.dtype, rows_RxD, axis),
                                  jnp.arange(n, dtype=jnp.int32) * plan.rows, lay.recv_sizes_N, lay.their_offsets_N,
                                  lay.send_sizes_N, axis_name=axis)
    return back_SxD[lay.send_pos_S]


def ranks_within_groups(groups_S: jax.Array, n_groups: int) -> jax.Array:
    """Each slot's rank [S] among the slots of its group (ids in [0, n_groups)), counted in slot order."""
    onehot_SxG = jax.nn.one_hot(groups_S, n_groups, dtype=jnp.int32)
    return jnp.sum((jnp.cumsum(onehot_SxG, axis=0) - 1) * onehot_SxG, axis=-1).astype(jnp.int32)


def group_rows(rows_e: jax.Array, n_groups: int) -> tuple[jax.Array, jax.Array]:
    """(order that sorts rows by group, group sizes [n_groups]) for rows with group ids in [0, n_groups]; id n_groups
    (an empty row) sorts last and is in no group, so a grouped matmul leaves it zero."""
    order = jnp.argsort(rows_e, stable=True)
    return order, jnp.bincount(rows_e, length=n_groups + 1)[:n_groups].astype(jnp.int32)
