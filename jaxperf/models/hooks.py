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
class PipelineSpec:
    """Run the model's layer stack as a pipeline: over mesh axis `axis` (its size is the number of stages), in
    `n_micro` microbatches, with `schedule` "gpipe" or "1f1b" (jaxperf.models.pipelined)."""

    mesh: Any
    n_micro: int
    schedule: str = "1f1b"
    axis: str = "stage"


@dataclass(frozen=True)
class ContextSpec:
    """Attention runs as a ring over mesh axis `axis` of size `n` with the sequence in `layout` ("zigzag": the loss
    puts the tokens in `jaxperf.parallel.ring_attention.zigzag_order` first; "contiguous")."""

    n: int
    layout: str = "zigzag"
    axis: str = "seq"


@dataclass(frozen=True)
class ExpertSpec:
    """MoE layers run their experts split over mesh axis `axis` of `mesh` (expert parallelism), tokens sent to them
    and back by all-to-all (jaxperf.parallel.expert)."""

    mesh: Any
    axis: str = "expert"


@dataclass(frozen=True)
class LayerHooks:
    """Callbacks a step installs on a model (the identity by default).

    layer_params: applied to one layer's parameters (a pytree without the stacked `layers` axis) just before the
      layer runs, once per layer and per forward pass.
    row_parallel: applied to the output of each row-parallel matmul (attention output and MLP output projections)
      before its bias is added.
    pipeline: when set, the loss runs the layer stack as a pipeline (jaxperf.models.gpt.gpt_loss).
    context: when set, attention runs as a ring over the sequence split (context parallelism).
    sequence_parallel: when set (to the mesh), the column- and row-parallel matmuls gather and scatter the sequence
      over `tensor` with collective matmuls (jaxperf.parallel.collective_matmul).
    experts: when set, MoE layers run expert parallel over its mesh axis.
    """

    layer_params: Callable[[Any], Any] = _identity
    row_parallel: Callable[[Any], Any] = _identity
    pipeline: PipelineSpec | None = None
    context: ContextSpec | None = None
    sequence_parallel: Any = None  # the mesh, when activations between layers are split over `tensor` (Megatron-SP)
    experts: ExpertSpec | None = None


DEFAULT_HOOKS = LayerHooks()
