"""The step-time prediction (jaxperf.perf.hlo_cost, jaxperf.perf.predict) on programs whose answer is known by hand:
a matmul's bytes, a psum's bytes and wire bytes, a collective inside a scan counted once per iteration, loop trip
counts, replica-group formats and TPU memory spaces in HLO text, and the arithmetic of the bound."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxperf.perf.hardware import Chip
from jaxperf.perf.hlo_cost import group_size, hlo_costs, shape_bytes
from jaxperf.perf.predict import format_prediction, predict_step


def test_a_matmul_moves_its_two_operands_and_its_result_once():
    a, b = jnp.ones((256, 512), jnp.float32), jnp.ones((512, 128), jnp.float32)
    costs = hlo_costs(jax.jit(lambda a, b: a @ b).lower(a, b).compile().as_text())
    assert costs.hbm_bytes == (256 * 512 + 512 * 128 + 256 * 128) * 4
    assert costs.wire_bytes == 0 and not costs.loops


def _psum_in_scan(n_iter: int):
    mesh = jax.make_mesh((8,), ("x",))
    x = jax.device_put(jnp.ones((8, 1024), jnp.float32), NamedSharding(mesh, P("x")))

    def body(c, _):
        return c + 0.5 * jax.lax.psum(c, "x"), None

    f = jax.shard_map(lambda x: jax.lax.scan(body, x, None, length=n_iter)[0], mesh=mesh, in_specs=P("x"),
                      out_specs=P("x"))
    return jax.jit(f).lower(x).compile().as_text()


@pytest.mark.parametrize("n_iter", [1, 5])
def test_a_psum_in_a_scan_is_counted_once_per_iteration(n_iter):
    costs = hlo_costs(_psum_in_scan(n_iter))
    ar = costs.collectives["all-reduce"]
    local = 1 * 1024 * 4  # each of the 8 devices holds one row of 1024 fp32
    assert ar["ops"] == n_iter and ar["bytes"] == n_iter * local
    assert ar["wire_bytes"] == pytest.approx(n_iter * local * 2 * 7 / 8)  # reduce-scatter + all-gather on a ring
    if n_iter > 1:
        assert [lp["trip_count"] for lp in costs.loops] == [n_iter] and not costs.unknown_trip_counts


def test_a_fori_loop_trip_count_is_read_from_its_bounds():
    f = jax.jit(lambda x: jax.lax.fori_loop(2, 9, lambda i, s: jnp.tanh(s) * i, x))
    costs = hlo_costs(f.lower(jnp.ones((64, 64))).compile().as_text())
    assert [lp["trip_count"] for lp in costs.loops] == [7] and not costs.unknown_trip_counts


HLO = """HloModule m, num_partitions=32

%body (p: (s32[], bf16[4,1024])) -> (s32[], bf16[4,1024]) {
  %p = (s32[], bf16[4,1024]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %one = s32[] constant(2)
  %next = s32[] add(%i, %one)
  %x = bf16[4,1024]{1,0} get-tuple-element(%p), index=1
  %ag = bf16[4,4096]{1,0} all-gather(%x), replica_groups=mesh['a'=4,'b'=8] {'a'}, dimensions={1}
  %rs = bf16[4,1024]{1,0} reduce-scatter(%ag), replica_groups=[8,4]<=[32], dimensions={1}, to_apply=%add
  %cp = bf16[4,1024]{1,0:T(8,128)S(1)} collective-permute(%rs), source_target_pairs={{0,1},{1,0}}
  ROOT %t = (s32[], bf16[4,1024]) tuple(%next, %cp)
}

%cond (q: (s32[], bf16[4,1024])) -> pred[] {
  %q = (s32[], bf16[4,1024]) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %n = s32[] constant(11)
  ROOT %lt = pred[] compare(%j, %n), direction=LT
}

ENTRY %main (x0: bf16[4,1024]) -> bf16[4,1024] {
  %x0 = bf16[4,1024]{1,0} parameter(0)
  %zero = s32[] constant(1)
  %init = (s32[], bf16[4,1024]) tuple(%zero, %x0)
  %w = (s32[], bf16[4,1024]) while(%init), condition=%cond, body=%body
  %ar = bf16[4,1024]{1,0} get-tuple-element(%w), index=1
  ROOT %sum = bf16[4,1024]{1,0} all-reduce(%ar), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
}
"""


def test_hlo_text_loops_groups_and_memory_spaces():
    costs = hlo_costs(HLO)
    assert costs.loops == [{"name": "w", "trip_count": 5, "multiplicity": 5.0}]  # i = 1, 3, 5, 7, 9 < 11
    c, x = costs.collectives, 4 * 1024 * 2
    assert c["all-gather"]["ops"] == 5 and c["all-gather"]["bytes"] == 5 * 4 * x  # group of 4 ('a')
    assert c["all-gather"]["wire_bytes"] == 5 * 3 * x
    assert c["reduce-scatter"]["bytes"] == 5 * 4 * x and c["reduce-scatter"]["wire_bytes"] == 5 * 3 * x
    assert c["collective-permute"]["wire_bytes"] == 5 * x
    assert c["all-reduce"]["ops"] == 1 and c["all-reduce"]["wire_bytes"] == 2 * 7 / 8 * x
    # HBM: the permute's result lives in S(1) (VMEM) and is not charged
    per_iter = (x + 4 * x) + (4 * x + x) + x + 3 * 4  # + the scalar add of the induction variable
    assert costs.hbm_bytes == 5 * per_iter + 2 * x


def _stacking_loop(op: str) -> str:
    """A 12-step loop writing one [1024, 1024] bf16 layer a step into a stacked [12, 1024, 1024] buffer, by a
    dynamic-update-slice fusion run as `op`: "fusion", or "fusion-start" + "fusion-done" as XLA:GPU runs it."""
    if op == "fusion":
        write = "%w = bf16[12,1024,1024]{2,1,0} fusion(%buf, %upd, %i), kind=kLoop, calls=%dus"
    else:
        write = ("%ws = ((bf16[12,1024,1024], bf16[1,1024,1024], s32[]), bf16[12,1024,1024], s32[]) "
                 "fusion-start(%buf, %upd, %i), kind=kLoop, calls=%dus\n"
                 "  %w = bf16[12,1024,1024]{2,1,0} fusion-done(%ws)")
    return f"""HloModule m

%dus (b: bf16[12,1024,1024], u: bf16[1,1024,1024], k: s32[]) -> bf16[12,1024,1024] {{
  %b = bf16[12,1024,1024]{{2,1,0}} parameter(0)
  %u = bf16[1,1024,1024]{{2,1,0}} parameter(1)
  %k = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %d = bf16[12,1024,1024]{{2,1,0}} dynamic-update-slice(%b, %u, %k, %z, %z)
}}

%body (p: (s32[], bf16[12,1024,1024], bf16[1,1024,1024])) -> (s32[], bf16[12,1024,1024], bf16[1,1024,1024]) {{
  %p = (s32[], bf16[12,1024,1024], bf16[1,1024,1024]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %buf = bf16[12,1024,1024]{{2,1,0}} get-tuple-element(%p), index=1
  %upd = bf16[1,1024,1024]{{2,1,0}} get-tuple-element(%p), index=2
  {write}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], bf16[12,1024,1024], bf16[1,1024,1024]) tuple(%next, %w, %upd)
}}

%cond (q: (s32[], bf16[12,1024,1024], bf16[1,1024,1024])) -> pred[] {{
  %q = (s32[], bf16[12,1024,1024], bf16[1,1024,1024]) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %n = s32[] constant(12)
  ROOT %lt = pred[] compare(%j, %n), direction=LT
}}

ENTRY %main (b0: bf16[12,1024,1024], u0: bf16[1,1024,1024]) -> bf16[12,1024,1024] {{
  %b0 = bf16[12,1024,1024]{{2,1,0}} parameter(0)
  %u0 = bf16[1,1024,1024]{{2,1,0}} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[12,1024,1024], bf16[1,1024,1024]) tuple(%zero, %b0, %u0)
  %loop = (s32[], bf16[12,1024,1024], bf16[1,1024,1024]) while(%init), condition=%cond, body=%body
  ROOT %out = bf16[12,1024,1024]{{2,1,0}} get-tuple-element(%loop), index=1
}}
"""


def test_an_async_fusion_is_charged_as_the_fusion_it_runs():
    """XLA:GPU wraps the dynamic-update-slice that stacks a scan's per-layer arrays in fusion-start/fusion-done:
    each step writes one layer in place (update read, update written), not the whole stacked buffer."""
    layer = 1024 * 1024 * 2
    sync, async_ = hlo_costs(_stacking_loop("fusion")), hlo_costs(_stacking_loop("fusion-start"))
    per_step = 2 * layer + 4 + 3 * 4  # the update read and written, the index; the induction variable's add
    assert sync.hbm_bytes == 12 * per_step
    assert async_.hbm_bytes == sync.hbm_bytes


def test_group_sizes_and_shapes():
    assert group_size("replica_groups=[2,16]<=[32]", 32) == 16
    assert group_size("replica_groups={{0,1},{2,3}}", 4) == 2
    assert group_size("replica_groups=mesh['x'=4,'y'=2,'z'=4] {'x','z'}", 32) == 16
    assert group_size("channel_id=1", 8) == 8
    assert shape_bytes("(bf16[2,3]{1,0}, f32[4]{0:S(1)}, s4[8])") == 12 + 16 + 4
    assert shape_bytes("(bf16[2,3]{1,0}, f32[4]{0:T(128)S(1)})", hbm_only=True) == 12


def test_the_bound_is_the_slowest_of_three_and_mfu_follows():
    chip = Chip("test", 100e12, 100e12, None, 16 * 2**30, 1e12, 100e9)
    text = _psum_in_scan(5)
    p = predict_step(text, model_flops=3e12, hardware_flops=4e12, chip=chip)
    assert p["compute_s"] == pytest.approx(0.04) and p["bound_by"] == "compute"
    assert p["hbm_s"] == pytest.approx(p["hbm_bytes"] / 1e12)
    assert p["collective_s"] == pytest.approx(5 * 4096 * 2 * 7 / 8 / 100e9)
    assert p["step_s"] == max(p["compute_s"], p["hbm_s"], p["collective_s"])
    assert p["step_s_no_overlap"] == pytest.approx(max(p["compute_s"], p["hbm_s"]) + p["collective_s"])
    assert p["mfu"] == pytest.approx(3e12 / (p["step_s"] * 100e12))  # 0.75: remat's recompute is not model work
    np.testing.assert_array_less(p["mfu_no_overlap"], p["mfu"])
    assert any("bound max()" in line for line in format_prediction(p))
    assert "step_s" not in predict_step(text, model_flops=1.0, hardware_flops=1.0, chip=None)
