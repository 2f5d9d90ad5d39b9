"""Correct on an NVIDIA GPU: the Pallas kernels (Triton lowering) against their references on the device, cuDNN
attention against XLA, one train step and greedy generation on the GPU against the same on the CPU, a checkpoint
saved from the GPU restored bitwise.

Every test is marked `gpu`. Without a GPU they skip with the reason, unless JAXPERF_GPU_DRY_RUN=1: then they run on
the CPU at tiny shapes (kernels in interpret mode, the "GPU" side on a CPU device), so the tests themselves never rot
between GPU runs (benchmarks/gpu_check.py --dry-run does this, and CI runs that). On the GPU machine:

    JAX_PLATFORMS=cuda,cpu python -m pytest -o addopts="" -m gpu tests/test_gpu.py

Errors are relative norms, ||got - want|| / ||want||, against references computed in fp32 from the same inputs.
Float32 Triton dots run in TF32 (about 3e-4 relative error); bf16 inputs land between 1e-3 and 1e-2.
Legend: B batch, L query length, S key length, H query heads, K kv heads, Dh head dim, N rows, D width, V vocab.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxperf import _compat
from jaxperf.config import get_config, validate_model
from jaxperf.generate import Generator
from jaxperf.models import GPT
from jaxperf.models.attention import xla_attention
from jaxperf.parallel.mesh import make_mesh
from jaxperf.parallel.rules import activation_sharding
from jaxperf.step.task import build_task
from jaxperf.checkpoint import Checkpointer
from pallas_kernels import norms
from pallas_kernels.cross_entropy import linear_cross_entropy
from pallas_kernels.flash_attention import SegmentIds, flash_attention, flash_attention_reference

DRY_RUN = os.environ.get("JAXPERF_GPU_DRY_RUN") == "1"


def _gpu_devices():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


GPUS = _gpu_devices()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not GPUS and not DRY_RUN,
                       reason="needs an NVIDIA GPU (JAX_PLATFORMS=cuda,cpu); JAXPERF_GPU_DRY_RUN=1 runs these on the "
                              "CPU at tiny shapes"),
]
DEVICE = GPUS[0] if GPUS else jax.devices("cpu")[0]
CPU = jax.devices("cpu")[0]
# Tolerances on relative norms, per input dtype: (forward, gradients).
TOL = {jnp.float32: (2e-3, 4e-3), jnp.bfloat16: (2e-2, 3e-2)}


def _rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.isfinite(got).all(), "non-finite values"
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def _put(*xs):
    return [jax.device_put(x, DEVICE) for x in xs]


def _seq(n: int) -> int:
    """A sequence length, cut down in the dry run (interpret mode walks every grid step on the CPU); odd stays odd."""
    return min(n // 8, 128) if DRY_RUN else n


# ---------------------------------------------------------------------------------------------------------------------
# Flash attention: forward and backward against the fp32 reference.

ATTENTION_CASES = [
    # (B, L, H, K, Dh, dtype, causal, segments)
    *[(2, 1024, 8, 2, dh, dt, causal, False) for dt in (jnp.bfloat16, jnp.float32) for dh in (64, 128)
      for causal in (True, False)],
    (1, 1000, 4, 4, 128, jnp.bfloat16, True, False),  # a length that is no block multiple: padded and masked
    (2, 2048, 8, 2, 64, jnp.bfloat16, True, True),  # packed documents
    (1, 8192, 4, 1, 128, jnp.bfloat16, True, False),  # long sequence, multi-query
]
if DRY_RUN:  # at the dry run's short lengths most cases are alike: one of each kind
    ATTENTION_CASES = [ATTENTION_CASES[0], ATTENTION_CASES[7], *ATTENTION_CASES[-3:-1]]


def _attention_inputs(B, L, H, K, Dh, dtype, seed=0):
    kq, kk, kv, kd = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (B, L, H, Dh), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (B, L, K, Dh), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (B, L, K, Dh), jnp.float32).astype(dtype)
    do = jax.random.normal(kd, (B, L, H, Dh), jnp.float32).astype(dtype)
    return q, k, v, do


def _segments(B, L, seed=1):
    """Three or four documents per row, boundaries at random positions."""
    rng = np.random.default_rng(seed)
    out = np.zeros((B, L), np.int32)
    for b in range(B):
        for cut in sorted(rng.choice(np.arange(1, L), 3, replace=False)):
            out[b, cut:] += 1
    return jnp.asarray(out)


@pytest.mark.parametrize("B,L,H,K,Dh,dtype,causal,segments", ATTENTION_CASES,
                         ids=lambda x: getattr(x, "__name__", str(x)))
def test_flash_attention_matches_reference_on_device(B, L, H, K, Dh, dtype, causal, segments):
    L = _seq(L)
    q, k, v, do = _put(*_attention_inputs(B, L, H, K, Dh, dtype))
    segs = _put(_segments(B, L))[0] if segments else None

    def run(fn, *xs):
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, causal=causal, segment_ids=segs), *xs)
        return out, vjp(do.astype(out.dtype))

    out, grads = jax.jit(lambda *xs: run(flash_attention, *xs))(q, k, v)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want, want_grads = jax.jit(lambda *xs: run(flash_attention_reference, *xs))(*f32)
    assert out.dtype == dtype and out.devices() == {DEVICE}
    fwd_tol, grad_tol = TOL[dtype]
    assert _rel(out, want) < fwd_tol
    for name, g, w in zip("qkv", grads, want_grads):
        assert _rel(g, w) < grad_tol, f"d{name}"


def test_fully_masked_query_rows_give_zeros_on_device():
    """A query whose segment appears among no key sees nothing: kernel, reference and XLA path all give zeros."""
    B, L, H, K, Dh = 1, _seq(256), 4, 2, 64
    q, k, v, _ = _put(*_attention_inputs(B, L, H, K, Dh, jnp.float32, seed=3))
    q_seg = np.zeros((B, L), np.int32)
    q_seg[:, L // 2:] = 7  # no key carries segment 7
    segs = SegmentIds(*_put(jnp.asarray(q_seg), jnp.zeros((B, L), jnp.int32)))
    outs = {name: np.asarray(jax.jit(lambda q, k, v, fn=fn: fn(q, k, v, causal=False, segment_ids=segs))(q, k, v))
            for name, fn in (("kernel", flash_attention), ("reference", flash_attention_reference),
                             ("xla", xla_attention))}
    for name, out in outs.items():
        np.testing.assert_array_equal(out[:, L // 2:], 0.0, err_msg=f"{name}: fully masked rows must be zeros")
        assert _rel(out[:, : L // 2], outs["reference"][:, : L // 2]) < TOL[jnp.float32][0], name


# ---------------------------------------------------------------------------------------------------------------------
# Norms and the fused loss


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: d.__name__)
@pytest.mark.parametrize("kind", ["rms_norm", "layer_norm"])
def test_norm_kernels_match_reference_on_device(kind, dtype):
    N, D = (64, 256) if DRY_RUN else (4096, 2048)
    kx, kr, ks, kb, kg = jax.random.split(jax.random.key(4), 5)
    x = jax.random.normal(kx, (N, D), jnp.float32).astype(dtype)
    r = jax.random.normal(kr, (N, D), jnp.float32).astype(dtype)
    scale = 1 + 0.1 * jax.random.normal(ks, (D,), jnp.float32)
    bias = 0.1 * jax.random.normal(kb, (D,), jnp.float32)
    g = jax.random.normal(kg, (N, D), jnp.float32).astype(dtype)
    x, r, scale, bias, g = _put(x, r, scale, bias, g)
    kernel, reference = getattr(norms, kind), getattr(norms, f"{kind}_reference")
    extra = (bias,) if kind == "layer_norm" else ()

    def loss(fn, x, r, scale, *extra):
        out, h = fn(x, scale, *extra, residual=r)
        return jnp.sum(out.astype(jnp.float32) * g.astype(jnp.float32)) + jnp.sum(h.astype(jnp.float32))

    got = jax.jit(jax.value_and_grad(lambda *a: loss(kernel, *a), argnums=(0, 1, 2)))(x, r, scale, *extra)
    f32 = [a.astype(jnp.float32) for a in (x, r)]
    want = jax.jit(jax.value_and_grad(lambda *a: loss(reference, *a), argnums=(0, 1, 2)))(*f32, scale, *extra)
    fwd_tol, grad_tol = TOL[dtype]
    assert _rel(got[0], want[0]) < fwd_tol
    for name, a, b in zip(("dx", "dresidual", "dscale"), got[1], want[1]):
        assert _rel(a, b) < grad_tol, name


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: d.__name__)
def test_fused_cross_entropy_matches_reference_on_device(dtype):
    N, D, V = (128, 64, 1000) if DRY_RUN else (4096, 768, 50257)
    kh, kw, kt, km = jax.random.split(jax.random.key(5), 4)
    h = jax.random.normal(kh, (N, D), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (D, V), jnp.float32) * D**-0.5 * 3).astype(dtype)
    t = jax.random.randint(kt, (N,), 0, V)
    mask = (jax.random.uniform(km, (N,)) > 0.2).astype(jnp.float32)
    h, w, t, mask = _put(h, w, t, mask)

    def mean_loss(impl, h, w):
        total, count = linear_cross_entropy(h, w, t, mask, impl=impl)
        return total / count

    results = {impl: jax.jit(jax.value_and_grad(lambda h, w, impl=impl: mean_loss(impl, h, w), argnums=(0, 1)))(
        *((h, w) if impl != "reference" else (h.astype(jnp.float32), w.astype(jnp.float32))))
        for impl in ("pallas", "xla", "reference")}
    fwd_tol, grad_tol = TOL[dtype]
    for impl in ("pallas", "xla"):
        loss, (dh, dw) = results[impl]
        want, (want_dh, want_dw) = results["reference"]
        assert abs(float(loss) - float(want)) / abs(float(want)) < fwd_tol, impl
        assert _rel(dh, want_dh) < grad_tol, f"{impl} dh"
        assert _rel(dw, want_dw) < grad_tol, f"{impl} dw"


# ---------------------------------------------------------------------------------------------------------------------
# cuDNN attention


@pytest.mark.parametrize("causal", [True, False])
def test_cudnn_attention_matches_xla(causal):
    if not GPUS:
        pytest.skip("cuDNN attention needs an NVIDIA GPU (nothing to dry-run on a CPU)")
    B, L, H, K, Dh = 2, 2048, 16, 4, 128
    q, k, v, do = _put(*_attention_inputs(B, L, H, K, Dh, jnp.bfloat16, seed=6))

    def run(fn, *xs):
        out, vjp = jax.vjp(fn, *xs)
        return out, vjp(do)

    cudnn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")  # noqa
    got, got_grads = jax.jit(lambda *xs: run(cudnn, *xs))(q, k, v)
    want, want_grads = jax.jit(lambda *xs: run(lambda q, k, v: xla_attention(q, k, v, causal=causal), *xs))(q, k, v)
    assert _rel(got, want) < 2e-2
    for name, a, b in zip("qkv", got_grads, want_grads):
        assert _rel(a, b) < 3e-2, f"d{name}"


# ---------------------------------------------------------------------------------------------------------------------
# The model on the device against the same model on the CPU


def _tiny_fp32(extra=()):
    return get_config("tiny", ["model.dtype=float32", "batch_size=8", "seq_len=128", *extra])


def _task(cfg, device):
    return build_task(cfg, make_mesh(cfg.parallel, devices=[device]))


def _batch(cfg, seed=0):
    rng = np.random.default_rng(seed)
    B, L = cfg.batch_size, cfg.train_seq_len
    tokens = rng.integers(0, cfg.model.vocab_size, (B, L + 1)).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": np.ones((B, L), np.float32)}


def _loss_and_grads(task, params, batch):
    def f(p):
        with activation_sharding(task.mesh, task.rules):
            return task.loss_fn(task.merge(p), batch)[0]

    return jax.jit(jax.value_and_grad(f))(params)


def test_train_step_on_device_matches_cpu():
    """Same parameters and batch: the loss, every gradient and one optimizer step agree with the CPU's (fp32, full
    precision matmuls: TF32 would differ by ~1e-3)."""
    cfg = _tiny_fp32()
    cpu_task, dev_task = _task(cfg, CPU), _task(cfg, DEVICE)
    state = cpu_task.init_state()
    batch = _batch(cfg)
    with jax.default_matmul_precision("highest"):
        want_loss, want_grads = _loss_and_grads(cpu_task, state.params, jax.device_put(batch, CPU))
        dev_state = jax.device_put(state, dev_task.state_shardings())
        loss, grads = _loss_and_grads(dev_task, dev_state.params, jax.device_put(batch, DEVICE))
        assert abs(float(loss) - float(want_loss)) < 1e-5 * abs(float(want_loss))
        flat, want_flat = jax.tree.leaves_with_path(grads), jax.tree.leaves(want_grads)
        # Relative to the whole gradient too: a leaf whose true gradient is zero (the key bias: softmax ignores a
        # shift shared by a row's scores) holds only rounding noise on either side.
        total = float(np.sqrt(sum(np.sum(np.square(np.asarray(w, np.float64))) for w in want_flat)))
        for (path, g), w in zip(flat, want_flat):
            err = np.linalg.norm(np.asarray(g, np.float64) - np.asarray(w, np.float64))
            assert err <= 1e-4 * np.linalg.norm(np.asarray(w, np.float64)) + 1e-7 * total, jax.tree_util.keystr(path)
        step = dev_task.train_step(donate=False)
        new_state, metrics = step(dev_state, jax.device_put(batch, dev_task.batch_sharding()))
        cpu_state, cpu_metrics = cpu_task.train_step(donate=False)(state, jax.device_put(batch, CPU))
    assert abs(float(metrics["loss"]) - float(cpu_metrics["loss"])) < 1e-5 * abs(float(cpu_metrics["loss"]))
    # Adam scales every gradient to about lr: a leaf whose gradient is rounding noise moves by +-lr either way, so
    # it is held to that bound; every other leaf must agree closely.
    lr = float(metrics["lr"])
    for (path, a), b, w in zip(jax.tree.leaves_with_path(new_state.params), jax.tree.leaves(cpu_state.params),
                               want_flat):
        if np.linalg.norm(np.asarray(w, np.float64)) <= 1e-6 * total:
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=2.5 * lr,
                                       err_msg=jax.tree_util.keystr(path))
        else:
            assert _rel(a, b) < 1e-4, jax.tree_util.keystr(path)


def test_checkpoint_saved_from_device_restores_bitwise(tmp_path):
    cfg = _tiny_fp32()
    task = _task(cfg, DEVICE)
    state = task.init_state()
    state, _ = task.train_step(donate=False)(state, jax.device_put(_batch(cfg), task.batch_sharding()))
    with Checkpointer(tmp_path, keep=1) as ckpt:
        assert ckpt.save(1, state)
        ckpt.wait()
        restored, _ = ckpt.restore(1, task.abstract_state())
    for (path, a), b in zip(jax.tree.leaves_with_path(state), jax.tree.leaves(restored)):
        assert b.devices() == {DEVICE}, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=jax.tree_util.keystr(path))


def test_greedy_generation_on_device_matches_cpu():
    mcfg = validate_model(_tiny_fp32().model)
    model = GPT(mcfg, rngs=nnx.Rngs(0))
    prompts = [[5, 17, 99, 3], [42] * 9, list(range(1, 30))]
    tokens = {}
    with jax.default_matmul_precision("highest"):
        for name, device in (("cpu", CPU), ("device", DEVICE)):
            mesh = _compat.make_mesh((1, 1, 1), ("data", "fsdp", "tensor"), devices=[device])
            gen = Generator(model, mesh=mesh)
            tokens[name] = [row.tokens for row in gen.generate(prompts, max_tokens=24, temperature=0.0)]
    assert tokens["device"] == tokens["cpu"]
