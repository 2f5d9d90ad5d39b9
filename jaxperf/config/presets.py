"""Presets: functions that return a whole TrainConfig, so a preset is typed and checked like any other config.

    cfg = get_config("gpt2-small", ["batch_size=8"])
    register_preset("my-run", lambda: dataclasses.replace(PRESETS["tiny"](), max_steps=1000))
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable
from typing import Any

from jaxperf.config.overrides import apply_overrides
from jaxperf.config.schema import ConfigError, DataConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig


def tiny() -> TrainConfig:
    """~0.8M parameters on bytes: small enough to train on two CPU cores in a few minutes."""
    return TrainConfig(
        # On CPU its four layers run unrolled (scan_unroll's platform default): a rolled scan over so few layers is
        # slow on XLA:CPU. A TPU or GPU step, or a model built from it with more layers, keeps the scan rolled.
        model=ModelConfig(d_model=128, n_layers=4, n_heads=4, max_seq_len=128),
        optim=OptimConfig(lr=2e-3, warmup_steps=30),
        data=DataConfig(max_bytes=8_000_000),
        batch_size=16, max_steps=300, run_dir="runs/tiny",
    )


def moe_tiny() -> TrainConfig:
    """`tiny` with a mixture-of-experts MLP in every layer: 8 experts of width 256, top-2 (softmax router), dropless,
    balanced loss-free (a router bias moved 0.003 a step: on the default corpus the busiest expert then takes a
    median 1.3x an even share rather than 1.6x). Each token's expert work (2 x 256) matches tiny's dense MLP width
    (512); the experts hold 4x its MLP weights."""
    base = tiny()
    return dataclasses.replace(
        base, model=dataclasses.replace(base.model, n_experts=8, experts_per_token=2, moe_mlp_dim=256,
                                        router_bias=True, router_bias_update_rate=0.003),
        run_dir="runs/moe-tiny")


def gpt2_small() -> TrainConfig:
    """GPT-2 small, 124M parameters (the 50257-token vocabulary padded to 50304, as in nanoGPT), BPE, bf16."""
    return TrainConfig(
        model=ModelConfig(vocab_size=50257, d_model=768, n_layers=12, n_heads=12, max_seq_len=1024, dtype="bfloat16"),
        optim=OptimConfig(lr=6e-4, warmup_steps=700),
        data=DataConfig(tokenizer="bpe"),
        batch_size=32, max_steps=20_000, run_dir="runs/gpt2-small", eval_every=500, checkpoint_every=1000,
    )


def gpt2_medium() -> TrainConfig:
    """GPT-2 medium, 355M parameters, BPE, bf16, matmul outputs saved for the backward (remat save_dots)."""
    return TrainConfig(
        model=ModelConfig(vocab_size=50257, d_model=1024, n_layers=24, n_heads=16, max_seq_len=1024, dtype="bfloat16",
                          remat="save_dots"),
        optim=OptimConfig(lr=3e-4, warmup_steps=700),
        data=DataConfig(tokenizer="bpe"),
        batch_size=32, max_steps=40_000, run_dir="runs/gpt2-medium", eval_every=500, checkpoint_every=1000,
    )


def llama_1b() -> TrainConfig:
    """Llama style, ~1.0B: RMSNorm, RoPE, SwiGLU, 32 heads sharing 8 KV heads, tied embeddings, bf16."""
    return TrainConfig(
        model=ModelConfig(style="llama", vocab_size=32000, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                          mlp_dim=8192, max_seq_len=2048, dtype="bfloat16", rope_theta=500_000.0, remat="save_dots"),
        optim=OptimConfig(lr=3e-4, warmup_steps=1000),
        data=DataConfig(tokenizer="bpe"),
        batch_size=64, max_steps=50_000, run_dir="runs/llama-1b", eval_every=1000, checkpoint_every=1000,
    )


def mixtral_8x7b() -> TrainConfig:
    """Mixtral-8x7B's shapes, 46.7B parameters of which 12.9B are active per token: Llama style, 32 layers each with
    8 SwiGLU experts of width 14336 (top-2 softmax routing, dropless), 32 heads sharing 8 KV heads, an untied head,
    rope_theta 1e6, bf16, `remat=save_dots`, fsdp. It trains on 4096-token sequences (the released model's context is
    32768; with RoPE `max_seq_len` only bounds the sequence length, so `max_seq_len=32768` changes no parameter). The
    router losses are those a Mixtral checkpoint imports with (aux 0.02, no z-loss). A pod-sized model: add
    `parallel.expert` to split the experts over chips (docs/moe.md)."""
    return TrainConfig(
        model=ModelConfig(style="llama", vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                          mlp_dim=14336, n_experts=8, experts_per_token=2, moe_mlp_dim=14336, router="softmax",
                          router_aux_loss_coef=0.02, router_z_loss_coef=0.0, max_seq_len=4096, tie_embeddings=False,
                          rope_theta=1_000_000.0, norm_eps=1e-5, dtype="bfloat16", remat="save_dots"),
        optim=OptimConfig(lr=3e-4, warmup_steps=2000),
        data=DataConfig(tokenizer="bpe"),
        parallel=ParallelConfig(strategy="fsdp"),
        batch_size=256, max_steps=100_000, run_dir="runs/mixtral-8x7b", eval_every=1000, checkpoint_every=1000,
    )


PRESETS: dict[str, Callable[[], TrainConfig]] = {
    "tiny": tiny, "gpt2-small": gpt2_small, "gpt2-medium": gpt2_medium, "llama-1b": llama_1b, "moe-tiny": moe_tiny,
    "mixtral-8x7b": mixtral_8x7b,
}
DEFAULT_PRESET = "tiny"


def register_preset(name: str, make: Callable[[], TrainConfig]) -> None:
    """Make `get_config(name)` (and `jaxperf train --preset name`) return `make()`."""
    PRESETS[name] = make


def get_config(preset: str | None = None, overrides: dict[str, Any] | list[str] | None = None) -> TrainConfig:
    """The config of a preset (default `tiny`) with overrides applied (jaxperf.config.overrides)."""
    name = preset or DEFAULT_PRESET
    if name not in PRESETS:
        close = difflib.get_close_matches(name, list(PRESETS), n=2)
        hint = f" Did you mean {' or '.join(close)}?" if close else ""
        raise ConfigError(f"unknown preset {name!r}.{hint} Presets: {', '.join(PRESETS)}")
    return apply_overrides(PRESETS[name](), overrides or {})
