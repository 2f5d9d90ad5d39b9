"""GPipe over a `stage` mesh axis against the plain sequential computation, and the pipelined GPT against the model."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh

from jaxperf.config import ModelConfig
from jaxperf.models.gpt import GPT
from jaxperf.models.pipelined import pipeline_loss
from jaxperf.parallel.pipeline import bubble_fraction, gpipe, scan_stage, split_microbatches

N_LAYERS, N_MICRO, B, D = 8, 8, 2, 16


def _stage_mesh(n: int = 4) -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), ("stage",))


def _layer(p, x_BxD):
    w_DxD, b_D = p
    return jnp.tanh(x_BxD @ w_DxD + b_D[None]) + 0.5 * x_BxD  # layers do not commute: order errors show


def _sequential(params, x_MxBxD):
    """The reference: every microbatch through all N layers in order, no pipeline."""
    return jax.vmap(lambda x: jax.lax.scan(lambda h, p: (_layer(p, h), None), x, params)[0])(x_MxBxD)


def _mlp_inputs():
    k = jax.random.split(jax.random.key(0), 3)
    params = (jax.random.normal(k[0], (N_LAYERS, D, D)) / D**0.5, 0.1 * jax.random.normal(k[1], (N_LAYERS, D)))
    return params, jax.random.normal(k[2], (N_MICRO, B, D))


def test_gpipe_matches_sequential_forward_and_grads():
    mesh = _stage_mesh(4)
    params, x = _mlp_inputs()
    local_layers = []

    def stage_fn(p, x_BxD):
        local_layers.append(p[0].shape[0])  # recorded at trace time: what one stage really holds
        return scan_stage(_layer)(p, x_BxD)

    weights_M = jnp.arange(1.0, N_MICRO + 1.0)  # a different weight per microbatch: a mix-up of outputs shows

    def loss(run, p, x):
        y_MxBxD = run(p, x)
        return jnp.sum(jnp.sum(y_MxBxD**2, axis=(1, 2)) * weights_M)

    piped = lambda p, x: gpipe(stage_fn, p, x, mesh, "stage")  # noqa: E731

    @jax.jit
    def both(p, x):
        return piped(p, x), _sequential(p, x), jax.grad(loss, (1, 2))(piped, p, x), jax.grad(loss, (1, 2))(
            _sequential, p, x)

    y, y_ref, grads, grads_ref = both(params, x)
    assert local_layers and set(local_layers) == {N_LAYERS // 4}, local_layers
    assert y.shape == (N_MICRO, B, D)
    np.testing.assert_allclose(y, y_ref, rtol=1e-6, atol=1e-6)
    for g, g_ref in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
        np.testing.assert_allclose(g, g_ref, rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(grads[1]).max()) > 0  # the input gradient flows back through every stage


def test_gpipe_with_data_axis_and_remat():
    """Stages on one mesh axis, microbatch rows split over another; remat recomputes the stage in the backward."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "stage"))
    params, x = _mlp_inputs()
    run = lambda p, x: gpipe(scan_stage(_layer), p, x, mesh, "stage", batch_axes="data", remat=True)  # noqa: E731
    f = jax.jit(jax.value_and_grad(lambda p, x: jnp.sum(run(p, x) ** 2)))
    f_ref = jax.jit(jax.value_and_grad(lambda p, x: jnp.sum(_sequential(p, x) ** 2)))
    (v, g), (v_ref, g_ref) = f(params, x), f_ref(params, x)
    np.testing.assert_allclose(v, v_ref, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):  # the data-axis psum sums in another order
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def _tiny_gpt(**kw) -> GPT:
    cfg = ModelConfig(**{**dict(vocab_size=128, max_seq_len=8, d_model=16, n_layers=4, n_heads=2), **kw})
    return GPT(cfg, rngs=nnx.Rngs(0))


def _batch(batch: int = 8, length: int = 8):
    tokens = jax.random.randint(jax.random.key(1), (batch, length + 1), 0, 128)
    mask = (jax.random.uniform(jax.random.key(2), (batch, length)) > 0.2).astype(jnp.float32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask}


def test_pipelined_gpt_train_step_matches_plain():
    """One SGD step of a Llama-style GPT (GQA, RoPE, scanned layers): loss, gradients and new parameters equal those
    of the unpipelined model. SGD keeps the update linear in the gradients (Adam's first step is sign(g) * lr, which
    would turn fp32 round-off in a near-zero gradient into a full-size difference)."""
    mesh = _stage_mesh(4)  # 4 layers over 4 stages, 8 rows in 4 microbatches
    model = _tiny_gpt(style="llama", n_kv_heads=1)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.sgd(0.5)
    batch = _batch()

    def step(loss_fn, params, batch):
        value, grads = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p, rest), batch)[0])(params)
        updates, _ = tx.update(grads, tx.init(params), params)
        return value, grads, optax.apply_updates(params, updates)

    @jax.jit
    def both(params, batch):
        plain = step(lambda m, b: m.next_token_loss(b), params, batch)
        piped = step(lambda m, b: pipeline_loss(m, b, mesh, n_micro=4), params, batch)
        return plain, piped

    plain, piped = both(params, batch)
    np.testing.assert_allclose(piped[0], plain[0], rtol=1e-6)
    assert float(plain[0]) > 1.0  # a real loss, not a degenerate zero
    for part, tol in ((1, 1e-5), (2, 1e-6)):
        paths = jax.tree_util.tree_flatten_with_path(plain[part])[0]
        assert len(paths) == len(jax.tree.leaves(piped[part])) > 5
        for (path, want), got in zip(paths, jax.tree.leaves(piped[part])):
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=jax.tree_util.keystr(path))
    changed = jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.any(a != b)), plain[2], params))
    assert all(changed), "every parameter should move in one SGD step"


def test_pipelined_gpt_loss_layer_list():
    """GPT-2 style (learned positions, biases) with layers kept as a list: stacked for the pipeline, same loss."""
    mesh = _stage_mesh(2)  # 4 layers over 2 stages, 8 rows in 8 microbatches
    model = _tiny_gpt(style="gpt2", scan_layers=False)
    batch = _batch()
    both = nnx.jit(lambda m, b: (m.next_token_loss(b)[0], pipeline_loss(m, b, mesh, n_micro=8)[0]))
    plain, piped = both(model, batch)
    np.testing.assert_allclose(piped, plain, rtol=1e-6)


def test_bubble_fraction():
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(4, 8, "1f1b") == pytest.approx(3 / 11)
    assert bubble_fraction(1, 5) == 0.0
    assert bubble_fraction(8, 1) == pytest.approx(7 / 8)
    assert bubble_fraction(4, 32) < bubble_fraction(4, 8) < bubble_fraction(4, 4)
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        bubble_fraction(4, 8, "zero-bubble")
    with pytest.raises(ValueError, match="n_micro"):
        bubble_fraction(4, 0)


def test_bad_inputs_raise_before_compiling():
    mesh = _stage_mesh(4)
    _, x = _mlp_inputs()
    six_layers = (jnp.zeros((6, D, D)), jnp.zeros((6, D)))
    with pytest.raises(ValueError, match=r"6 layers do not split over 4 pipeline stages.*\[1, 2, 3, 6\]"):
        gpipe(scan_stage(_layer), six_layers, x, mesh)
    with pytest.raises(ValueError, match="same leading layers axis"):
        gpipe(scan_stage(_layer), (jnp.zeros((8, D, D)), jnp.zeros((4, D))), x, mesh)
    with pytest.raises(ValueError, match="no pipeline axis 'pipe'"):
        gpipe(scan_stage(_layer), six_layers, x, mesh, axis="pipe")
    data_stage = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "stage"))
    with pytest.raises(ValueError, match="3 rows per microbatch do not split over 2 devices"):
        gpipe(scan_stage(_layer), (jnp.zeros((8, D, D)), jnp.zeros((8, D))), jnp.zeros((8, 3, D)), data_stage,
              batch_axes="data")
    with pytest.raises(ValueError, match="batch size 6 does not split into 4 microbatches"):
        split_microbatches(jnp.zeros((6, 3)), 4)
    # The checks need only the config and shapes: abstract models (no parameter values) must already fail.
    three_layers = nnx.eval_shape(lambda: _tiny_gpt(n_layers=3))
    with pytest.raises(ValueError, match="3 layers do not split over 4 pipeline stages"):
        pipeline_loss(three_layers, _batch(), mesh, n_micro=4)
    with pytest.raises(ValueError, match="batch size 8 does not split into 3 microbatches"):
        pipeline_loss(nnx.eval_shape(_tiny_gpt), _batch(), mesh, n_micro=3)
