"""The decode state carried between compiled calls (KV cache, per-row counters and settings) and the shape buckets.

A state holds B rows ("slots") and, per layer, a KV cache [B, K, S, Dh] (rows, KV heads, cache slots, head dim): for
each row and head the S positions are contiguous, the layout decode attention reads (`decode_attention`), so a
decode step reads the cache where it lies and writes one position per row in place. Row b's token at position t
lives in cache slot t (every row starts at position 0), so the positions given to learned embeddings or RoPE are the
slot indices and `lengths_B` masks each row's keys.

Each row also carries its own sampling settings, budget, stop ids and PRNG key: a row is one request, inserted
into a free slot (`Generator.insert`) and decoded with whatever else is running (`Generator.decode`). Nothing in a
row depends on the slot it occupies or on its neighbours.

Shapes are rounded up to buckets (powers of two) so that prompts and budgets of nearby sizes share one compilation.

Legend: N layers, B rows, S cache slots, K KV heads, Dh head dim, V padded vocabulary, NS stop ids per row.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from jaxperf.models.gpt import CACHE_AXES
from jaxperf.parallel.rules import Rules, logical_to_spec

N_STOP = 8  # stop ids per row (padded with -1)


@flax.struct.dataclass
class DecodeState:
    """Everything a decode step reads and writes; donated to each call so the cache is updated in place."""

    k_cache: tuple[jax.Array, ...]  # one [B, K, S, Dh] per layer
    v_cache: tuple[jax.Array, ...]  # one [B, K, S, Dh] per layer
    lengths_B: jax.Array  # int32: tokens held per row = the cache slot (position) the next token goes to
    generated_B: jax.Array  # int32: tokens produced so far (a final stop token included)
    done_B: jax.Array  # bool: the row has finished (stop token, budget, cache full, cancelled) or the slot is free
    stopped_B: jax.Array  # bool: the row ended on a stop token
    logits_BxV: jax.Array  # float32: the distribution of each row's next token
    key_B: jax.Array  # one PRNG key per row; a row's t-th token is drawn with fold_in(key_B[b], t)
    temperature_B: jax.Array  # float32; <= 0 is greedy
    top_k_B: jax.Array  # int32; 0 is off
    top_p_B: jax.Array  # float32; 1 is off
    max_tokens_B: jax.Array  # int32: budget of new tokens
    stop_ids_BxNS: jax.Array  # int32: token ids that end the row, padded with -1

    @property
    def batch(self) -> int:
        return int(self.lengths_B.shape[0])

    @property
    def max_len(self) -> int:
        return int(self.k_cache[0].shape[2])


def bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum)."""
    n = max(int(n), int(minimum), 1)
    return 1 << (n - 1).bit_length()


def cache_shape(cfg, batch: int, max_len: int) -> tuple[int, ...]:
    """One layer's cache, [B, K, S, Dh], for a resolved ModelConfig (there are cfg.n_layers of them, for k and v)."""
    return (batch, cfg.n_kv_heads, max_len, cfg.head_dim)


def cache_sharding(mesh: Mesh, rules: Rules, shape: tuple[int, ...]) -> NamedSharding:
    """Rows over the data axes, KV heads over `tensor` (where they divide), per the strategy's activation table."""
    return NamedSharding(mesh, logical_to_spec(CACHE_AXES, rules.activations, mesh, shape))


def cache_bytes(cfg, batch: int, max_len: int, dtype: Any = None) -> int:
    """Bytes of the k and v caches of all layers together."""
    n = cfg.n_layers
    for d in cache_shape(cfg, batch, max_len):
        n *= d
    return 2 * n * jnp.dtype(dtype or cfg.dtype).itemsize
