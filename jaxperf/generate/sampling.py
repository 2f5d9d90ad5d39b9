"""Choosing the next token from logits: greedy, temperature, top-k, top-p (nucleus), in that order.

    token_B = sample(key, logits_BxV, temperature=0.8, top_k=40, top_p=0.95)

Every setting is a traced array, not a Python constant, so changing the temperature or k between calls reuses the
compiled program. A setting is a scalar (all rows) or a [B] array (one value per row, as when a server batches
requests with different settings); `key` is one key or a [B] array of keys, one per row. `temperature <= 0` means
greedy (argmax of the raw logits); `top_k <= 0` and `top_p >= 1` switch those filters off. Filters set the logits
they drop to -inf; the survivors keep their relative weights. Neither filter sorts the vocabulary: each finds its
threshold by a bitwise search (`_largest_threshold`), which is what keeps sampling cheap next to a decode step.
A draw is the Gumbel-max trick, argmax(logits + Gumbel noise), the draw `jax.random.categorical` makes, and every
argmax is `first_argmax`, which XLA:CPU vectorizes.

Legend: B batch (rows), V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -jnp.inf


def _per_row(x, logits_BxV: jax.Array, dtype) -> jax.Array:
    """A scalar or [B] setting as a [B, 1] column that broadcasts against the logits."""
    return jnp.broadcast_to(jnp.asarray(x, dtype), logits_BxV.shape[:-1])[..., None]


def _sortable_u32(x: jax.Array) -> jax.Array:
    """float32 -> uint32 with the same order (negative floats below positive ones), for the searches below."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    negative = (bits >> 31) == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def _largest_threshold(keys_BxV: jax.Array, enough) -> jax.Array:
    """Per row, the largest uint32 t with enough(keys >= t) true, found bit by bit (32 masked reductions, no sort).

    `enough(mask_BxV) -> [B] bool` must be monotone: true for t = 0 and, once false, false for every larger t. The
    answer is exact: it is one of the row's keys (the k-th largest, or the last one the nucleus needs).
    """
    def bit(i, t_B):
        cand_B = t_B | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))
        return jnp.where(enough(keys_BxV >= cand_B[:, None]), cand_B, t_B)

    return jax.lax.fori_loop(0, 32, bit, jnp.zeros(keys_BxV.shape[:-1], jnp.uint32))


def apply_top_k(logits_BxV: jax.Array, k) -> jax.Array:
    """Keep the k largest logits of each row (ties with the k-th are kept too); k <= 0 keeps all.

    The k-th largest value is found by a bitwise search over the values' order (see `_largest_threshold`), not by
    sorting the row: sorting a vocabulary per row per step costs more than the rest of a small model's decode step.
    """
    V = logits_BxV.shape[-1]
    k_B = _per_row(k, logits_BxV, jnp.int32)[..., 0]
    k_B = jnp.where(k_B <= 0, V, jnp.minimum(k_B, V))
    keys = _sortable_u32(logits_BxV)
    kth_B = _largest_threshold(keys, lambda m: jnp.sum(m, axis=-1, dtype=jnp.int32) >= k_B)
    return jnp.where(keys >= kth_B[:, None], logits_BxV, NEG_INF)


def nucleus_mask(probs_BxV: jax.Array, p) -> jax.Array:
    """True for the nucleus of each row: the most probable tokens, in decreasing order, until their mass reaches p.

    A token belongs when the mass of the tokens more probable than it is below p, so the set is the smallest one whose
    mass is >= p and it always holds the most probable token (also for p <= 0); tokens as probable as the last one
    taken are taken too. Found as a probability threshold (the largest t with mass(probs >= t) >= p) by a bitwise
    search, without sorting.
    """
    probs = probs_BxV.astype(jnp.float32)
    p_B = _per_row(p, probs, jnp.float32)[..., 0]
    keys = _sortable_u32(jnp.maximum(probs, 0.0))
    top_B = jnp.max(keys, axis=-1)
    t_B = _largest_threshold(keys, lambda m: jnp.sum(jnp.where(m, probs, 0.0), axis=-1) >= p_B)
    return keys >= jnp.minimum(t_B, top_B)[:, None]


def apply_top_p(logits_BxV: jax.Array, p) -> jax.Array:
    """Keep the nucleus of mass p (see `nucleus_mask`); p >= 1 keeps all."""
    probs = jax.nn.softmax(logits_BxV.astype(jnp.float32), axis=-1)
    keep = nucleus_mask(probs, p) | (_per_row(p, probs, jnp.float32) >= 1.0)
    return jnp.where(keep, logits_BxV, NEG_INF)


def filter_logits(logits_BxV: jax.Array, temperature=1.0, top_k=0, top_p=1.0) -> jax.Array:
    """Temperature, then top-k, then top-p, in fp32: the logits `sample` draws from (for temperature > 0).

    A filter runs only when some row asks for it (`lax.cond`), so rows without top-k or top-p cost nothing extra.
    Scaled logits are clipped to finite values, so a tiny temperature cannot turn them into inf and NaN.
    """
    t_Bx1 = _per_row(temperature, logits_BxV, jnp.float32)
    x = logits_BxV.astype(jnp.float32)
    big = jnp.finfo(jnp.float32).max / 4
    scaled = jnp.clip(x / jnp.where(t_Bx1 > 0, t_Bx1, 1.0), -big, big)
    x = jnp.where(jnp.isfinite(x), scaled, x)  # -inf (never sampled) stays -inf
    k_B = _per_row(top_k, x, jnp.int32)
    p_B = _per_row(top_p, x, jnp.float32)
    x = jax.lax.cond(jnp.any(k_B > 0), lambda y: apply_top_k(y, k_B[..., 0]), lambda y: y, x)
    return jax.lax.cond(jnp.any(p_B < 1.0), lambda y: apply_top_p(y, p_B[..., 0]), lambda y: y, x)


def first_argmax(x_BxV: jax.Array) -> jax.Array:
    """`jnp.argmax(x, axis=-1)` as int32 (the first index of the maximum; the first NaN if there is one), written as
    a max and a min over the row rather than XLA's variadic (value, index) reduction, which XLA:CPU does not
    vectorize: at 32 rows over a 256-token vocabulary it was a fifth of a decode step."""
    m_Bx1 = jnp.max(x_BxV, axis=-1, keepdims=True)
    hit_BxV = (x_BxV == m_Bx1) | jnp.isnan(x_BxV)
    iota_V = jnp.arange(x_BxV.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where(hit_BxV, iota_V, x_BxV.shape[-1]), axis=-1)


def sample(key: jax.Array, logits_BxV: jax.Array, temperature=1.0, top_k=0, top_p=1.0) -> jax.Array:
    """One token per row, int32 [B]: argmax where temperature <= 0, else a draw from the filtered distribution.

    When every row is greedy the filters and the draw are skipped (`lax.cond`).
    """
    greedy_B = first_argmax(logits_BxV)
    t_B = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), greedy_B.shape)

    def draw(_):
        filtered_BxV = filter_logits(logits_BxV, temperature, top_k, top_p)
        # The Gumbel-max draw (what jax.random.categorical computes, written out so its argmax is first_argmax).
        if key.ndim == 0:
            gumbel_BxV = jax.random.gumbel(key, filtered_BxV.shape, filtered_BxV.dtype)
        else:  # one key per row
            gumbel_BxV = jax.vmap(lambda k: jax.random.gumbel(k, filtered_BxV.shape[-1:], filtered_BxV.dtype))(key)
        drawn_B = first_argmax(filtered_BxV + gumbel_BxV)
        return jnp.where(t_B > 0, drawn_B, greedy_B)

    return jax.lax.cond(jnp.any(t_B > 0), draw, lambda _: greedy_B, None)


MAX_TEMPERATURE = 100.0  # far past uniform for any trained model; a bound so that every setting has a range


def check_settings(temperature: float, top_k: int, top_p: float, vocab_size: int | None = None) -> None:
    """Raise ValueError, before compiling, for settings that cannot mean anything (one row's settings).

    With `vocab_size`, top_k must also lie within the vocabulary.
    """
    if not 0 <= temperature <= MAX_TEMPERATURE:
        raise ValueError(f"temperature={temperature} must lie in [0, {MAX_TEMPERATURE:g}] (0 = greedy)")
    k_max = vocab_size if vocab_size is not None else 2**31 - 1
    if int(top_k) != top_k or not 0 <= top_k <= k_max:
        raise ValueError(f"top_k={top_k} must be an integer in [0, {k_max}] (0 = off"
                         + (f"; the vocabulary has {vocab_size} tokens)" if vocab_size is not None else ")"))
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must lie in (0, 1] (1 = off)")
