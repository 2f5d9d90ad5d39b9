"""Generation and serving: a KV cache laid out for decode attention, insert-then-decode programs, sampling, int8
weights, continuous batching over replicas, and an HTTP server (jaxperf.generate.server)."""

from jaxperf.generate.cache import DecodeState, bucket, cache_bytes, cache_shape, cache_sharding
from jaxperf.generate.engine import DecodeOutput, Generation, GenerationBatch, Generator, TextStream
from jaxperf.generate.quantize import is_quantized_dir, perplexity, quantize_run, restore_quantized
from jaxperf.generate.sampling import apply_top_k, apply_top_p, filter_logits, nucleus_mask, sample
from jaxperf.models.layers import decode_attention

__all__ = [
    "DecodeOutput", "DecodeState", "Generation", "GenerationBatch", "Generator", "TextStream", "apply_top_k",
    "apply_top_p", "bucket", "cache_bytes", "cache_shape", "cache_sharding", "decode_attention", "filter_logits",
    "is_quantized_dir", "nucleus_mask", "perplexity", "quantize_run", "restore_quantized", "sample",
]
