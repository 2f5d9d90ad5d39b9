"""Loss-free load balancing (model.router_bias): the bias changes which experts are chosen and nothing else, the
step's loads reach it as its gradient, the optimizer moves it by their sign, and every other parameter trains as it
would without it; the bias reaches serving and is refused where a checkpoint format cannot hold it."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from helpers import fixed_batch, flat, make_task
from jaxperf.config import ConfigError, ModelConfig, OptimConfig, ParallelConfig, get_config, validate
from jaxperf.models.gpt import GPT
from jaxperf.models.moe import MoE, bias_signal, route, slot_shares
from jaxperf.step.optimizer import ROUTER_BIAS, with_router_bias

ONE = ParallelConfig(strategy="dp", data=1, fsdp=1)
SMALL = ModelConfig(d_model=32, n_heads=2, n_layers=2, max_seq_len=16, n_experts=4, experts_per_token=2,
                    init_std=0.2)
OPTIM = OptimConfig(lr=1e-2, warmup_steps=0)


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_the_bias_changes_the_choice_and_not_the_weights(router):
    logits = jnp.array([[3.0, 2.0, 1.0, 0.0], [0.0, 0.5, 1.0, 4.0]])
    scores = jax.nn.softmax(logits, -1) if router == "softmax" else jax.nn.sigmoid(logits)
    bias = jnp.array([-1.0, 0.0, 0.0, 1.0])  # expert 0 made unattractive, expert 3 attractive
    weights, experts, probs = jax.jit(lambda l, b: route(l, 2, router, True, b))(logits, bias)
    np.testing.assert_array_equal(np.sort(np.asarray(experts), axis=-1), [[1, 3], [2, 3]])
    unbiased = jax.jit(lambda l: route(l, 2, router, True))(logits)
    np.testing.assert_array_equal(np.sort(np.asarray(unbiased[1]), axis=-1), [[0, 1], [2, 3]])
    # the weights are the chosen experts' own scores, renormalised over the two: the bias is not in them
    want = np.take_along_axis(np.asarray(scores), np.asarray(experts), -1)
    np.testing.assert_allclose(weights, want / want.sum(-1, keepdims=True), rtol=1e-6)
    np.testing.assert_allclose(probs, unbiased[2], rtol=1e-6)


def test_the_bias_signal_is_zero_with_each_experts_load_as_its_gradient():
    experts = jnp.array([[0, 1], [0, 2], [0, 1], [3, 0]])  # 8 slots: expert 0 takes 4, 1 takes 2, 2 and 3 one each
    f = slot_shares(experts, 4)
    np.testing.assert_allclose(f, [0.5, 0.25, 0.125, 0.125])
    bias = jnp.array([0.3, -0.2, 0.1, 0.0])
    value, grad = jax.jit(jax.value_and_grad(bias_signal))(bias, f)
    assert float(value) == 0.0
    np.testing.assert_allclose(grad, [0.25, 0.0, -0.125, -0.125], rtol=1e-6)


def test_the_layer_chooses_by_the_biased_scores_and_hands_its_bias_the_loads():
    moe = MoE(dataclasses.replace(SMALL, d_model=16, mlp_dim=24, router_bias=True).resolved(), rngs=nnx.Rngs(0))
    moe.router_bias_E[...] = jnp.array([0.4, 0.0, 0.0, -0.4])
    x = jax.random.normal(jax.random.key(1), (2, 5, 16))
    graphdef, state = nnx.split(moe)

    def loss(st, x):
        y, stats = nnx.merge(graphdef, st)(x)
        return jnp.sum(y) + stats["bias_signal"], stats

    (_, stats), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state, x)
    scores = np.asarray(jax.nn.softmax(x.reshape(10, 16) @ moe.router_DxE[...], -1))
    chosen = np.argsort(-(scores + np.array([0.4, 0.0, 0.0, -0.4])), axis=-1)[:, :2]
    f = np.bincount(chosen.reshape(-1), minlength=4) / chosen.size
    assert f[0] > f[3]  # the bias moved slots from expert 3 to expert 0
    np.testing.assert_allclose(nnx.to_pure_dict(grads)["router_bias_E"], f - 0.25, atol=1e-7)
    assert float(stats["max_load"]) == pytest.approx(4 * f.max())


def test_the_optimizer_moves_each_bias_by_the_rate_against_its_load_and_the_rest_as_before():
    params = {"w": jnp.array([1.0, -2.0, 3.0]), "mlp": {ROUTER_BIAS: jnp.array([0.5, 0.0, -0.5, 0.0])}}
    grads = {"w": jnp.array([0.1, 0.2, -0.3]), "mlp": {ROUTER_BIAS: jnp.array([0.25, -0.125, 0.0, -0.125])}}
    inner = optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-2))
    tx = with_router_bias(inner, 0.05)
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    np.testing.assert_allclose(updates["mlp"][ROUTER_BIAS], [-0.05, 0.05, 0.0, 0.05])
    # the other leaves update as `inner` alone would on them (the bias's signal takes no share of the clip)
    alone, _ = jax.jit(inner.update)({"w": grads["w"]}, inner.init({"w": params["w"]}), {"w": params["w"]})
    np.testing.assert_allclose(updates["w"], alone["w"], rtol=1e-6)
    frozen, _ = with_router_bias(inner, 0.0).update(grads, tx.init(params), params)
    np.testing.assert_array_equal(frozen["mlp"][ROUTER_BIAS], np.zeros(4))


def _steps(model, n=2):
    task = make_task(model, ONE, optim=OPTIM, devices=jax.devices()[:1])
    state, step = task.init_state(), task.train_step()
    metrics = []
    for i in range(n):
        state, m = step(state, fixed_batch(batch=4, seq=16, seed=i))
        metrics.append(m)
    return state, metrics


def test_a_step_moves_only_the_biases_by_the_rate_and_trains_the_rest_as_without_them():
    biased = dataclasses.replace(SMALL, router_bias=True, router_bias_update_rate=0.01)
    state, metrics = _steps(biased, n=1)
    plain, plain_metrics = _steps(SMALL, n=1)
    bias = np.asarray(state.params["blocks"]["mlp"][ROUTER_BIAS])
    assert bias.shape == (2, 4)
    assert set(np.round(bias.reshape(-1) / 0.01).astype(int)) <= {-1, 0, 1} and np.abs(bias).sum() > 0, bias
    # starting from zero, the first step routes as the unbiased model does: every other parameter, the loss and the
    # gradient norm (the biases' signals are not counted in it) are the same
    want = flat(plain.params)
    got = flat(state.params)
    assert set(got) - set(want) == {f"blocks/mlp/{ROUTER_BIAS}"}
    for path, leaf in want.items():
        np.testing.assert_allclose(got[path], leaf, rtol=1e-6, atol=1e-7, err_msg=path)
    for k in ("loss", "grad_norm", "moe_aux_loss", "moe_max_load"):
        np.testing.assert_allclose(float(metrics[0][k]), float(plain_metrics[0][k]), rtol=1e-6, err_msg=k)
    assert float(metrics[0]["moe_max_load"]) > 1.0  # a load above even: there was something to move


def test_a_frozen_bias_stays_as_it_was_loaded():
    frozen = dataclasses.replace(SMALL, router_bias=True)
    state, _ = _steps(frozen, n=2)
    np.testing.assert_array_equal(np.asarray(state.params["blocks"]["mlp"][ROUTER_BIAS]), np.zeros((2, 4)))


def test_the_bias_evens_a_skewed_router_out():
    """A router that sends most tokens to expert 0 (its column lined up with the tokens): updated by the layer's own
    signal through `with_router_bias`, the bias spreads the slots to within a few percent of even."""
    moe = MoE(dataclasses.replace(SMALL, d_model=16, mlp_dim=24, router_bias=True).resolved(), rngs=nnx.Rngs(0))
    moe.router_DxE[...] = moe.router_DxE[...].at[:, 0].add(0.15)
    x = jax.random.normal(jax.random.key(2), (8, 32, 16)) + 0.5
    graphdef, template, rest = nnx.split(moe, nnx.Param, ...)
    params = nnx.to_pure_dict(template)  # as the train step holds them
    tx = with_router_bias(optax.sgd(0.0), 0.01)

    @jax.jit
    def step(params, opt_state):
        def signal(p):
            state = jax.tree.map(lambda v: v, template)
            nnx.replace_by_pure_dict(state, p)
            _, stats = nnx.merge(graphdef, state, rest)(x)
            return stats["bias_signal"], stats["max_load"]

        grads, load = jax.grad(signal, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, load

    opt_state = tx.init(params)
    loads = []
    for _ in range(80):
        params, opt_state, load = step(params, opt_state)
        loads.append(float(load))
    assert loads[0] > 1.6, loads  # of at most 2: with k=2 an expert takes at most half the slots
    assert max(loads[-10:]) < 1.15, loads


@pytest.mark.slow
def test_the_biased_routing_reaches_the_kv_cache_forward():
    cfg = dataclasses.replace(SMALL, router_bias=True)
    model = GPT(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, 256)
    unbiased = model.hidden(tokens)
    model.pop_moe_stats()
    model.blocks.mlp.router_bias_E[...] = jnp.array([[1.0, 0.0, 0.0, -1.0]] * 2)
    full = model.hidden(tokens)
    model.pop_moe_stats()
    assert float(jnp.max(jnp.abs(full - unbiased))) > 1e-3  # the bias changed the routing
    k, v = model.init_cache(2, 16)
    cached, _, _ = model.cached(tokens, jnp.broadcast_to(jnp.arange(9), (2, 9)), k, v)
    np.testing.assert_allclose(cached, full, rtol=1e-5, atol=1e-5)


def test_a_checkpoint_without_the_bias_is_refused_with_the_fix(tmp_path):
    from jaxperf.checkpoint import Checkpointer, IncompatibleCheckpointError

    plain = make_task(SMALL, ONE, devices=jax.devices()[:1])
    biased = make_task(dataclasses.replace(SMALL, router_bias=True), ONE, devices=jax.devices()[:1])
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"params": plain.init_state().params})
        ckpt.wait()
        with pytest.raises(IncompatibleCheckpointError, match=r"saved without a router bias: resume it with "
                                                              r"model.router_bias=false"):
            ckpt.restore(1, {"params": biased.abstract_params_sharded()})


def test_a_loss_of_your_own_is_warned_that_it_must_carry_the_bias_signal():
    from jaxperf.step.task import next_token_loss

    biased = dataclasses.replace(SMALL, router_bias=True, router_bias_update_rate=0.01)
    with pytest.warns(UserWarning, match="moves the router biases by the signal the loss adds"):
        make_task(biased, ONE, devices=jax.devices()[:1], loss_fn=next_token_loss)


@pytest.mark.parametrize("overrides,message", [
    (["n_experts=4", "router_bias_update_rate=0.001"],
     r"model.router_bias_update_rate=0.001 moves a router bias, and model.router_bias=false: set router_bias=true"),
    (["router_bias=true"], r"model.router_bias=true biases the choice of experts, and model.n_experts=0"),
    (["n_experts=4", "router_bias=true", "router_bias_update_rate=-1"],
     r"model.router_bias_update_rate=-1.0 must be at least 0"),
])
def test_bad_router_bias_settings_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        validate(get_config("tiny", overrides), 8)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_export_refuses_a_router_bias_the_format_cannot_hold(arch, tmp_path):
    from jaxperf.interop.hf import HFCheckpointError, _export_check

    cfg = ModelConfig(style="llama", n_experts=4, use_bias=False, router_bias=True,
                      n_shared_experts=1 if arch == "qwen2_moe" else 0, qkv_bias=arch == "qwen2_moe",
                      shared_expert_gate=arch == "qwen2_moe").resolved()
    with pytest.raises(HFCheckpointError, match=r"cannot export model.router_bias=true as .*no Hugging Face format "
                                                r".* holds a routing bias"):
        _export_check(cfg, arch)
    _export_check(dataclasses.replace(cfg, router_bias=False), arch)
