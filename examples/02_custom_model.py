"""Bring your own Flax NNX model: annotate parameters with logical axes and get every mesh and strategy for free.

    python examples/02_custom_model.py                       # one device
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/02_custom_model.py \
        parallel.strategy=fsdp_tp parallel.fsdp=4 parallel.tensor=2
"""

import sys

import jax.numpy as jnp
from flax import nnx

from jaxperf.config import get_config
from jaxperf.step.task import next_token_loss
from jaxperf.train.trainer import Trainer


class ConvLM(nnx.Module):
    """A causal depthwise-convolution language model: nothing like the built-in GPT."""

    def __init__(self, vocab: int = 256, dim: int = 128, width: int = 4, *, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.embed = nnx.Embed(vocab, dim, embedding_init=nnx.with_partitioning(init, ("vocab", "embed")), rngs=rngs)
        self.conv = nnx.Param(nnx.with_partitioning(init, (None, "embed"))(rngs.params(), (width, dim)))
        self.mlp_in = nnx.Linear(dim, 4 * dim, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")), rngs=rngs)
        self.mlp_out = nnx.Linear(4 * dim, dim, kernel_init=nnx.with_partitioning(init, ("mlp", "embed")), rngs=rngs)
        self.width = width

    def __call__(self, tokens):
        x = self.embed(tokens)  # [B, L, D]
        padded = jnp.pad(x, ((0, 0), (self.width - 1, 0), (0, 0)))
        L = x.shape[1]
        x = x + sum(padded[:, i : i + L] * self.conv[i][None, None, :] for i in range(self.width))
        x = x + self.mlp_out(nnx.gelu(self.mlp_in(x)))
        return self.embed.attend(x)


cfg = get_config("tiny", ["run_dir=runs/example-convlm", "max_steps=100", "sample_tokens=0", *sys.argv[1:]])
# The default data (the Python standard library's source, byte-level) comes with the Trainer; only the model is ours.
trainer = Trainer(cfg, make_model=lambda rngs: ConvLM(rngs=rngs), loss_fn=next_token_loss, flops_per_token=None)
summary = trainer.fit()
print(f"loss {summary['losses'][0]:.3f} -> {summary['final_loss']:.3f}")
