"""Interoperability with other ecosystems' checkpoints: Hugging Face GPT-2 and Llama (safetensors) in and out."""

from jaxperf.interop.hf import RUNTIME_FIELDS, SUPPORTED, HFCheckpointError, export_hf, import_hf, load_hf_model

__all__ = ["HFCheckpointError", "RUNTIME_FIELDS", "SUPPORTED", "export_hf", "import_hf", "load_hf_model"]
