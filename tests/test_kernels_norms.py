"""RMSNorm / LayerNorm kernels vs their jnp references: forward, gradients, fused residual, padding, errors, TPU
lowering, and the model trained with norm_impl="pallas" vs "xla" under an 8-device FSDP mesh.

The kernels really run here: on CPU `rms_norm` / `layer_norm` run the Pallas bodies in interpret mode.
Legend: R rows (all leading dims), D features.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _accelerators import gpu_kernel_names, lower_for_cuda, tpu_replicated

from jaxperf.config import ParallelConfig, get_config
from jaxperf.models import GPT
from jaxperf.parallel.mesh import make_mesh
from jaxperf.parallel.rules import get_rules
from jaxperf.models.gpt import gpt_loss as next_token_loss
from jaxperf.step.task import Task
from pallas_kernels.norms import (
    NormBlockSizes,
    layer_norm,
    layer_norm_reference,
    rms_norm,
    rms_norm_reference,
    unavailable_reason,
)

# dtype -> (forward tol, dx tol, dscale/dbias tol); low precision is compared with the reference on the same inputs.
TOL = {jnp.float32: (1e-5, 2e-5, 5e-5), jnp.bfloat16: (2e-2, 3e-2, 3e-2), jnp.float16: (3e-3, 5e-3, 5e-3)}


def _inputs(shape, dtype, bias, residual, seed=0):
    d = shape[-1]
    kx, kr, ks, kb, ky, kh = jax.random.split(jax.random.key(seed), 6)
    # A mean offset makes LayerNorm's centring matter; non-unit scale and bias make their gradients non-trivial.
    x = (jax.random.normal(kx, shape, jnp.float32) + 0.5).astype(dtype)
    r = jax.random.normal(kr, shape, jnp.float32).astype(dtype) if residual else None
    scale = 1.0 + 0.2 * jax.random.normal(ks, (d,), jnp.float32)
    b = 0.1 * jax.random.normal(kb, (d,), jnp.float32) if bias else None
    ct_y = jax.random.normal(ky, shape, jnp.float32)
    ct_h = jax.random.normal(kh, shape, jnp.float32)
    return x, r, scale, b, ct_y, ct_h


def _call(kind, fn_kind, x, r, scale, b, **kw):
    """The kernel (fn_kind="pallas") or reference ("reference") of `kind`, always returning (y, h or None)."""
    if kind == "rms":
        fn = rms_norm if fn_kind == "pallas" else rms_norm_reference
        out = fn(x, scale, residual=r, **kw)
    else:
        fn = layer_norm if fn_kind == "pallas" else layer_norm_reference
        out = fn(x, scale, b, residual=r, **kw)
    return out if r is not None else (out, None)


def _value_and_grads(kind, fn_kind, x, r, scale, b, ct_y, ct_h, **kw):
    """Outputs and the gradients wrt (x, residual, scale, bias) of a random linear function of (y, h)."""

    def loss(x, r, scale, b):
        y, h = _call(kind, fn_kind, x, r, scale, b, **kw)
        total = jnp.sum(y.astype(jnp.float32) * ct_y)
        if h is not None:
            total = total + jnp.sum(h.astype(jnp.float32) * ct_h)
        return total, (y, h)

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)
    (_, outs), grads = jax.jit(grad)(x, r, scale, b)
    return outs, grads


def _assert_close(actual, expected, tol, what):
    np.testing.assert_allclose(
        np.asarray(actual, np.float32), np.asarray(expected, np.float32), atol=tol, rtol=tol, err_msg=what
    )


CASES = [
    # kind, shape (rows = product of leading dims), residual, bias, dtype
    ("rms", (1, 64), False, False, jnp.float32),
    ("rms", (7, 11, 96), True, False, jnp.float32),  # 77 rows
    ("rms", (2, 65, 256), False, False, jnp.float32),  # 3 blocks of 64 rows, the last partly padding
    ("layer", (1, 1, 96), True, True, jnp.float32),
    ("layer", (77, 256), False, True, jnp.float32),
    ("layer", (130, 64), True, False, jnp.float32),
    ("layer", (2, 65, 96), True, True, jnp.float32),
    ("rms", (130, 96), True, False, jnp.bfloat16),
    ("layer", (7, 11, 256), True, True, jnp.bfloat16),
    ("layer", (1, 64), False, False, jnp.float16),
]


@pytest.mark.parametrize("kind,shape,residual,bias,dtype", CASES)
def test_forward_and_grads_match_reference(kind, shape, residual, bias, dtype):
    x, r, scale, b, ct_y, ct_h = _inputs(shape, dtype, bias, residual)
    (y, h), grads = _value_and_grads(kind, "pallas", x, r, scale, b, ct_y, ct_h)
    (ry, rh), ref_grads = _value_and_grads(kind, "reference", x, r, scale, b, ct_y, ct_h)
    fwd_tol, dx_tol, dparam_tol = TOL[dtype]
    assert y.shape == shape and y.dtype == dtype
    _assert_close(y, ry, fwd_tol, "normed")
    if residual:
        assert h.shape == shape and h.dtype == dtype
        np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(rh, np.float32), err_msg="x + residual")
    names = ("dx", "dresidual", "dscale", "dbias")
    for name, g, rg, arg in zip(names, grads, ref_grads, (x, r, scale, b)):
        if arg is None:
            assert g is None and rg is None, name
            continue
        assert g.shape == arg.shape and g.dtype == arg.dtype, (name, g.shape, g.dtype)
        tol = dx_tol if name in ("dx", "dresidual") else dparam_tol
        # Parameter gradients are sums over rows: scale the tolerance with their size.
        scale_of = 1.0 if name in ("dx", "dresidual") else float(np.max(np.abs(np.asarray(rg, np.float32)))) + 1.0
        _assert_close(g, rg, tol * scale_of, name)


def test_pallas_backward_is_a_kernel():
    """The gradient runs the forward and the backward Pallas kernels, nothing of the reference's autodiff."""
    x, r, scale, b, ct_y, _ = _inputs((77, 64), jnp.float32, True, True)
    grad = jax.grad(lambda x, r, s, b: jnp.sum(layer_norm(x, s, b, residual=r)[0] * ct_y), argnums=(0, 1, 2, 3))
    assert str(jax.make_jaxpr(grad)(x, r, scale, b)).count("pallas_call") == 2
    assert str(jax.make_jaxpr(lambda x, s: rms_norm(x, s))(x, scale)).count("pallas_call") == 1


@pytest.mark.parametrize("kind,bias", [("rms", False), ("layer", True), ("layer", False)])
def test_padded_features_path(kind, bias):
    """pad_features=True (the Triton layout): D=96 runs as 128 lanes with the padding masked out of the statistics."""
    shape = (130, 96)
    x, r, scale, b, ct_y, ct_h = _inputs(shape, jnp.float32, bias, True, seed=1)
    blocks = NormBlockSizes(block_rows=64, pad_features=True)
    (y, h), grads = _value_and_grads(kind, "pallas", x, r, scale, b, ct_y, ct_h, block_sizes=blocks)
    (ry, rh), ref_grads = _value_and_grads(kind, "reference", x, r, scale, b, ct_y, ct_h)
    _assert_close(y, ry, 1e-5, "normed")
    np.testing.assert_array_equal(h, rh)
    for name, g, rg in zip(("dx", "dresidual", "dscale", "dbias"), grads, ref_grads):
        if rg is not None:
            _assert_close(g, rg, 2e-5 * (1.0 + float(np.max(np.abs(rg)))), name)
    # The kernel really saw padded [192, 128] tiles (rows to 3 blocks of 64, D to 128), and [192, 96] without padding.
    call = lambda blocks: lambda x, r: _call(kind, "pallas", x, r, scale, b, block_sizes=blocks)  # noqa: E731
    assert "f32[192,128]" in str(jax.make_jaxpr(call(blocks))(x, r))
    assert "f32[192,128]" not in str(jax.make_jaxpr(call(NormBlockSizes(64)))(x, r))


def test_tpu_interpreter_mode():
    """interpret=pltpu.InterpretParams() runs the kernels on CPU through the TPU interpreter, matching the reference."""
    pltpu = pytest.importorskip("jax.experimental.pallas.tpu")
    x, r, scale, b, ct_y, ct_h = _inputs((40, 64), jnp.float32, True, True, seed=3)
    kw = dict(interpret=pltpu.InterpretParams())
    (y, h), grads = _value_and_grads("layer", "pallas", x, r, scale, b, ct_y, ct_h, **kw)
    (ry, rh), ref_grads = _value_and_grads("layer", "reference", x, r, scale, b, ct_y, ct_h)
    _assert_close(y, ry, 1e-5, "normed")
    for name, g, rg in zip(("dx", "dresidual", "dscale", "dbias"), grads, ref_grads):
        _assert_close(g, rg, 2e-5 * (1.0 + float(np.max(np.abs(rg)))), name)


def test_eps_and_mixed_dtypes():
    """eps reaches the kernel; a bf16 x with an fp32 residual sums in fp32 and returns the promoted h."""
    x = 1e-3 * jax.random.normal(jax.random.key(2), (9, 64), jnp.float32)
    scale = jnp.ones((64,))
    y_eps, ref_eps = jax.jit(lambda x: (rms_norm(x, scale, eps=1e-2), rms_norm_reference(x, scale, eps=1e-2)))(x)
    _assert_close(y_eps, ref_eps, 1e-5, "eps=1e-2")
    assert float(jnp.max(jnp.abs(y_eps))) < 0.1  # eps dominates tiny inputs

    def mixed(xb, r):
        (y, h), (ry, rh) = layer_norm(xb, scale, residual=r), layer_norm_reference(xb, scale, residual=r)
        grads = jax.grad(lambda x, r: jnp.sum(layer_norm(x, scale, residual=r)[1] ** 2), argnums=(0, 1))(xb, r)
        return y, h, ry, rh, grads

    xb, r = x.astype(jnp.bfloat16), jax.random.normal(jax.random.key(3), (9, 64), jnp.float32)
    y, h, ry, rh, (dx, dr) = jax.jit(mixed)(xb, r)
    assert y.dtype == jnp.bfloat16 and h.dtype == jnp.float32
    _assert_close(y, ry, 2e-2, "normed")
    np.testing.assert_array_equal(h, rh)
    assert dx.dtype == jnp.bfloat16 and dr.dtype == jnp.float32
    _assert_close(dr, 2 * rh, 1e-6, "d residual of sum(h^2)")


def test_empty_rows_and_xla_impl():
    x = jnp.zeros((0, 3, 64), jnp.float32)
    assert rms_norm(x, jnp.ones((64,))).shape == (0, 3, 64)
    x = jax.random.normal(jax.random.key(4), (5, 64))
    np.testing.assert_array_equal(
        layer_norm(x, jnp.ones((64,)), impl="xla"), layer_norm_reference(x, jnp.ones((64,)))
    )


@pytest.mark.parametrize(
    "fn,x_shape,kw,match",
    [
        (rms_norm, (4, 64), {"scale": jnp.ones((32,))}, r"scale.shape=\(32,\) must be \(D,\)=\(64,\)"),
        (layer_norm, (4, 64), {"bias": jnp.ones((65,))}, r"bias.shape=\(65,\) must be \(D,\)=\(64,\)"),
        (rms_norm, (4, 64), {"residual": jnp.ones((4, 63))}, r"residual.shape=\(4, 63\) must equal x.shape=\(4, 64\)"),
        (rms_norm, (4, 0), {"scale": jnp.ones((0,))}, r"x.shape=\(4, 0\) needs a non-empty feature"),
        (rms_norm, (4, 64), {"block_sizes": NormBlockSizes(0)}, "block_rows=0 must be a positive int"),
        (rms_norm, (4, 64), {"block_sizes": NormBlockSizes(12), "backend": "tpu"}, "block_rows=12 must be a multiple of 8"),
        (rms_norm, (4, 64), {"block_sizes": NormBlockSizes(24), "backend": "gpu"}, "block_rows=24 must be a power of two"),
        (layer_norm, (4, 96), {"block_sizes": NormBlockSizes(16), "backend": "gpu"}, "D=96 is not a power of two"),
        (rms_norm, (4, 64), {"interpret": False}, "compile only for"),
        (rms_norm, (4, 64), {"impl": "triton"}, "impl='triton' must be 'pallas' or 'xla'"),
    ],
)
def test_bad_inputs_raise_with_numbers(fn, x_shape, kw, match):
    kw = dict(kw)
    scale = kw.pop("scale", jnp.ones(x_shape[-1:]))
    if fn is layer_norm:
        kw.setdefault("bias", None)
        bias = kw.pop("bias")
        call = lambda x: layer_norm(x, scale, bias, **kw)  # noqa: E731
    else:
        call = lambda x: rms_norm(x, scale, **kw)  # noqa: E731
    x = jnp.zeros(x_shape, jnp.float32)
    if "interpret" in kw and jax.default_backend() != "cpu":
        pytest.skip("interpret=False runs compiled on this backend")
    with pytest.raises(ValueError, match=match):
        call(x)


def test_dtype_errors_and_unavailable_reason():
    x = jnp.zeros((4, 64), jnp.int32)
    with pytest.raises(ValueError, match="x.dtype=int32 is not supported"):
        rms_norm(x, jnp.ones((64,)))
    with pytest.raises(ValueError, match="scale.dtype=int32 is not supported"):
        layer_norm(jnp.zeros((4, 64)), jnp.ones((64,), jnp.int32))
    assert unavailable_reason(jnp.zeros((2, 8, 64), jnp.bfloat16)) is None  # CPU: interpret mode
    assert "int32" in unavailable_reason(x)
    assert "feature dim" in unavailable_reason(jnp.zeros((4, 0)))
    assert "compile only for" in unavailable_reason(jnp.zeros((4, 64)), interpret=False, backend="cpu")


def test_block_sizes_defaults():
    tpu = NormBlockSizes.get_default("tpu")
    assert tpu.block_rows % 8 == 0 and not tpu.pad_features
    wide = NormBlockSizes.get_default("tpu", dim=8192)
    assert wide.block_rows % 8 == 0 and wide.block_rows * 8192 * 4 <= 1 << 20
    for dim in (None, 64, 768, 8192):
        gpu = NormBlockSizes.get_default("gpu", dim=dim)
        assert gpu.pad_features and gpu.block_rows & (gpu.block_rows - 1) == 0
    assert NormBlockSizes.get_default("gpu", dim=8192).block_rows == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        tpu.block_rows = 8


# ---------------------------------------------------------------------------------------------------------------------
# The model: 3 training steps with Pallas norms == with XLA norms, under an 8-device FSDP mesh (the shard_map path).


def _parity_losses(style, steps=3):
    """{norm_impl: (losses of `steps` SGD steps, jaxpr of the step)} from one initial state, on an 8-device FSDP mesh."""
    parallel = ParallelConfig(strategy="fsdp", fsdp=8)
    mesh = make_mesh(parallel)
    rules = get_rules(parallel.strategy, mesh)
    overrides = [f"model.style={style}", "model.d_model=64", "model.n_layers=2", "model.n_heads=2",
                 "model.max_seq_len=16"] + (["model.n_kv_heads=1"] if style == "llama" else [])
    tokens = np.random.default_rng(0).integers(0, 256, (8, 17)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": np.ones((8, 16), np.float32)}
    results, state0 = {}, None
    for impl in ("pallas", "xla"):
        cfg = get_config("tiny", overrides + [f"model.norm_impl={impl}"]).model
        # Plain SGD keeps the step small to compile; parameters are the same for both impls (same seed and shapes).
        task = Task.create(lambda rngs: GPT(cfg, rngs=rngs), mesh, rules, optax.sgd(0.5), seed=0)
        if state0 is None:
            state0 = task.init_state()
        sharded_batch = jax.device_put(batch, task.batch_sharding())
        traced = task.train_step(next_token_loss, donate=False).trace(state0, sharded_batch)
        step = traced.lower().compile()
        state, losses = state0, []
        for _ in range(steps):
            state, metrics = step(state, sharded_batch)
            losses.append(float(metrics["loss"]))
        results[impl] = (losses, str(traced.jaxpr))
    return results


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_model_trains_the_same_with_pallas_norms_under_fsdp(style):
    results = _parity_losses(style)
    (pallas, jaxpr), (xla, xla_jaxpr) = results["pallas"], results["xla"]
    # The Pallas norms really ran, per shard: forward and backward kernels inside shard_map.
    assert "shard_map" in jaxpr and jaxpr.count("pallas_call") >= 2
    assert "pallas_call" not in xla_jaxpr
    assert pallas[-1] < pallas[0] - 0.1, pallas  # it trained
    np.testing.assert_allclose(pallas, xla, rtol=1e-5, err_msg=f"{style}: losses with pallas vs xla norms")


# ---------------------------------------------------------------------------------------------------------------------
# TPU: compile the forward and backward kernels for a v5p slice from this CPU-only machine.


@pytest.mark.parametrize("kind,shape,dtype", [("layer", (2, 77, 96), jnp.bfloat16), ("rms", (3, 130, 256), jnp.float32)])
def test_tpu_lowering_compiles_fwd_and_bwd(kind, shape, dtype):
    replicated = tpu_replicated("v5p:2x2x1")
    x = jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)
    vec = jax.ShapeDtypeStruct(shape[-1:], jnp.float32, sharding=replicated)

    def loss(x, r, scale, b):
        if kind == "rms":
            y, h = rms_norm(x, scale, residual=r, backend="tpu")
        else:
            y, h = layer_norm(x, scale, b, residual=r, backend="tpu")
        return jnp.sum(y.astype(jnp.float32)) + jnp.sum(jnp.square(h.astype(jnp.float32)))

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(x, x, vec, vec).compile()
    assert compiled.as_text().count("tpu_custom_call") >= 2, "expected the forward and backward Mosaic kernels"
    assert compiled.memory_analysis() is not None


# ---------------------------------------------------------------------------------------------------------------------
# GPU: lower forward and backward through the Pallas Triton lowering from this CPU-only machine, at model widths.


@pytest.mark.parametrize(
    "kind,shape,residual",
    [("rms", (4096, 4096), False), ("rms", (4096, 4096), True), ("layer", (4096, 4096), True),
     ("layer", (2, 1000, 3000), False)],  # the last one: rows and D that are not powers of two
)
def test_gpu_lowering_fwd_and_bwd(kind, shape, residual):
    x = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    vec = jax.ShapeDtypeStruct(shape[-1:], jnp.bfloat16)

    def loss(x, r, scale, b):
        r = r if residual else None
        if kind == "rms":
            out = rms_norm(x, scale, residual=r, backend="gpu")
        else:
            out = layer_norm(x, scale, b, residual=r, backend="gpu")
        y, h = out if residual else (out, x)
        return jnp.sum(y.astype(jnp.float32)) + jnp.sum(jnp.square(h.astype(jnp.float32)))

    # value_and_grad: under jax.grad alone newer jax drops the forward kernel when only its residuals are used.
    text = lower_for_cuda(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)), x, x, vec, vec)
    assert gpu_kernel_names(text) == [f"{kind}_norm_fwd", f"{kind}_norm_bwd"]
