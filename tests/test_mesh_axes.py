"""The stage (pipeline) and seq (context) mesh axes and Megatron sequence parallelism inside the train step: parity
with one device, literal shard shapes, 1F1B's memory against GPipe's, and the refusals."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import flat, make_task, random_batches

from jaxperf.config import (
    ConfigError,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    get_config,
    validate,
)

MODEL = ModelConfig(d_model=64, n_layers=2, n_heads=8, max_seq_len=32)
BATCH, SEQ, STEPS = 16, 32, 2
OPTIM = OptimConfig(lr=1e-3, warmup_steps=0, eps=1e-3)  # see tests/test_parallel.py: about sharding, not noise

# name: (mesh and strategy, pipeline microbatches, packed documents in the batch)
CASES = {
    "stage2_data4_gpipe": (dict(strategy="dp", data=4, fsdp=1, stage=2, schedule="gpipe"), 2, False),
    "stage2_data4_1f1b": (dict(strategy="dp", data=4, fsdp=1, stage=2, schedule="1f1b"), 4, False),
    "seq4_data2_segments": (dict(strategy="dp", data=2, fsdp=1, seq=4), 1, True),
    "seq4_data2_contiguous": (dict(strategy="dp", data=2, fsdp=1, seq=4, context_layout="contiguous"), 1, True),
    # On two devices: beside a data-parallel axis XLA:CPU has aborted this step (its collectives out of order).
    "tensor2_sp": (dict(strategy="tp", data=1, fsdp=1, tensor=2, sequence_parallel=True), 1, False),
    "fsdp2_stage2_seq2": (dict(strategy="fsdp", fsdp=2, stage=2, seq=2), 2, False),
    "tensor2_stage2_seq2": (dict(strategy="tp", tensor=2, stage=2, seq=2), 2, False),
}

# Shard shapes written out from the rule tables (global: embed (256, 64), wq (2, 64, 8, 8), w_in (2, 64, 256),
# attn_norm/scale (2, 64)): stage splits the stacked layers, fsdp the embed dim (norm scales stay whole), tensor
# heads / MLP / vocab; data and seq replicate weights.
SHARDS = {
    "stage2_data4_gpipe": {"embed_VxD": (256, 64), "blocks/attn/wq_DxHxDh": (1, 64, 8, 8),
                           "blocks/mlp/w_in_DxF": (1, 64, 256), "blocks/attn_norm/scale": (1, 64)},
    "stage2_data4_1f1b": {"embed_VxD": (256, 64), "blocks/attn/wq_DxHxDh": (1, 64, 8, 8),
                          "blocks/mlp/w_in_DxF": (1, 64, 256), "blocks/attn_norm/scale": (1, 64)},
    "seq4_data2_segments": {"embed_VxD": (256, 64), "blocks/attn/wq_DxHxDh": (2, 64, 8, 8),
                            "blocks/mlp/w_in_DxF": (2, 64, 256), "blocks/attn_norm/scale": (2, 64)},
    "seq4_data2_contiguous": {"embed_VxD": (256, 64), "blocks/attn/wq_DxHxDh": (2, 64, 8, 8),
                              "blocks/mlp/w_in_DxF": (2, 64, 256), "blocks/attn_norm/scale": (2, 64)},
    "tensor2_sp": {"embed_VxD": (128, 64), "blocks/attn/wq_DxHxDh": (2, 64, 4, 8),
                   "blocks/mlp/w_in_DxF": (2, 64, 128), "blocks/attn_norm/scale": (2, 64)},
    "fsdp2_stage2_seq2": {"embed_VxD": (256, 32), "blocks/attn/wq_DxHxDh": (1, 32, 8, 8),
                          "blocks/mlp/w_in_DxF": (1, 32, 256), "blocks/attn_norm/scale": (1, 64)},
    "tensor2_stage2_seq2": {"embed_VxD": (128, 64), "blocks/attn/wq_DxHxDh": (1, 64, 4, 8),
                            "blocks/mlp/w_in_DxF": (1, 64, 128), "blocks/attn_norm/scale": (1, 64)},
}


def _batches(packed: bool) -> list[dict]:
    batches = random_batches(STEPS, batch=BATCH, seq=SEQ, keep=0.9)
    if packed:  # two or three documents per row, cut at random places: attention must not cross a cut
        rng = np.random.default_rng(7)
        for b in batches:
            cuts = np.sort(rng.integers(1, SEQ, (BATCH, 2)), axis=1)
            pos = np.arange(SEQ)[None]
            b["segment_ids"] = ((pos >= cuts[:, :1]).astype(np.int32) + (pos >= cuts[:, 1:]).astype(np.int32))
    return batches


def _run(parallel: dict, microbatches: int, packed: bool, devices=None, model=MODEL):
    task = make_task(model, ParallelConfig(**parallel), optim=OPTIM, devices=devices, microbatches=microbatches)
    state, step, losses = task.init_state(), task.train_step(), []
    for batch in _batches(packed):
        state, metrics = step(state, jax.device_put(batch, task.batch_sharding()))
        losses.append(float(metrics["loss"]))
    return state, losses


@pytest.fixture(scope="module")
def one_device():
    return {packed: _run(dict(strategy="dp", data=1, fsdp=1), 1, packed, devices=jax.devices()[:1])
            for packed in (False, True)}


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.slow) if n in ("stage2_data4_gpipe", "stage2_data4_1f1b", "seq4_data2_contiguous",
                                                      "tensor2_stage2_seq2", "fsdp2_stage2_seq2")
    else n
    for n in CASES])
def test_matches_one_device_and_shards_as_written(name, one_device):
    parallel, microbatches, packed = CASES[name]
    n_devices = math.prod(parallel.get(a, 1) for a in ("data", "stage", "fsdp", "seq", "tensor"))
    state, losses = _run(parallel, microbatches, packed, devices=jax.devices()[:n_devices])
    ref_state, ref_losses = one_device[packed]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, err_msg=name)
    assert ref_losses[1] < ref_losses[0]
    ref = flat(ref_state.params)
    params = flat(state.params)
    for path, leaf in params.items():
        np.testing.assert_allclose(leaf, ref[path], rtol=1e-5, atol=2e-6, err_msg=f"{name}: {path}")
    for path, shape in SHARDS[name].items():
        for shard in params[path].addressable_shards:
            assert shard.data.shape == shape, f"{name}: {path} shard {shard.data.shape} != {shape}"


@pytest.mark.slow
@pytest.mark.parametrize("parallel,microbatches", [
    (dict(strategy="fsdp", fsdp=2, stage=2, seq=2), 2),
    (dict(strategy="fsdp_tp", data=1, fsdp=2, tensor=2, sequence_parallel=True), 1),
], ids=["fsdp2_stage2_seq2", "fsdp2_tensor2_sp"])
def test_gathered_mlp_weights_under_stage_seq_and_sequence_parallelism_match_one_device(parallel, microbatches,
                                                                                         one_device, monkeypatch):
    """`model.gather_mlp_weights` (on for large weights on TPU) inside the pipeline's stages, beside ring attention,
    and under Megatron sequence parallelism's collective matmuls: the weights are gathered, and the numbers are one
    device's."""
    from jaxperf.parallel import rules

    real, calls = rules._gather_to, []
    monkeypatch.setattr(rules, "_gather_to", lambda w, to, own: calls.append(own.spec) or real(w, to, own))
    n_devices = math.prod(parallel.get(a, 1) for a in ("data", "stage", "fsdp", "seq", "tensor"))
    model = dataclasses.replace(MODEL, gather_mlp_weights=True)
    state, losses = _run(parallel, microbatches, False, devices=jax.devices()[:n_devices], model=model)
    assert calls, "no MLP weight was gathered"
    ref_state, ref_losses = one_device[False]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    ref = flat(ref_state.params)
    for path, leaf in flat(state.params).items():
        np.testing.assert_allclose(leaf, ref[path], rtol=1e-5, atol=2e-6, err_msg=path)


def test_packed_documents_change_the_loss():
    """The segment ids reach attention: the same tokens without them give another loss (else the seq cases above
    would prove nothing about them)."""
    with_ids = _batches(True)[0]
    without = {k: v for k, v in with_ids.items() if k != "segment_ids"}
    task = make_task(MODEL, ParallelConfig(strategy="dp", data=2, fsdp=1, seq=4), optim=OPTIM)
    state = task.init_state()
    loss = task.eval_step()
    a = float(loss(state, jax.device_put(with_ids, task.batch_sharding()))["loss"])
    b = float(loss(state, jax.device_put(without, task.batch_sharding()))["loss"])
    assert abs(a - b) > 1e-4, (a, b)


def _temp_bytes(schedule: str) -> int:
    model = ModelConfig(d_model=64, n_layers=4, n_heads=4, max_seq_len=64)
    task = make_task(model, ParallelConfig(strategy="dp", data=2, fsdp=1, stage=4, schedule=schedule), optim=OPTIM,
                     microbatches=16)
    batch = {k: jax.ShapeDtypeStruct((32, 64), dt, sharding=task.batch_sharding())
             for k, dt in (("inputs", jnp.int32), ("targets", jnp.int32), ("mask", jnp.float32))}
    compiled = task.train_step().lower(task.abstract_state(), batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_1f1b_holds_less_than_gpipe_in_the_compiled_step():
    """Same 16 microbatches over 4 stages: GPipe keeps all 16 stage inputs until the backward, 1F1B (one forward and
    one backward per tick) at most 2 x 4."""
    gpipe, one_f_one_b = _temp_bytes("gpipe"), _temp_bytes("1f1b")
    assert one_f_one_b < gpipe, (one_f_one_b, gpipe)


@pytest.mark.parametrize("args, message", [
    (["stage=4", "model.n_layers=6", "microbatches=4"], r"model.n_layers=6 does not split over parallel.stage=4"),
    (["seq=4", "seq_len=36"], r"seq_len=36 does not split into 8 equal chunks \(parallel.seq=4 x 2 for the zigzag"),
    (["stage=4", "model.n_layers=4", "microbatches=2"], r"microbatches=2 is fewer than the parallel.stage=4"),
])
def test_bad_mesh_inputs_are_refused_before_compiling(args, message):
    """Checked from the config alone (validate runs before any model is built or step compiled)."""
    with pytest.raises(ConfigError, match=message):
        validate(get_config("tiny", ["data=1", "fsdp=-1", *args]), 8)


def test_stage_with_packed_documents_is_refused():
    task = make_task(MODEL, ParallelConfig(strategy="dp", data=4, fsdp=1, stage=2), optim=OPTIM, microbatches=2)
    batch = jax.device_put(_batches(True)[0], task.batch_sharding())
    with pytest.raises(ValueError, match="segment_ids"):
        task.train_step()(task.init_state(), batch)


def _compiled_text(parallel: dict) -> str:
    task = make_task(MODEL, ParallelConfig(**parallel), optim=OPTIM)
    batch = {k: jax.ShapeDtypeStruct((BATCH, SEQ), dt, sharding=task.batch_sharding())
             for k, dt in (("inputs", jnp.int32), ("targets", jnp.int32), ("mask", jnp.float32))}
    return task.train_step().lower(task.abstract_state(), batch).compile().as_text()


@pytest.mark.slow
def test_sequence_parallel_moves_blocks_with_collective_matmuls():
    """Megatron-SP: the layers' gathers and scatters run as ppermute rings inside the matmuls (collective matmul);
    plain tensor parallelism all-reduces the row-parallel outputs instead and permutes nothing."""
    tp = dict(strategy="tp", data=4, fsdp=1, tensor=2)
    plain, sp = _compiled_text(tp), _compiled_text({**tp, "sequence_parallel": True})
    assert "collective-permute" not in plain
    assert plain.count("all-reduce(") > sp.count("all-reduce(")
    # 2 layers x (3 column + 2 row matmuls) in the forward, more in the backward: many permutes, each one block
    assert sp.count("collective-permute(") >= 10, sp.count("collective-permute(")
