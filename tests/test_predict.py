"""The step-time prediction (jaxperf.perf.hlo_cost, jaxperf.perf.predict) on programs whose answer is known by hand:
a matmul's bytes, a psum's bytes and wire bytes, a collective inside a scan counted once per iteration, loop trip
counts, replica-group formats and TPU memory spaces in HLO text, and the arithmetic of the bound."""

from __future__ import annotations

import gzip
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxperf.perf.hardware import CHIPS, Chip
from jaxperf.perf.hlo_cost import group_size, hlo_costs, shape_bytes
from jaxperf.perf.predict import GPU_SUSTAINED, format_prediction, predict_step

DATA = Path(__file__).parent / "data"


def test_a_matmul_moves_its_two_operands_and_its_result_once():
    a, b = jnp.ones((256, 512), jnp.float32), jnp.ones((512, 128), jnp.float32)
    costs = hlo_costs(jax.jit(lambda a, b: a @ b).lower(a, b).compile().as_text())
    assert costs.hbm_bytes == (256 * 512 + 512 * 128 + 256 * 128) * 4
    assert costs.wire_bytes == 0 and not costs.loops


def test_a_matmul_kernel_carries_its_flops():
    a, b = jnp.ones((256, 512), jnp.bfloat16), jnp.ones((512, 128), jnp.bfloat16)
    costs = hlo_costs(jax.jit(lambda a, b: a @ b).lower(a, b).compile().as_text())
    assert sum(k.flops for k in costs.kernels) == 2 * 256 * 512 * 128
    assert {k.kind for k in costs.kernels if k.flops} == {"matmul"}


# Library calls as XLA:GPU writes them (from an H200's compiled gpt2-small step, backend configs cut to what is read).
_GPU_CALLS = """HloModule m

ENTRY %main (x: bf16[32768,768], w: bf16[768,2304], q: bf16[32,1024,12,64]) -> bf16[32768,2304] {
  %x = bf16[32768,768]{1,0} parameter(0)
  %w = bf16[768,2304]{1,0} parameter(1)
  %q = bf16[32,1024,12,64]{3,2,1,0} parameter(2)
  %mm = (bf16[32768,2304]{1,0}, s8[33554432]{0}) custom-call(%x, %w), custom_call_target="__cublas$lt$matmul", \
backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_batch_dimensions":[],\
"lhs_contracting_dimensions":["1"],"rhs_batch_dimensions":[],"rhs_contracting_dimensions":["0"]}}}
  %att = (bf16[32,12,1024,64]{3,1,2,0}, f32[32,12,1024]{2,1,0}, u8[256]{0}) custom-call(%q, %q, %q), \
custom_call_target="__cudnn$fmhaSoftmax", backend_config={"cudnn_fmha_backend_config":{\
"intermediate_tensor_shape":{"dimensions":["32","12","1024","1024"],"element_type":"BF16"},"mask_type":"CAUSAL"}}
  ROOT %out = bf16[32768,2304]{1,0} get-tuple-element(%mm), index=0
}
"""


def test_cublas_and_cudnn_calls_are_counted_as_matrix_work_without_their_workspace():
    kernels = {k.name: k for k in hlo_costs(_GPU_CALLS).kernels}
    mm, att = kernels["mm"], kernels["att"]
    assert (mm.kind, mm.flops) == ("matmul", 2 * 32768 * 768 * 2304)
    assert mm.hbm_bytes == 2 * (32768 * 768 + 768 * 2304 + 32768 * 2304)  # the 32 MiB workspace is not traffic
    assert att.kind == "attention"
    assert att.flops == 4 * 32 * 12 * 1024 * 1024 * 64 / 2  # QK^T and PV, half of them under the causal mask
    assert att.hbm_bytes == 3 * 32 * 1024 * 12 * 64 * 2 + 32 * 12 * 1024 * (64 * 2 + 4)


# Measured on an H200 (jax 0.11.2, CUDA 13; benchmarks/results/gpu.jsonl, the memory stage at 042a25f): the median
# step of the compiled programs in tests/data, and the matmul FLOPs per step of each model (6 x matmul parameters x
# tokens, the attention's own matmuls apart; llama-1b saves its matmul outputs, so nothing is recomputed).
_GPT2_MATMUL_PARAMS = 12 * (768 * 3 * 768 + 768 * 768 + 2 * 768 * 3072) + 768 * 50304  # qkv, out, mlp; logits
_LLAMA_MATMUL_PARAMS = 16 * (2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 8192) + 2048 * 32000
_H200_STEPS = [("h200-gpt2-small-b32-step.hlo.gz", 66.26e-3, 6 * _GPT2_MATMUL_PARAMS * 32 * 1024),
               ("h200-llama-1b-b8-step.hlo.gz", 218.31e-3, 6 * _LLAMA_MATMUL_PARAMS * 8 * 2048)]


@pytest.mark.parametrize("name,measured_s,matmul_flops", _H200_STEPS)
def test_gpu_step_prediction_within_15_percent_of_the_h200(name, measured_s, matmul_flops):
    """Kernels in series at their kinds' sustained rates: 0.88x (gpt2-small) and 0.94x (llama-1b) the measured
    steps. A max() of whole-program terms, the TPU model, says 0.40x and 0.50x on the same programs."""
    text = gzip.decompress((DATA / name).read_bytes()).decode()
    h200 = next(chip for _, chip in CHIPS if chip.name == "H200 SXM")
    p = predict_step(text, model_flops=1.0, hardware_flops=1.0, chip=h200)
    assert p["kernels_by_kind_s"]["matmul"] > p["kernels_by_kind_s"]["fusion"] > 0
    counted = sum(k.flops for k in hlo_costs(text).kernels if k.kind == "matmul")
    assert counted == pytest.approx(matmul_flops, rel=1e-9)
    assert 0.85 <= p["step_s"] / measured_s <= 1.15, p["step_s"]
    assert any("kernels in series" in line for line in format_prediction(p))
    tpu_like = predict_step(text, model_flops=1.0, hardware_flops=matmul_flops, chip=Chip(
        "same peaks, TPU model", h200.bf16_flops, h200.fp32_flops, None, h200.hbm_bytes, h200.hbm_bw, 450e9))
    assert tpu_like["step_s"] < 0.6 * measured_s


def test_every_gpu_kernel_kind_has_a_sustained_rate():
    assert set(GPU_SUSTAINED) == {"matmul", "attention", "fusion", "other"}
    assert all(0 < bw <= 1 and 0 <= f <= 1 for f, bw in GPU_SUSTAINED.values())


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


# One all-gather as the TPU compiler's async collective fusion writes it (the shape of a weight gathered in a layer's
# backward, libtpu 0.0.52): the start, a continuation fused with the matmul it overlaps (which uses a weight gathered
# before, in VMEM), and the done each hold a copy of the collective under channel 7; the continuation and the done
# return the gathered buffer in place (output_to_operand_aliasing). A second all-gather (channel 9) stands alone.
ASYNC_COLLECTIVE_FUSION_HLO = """HloModule m, num_partitions=8

%start (s0: bf16[1,512,1024]) -> (bf16[1,512,1024], bf16[1,4096,1024]) {
  %s0 = bf16[1,512,1024]{2,1,0:S(1)} parameter(0)
  %ag.1 = bf16[1,4096,1024]{2,1,0} all-gather(%s0), channel_id=7, replica_groups=mesh['x'=8] {'x'}, dimensions={1}
  ROOT %cs = (bf16[1,512,1024]{2,1,0:S(1)}, bf16[1,4096,1024]{2,1,0}) custom-call(%ag.1), custom_call_target="AsyncCollectiveStart"
}

%continuation (c0: bf16[1,512,1024], c1: bf16[1,4096,1024], c2: bf16[16,4096], c3: bf16[4096,1024]) -> (bf16[16,1024], bf16[1,512,1024], bf16[1,4096,1024], bf16[1,4096,1024]) {
  %c0 = bf16[1,512,1024]{2,1,0:S(1)} parameter(0)
  %c1 = bf16[1,4096,1024]{2,1,0} parameter(1)
  %c2 = bf16[16,4096]{1,0} parameter(2)
  %c3 = bf16[4096,1024]{1,0:S(1)} parameter(3)
  %mm = bf16[16,1024]{1,0} dot(%c2, %c3), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %ag.2 = bf16[1,4096,1024]{2,1,0} all-gather(%c0), channel_id=7, replica_groups=mesh['x'=8] {'x'}, dimensions={1}
  ROOT %ct = (bf16[16,1024]{1,0}, bf16[1,512,1024]{2,1,0:S(1)}, bf16[1,4096,1024]{2,1,0}, bf16[1,4096,1024]{2,1,0}) tuple(%mm, %c0, %c1, %ag.2)
}

%done (d0: bf16[1,512,1024], d1: bf16[1,4096,1024]) -> bf16[1,4096,1024] {
  %d0 = bf16[1,512,1024]{2,1,0:S(1)} parameter(0)
  %d1 = bf16[1,4096,1024]{2,1,0} parameter(1)
  %ag.3 = bf16[1,4096,1024]{2,1,0} all-gather(%d0), channel_id=7, replica_groups=mesh['x'=8] {'x'}, dimensions={1}
  ROOT %cd = bf16[1,4096,1024]{2,1,0} custom-call(%d0, %d1, %ag.3), custom_call_target="AsyncCollectiveDone"
}

ENTRY %main (x: bf16[1,512,1024], a: bf16[16,4096], v: bf16[4096,1024]) -> (bf16[16,1024], bf16[1,4096,1024]) {
  %x = bf16[1,512,1024]{2,1,0:S(1)} parameter(0)
  %a = bf16[16,4096]{1,0} parameter(1)
  %v = bf16[4096,1024]{1,0:S(1)} parameter(2)
  %st = (bf16[1,512,1024]{2,1,0:S(1)}, bf16[1,4096,1024]{2,1,0}) fusion(%x), kind=kCustom, calls=%start
  %st0 = bf16[1,512,1024]{2,1,0:S(1)} get-tuple-element(%st), index=0
  %st1 = bf16[1,4096,1024]{2,1,0} get-tuple-element(%st), index=1
  %co = (bf16[16,1024]{1,0}, bf16[1,512,1024]{2,1,0:S(1)}, bf16[1,4096,1024]{2,1,0}, bf16[1,4096,1024]{2,1,0}) fusion(%st0, %st1, %a, %v), kind=kOutput, output_to_operand_aliasing={{1}: (0, {}), {2}: (1, {}), {3}: (1, {})}, calls=%continuation
  %co0 = bf16[16,1024]{1,0} get-tuple-element(%co), index=0
  %co1 = bf16[1,512,1024]{2,1,0:S(1)} get-tuple-element(%co), index=1
  %co2 = bf16[1,4096,1024]{2,1,0} get-tuple-element(%co), index=2
  %dn = bf16[1,4096,1024]{2,1,0} fusion(%co1, %co2), kind=kCustom, output_to_operand_aliasing={{}: (1, {})}, calls=%done
  %other = bf16[1,4096,1024]{2,1,0} all-gather(%x), channel_id=9, replica_groups=mesh['x'=8] {'x'}, dimensions={1}
  ROOT %out = (bf16[16,1024]{1,0}, bf16[1,4096,1024]{2,1,0}, bf16[1,4096,1024]{2,1,0}) tuple(%co0, %dn, %other)
}
"""


def test_an_async_collective_fusion_sends_and_writes_its_collective_once():
    """The start, continuation and done of one async collective fusion are one all-gather on the wire (read as
    three, a TPU step's backward sent its weights' gathers three times over), whose gathered buffer is written to
    HBM once: the continuation and the done pass it through in place (their results alias it), so the continuation
    is charged its matmul only and the done nothing."""
    costs = hlo_costs(ASYNC_COLLECTIVE_FUSION_HLO)
    ag = costs.collectives["all-gather"]
    gathered = 4096 * 1024 * 2
    assert ag["ops"] == 2 and ag["bytes"] == 2 * gathered  # the fusion's collective and channel 9's
    assert ag["wire_bytes"] == 2 * gathered * 7 / 8
    charged = {k.name: k.hbm_bytes for k in costs.kernels}
    assert charged == {"st": gathered, "co": 16 * 4096 * 2 + 16 * 1024 * 2, "other": gathered}
    assert costs.hbm_bytes == 2 * gathered + 16 * 4096 * 2 + 16 * 1024 * 2
    # the same buffer also given as a result of its own, not aliased: that copy reads and writes it
    copied = ASYNC_COLLECTIVE_FUSION_HLO.replace("tuple(%mm, %c0, %c1, %ag.2)", "tuple(%mm, %c0, %c1, %ag.2, %c1)")
    assert {k.name: k.hbm_bytes for k in hlo_costs(copied).kernels}["co"] == charged["co"] + 2 * gathered


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


def test_an_async_slice_into_vmem_reads_the_slice_not_the_buffer():
    """The TPU compiler prefetches pieces of a buffer into VMEM (S(1)) with slice-start/slice-done: each reads its
    4 MiB piece of the 64 MiB buffer and writes nothing to HBM. Charged the whole operand, the 16 slices of a v6e
    Llama-2-7B step's buffers came to 312 GB of its 1,472 GB; the pieces are 20 GB."""
    piece, whole = 4 * 2**20, 64 * 2**20
    hlo = f"""HloModule m

ENTRY %main (b: s8[{whole}]) -> s8[{piece}] {{
  %b = s8[{whole}]{{0:T(1024)(128)(4,1)}} parameter(0)
  %s = ((s8[{whole}]{{0:T(1024)(128)(4,1)}}), s8[{piece}]{{0:T(1024)(128)(4,1)S(1)}}, s32[]{{:S(2)}}) slice-start(%b), slice={{[{piece}:{2 * piece}]}}
  ROOT %d = s8[{piece}]{{0:T(1024)(128)(4,1)S(1)}} slice-done(%s)
}}
"""
    assert hlo_costs(hlo).hbm_bytes == piece
    to_hbm = hlo.replace("(4,1)S(1)}, s32[]", "(4,1)}, s32[]")  # a destination in HBM is written there too
    assert hlo_costs(to_hbm).hbm_bytes == 2 * piece


def test_a_ragged_all_to_all_counts_the_smaller_of_its_data_and_output_buffers():
    """Expert parallelism's dispatch sends 512 routed rows of a device into blocks with room for 2,048 (four senders'
    worst case); its combine sends what arrived back from those blocks. Under balanced routing each moves 512 rows,
    (n-1)/n of them over the links; the offsets and sizes are not data."""
    hlo = """HloModule m

ENTRY %main (x: bf16[512,1024], o: bf16[2048,1024], s: s32[4]) -> bf16[512,1024] {
  %x = bf16[512,1024]{1,0} parameter(0)
  %o = bf16[2048,1024]{1,0} parameter(1)
  %s = s32[4]{0} parameter(2)
  %d = bf16[2048,1024]{1,0} ragged-all-to-all(%x, %o, %s, %s, %s, %s), replica_groups={{0,1,2,3}}
  ROOT %c = bf16[512,1024]{1,0} ragged-all-to-all(%d, %x, %s, %s, %s, %s), replica_groups={{0,1,2,3}}
}
"""
    c = hlo_costs(hlo).collectives["ragged-all-to-all"]
    assert c["ops"] == 2 and c["bytes"] == 2 * 512 * 1024 * 2 and c["wire_bytes"] == 2 * 3 / 4 * 512 * 1024 * 2


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
