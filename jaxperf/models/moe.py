"""A mixture-of-experts MLP: a router picks k of E expert MLPs for every token (docs/moe.md).

    moe = MoE(ModelConfig(n_experts=8, experts_per_token=2), rngs=nnx.Rngs(0))
    y_BxLxD, stats = moe(x_BxLxD)     # stats: STATS, fp32 scalars of this layer

The router is a [D, E] matmul in fp32. Routing (`route`): "softmax" takes the softmax over all experts, keeps the top
k and renormalises their weights to sum to 1 (Mixtral); "sigmoid" keeps the top k of independent sigmoid scores,
normalised over the k (DeepSeek-V3); `router_norm_topk=false` keeps the k weights as scored (Qwen2-MoE). Two ways
to run the experts:

  dropless (capacity_factor None or 0)  the token slots sorted by expert and run as grouped matmuls
                                        (`jax.lax.ragged_dot`): every routed token is computed, none is padded
  capacity (capacity_factor > 0)        each expert takes at most C = ceil(capacity_factor * T * k / E) slots into a
                                        dense [E, C, D] buffer; the slots past C are dropped (their MoE output is zero,
                                        the residual carries the token) and counted

With `router_bias` (loss-free balancing, DeepSeek-V3) a per-expert bias joins the scores where the top k are chosen;
the step's loads reach it as its gradient (`bias_signal`) and the optimizer moves it by their sign.

Expert weights are stacked arrays with a leading `expert` axis (`w_in_ExDxF`...). On a mesh with an `expert` axis
(`parallel.expert` > 1) the rule tables split them over it and the step installs `hooks.experts`: each device then
routes its own tokens, sends every token slot to the device that holds its expert and gets the outputs back by
all-to-all (jaxperf.parallel.expert), dropless or with a capacity per expert counted within each device's tokens (a
GShard group); the router losses average over the whole batch, as on one device. Without an expert axis, wherever
the tokens are split over devices, each device routes its own tokens the same way, through all the experts and
without all-to-all (`routes_per_device`). Shared experts
(`n_shared_experts`, DeepSeek) are one dense MLP of width `shared_mlp_dim` (by default n_shared_experts *
moe_mlp_dim) added to every token's routed output, scaled per token by a sigmoid gate with `shared_expert_gate`
(Qwen2-MoE).

Legend: B batch, L length, D embed, T tokens (B * L), E experts, K experts per token, S token slots (T * K),
F one expert's hidden width, C expert capacity.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jax.sharding import PartitionSpec as P

from jaxperf import _compat
from jaxperf.models.hooks import DEFAULT_HOOKS, LayerHooks
from jaxperf.models.layers import MLP, _param, _zeros, to_compute
from jaxperf.models.platform import for_platform
from jaxperf.models.registry import implementation, register
from jaxperf.parallel import expert as ep
from jaxperf.parallel.rules import activation_spec, param_spec

# What every MoE layer reports, each an fp32 scalar: the two router losses, the share of slots dropped, the busiest
# expert's slots over an even share (1 = balanced), and the router bias's signal (`bias_signal`: zero, for its
# gradient alone)
STATS = ("aux_loss", "z_loss", "dropped", "max_load", "bias_signal")
# logical axes of the expert weights (w_in, w_gate, w_out, b_in, b_out) and of the router
_WEIGHT_AXES = (("expert", "embed", "mlp"), ("expert", "embed", "mlp"), ("expert", "mlp", "embed"), ("expert", "mlp"),
                ("expert", "embed"))
_ROUTER_AXES = ("embed", None)  # the expert dim unnamed: the [T, E] logits are needed whole on every device


class MoeStats(nnx.Variable):
    """The router statistics of the last forward (averaged over the MoE layers), left on the GPT by `hidden` for its
    loss to take (`GPT.pop_moe_stats`): neither a parameter nor state kept between steps."""


def is_moe_layer(cfg, layer: int) -> bool:
    """Whether layer `layer` (from 0) has an MoE MLP: every `moe_every`-th layer, counting from 1, when n_experts > 0
    (moe_every=2 makes layers 1, 3, 5... MoE, as in Switch and GShard)."""
    return cfg.n_experts > 0 and (layer + 1) % cfg.moe_every == 0


def routes_per_device(cfg, mesh_shape: dict[str, int]) -> bool:
    """Whether the MoE layers of `cfg` (a TrainConfig) route each device's own tokens, under shard_map
    (`MoE._expert_parallel`): always with an expert axis, and wherever the tokens are split over data, fsdp or seq
    while the experts' width is not split over tensor. Under jit alone the sort of the token slots by expert does not
    split over the devices that hold the tokens: the partitioner gathers every slot of the batch and each device runs
    the experts on all of them (4x the work and the buffers on 4 data-parallel devices)."""
    if not cfg.model.n_experts:
        return False
    if mesh_shape.get("expert", 1) > 1:
        return True
    return math.prod(mesh_shape.get(a, 1) for a in ("data", "fsdp", "seq")) > 1 and mesh_shape.get("tensor", 1) == 1


def capacity(tokens: int, k: int, n_experts: int, factor: float) -> int:
    """Slots each expert takes on the capacity path: ceil(factor * tokens * k / n_experts), at least 1."""
    return max(1, math.ceil(factor * tokens * k / n_experts))


def route(logits_TxE: jax.Array, k: int, router: str, norm_topk: bool = True,
          bias_E: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(weights [T, K] fp32, experts [T, K] int32, probs [T, E] fp32) from router logits.

    `probs` are the per-expert scores the load-balancing loss averages: the softmax for "softmax", the sigmoid scores
    normalised over all E experts for "sigmoid". With `norm_topk` (both routers' default) the k kept weights are
    renormalised to sum to 1 per token; without, they are the kept scores themselves (Qwen2-MoE). `bias_E` (loss-free
    balancing, `model.router_bias`) is added to the scores (softmax probabilities, or sigmoid scores) where the top k
    are chosen, and to nothing else: the weights are the chosen experts' own scores, and no gradient reaches the bias
    through the choice.
    """
    logits = logits_TxE.astype(jnp.float32)
    if router == "softmax":
        scores = probs = jax.nn.softmax(logits, axis=-1)
    elif router == "sigmoid":
        scores = jax.nn.sigmoid(logits)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    else:
        raise ValueError(f"unknown router {router!r}; expected 'softmax' or 'sigmoid'")
    if bias_E is None:
        top_TxK, experts_TxK = jax.lax.top_k(scores, k)
    else:
        _, experts_TxK = jax.lax.top_k(scores + jax.lax.stop_gradient(bias_E.astype(jnp.float32))[None, :], k)
        top_TxK = jnp.take_along_axis(scores, experts_TxK, axis=-1)
    weights_TxK = top_TxK / jnp.sum(top_TxK, axis=-1, keepdims=True) if norm_topk else top_TxK
    return weights_TxK, experts_TxK.astype(jnp.int32), probs


def _identity(v):
    return v


def slot_shares(experts_TxK: jax.Array, n_experts: int) -> jax.Array:
    """f [E] fp32: the share of the T * K token slots routed to each expert (sums to 1; 1 / E each when even)."""
    return jnp.sum(jax.nn.one_hot(experts_TxK, n_experts, dtype=jnp.float32), axis=(0, 1)) / experts_TxK.size


def load_balancing_loss(probs_TxE: jax.Array, experts_TxK: jax.Array, mean=_identity) -> jax.Array:
    """E * sum_e f_e * P_e (Switch Transformer): f_e the share of the T * K token slots routed to expert e, P_e the
    mean router probability of e. 1 when routing is uniform, E when every token goes to one expert (with all its
    probability); only P carries a gradient. `mean` averages f and P over the devices that split the tokens."""
    E = probs_TxE.shape[-1]
    p_E = jnp.mean(probs_TxE.astype(jnp.float32), axis=0)
    return E * jnp.sum(mean(slot_shares(experts_TxK, E)) * mean(p_E))


def bias_signal(bias_E: jax.Array, f_E: jax.Array) -> jax.Array:
    """Zero, whose gradient with respect to `bias_E` is f_E - 1 / E: each expert's share of the slots over an even
    share. Added to the loss (`GPT.next_token_loss`), it hands the router bias the loads of the step as its gradient,
    through every path a gradient takes (microbatches, data parallelism, loss scaling), to an update that uses only
    the gradient's sign (`jaxperf.step.optimizer.with_router_bias`), so the positive factors on the way do not
    matter."""
    s = jnp.sum(bias_E.astype(jnp.float32) * jax.lax.stop_gradient(f_E - 1.0 / f_E.shape[-1]))
    return s - jax.lax.stop_gradient(s)


def router_z_loss(logits_TxE: jax.Array) -> jax.Array:
    """Mean over tokens of logsumexp(logits)^2 (ST-MoE): keeps the router logits small, so its softmax stays
    accurate in low precision."""
    return jnp.mean(jnp.square(jax.nn.logsumexp(logits_TxE.astype(jnp.float32), axis=-1)))


def _routed(x_BxLxD, router_DxE, k: int, router: str, norm_topk: bool = True, bias_E=None):
    """(x [T, D], router logits [T, E] fp32, weights [T, K], experts [T, K], probs [T, E]) of a batch's tokens."""
    x_TxD = x_BxLxD.reshape(-1, x_BxLxD.shape[-1])
    logits_TxE = x_TxD.astype(jnp.float32) @ router_DxE.astype(jnp.float32)
    return (x_TxD, logits_TxE, *route(logits_TxE, k, router, norm_topk, bias_E))


def _stats(probs_TxE, experts_TxK, logits_TxE, dropped, mean=_identity, bias_E=None) -> dict[str, jax.Array]:
    """The layer's router statistics (STATS); `mean` averages over the devices that split the tokens (each holds
    as many)."""
    E = probs_TxE.shape[-1]
    f_E = mean(slot_shares(experts_TxK, E))
    signal = jnp.zeros((), jnp.float32) if bias_E is None else bias_signal(bias_E, f_E)
    return {"aux_loss": load_balancing_loss(probs_TxE, experts_TxK, mean), "z_loss": mean(router_z_loss(logits_TxE)),
            "dropped": mean(dropped), "max_load": E * jnp.max(f_E), "bias_signal": signal}


def _tag_hidden(h, gate):
    """The experts' input projections named as the dense MLP names them (remat policies save them by name): up
    (mlpwi_1) and gate (mlpwi_0) with SwiGLU, mlpwi alone otherwise."""
    if gate is None:
        return checkpoint_name(h, "mlpwi"), None
    return checkpoint_name(h, "mlpwi_1"), checkpoint_name(gate, "mlpwi_0")


def _activate(h, gate, act: str):
    """The dense MLP's nonlinearity (jaxperf.models.layers.MLP): SwiGLU, or GELU (tanh form unless gelu_exact)."""
    if act == "swiglu":
        return jax.nn.silu(gate) * h
    return jax.nn.gelu(h, approximate=act != "gelu_exact")


class MoE(nnx.Module):
    """The MoE MLP of one layer; `__call__` returns (y [B, L, D], {aux_loss, z_loss, dropped}).

    Its parameters are checkpoint keys: `router_DxE` (and `router_bias_E` with `model.router_bias`); `w_in_ExDxF`,
    `w_gate_ExDxF` (SwiGLU), `w_out_ExFxD` and, with biases, `bias_in_ExF`, `bias_out_ExD`; `shared` (a `MLP`,
    `shared_mlp_dim` wide) with shared experts and `shared_gate_Dx1` with their sigmoid gate.
    """

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        D, E, F = cfg.d_model, cfg.n_experts, cfg.moe_mlp_dim or cfg.mlp_dim
        init = nnx.initializers.normal(cfg.init_std)
        out_init = nnx.initializers.normal(cfg.init_std / (2 * cfg.n_layers) ** 0.5)
        pd = jnp.dtype(cfg.param_dtype)
        self.act, self.k, self.router, self.norm_topk = cfg.mlp_act, cfg.experts_per_token, cfg.router, \
            cfg.router_norm_topk
        self.capacity_factor = cfg.capacity_factor or 0.0
        self.gmm_impl, self.platform = cfg.grouped_matmul_impl, cfg.platform
        # with the looped grouped matmul (XLA:CPU's), the slots are sorted and unsorted by gathers (`_permute_rows`)
        self.gather_rows = cfg.grouped_matmul_impl == "loop"
        self.ragged = bool(cfg.ragged_all_to_all)  # dropless expert parallelism only (jaxperf.parallel.expert)
        w_in, w_out, b_in, b_out = _WEIGHT_AXES[0], _WEIGHT_AXES[2], _WEIGHT_AXES[3], _WEIGHT_AXES[4]
        self.router_DxE = _param(rngs, init, (D, E), _ROUTER_AXES, pd)
        # loss-free balancing's bias (route): fp32 whatever param_dtype, as its steps are small; zeros drawn from no
        # key, so a model with it starts with the same other parameters as one without
        self.router_bias_E = _zero_param((E,), (None,), jnp.float32) if cfg.router_bias else None
        self.w_in_ExDxF = _param(rngs, init, (E, D, F), w_in, pd)
        self.w_gate_ExDxF = _param(rngs, init, (E, D, F), w_in, pd) if self.act == "swiglu" else None
        self.w_out_ExFxD = _param(rngs, out_init, (E, F, D), w_out, pd)
        self.bias_in_ExF = _param(rngs, _zeros, (E, F), b_in, pd) if cfg.use_bias else None
        self.bias_out_ExD = _param(rngs, _zeros, (E, D), b_out, pd) if cfg.use_bias else None
        shared_F = cfg.shared_mlp_dim or cfg.n_shared_experts * F
        self.shared = MLP(dataclasses.replace(cfg, mlp_dim=shared_F), rngs=rngs) if cfg.n_shared_experts else None
        self.shared_gate_Dx1 = (_param(rngs, init, (D, 1), ("embed", None), pd)
                                if cfg.n_shared_experts and cfg.shared_expert_gate else None)

    def _weights(self, dt):
        """(w_in, w_gate, w_out, b_in, b_out) in the compute dtype, None where absent."""
        opt = lambda p: None if p is None else to_compute(p[...], dt, round_first=True)  # noqa: E731
        return (opt(self.w_in_ExDxF), opt(self.w_gate_ExDxF), opt(self.w_out_ExFxD), opt(self.bias_in_ExF),
                opt(self.bias_out_ExD))

    def _grouped_matmul(self, x):
        return implementation("grouped_matmul", self.gmm_impl, x, self.w_in_ExDxF, platform=self.platform)

    def _shared(self, x_BxLxD: jax.Array, hooks: LayerHooks) -> jax.Array:
        """The shared experts' output, scaled per token by the sigmoid gate where there is one (gate in fp32)."""
        y_BxLxD = self.shared(x_BxLxD, hooks)
        if self.shared_gate_Dx1 is None:
            return y_BxLxD
        logit_BxLx1 = x_BxLxD.astype(jnp.float32) @ self.shared_gate_Dx1[...].astype(jnp.float32)
        return jax.nn.sigmoid(logit_BxLx1).astype(y_BxLxD.dtype) * y_BxLxD

    def __call__(self, x_BxLxD: jax.Array, hooks: LayerHooks = DEFAULT_HOOKS) -> tuple[jax.Array, dict]:
        if hooks.experts is not None:
            y_BxLxD, stats = self._expert_parallel(x_BxLxD, hooks.experts.mesh, hooks.experts.axis)
            if self.shared is not None:
                y_BxLxD = y_BxLxD + self._shared(x_BxLxD, hooks)
            return checkpoint_name(y_BxLxD, "mlpwo"), stats
        bias_E = self._bias()
        x_TxD, logits_TxE, weights_TxK, experts_TxK, probs_TxE = _routed(x_BxLxD, self.router_DxE[...], self.k,
                                                                          self.router, self.norm_topk, bias_E)
        y_TxD, dropped = _run_experts(x_TxD, weights_TxK, experts_TxK, self._weights(x_TxD.dtype),
                                      self.capacity_factor, self.act, self._grouped_matmul(x_TxD), self.gather_rows)
        y_BxLxD = y_TxD.reshape(x_BxLxD.shape)
        if self.shared is not None:
            y_BxLxD = y_BxLxD + self._shared(x_BxLxD, hooks)
        return checkpoint_name(y_BxLxD, "mlpwo"), _stats(probs_TxE, experts_TxK, logits_TxE, dropped, bias_E=bias_E)

    def _bias(self) -> jax.Array | None:
        return None if self.router_bias_E is None else self.router_bias_E[...]

    def _expert_parallel(self, x_BxLxD, mesh, axis: str):
        """The routed experts with their weights split over mesh axis `axis`: (y [B, L, D], stats), under shard_map
        with every device's own tokens (module docstring)."""
        x_spec = activation_spec(("batch", "seq", "embed"), x_BxLxD.shape) or P()
        token_axes = tuple(a for dim in x_spec for a in ((dim,) if isinstance(dim, str) else (dim or ())))
        k, router, factor, act, gather_rows = self.k, self.router, self.capacity_factor, self.act, self.gather_rows
        norm_topk, ragged = self.norm_topk, self.ragged and not self.capacity_factor
        E = self.w_in_ExDxF.shape[0]
        gmm = self._grouped_matmul(x_BxLxD)

        def routed(x_BxLxD, router_DxE, bias_E, weights, gmm=gmm):
            x_TxD, logits_TxE, weights_TxK, experts_TxK, probs_TxE = _routed(x_BxLxD, router_DxE, k, router,
                                                                              norm_topk, bias_E)
            T, n = x_TxD.shape[0], jax.lax.axis_size(axis)
            mean = (lambda v: jax.lax.pmean(v, token_axes)) if token_axes else _identity  # noqa: E731
            if n == 1:  # no expert axis: this device's tokens through all the experts, without all-to-all
                y_TxD, dropped = _run_experts(x_TxD, weights_TxK, experts_TxK, weights, factor, act, gmm, gather_rows)
                return y_TxD.reshape(x_BxLxD.shape), _stats(probs_TxE, experts_TxK, logits_TxE, dropped, mean,
                                                            bias_E)
            cap = capacity(T, k, E, factor) if factor > 0 else None
            # capacity: every token's first choice before any token's second (as `_capacity` on one device)
            priority = jnp.arange(T * k).reshape(T, k).T.reshape(-1) if cap else None
            plan = ep.send_plan(experts_TxK.reshape(T * k), n, E // n, capacity=cap, priority_S=priority,
                                slots_per_token=k)
            rows_x, rows_e = ep.dispatch(jnp.repeat(x_TxD, k, axis=0), plan, axis, ragged=ragged)
            rows_y = _expert_mlp(rows_x, rows_e, weights, act, gmm, gather_rows)
            out_SxD = ep.combine(rows_y, plan, axis, ragged=ragged)
            y_TxD = jnp.einsum("tkd,tk->td", out_SxD.reshape(T, k, -1), weights_TxK.astype(out_SxD.dtype))
            # the router losses of the whole batch
            dropped = 1.0 - jnp.mean(plan.keep_S.astype(jnp.float32))
            return y_TxD.reshape(x_BxLxD.shape), _stats(probs_TxE, experts_TxK, logits_TxE, dropped, mean, bias_E)

        # The weights enter split as they lie over the token axes (FSDP's split) and are gathered inside, but for
        # the expert split: the gathers' transposes reduce-scatter the gradients, where weights taken in whole would
        # have every device sum the whole gradient of every expert it holds. Splits over other axes (tensor) are
        # undone before, by the partitioner: the tokens are the same on those devices.
        inside = set(token_axes) | {axis}
        spec = lambda axes, shape: _only(param_spec(axes, shape) or P(), inside)  # noqa: E731
        weights = self._weights(x_BxLxD.dtype)
        w_specs = tuple(None if w is None else spec(axes, w.shape) for w, axes in zip(weights, _WEIGHT_AXES))
        router_w = self.router_DxE[...]
        router_spec = spec(_ROUTER_AXES, router_w.shape)

        bias_E = self._bias()  # replicated: every device chooses with the whole bias

        def local(x_BxLxD, router_DxE, bias_E, weights):
            whole = lambda w, spec: None if w is None else _gather_but(w, spec, axis)  # noqa: E731
            if factor > 0:
                return routed(x_BxLxD, whole(router_DxE, router_spec), bias_E, tuple(map(whole, weights, w_specs)))
            # dropless: each grouped matmul takes its weight split and gathers it where it runs (`_regathered`)
            matmuls = tuple(functools.partial(_regathered, gmm, spec, axis) for spec in w_specs[:3])
            biases = tuple(map(whole, weights[3:], w_specs[3:]))
            return routed(x_BxLxD, whole(router_DxE, router_spec), bias_E, (*weights[:3], *biases), matmuls)

        run = _compat.shard_map(local, mesh=_compat.context_mesh(mesh), in_specs=(x_spec, router_spec, P(), w_specs),
                                out_specs=(x_spec, P()))
        return run(x_BxLxD, router_w, bias_E, weights)


def _zero_param(shape, axes, dtype) -> nnx.Param:
    """A parameter of zeros annotated with logical axes, drawing nothing from the model's random keys."""
    with _compat.no_eager_sharding():
        return nnx.Param(nnx.with_partitioning(_zeros, axes)(None, shape, dtype))


def _only(spec: P, axes: set[str]) -> P:
    """`spec` with every mesh axis outside `axes` dropped."""
    out = []
    for entry in spec:
        names = tuple(n for n in ((entry,) if isinstance(entry, str) else (entry or ())) if n in axes)
        out.append(names[0] if len(names) == 1 else (names or None))
    return P(*out)


def _gather_but(w: jax.Array, spec: P, keep: str) -> jax.Array:
    """Inside shard_map: `w`, split by `spec`, gathered along every dim but over mesh axis `keep`."""
    for dim, names in enumerate(spec):
        names = tuple(n for n in ((names,) if isinstance(names, str) else (names or ())) if n != keep)
        if names:
            w = jax.lax.all_gather(w, names, axis=dim, tiled=True)
    return w


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _regathered(gmm, spec, keep, x_RxD, w, sizes_E):
    """Inside shard_map: `gmm(x, _gather_but(w, spec, keep), sizes)` with the weight gathered where each pass uses
    it: in the forward once its rows exist, in the backward again (`_regathered_bwd`) rather than kept whole."""
    # gathered once its rows exist: w_out's gather waits for the activations, by when w_in's and w_gate's are done
    w, x_RxD = jax.lax.optimization_barrier((w, x_RxD))
    return gmm(x_RxD, _gather_but(w, spec, keep), sizes_E)


def _regathered_fwd(gmm, spec, keep, x_RxD, w, sizes_E):
    return _regathered(gmm, spec, keep, x_RxD, w, sizes_E), (x_RxD, w, sizes_E)


def _regathered_bwd(gmm, spec, keep, res, dy):
    """The gradients of one grouped matmul from its split weight, gathered here once `dy` exists (the barrier): no
    expert weight stays whole from the (recomputed) forward into the backward. Kept whole, w_in, w_gate and w_out
    were all live at once with the layer's activations, the step's peak. The gather's transpose reduce-scatters the
    weight's gradient."""
    x_RxD, w, sizes_E = res
    w_now, dy = jax.lax.optimization_barrier((w, dy))
    _, pull = jax.vjp(lambda x, w: gmm(x, _gather_but(w, spec, keep), sizes_E), x_RxD, w_now)
    dx, dw = pull(dy)
    # summed over the token axes the primal is not split over (data, say), as autodiff's own transpose would
    sums = _extra_axes(dx, x_RxD), _extra_axes(dw, w)
    # the split gradient bound to dx: reduce-scattered (on a multi-dim torus the TPU compiler runs that as an
    # all-reduce of the whole weight and a slice) before the backward goes on, not held whole until its slice is
    # stored into the stacked gradient at the end of the layer
    dx, dw = jax.lax.optimization_barrier((dx, dw))
    dx, dw = (jax.lax.psum(v, axes) if axes else v for v, axes in zip((dx, dw), sums))
    return dx, dw, np.zeros(sizes_E.shape, jax.dtypes.float0)


def _extra_axes(ct, primal) -> tuple[str, ...]:
    """Inside shard_map: the mesh axes cotangent `ct` varies over and `primal` does not."""
    return tuple(sorted(_compat.varying_axes(ct) - _compat.varying_axes(primal)))


_regathered.defvjp(_regathered_fwd, _regathered_bwd)


def _run_experts(x_TxD, weights_TxK, experts_TxK, weights, factor: float, act: str, gmm, gather_rows: bool = False):
    """The routed experts on one device's tokens, with all E experts' `weights` at hand: (y [T, D], the share of
    slots dropped), dropless (`factor` 0, grouped matmuls by `gmm`) or with a capacity."""
    if factor > 0:
        return _capacity(x_TxD, weights_TxK, experts_TxK, weights, factor, act)
    return _dropless(x_TxD, weights_TxK, experts_TxK, weights, act, gmm, gather_rows), jnp.zeros((), jnp.float32)


def _dropless(x_TxD, weights_TxK, experts_TxK, weights, act: str, gmm, gather_rows: bool = False):
    """Every slot computed: slots sorted by expert, two (three with SwiGLU) grouped matmuls, then unsorted. With
    `gather_rows` (XLA:CPU's path) and the weights whole here, as expert blocks (`_blocked`)."""
    T, K = experts_TxK.shape
    if gather_rows and not isinstance(gmm, tuple):
        return _blocked(x_TxD, weights_TxK, experts_TxK, weights, act, _head_rows(T * K, weights[0].shape[0]))
    x_SxD = jnp.repeat(x_TxD, K, axis=0)  # slot s = t * K + k
    out_SxD = _expert_mlp(x_SxD, experts_TxK.reshape(T * K), weights, act, gmm, gather_rows)
    return jnp.einsum("tkd,tk->td", out_SxD.reshape(T, K, -1), weights_TxK.astype(out_SxD.dtype))


# XLA:CPU's expert blocks (`_blocked`): each expert's block holds an even share of the slots (rounded up to 8 rows),
# the slots past it go through the overflow loop 128 at a time. Against blocks of 1.25x an even share with 256-row
# chunks, moe-tiny on the default corpus trained 1.02-1.07x faster (four alternating rounds; 1.5x and 2x blocks, or
# 0.75x, or 64-row chunks, were slower: benchmarks/RESULTS.md, "Mixture of experts on CPU").
HEAD_SHARE = 1.0  # an expert block's rows, as a share of the rows an even split gives each expert
OVERFLOW_CHUNK = 128  # rows a time through the loop over the slots past the expert blocks


def _head_rows(rows: int, groups: int, share: float | None = None) -> int:
    """Rows of each group's block: `share` (default HEAD_SHARE) x an even split's, rounded up to a multiple of 8, at
    most `rows`."""
    share = HEAD_SHARE if share is None else share
    return min(rows, 8 * math.ceil(share * rows / groups / 8))


def _blocked(x_TxD, weights_TxK, experts_TxK, weights, act: str, head: int):
    """The dropless experts as dense blocks: each expert's first `head` slots gathered straight into an
    [E, head, D] block (in slot order, zeros after), the MLP as batched matmuls over the experts, and each slot's
    output gathered back (`_blocked_mlp`). No [S, F] arrays, and XLA:CPU runs a batched matmul of a few large items
    at about a dense one's rate."""
    T, K = experts_TxK.shape
    S, E = T * K, weights[0].shape[0]
    expert_S = experts_TxK.reshape(S)
    # a counting sort: each slot's rank within its expert (slot order) places it, so no sort runs (XLA:CPU's sort of
    # 4,096 slots and the scatter that inverted it took 3-5x as long as this)
    at_S = ep.ranks_within_groups(expert_S, E)
    sizes_E = jnp.bincount(expert_S, length=E).astype(jnp.int32)
    start_E = jnp.cumsum(sizes_E) - sizes_E
    order_S = jnp.zeros((S,), jnp.int32).at[start_E[expert_S] + at_S].set(jnp.arange(S, dtype=jnp.int32),
                                                                           unique_indices=True)
    at_H = jnp.arange(head, dtype=order_S.dtype)
    slot_B = order_S[jnp.minimum(start_E[:, None] + at_H[None, :], S - 1)].reshape(E * head)  # block row -> slot
    in_B = (at_H[None, :] < sizes_E[:, None]).reshape(E * head)
    row_S, in_S = expert_S * head + jnp.minimum(at_S, head - 1), at_S < head  # slot -> block row
    x_SxD = jnp.repeat(x_TxD, K, axis=0)  # slot s = t * K + k
    blocks = _Blocks(slot_B, in_B, row_S, in_S, order_S, sizes_E)
    out_SxD = _blocked_mlp(x_SxD, blocks, weights, act, head, min(OVERFLOW_CHUNK, S))
    return jnp.einsum("tkd,tk->td", out_SxD.reshape(T, K, -1), weights_TxK.astype(out_SxD.dtype))


class _Blocks(NamedTuple):
    """Where each slot goes in the expert blocks (`_blocked`): block row -> slot (`slot_B`, `in_B` where the row
    holds one), slot -> block row (`row_S`, `in_S` where the slot is in its expert's block), and the slots sorted by
    expert (`order_S`, `sizes_E` each) for those past the blocks."""

    slot_B: jax.Array
    in_B: jax.Array
    row_S: jax.Array
    in_S: jax.Array
    order_S: jax.Array
    sizes_E: jax.Array


def _gather_rows(x_NxD, index_M, mask_M):
    """x[index[m]] where mask[m], else zero."""
    return jnp.where(mask_M[:, None], x_NxD[index_M], jnp.zeros((), x_NxD.dtype))


def _blocked_forward(x_SxD, b: _Blocks, weights, act: str, head: int, chunk: int):
    E = b.sizes_E.shape[0]
    x_ExHxD = _gather_rows(x_SxD, b.slot_B, b.in_B).reshape(E, head, -1)
    y_ExHxD, pull = jax.vjp(lambda x, w: _batched_mlp(x, w, act), x_ExHxD, weights)
    y_SxD = _gather_rows(y_ExHxD.reshape(E * head, -1), b.row_S, b.in_S)

    def body(e, first, end, y_SxD):  # a chunk of the slots past expert e's block, through its whole MLP
        slot_C, _ = _overflow_rows(b.order_S, first, end, chunk)
        out_CxD = _expert_rows_mlp(jnp.take(x_SxD, slot_C, axis=0, mode="clip"), _one_expert(weights, e), act)
        return y_SxD.at[slot_C].set(out_CxD.astype(y_SxD.dtype), mode="drop")

    return _each_chunk(b.sizes_E, chunk, body, y_SxD, skip=head), pull


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _blocked_mlp(x_SxD, b: _Blocks, weights, act: str, head: int, chunk: int):
    """Every slot of `x` [S, D] through its expert's MLP: each expert's first `head` slots as a block of the batched
    MLP, the slots past it (none while every expert holds at most its even share) `chunk` at a time through a loop
    with a run-time trip count, writing into the blocks' output. The backward takes the blocks' gradients from the
    batched MLP's VJP and the loop's into the same buffers: the gathers' gradients are gathers by the inverse map
    (where autodiff's would be a scatter-add, several times slower on XLA:CPU), and no buffer is zeroed or added for
    a loop that runs no chunk."""
    return _blocked_forward(x_SxD, b, weights, act, head, chunk)[0]


def _blocked_mlp_fwd(x_SxD, b: _Blocks, weights, act: str, head: int, chunk: int):
    y_SxD, pull = _blocked_forward(x_SxD, b, weights, act, head, chunk)
    return y_SxD, (x_SxD, b, weights, pull)


def _blocked_mlp_bwd(act: str, head: int, chunk: int, res, dy_SxD):
    x_SxD, b, weights, pull = res
    E = b.sizes_E.shape[0]
    dx_ExHxD, dw_blocks = pull(_gather_rows(dy_SxD, b.slot_B, b.in_B).reshape(E, head, -1))
    dx_SxD = _gather_rows(dx_ExHxD.reshape(E * head, -1), b.row_S, b.in_S)
    live = [w for w in weights if w is not None]
    # Inside shard_map, the blocks' weight gradients come back summed over the axes the weights do not vary over (as
    # autodiff's transpose sums them) while the loop's vary: those add up after the loop, summed the same way.
    apart = any(_extra_axes(dy_SxD, w) for w in live)
    dw = tuple(None if w is None else _varying_like(jnp.zeros(w.shape, jnp.float32) if apart
                                                      else g.astype(jnp.float32), x_SxD, dy_SxD, b.sizes_E, *live)
               for w, g in zip(weights, dw_blocks))

    def body(e, first, end, carry):
        dx_SxD, dw = carry
        slot_C, mine_C = _overflow_rows(b.order_S, first, end, chunk)
        dy_CxD = jnp.where(mine_C[:, None], jnp.take(dy_SxD, slot_C, axis=0, mode="clip"),
                           jnp.zeros((), dy_SxD.dtype))  # the rest add nothing
        x_CxD = jnp.take(x_SxD, slot_C, axis=0, mode="clip")
        _, vjp = jax.vjp(lambda x, one: _expert_rows_mlp(x, one, act), x_CxD, _one_expert(weights, e))
        dx_CxD, dw_e = vjp(dy_CxD)  # (the hidden values recomputed)
        dw = tuple(None if g is None else g.at[e].add(d[0].astype(jnp.float32)) for g, d in zip(dw, dw_e))
        return dx_SxD.at[slot_C].set(dx_CxD.astype(dx_SxD.dtype), mode="drop"), dw

    dx_SxD = _varying_like(dx_SxD, x_SxD, dy_SxD, b.sizes_E, *live)
    dx_SxD, dw = _each_chunk(b.sizes_E, chunk, body, (dx_SxD, dw), skip=head)
    psum = lambda v, primal: jax.lax.psum(v, axes) if (axes := _extra_axes(v, primal)) else v  # noqa: E731
    dw = tuple(None if g is None else psum(g, w).astype(w.dtype) for g, w in zip(dw, weights))
    if apart:
        dw = tuple(None if g is None else g + d for g, d in zip(dw, dw_blocks))
    float0 = lambda a: np.zeros(a.shape, jax.dtypes.float0)  # noqa: E731
    return psum(dx_SxD, x_SxD), _Blocks(*map(float0, b)), dw


_blocked_mlp.defvjp(_blocked_mlp_fwd, _blocked_mlp_bwd)


def _one_expert(weights, e):
    """Expert `e`'s weights, each with a leading axis of 1."""
    return tuple(None if w is None else jax.lax.dynamic_slice_in_dim(w, e, 1) for w in weights)


def _expert_rows_mlp(x_CxD, one, act: str):
    """Rows through one expert's MLP (`one`: `_one_expert`), as a block of one."""
    return _batched_mlp(x_CxD[None], one, act)[0]


def _overflow_rows(order_S, first, end, chunk: int):
    """The slots of sorted positions first .. first + chunk (the sort's `order`), and which of them are before `end`
    (past it, the index is S: gathers clip it to a real row, whose share the mask zeroes; scatters drop it)."""
    S = order_S.shape[0]
    at_C = first + jnp.arange(chunk, dtype=order_S.dtype)
    mine_C = at_C < end
    return jnp.where(mine_C, order_S[jnp.minimum(at_C, S - 1)], S), mine_C


def _batched_mlp(x_ExCxD, weights, act: str):
    """Every expert's MLP on its own [C, D] block of rows: batched matmuls over the experts."""
    w_in, w_gate, w_out, b_in, b_out = weights
    h_ExCxF = jnp.einsum("ecd,edf->ecf", x_ExCxD, w_in)
    if b_in is not None:
        h_ExCxF = h_ExCxF + b_in[:, None, :]
    gate_ExCxF = jnp.einsum("ecd,edf->ecf", x_ExCxD, w_gate) if w_gate is not None else None
    h_ExCxF, gate_ExCxF = _tag_hidden(h_ExCxF, gate_ExCxF)
    out_ExCxD = jnp.einsum("ecf,efd->ecd", _activate(h_ExCxF, gate_ExCxF, act), w_out)
    if b_out is not None:
        out_ExCxD = out_ExCxD + b_out[:, None, :]
    return out_ExCxD


def _capacity(x_TxD, weights_TxK, experts_TxK, weights, factor: float, act: str):
    """At most C slots per expert: (y [T, D], the share of slots dropped). Every token's first choice comes before
    any token's second (GShard), tokens in order within a choice, so overflow drops the later and lower choices."""
    T, K = experts_TxK.shape
    E = weights[0].shape[0]
    C = capacity(T, K, E, factor)
    experts_S = experts_TxK.T.reshape(K * T)  # slot s = k * T + t: choice-major priority
    position_S = ep.ranks_within_groups(experts_S, E)
    keep_S = position_S < C
    tokens_S = jnp.arange(K * T, dtype=jnp.int32) % T
    # Slots past C fall outside the buffer and are dropped by the scatter itself (mode="drop").
    x_ExCxD = jnp.zeros((E, C, x_TxD.shape[1]), x_TxD.dtype).at[experts_S, position_S].add(
        jnp.take(x_TxD, tokens_S, axis=0), mode="drop")
    out_ExCxD = _batched_mlp(x_ExCxD, weights, act)
    out_SxD = out_ExCxD[experts_S, jnp.minimum(position_S, C - 1)]
    combine_S = weights_TxK.T.reshape(K * T) * keep_S  # a dropped slot adds nothing
    out_KxTxD = (out_SxD * combine_S.astype(out_SxD.dtype)[:, None]).reshape(K, T, -1)
    return jnp.sum(out_KxTxD, axis=0), 1.0 - jnp.mean(keep_S.astype(jnp.float32))


def _expert_mlp(x_RxD, expert_R, weights, act: str, gmm, gather_rows: bool = False):
    """Each row through its expert's MLP by grouped matmuls (`gmm`, a "grouped_matmul" implementation, or one each
    for w_in, w_gate and w_out), in row order. `expert_R` holds indices into the stacked `weights` (w_in, w_gate,
    w_out, b_in, b_out; E experts); a row whose index is E (an empty row of an all-to-all buffer) is in no group and
    comes out as garbage the caller never reads. `gather_rows`: sort and unsort the rows by gathers both ways
    (`_permute_rows`), not a gather and a scatter."""
    w_in, w_gate, w_out, b_in, b_out = weights
    gmm_in, gmm_gate, gmm_out = gmm if isinstance(gmm, tuple) else (gmm,) * 3
    order_R, sizes_E = ep.group_rows(expert_R, w_in.shape[0])
    if gather_rows:
        inverse_R = jnp.zeros_like(order_R).at[order_R].set(jnp.arange(order_R.shape[0], dtype=order_R.dtype))
        x_RxD = _permute_rows(x_RxD, order_R, inverse_R)
    else:
        x_RxD = x_RxD[order_R]
    expert_R = expert_R[order_R]
    h_RxF = gmm_in(x_RxD, w_in, sizes_E)
    if b_in is not None:
        h_RxF = h_RxF + jnp.take(b_in, expert_R, axis=0, mode="clip")
    gate_RxF = gmm_gate(x_RxD, w_gate, sizes_E) if w_gate is not None else None
    h_RxF, gate_RxF = _tag_hidden(h_RxF, gate_RxF)
    out_RxD = gmm_out(_activate(h_RxF, gate_RxF, act), w_out, sizes_E)
    if b_out is not None:
        out_RxD = out_RxD + jnp.take(b_out, expert_R, axis=0, mode="clip")
    if gather_rows:
        return _permute_rows(out_RxD, inverse_R, order_R)  # back to row order
    return jnp.zeros_like(out_RxD).at[order_R].set(out_RxD)


@jax.custom_vjp
def _permute_rows(x_RxD, order_R, inverse_R):
    """`x[order]` for a permutation `order` whose inverse is `inverse`, with a gather for a gradient too (`g[inverse]`)
    where autodiff's is a scatter-add: XLA:CPU runs a scatter of rows several times slower than a gather (one MoE
    layer of moe-tiny, forward and backward: 13 ms against 22 with the sort undone by a scatter). Not on TPU: there
    the TPU compiler gave the expert-parallel llama-1b-width case 1 GiB more per chip with it (test_memory_tpu)."""
    return x_RxD[order_R]


def _permute_rows_fwd(x_RxD, order_R, inverse_R):
    return x_RxD[order_R], (order_R, inverse_R)


def _permute_rows_bwd(res, g_RxD):
    order_R, inverse_R = res
    none = np.zeros(order_R.shape, jax.dtypes.float0)
    return g_RxD[inverse_R], none, none


_permute_rows.defvjp(_permute_rows_fwd, _permute_rows_bwd)


def ragged_grouped_matmul(x_RxD, w_ExDxF, sizes_E, *, platform=None):
    """Rows `x` [R, D], sorted by group with `sizes_E` rows in each, each times its group's `w` [D, F]: XLA's ragged
    dot (a grouped-matmul kernel on TPU; XLA:CPU expands it into one dense matmul per group, E x the work)."""
    return jax.lax.ragged_dot(x_RxD, w_ExDxF, sizes_E)


def tiled_grouped_matmul(x_RxD, w_ExDxF, sizes_E, *, platform=None, tile: int = 128):
    """The same product as `ragged_grouped_matmul` by fixed tiles: the rows cut into tiles of `tile`, and one work
    item per (tile, group) pair that meets, at most R / tile + E - 1 of them, run as one batched matmul with each
    item's rows of other groups masked out, then summed back into their tiles. The work is that of the routed rows
    plus at most one tile per group; each item gathers its group's weights, so the working set holds
    (R / tile + E) x D x F of them (small models: the CPU's choice)."""
    R, D = x_RxD.shape
    E, _, F = w_ExDxF.shape
    tile = min(tile, 8 * -(-R // 8))
    n_tiles = -(-R // tile)
    items = n_tiles + E - 1
    end_E = jnp.cumsum(sizes_E)
    start_E = end_E - sizes_E
    first_E = start_E // tile
    count_E = jnp.where(sizes_E > 0, (jnp.maximum(end_E, 1) - 1) // tile - first_E + 1, 0)  # tiles each group meets
    done_E = jnp.cumsum(count_E)
    item_W = jnp.arange(items)
    group_W = jnp.minimum(jnp.searchsorted(done_E, item_W, side="right"), E - 1)
    tile_W = jnp.minimum(first_E[group_W] + item_W - (done_E - count_E)[group_W], n_tiles - 1)
    row_WxT = tile_W[:, None] * tile + jnp.arange(tile)[None, :]
    mine_WxT = ((item_W < done_E[-1])[:, None] & (row_WxT >= start_E[group_W][:, None])
                & (row_WxT < end_E[group_W][:, None]))
    tiles_NxTxD = jnp.pad(x_RxD, ((0, n_tiles * tile - R), (0, 0))).reshape(n_tiles, tile, D)
    x_WxTxD = jnp.where(mine_WxT[..., None], tiles_NxTxD[tile_W], jnp.zeros((), x_RxD.dtype))
    y_WxTxF = jnp.einsum("wtd,wdf->wtf", x_WxTxD, w_ExDxF[group_W])
    y_NxTxF = jnp.zeros((n_tiles, tile, F), y_WxTxF.dtype).at[tile_W].add(y_WxTxF)
    return y_NxTxF.reshape(n_tiles * tile, F)[:R]


def _each_chunk(sizes_E, chunk: int, body, carry, skip: int = 0):
    """`carry = body(e, first_row, group_end, carry)` for every chunk of `chunk` rows of every group past its first
    `skip` rows, group by group (row-sorted groups of `sizes_E` rows): as many chunks as the groups fill, a loop with
    a run-time trip count."""
    end_E = jnp.cumsum(sizes_E)
    start_E = end_E - sizes_E + skip
    chunks_E = (jnp.maximum(sizes_E - skip, 0) + chunk - 1) // chunk
    done_E = jnp.cumsum(chunks_E)

    def one(i, carry):  # chunk i of them all: chunk j of group e
        e = jnp.searchsorted(done_E, i, side="right")
        return body(e, start_E[e] + (i - done_E[e] + chunks_E[e]) * chunk, end_E[e], carry)

    return jax.lax.fori_loop(0, done_E[-1], one, carry)


def _chunk_rows(x_RxD, first, end, chunk: int):
    """(the `chunk` rows from `first` on, which of them are in the group ending at row `end`, where they start). A
    window past the last row is moved back to end there (the rows before `first` are masked)."""
    start = jnp.minimum(first, x_RxD.shape[0] - chunk)
    rows = start + jnp.arange(chunk)
    return jax.lax.dynamic_slice_in_dim(x_RxD, start, chunk), (rows >= first) & (rows < end), start


def _varying_like(carry, *operands):
    """Inside shard_map: a loop's initial `carry` typed as varying over every mesh axis the `operands` vary over, as
    the carry the loop body returns is (a loop's carry keeps one type)."""
    axes = tuple(sorted(frozenset().union(*(_compat.varying_axes(o) for o in operands))))
    return jax.lax.pcast(carry, axes, to="varying") if axes else carry


def _heads(x_RxD, sizes_E, head: int):
    """Each group's first `head` rows as a [E, head, D] block (zero past the group's end), and for every row of
    `x` (group, index into the flattened blocks, whether it is in one)."""
    R = x_RxD.shape[0]
    end_E = jnp.cumsum(sizes_E)
    start_E = end_E - sizes_E
    at_H = jnp.arange(head, dtype=sizes_E.dtype)
    in_ExH = at_H[None, :] < sizes_E[:, None]
    rows_ExH = jnp.minimum(start_E[:, None] + at_H[None, :], R - 1)
    block_ExHxD = jnp.where(in_ExH[..., None], x_RxD[rows_ExH], jnp.zeros((), x_RxD.dtype))
    row_R = jnp.arange(R, dtype=sizes_E.dtype)
    group_R = jnp.minimum(jnp.searchsorted(end_E, row_R, side="right"), sizes_E.shape[0] - 1)
    at_R = row_R - start_E[group_R]
    in_R = (at_R < head) & (row_R < end_E[-1])
    return block_ExHxD, group_R * head + jnp.minimum(at_R, head - 1), in_R


def _looped_forward(x_RxD, w_ExDxF, sizes_E, chunk: int, head: int, heads=None):
    """The product; `heads`: `_heads(x_RxD, sizes_E, head)` where the caller has it."""
    dtype = jnp.result_type(x_RxD, w_ExDxF)
    y_RxF = _varying_like(jnp.zeros((x_RxD.shape[0], w_ExDxF.shape[2]), dtype), x_RxD, w_ExDxF, sizes_E)
    if head:
        block_ExHxD, flat_R, in_R = _heads(x_RxD, sizes_E, head) if heads is None else heads
        y_ExHxF = jnp.einsum("ehd,edf->ehf", block_ExHxD, w_ExDxF).astype(dtype)
        y_RxF = jnp.where(in_R[:, None], y_ExHxF.reshape(-1, y_ExHxF.shape[2])[flat_R], y_RxF)

    def body(e, first, end, y_RxF):
        x_CxD, mine_C, start = _chunk_rows(x_RxD, first, end, chunk)
        old_CxF = jax.lax.dynamic_slice_in_dim(y_RxF, start, chunk)
        new_CxF = jnp.dot(x_CxD, w_ExDxF[e]).astype(dtype)
        return jax.lax.dynamic_update_slice_in_dim(y_RxF, jnp.where(mine_C[:, None], new_CxF, old_CxF), start, 0)

    return _each_chunk(sizes_E, chunk, body, y_RxF, skip=head)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _looped(x_RxD, w_ExDxF, sizes_E, chunk: int, head: int):
    return _looped_forward(x_RxD, w_ExDxF, sizes_E, chunk, head)


def _looped_fwd(x_RxD, w_ExDxF, sizes_E, chunk: int, head: int):
    heads = _heads(x_RxD, sizes_E, head) if head else None
    # the heads' block of x is kept for the backward's dw
    return (_looped_forward(x_RxD, w_ExDxF, sizes_E, chunk, head, heads),
            (x_RxD, w_ExDxF, sizes_E, heads[0] if head else None))


def _looped_bwd(chunk: int, head: int, res, dy_RxF):
    """dx: the same product with each expert's weights transposed; dw[e]: x^T dy over e's rows (fp32), the heads'
    share as one batched matmul, the rest summed chunk by chunk."""
    x_RxD, w_ExDxF, sizes_E, x_ExHxD = res
    heads = _heads(dy_RxF, sizes_E, head) if head else None
    dx_RxD = _looped_forward(dy_RxF, jnp.swapaxes(w_ExDxF, 1, 2), sizes_E, chunk, head, heads).astype(x_RxD.dtype)
    dw = _varying_like(jnp.zeros(w_ExDxF.shape, jnp.float32), x_RxD, dy_RxF, sizes_E)
    if head:
        dw = dw + jnp.einsum("ehd,ehf->edf", x_ExHxD, heads[0], preferred_element_type=jnp.float32)

    def body(e, first, end, dw_ExDxF):
        x_CxD, mine_C, start = _chunk_rows(x_RxD, first, end, chunk)
        dy_CxF = jax.lax.dynamic_slice_in_dim(dy_RxF, start, chunk)
        x_CxD = jnp.where(mine_C[:, None], x_CxD, jnp.zeros((), x_CxD.dtype))
        return dw_ExDxF.at[e].add(jnp.dot(x_CxD.T, dy_CxF, preferred_element_type=jnp.float32))

    dw = _each_chunk(sizes_E, chunk, body, dw, skip=head).astype(w_ExDxF.dtype)
    # summed over the mesh axes the primal does not vary over, as autodiff's own transpose would
    dx_RxD, dw = (jax.lax.psum(v, axes) if axes else v
                  for v, axes in ((dx_RxD, _extra_axes(dx_RxD, x_RxD)), (dw, _extra_axes(dw, w_ExDxF))))
    return dx_RxD, dw, np.zeros(sizes_E.shape, jax.dtypes.float0)


_looped.defvjp(_looped_fwd, _looped_bwd)


def looped_grouped_matmul(x_RxD, w_ExDxF, sizes_E, *, platform=None, chunk: int = 256, head: float | int = 1.25):
    """The same product as `ragged_grouped_matmul`: each group's first `head` rows as one batched matmul over the
    groups ([E, head, D] x [E, D, F]), and the rows past them by a loop over chunks of `chunk` rows, one plain
    [chunk, D] x [D, F] matmul each, as many as the groups fill (a run-time trip count: none when every group fits
    its head, whatever the routing). A float `head` is that share of the rows an even split gives each group
    (R / E), rounded up to a multiple of 8; 0 runs every row through the loop. Its backward (a custom VJP: a loop
    with a run-time trip count has no reverse-mode rule) does the same: dx with the weights transposed, dw[e] as x^T
    dy over the heads and then the chunks. XLA:CPU runs a batched matmul of a few large items, or a plain one, at
    about the rate of one dense matmul, where many small matmuls (chunks, or the tiled version's items) run at
    about half of it (benchmarks/RESULTS.md, "Mixture of experts on CPU"). The CPU's choice; rows past the last
    group stay zero."""
    R = x_RxD.shape[0]
    if isinstance(head, float):
        head = _head_rows(R, w_ExDxF.shape[0], head)
    return _looped(x_RxD, w_ExDxF, sizes_E, max(1, min(chunk, R)), max(0, min(int(head), R)))


register("grouped_matmul", "xla", ragged_grouped_matmul)
register("grouped_matmul", "tiled", tiled_grouped_matmul)
register("grouped_matmul", "loop", looped_grouped_matmul)


def describe(cfg, mesh_shape, platform: str | None = None) -> str:
    """The start-up line of an MoE run (`cfg` a TrainConfig): experts per device, token slots per expert in a step
    (on average: dropless takes them all, a capacity at most its C per device's group), and with `expert` > 1 the
    bytes each device sends by all-to-all per step (dispatch and combine, forward and backward: 4 per MoE layer and
    microbatch, the dense blocks of jaxperf.parallel.expert, less the block a device keeps; dropless, a block holds
    min(k, E / n) slots of each of a device's tokens). With the ragged all-to-all (`model.ragged_all_to_all`, as
    settled for the mesh's platform: `platform`) the dropless bytes are those of the routed slots under balanced
    routing, (n - 1) / n of a device's slots. Either way each pass is charged a row's 4-byte expert id (only the
    forward dispatch sends ids), and remat's recomputed forward is not counted."""
    m = cfg.model.resolved()
    n = int(mesh_shape.get("expert", 1))
    layers = sum(is_moe_layer(m, i) for i in range(m.n_layers))
    tokens = cfg.batch_size * cfg.train_seq_len  # per step, over all devices
    slots = tokens * m.experts_per_token
    line = (f"moe: {layers} of {m.n_layers} layers, {m.n_experts} experts (top-{m.experts_per_token}"
            f"{f', {m.n_shared_experts} shared' if m.n_shared_experts else ''}), {m.n_experts // n} per device over "
            f"expert={n}; {slots / m.n_experts:.0f} token slots per expert per layer and step on average")
    if m.capacity_factor:
        line += f", capacity factor {m.capacity_factor:g}"
    if n > 1:
        groups = math.prod(int(mesh_shape.get(a, 1)) for a in ("data", "fsdp", "expert", "seq")) * cfg.microbatches
        local = tokens // groups  # a device's tokens in one microbatch
        rows = (m.n_experts // n * capacity(local, m.experts_per_token, m.n_experts, m.capacity_factor)
                if m.capacity_factor else ep.dropless_block_rows(local, m.experts_per_token, m.n_experts // n))
        row = m.d_model * jnp.dtype(m.dtype).itemsize + 4  # a row and its expert id
        ragged = not m.capacity_factor and (for_platform(m, platform) if platform else m).ragged_all_to_all
        if ragged:
            sent = 4 * layers * cfg.microbatches * local * m.experts_per_token * (n - 1) / n * row
            line += (f"; ragged all-to-all {sent / 2**20:.1f} MiB sent per device per step with balanced routing "
                     f"(blocks of {rows} rows received)")
        else:
            sent = 4 * layers * cfg.microbatches * (n - 1) * rows * row
            line += f"; all-to-all {sent / 2**20:.1f} MiB sent per device per step ({rows} rows per block)"
    return line
