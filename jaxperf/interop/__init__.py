"""Interoperability with other ecosystems' checkpoints: Hugging Face GPT-2, Llama, Mixtral, Qwen2 and Qwen2-MoE
(safetensors) in and out."""

from jaxperf.interop.hf import (
    EXPORT_DTYPES, RUNTIME_FIELDS, SUPPORTED, HFCheckpointError, default_arch, export_hf, hf_model_config, import_hf,
    load_hf_model, load_hf_params, read_generation_config,
)

__all__ = ["EXPORT_DTYPES", "HFCheckpointError", "RUNTIME_FIELDS", "SUPPORTED", "default_arch", "export_hf",
           "hf_model_config", "import_hf", "load_hf_model", "load_hf_params", "read_generation_config"]
