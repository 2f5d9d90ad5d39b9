"""Sequence parallelism: ring attention over 8 devices, checked against plain attention (forward and gradients).

    python examples/05_ring_attention.py

Runs on CPU with 8 simulated devices (set JAX_PLATFORMS yourself to use other hardware with at least 8 devices).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)  # before JAX starts its backends

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxperf import _compat  # noqa: E402
from jaxperf.models.attention import attention, xla_attention  # noqa: E402
from jaxperf.parallel.ring_attention import ring_attention_sharded  # noqa: E402

B, L, H, K, Dh = 2, 256, 8, 2, 32  # grouped-query: 4 query heads per kv head
mesh = _compat.make_mesh((8,), ("seq",), devices=jax.devices()[:8])
kq, kk, kv = jax.random.split(jax.random.key(0), 3)
q = jax.random.normal(kq, (B, L, H, Dh))
k = jax.random.normal(kk, (B, L, K, Dh))
v = jax.random.normal(kv, (B, L, K, Dh))


def loss_and_grads(attn):
    return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(jnp.sin(attn(q, k, v))), argnums=(0, 1, 2)))(q, k, v)


(ring_loss, ring_grads) = loss_and_grads(lambda q, k, v: ring_attention_sharded(q, k, v, mesh, seq_axis="seq"))
(ref_loss, ref_grads) = loss_and_grads(lambda q, k, v: xla_attention(q, k, v, causal=True))
out_diff = float(jnp.max(jnp.abs(jax.jit(lambda q, k, v: ring_attention_sharded(q, k, v, mesh))(q, k, v)
                                 - xla_attention(q, k, v))))
grad_diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(ring_grads, ref_grads))
np.testing.assert_allclose(ring_loss, ref_loss, rtol=1e-5)
assert out_diff < 1e-5, out_diff
for g, g_ref in zip(ring_grads, ref_grads):  # fp32 sums over 256 keys in another order: allow 1e-4
    np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-4)
print(f"sequence {L} over {mesh.shape['seq']} devices ({L // mesh.shape['seq']} positions each), {H} query heads, "
      f"{K} kv heads")
print(f"ring == plain attention: max |out diff| {out_diff:.1e}, max |grad diff| (dq, dk, dv) {grad_diff:.1e}")

# The same through the model's attention dispatch: impl="ring" uses the ambient mesh's "seq" axis.
with _compat.set_mesh(mesh):
    out = jax.jit(lambda q, k, v: attention(q, k, v, impl="ring"))(q, k, v)
dispatch_diff = float(jnp.max(jnp.abs(out - xla_attention(q, k, v))))
assert dispatch_diff < 1e-5, dispatch_diff
print(f"attention(impl='ring') under jax.set_mesh: max |diff| {dispatch_diff:.1e}")
