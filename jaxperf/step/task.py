"""The one train step: any Flax NNX module, any loss, any mesh and rule table.

    task = build_task(cfg, mesh)                    # the built-in GPT of cfg.model, AdamW of cfg.optim
    state = task.init_state()                       # parameters and optimizer state born sharded
    step = task.train_step(microbatches=4)
    state, metrics = step(state, batch)             # jitted with shardings, state donated

    task = build_task(cfg, mesh, make_model=MyLM, loss_fn=my_loss, tx=optax.sgd(0.1))   # research code

The step is pure `(state, batch) -> (state, metrics)`. Parameters live in `state.params` as a plain nested dict (the
pure-dict form of the module's `nnx.Param`s) so optax, Orbax and sharding trees all see ordinary pytrees; the module
is rebuilt from it inside the trace with `nnx.merge`, which costs nothing at run time. Non-parameter module state
(RNG counters, batch statistics) rides along in `state.model_state` and is updated by the loss function's calls.
"""

from __future__ import annotations

import dataclasses
import warnings
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
from jaxperf.config import ConfigError, TrainConfig
from jaxperf.config.validate import compiler_options
from jaxperf.models.gpt import GPT, cross_entropy_from_logits, gpt_loss
from jaxperf.models.hooks import ContextSpec, ExpertSpec, LayerHooks, PipelineSpec
from jaxperf.models.moe import routes_per_device
from jaxperf.models.platform import settle
from jaxperf.parallel.mesh import platform_of
from jaxperf.parallel.pipeline import split_microbatches
from jaxperf.parallel.rules import Rules, activation_sharding, get_rules, logical_to_spec
from jaxperf.perf.cpu_host import check_collective_order
from jaxperf.parallel.sharding import batch_sharding, replicated, tree_shardings
from jaxperf.step.health import HealthOptions, all_finite, init_health, is_spike, select, update_health
from jaxperf.step.optimizer import make_optimizer, without_router_bias

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
    reduced. Returns (new TrainState, metrics); `grad_norm` leaves out the MoE router biases' load signals, which
    are not gradients of the loss (jaxperf.step.optimizer.with_router_bias).
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
        "grad_norm": _global_norm(without_router_bias(grads)),
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


def next_token_loss(model: nnx.Module, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Masked next-token cross-entropy in fp32 from `model(inputs)` logits [B, L, V].

    batch: inputs, targets int32 [B, L]; optional mask [B, L]. Returns the mean over unmasked tokens and aux
    {"weight": number of unmasked tokens}. (The built-in GPT's own loss, `jaxperf.models.gpt.gpt_loss`, can also fuse
    the output projection with the softmax; `build_task` picks it for that model.)
    """
    targets = batch["targets"]
    mask = batch.get("mask")
    mask = jnp.ones(targets.shape, jnp.float32) if mask is None else mask.astype(jnp.float32)
    return cross_entropy_from_logits(model(batch["inputs"]), targets, mask)


@dataclass
class Task:
    """A model split into (graph, parameter template, other state), placed on a mesh by a rule table, with the
    optimizer, loss and numerical-health settings of its train step.

    Build one with `build_task` (from a TrainConfig) or `Task.create` (from the pieces).
    """

    graphdef: Any
    param_template: nnx.State  # abstract nnx.Param state, used to rebuild the module
    model_state: nnx.State  # abstract non-parameter state
    param_axes: Any  # pure dict of logical-axis tuples
    abstract_params: Any  # pure dict of ShapeDtypeStruct
    param_shardings: Any  # pure dict of NamedSharding
    mesh: Mesh
    rules: Rules
    tx: optax.GradientTransformation | None
    make_model: Callable[[nnx.Rngs], nnx.Module]
    seed: int
    health: HealthOptions = HealthOptions()
    loss_fn: LossFn = next_token_loss
    schedule: Callable | None = None  # the learning-rate schedule, reported as metrics["lr"]
    layer_stack: str | None = None  # the model's stacked layers' key in the parameter tree (jaxperf.models.hooks)
    hooks: LayerHooks | None = None  # installed on the model by every step of this task (e.g. a pipeline)
    # XLA options of this task's train and eval steps alone (TrainConfig.compiler_options), as jax.jit takes them
    compiler_options: dict[str, Any] | None = None

    @classmethod
    def create(cls, make_model, mesh: Mesh, rules: Rules, tx=None, *, seed: int = 0,
               health: HealthOptions | None = None, loss_fn: LossFn | None = None, schedule=None) -> "Task":
        """Trace `make_model(rngs)` abstractly (no memory used) and derive the shardings of its parameters."""
        with _compat.no_eager_sharding():
            abstract = nnx.eval_shape(lambda: make_model(nnx.Rngs(seed)))
        graphdef, params, other = nnx.split(abstract, nnx.Param, ...)
        axes = _param_axes(params)
        abstract_params = nnx.to_pure_dict(params)
        shardings = tree_shardings(abstract_params, axes, mesh, rules)
        return cls(graphdef, params, other, axes, abstract_params, shardings, mesh, rules, tx, make_model, seed,
                   health or HealthOptions(), loss_fn or next_token_loss, schedule,
                   getattr(abstract, "layer_stack", None))

    def replace(self, **changes) -> "Task":
        """A copy with some fields changed (e.g. `task.replace(tx=optax.sgd(0.1))`); nothing is traced again."""
        return dataclasses.replace(self, **changes)

    # ----------------------------------------------------------------------------------------------------------------
    def merge(self, params: Any, model_state: Any | None = None, hooks: LayerHooks | None = None) -> nnx.Module:
        """Rebuild the module from a pure-dict of parameter values (inside or outside a trace).

        `hooks` are installed on the module for explicit-collective steps (jaxperf.models.hooks)."""
        template = jax.tree.map(lambda x: x, self.param_template)  # a fresh copy of the Variables
        nnx.replace_by_pure_dict(template, params)
        model = nnx.merge(self.graphdef, template, self.model_state if model_state is None else model_state)
        hooks = hooks or self.hooks
        if hooks is not None:
            model.hooks = hooks
        return model

    def _require_tx(self) -> optax.GradientTransformation:
        if self.tx is None:
            raise ValueError("this Task has no optimizer (it was built for inference): build it with build_task(..., "
                             "with_optimizer=True) or task.replace(tx=...)")
        return self.tx

    def _init(self) -> TrainState:
        with _compat.no_eager_sharding():
            model = self.make_model(nnx.Rngs(self.seed))
        _, params, other = nnx.split(model, nnx.Param, ...)
        params = nnx.to_pure_dict(params)
        return TrainState(jnp.zeros((), jnp.int32), params, self._require_tx().init(params), other,
                          init_health(self.health))

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

    def abstract_params_sharded(self) -> Any:
        """ShapeDtypeStructs with shardings of the parameters alone: the restore target when no optimizer is needed."""
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), self.abstract_params,
                            self.param_shardings)

    def init_state(self) -> TrainState:
        """Parameters and optimizer state created directly in their shards (never whole on one device)."""
        return jax.jit(self._init, out_shardings=self.state_shardings())()

    def init_state_from(self, params: Any) -> TrainState:
        """A fresh TrainState around given parameters (a pretrained checkpoint's, placed with `param_shardings`):
        step 0, new optimizer state and health. `params` is donated: its buffers become the state's, so the
        parameters are never held twice."""

        def init(p):
            fresh = self._init()  # its random parameters are unused, so XLA never computes them
            return fresh.replace(params=p, opt_state=self._require_tx().init(p))

        return jax.jit(init, in_shardings=(self.param_shardings,), out_shardings=self.state_shardings(),
                       donate_argnums=0)(params)

    def output_size(self, seq_len: int) -> int | None:
        """The last dim of `model(tokens)` for int32 tokens [1, seq_len], traced abstractly (nothing is computed or
        allocated): the vocabulary the model can predict. None for a model that is not called on tokens alone or
        does not return [B, L, V] logits."""
        tokens = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
        try:
            out = jax.eval_shape(lambda p, t: self.merge(p)(t), self.abstract_params, tokens)
        except Exception:  # noqa: BLE001 - a model that needs more than tokens: nothing to check
            return None
        shape = getattr(out, "shape", None)
        return int(shape[-1]) if shape is not None and len(shape) == 3 else None

    # ----------------------------------------------------------------------------------------------------------------
    def batch_sharding(self, ndim: int = 2) -> NamedSharding:
        return batch_sharding(self.mesh, self.rules, ndim)

    def _grads(self, loss_fn, params, model_state, batch, scale=1.0, hooks: LayerHooks | None = None):
        """(loss, weight, metrics, model_state, grads) for one microbatch; loss and grads are times `scale`."""

        def f(p):
            model = self.merge(p, model_state, hooks)
            loss, aux = loss_fn(model, batch, scale)
            _, _, new_state = nnx.split(model, nnx.Param, ...)
            return loss, (aux, new_state)

        (loss, (aux, new_state)), grads = jax.value_and_grad(f, has_aux=True)(params)
        weight = jnp.asarray(aux.get("weight", 1.0), jnp.float32)
        return loss, weight, aux, new_state, grads

    def train_step(self, loss_fn: LossFn | None = None, *, microbatches: int = 1, schedule=None, donate: bool = True):
        """Build the jitted step. `loss_fn(model, batch) -> (mean_loss, aux)` (default: the task's); `aux["weight"]`
        (e.g. the number of unmasked tokens) weights microbatches so that accumulating k microbatches equals one
        k-times-larger batch.

        Numerical health follows `self.health`: a step with non-finite loss or gradients (or a loss spike, if enabled)
        leaves params, optimizer and model state untouched and is counted in `state.health`; metrics carry
        `skipped`, `consecutive_skips` and `loss_scale`. Scalars a loss returns in `aux["metrics"]` (an MoE model's
        router statistics) join the metrics, averaged over microbatches by their weights."""
        opts, tx = self.health, self._require_tx()
        loss_fn = loss_fn or self.loss_fn
        schedule = schedule or self.schedule

        def scaled_loss(model, batch, scale):
            loss, aux = loss_fn(model, batch)
            return loss * scale, aux

        grad_constraint = lambda g: jax.lax.with_sharding_constraint(g, self.param_shardings)  # noqa: E731

        def split_micro(x):
            x = split_microbatches(x, microbatches)  # each microbatch keeps rows of every data-parallel device
            spec = logical_to_spec((None, "batch") + (None,) * (x.ndim - 2), self.rules.activations, self.mesh)
            return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

        def step(state: TrainState, batch: dict[str, jax.Array]):
            scale = state.health["loss_scale"] if opts.loss_scale else jnp.ones((), jnp.float32)
            with activation_sharding(self.mesh, self.rules):
                if microbatches == 1:
                    loss, weight, aux, model_state, grads = self._grads(
                        scaled_loss, state.params, state.model_state, batch, scale)
                    total_w, total_loss = weight, loss * weight
                    grads = jax.tree.map(lambda g: g * weight, grads)
                    extra = aux.get("metrics", {})
                else:
                    micro = jax.tree.map(split_micro, batch)
                    # the loss's own metrics ride in the scan's model-state carry, summed times each weight
                    shapes = jax.eval_shape(lambda p, ms, mb: loss_fn(self.merge(p, ms), mb)[1].get("metrics", {}),
                                            state.params, state.model_state, jax.tree.map(lambda x: x[0], micro))
                    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), shapes)

                    def grads_of(carry, mb):
                        ms, sums = carry
                        loss, w, aux, ms, g = self._grads(scaled_loss, state.params, ms, mb, scale)
                        sums = jax.tree.map(lambda a, m: a + w * m, sums, aux.get("metrics", {}))
                        return loss, w, (ms, sums), g

                    grads, total_w, total_loss, (model_state, sums) = accumulate_microbatches(
                        grads_of, micro, jax.tree.map(jnp.zeros_like, state.params),
                        jnp.zeros((), jnp.float32), (state.model_state, zeros), constrain=grad_constraint)
                    extra = jax.tree.map(lambda a: a / total_w, sums)
                grads = grad_constraint(jax.tree.map(lambda g: g / (total_w * scale), grads))
                loss = total_loss / (total_w * scale)
            state, metrics = finish_step(tx, opts, state, grads, loss, total_w, model_state, schedule)
            return state, {**metrics, **extra}

        shardings = self.state_shardings()
        return jax.jit(
            step,
            in_shardings=(shardings, self.batch_sharding()),
            out_shardings=(shardings, replicated(self.mesh)),
            donate_argnums=(0,) if donate else (),
            compiler_options=self.compiler_options or None,
        )

    def eval_step(self, loss_fn: LossFn | None = None):
        """Jitted `(state, batch) -> {"loss", "tokens"}` without gradients (default loss: the task's)."""
        loss_fn = loss_fn or self.loss_fn

        def step(state: TrainState, batch):
            with activation_sharding(self.mesh, self.rules):
                loss, aux = loss_fn(self.merge(state.params, state.model_state), batch)
            weight = jnp.asarray(aux.get("weight", 1.0), jnp.float32)
            return {"loss": loss, "tokens": weight}

        return jax.jit(step, in_shardings=(self.state_shardings(), self.batch_sharding()),
                       out_shardings=replicated(self.mesh), compiler_options=self.compiler_options or None)


def _weighted(loss, w, grads):
    return loss * w, jax.tree.map(lambda g: g * w, grads)


def accumulate_microbatches(grads_of, micro_batches, zero_grads, zero, model_state, *, weigh=_weighted,
                            constrain=lambda g: g):
    """(sum of grads x w, sum of w, sum of loss x w, model state) over k microbatches, in one scan: gradient
    accumulation, as every step flavour runs it.

    Args:
      grads_of: `(model_state, microbatch) -> (loss, weight, model_state, grads)` of one microbatch.
      micro_batches: a pytree whose leaves lead with the microbatch axis k (jaxperf.parallel.pipeline
        .split_microbatches).
      zero_grads, zero: the accumulators' start (zeros shaped like the gradients, a scalar zero), as the caller needs
        them placed or typed.
      weigh: `(loss, w, grads) -> (loss x w, grads x w)` of one microbatch (a step whose loss is already weighted
        passes them through).
      constrain: applied to the running gradient sum (a sharding constraint).
    """

    def body(carry, mb):
        g_sum, w_sum, l_sum, ms = carry
        loss, w, ms, g = grads_of(ms, mb)
        lw, gw = weigh(loss, w, g)
        return (constrain(jax.tree.map(jnp.add, g_sum, gw)), w_sum + w, l_sum + lw, ms), None

    (grads, w, loss, model_state), _ = jax.lax.scan(body, (constrain(zero_grads), zero, zero, model_state),
                                                    micro_batches)
    return grads, w, loss, model_state


def step_microbatches(cfg: TrainConfig) -> int:
    """Microbatches the step accumulates itself: cfg.microbatches, except under a pipeline (stage > 1), where they are
    the pipeline's and the step sees one batch."""
    return 1 if cfg.parallel.stage > 1 else cfg.microbatches


def _compiler_options(cfg: TrainConfig, mesh: Mesh) -> dict[str, Any] | None:
    """cfg.compiler_options for jax.jit, checked against the mesh's platform; where the mesh's devices are attached,
    compiled once into an empty program, so that a name the compiler does not know is one line here rather than an
    error from the step's first compile."""
    platform = platform_of(mesh)
    options = compiler_options(cfg.compiler_options, platform)
    if not options:
        return None
    device = mesh.devices.flat[0]
    if device.platform == jax.default_backend():  # not a TPU topology described on a CPU host
        try:
            jax.jit(lambda: jnp.zeros(()), compiler_options=options).lower().compile()
        except Exception as e:  # XLA: "INVALID_ARGUMENT: No such compile option: 'x'", or a value it cannot parse
            raise ConfigError(f"compiler_options {', '.join(cfg.compiler_options)}: the {platform.upper()} compiler "
                              f"refuses them ({str(e).splitlines()[0][:200]}): check the names and values") from None
    return options


def build_task(cfg: TrainConfig, mesh: Mesh, make_model: Callable[[nnx.Rngs], nnx.Module] | None = None, *,
               loss_fn: LossFn | None = None, tx: optax.GradientTransformation | None = None,
               with_optimizer: bool = True) -> Task:
    """The Task of a run: its model on `mesh` under the rule table of `cfg.parallel.strategy`, the optimizer, the loss
    and the numerical-health settings. Traces the model once, abstractly.

    Args:
      cfg: the run's configuration.
      mesh: the device mesh (jaxperf.parallel.mesh.make_mesh); with its shape and its devices' platform the model
        config is settled here, once (jaxperf.models.platform.settle): every "auto" becomes the implementation the
        step runs, e.g. the Mosaic kernels for a TPU topology described on a CPU host.
      make_model: `rngs -> nnx.Module` whose parameters carry logical axes; default: the built-in GPT of cfg.model.
      loss_fn: `(model, batch) -> (mean_loss, aux)`; default: the GPT's own loss for the built-in model (which may
        fuse the output projection with the softmax), masked next-token cross-entropy from logits otherwise.
      tx: any optax transformation; default: AdamW with warm-up, cosine decay and clipping from cfg.optim (weight
        decay only on matrices), whose schedule is reported as metrics["lr"], and with `model.router_bias` the
        router biases moved by `model.router_bias_update_rate` (jaxperf.step.optimizer.with_router_bias; a `tx` of
        your own gets their load signals as gradients: wrap it in `with_router_bias` to balance the same way).
      with_optimizer: False builds a Task for inference (restoring or serving parameters): no optimizer is made.
    """
    rules = get_rules(cfg.parallel.strategy, mesh, sequence_parallel=cfg.parallel.sequence_parallel)
    pipeline = context = None
    if mesh.shape.get("stage", 1) > 1:
        pipeline = PipelineSpec(mesh, cfg.microbatches, cfg.parallel.schedule)
    if mesh.shape.get("seq", 1) > 1:
        context = ContextSpec(mesh.shape["seq"], cfg.parallel.context_layout)
    sequence_parallel = mesh if cfg.parallel.sequence_parallel and mesh.shape.get("tensor", 1) > 1 else None
    experts = ExpertSpec(mesh) if routes_per_device(cfg, dict(mesh.shape)) else None
    hooks = (LayerHooks(pipeline=pipeline, context=context, sequence_parallel=sequence_parallel, experts=experts)
             if pipeline or context or sequence_parallel is not None or experts else None)
    check_collective_order(cfg, dict(mesh.shape), platform_of(mesh))
    if make_model is None:
        model_cfg = settle(cfg, dict(mesh.shape), platform_of(mesh))
        make_model = lambda rngs: GPT(model_cfg, rngs=rngs)  # noqa: E731
        if loss_fn is not None and cfg.model.router_bias and cfg.model.router_bias_update_rate:
            warnings.warn("model.router_bias_update_rate moves the router biases by the signal the loss adds (the MoE "
                          "stats' bias_signal, as GPT.next_token_loss adds it); a loss of your own that leaves it out "
                          "leaves the biases where they are", stacklevel=2)
        loss_fn = loss_fn or gpt_loss
    task = Task.create(make_model, mesh, rules, seed=cfg.seed, health=HealthOptions.from_config(cfg),
                       loss_fn=loss_fn).replace(hooks=hooks)
    if not with_optimizer:  # no train or eval step: a TPU run's options do not stop serving it on a CPU or GPU
        return task
    task = task.replace(compiler_options=_compiler_options(cfg, mesh))
    schedule = None
    if tx is None:
        rate = cfg.model.router_bias_update_rate if cfg.model.router_bias else None
        tx, schedule = make_optimizer(cfg.optim, cfg.max_steps, decay_mask(task.param_axes, task.abstract_params),
                                      router_bias_rate=rate)
    return task.replace(tx=tx, schedule=schedule)
