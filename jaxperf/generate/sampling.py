"""Choosing the next token from logits: greedy, temperature, top-k, top-p (nucleus), in that order.

    token_B = sample(key, logits_BxV, temperature=0.8, top_k=40, top_p=0.95)

Every setting is a traced array, not a Python constant, so changing the temperature or k between calls reuses the
compiled program. A setting is a scalar (all rows) or a [B] array (one value per row, as when a server batches
requests with different settings); `key` is one key or a [B] array of keys, one per row. `temperature <= 0` means greedy (argmax of the raw logits); `top_k <= 0` and `top_p >= 1` switch
those filters off. Filters set the logits they drop to -inf; the survivors keep their relative weights.

Legend: B batch (rows), V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -jnp.inf


def _per_row(x, logits_BxV: jax.Array, dtype) -> jax.Array:
    """A scalar or [B] setting as a [B, 1] column that broadcasts against the logits."""
    return jnp.broadcast_to(jnp.asarray(x, dtype), logits_BxV.shape[:-1])[..., None]


def apply_top_k(logits_BxV: jax.Array, k) -> jax.Array:
    """Keep the k largest logits of each row (ties with the k-th are kept too); k <= 0 keeps all."""
    V = logits_BxV.shape[-1]
    k_Bx1 = _per_row(k, logits_BxV, jnp.int32)
    k_Bx1 = jnp.where(k_Bx1 <= 0, V, jnp.minimum(k_Bx1, V))
    sorted_BxV = jnp.sort(logits_BxV, axis=-1)[..., ::-1]
    kth_Bx1 = jnp.take_along_axis(sorted_BxV, k_Bx1 - 1, axis=-1)
    return jnp.where(logits_BxV >= kth_Bx1, logits_BxV, NEG_INF)


def nucleus_mask(probs_BxV: jax.Array, p) -> jax.Array:
    """True for the nucleus of each row: the most probable tokens, in decreasing order, until their mass reaches p.

    A token belongs when the mass of the tokens ranked before it is below p, so the set is the smallest one whose
    mass is >= p and it always holds the most probable token (also for p <= 0).
    """
    order_BxV = jnp.argsort(-probs_BxV, axis=-1)
    sorted_BxV = jnp.take_along_axis(probs_BxV, order_BxV, axis=-1)
    before_BxV = jnp.cumsum(sorted_BxV, axis=-1) - sorted_BxV
    keep_sorted = before_BxV < _per_row(p, probs_BxV, probs_BxV.dtype)
    keep_sorted = keep_sorted.at[..., 0].set(True)
    rows = jnp.arange(probs_BxV.shape[0])[:, None]
    return jnp.zeros(probs_BxV.shape, bool).at[rows, order_BxV].set(keep_sorted)


def apply_top_p(logits_BxV: jax.Array, p) -> jax.Array:
    """Keep the nucleus of mass p (see `nucleus_mask`); p >= 1 keeps all."""
    probs = jax.nn.softmax(logits_BxV.astype(jnp.float32), axis=-1)
    keep = nucleus_mask(probs, p) | (_per_row(p, probs, jnp.float32) >= 1.0)
    return jnp.where(keep, logits_BxV, NEG_INF)


def filter_logits(logits_BxV: jax.Array, temperature=1.0, top_k=0, top_p=1.0) -> jax.Array:
    """Temperature, then top-k, then top-p, in fp32: the logits `sample` draws from (for temperature > 0)."""
    t_Bx1 = _per_row(temperature, logits_BxV, jnp.float32)
    logits = logits_BxV.astype(jnp.float32) / jnp.where(t_Bx1 > 0, t_Bx1, 1.0)
    return apply_top_p(apply_top_k(logits, top_k), top_p)


def sample(key: jax.Array, logits_BxV: jax.Array, temperature=1.0, top_k=0, top_p=1.0) -> jax.Array:
    """One token per row, int32 [B]: argmax where temperature <= 0, else a draw from the filtered distribution."""
    greedy_B = jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    filtered_BxV = filter_logits(logits_BxV, temperature, top_k, top_p)
    if key.ndim == 0:
        drawn_B = jax.random.categorical(key, filtered_BxV, axis=-1)
    else:  # one key per row
        drawn_B = jax.vmap(lambda k, row_V: jax.random.categorical(k, row_V))(key, filtered_BxV)
    t_B = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), greedy_B.shape)
    return jnp.where(t_B > 0, drawn_B.astype(jnp.int32), greedy_B)


def check_settings(temperature: float, top_k: int, top_p: float) -> None:
    """Raise ValueError, before compiling, for settings that cannot mean anything (one row's settings)."""
    if not temperature >= 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 = greedy)")
    if int(top_k) != top_k or top_k < 0:
        raise ValueError(f"top_k={top_k} must be a non-negative integer (0 = off)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must lie in (0, 1] (1 = off)")
