"""Strategy parity: every rule table gives the single-device numbers, and really shards what it says it shards."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from helpers import flat, make_task, random_batches
from jaxperf.config import ConfigError, ModelConfig, OptimConfig, ParallelConfig, mesh_shape
from jaxperf.models import GPT
from jaxperf.parallel.mesh import make_mesh
from jaxperf.parallel import rules as rules_module
from jaxperf.models.layers import embed_lookup
from jaxperf.parallel.rules import (activation_sharding, cast_table_rows, constrain, gather_weight, get_rules,
                                    logical_to_spec)
from jaxperf.step.task import Task

# 8 heads so that tp=8 divides them; 2 scanned layers; vocab 256; fp32 for tight comparisons.
MODEL = ModelConfig(d_model=64, n_layers=2, n_heads=8, max_seq_len=32)
BATCH, SEQ = 16, 32

MESHES = {
    "dp": dict(data=8, fsdp=1, tensor=1),
    "fsdp": dict(data=1, fsdp=8, tensor=1),
    "tp": dict(data=1, fsdp=1, tensor=8),
    "fsdp_tp": dict(data=1, fsdp=4, tensor=2),
    "data_fsdp_tp": dict(data=2, fsdp=2, tensor=2),
}
STRATEGY = {"dp": "dp", "fsdp": "fsdp", "tp": "tp", "fsdp_tp": "fsdp_tp", "data_fsdp_tp": "fsdp_tp"}

# Shard shape of every parameter (and of its Adam moments) per mesh, written out by hand from the rule tables:
# fsdp splits each weight's embed dim (the norms' scales and biases, named `norm`, stay whole); tp splits heads,
# kv_heads, mlp and vocab; the data axis replicates weights.
# Global shapes: embed (256, 64), pos (32, 64), norms (64,) / (2, 64), wq/wk/wv (2, 64, 8, 8), wo (2, 8, 8, 64),
# bq/bk/bv (2, 8, 8), bo (2, 64), w_in (2, 64, 256), b_in (2, 256), w_out (2, 256, 64), b_out (2, 64).
SHARD_SHAPES = {
    #                                dp               fsdp            tp               fsdp_tp          data_fsdp_tp
    "embed_VxD": [(256, 64), (256, 8), (32, 64), (128, 16), (128, 32)],
    "pos_LxD": [(32, 64), (32, 8), (32, 64), (32, 16), (32, 32)],
    "final_norm/scale": [(64,), (64,), (64,), (64,), (64,)],
    "final_norm/bias": [(64,), (64,), (64,), (64,), (64,)],
    "blocks/attn_norm/scale": [(2, 64), (2, 64), (2, 64), (2, 64), (2, 64)],
    "blocks/attn_norm/bias": [(2, 64), (2, 64), (2, 64), (2, 64), (2, 64)],
    "blocks/mlp_norm/scale": [(2, 64), (2, 64), (2, 64), (2, 64), (2, 64)],
    "blocks/mlp_norm/bias": [(2, 64), (2, 64), (2, 64), (2, 64), (2, 64)],
    "blocks/attn/wq_DxHxDh": [(2, 64, 8, 8), (2, 8, 8, 8), (2, 64, 1, 8), (2, 16, 4, 8), (2, 32, 4, 8)],
    "blocks/attn/wk_DxKxDh": [(2, 64, 8, 8), (2, 8, 8, 8), (2, 64, 1, 8), (2, 16, 4, 8), (2, 32, 4, 8)],
    "blocks/attn/wv_DxKxDh": [(2, 64, 8, 8), (2, 8, 8, 8), (2, 64, 1, 8), (2, 16, 4, 8), (2, 32, 4, 8)],
    "blocks/attn/wo_HxDhxD": [(2, 8, 8, 64), (2, 8, 8, 8), (2, 1, 8, 64), (2, 4, 8, 16), (2, 4, 8, 32)],
    "blocks/attn/bias_q_HxDh": [(2, 8, 8), (2, 8, 8), (2, 1, 8), (2, 4, 8), (2, 4, 8)],
    "blocks/attn/bias_k_KxDh": [(2, 8, 8), (2, 8, 8), (2, 1, 8), (2, 4, 8), (2, 4, 8)],
    "blocks/attn/bias_v_KxDh": [(2, 8, 8), (2, 8, 8), (2, 1, 8), (2, 4, 8), (2, 4, 8)],
    "blocks/attn/bias_o_D": [(2, 64), (2, 8), (2, 64), (2, 16), (2, 32)],
    "blocks/mlp/w_in_DxF": [(2, 64, 256), (2, 8, 256), (2, 64, 32), (2, 16, 128), (2, 32, 128)],
    "blocks/mlp/bias_in_F": [(2, 256), (2, 256), (2, 32), (2, 128), (2, 128)],
    "blocks/mlp/w_out_FxD": [(2, 256, 64), (2, 256, 8), (2, 32, 64), (2, 128, 16), (2, 128, 32)],
    "blocks/mlp/bias_out_D": [(2, 64), (2, 8), (2, 64), (2, 16), (2, 32)],
}
ORDER = list(MESHES)


def _run(mesh_kw: dict, strategy: str, n_steps: int, devices=None, microbatches: int = 1, model=MODEL):
    """Train n_steps; returns (final state, losses, host copy of the params after each step)."""
    # eps=1e-3: Adam's first steps are ~lr * sign(g), so with the usual eps a gradient that is pure rounding noise
    # would move its parameter by up to lr; a larger eps keeps the comparison about sharding, not about noise.
    optim = OptimConfig(lr=1e-3, warmup_steps=0, eps=1e-3)
    task = make_task(model, ParallelConfig(strategy=strategy, **mesh_kw), optim=optim, devices=devices)
    state = task.init_state()
    step = task.train_step(microbatches=microbatches)
    losses, history = [], []
    for batch in random_batches(n_steps, batch=BATCH, seq=SEQ, keep=0.9):
        state, metrics = step(state, jax.device_put(batch, task.batch_sharding()))
        losses.append(float(metrics["loss"]))
        history.append(jax.device_get(state.params))
    return state, losses, history


@pytest.fixture(scope="module")
def single_device():
    return _run(dict(data=1, fsdp=1, tensor=1), "dp", 3, devices=jax.devices()[:1])


# At both ends of the jax range: fsdp and tp (the two rule tables the others combine); dp and the two-axis meshes are
# slow tests (one Python version runs them: .ci/run)
@pytest.mark.parametrize("name", [n if n in ("fsdp", "tp") else pytest.param(n, marks=pytest.mark.slow) for n in ORDER])
def test_strategy_matches_single_device(name, single_device):
    state, losses, history = _run(MESHES[name], STRATEGY[name], 3)
    _, ref_losses, ref_history = single_device
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, err_msg=f"{name}: losses")
    for n_steps in (1, 3):
        ref = flat(ref_history[n_steps - 1])
        for path, leaf in flat(history[n_steps - 1]).items():
            np.testing.assert_allclose(leaf, ref[path], rtol=1e-5, atol=2e-6,
                                       err_msg=f"{name}: {path} after {n_steps} steps")

    # Numbers alone do not prove anything was sharded: check every shard shape against the table.
    col = ORDER.index(name)
    params = flat(state.params)
    assert set(params) == set(SHARD_SHAPES), set(params) ^ set(SHARD_SHAPES)
    adam = state.opt_state[1][0]  # chain(clip, adamw) -> adamw = chain(scale_by_adam, ...) -> ScaleByAdamState
    for label, tree in (("param", params), ("mu", flat(adam.mu)), ("nu", flat(adam.nu))):
        for path, leaf in tree.items():
            shard = leaf.addressable_shards[0].data.shape
            assert shard == SHARD_SHAPES[path][col], f"{name}: {label} {path} shard {shard} != {SHARD_SHAPES[path][col]}"


@pytest.mark.slow
def test_gqa_llama_under_fsdp_tp():
    """Llama style with 4 query heads per KV head: shards KV heads over tensor, and matches one device."""
    llama = ModelConfig(style="llama", d_model=64, n_layers=2, n_heads=8, n_kv_heads=2, max_seq_len=32)
    state, losses, _ = _run(MESHES["fsdp_tp"], "fsdp_tp", 2, model=llama)
    ref_state, ref_losses, _ = _run(dict(data=1, fsdp=1, tensor=1), "dp", 2, devices=jax.devices()[:1], model=llama)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    wk = state.params["blocks"]["attn"]["wk_DxKxDh"]
    assert wk.shape == (2, 64, 2, 8)
    assert wk.addressable_shards[0].data.shape == (2, 16, 1, 8)
    np.testing.assert_allclose(np.asarray(wk), np.asarray(ref_state.params["blocks"]["attn"]["wk_DxKxDh"]), rtol=1e-5,
                               atol=2e-6)


def test_gradient_accumulation_equals_large_batch():
    """2 microbatches of 8 == one batch of 16, including a mask that weights microbatches unequally."""
    big, big_losses, _ = _run(MESHES["fsdp"], "fsdp", 2, microbatches=1)
    acc, acc_losses, _ = _run(MESHES["fsdp"], "fsdp", 2, microbatches=2)
    np.testing.assert_allclose(acc_losses, big_losses, rtol=1e-5)
    ref = flat(big.params)
    for path, leaf in flat(acc.params).items():
        np.testing.assert_allclose(np.asarray(leaf), np.asarray(ref[path]), rtol=1e-5, atol=2e-6, err_msg=path)


def test_gathered_mlp_weights_match_single_device(single_device, monkeypatch):
    """`model.gather_mlp_weights` (the TPU default for large weights) gathers each MLP weight whole before its matmul
    and sends the gradient back in the weight's own layout: under fsdp over 4 and tensor over 2, the numbers of one
    device, with both MLP weights gathered."""
    real, gathered = rules_module._gather_to, set()

    def counting(w, to, own):
        gathered.add(tuple((*spec, *[None] * (w.ndim - len(spec))) for spec in (to.spec, own.spec)))
        return real(w, to, own)

    monkeypatch.setattr(rules_module, "_gather_to", counting)
    state, losses, history = _run(MESHES["fsdp_tp"], "fsdp_tp", 3,
                                  model=dataclasses.replace(MODEL, gather_mlp_weights=True))
    assert gathered == {((None, "tensor"), ("fsdp", "tensor")), (("tensor", None), ("tensor", "fsdp"))}, gathered
    _, ref_losses, ref_history = single_device
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    ref = flat(ref_history[-1])
    for path, leaf in flat(history[-1]).items():
        np.testing.assert_allclose(leaf, ref[path], rtol=1e-5, atol=2e-6, err_msg=path)
    w_in = state.params["blocks"]["mlp"]["w_in_DxF"]
    assert w_in.addressable_shards[0].data.shape == SHARD_SHAPES["blocks/mlp/w_in_DxF"][ORDER.index("fsdp_tp")]


def test_gather_weight_gathers_over_fsdp_and_returns_the_gradient_in_the_weights_layout():
    """Inside the function the weight lies as the activation rules say (fsdp gathered, tensor kept); its gradient
    comes out in the parameter's layout. A plain constraint would gather the same, but pin the gradient gathered too
    (on TPU an all-reduce of the whole gradient where a reduce-scatter does)."""
    mesh = make_mesh(ParallelConfig(strategy="fsdp_tp", data=1, fsdp=4, tensor=2))
    rules = get_rules("fsdp_tp", mesh)
    w = jax.device_put(jnp.ones((64, 256)), NamedSharding(mesh, P("fsdp", "tensor")))
    x = jnp.ones((16, 64))
    seen = {}

    def loss(w, pin):
        with activation_sharding(mesh, rules):
            inner = pin(w, ("embed", "mlp"))
            jax.debug.inspect_array_sharding(inner, callback=lambda s: seen.setdefault(pin.__name__, s))
            return jnp.sum(jnp.tanh(x @ inner))

    grads = {pin.__name__: jax.jit(jax.grad(loss), static_argnums=1)(w, pin) for pin in (gather_weight, constrain)}
    for name in ("gather_weight", "constrain"):
        assert seen[name].spec in (P(None, "tensor"), P(None, ("tensor",))), (name, seen[name])
    assert grads["gather_weight"].sharding.spec == P("fsdp", "tensor"), grads["gather_weight"].sharding
    assert grads["constrain"].sharding.spec != P("fsdp", "tensor"), grads["constrain"].sharding
    np.testing.assert_allclose(grads["gather_weight"], grads["constrain"], rtol=1e-6)
    assert gather_weight(w, ("embed", "mlp")) is w  # outside activation_sharding: the weight as it is


def test_activation_constraints_follow_rules():
    """The model pins its activations by logical name: under tp the MLP hidden state is split over `tensor`."""
    mesh = make_mesh(ParallelConfig(strategy="tp", data=2, fsdp=1, tensor=4))
    rules = get_rules("tp", mesh)
    task = Task.create(lambda r: GPT(MODEL, rngs=r), mesh, rules, None)
    def hidden_mlp(tokens):
        with activation_sharding(mesh, rules):
            model = task.merge(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), task.abstract_params))
            return model(tokens)

    out = jax.jit(hidden_mlp)(jnp.zeros((4, 16), jnp.int32))
    # logits carry ("batch", "seq", "vocab"): batch over data (2), vocab over tensor (4)
    assert out.addressable_shards[0].data.shape == (2, 16, 64)


def test_dcn_data_multiplies_the_data_axis_and_needs_real_slices():
    assert mesh_shape(ParallelConfig(fsdp=-1, dcn_data=2), 8) == \
        {"data": 2, "stage": 1, "fsdp": 4, "expert": 1, "seq": 1, "tensor": 1}
    assert mesh_shape(ParallelConfig(strategy="fsdp_tp", fsdp=-1, tensor=2, dcn_data=4), 16) == \
        {"data": 4, "stage": 1, "fsdp": 2, "expert": 1, "seq": 1, "tensor": 2}
    with pytest.raises(ConfigError, match="dcn_data=3 slices do not split the 8 devices"):
        mesh_shape(ParallelConfig(dcn_data=3), 8)
    with pytest.raises(ConfigError, match="must be >= 1"):
        mesh_shape(ParallelConfig(dcn_data=0), 8)
    with pytest.raises(ConfigError, match="needs devices from 2 slices.*no slice_index"):
        make_mesh(ParallelConfig(fsdp=-1, dcn_data=2))  # CPU devices belong to no slice


def _constraints(jaxpr):
    """(dtype, spec) of every sharding constraint in a jaxpr, sub-jaxprs included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "sharding_constraint":
            found.append((eqn.invars[0].aval.dtype, eqn.invars[0].aval.shape, eqn.params["sharding"].spec))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    found += _constraints(sub)
    return found


@pytest.mark.parametrize("mesh_name,expected", [("fsdp", P(None, None, "fsdp")),
                                                ("data_fsdp_tp", P("data", None, "fsdp")), ("tp", None), ("dp", None)])
def test_embedding_gradient_moves_to_the_tables_shard_in_the_compute_dtype(mesh_name, expected):
    """The lookup's bf16 cotangent is sent to the table's D shard (the batch kept split over `data`, never gathered
    over it) before it is cast to fp32: half the bytes of the partitioner's own choice, which casts first. The table
    gradient is the same either way (up to the order of its sums); where the table's D is not split (tp, dp) there is
    nothing to move."""
    mesh = make_mesh(ParallelConfig(strategy=STRATEGY[mesh_name], **MESHES[mesh_name]))
    rules = get_rules(STRATEGY[mesh_name], mesh)
    table = jax.random.normal(jax.random.key(0), (256, 64))
    ids = jax.random.randint(jax.random.key(1), (16, 32), 0, 256)
    w = jax.random.normal(jax.random.key(2), (16, 32, 64))

    def loss(table, lookup):
        with activation_sharding(mesh, rules):
            x = constrain(lookup(table, ids), ("batch", "residual_seq", "embed"))
            return jnp.sum((x.astype(jnp.float32) * w) ** 2)

    ours = lambda t, i: embed_lookup(t, i, jnp.bfloat16)
    plain = lambda t, i: jnp.take(t, i, axis=0).astype(jnp.bfloat16)
    moved = [(shape, spec) for dtype, shape, spec in _constraints(jax.make_jaxpr(jax.grad(loss), static_argnums=1)(
        table, ours).jaxpr) if dtype == jnp.bfloat16 and spec != P(("data", "fsdp"))
             and spec != logical_to_spec(("batch", "residual_seq", "embed"), rules.activations, mesh, (16, 32, 64))]
    assert moved == ([] if expected is None else [((16, 32, 64), expected)]), moved
    g_ours, g_plain = (jax.jit(jax.grad(loss), static_argnums=1)(table, f) for f in (ours, plain))
    np.testing.assert_allclose(np.asarray(g_ours), np.asarray(g_plain), rtol=1e-5, atol=1e-5)  # sums reordered
    assert cast_table_rows(table[:3], jnp.bfloat16, ("batch", "embed")).dtype == jnp.bfloat16  # eager: a plain cast


def test_embedding_gradient_left_to_the_partitioner_on_an_expert_mesh():
    """With an `expert` axis the lookup is a plain cast: the constraint added an all-to-all and a permute there."""
    mesh = make_mesh(ParallelConfig(strategy="fsdp", data=1, fsdp=4, expert=2))
    rules = get_rules("fsdp", mesh)
    with activation_sharding(mesh, rules):
        assert rules_module._table_cotangent_sharding(("batch", "residual_seq", "embed"), (16, 32, 64)) is None
    fsdp = make_mesh(ParallelConfig(strategy="fsdp", data=1, fsdp=8))
    with activation_sharding(fsdp, get_rules("fsdp", fsdp)):
        assert rules_module._table_cotangent_sharding(("batch", "residual_seq", "embed"), (16, 32, 64)) is not None
