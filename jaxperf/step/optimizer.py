"""AdamW with linear warm-up and cosine decay (or a constant learning rate), global-norm clipping, and no weight
decay on norms and biases."""

from __future__ import annotations

from typing import Any

import optax

from jaxperf.config import OptimConfig


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


def make_optimizer(cfg: OptimConfig, max_steps: int, decay_mask: Any = None):
    """(tx, schedule). `decay_mask` is a pytree of bools like the params (True = apply weight decay)."""
    schedule = lr_schedule(cfg, max_steps)
    parts = []
    if cfg.grad_clip and cfg.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(cfg.grad_clip))
    parts.append(
        optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask)
    )
    return optax.chain(*parts), schedule
