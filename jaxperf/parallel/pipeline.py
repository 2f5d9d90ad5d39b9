"""Pipeline parallelism: GPipe over a `stage` mesh axis, written with shard_map and `lax.ppermute`.

    out_MxBxLxD = gpipe(stage_fn, params_N, x_MxBxLxD, mesh, axis="stage")

The built-in GPT runs its blocks through it with `jaxperf.models.pipelined.pipeline_loss`.

The layers are stacked on a leading `layers` axis of N and split into S equal runs of N / S consecutive layers, one run
per device of the `stage` axis. The batch is cut into M microbatches. On tick t stage s applies its layers to
microbatch t - s (when 0 <= t - s < M) and hands the result to stage s + 1 with a ppermute, so after M + S - 1 ticks
the last stage has produced every microbatch. Reverse-mode autodiff through the tick loop gives the backward pipeline
for free: the transpose of "send to s + 1" is "send to s - 1", run over the ticks in reverse.

Only the GPipe schedule is implemented: every forward tick runs before any backward tick, so each stage keeps the
activations of all M microbatches until the backward. 1F1B (one forward, one backward, interleaved) has the same bubble
and keeps at most S microbatches alive; it needs a hand-written backward and is not here. Wrap `stage_fn` in
`jax.checkpoint` (`remat=True`) to keep only each tick's stage input instead of every layer's activations.

Legend: S stages, M microbatches, N layers, B rows per microbatch, L length, D embed, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from jaxperf import _compat

SCHEDULES = ("gpipe", "1f1b")


def bubble_fraction(n_stages: int, n_micro: int, schedule: str = "gpipe") -> float:
    """Fraction of stage-ticks spent idle: (S - 1) / (M + S - 1) for both GPipe and 1F1B.

    Each stage is busy for M of the M + S - 1 ticks of a pass (forward or backward alike). 1F1B reorders work to hold
    fewer activations but leaves the same idle time; only more microbatches (or interleaved stages) shrink it.

        bubble_fraction(4, 8)  # 3 / 11 = 0.2727...
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if n_stages < 1 or n_micro < 1:
        raise ValueError(f"need n_stages >= 1 and n_micro >= 1, got {n_stages=} and {n_micro=}")
    return (n_stages - 1) / (n_micro + n_stages - 1)


def _to_varying(x, axis: str):
    """Mark a per-device value as varying over `axis` (shard_map's type check wants the loop carry's type fixed)."""
    return jax.lax.pcast(x, axis, to="varying")


def check_stages(params: Any, n_stages: int) -> int:
    """The number of layers N stacked on the leading axis of every leaf; ValueError unless S divides N."""
    leaves = jax.tree.leaves(params)
    if not leaves:
        raise ValueError("stage params are empty: pass the per-layer parameters stacked on a leading layers axis")
    sizes = {x.shape[0] if x.ndim else None for x in leaves}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(f"every stage parameter needs the same leading layers axis, found leading sizes {sizes}")
    (n_layers,) = sizes
    check_layers(n_layers, n_stages)
    return n_layers


def check_layers(n_layers: int, n_stages: int) -> None:
    if n_layers % n_stages:
        ok = [s for s in range(1, n_layers + 1) if n_layers % s == 0]
        raise ValueError(
            f"{n_layers} layers do not split over {n_stages} pipeline stages ({n_layers} % {n_stages} = "
            f"{n_layers % n_stages}): use a stage axis size in {ok} or a layer count that is a multiple of {n_stages}"
        )


def gpipe(
    stage_fn: Callable[[Any, jax.Array], jax.Array],
    stage_params: Any,
    x_MxBx: jax.Array,
    mesh: Mesh,
    axis: str = "stage",
    *,
    batch_axes: str | tuple[str, ...] | None = None,
    remat: bool = False,
) -> jax.Array:
    """Run microbatches through S pipeline stages with the GPipe schedule; differentiable.

    Args:
      stage_fn: `(params_of_one_stage, x_Bx...) -> y_Bx...` with y shaped like x. It receives the stage's slice of
        `stage_params` (leading axis N / S) and one microbatch; typically a `lax.scan` over its layers (`scan_stage`).
      stage_params: pytree whose every leaf has a leading layers axis N; S = mesh.shape[axis] must divide N. Stage s
        holds layers [s N / S, (s + 1) N / S).
      x_MxBx: the microbatched input [M, B, ...] (the first stage's input for every microbatch).
      mesh: a mesh with `axis`; other axes can split the rows of each microbatch (`batch_axes`) or stay replicated.
      axis: the mesh axis the stages live on.
      batch_axes: mesh axes that split dim 1 (rows of a microbatch), for data parallelism alongside the pipeline.
      remat: recompute each stage's layers in the backward instead of saving their activations.

    Returns:
      [M, B, ...]: the last stage's output for every microbatch, i.e. all N layers applied in order.

    Example:
      def stage_fn(w_NsxDxD, x_BxD):
          return jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x_BxD, w_NsxDxD)[0]
      y_MxBxD = gpipe(stage_fn, w_NxDxD, x_MxBxD, mesh)
    """
    if axis not in mesh.shape:
        raise ValueError(f"mesh axes {tuple(mesh.shape)} have no pipeline axis {axis!r}")
    n_stages = mesh.shape[axis]
    check_stages(stage_params, n_stages)
    n_micro = x_MxBx.shape[0]
    rows, split = x_MxBx.shape[1], _axes_size(mesh, batch_axes)
    if rows % split:
        raise ValueError(f"{rows} rows per microbatch do not split over {split} devices of mesh axes {batch_axes}: use "
                         f"a batch size that is a multiple of n_micro * {split}")
    ticks = n_micro + n_stages - 1
    body_fn = jax.checkpoint(stage_fn) if remat else stage_fn
    forward = [(s, s + 1) for s in range(n_stages - 1)]  # the last stage sends nothing; stage 0 receives zeros

    def per_stage(params, x_MxBx):
        stage = jax.lax.axis_index(axis)
        x_MxBx = _to_varying(x_MxBx, axis)  # stage 0 reads it; typing it per-stage keeps the carry's type fixed

        def tick(carry, t):
            received, out_MxBx = carry
            # Stage 0 starts microbatch t; later stages continue what their left neighbour sent on the previous tick.
            fresh = jax.lax.dynamic_index_in_dim(x_MxBx, jnp.minimum(t, n_micro - 1), 0, keepdims=False)
            y = body_fn(params, jnp.where(stage == 0, fresh, received))
            # The last stage finishes microbatch t - (S - 1). Before that is real (t < S - 1) the index clips to 0 and
            # the junk written there is overwritten at t = S - 1, so no mask is needed.
            done = jnp.maximum(t - (n_stages - 1), 0)
            out_MxBx = jax.lax.dynamic_update_index_in_dim(out_MxBx, y, done, 0)
            return (jax.lax.ppermute(y, axis, forward), out_MxBx), None

        init = (jnp.zeros_like(x_MxBx[0]), jnp.zeros_like(x_MxBx))
        (_, out_MxBx), _ = jax.lax.scan(tick, init, jnp.arange(ticks))
        return out_MxBx[None]  # [1, M, B, ...]: stacked over stages outside; only the last stage's entry is the result

    rest = (None,) * (x_MxBx.ndim - 2)
    x_spec = P(None, batch_axes, *rest)
    out_spec = P(axis, None, batch_axes, *rest)
    run = _compat.shard_map(per_stage, mesh=mesh, in_specs=(P(axis), x_spec), out_specs=out_spec)
    return run(stage_params, x_MxBx)[-1]


def _axes_size(mesh: Mesh, axes) -> int:
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    size = 1
    for a in axes:
        size *= mesh.shape[a]
    return size


def scan_stage(layer_fn: Callable[[Any, jax.Array], jax.Array]) -> Callable[[Any, jax.Array], jax.Array]:
    """A `gpipe` stage_fn that applies `layer_fn(params_of_one_layer, x) -> x` over the stage's layers in order."""

    def stage_fn(params, x):
        return jax.lax.scan(lambda h, p: (layer_fn(p, h), None), x, params)[0]

    return stage_fn


def split_microbatches(x_Bx: jax.Array, n_micro: int) -> jax.Array:
    """[B, ...] -> [M, B / M, ...] (microbatch m holds rows [m B / M, (m + 1) B / M)); ValueError unless M divides B."""
    B = x_Bx.shape[0]
    if n_micro < 1 or B % n_micro:
        raise ValueError(
            f"batch size {B} does not split into {n_micro} microbatches: use a microbatch count that divides {B} "
            f"or a batch size that is a multiple of {n_micro}"
        )
    return x_Bx.reshape(n_micro, B // n_micro, *x_Bx.shape[1:])
