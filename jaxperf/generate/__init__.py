"""Generation: a preallocated KV cache, prefill plus a compiled decode loop, sampling, streaming and a CLI."""

from jaxperf.generate.cache import DecodeState, Settings, bucket, cache_bytes, cache_shape, cache_sharding
from jaxperf.generate.engine import Generation, GenerationBatch, Generator
from jaxperf.generate.sampling import apply_top_k, apply_top_p, filter_logits, nucleus_mask, sample
from jaxperf.models.layers import decode_attention

__all__ = [
    "DecodeState", "Generation", "GenerationBatch", "Generator", "Settings", "apply_top_k", "apply_top_p", "bucket",
    "cache_bytes", "cache_shape", "cache_sharding", "decode_attention", "filter_logits", "nucleus_mask", "sample",
]
