"""Ring attention (sequence split over a mesh axis) against `xla_attention`, forward and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from jaxperf import _compat
from jaxperf.models.attention import attention, xla_attention
from jaxperf.parallel.ring_attention import ring_attention, ring_attention_sharded, zigzag_order

B, L, H, Dh = 2, 16, 4, 8
TOL = dict(rtol=1e-5, atol=1e-5)


def _qkv(kv_heads: int, length: int = L):
    kq, kk, kv, kw = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(kq, (B, length, H, Dh))
    k = jax.random.normal(kk, (B, length, kv_heads, Dh))
    v = jax.random.normal(kv, (B, length, kv_heads, Dh))
    w = jax.random.normal(kw, (B, length, H, Dh))  # cotangent weights: every output element matters
    return q, k, v, w


def _out_and_grads(attn):
    """(out, (dq, dk, dv)) of `attn` in one compiled function."""

    def f(q, k, v, w):
        out, pullback = jax.vjp(attn, q, k, v)
        return out, pullback(w)

    return jax.jit(f)


def _assert_same(got, want):
    (out, grads), (out_ref, grads_ref) = got, want
    np.testing.assert_allclose(out, out_ref, **TOL)
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        np.testing.assert_allclose(g, g_ref, err_msg=name, **TOL)


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_matches_xla(n, causal):
    """Grouped-query heads (4 query heads over 2 kv heads; multi-query on 8 devices), fp32."""
    mesh = Mesh(np.array(jax.devices()[:n]), ("seq",))
    q, k, v, w = _qkv(kv_heads=1 if n == 8 else 2)
    got = _out_and_grads(lambda q, k, v: ring_attention_sharded(q, k, v, mesh, causal=causal))(q, k, v, w)
    want = _out_and_grads(lambda q, k, v: xla_attention(q, k, v, causal=causal))(q, k, v, w)
    _assert_same(got, want)


def test_ring_segment_ids():
    """Packed sequences whose boundaries fall inside blocks: the kv ids travel around the ring with the keys."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("seq",))
    q, k, v, w = _qkv(kv_heads=2)
    seg_BxL = jnp.stack([jnp.repeat(jnp.array([0, 1, 2]), jnp.array([5, 6, 5])), jnp.ones(L, jnp.int32)])
    got = _out_and_grads(lambda q, k, v: ring_attention_sharded(q, k, v, mesh, segment_ids=seg_BxL))(q, k, v, w)
    want = _out_and_grads(lambda q, k, v: xla_attention(q, k, v, segment_ids=seg_BxL))(q, k, v, w)
    _assert_same(got, want)


@pytest.mark.parametrize("causal", [True, False])
def test_ring_fully_masked_queries_output_zeros_with_finite_gradients(causal):
    """Queries whose segment id no key has see nothing: zeros, as in xla_attention, and gradients that stay finite and
    equal however large their cotangent (a 1 / tiny floor on the softmax sum turned it into inf)."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("seq",))
    q, k, v, w = _qkv(kv_heads=2)
    kv_seg = jnp.stack([jnp.repeat(jnp.array([0, 1]), jnp.array([7, 9])), jnp.zeros(L, jnp.int32)])
    empty = np.zeros((B, L), bool)
    empty[0, 3:9] = empty[1, :2] = empty[1, L - 1] = True  # rows 3..8 span two devices' blocks
    segs = (jnp.where(empty, -1, kv_seg), kv_seg)
    w = jnp.where(empty[:, :, None, None], 1e6, 1.0) * w
    got = _out_and_grads(lambda q, k, v: ring_attention_sharded(q, k, v, mesh, causal=causal, segment_ids=segs))(
        q, k, v, w)
    want = _out_and_grads(lambda q, k, v: xla_attention(q, k, v, causal=causal, segment_ids=segs))(q, k, v, w)
    np.testing.assert_array_equal(np.asarray(got[0])[empty], 0.0)
    _assert_same(got, want)


def test_ring_inside_shard_map_with_data_axis():
    """Called inside a user's shard_map: each device holds 1 row and 4 positions of a (data=2, seq=4) mesh."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "seq"))
    q, k, v, _ = _qkv(kv_heads=2)
    local_shapes = []

    def per_device(q, k, v):
        local_shapes.append(q.shape)
        return ring_attention(q, k, v, "seq", causal=True)

    spec = P("data", "seq")
    run = jax.jit(_compat.shard_map(per_device, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec))
    np.testing.assert_allclose(run(q, k, v), xla_attention(q, k, v), **TOL)
    assert local_shapes == [(1, 4, H, Dh)]


def test_uneven_length_and_bad_shapes_raise():
    mesh = Mesh(np.array(jax.devices()[:4]), ("seq",))
    q, k, v, _ = _qkv(kv_heads=2, length=10)
    uneven = r"sequence length 10 does not split over 4 devices.*multiple of 4 \(e\.g\. 12\)"
    with pytest.raises(ValueError, match=uneven):
        ring_attention_sharded(q, k, v, mesh)
    q16, k16, v16, _ = _qkv(kv_heads=2)
    with pytest.raises(ValueError, match="equal query and key lengths"):
        ring_attention_sharded(q16[:, :8], k16, v16, mesh)
    with pytest.raises(ValueError, match="no sequence axis 'seq'"):
        ring_attention_sharded(q16, k16, v16, Mesh(np.array(jax.devices()[:4]), ("data",)))
    data_seq = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "seq"))
    with pytest.raises(ValueError, match=r"batch 2 does not split over 4 devices of mesh axes \('data',\)"):
        ring_attention_sharded(q16, k16, v16, data_seq, "seq", "data")
    with pytest.raises(ValueError, match="multiple of kv heads"):
        ring_attention_sharded(q16, k16[:, :, :1].repeat(3, axis=2), v16[:, :, :1].repeat(3, axis=2), mesh)


def test_registry_ring_uses_ambient_seq_axis():
    """attention(impl="ring") runs ring attention over the ambient mesh's "seq" axis, and says why when it cannot."""
    q, k, v, _ = _qkv(kv_heads=2)
    with pytest.raises(RuntimeError, match="ambient mesh with a 'seq' axis"):
        attention(q, k, v, impl="ring")
    mesh = _compat.make_mesh((2, 4), ("data", "seq"))
    ring = jax.jit(lambda q, k, v: attention(q, k, v, impl="ring"))
    with _compat.set_mesh(mesh):
        out = ring(q, k, v)
        hlo = ring.lower(q, k, v).as_text()
        with pytest.raises(RuntimeError, match="sequence length 10 does not split over 4"):
            attention(*_qkv(kv_heads=2, length=10)[:3], impl="ring")
    assert "collective_permute" in hlo  # the ring really ran, not a silent fallback to plain attention
    np.testing.assert_allclose(out, xla_attention(q, k, v), **TOL)
    with _compat.set_mesh(_compat.make_mesh((8,), ("data",))):
        with pytest.raises(RuntimeError, match=r"found \('data',\)"):
            attention(q, k, v, impl="ring")


@pytest.mark.parametrize("n", [2, 4])
def test_zigzag_matches_xla_with_gqa_and_segment_ids(n):
    """The zigzag layout on tokens put in `zigzag_order`: equal to xla_attention on those tokens at their global
    positions (computed there by permuting back)."""
    mesh = Mesh(np.array(jax.devices()[:n]), ("seq",))
    q, k, v, w = _qkv(kv_heads=2)
    seg_BxL = jnp.stack([jnp.repeat(jnp.array([0, 1, 2]), jnp.array([3, 9, 4])), jnp.ones(L, jnp.int32)])
    order = zigzag_order(L, n)
    assert sorted(order.tolist()) == list(range(L)) and order.tolist() != list(range(L))
    z = lambda a: jnp.take(a, order, axis=1)  # noqa: E731
    got = _out_and_grads(lambda q, k, v: ring_attention_sharded(q, k, v, mesh, segment_ids=z(seg_BxL),
                                                                layout="zigzag"))(z(q), z(k), z(v), z(w))
    out_ref, grads_ref = _out_and_grads(lambda q, k, v: xla_attention(q, k, v, segment_ids=seg_BxL))(q, k, v, w)
    _assert_same(got, (z(out_ref), tuple(z(g) for g in grads_ref)))


def _work(layout: str, n: int) -> np.ndarray:
    """(query chunk, key chunk) pairs each ring position computes under a causal mask."""
    mesh = Mesh(np.array(jax.devices()[:n]), ("seq",))
    q, k, v, _ = _qkv(kv_heads=2)
    f = _compat.shard_map(lambda q, k, v: ring_attention(q, k, v, "seq", layout=layout, return_work=True)[1][None],
                          mesh=mesh, in_specs=(P(None, "seq"),) * 3, out_specs=P("seq"))
    return np.asarray(jax.jit(f)(q, k, v))


@pytest.mark.parametrize("n", [2, 4, 8])
def test_zigzag_gives_every_device_the_same_causal_work(n):
    """Counted, not timed. A pair is one chunk of L / 2n queries against one of L / 2n keys (zigzag); contiguous
    blocks are L / n long, i.e. 4 such pairs each."""
    zigzag = _work("zigzag", n)
    assert zigzag.max() - zigzag.min() <= 1, zigzag  # within one block of equal (here: exactly equal)
    assert zigzag.sum() == (2 * n) * (2 * n + 1) // 2  # every causal pair once
    contiguous = _work("contiguous", n)
    np.testing.assert_array_equal(contiguous, np.arange(1, n + 1))  # device i sees i + 1 blocks: uneven
