"""Fused linear + cross-entropy vs its jnp reference: values, dh/dw/dmask, z-loss, masks, padding, memory, model parity.

The Pallas kernels really run here: on CPU `impl="pallas"` runs their bodies in interpret mode.
Legend: N tokens, D model width, V vocabulary.
"""


import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _accelerators import gpu_kernel_names, lower_for_cuda, tpu_replicated

import pallas_kernels.cross_entropy as ce
from pallas_kernels.cross_entropy import (
    BlockSizes,
    linear_cross_entropy,
    linear_cross_entropy_reference,
    unavailable_reason,
)

# dtype -> (value rtol, gradient atol/rtol); low precision is compared with the reference on the same inputs.
TOL = {jnp.float32: (1e-5, 2e-5), jnp.bfloat16: (1e-2, 3e-2)}


def _inputs(N, D, V, dtype, masked, seed=0):
    kh, kw, kt, km = jax.random.split(jax.random.key(seed), 4)
    h = jax.random.normal(kh, (N, D), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (D, V), jnp.float32) * D**-0.5 * 3).astype(dtype)
    t = jax.random.randint(kt, (N,), 0, V)
    mask = None
    if masked:
        mask = (jax.random.uniform(km, (N,)) > 0.3).astype(jnp.float32)
        t = jnp.where(mask > 0, t, -1)  # ignored tokens may carry any id
    return h, w, t, mask


def _value_and_grads(h, w, t, mask, **kw):
    """Mean loss and its gradients in h, w (and the mask weights when given)."""

    def loss(h, w, m):
        total, count = linear_cross_entropy(h, w, t, m, **kw)
        return total / jnp.maximum(count, 1.0)

    argnums = (0, 1) if mask is None else (0, 1, 2)
    return jax.jit(jax.value_and_grad(loss, argnums=argnums))(h, w, mask)


def _assert_close(actual, expected, tol, what):
    np.testing.assert_allclose(
        np.asarray(actual, np.float32), np.asarray(expected, np.float32), atol=tol, rtol=tol, err_msg=what
    )


CASES = [
    # N, D, V, masked, z_loss, dtype
    (1, 32, 100, False, 0.0, jnp.float32),
    (77, 32, 257, True, 0.0, jnp.float32),
    (130, 64, 512, True, 1e-2, jnp.float32),
    (77, 64, 100, False, 1e-2, jnp.float32),
    (130, 32, 257, False, 0.0, jnp.float32),
    (1, 64, 512, True, 1e-2, jnp.float32),
    (130, 64, 257, True, 1e-2, jnp.bfloat16),
    (77, 32, 512, False, 0.0, jnp.bfloat16),
]
# Interpret mode compiles slowly: the kernels get the subset that still covers every N, V, D, mask, z-loss and dtype.
PALLAS_CASES = [CASES[i] for i in (0, 2, 3, 4, 6)]
IMPL_CASES = [("xla",) + c for c in CASES] + [("pallas",) + c for c in PALLAS_CASES]


@pytest.mark.parametrize("impl,N,D,V,masked,z_loss,dtype", IMPL_CASES)
def test_values_and_grads_match_reference(impl, N, D, V, masked, z_loss, dtype):
    h, w, t, mask = _inputs(N, D, V, dtype, masked)
    if masked and N == 1:
        mask = jnp.ones((1,), jnp.float32)  # a lone masked token would make the mean 0 / 1 and test nothing
    # Small tiles: several row and vocab blocks (a padded last one on the Pallas path; on the xla path V=257 has no
    # divisor near chunk_v and takes one block, 100 and 512 take 4 and 16).
    blocks = BlockSizes(block_n=32, block_v=64, chunk_n=48, chunk_v=48)
    value, grads = _value_and_grads(h, w, t, mask, z_loss=z_loss, impl=impl, block_sizes=blocks)
    ref_value, ref_grads = _value_and_grads(h, w, t, mask, z_loss=z_loss, impl="reference")
    value_tol, grad_tol = TOL[dtype]
    _assert_close(value, ref_value, value_tol, "loss")
    for name, g, rg in zip(("dh", "dw", "dmask"), grads, ref_grads):
        assert g.shape == rg.shape and g.dtype == rg.dtype, name
        _assert_close(g, rg, grad_tol, name)
    assert float(jnp.max(jnp.abs(grads[1].astype(jnp.float32)))) > 1e-3  # the gradient is not trivially zero


def test_grid_reduction_layout_and_sum_count():
    """grid_reduction=True is the TPU layout (reductions over a sequential grid axis whose output block accumulates);
    the value tests above run the Triton layout (in-kernel loops), the CPU default."""
    h, w, t, mask = _inputs(40, 32, 300, jnp.float32, True, seed=1)
    blocks = BlockSizes(block_n=16, block_v=128, grid_reduction=True)
    total, count = linear_cross_entropy(h, w, t, mask, z_loss=1e-3, impl="pallas", block_sizes=blocks)
    ref_total, ref_count = linear_cross_entropy_reference(h, w, t, mask, z_loss=1e-3)
    assert total.dtype == jnp.float32 and count.shape == ()
    _assert_close(total, ref_total, 1e-5, "loss sum")
    assert float(count) == float(jnp.sum(mask)) == float(ref_count)

    def f(impl):
        return jax.grad(lambda h, w: linear_cross_entropy(h, w, t, mask, impl=impl, block_sizes=blocks)[0], (0, 1))

    for name, g, rg in zip(("dh", "dw"), jax.jit(f("pallas"))(h, w), jax.jit(f("reference"))(h, w)):
        _assert_close(g, rg, 2e-5, name)


def test_tpu_interpreter_runs_the_tpu_layout():
    """interpret=pltpu.InterpretParams() runs the kernels on CPU with TPU semantics, and picks the TPU layout
    (grid_reduction) by default."""
    pltpu = pytest.importorskip("jax.experimental.pallas.tpu")
    h, w, t, mask = _inputs(40, 32, 300, jnp.float32, True, seed=2)
    kw = dict(impl="pallas", block_sizes=BlockSizes(block_n=16, block_v=128), interpret=pltpu.InterpretParams())
    jaxpr = str(jax.make_jaxpr(lambda h, w: linear_cross_entropy(h, w, t, mask, **kw))(h, w))
    assert "grid=(3, 3)" in jaxpr, "expected the (row blocks, vocab blocks) grid of the TPU layout"

    def f(fn, **kw):
        return jax.jit(jax.value_and_grad(lambda h, w: fn(h, w, t, mask, **kw)[0], (0, 1)))

    value, grads = f(linear_cross_entropy, **kw)(h, w)
    ref_value, ref_grads = f(linear_cross_entropy_reference)(h, w)
    _assert_close(value, ref_value, 1e-5, "loss sum")
    for name, g, rg in zip(("dh", "dw"), grads, ref_grads):
        _assert_close(g, rg, 2e-5, name)


def test_pallas_path_runs_three_kernels():
    h, w, t, _ = _inputs(40, 32, 100, jnp.float32, False)
    grad = jax.grad(lambda h, w: linear_cross_entropy(h, w, t, impl="pallas")[0], (0, 1))
    assert str(jax.make_jaxpr(grad)(h, w)).count("pallas_call") == 3  # forward, dh and dw kernels
    grad = jax.grad(lambda h, w: linear_cross_entropy(h, w, t, impl="xla")[0], (0, 1))
    assert "pallas_call" not in str(jax.make_jaxpr(grad)(h, w))


def test_memory_of_fused_paths_vs_logits():
    """GPT-2 scale loss head: compile (do not run) value_and_grad and compare temporaries + outputs."""
    N, D, V = 8192, 768, 50304
    h = jax.ShapeDtypeStruct((N, D), jnp.float32)
    w = jax.ShapeDtypeStruct((D, V), jnp.float32)
    t = jax.ShapeDtypeStruct((N,), jnp.int32)

    def peak_bytes(impl):
        def loss(h, w, t):
            total, count = linear_cross_entropy(h, w, t, impl=impl)
            return total / count

        stats = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(h, w, t).compile().memory_analysis()
        return stats.temp_size_in_bytes + stats.output_size_in_bytes

    naive, xla, pallas = peak_bytes("reference"), peak_bytes("xla"), peak_bytes("pallas")
    logits_bytes = N * V * 4
    print(f"temp+output MiB: logits {naive / 2**20:.0f}, xla {xla / 2**20:.0f}, pallas(interpret) {pallas / 2**20:.0f}")
    assert naive >= logits_bytes, (naive, logits_bytes)  # the naive path really holds the fp32 logits
    assert naive >= 4 * xla, f"chunked path {xla / 2**20:.0f} MiB is not 4x below {naive / 2**20:.0f} MiB"
    # Interpret mode runs the kernels as a scan over the grid; the TPU test below checks the compiled kernels.
    assert naive >= 4 * pallas, f"pallas path {pallas / 2**20:.0f} MiB vs logits path {naive / 2**20:.0f} MiB"


def test_xla_backward_accumulates_dw_one_vocab_block_at_a_time():
    """bf16 weights (Llama-3 style): the fp32 dw accumulator of the xla backward is [D, block], not [D, V]."""
    N, D, V = 2048, 768, 50304
    h = jax.ShapeDtypeStruct((N, D), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((D, V), jnp.bfloat16)
    t = jax.ShapeDtypeStruct((N,), jnp.int32)

    def temp_bytes(chunk_v):
        blocks = BlockSizes(block_n=128, block_v=512, chunk_n=512, chunk_v=chunk_v)

        def loss(h, w, t):
            total, count = linear_cross_entropy(h, w, t, impl="xla", block_sizes=blocks)
            return total / count

        return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(h, w, t).compile().memory_analysis().temp_size_in_bytes

    assert ce.xla_vocab_block(V, 8192) == 6288 and ce.xla_vocab_block(257, 48) == 257 and ce.xla_vocab_block(100, 48) == 25
    whole, blocked = temp_bytes(V), temp_bytes(8192)
    accumulator = D * V * 4
    assert whole - blocked >= 0.7 * accumulator, (
        f"blocked backward temp {blocked / 2**20:.0f} MiB vs one block {whole / 2**20:.0f} MiB: the fp32 dw "
        f"accumulator ({accumulator / 2**20:.0f} MiB) is still whole")


def _split_w_loss(impl, mesh, blocks, keep_gathered=False):
    """The mean loss with rows over (data, fsdp) and w's rows over fsdp (`w_axes`), as the model's FSDP loss runs."""
    from jax.sharding import PartitionSpec as P

    from jaxperf import _compat

    rows = ("data", "fsdp")

    def per_shard(h, w, t, m):
        total, count = linear_cross_entropy(h, w, t, m, impl=impl, block_sizes=blocks, w_axes="fsdp",
                                            keep_gathered=keep_gathered)
        return jax.lax.psum(total, rows), jax.lax.psum(count, rows)

    def loss(h, w, t, m):
        total, count = _compat.shard_map(per_shard, mesh=mesh, in_specs=(P(rows), P("fsdp", None), P(rows), P(rows)),
                                         out_specs=(P(), P()), check_vma=False)(h, w, t, m)
        return total / jnp.maximum(count, 1.0)

    return loss


@pytest.mark.parametrize("impl,keep", [("xla", False), ("xla", True), ("pallas", False), ("pallas", True)])
def test_w_split_over_fsdp_matches_the_whole_w_and_is_gathered_a_block_at_a_time(impl, keep):
    """8 devices, data=2 x fsdp=4, each holding a quarter of w's rows: loss, dh, dw and dmask equal the reference on the
    whole w. The chunked path gathers [D, block] slices of w and reduce-scatters [D, block] gradients, never [D, V];
    with `keep_gathered` it gathers the whole w once, for both passes, and still reduce-scatters by blocks; the
    kernel gathers the whole w up front, with or without it."""
    from jaxperf import _compat

    N, D, V = 64, 32, 100
    mesh = _compat.make_mesh((2, 4), ("data", "fsdp"))
    h, w, t, mask = _inputs(N, D, V, jnp.float32, True, seed=3)
    blocks = BlockSizes(block_n=8, block_v=64, chunk_n=8, chunk_v=48)  # xla: 4 vocabulary blocks of 25
    fn = jax.jit(jax.value_and_grad(_split_w_loss(impl, mesh, blocks, keep), argnums=(0, 1, 3)))
    value, grads = fn(h, w, t, mask)
    ref_value, ref_grads = _value_and_grads(h, w, t, mask, impl="reference")
    _assert_close(value, ref_value, 1e-5, "loss")
    for name, g, rg in zip(("dh", "dw", "dmask"), grads, ref_grads):
        assert g.shape == rg.shape, name
        _assert_close(g, rg, 2e-5, name)

    hlo = fn.lower(h, w, t, mask).compile().as_text()
    gathers = re.findall(r"= f32\[(\d+,\d+)\]\{[^}]*\} all-gather", hlo)
    gathered = set(gathers)
    scattered = set(re.findall(r"= f32\[(\d+,\d+)\]\{[^}]*\} reduce-scatter", hlo))
    if impl == "xla" and keep:
        assert gathers == [f"{D},{V}"] and scattered == {f"{D // 4},25"}, (gathers, scattered)
    elif impl == "xla":
        assert gathered == {f"{D},25"} and scattered == {f"{D // 4},25"}, (gathered, scattered)
    else:
        assert f"{D},{V}" in gathered, gathered


def test_chunked_backward_keeps_one_fp32_dh_accumulator():
    """The chunked path's backward adds each vocabulary block's dh into one fp32 [N, D] accumulator, a chunk of rows
    at a time in place: no stacked fp32 [chunks, chunk, D] output beside it (a second 128 MiB per device at 8,192
    rows of 4,096 on a v6e Llama-2-7B step). The gradient is the reference's."""
    N, D, V = 64, 32, 100
    h, w, t, _ = _inputs(N, D, V, jnp.bfloat16, False, seed=4)
    blocks = BlockSizes(block_n=16, block_v=64, chunk_n=16, chunk_v=48)  # 4 row chunks, 4 vocabulary blocks of 25

    def loss(h, w):
        total, count = linear_cross_entropy(h, w, t, impl="xla", block_sizes=blocks)
        return total / count

    text = str(jax.make_jaxpr(jax.grad(loss, (0, 1)))(h, w))
    assert f"f32[{N},{D}]" in text and f"f32[4,16,{D}]" not in text
    dh, dw = jax.jit(jax.grad(loss, (0, 1)))(h, w)
    rdh, rdw = _value_and_grads(h.astype(jnp.float32), w.astype(jnp.float32), t, None, impl="reference")[1]
    _assert_close(dh.astype(jnp.float32), rdh, 2e-2, "dh")
    _assert_close(dw.astype(jnp.float32), rdw, 2e-2, "dw")


def test_w_split_that_does_not_add_up_to_h_width_is_refused():
    from jax.sharding import PartitionSpec as P

    from jaxperf import _compat

    mesh = _compat.make_mesh((2, 4), ("data", "fsdp"))
    h, w, t, _ = _inputs(64, 32, 100, jnp.float32, False)

    def per_shard(h, w, t):
        return linear_cross_entropy(h, w, t, impl="xla", w_axes="fsdp")

    fn = _compat.shard_map(per_shard, mesh=mesh, in_specs=(P("data"), P(None, "fsdp"), P("data")),
                           out_specs=(P(), P()), check_vma=False)
    refusal = r"w holds 32 rows split over 4 devices \(w_axes\), 128 in all, but h has D=32"
    with pytest.raises(ValueError, match=refusal):
        jax.eval_shape(fn, h, w, t)


def _fixed_batch(batch=8, seq=16, vocab=256, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (batch, seq + 1)).astype(np.int32)
    mask = np.ones((batch, seq), np.float32)
    mask[:, :3] = 0.0  # a few ignored tokens
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask}


def _task(loss_impl, *overrides):
    from jaxperf.config import OptimConfig, ParallelConfig, get_config
    from jaxperf.models import GPT
    from jaxperf.parallel.mesh import make_mesh
    from jaxperf.parallel.rules import get_rules
    from jaxperf.step.optimizer import make_optimizer
    from jaxperf.step.task import Task

    cfg = get_config("tiny", ["d_model=32", "n_layers=1", "n_heads=2", "max_seq_len=16",
                              f"loss_impl={loss_impl}", *overrides]).model
    parallel = ParallelConfig(strategy="fsdp", fsdp=8)
    mesh = make_mesh(parallel, None)
    tx, schedule = make_optimizer(OptimConfig(lr=3e-3, warmup_steps=1), 10)
    return Task.create(lambda rngs: GPT(cfg, rngs=rngs), mesh, get_rules(parallel.strategy, mesh), tx), schedule


def _train_three_steps(task, schedule, loss_fn, state):
    """Losses of 3 steps from a copy of `state` (the step donates its input) and the final parameters."""
    step = task.train_step(loss_fn, schedule=schedule)
    state = jax.tree.map(jnp.copy, state)
    batch = jax.device_put(_fixed_batch(), task.batch_sharding())
    losses = []
    for _ in range(3):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, jax.tree_util.tree_leaves_with_path(jax.tree.map(np.asarray, state.params))


def _chunked_loss(model, batch):
    """The model's loss through the chunked "xla" path (small chunks, so several per shard)."""
    h_BxLxD = model.hidden(batch["inputs"])
    B, L, D = h_BxLxD.shape
    total, count = linear_cross_entropy(
        h_BxLxD.reshape(B * L, D), model.output_weights().astype(h_BxLxD.dtype), batch["targets"].reshape(B * L),
        batch["mask"].reshape(B * L), impl="xla", block_sizes=BlockSizes(32, 64, chunk_n=64))
    return total / jnp.maximum(count, 1.0), {"weight": count}


@pytest.mark.slow
def test_tiny_gpt_trains_the_same_with_fused_losses(monkeypatch):
    """3 steps under an 8-device FSDP mesh: loss_impl="pallas" and the chunked path (its output weights gathered by
    blocks, or whole once: `loss_gather_once`) match the logits path."""
    from jaxperf.models.gpt import gpt_loss as next_token_loss

    kernel_traces = []
    real_fwd = ce._fwd_pallas
    monkeypatch.setattr(ce, "_fwd_pallas", lambda *a: kernel_traces.append(1) or real_fwd(*a))

    base_task, schedule = _task("auto")
    pallas_task, _ = _task("pallas")  # same parameters; only model.loss_impl differs
    chunked_task, _ = _task("chunked")
    once_task, _ = _task("chunked", "loss_gather_once=true")
    state = base_task.init_state()
    base_losses, base_params = _train_three_steps(base_task, schedule, next_token_loss, state)
    assert not kernel_traces
    runs = {"pallas": (pallas_task, next_token_loss), "chunked": (base_task, _chunked_loss),
            "chunked-config": (chunked_task, next_token_loss), "chunked-gathered-once": (once_task, next_token_loss)}
    for name, (task, loss_fn) in runs.items():
        kernel_traces.clear()
        losses, params = _train_three_steps(task, schedule, loss_fn, state)
        assert bool(kernel_traces) == (name == "pallas"), f"{name}: the Pallas kernel was (not) traced"
        np.testing.assert_allclose(losses, base_losses, rtol=2e-5, err_msg=f"{name} losses")
        assert losses[2] < losses[0], losses  # it trained
        assert len(params) == len(base_params) > 0
        for (path, p), (_, ref) in zip(params, base_params):
            np.testing.assert_allclose(p, ref, atol=2e-5, rtol=1e-4, err_msg=f"{name} {jax.tree_util.keystr(path)}")


@pytest.mark.parametrize(
    "h_shape,w_shape,t_shape,kw,match",
    [
        ((8, 32), (16, 100), (8,), {}, "h has D=32 features but w has 16 rows"),
        ((2, 8, 32), (32, 100), (8,), {}, r"h must be \[N, D\].*\(2, 8, 32\)"),
        ((8, 32), (32, 100), (7,), {}, r"targets must be \[N\] = \(8,\).*\(7,\)"),
        ((8, 32), (32, 100), (8,), {"mask": jnp.ones((9,))}, r"mask must be \[N\] = \(8,\).*\(9,\)"),
        ((8, 32), (32, 100), (8,), {"z_loss": -1.0}, "z_loss must be a non-negative"),
        ((8, 32), (32, 100), (8,), {"impl": "cudnn"}, "impl='cudnn' is not one of"),
        ((8, 32), (32, 100), (8,), {"impl": "pallas", "block_sizes": BlockSizes(0, 64)}, "block_n=0"),
        ((8, 32), (32, 100), (8,), {"impl": "xla", "block_sizes": BlockSizes(8, 64, chunk_n=-4)}, "chunk_n=-4"),
        ((8, 32), (32, 100), (8,), {"impl": "pallas", "block_sizes": BlockSizes(8, 96), "backend": "tpu"},
         "block_v=96 must be a multiple of 128 on TPU"),
        ((8, 32), (32, 100), (8,), {"impl": "pallas", "block_sizes": BlockSizes(24, 64), "backend": "gpu"},
         "block_n=24 must be a power of two"),
        ((8, 32), (32, 100), (8,), {"impl": "pallas", "interpret": False}, "pass interpret=True"),
    ],
)
def test_bad_inputs_raise_with_numbers(h_shape, w_shape, t_shape, kw, match):
    h, w, t = jnp.zeros(h_shape), jnp.zeros(w_shape), jnp.zeros(t_shape, jnp.int32)
    with pytest.raises(ValueError, match=match):
        linear_cross_entropy(h, w, t, **kw)


def test_dtype_errors_and_unavailable_reason():
    h, w, t = jnp.zeros((8, 32)), jnp.zeros((32, 100)), jnp.zeros((8,), jnp.int32)
    with pytest.raises(ValueError, match="cast w with w.astype"):
        linear_cross_entropy(h, w.astype(jnp.bfloat16), t)
    with pytest.raises(ValueError, match="targets must be integer"):
        linear_cross_entropy(h, w, t.astype(jnp.float32))
    with pytest.raises(ValueError, match="dtype int32 is not supported"):
        linear_cross_entropy(h.astype(jnp.int32), w.astype(jnp.int32), t)
    assert unavailable_reason(h, w) is None  # CPU: interpret mode
    assert "dtypes" in unavailable_reason(h, w.astype(jnp.bfloat16))
    assert "need h [N, D]" in unavailable_reason(h, w.T)
    with pytest.raises(RuntimeError, match="cannot run here"):
        linear_cross_entropy(h, w, t, impl="pallas", backend="metal")


def test_block_sizes_defaults():
    for backend in ("cpu", "gpu", "tpu"):
        blocks = BlockSizes.get_default(backend)
        assert blocks.block_n & (blocks.block_n - 1) == 0 and blocks.block_v & (blocks.block_v - 1) == 0
    assert BlockSizes.get_default("tpu").block_v % 128 == 0 and BlockSizes.get_default("tpu").block_n % 8 == 0


def test_tpu_lowering_compiles_fwd_and_bwd():
    replicated = tpu_replicated("v5p:2x2x1")
    h = jax.ShapeDtypeStruct((1000, 256), jnp.bfloat16, sharding=replicated)
    w = jax.ShapeDtypeStruct((256, 5000), jnp.bfloat16, sharding=replicated)
    t = jax.ShapeDtypeStruct((1000,), jnp.int32, sharding=replicated)

    def loss(h, w, t):
        return linear_cross_entropy(h, w, t, z_loss=1e-4, impl="pallas", backend="tpu")[0]

    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(h, w, t).compile()
    assert compiled.as_text().count("tpu_custom_call") >= 3, "expected the forward, dh and dw Mosaic kernels"
    assert compiled.memory_analysis() is not None

    # GPT-2 scale in bf16: the compiled kernels' temporaries + outputs stay far below the fp32 logits alone.
    N, D, V = 8192, 768, 50304
    h = jax.ShapeDtypeStruct((N, D), jnp.bfloat16, sharding=replicated)
    w = jax.ShapeDtypeStruct((D, V), jnp.bfloat16, sharding=replicated)
    t = jax.ShapeDtypeStruct((N,), jnp.int32, sharding=replicated)
    stats = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(h, w, t).compile().memory_analysis()
    fused = stats.temp_size_in_bytes + stats.output_size_in_bytes
    assert 4 * fused <= N * V * 4, f"fused {fused / 2**20:.0f} MiB vs fp32 logits {N * V * 4 / 2**20:.0f} MiB"


# ---------------------------------------------------------------------------------------------------------------------
# GPU: lower forward and backward through the Pallas Triton lowering from this CPU-only machine, at LM-head shapes.


@pytest.mark.parametrize("N,D,V", [(4096, 2048, 32768), (4000, 2000, 50257)])  # the second: nothing a power of two
def test_gpu_lowering_fwd_and_bwd(N, D, V):
    h = jax.ShapeDtypeStruct((N, D), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((D, V), jnp.bfloat16)
    t = jax.ShapeDtypeStruct((N,), jnp.int32)
    mask = jax.ShapeDtypeStruct((N,), jnp.float32)

    def loss(h, w, t, mask):
        total, count = linear_cross_entropy(h, w, t, mask, z_loss=1e-4, impl="pallas", backend="gpu")
        return total / count

    text = lower_for_cuda(jax.value_and_grad(loss, argnums=(0, 1)), h, w, t, mask)
    assert gpu_kernel_names(text) == ["linear_cross_entropy_fwd", "linear_cross_entropy_dh", "linear_cross_entropy_dw"]


def test_gpu_tiles_shrink_to_fit_shared_memory_or_refuse_a_width_that_cannot():
    """Triton holds [block_n, D] and [D, block_v] tiles in shared memory (D padded to a power of two): the tiles halve
    until they fit the budget; a width too wide even at 16 x 16 is refused with the numbers and the fix."""
    blocks = BlockSizes.get_default("gpu")
    for D, itemsize, want in ((768, 2, (32, 32)), (768, 4, (16, 16)), (2048, 2, (16, 16)), (64, 4, (64, 128))):
        cfg = ce._fit(blocks, 4096, D, 50257, "pallas", "gpu", False, itemsize=itemsize)
        assert (cfg.block_n, cfg.block_v) == want, (D, itemsize)
        assert ce._gpu_tile_bytes(cfg.block_n, cfg.block_v, cfg.dim_pad, itemsize) <= ce.GPU_SHARED_MEMORY_BUDGET
        assert cfg.vocab_pad % cfg.block_v == 0 and cfg.rows_pad % cfg.block_n == 0
    with pytest.raises(ValueError, match=r"D=4096 at 2 bytes .* use impl='xla'"):
        ce._fit(blocks, 4096, 4096, 50257, "pallas", "gpu", False, itemsize=2)
    wide = (jax.ShapeDtypeStruct((8, 4096), jnp.bfloat16), jax.ShapeDtypeStruct((4096, 256), jnp.bfloat16))
    assert "shared memory" in unavailable_reason(*wide, backend="gpu")
    assert unavailable_reason(*wide, backend="tpu") is None  # the limit is Triton's alone
    # Interpret mode and the xla path keep the tiles they are given.
    assert ce._fit(blocks, 4096, 768, 50257, "pallas", "gpu", True, itemsize=2).block_n == 64
