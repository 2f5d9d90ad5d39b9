"""Expert parallelism's all-to-all dispatch and combine (jaxperf.parallel.expert) against a plain loop: every slot
reaches the device that holds its expert and comes back in place; with a capacity, exactly the slots past it are
dropped."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxperf import _compat
from jaxperf.parallel import expert as ep

N, E, S, D = 4, 8, 12, 3  # devices on the expert axis, experts, slots per device, width


def _round_trip(experts_NxS, x_NxSxD, capacity=None):
    """Each device's slots sent to their experts, multiplied there by (global expert id + 1), and sent back."""
    mesh = _compat.make_mesh((N,), ("expert",), devices=jax.devices()[:N])

    def body(experts_S, x_SxD):
        experts_S, x_SxD = experts_S[0], x_SxD[0]
        plan = ep.send_plan(experts_S, N, E // N, capacity=capacity)
        rows_x, rows_e = ep.dispatch(x_SxD, plan, "expert")
        glob = jax.lax.axis_index("expert") * (E // N) + rows_e
        rows_y = jnp.where((rows_e < E // N)[:, None], rows_x * (glob + 1)[:, None].astype(rows_x.dtype), 0.0)
        return ep.combine(rows_y, plan, "expert")[None], plan.keep_S[None]

    run = jax.jit(_compat.shard_map(body, mesh=mesh, in_specs=(P("expert"), P("expert")),
                                    out_specs=(P("expert"), P("expert"))))
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P("expert")))  # noqa: E731
    y, keep = run(put(experts_NxS), put(x_NxSxD))
    return np.asarray(y), np.asarray(keep)


def _inputs(skewed: bool):
    rng = np.random.default_rng(0)
    experts = rng.integers(0, E, (N, S)).astype(np.int32)
    if skewed:  # device 0 sends everything to expert 5, on device 2: a dropless block must take all S slots
        experts[0] = 5
    return experts, rng.normal(size=(N, S, D)).astype(np.float32)


@pytest.mark.parametrize("skewed", [False, True])
def test_dropless_every_slot_reaches_its_expert_and_comes_back_in_place(skewed):
    experts, x = _inputs(skewed)
    y, keep = _round_trip(experts, x)
    assert keep.all()
    np.testing.assert_allclose(y, x * (experts + 1)[..., None], rtol=1e-6)


def test_capacity_drops_exactly_the_slots_past_it_in_priority_order():
    experts, x = _inputs(skewed=True)
    cap = 2
    y, keep = _round_trip(experts, x, capacity=cap)
    expected_keep = np.zeros_like(keep)
    for d in range(N):  # rank of a slot among this device's slots to the same expert, in slot order
        seen = {}
        for s in range(S):
            e = experts[d, s]
            expected_keep[d, s] = seen.get(e, 0) < cap
            seen[e] = seen.get(e, 0) + 1
    np.testing.assert_array_equal(keep, expected_keep)
    assert not keep[0, cap:].any()  # device 0's slots all go to expert 5: only the first `cap` are kept
    np.testing.assert_allclose(y, np.where(expected_keep[..., None], x * (experts + 1)[..., None], 0.0), rtol=1e-6)


def test_group_rows_sorts_by_expert_and_leaves_empty_rows_out():
    order, sizes = ep.group_rows(jnp.array([2, 0, 4, 1, 0, 4], jnp.int32), 4)
    np.testing.assert_array_equal(np.asarray(sizes), [2, 1, 1, 0])
    np.testing.assert_array_equal(np.asarray(order)[:4], [1, 4, 3, 0])
