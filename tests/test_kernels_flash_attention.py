"""Flash attention kernel vs its jnp reference: forward, gradients, lse, masks, GQA, padding, errors, TPU lowering.

The kernels really run here: on CPU `flash_attention` runs the Pallas bodies in interpret mode.
Legend: B batch, L query length, S key length, H query heads, K kv heads, Dh head dim.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _accelerators import gpu_kernel_names, lower_for_cuda, tpu_replicated

from pallas_kernels.flash_attention import (
    MASKED_ROW_LSE,
    BlockSizes,
    SegmentIds,
    as_segment_ids,
    flash_attention,
    flash_attention_reference,
    unavailable_reason,
)

# dtype -> (forward atol/rtol, gradient atol/rtol); low precision is compared with the reference on the same inputs.
TOL = {jnp.float32: (1e-5, 2e-5), jnp.bfloat16: (2e-2, 5e-2), jnp.float16: (5e-3, 1e-2)}


def _inputs(B, L, S, H, K, Dh, dtype, segments, seed=0):
    kq, kk, kv, kc, ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(kq, (B, L, H, Dh), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (B, S, K, Dh), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (B, S, K, Dh), jnp.float32).astype(dtype)
    ct = jax.random.normal(kc, (B, L, H, Dh), jnp.float32)
    segs = None
    if segments:
        # Packed sequences: a new segment starts with probability 5% per position (always >= 1 key per query).
        seg_BxS = jnp.cumsum(jax.random.bernoulli(ks, 0.05, (B, S)), axis=1).astype(jnp.int32)
        segs = seg_BxS if L == S else (seg_BxS[:, S - L :], seg_BxS)
    return q, k, v, ct, segs


def _value_and_grads(fn, q, k, v, ct, **kw):
    def loss(q, k, v):
        out = fn(q, k, v, **kw)
        return jnp.sum(out.astype(jnp.float32) * ct), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


def _assert_close(actual, expected, tol, what):
    np.testing.assert_allclose(
        np.asarray(actual, np.float32), np.asarray(expected, np.float32), atol=tol, rtol=tol, err_msg=what
    )


CASES = [
    # B, L, S, H, K, Dh, causal, segments, dtype
    (1, 1, 1, 2, 2, 16, True, False, jnp.float32),
    (2, 77, 77, 4, 2, 32, True, True, jnp.float32),
    (1, 77, 77, 4, 1, 64, False, False, jnp.float32),
    (2, 130, 130, 2, 2, 32, False, True, jnp.float32),
    (1, 130, 130, 4, 1, 16, True, False, jnp.float32),
    (1, 1, 1, 4, 1, 32, False, True, jnp.float32),
    (1, 130, 130, 2, 2, 128, True, False, jnp.float32),
    (1, 1000, 1000, 1, 1, 16, True, True, jnp.float32),
    (1, 100, 160, 4, 2, 32, True, True, jnp.float32),  # S > L: queries aligned to the end of the keys
    (2, 77, 77, 4, 2, 64, True, True, jnp.bfloat16),
    (1, 130, 130, 4, 1, 32, False, False, jnp.bfloat16),
    (1, 77, 77, 2, 2, 64, True, False, jnp.float16),
]


@pytest.mark.parametrize("B,L,S,H,K,Dh,causal,segments,dtype", CASES)
def test_forward_and_grads_match_reference(B, L, S, H, K, Dh, causal, segments, dtype):
    q, k, v, ct, segs = _inputs(B, L, S, H, K, Dh, dtype, segments)
    out, grads = _value_and_grads(flash_attention, q, k, v, ct, causal=causal, segment_ids=segs)
    ref_out, ref_grads = _value_and_grads(flash_attention_reference, q, k, v, ct, causal=causal, segment_ids=segs)
    assert out.shape == (B, L, H, Dh) and out.dtype == dtype
    fwd_tol, grad_tol = TOL[dtype]
    _assert_close(out, ref_out, fwd_tol, "out")
    for name, g, rg in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert g.shape == rg.shape and g.dtype == dtype, name
        _assert_close(g, rg, grad_tol, name)


def test_small_blocks_many_tiles_gqa_segments():
    """Several q and k tiles per kernel with fwd/bwd tiles of different sizes: exercises the causal loop bounds."""
    q, k, v, ct, segs = _inputs(2, 130, 130, 4, 2, 32, jnp.float32, True, seed=1)
    blocks = BlockSizes(block_q=32, block_k=16, block_q_dq=16, block_k_dq=32, block_q_dkv=32, block_k_dkv=16)
    for causal in (True, False):
        out, grads = _value_and_grads(
            flash_attention, q, k, v, ct, causal=causal, segment_ids=segs, block_sizes=blocks
        )
        ref_out, ref_grads = _value_and_grads(flash_attention_reference, q, k, v, ct, causal=causal, segment_ids=segs)
        _assert_close(out, ref_out, 1e-5, f"out {causal=}")
        for name, g, rg in zip(("dq", "dk", "dv"), grads, ref_grads):
            _assert_close(g, rg, 2e-5, f"{name} {causal=}")


def _interpret_modes():
    """Plain interpret mode (the portable kernels) and the TPU interpreter (the TPU kernels)."""
    from jax.experimental.pallas import tpu as pltpu

    return [pytest.param(True, id="portable"), pytest.param(pltpu.InterpretParams(), id="tpu")]


@pytest.mark.parametrize("interpret", _interpret_modes())
def test_causal_skips_fully_masked_blocks(interpret):
    """NaN values in keys that no query of the first half may see: a kernel that visits those blocks turns NaN, in
    the forward and in dq (0 * NaN is NaN, so masking alone would not hide them)."""
    q, k, v, ct, _ = _inputs(1, 256, 256, 2, 1, 16, jnp.float32, False)
    v = v.at[:, 128:].set(jnp.nan)
    blocks = BlockSizes(64, 64, 64, 64, 64, 64)
    fn = jax.jit(functools.partial(flash_attention, causal=True, block_sizes=blocks, interpret=interpret))
    out = fn(q, k, v)
    ref = flash_attention_reference(q[:, :128], k[:, :128], v[:, :128], causal=True)
    _assert_close(out[:, :128], ref, 1e-5, "first half")
    assert np.isnan(np.asarray(out[:, 128:])).any()  # the NaNs really were reachable

    def first_half_loss(fn, k, v):
        return lambda q: jnp.sum(fn(q, k, v)[:, :128] * ct[:, :128])

    dq = jax.grad(first_half_loss(fn, k, v))(q)[:, :128]
    ref_dq = jax.grad(first_half_loss(flash_attention_reference, k[:, :128], v[:, :128]))(q[:, :128])
    _assert_close(dq, ref_dq, 2e-5, "dq of the first half")


def _count_pallas_calls(fn, *args):
    return str(jax.make_jaxpr(fn)(*args)).count("pallas_call")


def test_pallas_backward_matches_reference_backward_and_is_used():
    q, k, v, ct, segs = _inputs(1, 77, 77, 4, 2, 32, jnp.float32, True, seed=2)
    grads = {}
    for backward in ("pallas", "reference"):
        fn = functools.partial(flash_attention, causal=True, segment_ids=segs, backward=backward)
        _, grads[backward] = _value_and_grads(fn, q, k, v, ct)
        n_calls = _count_pallas_calls(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * ct), (0, 1, 2)), q, k, v)
        # forward kernel, plus the dq and dk/dv kernels when the backward is Pallas
        assert n_calls == (3 if backward == "pallas" else 1), (backward, n_calls)
    for name, g, rg in zip(("dq", "dk", "dv"), grads["pallas"], grads["reference"]):
        _assert_close(g, rg, 2e-5, name)


@pytest.mark.parametrize("causal,segments", [(True, True), (False, False)])
def test_lse_and_its_gradient_match_reference(causal, segments):
    q, k, v, _, segs = _inputs(2, 130, 130, 4, 1, 32, jnp.float32, segments, seed=3)
    kw = dict(causal=causal, segment_ids=segs, return_lse=True)
    out, lse = flash_attention(q, k, v, **kw)
    ref_out, ref_lse = flash_attention_reference(q, k, v, **kw)
    assert lse.shape == (2, 4, 130) and lse.dtype == jnp.float32
    _assert_close(lse, ref_lse, 1e-5, "lse")
    _assert_close(out, ref_out, 1e-5, "out")

    def loss(fn):
        def f(q, k, v):
            o, l = fn(q, k, v, **kw)
            return jnp.sum(o * o) + jnp.sum(jnp.sin(l))

        return jax.jit(jax.grad(f, argnums=(0, 1, 2)))

    for name, g, rg in zip(("dq", "dk", "dv"), loss(flash_attention)(q, k, v), loss(flash_attention_reference)(q, k, v)):
        _assert_close(g, rg, 2e-5, name)


def test_segment_ids_forms_agree():
    """One array, a (q, kv) tuple or list, and a SegmentIds mean the same mask, in the kernel and the reference."""
    q, k, v, _, seg_BxL = _inputs(1, 77, 77, 2, 1, 16, jnp.float32, True, seed=6)
    assert as_segment_ids(None) is None
    forms = [seg_BxL, (seg_BxL, seg_BxL), [seg_BxL, seg_BxL], SegmentIds(q=seg_BxL, kv=seg_BxL)]
    for form in forms:
        segs = as_segment_ids(form)
        assert isinstance(segs, SegmentIds) and segs.q is seg_BxL and segs.kv is seg_BxL
    ref = flash_attention_reference(q, k, v, causal=False, segment_ids=seg_BxL)
    unmasked = flash_attention_reference(q, k, v, causal=False)
    assert not np.allclose(ref, unmasked, atol=1e-3)  # the segments really mask something
    for form in forms:
        _assert_close(flash_attention(q, k, v, causal=False, segment_ids=form), ref, 1e-5, type(form).__name__)
        _assert_close(flash_attention_reference(q, k, v, causal=False, segment_ids=form), ref, 0.0, "reference")
    with pytest.raises(ValueError, match="got 3 items"):
        as_segment_ids((seg_BxL, seg_BxL, seg_BxL))


def test_custom_scale_and_explicit_interpret():
    q, k, v, _, _ = _inputs(1, 40, 40, 2, 1, 16, jnp.float32, False, seed=4)
    out = flash_attention(q, k, v, causal=False, sm_scale=0.3, interpret=True)
    _assert_close(out, flash_attention_reference(q, k, v, causal=False, sm_scale=0.3), 1e-5, "out")


# The TPU kernels (sequential key / query grid axes, VMEM scratch) run on CPU under the TPU interpreter.
SMALL_BLOCKS = BlockSizes(block_q=32, block_k=16, block_q_dq=16, block_k_dq=32, block_q_dkv=32, block_k_dkv=16)
TPU_CASES = [
    # B, L, S, H, K, Dh, causal, segments, dtype, blocks
    (1, 77, 77, 4, 2, 32, True, True, jnp.float32, None),  # default blocks, shrunk to the short sequence
    (2, 130, 130, 2, 1, 16, False, True, jnp.float32, SMALL_BLOCKS),
    (1, 100, 160, 4, 2, 32, True, True, jnp.float32, SMALL_BLOCKS),  # S > L, padded key blocks
    (1, 130, 130, 4, 4, 16, True, False, jnp.float32, SMALL_BLOCKS),
    (1, 77, 77, 4, 1, 64, False, False, jnp.bfloat16, SMALL_BLOCKS),
]


def _pallas_calls(fn, *args):
    """(name, grid, block mappings, scratch avals) of every pallas_call in fn's jaxpr, nested jaxprs included."""

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                gm = eqn.params["grid_mapping"]
                name = eqn.params.get("name") or getattr(eqn.params.get("name_and_src_info"), "name", "?")
                yield name, tuple(gm.grid), list(gm.block_mappings), list(gm.scratch_avals)
            for param in eqn.params.values():
                for sub in param if isinstance(param, (list, tuple)) else [param]:
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        yield from walk(inner)

    return list(walk(jax.make_jaxpr(fn)(*args).jaxpr))


@pytest.mark.parametrize("B,L,S,H,K,Dh,causal,segments,dtype,blocks", TPU_CASES)
def test_tpu_kernels_match_reference_in_the_tpu_interpreter(B, L, S, H, K, Dh, causal, segments, dtype, blocks):
    pltpu = pytest.importorskip("jax.experimental.pallas.tpu")
    q, k, v, ct, segs = _inputs(B, L, S, H, K, Dh, dtype, segments, seed=5)
    kw = dict(causal=causal, segment_ids=segs, block_sizes=blocks, interpret=pltpu.InterpretParams())
    out, grads = _value_and_grads(flash_attention, q, k, v, ct, **kw)
    ref_out, ref_grads = _value_and_grads(flash_attention_reference, q, k, v, ct, causal=causal, segment_ids=segs)
    fwd_tol, grad_tol = TOL[dtype]
    _assert_close(out, ref_out, fwd_tol, "out")
    for name, g, rg in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert g.shape == rg.shape and g.dtype == dtype, name
        _assert_close(g, rg, grad_tol, name)
    # The TPU kernels ran: forward and dq walk key blocks on a 4-D grid, dk/dv walks (head, query block) on a 5-D one.
    calls = _pallas_calls(jax.grad(lambda q, k, v: jnp.sum(flash_attention(q, k, v, **kw) * ct), (0, 1, 2)), q, k, v)
    assert [(name, len(grid)) for name, grid, _, _ in calls] == [
        ("flash_attention_fwd", 4),
        ("flash_attention_dq", 4),
        ("flash_attention_dkv", 5),
    ]


def fully_masked_segments(B, L, S, seed=0):
    """(SegmentIds, empty [B, L] bool): packed key segments, and queries that carry an id no key has (-1), so they
    see no key: a short run, one across a 16- and 32-row block edge, a whole 32-row block, and the last query."""
    seg_BxS = jnp.cumsum(jax.random.bernoulli(jax.random.key(seed), 0.05, (B, S)), axis=1).astype(jnp.int32)
    empty_BxL = np.zeros((B, L), bool)
    empty_BxL[0, 3:7] = empty_BxL[0, 28:40] = empty_BxL[-1, 64:96] = empty_BxL[:, L - 1] = True
    return SegmentIds(jnp.where(empty_BxL, -1, seg_BxS[:, S - L :]), seg_BxS), empty_BxL


def _masked_row_cases():
    """Every case with the portable kernels; the TPU interpreter (25 s a case) takes the two that differ in its code
    path: not causal, and causal with more keys than queries."""
    portable, tpu = _interpret_modes()
    cases = [(130, 130, True), (130, 130, False), (100, 160, True)]
    return ([pytest.param(*c, portable.values[0], id=f"portable-{c[0]}-{c[1]}-{c[2]}") for c in cases]
            + [pytest.param(*c, tpu.values[0], id=f"tpu-{c[0]}-{c[1]}-{c[2]}") for c in cases[1:]])


@pytest.mark.parametrize("L,S,causal,interpret", _masked_row_cases())
def test_fully_masked_query_rows_output_zeros_in_kernel_and_reference(L, S, causal, interpret):
    """A query that sees no key outputs zeros with lse MASKED_ROW_LSE (kernel and reference alike), has dq = 0, and
    adds nothing to dk, dv: the gradients do not change when its cotangent does, however large."""
    q, k, v, ct, _ = _inputs(2, L, S, 2, 1, 16, jnp.float32, False, seed=7)  # two query heads share a K/V head
    segs, empty_BxL = fully_masked_segments(2, L, S)
    kw = dict(causal=causal, segment_ids=segs, return_lse=True)
    kernel = functools.partial(flash_attention, block_sizes=SMALL_BLOCKS, interpret=interpret, **kw)
    reference = functools.partial(flash_attention_reference, **kw)

    def loss(q, k, v, ct, fn):
        out, lse = fn(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * ct) + jnp.sum(jnp.sin(lse))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=4)  # compiled once per fn, for both cotangents

    def grads(fn, ct):
        return grad(q, k, v, ct, fn)

    loud_ct = jnp.where(empty_BxL[:, :, None, None], 1e6, 1.0) * ct  # huge cotangents on the empty rows
    quiet_ct = jnp.where(empty_BxL[:, :, None, None], 0.0, ct)  # none there
    results = {}
    for name, fn in (("kernel", kernel), ("reference", reference)):
        out, lse = fn(q, k, v)
        np.testing.assert_array_equal(np.asarray(out)[empty_BxL], 0.0, err_msg=f"{name} out of empty rows")
        lse_BxLxH = np.asarray(lse).transpose(0, 2, 1)
        np.testing.assert_array_equal(lse_BxLxH[empty_BxL], np.float32(MASKED_ROW_LSE), err_msg=f"{name} lse")
        assert np.isfinite(lse_BxLxH[~empty_BxL]).all() and (lse_BxLxH[~empty_BxL] > -1e3).all(), name
        loud, quiet = grads(fn, loud_ct), grads(fn, quiet_ct)
        for g_name, g, g_quiet in zip(("dq", "dk", "dv"), loud, quiet):
            assert np.isfinite(np.asarray(g)).all(), f"{name} {g_name} not finite"
            _assert_close(g, g_quiet, 1e-6, f"{name} {g_name}: the empty rows' cotangent leaked in")
        np.testing.assert_array_equal(np.asarray(loud[0])[empty_BxL], 0.0, err_msg=f"{name} dq of empty rows")
        results[name] = out, lse, loud
    (out, lse, g), (ref_out, ref_lse, ref_g) = results["kernel"], results["reference"]
    _assert_close(out, ref_out, 1e-5, "out")
    _assert_close(lse, ref_lse, 1e-5, "lse")
    for name, a, b in zip(("dq", "dk", "dv"), g, ref_g):
        _assert_close(a, b, 2e-5, name)


def _vmem_tile_bytes(aval) -> int:
    """Bytes of one VMEM buffer of this block: TPU pads the last dim to 128 lanes and the one before to 8 sublanes
    of 32 bits (16 rows for 16-bit types)."""
    shape, itemsize = list(aval.shape), jnp.dtype(aval.dtype).itemsize
    if shape:
        shape[-1] = -(-shape[-1] // 128) * 128
    if len(shape) >= 2:
        sublanes = 8 * (4 // itemsize)
        shape[-2] = -(-shape[-2] // sublanes) * sublanes
    return math.prod(shape) * itemsize


def _vmem_bytes_per_kernel(L: int, H=4, K=2, Dh=128):
    """Per kernel: the VMEM its BlockSpecs (double-buffered) and scratch take on TPU, for causal bf16 attention of
    length L, traced for backend="tpu" (tracing needs no TPU and no libtpu)."""
    q = jax.ShapeDtypeStruct((1, L, H, Dh), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, L, K, Dh), jnp.bfloat16)
    loss = lambda q, k, v: jnp.sum(flash_attention(q, k, v, causal=True, backend="tpu").astype(jnp.float32))  # noqa
    return {
        name: 2 * sum(_vmem_tile_bytes(bm.block_aval) for bm in blocks) + sum(map(_vmem_tile_bytes, scratch))
        for name, _, blocks, scratch in _pallas_calls(jax.grad(loss, (0, 1, 2)), q, kv, kv)
    }


def test_tpu_kernels_vmem_does_not_grow_with_sequence_length():
    """Every operand of the TPU kernels is one tile: 8x the sequence, the same VMEM. A kernel that kept whole K/V
    (forward, dq) or whole query ranges (dk/dv) in VMEM would need 8x more at 32768 than at 4096."""
    short, long = _vmem_bytes_per_kernel(4096), _vmem_bytes_per_kernel(32768)
    assert set(long) == {"flash_attention_fwd", "flash_attention_dq", "flash_attention_dkv"}
    assert long == short, f"VMEM bytes per kernel at 4096: {short}, at 32768: {long}"
    assert max(long.values()) < 2**20, long  # a few tiles of 128 x 128, far below the 16 MiB default scoped limit


def test_tpu_kernels_keep_lse_and_delta_lane_dense_in_hbm():
    """The per-row vectors the backward reads (lse, delta) are [B, H, 1, L] rows in HBM, not [B, H, L, 1] columns:
    TPU's (8, 128) tiling pads a column's one value a row to 128 lanes, so at 2 x 4096 tokens and 32 heads each
    would take 128 MiB for 1 MiB of values (three such buffers were live in a v6e Llama-2-7B step)."""
    q = jax.ShapeDtypeStruct((2, 4096, 32, 128), jnp.bfloat16)
    loss = lambda q, k, v: jnp.sum(flash_attention(q, k, v, causal=True, backend="tpu").astype(jnp.float32))  # noqa
    calls = _pallas_calls(jax.grad(loss, (0, 1, 2)), q, q, q)
    rows = {}
    for name, _, blocks, _ in calls:
        for bm in blocks:
            shape = tuple(bm.array_aval.shape)
            assert shape[-1] != 1, f"{name} takes a [.., L, 1] column {shape}"
            if shape[-2] == 1:
                rows.setdefault(name, []).append(shape)
    # the forward writes lse; dq and dk/dv each read lse and delta
    assert rows == {"flash_attention_fwd": [(2, 32, 1, 4096)], "flash_attention_dq": [(2, 32, 1, 4096)] * 2,
                    "flash_attention_dkv": [(2, 32, 1, 4096)] * 2}, rows


@pytest.mark.parametrize(
    "q_shape,k_shape,kw,match",
    [
        ((1, 8, 3, 16), (1, 8, 2, 16), {}, "query heads 3 must be a multiple of kv heads 2"),
        ((1, 8, 2, 16), (1, 8, 2, 32), {}, "head dims differ: q has 16, k/v have 32"),
        ((1, 8, 2, 16), (2, 8, 2, 16), {}, "batch sizes differ: q has 1, k/v have 2"),
        ((1, 8, 2, 16), (1, 4, 2, 16), {"causal": True}, "S=4 < L=8"),
        ((1, 8, 2, 16), (1, 8, 2, 16), {"segment_ids": jnp.zeros((1, 7), jnp.int32)}, r"\(1, 8\).*\(1, 7\)"),
        ((1, 130, 2, 16), (1, 130, 2, 16), {"block_sizes": BlockSizes(128, 128, 96, 128, 128, 128)}, "block_q_dq=96"),
        ((1, 8, 2, 16), (1, 8, 2, 16), {"block_sizes": BlockSizes(0, 128, 128, 128, 128, 128)}, "block_q=0"),
        ((1, 8, 2, 16), (1, 8, 2, 16), {"backward": "xla"}, "backward must be"),
        ((1, 8, 2, 64), (1, 8, 2, 64), {"backend": "tpu", "block_sizes": BlockSizes(128, 96, 128, 128, 128, 128)},
         "block_k=96 must be a multiple of 128 on TPU; use 128"),
        ((1, 8, 2, 64), (1, 8, 2, 64), {"backend": "gpu", "block_sizes": BlockSizes(48, 64, 64, 64, 64, 64)},
         "block_q=48 must be a power of two for the Triton lowering; use 64"),
    ],
)
def test_bad_inputs_raise_with_numbers(q_shape, k_shape, kw, match):
    q, k = jnp.zeros(q_shape, jnp.float32), jnp.zeros(k_shape, jnp.float32)
    with pytest.raises(ValueError, match=match):
        flash_attention(q, k, k, **kw)


def test_compiled_head_dim_and_dtype_checks():
    q = jnp.zeros((1, 8, 2, 16), jnp.float32)
    with pytest.raises(ValueError, match="head dim 16 is not supported when compiled"):
        flash_attention(q, q, q, interpret=False)
    with pytest.raises(ValueError, match="dtype int32"):
        flash_attention(q.astype(jnp.int32), q.astype(jnp.int32), q.astype(jnp.int32))


def test_unavailable_reason():
    q = jnp.zeros((1, 8, 4, 64), jnp.bfloat16)
    k = jnp.zeros((1, 8, 2, 64), jnp.bfloat16)
    assert unavailable_reason(q, k, k) is None  # CPU: interpret mode
    assert "dtype" in unavailable_reason(q.astype(jnp.int32), k.astype(jnp.int32), k.astype(jnp.int32))
    assert "kv heads" in unavailable_reason(jnp.zeros((1, 8, 3, 64)), jnp.zeros((1, 8, 2, 64)), jnp.zeros((1, 8, 2, 64)))


def test_block_sizes_defaults():
    for backend in ("cpu", "gpu", "tpu"):
        blocks = BlockSizes.get_default(backend)
        for size in (blocks.block_q, blocks.block_k, blocks.block_q_dkv, blocks.block_k_dkv):
            assert size & (size - 1) == 0 and size >= 16
    assert BlockSizes.get_default("tpu").block_k % 128 == 0


def _block_indices(block_mapping, *grid_point):
    index_map = block_mapping.index_map_jaxpr
    return tuple(int(i) for i in jax.core.eval_jaxpr(index_map.jaxpr, index_map.consts, *grid_point))


def test_tpu_kernels_fetch_nothing_for_causally_skipped_blocks():
    """Skipped grid steps must name the block already in VMEM (an unchanged block index issues no copy): in the
    forward and dq the last key block the query block sees, in dk/dv the first query block that sees the key block."""
    L, bq = 512, 128
    q = jax.ShapeDtypeStruct((1, L, 2, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, L, 1, 128), jnp.bfloat16)
    loss = lambda q, k, v: jnp.sum(flash_attention(q, k, v, causal=True, backend="tpu").astype(jnp.float32))  # noqa
    calls = {name: blocks for name, _, blocks, _ in _pallas_calls(jax.grad(loss, (0, 1, 2)), q, kv, kv)}
    n = L // bq
    for name in ("flash_attention_fwd", "flash_attention_dq"):
        k_block = calls[name][1]  # operands: q, k, v, ...
        for i in range(n):
            # grid (b, h, i, j): query block i sees key blocks 0..i, then stays on block i.
            assert [_block_indices(k_block, 0, 1, i, j)[2] for j in range(n)] == [min(j, i) for j in range(n)], name
    q_block = calls["flash_attention_dkv"][0]
    for j in range(n):
        # grid (b, kv head, j, g, i): key block j is first seen by query block j; earlier steps wait on block j.
        assert [_block_indices(q_block, 0, 0, j, 1, i)[2] for i in range(n)] == [max(i, j) for i in range(n)]


def _with_vmem_limit(monkeypatch, limit_bytes: int):
    """Compile every Mosaic kernel with `vmem_limit_bytes=limit_bytes` (the compiler refuses a kernel that needs more)."""
    from pallas_kernels import _util

    original = _util.compiler_params

    def limited(*args, **kwargs):
        params = original(*args, **kwargs)
        return dataclasses.replace(params, vmem_limit_bytes=limit_bytes) if params is not None else None

    monkeypatch.setattr(_util, "compiler_params", limited)


def test_tpu_compiles_long_causal_attention_in_little_vmem(monkeypatch):
    """Sequence 32768, head dim 128, bf16, causal, GQA: forward and backward compile for a v5p with every kernel held
    to 1 MiB of VMEM, at 4096 as at 32768. A forward holding whole K/V blocks needs 2 (k, v) x 2 (buffers) x S x Dh
    x 2 bytes of VMEM, 4 MiB at 4096 already; and HBM temporaries grow linearly, not with the [L, S] scores."""
    replicated = tpu_replicated("v5p:2x2x1")
    _with_vmem_limit(monkeypatch, 2**20)

    def loss(q, k, v):
        return jnp.sum(flash_attention(q, k, v, causal=True, backend="tpu").astype(jnp.float32))

    temp_bytes = {}
    for L in (4096, 32768):
        q = jax.ShapeDtypeStruct((1, L, 4, 128), jnp.bfloat16, sharding=replicated)
        kv = jax.ShapeDtypeStruct((1, L, 2, 128), jnp.bfloat16, sharding=replicated)
        fwd = jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=True, backend="tpu")).lower(q, kv, kv).compile()
        assert fwd.as_text().count("tpu_custom_call") >= 1
        bwd = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile()
        assert bwd.as_text().count("tpu_custom_call") >= 3, "expected the forward, dq and dk/dv Mosaic kernels"
        temp_bytes[L] = bwd.memory_analysis().temp_size_in_bytes
    # HBM temporaries per query position stay within a small factor (XLA's buffer assignment varies with size);
    # storing [L, S] scores would make them 8x larger at 8x the length.
    per_position = {L: temp_bytes[L] / L for L in temp_bytes}
    assert per_position[32768] <= 2 * per_position[4096], temp_bytes


@pytest.mark.parametrize(
    "L,H,K,Dh,dtype,causal,segments",
    [(256, 4, 2, 128, jnp.bfloat16, True, True), (200, 2, 1, 64, jnp.float32, False, False)],
)
def test_tpu_lowering_compiles_fwd_and_bwd(L, H, K, Dh, dtype, causal, segments):
    replicated = tpu_replicated("v5p:2x2x1")
    q = jax.ShapeDtypeStruct((2, L, H, Dh), dtype, sharding=replicated)
    kv = jax.ShapeDtypeStruct((2, L, K, Dh), dtype, sharding=replicated)
    seg = jax.ShapeDtypeStruct((2, L), jnp.int32, sharding=replicated)

    def loss(q, k, v, seg):
        out = flash_attention(q, k, v, causal=causal, segment_ids=seg if segments else None, backend="tpu")
        return jnp.sum(out.astype(jnp.float32))

    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, seg).compile()
    text = compiled.as_text()
    assert text.count("tpu_custom_call") >= 3, "expected the forward, dq and dk/dv Mosaic kernels in the TPU program"
    assert compiled.memory_analysis() is not None


# ---------------------------------------------------------------------------------------------------------------------
# GPU: lower forward and backward through the Pallas Triton lowering (the kernels pass Triton compiler params) from
# this CPU-only machine, at training shapes.


@pytest.mark.parametrize(
    "B,L,S,H,K,Dh,causal,segments",
    [
        (2, 2048, 2048, 8, 2, 64, True, False),
        (2, 2048, 2048, 8, 2, 64, False, True),
        (1, 4096, 4096, 16, 4, 128, True, True),
        (2, 2048, 2048, 8, 8, 128, False, False),
        (1, 1000, 3000, 6, 2, 128, True, True),  # awkward lengths, S > L, 3 query heads per kv head
    ],
)
def test_gpu_lowering_fwd_and_bwd(B, L, S, H, K, Dh, causal, segments):
    q = jax.ShapeDtypeStruct((B, L, H, Dh), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, S, K, Dh), jnp.bfloat16)
    segs = SegmentIds(jax.ShapeDtypeStruct((B, L), jnp.int32), jax.ShapeDtypeStruct((B, S), jnp.int32))

    def loss(q, k, v, segs):
        out = flash_attention(q, k, v, causal=causal, segment_ids=segs if segments else None, backend="gpu")
        return jnp.sum(out.astype(jnp.float32))

    text = lower_for_cuda(jax.value_and_grad(loss, argnums=(0, 1, 2)), q, kv, kv, segs)
    assert gpu_kernel_names(text) == ["flash_attention_fwd", "flash_attention_dq", "flash_attention_dkv"]
