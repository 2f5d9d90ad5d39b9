"""The preallocated KV cache and the decode state carried between compiled calls, and the shape buckets.

A cache is two arrays [N, B, S, K, Dh] (layers, rows, slots, KV heads, head dim) made once per generation: decoding
writes one slot per row and step in place, so its shape never changes and one compiled program serves every step.
Row b's token at position t lives in slot t (prompts are right-padded and every row starts at position 0), so the
positions given to learned embeddings or RoPE are the slot indices and `lengths_B` masks each row's keys.

Shapes are rounded up to buckets (powers of two) so that prompts and budgets of nearby sizes share one compilation.

Legend: N layers, B rows, S cache slots, K KV heads, Dh head dim, P prompt bucket, V padded vocabulary.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from jaxperf.models.gpt import CACHE_AXES
from jaxperf.parallel.rules import Rules, logical_to_spec


@flax.struct.dataclass
class DecodeState:
    """Everything a decode step reads and writes; donated to each call so the cache is updated in place."""

    k_cache: jax.Array  # [N, B, S, K, Dh]
    v_cache: jax.Array  # [N, B, S, K, Dh]
    tokens_BxS: jax.Array  # int32: prompt then generated tokens of each row (slot = position)
    lengths_B: jax.Array  # int32: tokens held per row = the slot the next token goes to
    prompt_len_B: jax.Array  # int32
    generated_B: jax.Array  # int32: tokens produced so far (a final stop token included)
    done_B: jax.Array  # bool: the row has stopped (stop token, budget or cache full) or is batch padding
    stopped_B: jax.Array  # bool: the row ended on a stop token
    logits_BxV: jax.Array  # float32: the distribution of each row's next token
    step: jax.Array  # int32 scalar: decode steps taken
    key_B: jax.Array  # one PRNG key per row; a row's t-th token is drawn with fold_in(key_B[b], t)


@flax.struct.dataclass
class Settings:
    """Sampling settings as arrays, one value per row: changing them never recompiles."""

    temperature: jax.Array  # float32 [B]; <= 0 is greedy
    top_k: jax.Array  # int32 [B]; <= 0 is off
    top_p: jax.Array  # float32 [B]; 1 is off
    max_tokens: jax.Array  # int32 [B]: budget of new tokens of each row
    stop_ids: jax.Array  # int32 [n_stop], padded with -1 (shared by all rows)


def bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum)."""
    n = max(int(n), int(minimum), 1)
    return 1 << (n - 1).bit_length()


def cache_shape(cfg, batch: int, max_len: int) -> tuple[int, ...]:
    """[N, B, S, K, Dh] for a resolved ModelConfig."""
    return (cfg.n_layers, batch, max_len, cfg.n_kv_heads, cfg.head_dim)


def cache_sharding(mesh: Mesh, rules: Rules, shape: tuple[int, ...]) -> NamedSharding:
    """Rows over the data axes, KV heads over `tensor` (where they divide), per the strategy's activation table."""
    return NamedSharding(mesh, logical_to_spec(CACHE_AXES, rules.activations, mesh, shape))


def cache_bytes(cfg, batch: int, max_len: int, dtype: Any = None) -> int:
    """Bytes of the k and v caches together."""
    n = 1
    for d in cache_shape(cfg, batch, max_len):
        n *= d
    return 2 * n * jnp.dtype(dtype or cfg.dtype).itemsize
