"""What `jaxperf generate` and `jaxperf serve` are pointed at: a jaxperf run directory or a Hugging Face one."""

from __future__ import annotations

from pathlib import Path

from jaxperf.generate.engine import Generator
from jaxperf.interop import load_hf_model
from jaxperf.train.pretrained import checkpoint_kind, load_hf_tokenizer


def load_generator(path: str | Path, **kwargs) -> Generator:
    """A Generator for `path`: a training run's newest checkpoint (`Generator.from_checkpoint`), or a Hugging Face
    GPT-2 / Llama directory (its safetensors weights and tokenizer.json), told apart by config.json
    (`jaxperf.train.pretrained.checkpoint_kind`; ConfigError when it is neither). `kwargs` (mesh, quantize, ...) go
    to the Generator; without a mesh it sits on the first device."""
    if checkpoint_kind(path) == "hf":
        return Generator(load_hf_model(str(path)), load_hf_tokenizer(path), **kwargs)
    return Generator.from_checkpoint(path, **kwargs)
