"""What a train step may ask of a model's layers, passed to them explicitly.

A step written with explicit collectives (jaxperf.explicit) needs two things from the layers that plain `jit` does
not: a place where each layer's parameters are used (to all-gather fsdp shards there, or to all-reduce that layer's
gradients as soon as its backward is done), and the output of every row-parallel matmul (to add the partial sums of a
Megatron tensor-parallel layer). A model that supports those flavours keeps a `hooks` attribute, hands each layer its
parameters through `hooks.layer_params` and passes `hooks` on to its layers, which call `hooks.row_parallel` on the
output of their row-parallel matmuls. It also names where its stacked layers live (`layer_stack`, the key of the
stacked layer parameters in its parameter tree). The defaults are the identity, so under `jit` nothing changes.

    model = task.merge(params, hooks=LayerHooks(row_parallel=lambda y: jax.lax.psum(y, "tensor")))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def _identity(x):
    return x


@dataclass(frozen=True)
class LayerHooks:
    """Callbacks a step installs on a model (the identity by default).

    layer_params: applied to one layer's parameters (a pytree without the stacked `layers` axis) just before the
      layer runs, once per layer and per forward pass.
    row_parallel: applied to the output of each row-parallel matmul (attention output and MLP output projections)
      before its bias is added.
    """

    layer_params: Callable[[Any], Any] = _identity
    row_parallel: Callable[[Any], Any] = _identity


DEFAULT_HOOKS = LayerHooks()
