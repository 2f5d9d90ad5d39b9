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
import numpy as np
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
    """[B, ...] -> [M, B / M, ...], microbatch m taking rows m, m + M, m + 2M...: where the batch is split over
    devices, every microbatch keeps rows of every device (contiguous blocks would leave a microbatch on a few of
    them). The one splitter of the train steps, the shard_map steps and the pipeline. ValueError unless M divides B."""
    B = x_Bx.shape[0]
    if n_micro < 1 or B % n_micro:
        raise ValueError(
            f"batch size {B} does not split into {n_micro} microbatches: use a microbatch count that divides {B} "
            f"or a batch size that is a multiple of {n_micro}"
        )
    return jnp.swapaxes(x_Bx.reshape(B // n_micro, n_micro, *x_Bx.shape[1:]), 0, 1)


# --------------------------------------------------------------------------------------------------------------------
# The pipeline inside a train step: loss and gradients under a schedule (GPipe or 1F1B).
#
# The last stage computes each microbatch's loss as soon as its forward is done, so its backward can start at once
# (that is what lets 1F1B hold fewer activations). Each stage keeps only its *input* for a microbatch between its
# forward and its backward and recomputes the stage's layers in the backward (remat at stage granularity). The ticks
# run in lockstep on every stage: on tick t stage s runs the forward of microbatch `fwd` and the backward of
# microbatch `bwd` of `schedule_ticks`, sends the forward's output to stage s + 1 and the input gradient to s - 1.
#
#   GPipe: all forwards, then all backwards. A stage holds every microbatch's input at once: M stashes.
#   1F1B:  the backward of microbatch i starts on the last stage the tick after its forward and walks back one stage
#          per tick, interleaved with the forwards of later microbatches: a stage holds at most 2 (S - s) inputs.
#
# Both have the same bubble, (S - 1) / (M + S - 1) of a stage's time.


def schedule_ticks(schedule: str, n_stages: int, n_micro: int) -> tuple[int, int]:
    """(ticks of the schedule, stash slots a stage needs: inputs held between a microbatch's forward and backward)."""
    S, M = n_stages, n_micro
    if schedule == "gpipe":
        return 2 * (M + S - 1), M
    if schedule == "1f1b":
        return M + 2 * S - 1, min(M, 2 * S)
    raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")


def describe(schedule: str, n_stages: int, n_micro: int, microbatch_bytes: int) -> str:
    """One line for the start-up log: the schedule, its bubble and the stage inputs it stashes per device.

    `microbatch_bytes`: one microbatch's stage input on one device (rows x positions x d_model x bytes)."""
    _, slots = schedule_ticks(schedule, n_stages, n_micro)
    return (f"pipeline {schedule}: {n_stages} stages x {n_micro} microbatches, bubble "
            f"{bubble_fraction(n_stages, n_micro, schedule):.0%}, stashes {slots} stage inputs of "
            f"{microbatch_bytes / 2**20:.2f} MiB per device ({slots * microbatch_bytes / 2**20:.2f} MiB, before the "
            f"layers' own activations)")


def _tick_plan(schedule: str, t, stage, n_stages: int, n_micro: int):
    """(forward microbatch, backward microbatch) of `stage` on tick t; an index outside [0, M) means none."""
    S, M = n_stages, n_micro
    if schedule == "gpipe":
        fwd = jnp.where(t < M + S - 1, t - stage, -1)
        bwd = (t - (M + S - 1)) - (S - 1 - stage)
        return fwd, bwd
    return t - stage, t - (2 * S - 1 - stage)


def _zero_cotangent(x):
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, jax.dtypes.float0)


def pipeline_value(stage_fn, last_fn, stage_params, last_params, x_MxBx, aux_M, consts=None, *, mesh: Mesh,
                   axis: str = "stage", schedule: str = "1f1b"):
    """(loss sum, token count) of M microbatches through S pipeline stages; differentiable with the schedule's own
    backward (jax.grad of it runs `schedule`, without it only the forward ticks run).

    Args:
      stage_fn: `(params_of_one_stage, x_Bx..., consts) -> y_Bx...` (y shaped like x): the stage's layers.
      last_fn: `(last_params, y_Bx..., aux_of_one_microbatch, consts) -> (loss_sum, count)`: after the last stage.
      stage_params: pytree with a leading layers axis N on every leaf, split over `axis` (S must divide N).
      last_params: pytree used by `last_fn` (the final norm and output projection), replicated over `axis`.
      x_MxBx: [M, B, ...] the first stage's input per microbatch. aux_M: pytree of [M, ...] (targets, masks).
      consts: a pytree every stage reads whole (e.g. the token positions); not differentiated.
      mesh: the mesh; only `axis` is run by hand, every other mesh axis stays with the automatic partitioner, so the
        stage's layers keep their data / fsdp / tensor / seq sharding.
      schedule: "gpipe" or "1f1b".
    """
    if axis not in mesh.shape:
        raise ValueError(f"mesh axes {tuple(mesh.shape)} have no pipeline axis {axis!r}")
    S, M = mesh.shape[axis], x_MxBx.shape[0]
    check_stages(stage_params, S)
    if M < S:
        raise ValueError(f"{M} microbatches for {S} pipeline stages: use at least {S} (microbatches >= stage) so "
                         f"every stage has work")
    ticks, slots = schedule_ticks(schedule, S, M)

    def run(train: bool):
        def body(params, last, x_MxBx, aux_M, consts, stage_index):
            stage = stage_index[0]  # as data: a partition id is ambiguous where only some mesh axes are manual
            is_last = stage == S - 1
            to_next = [(s, s + 1) for s in range(S - 1)]
            to_prev = [(s, s - 1) for s in range(1, S)]
            zero_y = jnp.zeros_like(x_MxBx[0])
            pick = lambda tree, i: jax.tree.map(  # noqa: E731
                lambda a: jax.lax.dynamic_index_in_dim(a, jnp.clip(i, 0, M - 1), 0, keepdims=False), tree)

            # Every stage runs the same program on every tick (results masked where they do not apply): a branch
            # taken by some stages only could hold a collective of another mesh axis (fsdp gathers, tensor sums, the
            # ring of context parallelism) that the other stages never join.
            def forward(i, received, stash):
                x_in = jnp.where(stage == 0, pick(x_MxBx, i), received)
                valid = (i >= 0) & (i < M)
                if stash is not None:
                    slot = jnp.clip(i, 0, M - 1) % slots
                    stash = jnp.where(valid, jax.lax.dynamic_update_index_in_dim(stash, x_in, slot, 0), stash)
                y = stage_fn(params, x_in, consts)
                loss, count = last_fn(last, y, pick(aux_M, i), consts)
                use = (valid & is_last).astype(jnp.float32)
                return y, loss.astype(jnp.float32) * use, count.astype(jnp.float32) * use, stash

            def backward(j, received_ct, stash):
                valid = ((j >= 0) & (j < M)).astype(jnp.float32)
                x_in = jax.lax.dynamic_index_in_dim(stash, jnp.clip(j, 0, M - 1) % slots, 0, keepdims=False)
                last_w = is_last.astype(jnp.float32)

                def objective(p, lp, x):
                    # On the last stage the microbatch's loss; elsewhere <y, cotangent from the next stage>: its
                    # gradient is the vjp of the stage with that cotangent.
                    y = stage_fn(p, x, consts)
                    loss = last_fn(lp, y, pick(aux_M, j), consts)[0].astype(jnp.float32)
                    passed = jnp.sum((y * received_ct).astype(jnp.float32))
                    return last_w * loss + (1.0 - last_w) * passed

                dp, dl, dx = jax.grad(objective, argnums=(0, 1, 2))(params, last, x_in)
                mask = lambda tree: jax.tree.map(lambda a: (a * valid).astype(a.dtype), tree)  # noqa: E731
                return mask(dp), mask(dl), mask(dx)

            def tick(carry, t):
                fwd_i, bwd_j = _tick_plan(schedule, t, stage, S, M)
                if train:
                    recv_f, recv_b, stash, d_p, d_l, dx_M, loss, count = carry
                else:
                    recv_f, loss, count = carry
                    stash = None
                y, l_i, c_i, stash = forward(fwd_i, recv_f, stash)
                loss, count = loss + l_i, count + c_i
                if not train:
                    return (jax.lax.ppermute(y, axis, to_next), loss, count), None
                dp, dl, dx = backward(bwd_j, recv_b, stash)
                d_p = jax.tree.map(jnp.add, d_p, dp)
                d_l = jax.tree.map(jnp.add, d_l, dl)
                valid_b = (bwd_j >= 0) & (bwd_j < M)
                keep = valid_b & (stage == 0)
                dx_M = jnp.where(keep, jax.lax.dynamic_update_index_in_dim(dx_M, dx, jnp.clip(bwd_j, 0, M - 1), 0),
                                 dx_M)
                carry = (jax.lax.ppermute(y, axis, to_next), jax.lax.ppermute(dx, axis, to_prev), stash, d_p, d_l,
                         dx_M, loss, count)
                return carry, None

            zero = jnp.zeros((), jnp.float32)
            if not train:
                (_, loss, count), _ = jax.lax.scan(tick, (zero_y, zero, zero), jnp.arange(M + S - 1))
                return loss[None], count[None]
            stash = jnp.zeros((slots, *x_MxBx.shape[1:]), x_MxBx.dtype)
            init = (zero_y, zero_y, stash, jax.tree.map(jnp.zeros_like, params),
                    jax.tree.map(jnp.zeros_like, last), jnp.zeros_like(x_MxBx), zero, zero)
            (_, _, _, d_p, d_l, dx_M, loss, count), _ = jax.lax.scan(tick, init, jnp.arange(ticks))
            # Per-stage results leave stacked on a leading stage axis and are summed outside, by the partitioner: only
            # one stage holds each of them (the last the loss and head gradients, the first the input gradients).
            stacked = lambda tree: jax.tree.map(lambda a: a[None], tree)  # noqa: E731
            return loss[None], count[None], d_p, stacked(d_l), dx_M[None]

        rep = P()
        stage_spec = jax.tree.map(lambda _: P(axis), stage_params)
        last_spec = jax.tree.map(lambda _: rep, last_params)
        aux_spec = jax.tree.map(lambda _: rep, aux_M)
        const_spec = jax.tree.map(lambda _: rep, consts)
        per_stage = P(axis)
        out = ((per_stage, per_stage, stage_spec, jax.tree.map(lambda _: per_stage, last_params), per_stage) if train
               else (per_stage, per_stage))
        run_body = _compat.shard_map(body, mesh=mesh, in_specs=(stage_spec, last_spec, rep, aux_spec, const_spec,
                                                                 P(axis)), out_specs=out, check_vma=False,
                                     axis_names={axis})

        def call(*args):
            outs = run_body(*args, jnp.arange(S, dtype=jnp.int32))
            total = lambda tree: jax.tree.map(lambda a: jnp.sum(a, axis=0), tree)  # noqa: E731
            if not train:
                return total(outs)
            loss, count, d_p, d_l, dx = outs
            return total(loss), total(count), d_p, total(d_l), total(dx)

        return call

    @jax.custom_vjp
    def value(stage_params, last_params, x_MxBx, aux_M, consts):
        return run(False)(stage_params, last_params, x_MxBx, aux_M, consts)

    def value_fwd(stage_params, last_params, x_MxBx, aux_M, consts):
        loss, count, d_p, d_l, dx = run(True)(stage_params, last_params, x_MxBx, aux_M, consts)
        return (loss, count), (d_p, d_l, dx, aux_M, consts)

    def value_bwd(res, cts):
        d_p, d_l, dx, aux_M, consts = res
        g = cts[0]  # the count does not depend on any input
        scale = lambda tree: jax.tree.map(lambda a: (a * g).astype(a.dtype), tree)  # noqa: E731
        zero = lambda tree: jax.tree.map(_zero_cotangent, tree)  # noqa: E731
        return scale(d_p), scale(d_l), scale(dx), zero(aux_M), zero(consts)

    value.defvjp(value_fwd, value_bwd)
    return value(stage_params, last_params, x_MxBx, aux_M, consts)
