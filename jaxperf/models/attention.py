"""Attention with one API and several implementations.

    out_BxLxHxDh = attention(q_BxLxHxDh, k_BxSxKxDh, v_BxSxKxDh, causal=True, impl="pallas", platform="tpu")

Implementations: "xla" (plain jnp, the reference, runs everywhere), "cudnn" (`jax.nn.dot_product_attention` on NVIDIA
GPUs, bf16/fp16), "pallas" (jaxperf's flash attention kernel), "ring" (the sequence split over the mesh's `seq` axis)
and whatever else is registered with `register_attention`. `platform` is the one the program is built for (the
model passes its settled `cfg.platform`); "auto" follows the platform table of jaxperf.models.platform for it, with
the shapes given: Pallas flash attention on TPU, cuDNN on GPU, XLA on CPU or when no platform is named, XLA with the
reason where the shapes rule the first choice out (warned once on accelerators). An explicit impl that cannot run
raises.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxperf.models.kernels import pallas_attention, pallas_attention_unavailable
from jaxperf.models.platform import attention_choice
from jaxperf.models.registry import implementation, names, register
from jaxperf.parallel.ring_attention import ring_attention_ambient, ring_unavailable
from pallas_kernels.flash_attention import as_segment_ids

AttentionFn = Callable[..., jax.Array]


_WARNED: set[str] = set()


def register_attention(name: str, fn: AttentionFn, unavailable=None) -> None:
    """Add an implementation `fn(q, k, v, *, causal, segment_ids, platform) -> out` under `name`
    (model.attention_impl=name): `register("attention", ...)` of jaxperf.models.registry.

    `platform` is the one the program is built for ("cpu", "gpu", "tpu"; None for a model config that was never
    settled). `unavailable(q, k, v, *, platform)` returns None when the impl can run there or the reason it cannot.
    "auto" never picks a registered implementation: name it.
    """
    register("attention", name, fn, unavailable)


def available_attention_impls() -> list[str]:
    return names("attention")


def xla_attention(q_BxLxHxDh, k_BxSxKxDh, v_BxSxKxDh, *, causal: bool = True, segment_ids=None):
    """Reference attention in jnp: fp32 softmax, grouped-query heads, optional causal and segment masks.

    Query position i attends to key position j when (not causal or j <= i) and the segment ids match. The query block
    is aligned to the end of the key block (so S > L works for decoding with a cache). A query that sees no key (its
    segment id is in no key, or a causal query before the first key when S < L) outputs zeros and passes no gradient,
    as in FlashAttention and `flash_attention_reference`.
    """
    B, L, H, Dh = q_BxLxHxDh.shape
    S, K = k_BxSxKxDh.shape[1], k_BxSxKxDh.shape[2]
    G = H // K
    # Heads go in front of positions, and a KV head's G query heads are stacked along the query axis ([B, K, G*L,
    # Dh], free to reshape from [B, H, L, Dh] since head h = k*G + g), so both matmuls are contiguous 4-D batched
    # GEMMs, which XLA:CPU runs faster than the layout with heads between positions and features.
    q_BxKxMxDh = jnp.swapaxes(q_BxLxHxDh, 1, 2).reshape(B, K, G * L, Dh)
    k_BxKxSxDh = jnp.swapaxes(k_BxSxKxDh, 1, 2)
    v_BxKxSxDh = jnp.swapaxes(v_BxSxKxDh, 1, 2)
    scores_BxKxMxS = jnp.einsum("bkmd,bksd->bkms", q_BxKxMxDh, k_BxKxSxDh, preferred_element_type=jnp.float32)
    scores_BxKxMxS = scores_BxKxMxS * (Dh**-0.5)
    mask_LxS = jnp.ones((L, S), dtype=bool)
    if causal:
        mask_LxS = (jnp.arange(L)[:, None] + (S - L)) >= jnp.arange(S)[None, :]
    mask = jnp.tile(mask_LxS, (G, 1))[None, None]  # row g*L + i is query position i
    if segment_ids is not None:
        q_seg, kv_seg = as_segment_ids(segment_ids)
        mask = mask & (jnp.tile(q_seg, (1, G))[:, None, :, None] == kv_seg[:, None, None, :])
    scores_BxKxMxS = jnp.where(mask, scores_BxKxMxS, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores_BxKxMxS, axis=-1).astype(v_BxSxKxDh.dtype)
    out_BxKxMxDh = jnp.einsum("bkms,bksd->bkmd", probs, v_BxKxSxDh, preferred_element_type=jnp.float32)
    if segment_ids is not None or (causal and S < L):  # only then can a query see no key
        # Such a row's softmax spread evenly over masked keys: zero it (the `where` also blocks its gradient).
        out_BxKxMxDh = jnp.where(jnp.any(mask, axis=-1, keepdims=True), out_BxKxMxDh, 0.0)
    return jnp.swapaxes(out_BxKxMxDh.reshape(B, H, L, Dh), 1, 2).astype(q_BxLxHxDh.dtype)


def _cudnn_attention(q, k, v, *, causal: bool = True, segment_ids=None, platform=None):
    if segment_ids is not None:
        raise NotImplementedError("cudnn attention here takes no segment ids; use impl='xla'")
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")


def _cudnn_unavailable(q, k, v, *, platform) -> str | None:
    if platform not in (None, "gpu"):
        return f"cuDNN attention needs an NVIDIA GPU, the step is compiled for {platform!r}"
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"cuDNN attention needs bfloat16 or float16 inputs, got {q.dtype}"
    if q.shape[1] != k.shape[1]:
        return "cuDNN attention here needs equal query and key lengths"
    return None


register_attention("xla", lambda q, k, v, *, causal=True, segment_ids=None, platform=None: xla_attention(
    q, k, v, causal=causal, segment_ids=segment_ids))
register_attention("cudnn", _cudnn_attention, _cudnn_unavailable)
register_attention("pallas", pallas_attention, pallas_attention_unavailable)


def attention(q, k, v, *, causal: bool = True, segment_ids=None, impl: str = "auto", platform: str | None = None):
    """Dispatch to an implementation. Shapes: q [B, L, H, Dh], k and v [B, S, K, Dh] with H % K == 0. `platform`:
    the one the program is built for (None: not known, and "auto" runs XLA)."""
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads {q.shape[2]} must be a multiple of kv heads {k.shape[2]}")
    if impl == "auto":
        impl = "xla"
        if platform is not None:
            choice = attention_choice(platform, dtype=q.dtype, head_dim=q.shape[3], heads=q.shape[2],
                                      kv_heads=k.shape[2], q_len=q.shape[1], kv_len=k.shape[1],
                                      segment_ids=segment_ids is not None)
            if choice.impl == "xla" and platform != "cpu" and platform not in _WARNED:
                _WARNED.add(platform)
                warnings.warn(f"attention impl 'auto' on {platform} fell back to 'xla': {choice.why}", stacklevel=2)
            impl = choice.impl
    fn = implementation("attention", impl, q, k, v, platform=platform)
    return fn(q, k, v, causal=causal, segment_ids=segment_ids, platform=platform)


# Sequence parallelism over the ambient mesh's "seq" axis (jaxperf.parallel.ring_attention).
register_attention("ring", lambda q, k, v, *, causal=True, segment_ids=None, platform=None: ring_attention_ambient(
    q, k, v, causal=causal, segment_ids=segment_ids), lambda q, k, v, *, platform: ring_unavailable(q, k, v))
