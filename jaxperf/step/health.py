"""Numerical health inside the step: skip non-finite or spiking updates, and dynamic loss scaling for fp16.

All of it runs on the device as part of the jitted step (no host round trip). The decision is a select between the
new and the old parameters/optimizer state, so a skipped step leaves them bit-for-bit unchanged, unlike
`optax.apply_if_finite`, which eventually applies a bad update. The counters live in `TrainState.health` and so are
checkpointed with everything else.

Loss scaling: the loss is multiplied by `scale` before differentiation and the gradients divided by it afterwards; an
overflow (non-finite gradient) halves the scale and skips the step; `growth_interval` clean steps in a row double it.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxperf.config import ConfigError


@dataclass(frozen=True)
class HealthOptions:
    skip_nonfinite: bool = True  # skip updates whose loss or gradients are not finite
    spike_sigma: float = 0.0  # skip when loss > mean + sigma * std of the last `spike_window` losses (0 = off)
    spike_window: int = 100
    loss_scale: bool = False  # dynamic loss scaling (for float16 compute)
    loss_scale_init: float = 2.0**15
    growth_interval: int = 2000
    min_loss_scale: float = 1.0

    @classmethod
    def from_config(cls, cfg) -> HealthOptions:
        """The settings of a TrainConfig: loss scaling is dynamic for float16 compute unless `loss_scale` says."""
        if cfg.loss_scale not in ("auto", "dynamic", "none"):
            raise ConfigError(f"loss_scale={cfg.loss_scale!r} is not one of auto, dynamic, none")
        scaling = cfg.loss_scale == "dynamic" or (cfg.loss_scale == "auto" and cfg.model.dtype == "float16")
        return cls(skip_nonfinite=cfg.skip_nonfinite, spike_sigma=cfg.spike_sigma, spike_window=cfg.spike_window,
                   loss_scale=scaling)


def init_health(opts: HealthOptions) -> dict[str, jax.Array]:
    return {
        "skipped": jnp.zeros((), jnp.int32),  # total skipped updates
        "consecutive": jnp.zeros((), jnp.int32),  # skipped in a row
        "loss_scale": jnp.asarray(opts.loss_scale_init if opts.loss_scale else 1.0, jnp.float32),
        "good_steps": jnp.zeros((), jnp.int32),  # clean steps since the scale last changed
        "window": jnp.zeros((max(opts.spike_window, 1),), jnp.float32),  # recent accepted losses (ring buffer)
        "window_count": jnp.zeros((), jnp.int32),
    }


def all_finite(tree) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.stack(leaves).all() if leaves else jnp.asarray(True)


def is_spike(health, loss, opts: HealthOptions) -> jax.Array:
    if opts.spike_sigma <= 0:
        return jnp.asarray(False)
    w, n = health["window"], health["window_count"]
    full = n >= w.shape[0]
    mean = jnp.mean(w)
    std = jnp.sqrt(jnp.maximum(jnp.mean(jnp.square(w - mean)), 1e-12))
    return full & (loss > mean + opts.spike_sigma * std)


def update_health(health, *, ok, finite, loss, opts: HealthOptions):
    """New counters after a step whose update was applied iff `ok` (finite: gradients were finite)."""
    skipped = jnp.logical_not(ok)
    new = dict(health)
    new["skipped"] = health["skipped"] + skipped.astype(jnp.int32)
    new["consecutive"] = jnp.where(skipped, health["consecutive"] + 1, 0)
    if opts.loss_scale:
        grow = finite & (health["good_steps"] + 1 >= opts.growth_interval)
        scale = jnp.where(finite, jnp.where(grow, health["loss_scale"] * 2.0, health["loss_scale"]),
                          jnp.maximum(health["loss_scale"] / 2.0, opts.min_loss_scale))
        new["loss_scale"] = scale
        new["good_steps"] = jnp.where(finite & ~grow, health["good_steps"] + 1, 0)
    if opts.spike_sigma > 0:
        W = health["window"].shape[0]
        slot = health["window_count"] % W
        new["window"] = jnp.where(ok, health["window"].at[slot].set(loss), health["window"])
        new["window_count"] = health["window_count"] + ok.astype(jnp.int32)
    return new


def select(ok, new_tree, old_tree):
    """`new` where ok else `old`, leaf by leaf (a skipped step keeps the old values bit for bit)."""
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_tree, old_tree)
