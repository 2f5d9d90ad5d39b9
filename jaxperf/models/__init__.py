"""Models: a GPT-2 / Llama-style decoder whose parameters and activations carry logical axis names."""

from jaxperf.models.attention import attention, available_attention_impls, register_attention, xla_attention
from jaxperf.models.gpt import GPT, REMAT_POLICIES, count_params, gpt_loss

__all__ = [
    "GPT", "REMAT_POLICIES", "attention", "available_attention_impls", "count_params", "gpt_loss", "register_attention",
    "xla_attention",
]
