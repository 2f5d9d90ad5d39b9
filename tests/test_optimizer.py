"""Optimizer: the learning-rate schedule, clipping, and no weight decay on norms and biases."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxperf.config import ConfigError, ModelConfig, OptimConfig, ParallelConfig, get_config
from jaxperf.models import GPT
from jaxperf.parallel.mesh import make_mesh
from jaxperf.parallel.rules import get_rules
from jaxperf.step.optimizer import lr_schedule, make_optimizer
from jaxperf.step.task import Task, decay_mask


def test_schedule_warms_up_then_decays_to_the_floor():
    sched = lr_schedule(OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1), max_steps=110)
    np.testing.assert_allclose([sched(0), sched(4), sched(9)], [0.1, 0.5, 1.0], rtol=1e-6)
    assert float(sched(59)) < 1.0 and float(sched(59)) > 0.5
    np.testing.assert_allclose(sched(109), 0.1, rtol=1e-5)


def test_constant_schedule_is_one_setting():
    cfg = get_config("tiny", ["optim.schedule=constant", "lr=3e-4"]).optim
    sched = lr_schedule(cfg, max_steps=100)
    np.testing.assert_allclose([sched(s) for s in (0, 1, 49, 99, 500)], [3e-4] * 5, rtol=1e-7)
    with pytest.raises(ConfigError, match="choose one of warmup_cosine, constant"):
        get_config("tiny", ["optim.schedule=flat"])


def test_no_weight_decay_on_norms_and_biases():
    cfg = ModelConfig(d_model=32, n_layers=2, n_heads=4, max_seq_len=16)
    mesh = make_mesh(ParallelConfig(strategy="dp", data=1, fsdp=1), jax.devices()[:1])
    task = Task.create(lambda r: GPT(cfg, rngs=r), mesh, get_rules("dp", mesh), None)
    mask = decay_mask(task.param_axes, task.abstract_params)
    blocks = mask["blocks"]
    # Scanned layers give norm scales a shape (layers, D): still not decayed.
    assert blocks["attn_norm"]["scale"] is False and blocks["attn"]["bias_q_HxDh"] is False
    assert blocks["mlp"]["bias_in_F"] is False and mask["final_norm"]["bias"] is False
    assert blocks["attn"]["wq_DxHxDh"] is True and blocks["mlp"]["w_in_DxF"] is True and mask["embed_VxD"] is True

    # With zero gradients only weight decay moves parameters: matrices shrink, norm scales stay exactly 1.
    tx, _ = make_optimizer(OptimConfig(lr=0.1, warmup_steps=0, weight_decay=0.5), 10, mask)
    params = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), task.abstract_params)
    # one compiled update (op by op, every optax op over every leaf compiles a program of its own: ~20x slower)
    @jax.jit
    def step(params):
        updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
        return jax.tree.map(lambda p, u: p + u, params, updates)

    new = step(params)
    assert float(new["blocks"]["attn_norm"]["scale"][0, 0]) == 1.0
    assert float(new["blocks"]["mlp"]["w_in_DxF"][0, 0, 0]) < 1.0


def test_global_norm_clipping():
    # With eps >> |g| Adam's update is ~ -lr * g / eps, linear in the (clipped) gradient: [30, 40] has norm 50 and
    # clips to [0.6, 0.8]; without the clip the update would be [-30, -40].
    tx, _ = make_optimizer(OptimConfig(lr=1e6, warmup_steps=0, grad_clip=1.0, weight_decay=0.0, b1=0.0, b2=0.0, min_lr_ratio=1.0,
                                       eps=1e6), 10)
    params = {"w": jnp.zeros((2,))}
    updates, _ = tx.update({"w": jnp.array([30.0, 40.0])}, tx.init(params), params)
    np.testing.assert_allclose(updates["w"], [-0.6, -0.8], rtol=1e-5)
