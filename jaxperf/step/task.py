"""The one train step: any Flax NNX module, any loss, any mesh and rule table.

    task = Task.create(lambda rngs: GPT(cfg.model, rngs=rngs), mesh, get_rules("fsdp_tp"), tx, seed=0)
    state = task.init_state()                       # parameters and optimizer state born sharded
    step = task.train_step(next_token_loss, microbatches=4)
    state, metrics = step(state, batch)             # jitted with shardings, state donated

The step is pure `(state, batch) -> (state, metrics)`. Parameters live in `state.params` as a plain nested dict (the
pure-dict form of the module's `nnx.Param`s) so optax, Orbax and sharding trees all see ordinary pytrees; the module
is rebuilt from it inside the trace with `nnx.merge`, which costs nothing at run time. Non-parameter module state
(RNG counters, batch statistics) rides along in `state.model_state` and is updated by the loss function's calls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jaxperf import _compat
from jaxperf.parallel.rules import Rules, activation_sharding, logical_to_spec
from jaxperf.parallel.sharding import batch_sharding, replicated, tree_shardings
from jaxperf.step.health import HealthOptions, all_finite, init_health, is_spike, select, update_health

LossFn = Callable[[nnx.Module, dict[str, jax.Array]], tuple[jax.Array, dict[str, jax.Array]]]


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: number of updates applied
    params: Any  # nested dict of arrays (the module's nnx.Param values)
    opt_state: Any  # optax state
    model_state: Any  # nnx.State of non-parameter variables (often empty)
    health: Any  # skip counters, loss scale, recent losses (jaxperf.step.health)


def _global_norm(tree) -> jax.Array:
    tree_api = getattr(optax, "tree", None)
    return tree_api.norm(tree) if hasattr(tree_api, "norm") else optax.global_norm(tree)


def _param_axes(abstract_params: nnx.State) -> Any:
    """Pure-dict tree of logical-axis tuples (None where a parameter carries no annotation)."""
    axes = jax.tree.map(_compat.variable_logical_axes, abstract_params, is_leaf=lambda v: isinstance(v, nnx.Variable))
    return nnx.to_pure_dict(axes) if isinstance(axes, nnx.State) else axes


def finish_step(tx, opts: HealthOptions, state: TrainState, grads, loss, tokens, model_state, schedule=None):
    """The end of every step flavour: optimizer update, the numerical-health select, and the metrics.

    `grads` and `loss` are the final (averaged, unscaled) values and `tokens` the batch weight; the jit step calls it
    on global arrays, the explicit-collective steps (jaxperf.explicit.flavours) on per-device values that are already
    reduced. Returns (new TrainState, metrics).
    """
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    finite = all_finite(grads) & jnp.isfinite(loss)
    ok = jnp.logical_not(is_spike(state.health, loss, opts))
    if opts.skip_nonfinite or opts.loss_scale:
        ok = ok & finite
    params = select(ok, params, state.params)
    opt_state = select(ok, opt_state, state.opt_state)
    model_state = select(ok, model_state, state.model_state)
    health = update_health(state.health, ok=ok, finite=finite, loss=loss, opts=opts)
    metrics = {
        "loss": loss,
        "grad_norm": _global_norm(grads),
        "tokens": tokens,
        "skipped": jnp.logical_not(ok).astype(jnp.int32),
        "consecutive_skips": health["consecutive"],
        "loss_scale": state.health["loss_scale"],
    }
    if schedule is not None:
        metrics["lr"] = schedule(state.step)
    return TrainState(state.step + 1, params, opt_state, model_state, health), metrics


def decay_mask(params_axes: Any, abstract_params: Any) -> Any:
    """True where AdamW should decay: weight matrices and embeddings, not norms or biases.

    A parameter is not decayed when its name starts with `bias` or `scale` (Flax's and jaxperf's naming), or when it
    has fewer than two dims besides a scanned `layers` axis.
    """

    def decays(path, axes, x):
        name = str(getattr(path[-1], "key", getattr(path[-1], "name", path[-1]))) if path else ""
        if name.startswith(("bias", "scale")):
            return False
        if axes is None:
            return x.ndim >= 2
        return sum(1 for a in axes if a != "layers") >= 2

    return jax.tree_util.tree_map_with_path(
        decays, params_axes, abstract_params, is_leaf=lambda a: isinstance(a, tuple) or a is None
    )


@dataclass
class Task:
    """A model split into (graph, parameter template, other state), placed on a mesh by a rule table."""

    graphdef: Any
    param_template: nnx.State  # abstract nnx.Param state, used to rebuild the module
    model_state: nnx.State  # abstract non-parameter state
    param_axes: Any  # pure dict of logical-axis tuples
    abstract_params: Any  # pure dict of ShapeDtypeStruct
    param_shardings: Any  # pure dict of NamedSharding
    mesh: Mesh
    rules: Rules
    tx: optax.GradientTransformation
    make_model: Callable[[nnx.Rngs], nnx.Module]
    seed: int
    health: HealthOptions = HealthOptions()

    @classmethod
    def create(cls, make_model, mesh: Mesh, rules: Rules, tx, *, seed: int = 0,
               health: HealthOptions | None = None) -> "Task":
        """Trace `make_model(rngs)` abstractly (no memory used) and derive the shardings of its parameters."""
        with _compat.no_eager_sharding():
            abstract = nnx.eval_shape(lambda: make_model(nnx.Rngs(seed)))
        graphdef, params, other = nnx.split(abstract, nnx.Param, ...)
        axes = _param_axes(params)
        abstract_params = nnx.to_pure_dict(params)
        shardings = tree_shardings(abstract_params, axes, mesh, rules)
        return cls(graphdef, params, other, axes, abstract_params, shardings, mesh, rules, tx, make_model, seed,
                   health or HealthOptions())

    # ----------------------------------------------------------------------------------------------------------------
    def merge(self, params: Any, model_state: Any | None = None) -> nnx.Module:
        """Rebuild the module from a pure-dict of parameter values (inside or outside a trace)."""
        template = jax.tree.map(lambda x: x, self.param_template)  # a fresh copy of the Variables
        nnx.replace_by_pure_dict(template, params)
        return nnx.merge(self.graphdef, template, self.model_state if model_state is None else model_state)

    def _init(self) -> TrainState:
        with _compat.no_eager_sharding():
            model = self.make_model(nnx.Rngs(self.seed))
        _, params, other = nnx.split(model, nnx.Param, ...)
        params = nnx.to_pure_dict(params)
        return TrainState(jnp.zeros((), jnp.int32), params, self.tx.init(params), other, init_health(self.health))

    def state_shardings(self) -> TrainState:
        """NamedShardings for every leaf of the TrainState: optimizer moments follow their parameters."""
        abstract = jax.eval_shape(self._init)
        rep = replicated(self.mesh)
        opt = optax.tree_map_params(
            self.tx,
            lambda _, sharding: sharding,
            abstract.opt_state,
            self.param_shardings,
            transform_non_params=lambda _: rep,
        )
        model_state = jax.tree.map(lambda _: rep, abstract.model_state)
        health = jax.tree.map(lambda _: rep, abstract.health)
        return TrainState(rep, self.param_shardings, opt, model_state, health)

    def abstract_state(self) -> TrainState:
        """ShapeDtypeStructs with shardings: the restore target for checkpoints."""
        abstract, shardings = jax.eval_shape(self._init), self.state_shardings()
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)

    def init_state(self) -> TrainState:
        """Parameters and optimizer state created directly in their shards (never whole on one device)."""
        return jax.jit(self._init, out_shardings=self.state_shardings())()

    # ----------------------------------------------------------------------------------------------------------------
    def batch_sharding(self, ndim: int = 2) -> NamedSharding:
        return batch_sharding(self.mesh, self.rules, ndim)

    def _grads(self, loss_fn, params, model_state, batch, scale=1.0):
        """(loss, weight, metrics, model_state, grads) for one microbatch; loss and grads are times `scale`."""

        def f(p):
            model = self.merge(p, model_state)
            loss, aux = loss_fn(model, batch, scale)
            _, _, new_state = nnx.split(model, nnx.Param, ...)
            return loss, (aux, new_state)

        (loss, (aux, new_state)), grads = jax.value_and_grad(f, has_aux=True)(params)
        weight = jnp.asarray(aux.get("weight", 1.0), jnp.float32)
        return loss, weight, aux, new_state, grads

    def train_step(self, loss_fn: LossFn, *, microbatches: int = 1, schedule=None, donate: bool = True):
        """Build the jitted step. `loss_fn(model, batch) -> (mean_loss, aux)`; `aux["weight"]` (e.g. the number of
        unmasked tokens) weights microbatches so that accumulating k microbatches equals one k-times-larger batch.

        Numerical health follows `self.health`: a step with non-finite loss or gradients (or a loss spike, if enabled)
        leaves params, optimizer and model state untouched and is counted in `state.health`; metrics carry
        `skipped`, `consecutive_skips` and `loss_scale`."""
        opts = self.health

        def scaled_loss(model, batch, scale):
            loss, aux = loss_fn(model, batch)
            return loss * scale, aux

        grad_constraint = lambda g: jax.lax.with_sharding_constraint(g, self.param_shardings)  # noqa: E731

        def split_micro(x):
            # Microbatch i takes rows i, i+k, i+2k...: every microbatch stays spread over all data-parallel devices.
            x = x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:])
            x = jnp.swapaxes(x, 0, 1)
            spec = logical_to_spec((None, "batch") + (None,) * (x.ndim - 2), self.rules.activations, self.mesh)
            return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

        def step(state: TrainState, batch: dict[str, jax.Array]):
            scale = state.health["loss_scale"] if opts.loss_scale else jnp.ones((), jnp.float32)
            with activation_sharding(self.mesh, self.rules):
                if microbatches == 1:
                    loss, weight, _, model_state, grads = self._grads(
                        scaled_loss, state.params, state.model_state, batch, scale)
                    total_w, total_loss = weight, loss * weight
                    grads = jax.tree.map(lambda g: g * weight, grads)
                else:
                    micro = jax.tree.map(split_micro, batch)

                    def body(carry, mb):
                        g_sum, w_sum, l_sum, ms = carry
                        loss, w, aux, ms, g = self._grads(scaled_loss, state.params, ms, mb, scale)
                        g_sum = jax.tree.map(lambda a, b: a + b * w, g_sum, g)
                        return (grad_constraint(g_sum), w_sum + w, l_sum + loss * w, ms), None

                    zeros = jax.tree.map(jnp.zeros_like, state.params)
                    init = (grad_constraint(zeros), jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32),
                            state.model_state)
                    (grads, total_w, total_loss, model_state), _ = jax.lax.scan(body, init, micro)
                grads = grad_constraint(jax.tree.map(lambda g: g / (total_w * scale), grads))
                loss = total_loss / (total_w * scale)
            return finish_step(self.tx, opts, state, grads, loss, total_w, model_state, schedule)

        shardings = self.state_shardings()
        return jax.jit(
            step,
            in_shardings=(shardings, self.batch_sharding()),
            out_shardings=(shardings, replicated(self.mesh)),
            donate_argnums=(0,) if donate else (),
        )

    def eval_step(self, loss_fn: LossFn):
        """Jitted `(state, batch) -> {"loss", "tokens"}` without gradients."""

        def step(state: TrainState, batch):
            with activation_sharding(self.mesh, self.rules):
                loss, aux = loss_fn(self.merge(state.params, state.model_state), batch)
            weight = jnp.asarray(aux.get("weight", 1.0), jnp.float32)
            return {"loss": loss, "tokens": weight}

        return jax.jit(step, in_shardings=(self.state_shardings(), self.batch_sharding()),
                       out_shardings=replicated(self.mesh))


def next_token_loss(model: nnx.Module, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Masked next-token cross-entropy in fp32. batch: inputs, targets int32 [B, L]; optional mask [B, L].

    Returns the mean over unmasked tokens and aux {"weight": number of unmasked tokens}. A model that defines its own
    `next_token_loss(batch)` (the built-in GPT does, to offer a fused kernel) is asked to compute it.
    """
    if hasattr(model, "next_token_loss"):
        return model.next_token_loss(batch)
    from jaxperf.models.gpt import cross_entropy_from_logits

    targets = batch["targets"]
    mask = batch.get("mask")
    mask = jnp.ones(targets.shape, jnp.float32) if mask is None else mask.astype(jnp.float32)
    return cross_entropy_from_logits(model(batch["inputs"]), targets, mask)
