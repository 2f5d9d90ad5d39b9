"""Step flavours: the shard_map and pmap steps (jaxperf.explicit.flavours) give the single-device jit numbers, store what
they say they store, refuse what they cannot run before compiling, and drive the Trainer and the CLI."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest

from helpers import SMALL_RUN, flat, make_task, random_batches, run_cli
from jaxperf.config import ConfigError, ModelConfig, OptimConfig, ParallelConfig, TrainConfig, get_config, validate
from jaxperf.explicit.flavours import build_train_step
from jaxperf.models import GPT
from jaxperf.models.gpt import gpt_loss
from jaxperf.parallel.mesh import make_mesh
from jaxperf.step.task import Task, build_task
from jaxperf.checkpoint import Checkpointer
from jaxperf.train.trainer import Trainer

# 2 scanned layers, 4 heads of 8, mlp 128, vocab 256, fp32 for tight comparisons.
# A rolled layer loop (on CPU two layers would otherwise run unrolled): the tests look for collectives inside it.
MODEL = ModelConfig(d_model=32, n_layers=2, n_heads=4, max_seq_len=16, scan_unroll=1)
BATCH, SEQ, STEPS = 16, 16, 2
OPTIM = OptimConfig(lr=1e-3, warmup_steps=0, decay_steps=10, eps=1e-3)  # eps: see tests/test_parallel.py

# Global shapes: embed (256, 32), pos (16, 32), norms (32,) / (2, 32), wq/wk/wv (2, 32, 4, 8), wo (2, 4, 8, 32),
# bias_q/k/v (2, 4, 8), bias_o (2, 32), w_in (2, 32, 128), bias_in (2, 128), w_out (2, 128, 32), bias_out (2, 32).
# Shard shape per device, by hand from the rule tables (fsdp: each weight's embed dim over `fsdp`, the data axis
# replicates; tp: heads, kv heads, mlp and vocab over `tensor`): the jit strategies' placement, so checkpoints move
# between flavours unchanged.
SHARD_SHAPES = {
    #                         replicated       fsdp=8          data=2 x fsdp=4   tensor=4         fsdp=4 x tensor=2
    "embed_VxD": [(256, 32), (256, 4), (256, 8), (64, 32), (128, 8)],
    "pos_LxD": [(16, 32), (16, 4), (16, 8), (16, 32), (16, 8)],
    "final_norm/scale": [(32,), (32,), (32,), (32,), (32,)],
    "final_norm/bias": [(32,), (32,), (32,), (32,), (32,)],
    "blocks/attn_norm/scale": [(2, 32), (2, 32), (2, 32), (2, 32), (2, 32)],
    "blocks/attn_norm/bias": [(2, 32), (2, 32), (2, 32), (2, 32), (2, 32)],
    "blocks/mlp_norm/scale": [(2, 32), (2, 32), (2, 32), (2, 32), (2, 32)],
    "blocks/mlp_norm/bias": [(2, 32), (2, 32), (2, 32), (2, 32), (2, 32)],
    "blocks/attn/wq_DxHxDh": [(2, 32, 4, 8), (2, 4, 4, 8), (2, 8, 4, 8), (2, 32, 1, 8), (2, 8, 2, 8)],
    "blocks/attn/wk_DxKxDh": [(2, 32, 4, 8), (2, 4, 4, 8), (2, 8, 4, 8), (2, 32, 1, 8), (2, 8, 2, 8)],
    "blocks/attn/wv_DxKxDh": [(2, 32, 4, 8), (2, 4, 4, 8), (2, 8, 4, 8), (2, 32, 1, 8), (2, 8, 2, 8)],
    "blocks/attn/wo_HxDhxD": [(2, 4, 8, 32), (2, 4, 8, 4), (2, 4, 8, 8), (2, 1, 8, 32), (2, 2, 8, 8)],
    "blocks/attn/bias_q_HxDh": [(2, 4, 8), (2, 4, 8), (2, 4, 8), (2, 1, 8), (2, 2, 8)],  # no embed dim
    "blocks/attn/bias_k_KxDh": [(2, 4, 8), (2, 4, 8), (2, 4, 8), (2, 1, 8), (2, 2, 8)],
    "blocks/attn/bias_v_KxDh": [(2, 4, 8), (2, 4, 8), (2, 4, 8), (2, 1, 8), (2, 2, 8)],
    "blocks/attn/bias_o_D": [(2, 32), (2, 4), (2, 8), (2, 32), (2, 8)],
    "blocks/mlp/w_in_DxF": [(2, 32, 128), (2, 4, 128), (2, 8, 128), (2, 32, 32), (2, 8, 64)],
    "blocks/mlp/bias_in_F": [(2, 128), (2, 128), (2, 128), (2, 32), (2, 64)],
    "blocks/mlp/w_out_FxD": [(2, 128, 32), (2, 128, 4), (2, 128, 8), (2, 32, 32), (2, 64, 8)],
    "blocks/mlp/bias_out_D": [(2, 32), (2, 4), (2, 8), (2, 32), (2, 8)],
}
REPLICATED, FSDP8, HSDP, TP4, FSDP4_TP2 = range(5)

# (flavour, strategy, mesh, microbatches, column of SHARD_SHAPES)
CASES = {
    "shard_map-dp-data2xfsdp4-micro2": ("shard_map", "dp", dict(data=2, fsdp=4), 2, REPLICATED),
    "shard_map-fsdp": ("shard_map", "fsdp", dict(data=1, fsdp=8), 1, FSDP8),
    "shard_map-fsdp-data2xfsdp4-micro2": ("shard_map", "fsdp", dict(data=2, fsdp=4), 2, HSDP),
    # Megatron: each device runs its own heads and MLP columns, psum after the row-parallel matmuls.
    "shard_map-tp-data2xtensor4": ("shard_map", "tp", dict(data=2, fsdp=1, tensor=4), 1, TP4),
    "shard_map-fsdp_tp-fsdp4xtensor2-micro2": ("shard_map", "fsdp_tp", dict(data=1, fsdp=4, tensor=2), 2, FSDP4_TP2),
    "pmap-dp": ("pmap", "dp", dict(data=8, fsdp=1), 1, REPLICATED),
}


def _batches(n: int):
    # A ragged mask: devices and microbatches hold different token counts, so a plain mean of per-device means
    # would not be the big-batch gradient.
    return random_batches(n, batch=BATCH, seq=SEQ, keep=0.7)


def _task(strategy: str, mesh_kw: dict, devices=None, model=MODEL) -> Task:
    return make_task(model, ParallelConfig(strategy=strategy, **mesh_kw), optim=OPTIM, devices=devices)


def _run(flavour, strategy, mesh_kw, microbatches=1, devices=None):
    """STEPS steps; returns (state in the flavour's own layout, state as the jit step lays it out, losses, params
    after each step)."""
    task = _task(strategy, mesh_kw, devices)
    step = build_train_step(task, task.loss_fn, flavour, microbatches=microbatches)
    state = step.to_step(task.init_state())
    losses, history = [], []
    for batch in _batches(STEPS):
        state, metrics = step(state, jax.device_put(batch, task.batch_sharding()))
        losses.append(float(metrics["loss"]))
        history.append(jax.device_get(step.from_step(state).params))
    return state, step.from_step(state), losses, history


@pytest.fixture(scope="module")
def single_device():
    _, state, losses, history = _run("jit", "dp", dict(data=1, fsdp=1, tensor=1), devices=jax.devices()[:1])
    return state, losses, history


# At both ends of the jax range: pmap and the shard_map step under each strategy once; the meshes with two axes and
# microbatches are slow tests (one Python version runs them: .ci/run)
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n.endswith("-micro2") else n
                                  for n in CASES])
def test_flavour_matches_single_device_jit(name, single_device):
    flavour, strategy, mesh_kw, micro, col = CASES[name]
    own, state, losses, history = _run(flavour, strategy, mesh_kw, micro)
    _, ref_losses, ref_history = single_device
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, err_msg=f"{name}: losses")
    for n in range(STEPS):
        ref = flat(ref_history[n])
        for path, leaf in flat(history[n]).items():
            np.testing.assert_allclose(leaf, ref[path], rtol=1e-5, atol=2e-6, err_msg=f"{name}: {path} after {n + 1}")

    # What each device stores, parameters and Adam moments alike.
    adam = state.opt_state[1][0]  # chain(clip, adamw) -> adamw = chain(scale_by_adam, ...) -> ScaleByAdamState
    params = flat(state.params)
    assert set(params) == set(SHARD_SHAPES), set(params) ^ set(SHARD_SHAPES)
    for label, tree in (("param", params), ("mu", flat(adam.mu)), ("nu", flat(adam.nu))):
        for path, leaf in tree.items():
            shard = leaf.addressable_shards[0].data.shape
            want = SHARD_SHAPES[path][col]
            assert shard == want, f"{name}: {label} {path} shard {shard} != {want}"

    if strategy != "dp":  # the jit strategy's placement (so the literal shapes above say the same for both flavours)
        task = _task(strategy, mesh_kw)
        for path, leaf in params.items():
            assert leaf.sharding.is_equivalent_to(flat(task.param_shardings)[path], leaf.ndim), path

    if flavour == "pmap":  # inside, a leading device axis of 8 whole replicas, one per device, all equal
        for path, leaf in flat(own.params).items():
            whole = SHARD_SHAPES[path][REPLICATED]
            assert leaf.shape == (8, *whole), (path, leaf.shape)
            assert leaf.addressable_shards[0].data.shape == (1, *whole), path
            replicas = np.asarray(leaf)
            np.testing.assert_array_equal(replicas, np.broadcast_to(replicas[:1], replicas.shape), err_msg=path)


def _collectives_by_computation(hlo: str, op: str = "all-reduce") -> dict[str, list[str]]:
    """{computation name ("ENTRY" for the entry): [its `op` instructions]} of a compiled program's text."""
    out: dict[str, list[str]] = {}
    current = None
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            current = "ENTRY" if line.startswith("ENTRY") else line.split(" ")[0]
        elif f" {op}(" in line or f" {op}-start(" in line:
            out.setdefault(current, []).append(line.strip())
    return out


def test_shard_map_fsdp_gathers_each_layer_inside_the_layer_loop():
    """ZeRO-3 under shard_map: a layer's weight shards are all-gathered inside the forward scan over layers and its
    gradient reduce-scattered inside the backward scan; only the embeddings are handled outside."""
    task = _task("fsdp", dict(data=2, fsdp=4))
    step = build_train_step(task, gpt_loss, "shard_map")
    batch = jax.device_put(_batches(1)[0], task.batch_sharding())
    hlo = step.fn.lower(task.init_state(), batch).compile().as_text()
    for op in ("all-gather", "reduce-scatter"):
        where = _collectives_by_computation(hlo, op)
        in_loops = [x for comp, xs in where.items() if comp != "ENTRY" for x in xs]
        # One layer's wq shard [8, 4, 8] of [32, 4, 8] (embed over fsdp=4): no leading layers axis, so per layer.
        assert any("f32[8,4,8]" in x or "f32[32,4,8]" in x for x in in_loops), (op, where)
        # Outside the loops: embed and positions (the norms' scales and biases are whole), nothing stacked over
        # layers.
        outside = where.get("ENTRY", [])
        assert len(outside) == 2 and not any("f32[2," in x for x in outside), (op, outside)


@pytest.mark.slow
def test_overlap_grad_reduce_matches_and_reduces_each_layer_inside_the_backward(single_device):
    """shard_map dp with overlap_grad_reduce: the same numbers, and the layers' gradients are all-reduced inside the
    backward scan over layers (its loop body) rather than all at once after it."""
    _, ref_losses, ref_history = single_device
    placement = {}
    for overlap in (False, True):
        task = _task("dp", dict(data=8, fsdp=1))
        step = build_train_step(task, gpt_loss, "shard_map", overlap_grad_reduce=overlap)
        state = task.init_state()
        batches = [jax.device_put(b, task.batch_sharding()) for b in _batches(STEPS)]
        placement[overlap] = _collectives_by_computation(step.fn.lower(state, batches[0]).compile().as_text())
        losses = []
        for batch in batches:
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, err_msg=f"overlap={overlap}: losses")
        ref = flat(ref_history[-1])
        for path, leaf in flat(jax.device_get(state.params)).items():
            np.testing.assert_allclose(leaf, ref[path], rtol=1e-5, atol=2e-6, err_msg=f"overlap={overlap}: {path}")

    assert set(placement[False]) == {"ENTRY"}, placement[False]  # every gradient reduced after the backward
    in_loop = [ar for comp, ars in placement[True].items() if comp != "ENTRY" for ar in ars]
    assert in_loop, placement[True]
    # One layer's weights (no leading layers axis): wq [32, 4, 8] and w_in [32, 128] go out from inside the loop.
    assert any("f32[32,4,8]" in ar and "f32[32,128]" in ar for ar in in_loop), in_loop
    assert not any("f32[2,32,4,8]" in ar for ars in placement[True].values() for ar in ars)


def test_overlap_grad_reduce_is_refused_where_it_cannot_run():
    fsdp = _task("fsdp", dict(data=1, fsdp=8))
    dp = _task("dp", dict(data=8, fsdp=1))
    before = len(_COMPILES)  # building a task may compile small eager ops (its seed); no step may compile below
    with pytest.raises(ConfigError, match=r"overlap_grad_reduce runs with strategy dp and one microbatch"):
        build_train_step(fsdp, gpt_loss, "shard_map", overlap_grad_reduce=True)
    with pytest.raises(ConfigError, match=r"microbatches=2"):
        build_train_step(dp, gpt_loss, "shard_map", microbatches=2, overlap_grad_reduce=True)
    with pytest.raises(ConfigError, match=r"is a shard_map option .* flavour=jit does not take it"):
        build_train_step(dp, gpt_loss, "jit", overlap_grad_reduce=True)
    cfg = get_config("tiny", ["flavour=jit", "strategy=dp", "data=8", "fsdp=1", "overlap_grad_reduce=true"])
    with pytest.raises(ConfigError, match=r"overlap_grad_reduce runs with parallel.flavour=shard_map"):
        Trainer(cfg, train_data=_Rows())
    assert len(_COMPILES) == before


# ---------------------------------------------------------------------------------------------------------------------
# Errors before compiling

_COMPILES: list[str] = []


def _count_compiles(event, duration, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES.append(event)


jax.monitoring.register_event_duration_secs_listener(_count_compiles)


class _Rows:
    """Training data that is never read: the tests below must fail before the first batch."""

    def batch(self, step, batch_size, *, rows=None):  # pragma: no cover - must not be reached
        raise AssertionError("a batch was requested before the config error")


def test_bad_flavour_name_is_a_config_error():
    with pytest.raises(ConfigError, match=r"unknown parallel.flavour 'shardmap'; choose one of jit, shard_map, pmap.*"
                                          r"Did you mean 'shard_map'"):
        get_config("tiny", ["parallel.flavour=shardmap", "parallel.strategy=dp"])
    cfg = get_config("tiny", ["parallel.strategy=dp"])  # a config built in Python is checked all the same
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, flavour="shardmap"))
    with pytest.raises(ConfigError, match=r"unknown parallel.flavour 'shardmap'; choose one of jit, shard_map, pmap"):
        validate(cfg, 8)
    before = len(_COMPILES)
    with pytest.raises(ConfigError, match="Did you mean 'shard_map'"):
        Trainer(cfg, train_data=_Rows())
    task = _task("dp", dict(data=8, fsdp=1))
    with pytest.raises(ConfigError, match="choose one of jit, shard_map, pmap"):
        build_train_step(task, gpt_loss, "vmap")
    assert len(_COMPILES) == before


@pytest.mark.parametrize("overrides, message", [
    (["flavour=shard_map", "strategy=tp", "fsdp=1", "tensor=8"],
     r"model.n_heads=4 is not divisible by the tensor-parallel size parallel.tensor=8"),
    (["flavour=pmap", "strategy=tp", "fsdp=1", "tensor=8"],
     r"parallel.flavour=pmap supports parallel.strategy dp, not 'tp': use parallel.flavour=jit or "
     r"parallel.flavour=shard_map for tp"),
    (["flavour=pmap", "strategy=fsdp", "fsdp=8"],
     r"parallel.flavour=pmap supports parallel.strategy dp, not 'fsdp': use parallel.flavour=jit or "
     r"parallel.flavour=shard_map for fsdp"),
])
def test_unsupported_flavour_and_strategy_is_a_config_error(overrides, message):
    before = len(_COMPILES)
    with pytest.raises(ConfigError, match=message):
        Trainer(get_config("tiny", overrides), train_data=_Rows())
    assert len(_COMPILES) == before


def test_step_builder_checks_the_rule_table_itself():
    """Without the config (research code building steps directly) the rule table is judged: Megatron under shard_map
    needs every MLP column block split evenly over `tensor` (30 columns over 4 devices are not), and pmap wants
    every parameter whole."""
    before = len(_COMPILES)
    odd_mlp = dataclasses.replace(MODEL, mlp_dim=30)
    tp = _task("tp", dict(data=2, fsdp=1, tensor=4), model=odd_mlp)
    with pytest.raises(ConfigError, match=r"parameter blocks/mlp/\S+ .* its 30 mlp do not divide over tensor=4"):
        build_train_step(tp, gpt_loss, "shard_map")
    fsdp = _task("fsdp", dict(data=1, fsdp=8))
    with pytest.raises(ConfigError, match=r"flavour=pmap keeps a whole copy .* shards 10 of them"):
        build_train_step(fsdp, gpt_loss, "pmap")
    assert len(_COMPILES) == before


# ---------------------------------------------------------------------------------------------------------------------
# The Trainer and the CLI


class _FixedBatches:
    """The parity tests' batches, served through the Trainer's data interface."""

    def __init__(self):
        self.batches = _batches(STEPS)

    def batch(self, step, batch_size, *, rows=None):
        assert batch_size == BATCH
        b = self.batches[step % STEPS]  # the prefetcher reads a little past max_steps
        return {k: v[rows] if rows is not None else v for k, v in b.items()}


@pytest.mark.slow
def test_trainer_with_pmap_matches_single_device_and_resumes_under_jit(tmp_path, single_device):
    common = ["strategy=dp", "data=8", "fsdp=1", f"batch_size={BATCH}", f"max_steps={STEPS}", "lr=1e-3",
              "warmup_steps=0", "decay_steps=10", "eps=1e-3", "eval_every=0", "eval_batches=0", "checkpoint_every=0",
              "sample_tokens=0", "tensorboard=false", "log_every=1", f"run_dir={tmp_path}"]
    make = lambda rngs: GPT(MODEL, rngs=rngs)  # noqa: E731
    trainer = Trainer(get_config("tiny", ["flavour=pmap", *common]), make_model=make, train_data=_FixedBatches())
    summary = trainer.fit()
    ref_state, ref_losses, _ = single_device
    np.testing.assert_allclose([summary["losses"][i] for i in range(STEPS)], ref_losses, rtol=1e-5)
    state = summary["state"]  # back in the usual layout: whole arrays replicated over the mesh
    wq = state.params["blocks"]["attn"]["wq_DxHxDh"]
    assert wq.shape == (2, 32, 4, 8) and wq.addressable_shards[0].data.shape == (2, 32, 4, 8)
    ref = flat(ref_state.params)
    for path, leaf in flat(state.params).items():
        np.testing.assert_allclose(np.asarray(leaf), np.asarray(ref[path]), rtol=1e-5, atol=2e-6, err_msg=path)

    # The checkpoint pmap wrote resumes in a jit run on another mesh.
    again = Trainer(get_config("tiny", ["flavour=jit", *common, "strategy=fsdp", "data=1", "fsdp=8"]),
                    make_model=make, train_data=_FixedBatches())
    with Checkpointer(tmp_path / "checkpoints") as ckpt:
        restored, start = again.init_or_restore(ckpt)
    assert start == STEPS
    emb = restored.params["embed_VxD"]
    assert emb.addressable_shards[0].data.shape == (256, 4)
    np.testing.assert_array_equal(np.asarray(emb), np.asarray(state.params["embed_VxD"]))


@pytest.mark.slow
def test_cli_train_with_shard_map_flavour(tmp_path):
    out = run_cli(tmp_path, "train", *SMALL_RUN, "max_steps=3", "parallel.flavour=shard_map", "run_dir=run",
                  devices=4)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "strategy fsdp, flavour shard_map, mesh data=1 stage=1 fsdp=4 expert=1 seq=1 tensor=1" in out.stdout, \
        out.stdout
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
    assert sorted(losses) == [1, 2, 3] and all(np.isfinite(list(losses.values()))), losses
    assert 5.0 < losses[1] < 6.0, losses  # ~ln(256) at initialisation
    assert (tmp_path / "run" / "checkpoints" / "3").is_dir()


@pytest.mark.parametrize("model,parallel", [
    pytest.param({}, dict(strategy="fsdp", flavour="shard_map", data=1, fsdp=8), id="shard_map-fsdp"),
    pytest.param({}, dict(strategy="fsdp", data=1, fsdp=4, seq=2), id="ring-seq2", marks=pytest.mark.slow),
    pytest.param(dict(n_experts=8, n_shared_experts=1, shared_expert_gate=True),
                 dict(strategy="dp", data=2, fsdp=1, expert=4), id="moe-expert4", marks=pytest.mark.slow),
])
def test_layer_gradient_stacks_in_the_compute_dtype_change_no_bit_of_a_sharded_step(model, parallel):
    """model.layer_grads_in_compute_dtype (the TPU default; jaxperf.models.layer_scan) where the layers carry hooks:
    gathered and reduce-scattered by hand, attention around a ring, experts behind an all-to-all. Two steps give the
    parameters of autodiff's remat-full scan, bit for bit."""
    base = ModelConfig(style="llama", d_model=64, n_layers=2, n_heads=4, max_seq_len=32, vocab_size=256,
                       dtype="bfloat16", remat="full", **model)
    params = []
    for on in (False, True):
        task = make_task(dataclasses.replace(base, layer_grads_in_compute_dtype=on), ParallelConfig(**parallel),
                         optim=OptimConfig(lr=1e-3, warmup_steps=0))
        state, step = task.init_state(), task.train_step()
        for batch in random_batches(2, batch=16, seq=32):
            state, _ = step(state, jax.device_put(batch, task.batch_sharding()))
        params.append(flat(state.params))
    assert params[0].keys() == params[1].keys()
    for k in params[0]:
        np.testing.assert_array_equal(np.asarray(params[0][k]), np.asarray(params[1][k]), err_msg=k)


def test_compiler_options_reach_each_flavours_step_and_nothing_else():
    """cfg.compiler_options go to jax.jit for the task's train and eval steps (every jit flavour), are checked
    against the attached compiler when the task is built, and the pmap step, which jax.jit does not build, refuses
    them."""
    parallel = ParallelConfig(strategy="fsdp", fsdp=8)
    cfg = TrainConfig(model=MODEL, optim=OPTIM, parallel=parallel, batch_size=BATCH,
                      compiler_options=("xla_embed_ir_in_executable=true",))
    mesh = make_mesh(parallel)
    task = build_task(cfg, mesh)
    assert task.compiler_options == {"xla_embed_ir_in_executable": True}
    state = task.init_state()
    batch = {k: np.asarray(v) for k, v in random_batches(1, batch=BATCH, seq=SEQ)[0].items()}
    build_train_step(task, task.loss_fn, "jit").fn(state, batch)  # an option the compiler knows: the step runs
    # a name the compiler does not know, given to a built task, fails the step's own compile: the option got there
    bad = task.replace(compiler_options={"no_such_xla_option": True})
    for step in (build_train_step(bad, bad.loss_fn, "jit").fn, build_train_step(bad, bad.loss_fn, "shard_map").fn,
                 bad.eval_step()):
        with pytest.raises(Exception, match="no_such_xla_option"):
            step.lower(task.abstract_state(), batch).compile()
    # ... and in a config it is one line when the task is built, before the step compiles
    with pytest.raises(ConfigError, match="CPU compiler refuses"):
        build_task(dataclasses.replace(cfg, compiler_options=("no_such_xla_option=1",)), mesh)
    # a TPU run's options: refused for a CPU step, no matter to a task that only serves (no train or eval step)
    tpu_run = dataclasses.replace(cfg, compiler_options=("xla_tpu_enable_windowed_einsum_for_reduce_scatter=false",))
    with pytest.raises(ConfigError, match="option of the TPU compiler"):
        build_task(tpu_run, mesh)
    assert build_task(tpu_run, mesh, with_optimizer=False).compiler_options is None
    dp = make_task(MODEL, ParallelConfig(strategy="dp", data=8), optim=OPTIM).replace(compiler_options={"a": 1})
    with pytest.raises(ConfigError, match="pmap step takes none"):
        build_train_step(dp, dp.loss_fn, "pmap")
    with pytest.raises(ConfigError, match="parallel.flavour=pmap takes none"):
        validate(dataclasses.replace(cfg, parallel=ParallelConfig(strategy="dp", flavour="pmap")), 8)
