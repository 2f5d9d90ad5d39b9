"""The Transformer: attention against JAX's own, scan == loop, remat changes memory not numbers, dtypes, RoPE."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxperf.config import REMAT_NAMES, ModelConfig
from jaxperf.models import GPT, REMAT_POLICIES, attention, xla_attention
from jaxperf.models.layers import REMAT_SAVES, Block, decode_attention, dense, remat_policy, rope, to_compute
from pallas_kernels.flash_attention import flash_attention_reference

SMALL = ModelConfig(d_model=32, n_layers=2, n_heads=4, max_seq_len=16, vocab_size=64, vocab_multiple=64)


@pytest.mark.parametrize("heads,kv_heads,causal", [(4, 4, True), (4, 2, True), (4, 1, False), (8, 2, False)])
def test_xla_attention_matches_jax(heads, kv_heads, causal):
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (2, 13, heads, 16))
    k = jax.random.normal(kk, (2, 13, kv_heads, 16))
    v = jax.random.normal(kv, (2, 13, kv_heads, 16))
    ours = xla_attention(q, k, v, causal=causal)
    ref = jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5)


def test_segment_ids_block_attention_across_documents():
    q = k = v = jax.random.normal(jax.random.key(1), (1, 8, 2, 8))
    seg = jnp.array([[0, 0, 0, 1, 1, 1, 1, 1]])
    attend = jax.jit(functools.partial(xla_attention, causal=True))  # compiled: op by op, one program per operation
    packed = attend(q, k, v, segment_ids=seg)
    first = attend(q[:, :3], k[:, :3], v[:, :3])
    second = attend(q[:, 3:], k[:, 3:], v[:, 3:])
    np.testing.assert_allclose(packed, jnp.concatenate([first, second], axis=1), rtol=1e-6, atol=1e-6)


def test_grouped_heads_with_segments_and_a_longer_key_block():
    """GQA stacks a KV head's query heads along the query axis: segments and the end-aligned causal mask follow."""
    kq, kk, kv = jax.random.split(jax.random.key(2), 3)
    q = jax.random.normal(kq, (2, 8, 6, 8))
    k = jax.random.normal(kk, (2, 8, 2, 8))
    v = jax.random.normal(kv, (2, 8, 2, 8))
    seg = jnp.array([[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 1, 1]])
    packed = jax.jit(functools.partial(xla_attention, causal=True))(q, k, v, segment_ids=seg)
    expanded = [jnp.repeat(a, 3, axis=2) for a in (k, v)]  # query head h uses kv head h // 3
    reference = jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="xla"))
    for b, cut in ((0, 3), (1, 6)):
        for lo, hi in ((0, cut), (cut, 8)):
            want = reference(q[b:b + 1, lo:hi], expanded[0][b:b + 1, lo:hi], expanded[1][b:b + 1, lo:hi])
            np.testing.assert_allclose(packed[b:b + 1, lo:hi], want, rtol=1e-5, atol=1e-5)
    # Two new queries against eight keys: the queries sit at positions 6 and 7.
    tail = xla_attention(q[:, 6:], k, v, causal=True)
    np.testing.assert_allclose(tail, xla_attention(q, k, v, causal=True)[:, 6:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal,segments,L,S", [(True, True, 12, 12), (False, True, 12, 12), (True, False, 12, 8)])
def test_fully_masked_queries_output_zeros_as_the_kernel_reference(causal, segments, L, S):
    """A query that sees no key (its segment id is in no key; causal with S < L, a query before the first key)
    outputs zeros and passes no gradient, as `flash_attention_reference` and FlashAttention do."""
    kq, kk, kv, kc = jax.random.split(jax.random.key(4), 4)
    q, ct = jax.random.normal(kq, (2, L, 4, 8)), jax.random.normal(kc, (2, L, 4, 8))
    k, v = jax.random.normal(kk, (2, S, 2, 8)), jax.random.normal(kv, (2, S, 2, 8))
    empty = np.zeros((2, L), bool)
    segs = None
    if segments:
        kv_seg = jnp.array([[0] * 6 + [1] * 6, [0] * 12])
        empty[0, 2:5] = empty[1, 0] = empty[1, L - 1] = True
        segs = (jnp.where(empty, -1, kv_seg), kv_seg)
    else:
        empty[:, : L - S] = True
    ct = jnp.where(empty[:, :, None, None], 1e6, 1.0) * ct  # huge cotangents on the empty rows must not leak

    @functools.partial(jax.jit, static_argnums=0)  # one program, not one per operation
    def out_and_grads(fn, q, k, v):
        loss = lambda q, k, v: jnp.sum(fn(q, k, v, causal=causal, segment_ids=segs) * ct)  # noqa: E731
        return fn(q, k, v, causal=causal, segment_ids=segs), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    out, grads = out_and_grads(xla_attention, q, k, v)
    ref_out, ref_grads = out_and_grads(flash_attention_reference, q, k, v)
    np.testing.assert_array_equal(np.asarray(out)[empty], 0.0)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(grads[0])[empty], 0.0)
    for name, g, rg in zip(("dq", "dk", "dv"), grads, ref_grads):
        np.testing.assert_allclose(g, rg, rtol=1e-5, atol=1e-5, err_msg=name)


def test_decode_attention_of_an_empty_row_is_zeros():
    """Length 0 sees no cache slot: zeros, as a fully masked query in `xla_attention`; other rows attend their
    prefix."""
    kq, kk, kv = jax.random.split(jax.random.key(5), 3)
    q = jax.random.normal(kq, (2, 1, 4, 8))
    k_cache, v_cache = jax.random.normal(kk, (2, 2, 6, 8)), jax.random.normal(kv, (2, 2, 6, 8))
    out = decode_attention(q, k_cache, v_cache, jnp.array([0, 3]))
    np.testing.assert_array_equal(out[0], 0.0)
    prefix = [jnp.swapaxes(c[1:, :, :3], 1, 2) for c in (k_cache, v_cache)]
    np.testing.assert_allclose(out[1:], xla_attention(q[1:], *prefix, causal=False), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("materialise,keep_dims", [(False, False), (True, False), (False, True)])
def test_dense_is_the_einsum_in_value_and_gradient(materialise, keep_dims):
    kx, kw = jax.random.split(jax.random.key(3))
    x = jax.random.normal(kx, (2, 5, 3, 4))
    w = jax.random.normal(kw, (3, 4, 6))
    r = jnp.arange(2 * 5 * 6, dtype=jnp.float32).reshape(2, 5, 6) / 60

    def ours(x, w):
        return jnp.sum(jax.nn.gelu(dense(x, w, n_in=2, grad_barrier=materialise, keep_dims=keep_dims)) * r)

    def ref(x, w):
        return jnp.sum(jax.nn.gelu(jnp.einsum("blnh,nhd->bld", x, w)) * r)

    np.testing.assert_allclose(dense(x, w, n_in=2, grad_barrier=materialise, keep_dims=keep_dims),
                               jnp.einsum("blnh,nhd->bld", x, w), rtol=1e-5, atol=1e-5)
    # both compiled whole: with XLA:CPU's LLVM optimisations off (as the tests run: conftest.py), gelu's derivative
    # computed op by op differs from the fused one by up to 2e-4 relative
    grads = [jax.jit(jax.grad(f, argnums=(0, 1)))(x, w) for f in (ours, ref)]
    for got, want in zip(*grads):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"does not end in the weight's input dims \(3, 4\)"):
        dense(x[..., :2], w, n_in=2)


def test_to_compute_rounds_to_the_plain_casts_values_and_gradients():
    w = jnp.concatenate([jax.random.normal(jax.random.key(0), (64,)) * 3.0,
                         jnp.array([1e-40, -3e-39, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-9, 3.4e38, 0.0, -0.0])])
    got = to_compute(w, jnp.bfloat16, round_first=True)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(w.astype(jnp.bfloat16), np.float32))
    r = jnp.linspace(-2.0, 2.0, w.size)

    def loss(w, round_first):
        return jnp.sum(to_compute(w, jnp.bfloat16, round_first=round_first).astype(jnp.float32) * r)

    np.testing.assert_array_equal(jax.grad(loss)(w, True), jax.grad(loss)(w, False))


def test_explicit_impl_that_cannot_run_raises():
    q = jnp.zeros((1, 4, 2, 8))
    for platform in ("cpu", "tpu"):  # the platform a settled model config names
        with pytest.raises(RuntimeError, match="cudnn.*cannot run here: cuDNN attention needs an NVIDIA GPU"):
            attention(q, q, q, impl="cudnn", platform=platform)
    with pytest.raises(ValueError, match="unknown attention impl 'flash'"):
        attention(q, q, q, impl="flash")
    np.testing.assert_array_equal(attention(q, q, q, impl="auto"), xla_attention(q, q, q))


def test_attention_norms_and_the_loss_come_in_by_the_same_door():
    """One registry per op kind (jaxperf.models.registry): the same errors for each, and an implementation it holds is
    the one the model runs, handed the model config's platform."""
    from jaxperf.models import registry
    from jaxperf.models.attention import register_attention

    x = jnp.zeros((1, 4, 8))
    with pytest.raises(ValueError, match="unknown norm impl 'flash'; registered: auto, xla, pallas"):
        registry.implementation("norm", "flash", x, platform="cpu")
    assert registry.names("loss") == ["auto", "xla", "chunked", "pallas"]
    model = GPT(ModelConfig(n_layers=1, loss_impl="pallas"), rngs=nnx.Rngs(0))
    batch = {"inputs": jnp.zeros((2, 8), jnp.int32), "targets": jnp.zeros((2, 8), jnp.int32)}
    with pytest.raises(RuntimeError, match="loss impl 'pallas' cannot run here: .*metal"):
        registry.implementation("loss", "pallas", model, batch, platform="metal")
    assert registry.implementation("norm", "auto", x, platform=None) is registry._REGISTRY["norm"]["xla"].fn

    seen = []

    def spy(q, k, v, *, causal, segment_ids, platform):
        seen.append(platform)
        return xla_attention(q, k, v, causal=causal, segment_ids=segment_ids)

    register_attention("spy", spy)
    try:
        cfg = dataclasses.replace(ModelConfig(n_layers=1, attention_impl="spy").resolved(), platform="cpu")
        GPT(cfg, rngs=nnx.Rngs(0))(jnp.zeros((1, 8), jnp.int32))
    finally:
        del registry._REGISTRY["attention"]["spy"]
    assert seen == ["cpu"]


def _loss_and_grads(model, tokens):
    def loss(m):
        return jnp.mean(m(tokens).astype(jnp.float32) ** 2)

    return nnx.jit(nnx.value_and_grad(loss))(model)  # one program: op by op, every operation compiles its own


def _scan_to_loop(scan_model: GPT, loop_model: GPT) -> None:
    """Copy the stacked [layers, ...] parameters of a scanned model into a looped model's per-layer blocks."""
    stacked = nnx.to_pure_dict(nnx.state(scan_model.blocks, nnx.Param))
    for i, block in enumerate(loop_model.blocks):
        state = nnx.state(block, nnx.Param)
        nnx.replace_by_pure_dict(state, jax.tree.map(lambda x: x[i], stacked))
        nnx.update(block, state)
    loop_model.embed_VxD[...] = scan_model.embed_VxD[...]
    if scan_model.pos_LxD is not None:
        loop_model.pos_LxD[...] = scan_model.pos_LxD[...]
    nnx.update(loop_model.final_norm, nnx.state(scan_model.final_norm))


@pytest.mark.slow
@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_scanned_layers_equal_looped_layers(style):
    cfg = dataclasses.replace(SMALL, style=style, n_kv_heads=2 if style == "llama" else None)
    scan = GPT(cfg, rngs=nnx.Rngs(0))
    loop = GPT(dataclasses.replace(cfg, scan_layers=False), rngs=nnx.Rngs(1))
    _scan_to_loop(scan, loop)
    tokens = jnp.arange(24, dtype=jnp.int32).reshape(2, 12) % cfg.vocab_size
    np.testing.assert_allclose(scan(tokens), loop(tokens), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("policy", [p for p in REMAT_POLICIES if p != "none"])
def test_remat_policy_is_on_and_changes_no_numbers(policy):
    tokens = jnp.arange(24, dtype=jnp.int32).reshape(2, 12)
    base = GPT(SMALL, rngs=nnx.Rngs(0))
    remat = GPT(dataclasses.replace(SMALL, remat=policy), rngs=nnx.Rngs(0))
    (l0, g0), (l1, g1) = _loss_and_grads(base, tokens), _loss_and_grads(remat, tokens)
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    # The checkpoint really is in the program (a remat test that never turns remat on proves nothing).
    jaxpr = str(jax.make_jaxpr(lambda t: remat(t))(tokens))
    assert "checkpoint" in jaxpr or "remat" in jaxpr
    assert "checkpoint" not in str(jax.make_jaxpr(lambda t: base(t))(tokens))


def _layer_residuals(cfg):
    """(names of the activations one checkpointed layer saves, how many it offloads to host memory)."""
    from jax._src.ad_checkpoint import saved_residuals

    from jaxperf.models.moe import MoE

    block = Block(cfg, rngs=nnx.Rngs(0), make_mlp=MoE if cfg.n_experts else None)
    graphdef, state = nnx.split(block)
    layer = jax.checkpoint(lambda st, x, pos: nnx.merge(graphdef, st)(x, pos, None), policy=remat_policy(cfg))
    x, pos = jnp.ones((1, 8, cfg.d_model)), jnp.arange(8)[None]
    named, host, other = set(), 0, []
    for aval, why in saved_residuals(layer, state, x, pos):
        if "from the argument" in why:
            continue
        if str(aval.memory_space).endswith("Host"):
            host += 1
        elif "named '" in why:
            named.add(why.split("named '")[1].split("'")[0])
        else:
            other.append((aval, why))
    assert not other, f"{cfg.remat} saves activations it does not name: {other}"
    return named, host


@pytest.mark.parametrize("style,experts", [("llama", 0), ("gpt2", 0), ("llama", 4)])
def test_each_named_remat_policy_keeps_the_activations_it_names(style, experts):
    # MaxText's remat_policy names mean the same here: each keeps (on the device, or offloaded to the host) exactly
    # the layer outputs it names, an MoE layer's expert projections too. mlpwo never shows: the layer's output feeds
    # only the next layer's (saved) input.
    for policy, (saved, offloaded) in [*REMAT_SAVES.items(), ("custom", (("context", "mlpwo"), ("key_proj",)))]:
        cfg = dataclasses.replace(SMALL, style=style, remat=policy, remat_save=saved if policy == "custom" else (),
                                  remat_offload=offloaded if policy == "custom" else (), n_experts=experts,
                                  experts_per_token=2).resolved()
        present = set(REMAT_NAMES) - {"mlpwo"} - ({"mlpwi"} if style == "llama" else {"mlpwi_0", "mlpwi_1"})
        named, host = _layer_residuals(cfg)
        assert named == set(saved) & present, (policy, named)
        assert host == len(set(offloaded) & present), (policy, host)


def test_bf16_compute_keeps_fp32_params():
    model = GPT(dataclasses.replace(SMALL, dtype="bfloat16"), rngs=nnx.Rngs(0))
    logits = model(jnp.zeros((1, 8), jnp.int32))
    assert logits.dtype == jnp.bfloat16
    assert {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))} == {jnp.dtype(jnp.float32)}


def test_tied_and_untied_embeddings():
    tied = GPT(SMALL, rngs=nnx.Rngs(0))
    untied = GPT(dataclasses.replace(SMALL, tie_embeddings=False), rngs=nnx.Rngs(0))
    assert tied.head_DxV is None and untied.head_DxV[...].shape == (32, 64)
    n = lambda m: sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param)))  # noqa: E731
    assert n(untied) - n(tied) == 32 * 64


def test_every_parameter_carries_logical_axes():
    from jaxperf._compat import variable_logical_axes

    names = {"batch", "seq", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab", "layers", "norm"}
    for style in ("gpt2", "llama"):
        model = GPT(dataclasses.replace(SMALL, style=style, tie_embeddings=False), rngs=nnx.Rngs(0))
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
            axes = variable_logical_axes(var)
            assert axes is not None and len(axes) == var[...].ndim, (path, axes)
            assert set(axes) <= names, (path, axes)


def test_rope_scores_depend_only_on_relative_position():
    q = jax.random.normal(jax.random.key(0), (1, 1, 1, 16))
    k = jax.random.normal(jax.random.key(1), (1, 1, 1, 16))

    def score(pq, pk):
        return jnp.sum(rope(q, jnp.array([[pq]]), 10000.0) * rope(k, jnp.array([[pk]]), 10000.0))

    np.testing.assert_allclose(score(5, 2), score(13, 10), rtol=1e-5)
    assert abs(float(score(5, 2)) - float(score(5, 4))) > 1e-4


def _plain_rope(x, pos, theta=10000.0):
    """RoPE written out: the whole vector cast to fp32, rotated by autodiff-able ops, rounded once."""
    half = x.shape[-1] // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = (pos.astype(jnp.float32)[..., None] * freq[None, None, :])[:, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    out = jnp.concatenate([x1 * jnp.cos(angle) - x2 * jnp.sin(angle), x2 * jnp.cos(angle) + x1 * jnp.sin(angle)], -1)
    return out.astype(x.dtype)


def test_rope_bf16_rotates_in_fp32():
    """bf16 q/k are rotated in fp32 and rounded once: the same values as casting the whole vector first."""
    x = jax.random.normal(jax.random.key(0), (2, 3, 2, 8)).astype(jnp.bfloat16)
    pos = jnp.arange(3, dtype=jnp.int32)[None].repeat(2, 0)
    got = rope(x, pos, 10000.0)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(_plain_rope(x, pos), np.float32))


def test_rope_backward_is_the_opposite_rotation_in_one_pass():
    """dx equals autodiff of the plain rotation, and the backward never pads half-width cotangents back to full
    width (autodiff of the halving does, then sums the two)."""
    x = jax.random.normal(jax.random.key(0), (2, 5, 3, 8)).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), x.shape).astype(jnp.bfloat16)
    pos = jnp.array([[0, 1, 2, 3, 4], [7, 9, 11, 13, 15]], jnp.int32)

    def loss(f):
        return lambda x: jnp.sum((f(x, pos) * w).astype(jnp.float32))

    ours = loss(lambda x, p: rope(x, p, 10000.0))
    got, want = jax.grad(ours)(x), jax.grad(loss(_plain_rope))(x)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    prims = {e.primitive.name for e in jax.make_jaxpr(jax.grad(ours))(x).eqns}
    assert "pad" in {e.primitive.name for e in jax.make_jaxpr(jax.grad(loss(_plain_rope)))(x).eqns}
    assert "pad" not in prims, prims


def test_causality():
    """Changing a later token never changes an earlier position's logits."""
    model = GPT(SMALL, rngs=nnx.Rngs(0))
    a = jnp.arange(10, dtype=jnp.int32)[None]
    b = a.at[0, 7].set(3)
    la, lb = model(a), model(b)
    np.testing.assert_allclose(la[:, :7], lb[:, :7], rtol=1e-6)
    assert not np.allclose(la[:, 7:], lb[:, 7:])


# Remat full with the backward's weight-gradient stacks in the compute dtype (jaxperf.models.layer_scan)

_COMPACT = dict(style="llama", d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, mlp_dim=128, vocab_size=256,
                max_seq_len=32, dtype="bfloat16", param_dtype="float32", remat="full", tie_embeddings=False)


def _loss_grads(cfg: ModelConfig, batch):
    from jaxperf.models.gpt import gpt_loss

    model = GPT(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    def loss(state):
        return gpt_loss(nnx.merge(graphdef, state), batch)[0]

    return jax.jit(jax.grad(loss))(state), jax.make_jaxpr(jax.grad(loss))(state)


def _reverse_scan_outputs(jaxpr) -> set[tuple[tuple[int, ...], str]]:
    """(shape, dtype) of what the reverse scans of `jaxpr` stack (the backward loop's gradients)."""
    out = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan" and eqn.params["reverse"]:
            out |= {(tuple(v.aval.shape), str(v.aval.dtype)) for v in eqn.outvars}
        for p in eqn.params.values():  # inside jits and scans
            inner = getattr(p, "jaxpr", None)
            if inner is not None and hasattr(inner, "eqns"):
                out |= _reverse_scan_outputs(inner)
    return out


@pytest.mark.parametrize("extra", [
    pytest.param({}, id="dense"),
    pytest.param(dict(round_weights_before_cast=True), id="rounded"),
    pytest.param(dict(use_bias=False, qkv_bias=True, n_experts=4, n_shared_experts=1, shared_mlp_dim=96,
                      shared_expert_gate=True, router_norm_topk=False), id="qwen2_moe", marks=pytest.mark.slow),
])
def test_layer_grads_stacked_in_the_compute_dtype_are_the_same_bits(extra):
    """The backward loop stacks each cast weight's gradient in bf16 (the reverse scan's outputs), the norm scales',
    the router's and the shared expert gate's (used in fp32) in fp32, and every gradient equals autodiff's remat-full
    scan bit for bit."""
    tokens = jax.random.randint(jax.random.key(1), (2, 32), 0, 256)
    batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, 1)}
    cfg = ModelConfig(**_COMPACT, **extra)
    plain, plain_jaxpr = _loss_grads(dataclasses.replace(cfg, layer_grads_in_compute_dtype=False), batch)
    compact, jaxpr = _loss_grads(dataclasses.replace(cfg, layer_grads_in_compute_dtype=True), batch)
    want, got = jax.tree.leaves_with_path(plain), jax.tree.leaves(compact)
    assert len(want) == len(got)
    for (path, a), b in zip(want, got):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
    stacks = _reverse_scan_outputs(jaxpr.jaxpr)
    assert ((3, 64, 4, 16), "bfloat16") in stacks and ((3, 64, 4, 16), "float32") not in stacks  # wq
    assert ((3, 64), "float32") in stacks and ((3, 64), "bfloat16") not in stacks  # the norm scales
    if extra.get("n_experts"):
        assert ((3, 64, 4), "float32") in stacks and ((3, 64, 1), "float32") in stacks  # router, shared gate
        assert ((3, 4, 64, 128), "bfloat16") in stacks  # the experts' w_in
    assert ((3, 64, 4, 16), "bfloat16") not in _reverse_scan_outputs(plain_jaxpr.jaxpr)


@pytest.mark.parametrize("extra", [pytest.param({}, id="rmsnorm"),
                                   pytest.param(dict(style="gpt2", norm="layernorm", use_bias=True), id="layernorm")])
def test_norm_gradients_summed_over_the_rows_in_the_compute_dtype(extra):
    """model.norm_grads_in_compute_dtype (the TPU default): every gradient but the norms' scales and biases is the same
    bits; theirs are the fp32 gradient within bf16's rounding, bf16 values (what the batch's all-reduce sends), and
    the remat-full backward loop stacks them in bf16, a cast-back value like a weight's."""
    tokens = jax.random.randint(jax.random.key(1), (4, 32), 0, 256)
    batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, 1)}
    cfg = dataclasses.replace(ModelConfig(**_COMPACT), layer_grads_in_compute_dtype=True, **extra)
    plain, _ = _loss_grads(dataclasses.replace(cfg, norm_grads_in_compute_dtype=False), batch)
    ours, jaxpr = _loss_grads(dataclasses.replace(cfg, norm_grads_in_compute_dtype=True), batch)
    norms = 0
    for (path, a), b in zip(jax.tree.leaves_with_path(plain), jax.tree.leaves(ours), strict=True):
        name, a, b = jax.tree_util.keystr(path), np.asarray(a), np.asarray(b)
        if "norm" not in name:
            np.testing.assert_array_equal(a, b, err_msg=name)
            continue
        norms += 1
        np.testing.assert_array_equal(b, b.astype(jnp.bfloat16).astype(np.float32), err_msg=name)
        np.testing.assert_allclose(b, a, rtol=2 ** -6, atol=2 ** -6 * np.abs(a).max(), err_msg=name)
        assert not np.array_equal(a, b), name  # rounded: the option took effect
    assert norms == (6 if extra else 3)  # per layer stacked, and the final norm: scales (and biases)
    stacks = _reverse_scan_outputs(jaxpr.jaxpr)
    assert ((3, 64), "bfloat16") in stacks and ((3, 64), "float32") not in stacks
    from jaxperf.models.layers import norm_grad_dtype  # an fp32 compute dtype has nothing to halve: autodiff's sum

    assert norm_grad_dtype(dataclasses.replace(cfg, norm_grads_in_compute_dtype=True, dtype="float32")) is None


def test_norm_gradient_in_the_compute_dtype_is_each_rows_fp32_sum_rounded_then_summed():
    """The XLA norm's backward with grad_dtype: each row's gradient summed over its positions in fp32, rounded to
    bf16, and the rows summed in bf16; the input's gradient is autodiff's. Built to be exact: rows of +-1 normalise
    to themselves (eps 0) and integer cotangents sum to integers past bf16's 256, so each rounding shows."""
    from jaxperf.models.layers import xla_norm

    x = jnp.where(jax.random.bernoulli(jax.random.key(0), 0.9, (2, 16, 32)), 1.0, -1.0).astype(jnp.bfloat16)
    w = jax.random.randint(jax.random.key(1), (2, 16, 32), 50, 101).astype(jnp.float32)
    scale = 1 + 0.1 * jax.random.normal(jax.random.key(2), (32,))

    def loss(scale, x, grad_dtype):
        y = xla_norm(x, scale, None, kind="rmsnorm", eps=0.0, grad_dtype=grad_dtype)
        return jnp.sum(y.astype(jnp.float32) * w)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
    (ds_plain, dx_plain), (ds, dx) = grad(scale, x, None), grad(scale, x, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(dx_plain))
    rows = (np.asarray(w) * np.asarray(x, np.float32)).sum(1)  # [2, 32] exact integers
    bf = lambda v: np.asarray(v, np.float32).astype(jnp.bfloat16).astype(np.float32)  # noqa: E731
    np.testing.assert_array_equal(np.asarray(ds_plain), rows.sum(0))
    np.testing.assert_array_equal(np.asarray(ds), bf(bf(rows[0]) + bf(rows[1])))
    assert not np.array_equal(bf(rows.sum(0)), bf(bf(rows[0]) + bf(rows[1])))  # the rows' rounding is seen

@pytest.mark.parametrize("extra", [pytest.param({}, id="swiglu"),
                                   pytest.param(dict(style="gpt2", norm="layernorm", use_bias=True), id="gelu_bias")])
def test_mlp_in_slices_of_its_width_gives_the_plain_mlps_loss_and_gradients(extra):
    """model.mlp_slices (remat full): the MLP computed over 4 slices of its hidden width, each slice's hidden values
    live in turn, gives the plain MLP's loss and every gradient (fp32: summation order only); without remat full the
    setting leaves the plain MLP in place."""
    from jaxperf.models.layers import MLP

    tokens = jax.random.randint(jax.random.key(1), (2, 32), 0, 256)
    batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, 1)}
    cfg = dataclasses.replace(ModelConfig(**_COMPACT), dtype="float32", **extra)
    (plain, _), (sliced, jaxpr) = (_loss_grads(dataclasses.replace(cfg, mlp_slices=n), batch) for n in (1, 4))
    for (path, a), b in zip(jax.tree.leaves_with_path(plain), jax.tree.leaves(sliced), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        # (a key bias's gradient is zero up to rounding, ~1e-11: the absolute floor)
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=max(1e-6 * np.abs(a).max(), 1e-8),
                                   err_msg=jax.tree_util.keystr(path))
    assert "length=4" in str(jaxpr)  # the sliced path ran: its backward's loop over the 4 slices (3 layers)
    assert MLP(dataclasses.replace(cfg, mlp_slices=4), rngs=nnx.Rngs(0)).slices == 4
    assert MLP(dataclasses.replace(cfg, mlp_slices=4, remat="save_dots"), rngs=nnx.Rngs(0)).slices == 1
    assert MLP(dataclasses.replace(cfg, mlp_slices=4, mlp_dim=130), rngs=nnx.Rngs(0)).slices == 1  # a shared expert


def test_sliced_mlp_weight_gradients_are_the_plain_matmuls():
    """In bf16 each weight gradient slice is one contraction over the tokens, as the plain MLP's: the same values up
    to the compiler's accumulation; the input's gradient sums the slices in fp32."""
    from jaxperf.models.layers import sliced_mlp

    k = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(k[0], (2, 16, 64), jnp.bfloat16)
    w_in, w_gate = (0.1 * jax.random.normal(k[i], (64, 256), jnp.bfloat16) for i in (1, 2))
    w_out = 0.1 * jax.random.normal(k[3], (256, 64), jnp.bfloat16)
    dy = jax.random.normal(k[4], (2, 16, 64), jnp.bfloat16)

    def plain(x, w_in, w_gate, w_out):
        return (jax.nn.silu(x @ w_gate) * (x @ w_in)) @ w_out

    y0, vjp0 = jax.vjp(plain, x, w_in, w_gate, w_out)
    y1, vjp1 = jax.vjp(lambda *a: sliced_mlp(*a, None, "swiglu", 4), x, w_in, w_gate, w_out)
    np.testing.assert_allclose(np.asarray(y1, np.float32), np.asarray(y0, np.float32), rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="3 slices do not cut the hidden width 256 evenly"):
        sliced_mlp(x, w_in, w_gate, w_out, None, "swiglu", 3)
    for name, a, b in zip(("x", "w_in", "w_gate", "w_out"), vjp0(dy), vjp1(dy)):
        assert a.dtype == b.dtype == jnp.bfloat16, name
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(b, a, rtol=2e-2, atol=2e-2 * np.abs(a).max(), err_msg=name)
