"""A ring all-reduce written as ppermutes equals psum; an alpha-beta link fitted to psum predicts the ring's time.

    python examples/03_collectives.py

Runs on 8 simulated CPU devices (threads of this process), so the "link" is a memory copy between threads: the point
is the method (check, time, fit, predict), not the figures.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

from jaxperf import _compat  # noqa: E402
from jaxperf.explicit import collectives, cost_model  # noqa: E402
from jaxperf.perf.timing import benchmark  # noqa: E402

devices = jax.devices("cpu")[:8]
n = len(devices)
mesh = Mesh(np.array(devices), ("x",))


def per_device(fn):
    """jit(shard_map(fn)): row d of an (n, ...) array is device d's buffer."""
    return jax.jit(_compat.shard_map(lambda x: fn(x, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))


ring, psum = per_device(collectives.ring_all_reduce), per_device(lambda x, axis: lax.psum(x, axis))

# 1. The same answer: 1000 floats per device (not a multiple of n: the ring pads and unpads).
x_NxM = jax.random.normal(jax.random.key(0), (n, 1000), jnp.float32)
np.testing.assert_allclose(np.asarray(ring(x_NxM)), np.asarray(psum(x_NxM)), rtol=1e-5, atol=1e-5)
print(f"ring_all_reduce == psum on {n} devices")

# 2. Time psum over a few sizes, fit alpha and beta to it, and predict the ring.
sizes = [4 << 10, 64 << 10, 1 << 20]  # bytes per device
measured = {"psum": {}, "ring": {}}
for nbytes in sizes:
    x_NxM = jax.random.normal(jax.random.key(1), (n, nbytes // 4), jnp.float32)
    for name, fn in (("psum", psum), ("ring", ring)):
        measured[name][nbytes] = benchmark(fn, x_NxM, iters=5).median_s
link = cost_model.fit_link(measured["psum"].items(), n=n, algorithm="psum")
print(f"link fitted to psum: alpha {link.alpha_s * 1e6:.1f} us, bandwidth {link.bandwidth / 1e9:.2f} GB/s")

print(f"{'bytes/device':>12}  {'algorithm':>9}  {'measured':>10}  {'predicted':>10}  {'bus GB/s':>8}")
for nbytes in sizes:
    for name in ("psum", "ring"):
        t = measured[name][nbytes]
        print(f"{nbytes:>12}  {name:>9}  {t * 1e3:>8.3f}ms  {cost_model.predict(name, nbytes, n, link) * 1e3:>8.3f}ms"
              f"  {cost_model.bus_bandwidth(nbytes, n, t) / 1e9:>8.3f}")
# On CPU the ring's 2(n-1) ppermutes are each a separate copy between threads, so it trails the runtime's psum; on
# a GPU or TPU slice, the gap between measurement and model is what says whether the link or the steps are the limit.
