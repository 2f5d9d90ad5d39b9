"""The mixture-of-experts MLP (jaxperf.models.moe): both dispatch paths against a per-expert loop, the capacity rule
on constructed routings, the router losses against their formulas, training, refusals, FLOPs."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxperf.config import ConfigError, ModelConfig, ParallelConfig, get_config, validate
from jaxperf.models.gpt import GPT
from jaxperf.models.layers import to_compute
from jaxperf.models import moe as moe_lib
from jaxperf.models.moe import (MoE, load_balancing_loss, looped_grouped_matmul, ragged_grouped_matmul,
                                router_z_loss, tiled_grouped_matmul)
from jaxperf.models.platform import settle
from jaxperf.perf.flops import matmul_params
from jaxperf.perf.memory import estimate
from helpers import fixed_batch, flat, make_task


def _moe(**kw) -> MoE:
    base = dict(d_model=16, n_heads=2, n_layers=2, mlp_dim=24, n_experts=4, experts_per_token=2, init_std=0.3)
    return MoE(ModelConfig(**{**base, **kw}).resolved(), rngs=nnx.Rngs(0))


def _reference(moe: MoE, x_BxLxD, kept_TxE=None):
    """The MoE output by a plain loop over experts: each expert's MLP on every token, added with the token's top-k
    weight (renormalised over the k unless router_norm_topk is off) where the token chose it (and `kept_TxE` keeps
    it); the shared experts' MLP added, scaled by their sigmoid gate where there is one."""
    B, L, D = x_BxLxD.shape
    x = x_BxLxD.reshape(B * L, D).astype(jnp.float32)
    logits = x @ moe.router_DxE[...]
    scores = jax.nn.softmax(logits, axis=-1) if moe.router == "softmax" else jax.nn.sigmoid(logits)
    kth = jnp.sort(scores, axis=-1)[:, -moe.k][:, None]
    chosen_TxE = scores >= kth
    if kept_TxE is not None:
        chosen_TxE = chosen_TxE & kept_TxE
    norm_T = jnp.sum(jnp.where(scores >= kth, scores, 0.0), axis=-1) if moe.norm_topk else jnp.ones(B * L)
    y = jnp.zeros_like(x)
    for e in range(scores.shape[1]):
        h = x @ moe.w_in_ExDxF[e]
        if moe.bias_in_ExF is not None:
            h = h + moe.bias_in_ExF[e][None]
        if moe.act == "swiglu":
            h = jax.nn.silu(x @ moe.w_gate_ExDxF[e]) * h
        else:
            h = jax.nn.gelu(h, approximate=True)
        out = h @ moe.w_out_ExFxD[e]
        if moe.bias_out_ExD is not None:
            out = out + moe.bias_out_ExD[e][None]
        y = y + jnp.where(chosen_TxE[:, e], scores[:, e] / norm_T, 0.0)[:, None] * out
    y = y.reshape(B, L, D)
    if moe.shared is not None:
        gate = 1.0 if moe.shared_gate_Dx1 is None else jax.nn.sigmoid(x_BxLxD @ moe.shared_gate_Dx1[...])
        y = y + gate * moe.shared(x_BxLxD)
    return y


def _run(fn, moe, *args):
    """`fn(moe, *args)` compiled as one program: op by op, every operation compiles a program of its own (hundreds
    per test, most of its time)."""
    graphdef, state = nnx.split(moe)
    return jax.jit(lambda st, *a: fn(nnx.merge(graphdef, st), *a))(state, *args)


def _grads(fn, moe, x):
    """Gradients of <fn(moe, x), a fixed cotangent> with respect to the parameters and x (one compiled program)."""
    graphdef, state = nnx.split(moe)
    ct = jax.random.normal(jax.random.key(7), x.shape)

    def f(st, x):
        return jnp.sum(fn(nnx.merge(graphdef, st), x) * ct)

    g_state, g_x = jax.jit(jax.grad(f, argnums=(0, 1)))(state, x)
    return flat(nnx.to_pure_dict(g_state)), g_x


def _out(moe, x):
    return moe(x)[0]


# Qwen2-MoE's block: the k weights as the softmax scored them, one gated shared expert of its own width
QWEN_MOE = dict(router_norm_topk=False, shared_mlp_dim=40, shared_expert_gate=True)


@pytest.mark.parametrize("router,style,shared,gmm,extra", [
    ("softmax", "gpt2", 0, "xla", {}), ("sigmoid", "gpt2", 0, "tiled", {}), ("softmax", "llama", 1, "loop", {}),
    ("sigmoid", "llama", 2, "xla", {}), pytest.param("softmax", "llama", 1, "xla", QWEN_MOE, id="qwen2_moe-xla"),
    pytest.param("softmax", "llama", 1, "loop", QWEN_MOE, id="qwen2_moe-loop")])
def test_dropless_equals_a_per_expert_loop_forward_and_gradient(router, style, shared, gmm, extra):
    moe = _moe(router=router, style=style, n_shared_experts=shared, grouped_matmul_impl=gmm, **extra)
    if extra:
        assert moe.shared_gate_Dx1.shape == (16, 1) and moe.shared.w_in_DxF.shape == (16, 40)
    x = jax.random.normal(jax.random.key(1), (2, 5, 16))
    np.testing.assert_allclose(_run(_out, moe, x), _run(_reference, moe, x), rtol=1e-5, atol=1e-5)
    got, got_x = _grads(_out, moe, x)
    want, want_x = _grads(_reference, moe, x)
    np.testing.assert_allclose(got_x, want_x, rtol=1e-4, atol=1e-5)
    assert set(got) == set(want)
    for k in got:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-5, err_msg=k)


@pytest.mark.parametrize("sizes", [[125] * 8, [0, 0, 1000, 0, 0, 0, 0, 0], [1, 300, 0, 200, 99, 0, 300, 100],
                                   [10, 0, 5, 0, 0, 0, 0, 3]])
@pytest.mark.parametrize("impl,tile", [(tiled_grouped_matmul, 128), (tiled_grouped_matmul, 7),
                                       (looped_grouped_matmul, (256, 0)), (looped_grouped_matmul, (7, 0)),
                                       (looped_grouped_matmul, (7, 40)), (looped_grouped_matmul, (256, 1.25))])
def test_the_tiled_and_looped_grouped_matmuls_equal_the_ragged_dot(sizes, impl, tile):
    """Groups of any size, empty ones, one group holding every row, groups that straddle tiles (chunks), a chunk
    running past the last row, and rows past the last group (an all-to-all buffer's empty rows: left zero). The
    looped one runs as (chunk, head): all rows through the loop (head 0), groups that overflow a head of 40 rows, and
    the default head (1.25 x R / E = 160 rows: only the groups of 200 rows and more reach the loop)."""
    x = jax.random.normal(jax.random.key(0), (1000, 24))
    w = jax.random.normal(jax.random.key(1), (8, 24, 40))
    sizes = jnp.asarray(sizes, jnp.int32)
    n = int(sizes.sum())
    f = lambda impl: lambda x, w: impl(x, w, sizes)[:n]  # noqa: E731
    kwargs = {"tile": tile} if impl is tiled_grouped_matmul else {"chunk": tile[0], "head": tile[1]}
    gmm = jax.jit(functools.partial(impl, **kwargs))
    np.testing.assert_allclose(f(gmm)(x, w), f(ragged_grouped_matmul)(x, w), rtol=1e-5, atol=1e-4)
    assert not np.any(np.asarray(gmm(x, w, sizes)[n:]))
    grads = [jax.grad(lambda x, w, g=g: jnp.sum(jnp.sin(f(g)(x, w))), (0, 1))(x, w)
             for g in (gmm, ragged_grouped_matmul)]
    for got, want in zip(*grads):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("style", ["gpt2", "llama"])
@pytest.mark.parametrize("routing", ["even", "skewed"])
def test_the_cpu_expert_blocks_with_their_overflow_equal_the_ragged_dot(style, routing):
    """XLA:CPU's dropless path (`_blocked`): each expert's first slots as a dense block, the slots past it by the
    chunked loop. Even routing fits the blocks (150 slots each, blocks of 152); skewed routing gives expert 0 250 of
    the 600 slots and expert 3 284, whose 98 and 132 past their blocks take one chunk of 128 and two. Forward and
    gradients (x, weights, biases, combine weights) against the ragged dot path; dropping the overflow, or its
    gradient, turns the skewed case red."""
    moe = _moe(style=style, grouped_matmul_impl="xla")
    T, K, E = 300, 2, 4
    x = jax.random.normal(jax.random.key(3), (T, 16))
    if routing == "even":
        experts = (jnp.arange(T * K) % E).reshape(T, K)
    else:
        experts = jnp.where(jnp.arange(T * K) < 500, 0, 1 + jnp.arange(T * K) % 3).reshape(T, K)
        experts = experts.at[:, 1].set(jnp.where(experts[:, 0] == experts[:, 1], 3, experts[:, 1]))
    combine = jax.nn.softmax(jax.random.normal(jax.random.key(4), (T, K)), axis=-1)
    weights = moe._weights(jnp.float32)
    head = moe_lib._head_rows(T * K, E)
    assert head == 152 and (int(jnp.max(jnp.bincount(experts.reshape(-1), length=E))) > head) == (routing == "skewed")

    def run(path):
        def f(x, weights, combine):
            if path == "blocked":
                return moe_lib._blocked(x, combine, experts, weights, moe.act, head)
            return moe_lib._dropless(x, combine, experts, weights, moe.act, ragged_grouped_matmul)
        ct = jax.random.normal(jax.random.key(5), (T, 16))
        y, vjp = jax.vjp(jax.jit(f), x, weights, combine)
        return y, vjp(ct)

    (got, got_g), (want, want_g) = run("blocked"), run("ragged")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_auto_runs_the_looped_grouped_matmul_on_cpu_only():
    cfg = get_config("moe-tiny")
    assert settle(cfg, {"data": 1}, "cpu").grouped_matmul_impl == "loop"
    assert settle(cfg, {"data": 1}, "tpu").grouped_matmul_impl == "xla"
    assert settle(get_config("moe-tiny", ["grouped_matmul_impl=xla"]), {"data": 1}, "cpu").grouped_matmul_impl == "xla"
    with pytest.raises(ConfigError, match="grouped_matmul_impl"):
        get_config("moe-tiny", ["grouped_matmul_impl=megablox"])


def _routed(moe: MoE, first_second):
    """Tokens that are basis vectors of the embedding, and a router that sends basis vector j to the experts
    first_second[j] = (first choice, second choice), with softmax weights e^4 : e^2 between the two."""
    D, E = moe.router_DxE.shape
    router = np.full((D, E), -4.0, np.float32)
    for j, (a, b) in enumerate(first_second):
        router[j, a], router[j, b] = 4.0, 2.0
    moe.router_DxE[...] = jnp.asarray(router)


def test_capacity_drops_exactly_the_overflow_and_zeroes_those_tokens():
    # k=1, 8 tokens, 4 experts, capacity ceil(1.0 * 8 / 4) = 2: tokens 0-5 choose expert 0, 6-7 expert 1. Expert 0
    # keeps the first two of its six (tokens 0 and 1); tokens 2-5 are dropped, half of all slots.
    moe = _moe(experts_per_token=1, capacity_factor=1.0)
    _routed(moe, [(0, 1), (1, 0)])
    x = jnp.zeros((1, 8, 16)).at[0, jnp.arange(8), jnp.array([0] * 6 + [1] * 2)].set(1.0)
    y, stats = _run(MoE.__call__, moe, x)
    assert float(stats["dropped"]) == 0.5
    kept = np.array([1, 1, 0, 0, 0, 0, 1, 1], bool)
    np.testing.assert_array_equal(np.asarray(y[0, ~kept]), 0.0)
    assert np.all(np.abs(np.asarray(y[0, kept])).sum(-1) > 0)
    np.testing.assert_allclose(y[0, kept], _run(_reference, moe, x)[0, kept], rtol=1e-5, atol=1e-6)


def test_capacity_serves_every_first_choice_before_any_second_choice():
    # k=2, 8 tokens alternating between (first 0, second 1) and (first 1, second 0); capacity ceil(8 * 2 / 4) = 4.
    # First choices fill experts 0 and 1 exactly, so every second choice is dropped: each token keeps only its first
    # expert (weighted e^4 / (e^4 + e^2), as renormalised over the two it chose). A token-major order would instead
    # drop the first choices of tokens 4-7.
    moe = _moe(capacity_factor=1.0)
    _routed(moe, [(0, 1), (1, 0)])
    x = jnp.zeros((1, 8, 16)).at[0, jnp.arange(8), jnp.arange(8) % 2].set(1.0)
    y, stats = _run(MoE.__call__, moe, x)
    assert float(stats["dropped"]) == 0.5
    first = jax.nn.one_hot(jnp.arange(8) % 2, 4, dtype=bool)
    np.testing.assert_allclose(y, _run(_reference, moe, x, first), rtol=1e-5, atol=1e-6)


def test_the_expert_weights_cast_equals_the_plain_cast():
    """`layers.to_compute` rounds fp32 to bf16 with reduce_precision before the cast (it keeps the TPU compiler from
    casting the whole stack of experts before the layer loop): the same bits as `astype`, extremes included, and
    the same gradient."""
    x = jax.random.normal(jax.random.key(0), (4096,)) * jnp.logspace(-45, 38, 4096)
    x = jnp.concatenate([x, jnp.array([jnp.nan, jnp.inf, -jnp.inf, 0.0, -0.0, 3.4e38, 1e-45, 1.00390625])])
    ours, plain = jax.jit(lambda w: to_compute(w, jnp.bfloat16, round_first=True))(x), x.astype(jnp.bfloat16)
    assert ours.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(ours.astype(jnp.float32)), np.asarray(plain.astype(jnp.float32)))
    loss = lambda cast, w: jnp.sum(jnp.sin(cast(w[:64]).astype(jnp.float32)))  # noqa: E731
    rounded = lambda w: to_compute(w, jnp.bfloat16, round_first=True)  # noqa: E731
    np.testing.assert_array_equal(jax.grad(functools.partial(loss, rounded))(x),
                                  jax.grad(functools.partial(loss, lambda w: w.astype(jnp.bfloat16)))(x))


def test_a_capacity_that_holds_every_slot_equals_dropless():
    x = jax.random.normal(jax.random.key(2), (2, 6, 16))
    dropless, capped = _moe(style="llama"), _moe(style="llama", capacity_factor=4.0)  # C = T * k: nothing dropped
    y, stats = _run(MoE.__call__, capped, x)
    assert float(stats["dropped"]) == 0.0
    np.testing.assert_allclose(y, _run(_out, dropless, x), rtol=1e-5, atol=1e-6)
    got, got_x = _grads(_out, capped, x)
    want, want_x = _grads(_out, dropless, x)
    np.testing.assert_allclose(got_x, want_x, rtol=1e-4, atol=1e-6)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-6, err_msg=k)


def test_balance_loss_and_z_loss_match_their_formulas():
    E, T = 4, 8
    uniform = jnp.full((T, E), 1.0 / E)
    spread = jnp.stack([jnp.arange(T) % E, (jnp.arange(T) + 1) % E], axis=1)  # every expert gets 4 of 16 slots
    assert float(load_balancing_loss(uniform, spread)) == pytest.approx(1.0, rel=1e-6)
    collapsed = jax.nn.one_hot(jnp.zeros(T, jnp.int32), E)
    assert float(load_balancing_loss(collapsed, jnp.zeros((T, 1), jnp.int32))) == pytest.approx(E, rel=1e-6)
    # a lopsided case by hand: f = (3/4, 1/4), P = (0.6, 0.4): 2 * (0.45 + 0.1) = 1.1
    probs = jnp.array([[0.6, 0.4]] * 4)
    assert float(load_balancing_loss(probs, jnp.array([[0], [0], [0], [1]]))) == pytest.approx(1.1, rel=1e-6)
    logits = jnp.array([[0.0, 0.0, 0.0, 0.0], [1.0, 2.0, 3.0, 4.0]])
    lse = np.log(np.exp([0.0] * 4).sum()), np.log(np.exp([1.0, 2.0, 3.0, 4.0]).sum())
    assert float(router_z_loss(logits)) == pytest.approx((lse[0] ** 2 + lse[1] ** 2) / 2, rel=1e-6)


@pytest.mark.slow
def test_moe_tiny_trains_on_one_device_and_reports_its_router_metrics():
    cfg = get_config("moe-tiny")
    one = ParallelConfig(strategy="dp", data=1, fsdp=1)
    batch = fixed_batch(batch=4, seq=64)
    task = make_task(cfg.model, one, optim=dataclasses.replace(cfg.optim, warmup_steps=0), devices=jax.devices()[:1])
    step, state = task.train_step(), task.init_state()
    losses, metrics = [], []
    for _ in range(4):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
        metrics.append(m)
    assert losses[-1] < losses[0] - 0.2, losses
    assert 0.9 < float(m["moe_aux_loss"]) < 2.0 and float(m["moe_z_loss"]) > 0, m
    assert float(m["moe_dropped_fraction"]) == 0.0
    # Two microbatches of the same batch: the z-loss is a mean over tokens, so its weighted average over the
    # microbatches is the whole batch's
    m1 = metrics[0]
    _, m2 = task.train_step(microbatches=2)(task.init_state(), batch)
    np.testing.assert_allclose(float(m2["moe_z_loss"]), float(m1["moe_z_loss"]), rtol=1e-5)
    np.testing.assert_allclose(float(m2["loss"]), float(m1["loss"]), rtol=1e-3)


def test_the_train_loss_is_the_cross_entropy_plus_the_weighted_router_losses():
    cfg = ModelConfig(d_model=32, n_heads=2, n_layers=2, max_seq_len=16, n_experts=4, router_aux_loss_coef=0.5,
                      router_z_loss_coef=0.25)
    batch = fixed_batch(batch=2, seq=16)
    no_router_losses = dataclasses.replace(cfg, router_aux_loss_coef=0.0, router_z_loss_coef=0.0)
    loss, aux = _run(GPT.next_token_loss, GPT(cfg, rngs=nnx.Rngs(0)), batch)
    ce, ce_aux = _run(GPT.next_token_loss, GPT(no_router_losses, rngs=nnx.Rngs(0)), batch)
    m = aux["metrics"]
    np.testing.assert_allclose(float(loss), float(ce) + 0.5 * float(m["moe_aux_loss"]) + 0.25 * float(m["moe_z_loss"]),
                               rtol=1e-6)
    np.testing.assert_allclose(float(ce_aux["metrics"]["moe_aux_loss"]), float(m["moe_aux_loss"]), rtol=1e-6)


@pytest.mark.slow
def test_mixed_layers_in_a_python_loop_with_remat_and_capacity():
    model = ModelConfig(d_model=32, n_heads=2, n_layers=2, max_seq_len=32, n_experts=4, moe_every=2,
                        scan_layers=False, remat="full", capacity_factor=1.0, style="llama", n_shared_experts=1,
                        moe_mlp_dim=48)
    task = make_task(model, ParallelConfig(strategy="dp", data=1, fsdp=1), devices=jax.devices()[:1])
    blocks = task.abstract_params["blocks"]
    assert "router_DxE" not in blocks[0]["mlp"] and "router_DxE" in blocks[1]["mlp"]  # layer 1 is MoE, 0 dense
    assert blocks[1]["mlp"]["w_gate_ExDxF"].shape == (4, 32, 48)
    _, m = task.train_step()(task.init_state(), fixed_batch(batch=2, seq=32))
    assert np.isfinite(float(m["loss"])) and 0.0 <= float(m["moe_dropped_fraction"]) < 1.0, m


@pytest.mark.slow
def test_the_kv_cache_forward_matches_the_full_forward():
    model = GPT(ModelConfig(d_model=32, n_heads=2, n_layers=2, max_seq_len=16, n_experts=4, init_std=0.2),
                rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, 256)
    full = model.hidden(tokens)
    assert model.pop_moe_stats() and not model.pop_moe_stats()  # taken once, not left behind
    k, v = model.init_cache(2, 16)
    cached, _, _ = model.cached(tokens, jnp.broadcast_to(jnp.arange(9), (2, 9)), k, v)
    np.testing.assert_allclose(cached, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("overrides,message", [
    (["n_experts=4", "experts_per_token=5"], r"model.experts_per_token=5 is more than model.n_experts=4: use "
                                             r"experts_per_token <= 4"),
    (["n_experts=-1"], r"model.n_experts=-1 must be at least 0"),
    (["n_experts=4", "capacity_factor=-0.5"], r"model.capacity_factor=-0.5 must be at least 0"),
    (["n_experts=4", "moe_every=2"], r"model.moe_every=2 mixes dense and MoE layers.*scan_layers=false"),
    (["n_shared_experts=1"], r"model.n_shared_experts=1 needs model.n_experts > 0"),
    (["n_experts=4", "shared_mlp_dim=64"], r"model.shared_mlp_dim=64 shapes shared experts, and "
                                           r"model.n_shared_experts=0: set n_shared_experts >= 1"),
    (["n_experts=4", "shared_expert_gate=true"], r"model.shared_expert_gate=True shapes shared experts"),
    (["n_experts=4", "n_shared_experts=1", "shared_mlp_dim=0"], r"model.shared_mlp_dim=0 must be at least 1"),
    (["n_experts=4", "flavour=shard_map"], r"model.n_experts=4 \(MoE\) runs with parallel.flavour=jit"),
])
def test_bad_moe_settings_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        validate(get_config("tiny", overrides), 8)
    assert "\n" not in str(e.value)


def test_an_unknown_router_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"unknown model.router 'topk'; choose one of softmax, sigmoid") as e:
        get_config("moe-tiny", ["router=topk"])
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"model.router='topk' is not one of \('softmax', 'sigmoid'\)"):
        validate(dataclasses.replace(get_config("moe-tiny"), model=ModelConfig(n_experts=2, router="topk")), 8)


def test_flops_count_the_active_experts():
    tiny, moe = get_config("tiny").model, get_config("moe-tiny").model
    # moe-tiny's two routed experts of 256 match tiny's 512-wide MLP: the router's D x E is all that is added
    assert matmul_params(moe) - matmul_params(tiny) == 4 * 128 * 8
    wider = dataclasses.replace(moe, experts_per_token=4, n_shared_experts=1)  # 5 experts of 256 per token
    assert matmul_params(wider) - matmul_params(moe) == 4 * 3 * (2 * 128 * 256)
    gated = dataclasses.replace(moe, n_shared_experts=1, shared_mlp_dim=100, shared_expert_gate=True)
    # + a shared expert 100 wide (in and out: moe-tiny is GELU) and its [128, 1] gate, in each of the 4 layers
    assert matmul_params(gated) - matmul_params(moe) == 4 * (2 * 128 * 100 + 128)
    mixed = dataclasses.replace(moe, moe_every=2, scan_layers=False)  # layers 1 and 3 MoE, 0 and 2 dense
    assert matmul_params(mixed) - matmul_params(tiny) == 2 * 128 * 8


def test_the_tpu_memory_estimate_counts_the_routed_layer_and_the_expert_weights():
    """The TPU estimate traces the MoE layer itself (the capacity path's [E, C, D] buffers grow with the factor) and
    holds one layer's gathered experts (dropless: its largest expert weight), with no compute-dtype copy of the stacked experts (the layer casts its own
    slice: `layers.to_compute`); tests/test_memory_tpu.py checks the totals against the TPU compiler. Off TPU it refuses
    in one line."""
    base = ["batch_size=16", "fsdp=4", "strategy=fsdp", "attention_impl=xla", "loss_impl=xla", "dtype=bfloat16",
            "use_bias=false"]
    dropless = estimate(get_config("moe-tiny", base), 4, platform="tpu")
    roomy = estimate(get_config("moe-tiny", base + ["capacity_factor=4"]), 4, platform="tpu")
    assert roomy.activations > dropless.activations
    dense = estimate(get_config("tiny", base), 4, platform="tpu")
    # FSDP's gathered layers in bf16: two of everything (the running layer and the next one's gather) but the
    # experts, held once (8 experts of 2 x 128 x 256), and dropless, where each grouped matmul gathers its own
    # weight, only the largest of them (8 x 128 x 256); a dense layer's MLP is 2 x 128 x 512, the router 128 x 8 and
    # its balancing bias 8
    others = 2 * (128 * 8 + 8) - 2 * 2 * 128 * 512
    assert roomy.gathered - dense.gathered == (8 * 2 * 128 * 256 + others) * 2
    assert dropless.gathered - dense.gathered == (8 * 128 * 256 + others) * 2
    for platform in ("cpu", "gpu"):
        with pytest.raises(ConfigError, match=rf"models MoE layers \(model.n_experts=8\) for TPU only, not {platform}"):
            estimate(get_config("moe-tiny"), 1, platform=platform)
