"""AdamW with linear warm-up and cosine decay (or a constant learning rate), global-norm clipping, and no weight
decay on norms and biases; the MoE router bias (loss-free balancing) moved by the sign of its load signal."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxperf.config import OptimConfig

ROUTER_BIAS = "router_bias_E"  # the parameter name of an MoE layer's balancing bias (jaxperf.models.moe)


def lr_schedule(cfg: OptimConfig, max_steps: int) -> optax.Schedule:
    """`cfg.schedule`: "warmup_cosine" is a linear warm-up to `lr` over `warmup_steps`, then cosine decay to
    `min_lr_ratio * lr` at `decay_steps`; "constant" is `lr` at every step.

    Step 0 already gets lr / warmup_steps (a first update with learning rate 0 would be wasted).
    """
    if cfg.schedule == "constant":
        return optax.constant_schedule(cfg.lr)
    decay_steps = max(cfg.decay_steps or max_steps, cfg.warmup_steps + 1)
    base = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.lr,
        warmup_steps=cfg.warmup_steps,
        decay_steps=decay_steps,
        end_value=cfg.lr * cfg.min_lr_ratio,
    )
    return lambda step: base(step + 1)


def is_router_bias(path) -> bool:
    """Whether the leaf at `path` (a key path of the parameter tree) is an MoE layer's router bias."""
    if not path:
        return False
    last = path[-1]
    return str(getattr(last, "key", getattr(last, "name", last))) == ROUTER_BIAS


def router_bias_mask(params: Any) -> Any:
    """A tree of bools like `params`: True at the MoE router biases."""
    return jax.tree_util.tree_map_with_path(lambda path, _: is_router_bias(path), params)


def without_router_bias(grads: Any) -> Any:
    """`grads` with the router biases' load signals zeroed: what a gradient norm should measure."""
    return jax.tree_util.tree_map_with_path(lambda path, g: jnp.zeros_like(g) if is_router_bias(path) else g, grads)


def with_router_bias(tx: optax.GradientTransformation, rate: float) -> optax.GradientTransformation:
    """`tx` for every parameter but the MoE router biases, which move by `-rate * sign(g)` instead (loss-free load
    balancing, DeepSeek-V3): their "gradient" is each expert's share of the step's slots over an even share
    (`jaxperf.models.moe.bias_signal`), so a busy expert's bias falls and an idle one's rises. `tx` sees zeros there
    (no moment, no clipping share, no decay); rate 0 keeps the biases frozen. The optimizer state is `tx`'s own."""

    def update(grads, state, params=None):
        mask = router_bias_mask(grads)
        inner = jax.tree.map(lambda g, m: jnp.zeros_like(g) if m else g, grads, mask)
        updates, state = tx.update(inner, state, params)
        updates = jax.tree.map(lambda u, g, m: (-rate * jnp.sign(g)).astype(u.dtype) if m else u, updates, grads, mask)
        return updates, state

    return optax.GradientTransformation(tx.init, update)


def make_optimizer(cfg: OptimConfig, max_steps: int, decay_mask: Any = None, router_bias_rate: float | None = None):
    """(tx, schedule). `decay_mask` is a pytree of bools like the params (True = apply weight decay);
    `router_bias_rate` (a model with router biases: `model.router_bias_update_rate`) wraps the optimizer in
    `with_router_bias`."""
    schedule = lr_schedule(cfg, max_steps)
    parts = []
    if cfg.grad_clip and cfg.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(cfg.grad_clip))
    parts.append(
        optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask)
    )
    tx = optax.chain(*parts)
    if router_bias_rate is not None:
        tx = with_router_bias(tx, router_bias_rate)
    return tx, schedule
