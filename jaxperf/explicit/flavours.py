"""The train step with its collectives written out by hand: shard_map and pmap twins of the jit step.

`parallel.flavour` picks how the one train step of jaxperf.step.task is written. All flavours give the same numbers
(tests/test_flavours.py checks them against a single-device jit step) and the same checkpoints:

  jit        GSPMD: the step is written for one big device and XLA derives every collective from the shardings of the
             rule table. Runs every strategy.
  shard_map  the body sees each device's block and names each collective itself.
             dp: parameters and optimizer state replicated, the batch split over the data-parallel axes. Each device
               differentiates its own rows, `lax.pmean` averages the gradients, and every device applies the same
               optimizer update to its own copy; the whole step runs inside the shard_map.
             fsdp (ZeRO-3): each device stores 1/n of every parameter and of its optimizer moments, placed exactly as
               the jit fsdp strategy places them (the rule table's `embed` dim over `fsdp`). Each layer's weights are
               all-gathered (`lax.all_gather(..., tiled=True)` along the sharded dim) when that layer runs, inside
               the scan over layers (the model hands them over through its `hooks.layer_params`, see
               jaxperf.models.hooks), and autodiff turns each
               gather into a reduce-scatter (`lax.psum_scatter`) inside the backward scan, so each device ends with
               the batch-summed gradient of exactly the shard it stores, layer by layer; the embeddings are
               gathered before and reduce-scattered after (norm scales are whole: their gradients are
               `lax.psum`med). (A model without stacked layers under `blocks`
               gets all its parameters gathered at once.) A parameter whose dims do not divide stays whole and its
               gradient is `lax.psum`med. The optimizer update is then applied in the
               jit around the shard_map, to shards that live where their gradients do: it is elementwise, so each
               device updates only its 1/n, and its one global quantity (the gradient norm for clipping) becomes a
               scalar all-reduce. Doing the update inside the shard_map would let clip_by_global_norm see one shard's
               norm only.
             tp (Megatron), also with dp or fsdp: each device keeps its own attention heads, KV heads and MLP columns
               (the dims the rule table puts on `tensor`) and runs the layers on them; the attention-output and
               MLP-output matmuls then hold partial sums, which the layers add up with `lax.psum` over `tensor`
               (the step installs `hooks.row_parallel` = psum over `tensor`). Autodiff under shard_map's replication
               check puts the matching psum of the input gradient into the backward by itself. A parameter the rule
               table splits over `tensor` on any other dim (the embedding's vocabulary) enters whole and its gradient
               leaves whole.
               A custom model runs this flavour only if its row-parallel layers call `hooks.row_parallel`.
  pmap       data parallelism the classic way, one process: the state carries a leading device axis, `jax.pmap` runs
             the same per-device step as shard_map dp. `FlavouredStep.to_step` / `from_step` convert at the boundary,
             so the Trainer checkpoints, evaluates and logs the usual state.

Both register with jaxperf.step.flavours, where every run gets its step (`build_train_step`). Their checks
refuse, before compiling, what a flavour cannot run: pmap anything but replicated parameters;
shard_map parameters split over other mesh axes, or tensor parallelism whose head or MLP dims do not divide evenly.

Weighting: as in the jit step, a device's gradient of its mean loss is multiplied by its number of unmasked tokens,
summed over devices and microbatches, and divided by the global token count, so unequal masks across devices and
microbatches still give the gradient of one big batch. Microbatches split each device's own rows (row i, i+k, ...).

Autodiff inside shard_map would sum the gradient of a replicated (device-invariant) input over the devices by itself.
The steps here first mark the parameters as per-device values (`lax.pcast(..., to="varying")`), so every reduction
happens in a collective written below; shard_map's replication check then proves the result: leave out the pmean and
the step no longer traces, because its parameters would differ between devices.

    step = build_train_step(task, next_token_loss, "shard_map", microbatches=2, schedule=sched)
    state = step.to_step(task.init_state())        # the identity except for pmap
    state, metrics = step(state, batch)            # batch placed with task.batch_sharding()
    state = step.from_step(state)                  # back to task.state_shardings(), e.g. for a checkpoint

Legend: n devices on the data-parallel axes, B global batch rows, b = B / n rows per device, k microbatches.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxperf import _compat
from jaxperf.config import ConfigError
from jaxperf.models.hooks import LayerHooks
from jaxperf.parallel.pipeline import split_microbatches
from jaxperf.parallel.rules import logical_to_spec
from jaxperf.parallel.sharding import replicated
from jaxperf.step.flavours import FlavouredStep, build_train_step, check_flavour, register_flavour
from jaxperf.step.task import LossFn, Task, TrainState, accumulate_microbatches, finish_step

PMAP_AXIS = "replica"  # the axis name the pmap step reduces over
TENSOR_AXIS = "tensor"
# Logical dims that stay split over the tensor axis inside the shard_map body: each device runs its own heads and MLP
# columns (Megatron). Any other dim the rule table puts on the tensor axis is gathered at the shard_map boundary.
TENSOR_LOCAL = frozenset({"heads", "kv_heads", "mlp"})


def _identity(x):
    return x


# --------------------------------------------------------------------------------------------------------------------
# Layout helpers


def _axes_of(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, a name, or a tuple of names)."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _spec_axes(spec: P) -> set[str]:
    return {a for entry in spec for a in _axes_of(entry)}


def data_axes(task: Task) -> tuple[str, ...]:
    """The mesh axes (larger than 1) that the batch dim is split over, in mesh order: the data-parallel axes."""
    spec = logical_to_spec(("batch",), task.rules.activations, task.mesh)
    return _axes_of(spec[0]) if len(spec) else ()


def _batch_spec(axes: tuple[str, ...]) -> P:
    if not axes:
        return P()
    return P(axes[0] if len(axes) == 1 else axes)


def _flat_by_path(tree, is_leaf=None) -> dict[str, Any]:
    """{"blocks/attn/wq_DxHxDh": leaf, ...} of a parameter-shaped tree."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
    return {"/".join(str(getattr(k, "key", k)) for k in path): leaf for path, leaf in leaves}


def _flat_specs(task: Task) -> list[tuple[str, P]]:
    return [(path, s.spec) for path, s in _flat_by_path(task.param_shardings).items()]


def _entry(names: tuple[str, ...]):
    return None if not names else names[0] if len(names) == 1 else names


def _body_specs(task: Task):
    """Per parameter (two trees like `task.param_shardings`): the spec of the block each device holds inside the
    shard_map body (tensor kept only on TENSOR_LOCAL dims), and that spec's data-parallel part (what the body
    gathers and reduce-scatters)."""

    def one(sharding, logical):
        logical = tuple(logical or ())
        inner, data = [], []
        for dim, entry in enumerate(sharding.spec):
            local = dim < len(logical) and logical[dim] in TENSOR_LOCAL
            keep = tuple(a for a in _axes_of(entry) if a != TENSOR_AXIS or local)
            inner.append(_entry(keep))
            data.append(_entry(tuple(a for a in keep if a != TENSOR_AXIS)))
        return P(*inner), P(*data)

    pairs = jax.tree.map(one, task.param_shardings, task.param_axes)
    is_pair = lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], P)  # noqa: E731
    return (jax.tree.map(lambda pr: pr[0], pairs, is_leaf=is_pair),
            jax.tree.map(lambda pr: pr[1], pairs, is_leaf=is_pair))


def _check_tensor_split(task: Task) -> None:
    """Megatron under shard_map needs every heads / kv_heads / mlp dim split over `tensor`, and split over it alone."""
    t = task.mesh.shape.get(TENSOR_AXIS, 1)
    if t == 1:
        return
    flat_axes = _flat_by_path(task.param_axes, is_leaf=lambda x: x is None or isinstance(x, tuple))
    shapes = {path: v.shape for path, v in _flat_by_path(task.abstract_params).items()}
    for path, spec in _flat_specs(task):
        logical = tuple(flat_axes.get(path) or ())
        for dim, name in enumerate(logical):
            if name not in TENSOR_LOCAL:
                continue
            names = _axes_of(spec[dim]) if dim < len(spec) else ()
            size = shapes.get(path, (None,) * len(logical))[dim]
            if names != (TENSOR_AXIS,):
                why = (f"its {size} {name} do not divide over tensor={t}" if TENSOR_AXIS not in names
                       else f"it is split over {names}, not over tensor alone")
                raise ConfigError(
                    f"flavour=shard_map needs every {name} dim split over tensor alone, but parameter {path} ({spec}): "
                    f"{why}; "
                    f"make heads, KV heads and MLP width divide by tensor={t}, or use parallel.flavour=jit")


def _check_by_hand(flavour: str, task: Task) -> None:
    """Raise ConfigError, before anything compiles, when `flavour` (shard_map or pmap) cannot run the task's rule table
    on its mesh: shard_map runs parameters sharded over data-parallel axes and `tensor` (dp, fsdp, tp, fsdp_tp); pmap
    runs replicated parameters only, in one process."""
    data = set(data_axes(task))
    allowed = data | ({TENSOR_AXIS} if flavour == "shard_map" else set())
    for path, spec in _flat_specs(task):
        other = sorted(_spec_axes(spec) - allowed)
        if other:
            kinds = "dp, fsdp, tp and fsdp_tp" if flavour == "shard_map" else "dp"
            raise ConfigError(
                f"flavour={flavour} supports strategies {kinds}, but strategy {task.rules.name!r} splits parameter "
                f"{path} ({spec}) over {', '.join(other)}, which is neither a data-parallel axis nor "
                f"{'tensor' if flavour == 'shard_map' else 'replicated'}: use parallel.flavour=jit"
            )
    if flavour == "shard_map":
        _check_tensor_split(task)
    if flavour == "pmap":
        sharded = [path for path, spec in _flat_specs(task) if _spec_axes(spec)]
        if sharded:
            raise ConfigError(
                f"flavour=pmap keeps a whole copy of every parameter on each device (strategy dp), but strategy "
                f"{task.rules.name!r} shards {len(sharded)} of them (e.g. {sharded[0]}): use "
                f"parallel.flavour=shard_map or jit for {task.rules.name}"
            )
        if jax.process_count() > 1:
            raise ConfigError(f"flavour=pmap runs in one process, not {jax.process_count()}: use parallel.flavour="
                              f"shard_map or jit for multi-process runs")


def _cast_varying(x, axes: tuple[str, ...]):
    """Mark `x` as a per-device value over `axes`, so that its gradient stays per device until we reduce it."""
    axes = tuple(a for a in axes if a not in _compat.varying_axes(x))
    return lax.pcast(x, axes, to="varying") if axes else x


def _varying_like(x, like):
    """`x` marked per-device over every mesh axis `like` varies over (a tp block also varies over `tensor`)."""
    return _cast_varying(x, tuple(sorted(_compat.varying_axes(like))))


def _gather(shard, spec: P):
    """The whole parameter from this device's shard: all-gather along every sharded dim."""
    for dim, entry in enumerate(spec):
        if _axes_of(entry):
            shard = lax.all_gather(shard, _axes_of(entry), axis=dim, tiled=True)
    return shard


def _sum_over(x, axes: tuple[str, ...]):
    return lax.psum(x, axes) if axes else x


def _reduce_scatter(grad, spec: P, axes: tuple[str, ...]):
    """Sum a whole-parameter gradient over the data-parallel `axes`, keeping only this device's shard of it."""
    scattered: set[str] = set()
    for dim, entry in enumerate(spec):
        if _axes_of(entry):
            grad = lax.psum_scatter(grad, _axes_of(entry), scatter_dimension=dim, tiled=True)
            scattered.update(_axes_of(entry))
    rest = tuple(a for a in axes if a not in scattered)
    return lax.psum(grad, rest) if rest else grad


# --------------------------------------------------------------------------------------------------------------------
# Per-device pieces shared by the flavours


class _CountingHooks:
    """LayerHooks whose `layer_params` counts its calls: a model that never calls it cannot run the flavour."""

    def __init__(self, layer_params):
        self.calls = 0

        def counted(params):
            self.calls += 1
            return layer_params(params)

        self.hooks = LayerHooks(layer_params=counted)


def _local_grads(task: Task, loss_fn: LossFn, params, model_state, batch, scale, microbatches: int, vary,
                 weighted: bool = False, hooks: LayerHooks | None = None):
    """This device's (Σ grads·w, Σ w, Σ loss·w, model state) over its k microbatches, with no communication.

    `params` must already be per-device values; `vary` marks a fresh constant as one (the accumulators). With
    `weighted` the loss is multiplied by its weight before differentiating (needed when a collective inside the
    backward sums gradients across devices, so that it sums weighted ones); the result is the same. `hooks` are
    installed on the model (jaxperf.models.hooks).
    """

    def scaled_loss(model, mb, s):
        loss, aux = loss_fn(model, mb)
        if weighted:
            loss = loss * jnp.asarray(aux.get("weight", 1.0), jnp.float32)
        return loss * s, aux

    def weigh(loss, w, g):  # (loss·w, grads·w) of one microbatch
        return (loss, g) if weighted else (loss * w, jax.tree.map(lambda x: x * w, g))

    zero = vary(jnp.zeros((), jnp.float32))
    if microbatches == 1:
        loss, w, _, model_state, g = task._grads(scaled_loss, params, model_state, batch, scale, hooks)
        lw, gw = weigh(loss, w, g)
        # `zero +` keeps a weight that does not depend on the rows (a loss without aux["weight"]) per device too.
        return gw, zero + w, zero + lw, model_state

    rows = jax.tree.leaves(batch)[0].shape[0]
    if rows % microbatches:
        raise ConfigError(f"each device holds {rows} rows of the batch, which do not split into microbatches="
                          f"{microbatches}: make batch_size a multiple of microbatches * the data-parallel size")

    def grads_of(ms, mb):
        loss, w, _, ms, g = task._grads(scaled_loss, params, ms, mb, scale, hooks)
        return loss, w, ms, g

    # Microbatch i takes this device's rows i, i+k, i+2k...
    zeros = jax.tree.map(lambda p: _varying_like(jnp.zeros(p.shape, p.dtype), p), params)
    return accumulate_microbatches(grads_of, jax.tree.map(lambda x: split_microbatches(x, microbatches), batch),
                                   zeros, zero, model_state, weigh=weigh)


def _loss_scale(task: Task, state: TrainState):
    return state.health["loss_scale"] if task.health.loss_scale else jnp.ones((), jnp.float32)


def _stacked_layers(task: Task) -> bool:
    """Whether the task's model keeps its layers stacked under `task.layer_stack` (a scanned model)."""
    key = task.layer_stack
    axes = task.param_axes.get(key) if key and isinstance(task.param_axes, dict) else None
    leaves = jax.tree.leaves(axes, is_leaf=lambda x: x is None or isinstance(x, tuple)) if axes else []
    return bool(leaves) and all(isinstance(a, tuple) and a[:1] == ("layers",) for a in leaves)


def _per_layer_fsdp_grads(task, loss_fn, param_blocks, model_state, batch, scale, microbatches, data_specs, axes,
                          vary, whole, missing):
    """fsdp under shard_map with the layers' weights gathered inside the layer scan, as each layer runs.

    The layers' parameters stay shards; the model's `hooks.layer_params` (called for every layer) all-gathers that
    layer's slice. Autodiff transposes each all-gather into a reduce-scatter inside the backward scan, so every
    layer's gradient leaves the backward already summed over `fsdp` and cut to this device's shard; what is left is
    a psum over data-parallel axes the parameter is not sharded over. The loss is weighted before differentiating so
    those in-backward sums are sums of weighted gradients. Everything else split (the embeddings) is gathered whole
    up front and reduce-scattered after, as in the all-at-once path.
    """
    key = task.layer_stack
    layer_specs = jax.tree.map(lambda spec: P(*tuple(spec)[1:]), data_specs[key],
                               is_leaf=lambda x: isinstance(x, P))
    spec_leaves = jax.tree.leaves(layer_specs, is_leaf=lambda x: isinstance(x, P))

    def gather_layer(layer_params):
        leaves, treedef = jax.tree.flatten(layer_params)
        if len(leaves) != len(spec_leaves):
            raise ValueError(f"hooks.layer_params got {len(leaves)} arrays for a layer whose parameters under "
                             f"{key!r} are {len(spec_leaves)}")
        return jax.tree.unflatten(treedef, [_gather(x, sp) for x, sp in zip(leaves, spec_leaves)])

    params = {k: (jax.tree.map(lambda b, spec: _cast_varying(b, missing(spec)), v, data_specs[k])
                  if k == key else jax.tree.map(whole, v, data_specs[k]))
              for k, v in param_blocks.items()}
    hooks = _CountingHooks(gather_layer)
    g, w, l, model_state = _local_grads(task, loss_fn, params, model_state, batch, scale, microbatches, vary,
                                        weighted=True, hooks=hooks.hooks)
    if hooks.calls == 0:
        raise ConfigError(f"the model keeps stacked layers under {key!r} but never passed them through its "
                          f"hooks.layer_params (jaxperf.models.hooks), so fsdp under shard_map cannot gather them")
    g = {k: (jax.tree.map(lambda x, spec: _sum_over(x, missing(spec)), v, data_specs[k]) if k == key
             else jax.tree.map(lambda x, spec: _reduce_scatter(x, spec, axes), v, data_specs[k]))
         for k, v in g.items()}
    return g, _sum_over(w, axes), _sum_over(l, axes), model_state


def _psum_in_backward(axes: tuple[str, ...]):
    """Identity on a layer's parameters whose backward sums their gradient over `axes` right away: the all-reduce of
    layer i's gradients is issued as soon as layer i's backward is done, while layers i-1, i-2, ... still compute."""

    @jax.custom_vjp
    def reduce(params):
        return params

    def bwd(_, g):
        return (jax.tree.map(lambda x: lax.psum(x, axes), g),)

    reduce.defvjp(lambda params: (params, None), bwd)
    return reduce


def _replicated_step(task: Task, loss_fn: LossFn, *, axes, microbatches: int, schedule, vary,
                     overlap_grad_reduce: bool = False):
    """The data-parallel step one device runs (under shard_map or pmap): local grads, pmean, the same update.

    With `overlap_grad_reduce` each layer's gradients are summed inside the backward pass (one all-reduce per layer,
    a bucket each) and the rest (embeddings, final norm) after it; the loss is weighted by the device's token count
    before differentiating, so the sums are the same weighted sums the pmean path forms."""
    pmean = (lambda x: lax.pmean(x, axes)) if axes else _identity  # no axes: a one-device mesh
    psum = lambda x: _sum_over(x, axes)  # noqa: E731

    def overlapped(state: TrainState, batch, scale):
        params = vary(state.params)
        key = task.layer_stack
        hooks = _CountingHooks(_psum_in_backward(axes))
        g, w, lw, model_state = _local_grads(task, loss_fn, params, state.model_state, batch, scale, 1, vary,
                                             weighted=True, hooks=hooks.hooks)
        if hooks.calls == 0 or not isinstance(g, dict) or key not in g:
            raise ConfigError(
                f"parallel.overlap_grad_reduce needs a model whose stacked layers pass through hooks.layer_params "
                f"(jaxperf.models.hooks; the built-in GPT does); this one "
                f"{'never called it' if hooks.calls == 0 else 'has no ' + repr(key)}")
        g = {k: (v if k == key else jax.tree.map(psum, v)) for k, v in g.items()}
        return g, psum(w), psum(lw), model_state  # sums over devices of grads x w, w, loss x w (all times scale)

    def step(state: TrainState, batch):
        scale = _loss_scale(task, state)
        if overlap_grad_reduce:
            g, w_sum, l_sum, model_state = overlapped(state, batch, scale)
            grads = jax.tree.map(lambda x: x / (w_sum * scale), g)
            return finish_step(task.tx, task.health, state, grads, l_sum / (w_sum * scale), w_sum, model_state,
                               schedule)
        params = vary(state.params)  # this device's copy: its gradient stays local until the pmean below
        g, w, l, model_state = _local_grads(task, loss_fn, params, state.model_state, batch, scale, microbatches, vary)
        w_mean = pmean(w)
        grads = jax.tree.map(lambda x: pmean(x) / (w_mean * scale), g)
        loss = pmean(l) / (w_mean * scale)
        tokens = psum(w)
        return finish_step(task.tx, task.health, state, grads, loss, tokens, model_state, schedule)

    return step


# --------------------------------------------------------------------------------------------------------------------
# Step builders


def shard_map_train_step(task: Task, loss_fn: LossFn, *, microbatches: int = 1, schedule=None,
                         donate: bool = True, overlap_grad_reduce: bool = False) -> FlavouredStep:
    """The step under shard_map: dp when the rule table replicates every parameter, fsdp (ZeRO-3) when it shards them
    over data-parallel axes, Megatron tp when it splits heads and MLP columns over `tensor` (alone or with either).
    State and batch are laid out as for `task.train_step` (same shardings, same checkpoints).

    Args:
      task: a Task whose rule table maps parameters onto data-parallel axes and `tensor` (strategies dp, fsdp, tp,
        fsdp_tp).
      loss_fn: `(model, batch) -> (mean_loss, aux)`, as for `Task.train_step`.
      microbatches: k; each device splits its b rows into k sequential microbatches (b % k == 0).
      schedule: the learning-rate schedule, reported as metrics["lr"].
      overlap_grad_reduce: dp only, one microbatch: all-reduce each layer's gradients inside the backward pass, as
        soon as that layer's backward is done (a bucket per layer), instead of all of them after it.
    Returns:
      a FlavouredStep whose `(state, batch) -> (state, metrics)` is jitted with the jit step's shardings.
    """
    _check_by_hand("shard_map", task)
    mesh, axes = task.mesh, data_axes(task)
    vary_all = lambda tree: jax.tree.map(lambda x: _cast_varying(x, axes), tree)  # noqa: E731
    body_specs, data_specs = _body_specs(task)  # the block each device holds; its data-parallel part
    batch_spec = _batch_spec(axes)
    tensor_parallel = any(TENSOR_AXIS in _spec_axes(spec) for spec in jax.tree.leaves(body_specs))
    sharded = tensor_parallel or any(_spec_axes(spec) for spec in jax.tree.leaves(data_specs))

    if overlap_grad_reduce and (sharded or microbatches != 1):
        raise ConfigError(
            f"parallel.overlap_grad_reduce runs with strategy dp and one microbatch, not strategy "
            f"{task.rules.name!r} with microbatches={microbatches}: set strategy=dp microbatches=1, or drop it")
    state_shardings = task.state_shardings()  # after the checks: it evaluates the optimizer's init
    if not sharded and overlap_grad_reduce:
        # A layer's gradient is summed inside the backward, so in the replication check's terms the parameters' own
        # gradients would have to change type from per-device to replicated half-way through autodiff; the check
        # is off for this body and the test suite proves the numbers instead (tests/test_flavours.py).
        body = _replicated_step(task, loss_fn, axes=axes, microbatches=microbatches, schedule=schedule,
                                vary=_identity, overlap_grad_reduce=True)
        step = _compat.shard_map(body, mesh=mesh, in_specs=(P(), batch_spec), out_specs=(P(), P()), check_vma=False)
    elif not sharded:  # dp: the whole step per device
        body = _replicated_step(task, loss_fn, axes=axes, microbatches=microbatches, schedule=schedule,
                                vary=vary_all)
        step = _compat.shard_map(body, mesh=mesh, in_specs=(P(), batch_spec), out_specs=(P(), P()))
    else:  # fsdp and/or tp: gather, local grads, reduce-scatter; the update on the shards outside

        per_layer = not tensor_parallel and _stacked_layers(task)

        def missing(spec):  # data-parallel axes a parameter is not sharded over: its gradient is psummed there
            return tuple(a for a in axes if a not in _spec_axes(spec))

        def grads_body(param_blocks, model_state, batch, scale):
            def whole(block, spec):  # whole over the data-parallel axes; tp blocks stay this device's own
                return _cast_varying(_gather(block, spec), missing(spec))

            if per_layer:  # ZeRO-3 proper: each layer's weights gathered when the layer runs, one layer at a time
                return _per_layer_fsdp_grads(task, loss_fn, param_blocks, model_state, batch, scale, microbatches,
                                             data_specs, axes, vary_all, whole, missing)
            params = jax.tree.map(whole, param_blocks, data_specs)
            hooks = LayerHooks(row_parallel=lambda y: lax.psum(y, TENSOR_AXIS)) if tensor_parallel else None
            g, w, l, model_state = _local_grads(task, loss_fn, params, model_state, batch, scale, microbatches,
                                                vary_all, hooks=hooks)
            g = jax.tree.map(lambda x, spec: _reduce_scatter(x, spec, axes), g, data_specs)
            return g, _sum_over(w, axes), _sum_over(l, axes), model_state

        sharded_grads = _compat.shard_map(grads_body, mesh=mesh, in_specs=(body_specs, P(), batch_spec, P()),
                                          out_specs=(body_specs, P(), P(), P()))

        def step(state: TrainState, batch):
            scale = _loss_scale(task, state)
            g, w, l, model_state = sharded_grads(state.params, state.model_state, batch, scale)
            grads = jax.tree.map(lambda x: x / (w * scale), g)
            return finish_step(task.tx, task.health, state, grads, l / (w * scale), w, model_state, schedule)

    jitted = jax.jit(step, in_shardings=(state_shardings, task.batch_sharding()),
                     out_shardings=(state_shardings, replicated(mesh)), donate_argnums=(0,) if donate else (),
                     compiler_options=task.compiler_options or None)
    return FlavouredStep("shard_map", jitted)


def pmap_train_step(task: Task, loss_fn: LossFn, *, microbatches: int = 1, schedule=None,
                    donate: bool = True) -> FlavouredStep:
    """Data parallelism with jax.pmap over the task's mesh devices (strategy dp, one process).

    Inside, the state has a leading device axis: `to_step` stacks a replicated TrainState into it, `from_step` takes
    replica 0 back to `task.state_shardings()`. The batch is given as for the jit step (rows over the data-parallel
    axes) and regrouped per device as [n, b, ...] without moving data; metrics come back as scalars.
    """
    _check_by_hand("pmap", task)
    if task.compiler_options:
        raise ConfigError(f"compiler_options ({', '.join(task.compiler_options)}) are given to jax.jit; the pmap step "
                          f"takes none: use the shard_map (or jit) flavour for the same data-parallel step")
    devices = list(task.mesh.devices.flat)
    n = len(devices)
    stacked = NamedSharding(_compat.make_mesh((n,), (PMAP_AXIS,), devices=devices), P(PMAP_AXIS))
    body = _replicated_step(task, loss_fn, axes=PMAP_AXIS, microbatches=microbatches, schedule=schedule,
                            vary=_identity)
    pstep = jax.pmap(body, axis_name=PMAP_AXIS, devices=devices, donate_argnums=(0,) if donate else ())
    state_shardings = task.state_shardings()

    def per_device(x):
        """[n, ...] whose slice i is the block device i holds: a replica of the state, or its rows of the batch."""
        by_device = {s.device: s.data for s in x.addressable_shards}
        pieces = [jnp.expand_dims(by_device[d], 0) for d in devices]
        return jax.make_array_from_single_device_arrays((n, *pieces[0].shape[1:]), stacked, pieces)

    def to_step(state: TrainState):
        return jax.tree.map(per_device, jax.device_put(state, state_shardings))

    def from_step(state) -> TrainState:
        replica = jax.tree.map(lambda x: x.addressable_shards[0].data[0], state)
        return jax.device_put(replica, state_shardings)

    def prepare_batch(batch):
        return jax.tree.map(per_device, jax.device_put(batch, task.batch_sharding()))

    def finish_metrics(metrics):
        return jax.tree.map(lambda m: m.addressable_shards[0].data[0], metrics)

    return FlavouredStep("pmap", pstep, to_step, from_step, prepare_batch, finish_metrics)


register_flavour("shard_map", shard_map_train_step, lambda task: _check_by_hand("shard_map", task),
                 options=("overlap_grad_reduce",))
register_flavour("pmap", pmap_train_step, lambda task: _check_by_hand("pmap", task))

__all__ = ["FlavouredStep", "build_train_step", "check_flavour", "pmap_train_step", "shard_map_train_step"]
