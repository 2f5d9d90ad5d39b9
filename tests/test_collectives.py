"""Hand-written collectives equal their lax twins on sub-meshes of the 8 CPU devices; the cost model's formulas,
orderings and fit; the collective matmuls equal gather-then-matmul and matmul-then-scatter; XLA:CPU has threads
enough for a blocked collective beside the next program's launches.

Each all-reduce is checked on several awkward sizes at once (one compile per algorithm, n and dtype) and its program
is checked to be made of the expected number of ppermutes: an implementation that quietly called psum would pass a
numbers-only test.
"""

import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from jaxperf import _compat
from jaxperf.explicit import collectives as C, cost_model
from jaxperf.parallel import collective_matmul as CM

HAND_WRITTEN = ("ring", "bidirectional_ring", "halving_doubling")
SHAPES = ((1,), (7,), (1000,), (5, 9))  # none a multiple of 2n for every n


def mesh_of(n):
    return Mesh(np.array(jax.devices()[:n]), ("x",))


def per_device(fn, n, in_specs=P("x"), out_specs=P("x")):
    return jax.jit(_compat.shard_map(fn, mesh=mesh_of(n), in_specs=in_specs, out_specs=out_specs))


def stacked_inputs(n, dtype, seed=0):
    """One (n, *shape) array per shape: row d is device d's buffer."""
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal((n, *s)), dtype) for s in SHAPES)


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("algo", HAND_WRITTEN)
def test_all_reduce_equals_psum(algo, n):
    fn = C.ALL_REDUCES[algo]

    def both(*xs):  # every shape and dtype in one program: one compile per (algo, n)
        xs = [x[0] for x in xs]
        return tuple(fn(x, "x")[None] for x in xs), tuple(lax.psum(x, "x")[None] for x in xs)

    xs = stacked_inputs(n, "float32") + stacked_inputs(n, "bfloat16", seed=1)
    got, want = per_device(both, n, in_specs=(P("x"),) * len(xs), out_specs=P("x"))(*xs)
    for x, g, w in zip(xs, got, want):
        assert g.shape == x.shape and g.dtype == x.dtype, (x.shape, x.dtype, g.shape, g.dtype)
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        if x.dtype == jnp.float32:
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=f"float32 {x.shape}")
        else:
            # n-1 additions, each rounding to bf16 (unit roundoff 2^-8) in an order that differs from psum's.
            atol = (n - 1) * 2.0**-8 * float(np.max(np.sum(np.abs(np.asarray(x, np.float32)), axis=0)))
            np.testing.assert_allclose(g, w, rtol=2.0**-7, atol=atol, err_msg=f"bfloat16 {x.shape}")
        np.testing.assert_array_equal(g, np.broadcast_to(g[:1], g.shape))  # every device has the same answer


@pytest.mark.parametrize(("algo", "ppermutes_at_8"), [("ring", 14), ("bidirectional_ring", 28),
                                                      ("halving_doubling", 6)])
def test_all_reduce_is_made_of_ppermutes(algo, ppermutes_at_8):
    f = _compat.shard_map(lambda x: C.ALL_REDUCES[algo](x, "x"), mesh=mesh_of(8), in_specs=P("x"), out_specs=P("x"))
    text = str(jax.make_jaxpr(f)(jnp.ones((8, 10), jnp.float32)))
    assert text.count("ppermute[") == ppermutes_at_8, text
    assert "psum" not in text and "all_gather" not in text and "reduce_scatter" not in text


def test_ring_sends_to_the_next_device_and_bidirectional_also_to_the_previous():
    def perms(fn):
        f = _compat.shard_map(lambda x: fn(x, "x"), mesh=mesh_of(4), in_specs=P("x"), out_specs=P("x"))
        jaxpr = jax.make_jaxpr(f)(jnp.ones((4, 8), jnp.float32))
        found = set()

        def walk(jpr):  # the ppermutes sit inside the shard_map equation's own jaxpr
            for eqn in jpr.eqns:
                if eqn.primitive.name == "ppermute":
                    found.add(tuple(sorted(eqn.params["perm"])))
                for v in eqn.params.values():
                    sub = v if hasattr(v, "eqns") else getattr(v, "jaxpr", None)
                    if hasattr(sub, "eqns"):
                        walk(sub)

        walk(jaxpr.jaxpr)
        return found

    forward = tuple((j, (j + 1) % 4) for j in range(4))
    backward = tuple(sorted((j, (j - 1) % 4) for j in range(4)))
    assert perms(C.ring_all_reduce) == {forward}
    assert perms(C.bidirectional_ring_all_reduce) == {forward, backward}


@pytest.mark.parametrize("n", [2, 4, 8])
def test_reduce_scatter_and_all_gather_equal_lax(n):
    rng = np.random.default_rng(1)
    a = jnp.asarray(rng.standard_normal((n, n, 3)), jnp.float32)  # device d: (n, 3), leading dim = n
    b = jnp.asarray(rng.standard_normal((n, 2 * n, 5)), jnp.float32)  # device d: (2n, 5), tiled scatter
    c = jnp.asarray(rng.standard_normal((n, 2, 3)), jnp.float32)  # device d: (2, 3) to gather

    def both(a, b, c):
        a, b, c = a[0], b[0], c[0]
        got = [C.ring_reduce_scatter(a, "x"), C.ring_reduce_scatter(b, "x", tiled=True),
               C.ring_reduce_scatter(b, "x", tiled=True, direction=-1),
               C.ring_all_gather(c, "x"), C.ring_all_gather(c, "x", tiled=True),
               C.ring_all_gather(c, "x", direction=-1)]
        want = [lax.psum_scatter(a, "x", tiled=False), lax.psum_scatter(b, "x", tiled=True),
                lax.psum_scatter(b, "x", tiled=True),
                lax.all_gather(c, "x"), lax.all_gather(c, "x", tiled=True), lax.all_gather(c, "x")]
        return [g[None] for g in got], [w[None] for w in want]

    got, want = per_device(both, n, in_specs=(P("x"),) * 3, out_specs=P("x"))(a, b, c)
    assert [g.shape for g in got] == [(n, 3), (n, 2, 5), (n, 2, 5), (n, n, 2, 3), (n, 2 * n, 3), (n, n, 2, 3)]
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


def test_reduce_scatter_rejects_a_leading_dim_that_does_not_split():
    with pytest.raises(ValueError, match="leading dim 5 must be a multiple of the 4 devices"):
        per_device(lambda x: C.ring_reduce_scatter(x, "x", tiled=True), 4)(jnp.ones((4 * 5, 3)))
    with pytest.raises(ValueError, match="leading dim 3 must equal the 4 devices"):
        per_device(lambda x: C.ring_reduce_scatter(x, "x")[None], 4)(jnp.ones((4 * 3, 3)))


@pytest.mark.parametrize("n", [3, 6])
def test_halving_doubling_needs_a_power_of_two(n):
    f = per_device(lambda x: C.halving_doubling_all_reduce(x, "x"), n)
    with pytest.raises(ValueError, match=f"power-of-two.*n={n}.*ring_all_reduce"):
        f(jnp.ones((n, 4), jnp.float32))
    with pytest.raises(ValueError, match=f"n={n}"):
        cost_model.predict("halving_doubling", 1024, n, cost_model.LinkModel(1e-6, 1e-9))


def test_ring_on_three_devices():
    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 10)), jnp.float32)
    got = per_device(lambda v: C.bidirectional_ring_all_reduce(C.ring_all_reduce(v, "x"), "x"), 3)(x)
    np.testing.assert_allclose(np.asarray(got), np.broadcast_to(3 * x.sum(0), (3, 10)), rtol=1e-5, atol=1e-5)


def _threads_named(name: str) -> int:
    count = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            count += (task / "comm").read_text().strip() == name
        except OSError:  # a thread that ended meanwhile
            pass
    return count


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts XLA's threads through /proc (Linux)")
def test_xla_cpu_has_threads_for_a_blocked_collective_beside_the_next_launches():
    # XLA:CPU runs the devices' parts of programs and the per-device launches of multi-device programs on one pool, by
    # default of max(cores, devices) threads. With 8, 7 devices waiting in a collective and a launch waiting for the
    # 8th device's in-flight limit leave that device no thread: XLA aborts the process after 40 s. conftest sets
    # PJRT_NPROC so that a blocked collective and two threads' launches fit (tests/conftest.py says more).
    n = len(jax.devices("cpu"))
    pool = _threads_named("tf_XLAEigen")
    assert pool >= (n - 1) + 2 * n, (
        f"XLA:CPU's pool has {pool} threads for {n} devices: a collective blocked on {n - 1} of them and the next "
        f"program's launches can take them all, and XLA aborts after 40 s. tests/conftest.py sets PJRT_NPROC before "
        f"JAX makes its CPU client (here PJRT_NPROC={os.environ.get('PJRT_NPROC')!r})")


# ---------------------------------------------------------------------------------------------------------------------
# Cost model

LINK = cost_model.LinkModel(alpha_s=10e-6, beta_s_per_byte=1 / 25e9)


def test_predict_formulas():
    n, nb, a, b = 8, 1 << 20, LINK.alpha_s, LINK.beta_s_per_byte
    assert cost_model.predict("ring", nb, n, LINK) == pytest.approx(14 * a + 14 / 8 * nb * b)
    assert cost_model.predict("psum", nb, n, LINK) == cost_model.predict("ring", nb, n, LINK)
    assert cost_model.predict("bidirectional_ring", nb, n, LINK) == pytest.approx(14 * a + 7 / 8 * nb * b)
    assert cost_model.predict("halving_doubling", nb, n, LINK) == pytest.approx(6 * a + 14 / 8 * nb * b)
    assert cost_model.predict("naive", nb, n, LINK) == pytest.approx(7 * a + 7 * nb * b)
    assert cost_model.predict("ring", nb, 1, LINK) == 0.0
    assert LINK.bandwidth == pytest.approx(25e9) and cost_model.LinkModel.from_bandwidth(a, 25e9) == LINK
    with pytest.raises(ValueError, match="unknown algorithm 'tree'"):
        cost_model.predict("tree", nb, n, LINK)


def test_cost_model_orderings():
    n = 8
    t = lambda algo, nb: cost_model.predict(algo, nb, n, LINK)  # noqa: E731
    big, small = 64 << 20, 256
    assert t("bidirectional_ring", big) < t("ring", big) < t("naive", big)
    # the same bytes as the ring, 2 log2(n) instead of 2(n-1) messages
    assert t("ring", big) - t("halving_doubling", big) == pytest.approx((14 - 6) * LINK.alpha_s)
    assert t("halving_doubling", small) < t("ring", small)  # 2 log2 n messages vs 2(n-1)
    assert t("naive", small) < t("ring", small)  # n-1 messages: for tiny buffers the ring's extra steps cost more
    # ring and naive cross where the ring's extra (n-1) alpha equals the bytes it saves
    cross = LINK.alpha_s / (LINK.beta_s_per_byte * (1 - 2 / n))
    assert t("naive", 0.9 * cross) < t("ring", 0.9 * cross) and t("ring", 1.1 * cross) < t("naive", 1.1 * cross)


def test_bus_bandwidth_of_a_latency_free_ring_is_the_link_bandwidth():
    link = cost_model.LinkModel(0.0, LINK.beta_s_per_byte)
    for n in (2, 4, 8, 64):
        nb = 3 << 20
        assert cost_model.bus_bandwidth(nb, n, cost_model.predict("ring", nb, n, link)) == pytest.approx(link.bandwidth)
    assert cost_model.bus_bandwidth(1e9, 8, 1.0) == pytest.approx(1.75e9)


@pytest.mark.parametrize("algo", ["psum", "halving_doubling", "bidirectional_ring"])
def test_fit_link_recovers_alpha_and_beta(algo):
    sizes = [2**k for k in range(10, 27, 2)]
    exact = [(nb, cost_model.predict(algo, nb, 8, LINK)) for nb in sizes]
    fit = cost_model.fit_link(exact, n=8, algorithm=algo)
    assert fit.alpha_s == pytest.approx(LINK.alpha_s, rel=1e-6)
    assert fit.beta_s_per_byte == pytest.approx(LINK.beta_s_per_byte, rel=1e-6)
    rng = np.random.default_rng(3)
    noisy = [(nb, s * (1 + 0.03 * rng.standard_normal())) for nb, s in exact for _ in range(3)]
    fit = cost_model.fit_link(noisy, n=8, algorithm=algo)
    assert fit.alpha_s == pytest.approx(LINK.alpha_s, rel=0.1)
    assert fit.beta_s_per_byte == pytest.approx(LINK.beta_s_per_byte, rel=0.1)


def test_fit_link_keeps_alpha_and_beta_non_negative():
    # times that a line through them would meet below zero need a negative alpha: the fit keeps it at zero
    beta = LINK.beta_s_per_byte
    fit = cost_model.fit_link([(nb, cost_model.predict("ring", nb, 8, cost_model.LinkModel(0.0, beta)) - 5e-6) for nb in (1e5, 1e6, 1e7)], n=8)
    assert fit.alpha_s == 0 and fit.beta_s_per_byte > 0
    with pytest.raises(ValueError, match="two or more message sizes"):
        cost_model.fit_link([(1024, 1e-5), (1024, 2e-5)], n=8)


# ---------------------------------------------------------------------------------------------------------------------
# Collective matmuls


@pytest.mark.parametrize("n", [2, 4, 8])
def test_all_gather_matmul_equals_gather_then_matmul(n):
    L, D, F = 3, 16, 5
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((n * L, D)), jnp.float32)  # rows sharded
    w = jnp.asarray(rng.standard_normal((D, n * F)), jnp.float32)  # columns sharded
    x3 = jnp.asarray(rng.standard_normal((2, n * L, D)), jnp.float32)  # (B, L, D), L sharded

    def both(x_LxD, w_DxF, x_BxLxD):
        plain = lax.all_gather(x_LxD, "x", tiled=True) @ w_DxF
        plain3 = jnp.einsum("bld,df->blf", lax.all_gather(x_BxLxD, "x", axis=1, tiled=True), w_DxF)
        return (CM.all_gather_matmul(x_LxD, w_DxF, "x"), plain,
                CM.all_gather_matmul(x_BxLxD, w_DxF, "x", axis=1), plain3)

    specs = (P("x", None), P(None, "x"), P(None, "x", None))
    out_specs = (P(None, "x"), P(None, "x"), P(None, None, "x"), P(None, None, "x"))
    got, plain, got3, plain3 = per_device(both, n, in_specs=specs, out_specs=out_specs)(x, w, x3)
    assert got.shape == (n * L, n * F) and got3.shape == (2, n * L, n * F)
    np.testing.assert_allclose(np.asarray(got), np.asarray(plain), rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got3), np.asarray(plain3), rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got), np.asarray(x) @ np.asarray(w), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("n", [2, 8])
def test_matmul_reduce_scatter_equals_matmul_then_scatter(n):
    L, D, F = 2, 8, 6
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((n * L, n * D)), jnp.float32)  # contracted dim sharded
    w = jnp.asarray(rng.standard_normal((n * D, F)), jnp.float32)  # rows sharded

    def both(x_LxD, w_DxF):
        return CM.matmul_reduce_scatter(x_LxD, w_DxF, "x"), lax.psum_scatter(x_LxD @ w_DxF, "x", tiled=True)

    got, plain = per_device(both, n, in_specs=(P(None, "x"), P("x", None)), out_specs=(P("x"), P("x")))(x, w)
    assert got.shape == (n * L, F)
    np.testing.assert_allclose(np.asarray(got), np.asarray(plain), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got), np.asarray(x) @ np.asarray(w), rtol=1e-5, atol=1e-4)


def test_collective_matmuls_are_made_of_ppermutes():
    x, w = jnp.ones((8 * 2, 4)), jnp.ones((4, 8 * 3))
    ag = _compat.shard_map(lambda a, b: CM.all_gather_matmul(a, b, "x"), mesh=mesh_of(8),
                           in_specs=(P("x"), P(None, "x")), out_specs=P(None, "x"))
    text = str(jax.make_jaxpr(ag)(x, w))
    assert text.count("ppermute[") == 7 and "all_gather" not in text
    rs = _compat.shard_map(lambda a, b: CM.matmul_reduce_scatter(a, b, "x"), mesh=mesh_of(8),
                           in_specs=(P(None, "x"), P("x")), out_specs=P("x"))
    text = str(jax.make_jaxpr(rs)(jnp.ones((8 * 2, 8 * 4)), jnp.ones((8 * 4, 3))))
    assert text.count("ppermute[") == 7 and "psum" not in text and "reduce_scatter" not in text
    with pytest.raises(ValueError, match="7 rows, not a multiple of the 8 devices"):
        per_device(lambda a, b: CM.matmul_reduce_scatter(a, b, "x"), 8, in_specs=(P(None, "x"), P("x")),
                   out_specs=P("x"))(jnp.ones((7, 8 * 4)), jnp.ones((8 * 4, 3)))
