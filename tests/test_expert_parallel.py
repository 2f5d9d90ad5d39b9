"""Expert parallelism's all-to-all dispatch and combine (jaxperf.parallel.expert) against a plain loop: every slot
reaches the device that holds its expert and comes back in place; with a capacity, exactly the slots past it are
dropped."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import flat, make_task, random_batches
from jaxperf import _compat
from jaxperf.config import ConfigError, ModelConfig, OptimConfig, ParallelConfig, TrainConfig, validate
from jaxperf.models import moe
from jaxperf.parallel import expert as ep

N, E, S, D = 4, 8, 12, 3  # devices on the expert axis, experts, slots per device, width


def _round_trip(experts_NxS, x_NxSxD, capacity=None, slots_per_token=1):
    """Each device's slots sent to their experts, multiplied there by (global expert id + 1), and sent back."""
    mesh = _compat.make_mesh((N,), ("expert",), devices=jax.devices()[:N])

    def body(experts_S, x_SxD):
        experts_S, x_SxD = experts_S[0], x_SxD[0]
        plan = ep.send_plan(experts_S, N, E // N, capacity=capacity, slots_per_token=slots_per_token)
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


def test_dropless_blocks_of_top_k_slots_hold_a_token_once_per_local_expert():
    """Slots as tokens of k = 4 distinct experts with 2 experts per device: a block needs room for 2 slots a token,
    half of S; device 0's tokens all choose both experts of device 2 and so fill its block exactly."""
    k, T = 4, S // 4
    rng = np.random.default_rng(1)
    experts = np.stack([rng.permutation(E)[:k] for _ in range(N * T)]).reshape(N, S).astype(np.int32)
    experts[0] = np.array([[4, 5, 0, 7], [5, 1, 4, 2], [6, 4, 3, 5]]).reshape(S)
    assert ep.send_plan(jnp.asarray(experts[0]), N, E // N, slots_per_token=k).rows == T * 2 == S // 2
    x = rng.normal(size=(N, S, D)).astype(np.float32)
    y, keep = _round_trip(experts, x, slots_per_token=k)
    assert keep.all()
    np.testing.assert_allclose(y, x * (experts + 1)[..., None], rtol=1e-6)
    with pytest.raises(ValueError, match="not whole tokens"):
        ep.send_plan(jnp.asarray(experts[0]), N, E // N, slots_per_token=5)


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


def _emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                                axis_name):
    """`jax.lax.ragged_all_to_all` as its docstring defines it, from all_gather (XLA:CPU has no ragged all-to-all):
    sender i's rows [input_offsets_i[j], + send_sizes_i[j]) land in device j's output from output_offsets_i[j] on,
    the other rows of `output` stay. A `recv_sizes` that disagrees with what the senders send poisons the output."""
    n, me = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    ops, ins, sizes, outs = (jax.lax.all_gather(a, axis_name) for a in (operand, input_offsets, send_sizes,
                                                                        output_offsets))
    p = jnp.arange(operand.shape[0])
    for i in range(n):
        dst = jnp.where(p < sizes[i, me], outs[i, me] + p, output.shape[0])  # past the rows sent: dropped
        output = output.at[dst].set(ops[i][jnp.clip(ins[i, me] + p, 0, operand.shape[0] - 1)], mode="drop")
    return jnp.where(jnp.all(recv_sizes == sizes[:, me]), output, jnp.full_like(output, -7))


@pytest.mark.parametrize("skewed", [False, True])
def test_the_ragged_all_to_all_fills_the_dense_blocks_and_differentiates_alike(skewed, monkeypatch):
    """Dropless, top-2 slots: the ragged dispatch receives the dense one's blocks row for row (empty rows zero, with
    the empty expert id), the combine returns the same outputs, and the gradients through both are equal. The
    collective is the emulation above: what is checked is the offsets and sizes handed to it."""
    monkeypatch.setattr(ep, "_ragged_all_to_all", _emulated_ragged_all_to_all)
    k = 2
    rng = np.random.default_rng(2)
    experts = np.stack([rng.permutation(E)[:k] for _ in range(N * S // k)]).reshape(N, S).astype(np.int32)
    if skewed:  # device 0's tokens all choose experts 4 and 5 (device 2): its other blocks stay empty
        experts[0] = np.tile([4, 5], S // k)
    x = rng.normal(size=(N, S, D)).astype(np.float32)
    mesh = _compat.make_mesh((N,), ("expert",), devices=jax.devices()[:N])

    def body(experts_S, x_SxD, w_D, ragged):
        plan = ep.send_plan(experts_S[0], N, E // N, slots_per_token=k)
        rows_x, rows_e = ep.dispatch(x_SxD[0], plan, "expert", ragged=ragged)
        rows_y = jnp.tanh(rows_x * w_D[None]) * (rows_e + 1)[:, None]
        y_SxD = ep.combine(rows_y, plan, "expert", ragged=ragged)
        return rows_x[None], rows_e[None], y_SxD[None]

    def run(ragged):
        f = _compat.shard_map(functools.partial(body, ragged=ragged), mesh=mesh,
                              in_specs=(P("expert"), P("expert"), P()), out_specs=P("expert"))
        loss = lambda x, w: jnp.sum(f(experts, x, w)[2] ** 2)  # noqa: E731
        w = jnp.linspace(0.5, 1.5, D, dtype=jnp.float32)
        return jax.jit(f)(experts, x, w), jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)

    (rows_x, rows_e, y), grads = run(ragged=True)
    (dense_x, dense_e, dense_y), dense_grads = run(ragged=False)
    np.testing.assert_array_equal(np.asarray(rows_e), np.asarray(dense_e))
    np.testing.assert_array_equal(np.asarray(rows_x), np.asarray(dense_x))
    np.testing.assert_allclose(np.asarray(y), np.asarray(dense_y), rtol=1e-6)
    assert np.asarray(y).any(axis=-1).all()  # every slot came back
    for g, dense_g in zip(grads, dense_grads):
        np.testing.assert_allclose(np.asarray(g), np.asarray(dense_g), rtol=1e-5, atol=1e-6)
    if skewed:  # device 2 takes a full block from device 0 (S / k tokens of min(k, E / N) = 2 slots), the others none
        rows_e = np.asarray(rows_e).reshape(N, N, S)
        assert (rows_e[2, 0] < E // N).all() and (rows_e[[0, 1, 3], 0] == E // N).all()
    with pytest.raises(ValueError, match="dropless plan"):
        plan = ep.send_plan(jnp.asarray(experts[0]), N, E // N, capacity=2)
        jax.eval_shape(lambda: _compat.shard_map(
            lambda e: ep.dispatch(jnp.zeros((S, D)), plan, "expert", ragged=True)[1][None], mesh=mesh,
            in_specs=P("expert"), out_specs=P("expert"))(experts))


def test_the_ragged_paths_backward_sums_nothing_over_the_expert_axis():
    """jax.lax.ragged_all_to_all's result takes the type of its output buffer: a buffer that does not vary over the
    axis makes the received rows unvarying, and autodiff then psums their cotangent over the experts' devices (wrong
    gradients, and on Mixtral-8x7B over expert=8 37 GB more all-reduce a step). The buffers vary like the data, so the
    backward holds the psums of the dense path and no more. Traced only: XLA:CPU cannot compile the collective."""
    mesh = _compat.make_mesh((N,), ("expert",), devices=jax.devices()[:N])
    experts = np.random.default_rng(3).integers(0, E, (N, S)).astype(np.int32)

    def psums(ragged):
        def body(experts_S, x_SxD, w_D):
            plan = ep.send_plan(experts_S[0], N, E // N)
            rows_x, _ = ep.dispatch(x_SxD[0], plan, "expert", ragged=ragged)
            assert "expert" in _compat.varying_axes(rows_x)
            return ep.combine(jnp.tanh(rows_x * w_D[None]), plan, "expert", ragged=ragged)[None]

        f = _compat.shard_map(body, mesh=mesh, in_specs=(P("expert"), P("expert"), P()), out_specs=P("expert"))
        grad = jax.grad(lambda x, w: jnp.sum(f(experts, x, w) ** 2), argnums=(0, 1))
        jaxpr = str(jax.make_jaxpr(grad)(np.ones((N, S, D), np.float32), np.ones(D, np.float32)))
        return len(re.findall(r"\bpsum\w*\[", jaxpr)), jaxpr.count("ragged_all_to_all")

    (ragged, n_ragged), (dense, _) = psums(True), psums(False)
    assert n_ragged >= 4 and ragged == dense == 1  # the replicated weight's gradient, summed over the axis


def test_group_rows_sorts_by_expert_and_leaves_empty_rows_out():
    order, sizes = ep.group_rows(jnp.array([2, 0, 4, 1, 0, 4], jnp.int32), 4)
    np.testing.assert_array_equal(np.asarray(sizes), [2, 1, 1, 0])
    np.testing.assert_array_equal(np.asarray(order)[:4], [1, 4, 3, 0])


# ---------------------------------------------------------------------------------------------------------------------
# The MoE train step with its experts split over the mesh's expert axis, against one device

MOE = ModelConfig(d_model=64, n_layers=2, n_heads=8, max_seq_len=32, n_experts=8, experts_per_token=2)
BATCH, SEQ = 16, 32
EP_MESHES = {  # mesh, strategy
    "expert4_data2": (dict(data=2, fsdp=1, expert=4), "dp"),
    "expert2_fsdp2_tensor2": (dict(data=1, fsdp=2, expert=2, tensor=2), "fsdp_tp"),
    "expert2_seq2_data2": (dict(data=2, fsdp=1, expert=2, seq=2), "dp"),  # ring attention, tokens split over seq
    # no expert axis: each device routes its own tokens through all the experts (moe.routes_per_device)
    "fsdp4_data2": (dict(data=2, fsdp=4), "fsdp"),
}
# Shard shapes of the stacked experts [layers, E, D, F] / [layers, E, F, D] and the router [layers, D, E]: the expert
# dim over `expert`, embed over fsdp, the expert's hidden dim over tensor; the router's expert dim never splits.
EXPERT_SHARDS = {
    "expert4_data2": {"w_in_ExDxF": (2, 2, 64, 256), "w_out_ExFxD": (2, 2, 256, 64), "router_DxE": (2, 64, 8)},
    "expert2_fsdp2_tensor2": {"w_in_ExDxF": (2, 4, 32, 128), "w_out_ExFxD": (2, 4, 128, 32),
                              "router_DxE": (2, 32, 8)},
    "expert2_seq2_data2": {"w_in_ExDxF": (2, 4, 64, 256), "w_out_ExFxD": (2, 4, 256, 64), "router_DxE": (2, 64, 8)},
    "fsdp4_data2": {"w_in_ExDxF": (2, 8, 16, 256), "w_out_ExFxD": (2, 8, 256, 16), "router_DxE": (2, 16, 8)},
}


def _train(model, mesh_kw, strategy, devices=None, n_steps=2):
    optim = OptimConfig(lr=1e-3, warmup_steps=0, eps=1e-3)
    task = make_task(model, ParallelConfig(strategy=strategy, **mesh_kw), optim=optim, devices=devices)
    state, step = task.init_state(), task.train_step()
    metrics = []
    for batch in random_batches(n_steps, batch=BATCH, seq=SEQ, keep=0.9):
        state, m = step(state, jax.device_put(batch, task.batch_sharding()))
        metrics.append({k: float(m[k]) for k in ("loss", "moe_aux_loss", "moe_z_loss", "moe_dropped_fraction")})
    return state, metrics


@pytest.fixture(scope="module")
def one_device():
    return _train(MOE, dict(data=1, fsdp=1), "dp", devices=jax.devices()[:1])


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == "expert4_data2"
                                                  else pytest.mark.slow) for n in EP_MESHES])
def test_the_expert_parallel_step_equals_one_device(name, one_device):
    mesh_kw, strategy = EP_MESHES[name]
    state, metrics = _train(MOE, mesh_kw, strategy)
    ref_state, ref_metrics = one_device
    for got, want in zip(metrics, ref_metrics):
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=1e-7, err_msg=f"{name}: {k}")
    ref = flat(ref_state.params)
    for path, leaf in flat(state.params).items():
        np.testing.assert_allclose(leaf, ref[path], rtol=1e-5, atol=2e-6, err_msg=f"{name}: {path}")
    for path, leaf in flat(state.params).items():
        key = path.rsplit("/", 1)[-1]
        if key in EXPERT_SHARDS[name]:
            assert leaf.addressable_shards[0].data.shape == EXPERT_SHARDS[name][key], (name, path)


@pytest.mark.slow
def test_qwen2_moe_layers_split_over_experts_as_on_one_device():
    """Qwen2-MoE's block (q/k/v biases alone, top-k weights kept as the softmax scored them, one shared expert of its
    own width scaled by a sigmoid gate): a step over expert=4 x data=2 equals one device's."""
    qwen = dataclasses.replace(MOE, style="llama", use_bias=False, qkv_bias=True, n_shared_experts=1,
                               shared_mlp_dim=96, shared_expert_gate=True, router_norm_topk=False)
    ref_state, ref = _train(qwen, dict(data=1, fsdp=1), "dp", devices=jax.devices()[:1], n_steps=1)
    state, got = _train(qwen, *EP_MESHES["expert4_data2"], n_steps=1)
    for k in ref[0]:
        np.testing.assert_allclose(got[0][k], ref[0][k], rtol=2e-5, atol=1e-7, err_msg=k)
    want = flat(ref_state.params)
    assert any(p.endswith("shared_gate_Dx1") for p in want) and any(p.endswith("bias_q_HxDh") for p in want)
    for path, leaf in flat(state.params).items():
        np.testing.assert_allclose(leaf, want[path], rtol=1e-5, atol=2e-6, err_msg=path)


@pytest.mark.slow
def test_the_router_bias_moves_over_experts_as_on_one_device():
    """Loss-free balancing over expert=2 x fsdp=2 x tensor=2: each device chooses with the whole bias and hands it the
    loads of the whole batch, so three steps leave every bias (and every other parameter) as one device's do."""
    biased = dataclasses.replace(MOE, router_bias=True, router_bias_update_rate=0.003)
    ref_state, ref = _train(biased, dict(data=1, fsdp=1), "dp", devices=jax.devices()[:1], n_steps=3)
    state, got = _train(biased, *EP_MESHES["expert2_fsdp2_tensor2"], n_steps=3)
    for g, w in zip(got, ref):
        for k in w:
            np.testing.assert_allclose(g[k], w[k], rtol=2e-5, atol=1e-7, err_msg=k)
    want = flat(ref_state.params)
    bias = np.asarray(want["blocks/mlp/router_bias_E"])
    # three steps of +-rate: most entries end an odd multiple of it away from zero, none of them at zero here
    assert bias.shape == (2, 8) and (np.abs(bias) > 0.002).mean() > 0.5, bias
    for path, leaf in flat(state.params).items():
        np.testing.assert_allclose(leaf, want[path], rtol=1e-5, atol=2e-6, err_msg=path)


def test_without_an_expert_axis_each_device_sorts_only_its_own_token_slots():
    """Under jit alone the sort by expert would gather every slot of the batch onto every device (each then running
    the experts on all of them); routed per device, the compiled step's sorts see 1/8 of the slots."""
    task = make_task(MOE, ParallelConfig(strategy="fsdp", data=2, fsdp=4))
    assert task.hooks is not None and task.hooks.experts is not None
    batch = {k: jax.ShapeDtypeStruct((BATCH, SEQ), d, sharding=task.batch_sharding())
             for k, d in (("inputs", jnp.int32), ("targets", jnp.int32), ("mask", jnp.float32))}
    hlo = task.train_step().lower(task.abstract_state(), batch).compile().as_text()
    slots = BATCH * SEQ * MOE.experts_per_token
    sort_sizes = {int(m) for m in re.findall(r"s32\[(\d+)\]\{[^}]*\} sort\(", hlo)}
    sort_sizes |= {int(m) for m in re.findall(r"\(s32\[(\d+)\]\{[^}]*\}, s32\[\d+\]\{[^}]*\}\) sort\(", hlo)}
    assert slots // 8 in sort_sizes and slots not in sort_sizes, sorted(sort_sizes)


@pytest.mark.slow
def test_the_capacity_path_splits_over_experts_and_counts_what_it_drops(one_device):
    """With room for every slot it equals dropless (one device's step); with little room it drops, and says how
    much."""
    roomy = dataclasses.replace(MOE, capacity_factor=8.0)
    _, full = _train(roomy, *EP_MESHES["expert4_data2"], n_steps=1)
    np.testing.assert_allclose(full[0]["loss"], one_device[1][0]["loss"], rtol=2e-5)
    assert full[0]["moe_dropped_fraction"] == 0.0
    _, tight = _train(dataclasses.replace(MOE, capacity_factor=0.5), *EP_MESHES["expert4_data2"], n_steps=1)
    assert 0.5 <= tight[0]["moe_dropped_fraction"] < 1.0  # at most half the slots fit


@pytest.mark.parametrize("model,parallel,match", [
    (ModelConfig(d_model=64, n_layers=2, n_heads=8), dict(expert=2, fsdp=4),
     r"^parallel.expert=2 splits the experts over 2 devices but model.n_experts=0: set parallel.expert=1"),
    (dataclasses.replace(MOE, n_experts=6), dict(expert=4, fsdp=2),
     r"model.n_experts=6: use an expert count that is a multiple of 4$"),
    (MOE, dict(expert=4, fsdp=2, flavour="shard_map"), r"runs with parallel.flavour=jit"),
])
def test_expert_parallel_refusals_come_before_compiling(model, parallel, match):
    cfg = TrainConfig(model=model, parallel=ParallelConfig(**parallel), batch_size=16)
    with pytest.raises(ConfigError, match=match):
        validate(cfg, 8)


def test_the_start_up_line_counts_slots_per_expert_and_all_to_all_bytes():
    cfg = TrainConfig(model=MOE, parallel=ParallelConfig(data=2, fsdp=1, expert=4), batch_size=16, seq_len=32)
    line = moe.describe(cfg, {"data": 2, "fsdp": 1, "expert": 4})
    # 16 x 32 tokens x top-2 over 8 experts: 128 slots each. A device holds 16 x 32 / 8 = 64 tokens, 128 slots: a
    # dropless block is 128 rows of 64 fp32 values and an int32 id; 4 all-to-alls in each of 2 layers, 3 blocks sent
    sent = 4 * 2 * 3 * 128 * (64 * 4 + 4)
    assert line == (f"moe: 2 of 2 layers, 8 experts (top-2), 2 per device over expert=4; 128 token slots per expert "
                    f"per layer and step on average; all-to-all {sent / 2**20:.1f} MiB sent per device per step "
                    f"(128 rows per block)")
    capped = dataclasses.replace(cfg, model=dataclasses.replace(MOE, capacity_factor=1.0))
    assert "capacity factor 1; all-to-all" in moe.describe(capped, {"data": 2, "expert": 4})
    assert "(32 rows per block)" in moe.describe(capped, {"data": 2, "expert": 4})  # 2 experts x C = 64 x 2 / 8
    # one expert per device: a token sends at most one of its two slots to each, so a block is 64 tokens' 64 rows
    assert "(64 rows per block)" in moe.describe(cfg, {"data": 1, "fsdp": 1, "expert": 8})
    # settled for TPU: ragged, the 128 slots a device routes less the quarter it keeps, under balanced routing
    ragged = 4 * 2 * 128 * 3 / 4 * (64 * 4 + 4)
    assert moe.describe(cfg, {"data": 2, "fsdp": 1, "expert": 4}, "tpu").endswith(
        f"; ragged all-to-all {ragged / 2**20:.1f} MiB sent per device per step with balanced routing (blocks of "
        f"128 rows received)")
    assert "capacity factor 1; all-to-all" in moe.describe(capped, {"data": 2, "expert": 4}, "tpu")
