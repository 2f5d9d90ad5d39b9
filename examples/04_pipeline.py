"""Pipeline parallelism: a GPT's blocks split over 4 stages (GPipe), checked against the unpipelined model.

    python examples/04_pipeline.py

Runs on CPU with 8 simulated devices (set JAX_PLATFORMS yourself to use other hardware with at least 4 devices).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)  # before JAX starts its backends

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from jaxperf.config import ModelConfig  # noqa: E402
from jaxperf.models.gpt import GPT  # noqa: E402
from jaxperf.models.pipelined import pipeline_loss  # noqa: E402
from jaxperf.parallel.pipeline import bubble_fraction  # noqa: E402

N_STAGES, N_MICRO = 4, 8
mesh = Mesh(np.array(jax.devices()[:N_STAGES]), ("stage",))
cfg = ModelConfig(style="llama", vocab_size=256, max_seq_len=32, d_model=64, n_layers=8, n_heads=4, n_kv_heads=2)
model = GPT(cfg, rngs=nnx.Rngs(0))
tokens = jax.random.randint(jax.random.key(1), (16, 33), 0, cfg.vocab_size)
batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
graphdef, params, rest = nnx.split(model, nnx.Param, ...)


def loss_and_grads(loss_fn):
    return jax.jit(jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p, rest), batch)[0]))(params)


plain_loss, plain_grads = loss_and_grads(lambda m, b: m.next_token_loss(b))
piped_loss, piped_grads = loss_and_grads(lambda m, b: pipeline_loss(m, b, mesh, n_micro=N_MICRO))
grad_diff = max(float(np.max(np.abs(a - b)))
                for a, b in zip(jax.tree.leaves(piped_grads), jax.tree.leaves(plain_grads)))
np.testing.assert_allclose(piped_loss, plain_loss, rtol=1e-6)
assert grad_diff < 1e-5, grad_diff

print(f"{cfg.n_layers} layers over {N_STAGES} stages ({cfg.n_layers // N_STAGES} each), {N_MICRO} microbatches of "
      f"{tokens.shape[0] // N_MICRO} rows")
print(f"loss: pipelined {float(piped_loss):.6f} == plain {float(plain_loss):.6f}; max |grad diff| {grad_diff:.1e}")
for m in (1, 4, 8, 32):
    print(f"GPipe bubble with {N_STAGES} stages and {m:2d} microbatches: {bubble_fraction(N_STAGES, m):.1%}")
