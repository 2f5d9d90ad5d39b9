"""Hugging Face checkpoints in and out: GPT-2 (`GPT2LMHeadModel`), Llama (`LlamaForCausalLM`) and Mixtral
(`MixtralForCausalLM`).

    cfg, params = import_hf("path/to/gpt2")           # ModelConfig + pure-dict params (numpy, float32)
    cfg = hf_model_config("path/to/llama")           # the ModelConfig alone (config.json only)
    params = load_hf_params("path/to/llama", cfg, task.param_shardings)   # straight into each device's shard
    model = load_hf_model("path/to/llama", mesh=mesh) # a jaxperf GPT with those params, sharded on the mesh
    export_hf(cfg, params, "out/", arch="llama", special_tokens=..., tokenizer="path/to/tokenizer.json")

Only `config.json` and `*.safetensors` files are read (sharded checkpoints through `model.safetensors.index.json`),
memory-mapped (jaxperf.interop._safetensors): no torch, no network, float32, float16 and bfloat16 tensors. `params` has
exactly the structure of `nnx.to_pure_dict(nnx.state(GPT(cfg), nnx.Param))`, i.e. of `TrainState.params` and of what
`Task.merge` takes, so an imported checkpoint can be merged into a model, evaluated or trained further.

How the two layouts line up (jaxperf legend: D embed, H heads, K kv heads, Dh head dim, F mlp, V vocab). Every
jaxperf tensor is a block of one HF tensor (`_Part`): view the HF tensor, transposed for `nn.Linear`, as a matrix
[R, C]; the jaxperf tensor is a band of its columns with R and the band's columns split into jaxperf's dims. That one
description drives import (whole or a device's slice) and export.
- GPT-2 stores `Conv1D` weights as [in, out] (jaxperf's own order) and fuses q, k, v into `c_attn` [D, 3D] (three
  bands); it ties the LM head to the token embedding. `activation_function` "gelu_new" / "gelu_pytorch_tanh" is the
  tanh-approximated GELU, jaxperf's `mlp_act="gelu"`; "gelu" is the erf form, `mlp_act="gelu_exact"`.
- Llama stores `nn.Linear` weights as [out, in], so every matrix is transposed. Its RoPE is the rotate-half form with
  frequencies theta^(-2i/Dh) over the two halves of each head; jaxperf's `rope` is the same form with the same
  frequencies, so q and k weights need no permutation (the permutation some converters apply maps Meta's interleaved
  layout to this one; HF checkpoints are already in it).
- The imported config sets `vocab_multiple=1`, so the embedding and head have exactly the checkpoint's vocabulary and
  the logits match the HF model's one for one. Exporting a model trained with a padded vocabulary drops the padded
  rows (never produced by a tokenizer); their share of the softmax during training is then gone, a tiny difference.
- Mixtral is Llama with a mixture-of-experts MLP (jaxperf's `n_experts`, `router="softmax"`, dropless). The hub layout
  stores one tensor per expert: `block_sparse_moe.experts.{j}.w1` (the SwiGLU gate, [F, D]), `.w3` (up, [F, D]),
  `.w2` (down, [D, F]) and the router `block_sparse_moe.gate` [E, D]; expert j's tensors are slice j of jaxperf's
  stacked `mlp.w_gate_ExDxF`, `mlp.w_in_ExDxF`, `mlp.w_out_ExFxD` (each transposed) and `gate` is `mlp.router_DxE`
  transposed. The fused layout (transformers 5's modules: `mlp.experts.gate_up_proj` [E, 2F, D], gate rows first, and
  `mlp.experts.down_proj` [E, D, F], router `mlp.gate`) is read too; export writes the hub layout. A `_Map` with
  `experts` stands for the E expert tensors (or the E slices of a fused one) and its parts have a leading expert dim.

Refused with an error that names the tensor or setting: other architectures, missing or unexpected tensors, shapes
that do not match the config, RoPE scaling (`rope_scaling`/`rope_parameters` other than "default"), activations other
than GELU (GPT-2) or SiLU (Llama, Mixtral), a non-zero Llama `gate_proj` bias (jaxperf's SwiGLU has no gate bias),
GPT-2 variants (`scale_attn_by_inverse_layer_idx`, unscaled attention, cross-attention), a Mixtral sliding window
shorter than the context, router jitter, or more experts per token than experts. Llama `attention_bias` and
`mlp_bias` map to jaxperf's `use_bias=True` (the biases jaxperf has and the checkpoint lacks are zero).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tokenizers import Tokenizer

from jaxperf import _compat
from jaxperf.config import ModelConfig, validate_model
from jaxperf.data.tokenizer import SPECIAL_TOKENS
from jaxperf.interop._safetensors import Checkpoint, HFCheckpointError, parse_size, write_shards
from jaxperf.models.gpt import GPT
from jaxperf.parallel.rules import get_rules
from jaxperf.step.task import Task

SUPPORTED = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM",
             "qwen2": "Qwen2ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
MOE_ARCHS = ("mixtral", "qwen2_moe")
# ModelConfig fields that change how the model runs but not what it computes: safe to override on import. A router
# bias (loss-free balancing, for fine-tuning an MoE checkpoint with it) starts at zero, which routes as the checkpoint
# does; its update rate is the optimizer's.
RUNTIME_FIELDS = ("dtype", "param_dtype", "scan_layers", "scan_unroll", "remat", "attention_impl", "norm_impl",
                  "loss_impl", "matmul_grad_barrier", "init_std", "router_bias", "router_bias_update_rate")
GPT2_ACTIVATIONS = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu": "gelu_exact"}  # HF name -> mlp_act
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
EXPORT_DTYPES = ("float32", "bfloat16", "float16")

__all__ = ["EXPORT_DTYPES", "HFCheckpointError", "RUNTIME_FIELDS", "SUPPORTED", "default_arch", "export_hf",
           "hf_model_config", "import_hf", "load_hf_model", "load_hf_params", "read_generation_config"]


@dataclass(frozen=True)
class _Part:
    """One jaxperf tensor as a block of an HF tensor.

    M is the HF tensor ([R, C]; its transpose when `t`; a 1-D tensor is its columns alone). The jaxperf tensor is
    M[:, offset : offset + prod(cols)] with the R rows split into the dims `rows` and the band's columns into `cols`.
    """

    jp: str  # dotted jaxperf path, e.g. "attn.wq_DxHxDh" (per-layer paths are relative to the layer)
    rows: tuple[int, ...]
    cols: tuple[int, ...]
    offset: int = 0
    t: bool = False


@dataclass(frozen=True)
class _Map:
    """One HF tensor and the jaxperf tensors it holds."""

    hf: str  # HF name (per-layer names are relative to the layer prefix)
    hf_shape: tuple[int, ...]
    parts: tuple[_Part, ...]
    zero_only: bool = False  # no jaxperf tensor: imported only when all zero (Llama's gate bias)
    # > 0: one expert's tensor of E. `hf` holds "{j}" (one HF tensor per expert, Mixtral's hub layout) or names one
    # tensor [E, *hf_shape] whose slice j is expert j (the fused layout); every part has a leading expert dim.
    experts: int = 0

    def stored(self) -> list[tuple[str, tuple[int, ...], int | None]]:
        """(HF name, stored shape, expert or None) of each HF tensor this map stands for."""
        if not self.experts:
            return [(self.hf, self.hf_shape, None)]
        if "{j}" in self.hf:
            return [(self.hf.format(j=j), self.hf_shape, j) for j in range(self.experts)]
        return [(self.hf, (self.experts, *self.hf_shape), None)]

    def expert_source(self, j: int) -> tuple[str, tuple[int, ...]]:
        """(HF name, leading index) that holds expert j's tensor."""
        return (self.hf.format(j=j), ()) if "{j}" in self.hf else (self.hf, (j,))


def _same(hf: str, jp: str, shape: tuple[int, ...]) -> _Map:
    """The same tensor on both sides."""
    return _Map(hf, shape, (_Part(jp, shape[:-1], shape[-1:]),))


def _linear_t(hf: str, jp: str, inn: tuple[int, ...], out: tuple[int, ...], experts: int = 0) -> _Map:
    """nn.Linear [out, in] <-> jaxperf [*in, *out] (transposed, then both sides split into jaxperf's dims)."""
    return _Map(hf, (math.prod(out), math.prod(inn)), (_Part(jp, inn, out, t=True),), experts=experts)


def _bands(hf: str, hf_shape: tuple[int, ...], jps: tuple[str, ...], rows: tuple[int, ...],
           cols: tuple[int, ...]) -> _Map:
    """Several jaxperf tensors side by side along the HF tensor's columns (GPT-2's fused q, k, v)."""
    width = math.prod(cols)
    return _Map(hf, hf_shape, tuple(_Part(jp, rows, cols, offset=i * width) for i, jp in enumerate(jps)))


# --------------------------------------------------------------------------------------------------------------------
# Config translation


def _architecture(hf: dict) -> str:
    model_type = hf.get("model_type")
    archs = hf.get("architectures") or []
    for arch, cls in SUPPORTED.items():
        if model_type == arch or (model_type is None and cls in archs):
            return arch
    raise HFCheckpointError(
        f"unsupported checkpoint: model_type={model_type!r}, architectures={archs}. jaxperf imports "
        f"{', '.join(f'{cls} (model_type={a!r})' for a, cls in SUPPORTED.items())}")


def _require(hf: dict, key: str, ok: Callable, default, why: str):
    value = hf.get(key, default)
    if not ok(value):
        raise HFCheckpointError(f"config.json {key}={value!r} is not supported: {why}")
    return value


def _gpt2_config(hf: dict) -> ModelConfig:
    act = _require(hf, "activation_function", lambda v: v in GPT2_ACTIVATIONS, "gelu_new",
                   "jaxperf's MLP has the tanh-approximated GELU ('gelu_new', 'gelu_pytorch_tanh') and the exact one "
                   "('gelu')")
    _require(hf, "scale_attn_weights", lambda v: v is True, True, "jaxperf always scales scores by head_dim**-0.5")
    _require(hf, "scale_attn_by_inverse_layer_idx", lambda v: not v, False, "jaxperf has no per-layer score scaling")
    _require(hf, "add_cross_attention", lambda v: not v, False, "jaxperf is decoder-only without cross-attention")
    d = hf["n_embd"]
    return ModelConfig(
        style="gpt2", vocab_size=hf["vocab_size"], vocab_multiple=1, max_seq_len=hf.get("n_positions", 1024),
        d_model=d, n_layers=hf["n_layer"], n_heads=hf["n_head"], n_kv_heads=hf["n_head"], head_dim=d // hf["n_head"],
        mlp_dim=hf.get("n_inner") or 4 * d, norm="layernorm", position="learned", mlp_act=GPT2_ACTIVATIONS[act],
        use_bias=True, tie_embeddings=hf.get("tie_word_embeddings", True), norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        dtype="float32", param_dtype="float32")


def _rope_theta(hf: dict) -> float:
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    for src, block in (("rope_parameters", params), ("rope_scaling", scaling)):
        kind = block.get("rope_type", block.get("type", "default"))
        if kind != "default":
            raise HFCheckpointError(
                f"config.json {src}={block!r}: RoPE scaling {kind!r} is not supported; jaxperf implements plain RoPE "
                f"(rope_type 'default') with a single rope_theta")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _llama_config(hf: dict) -> tuple[ModelConfig, dict]:
    _require(hf, "hidden_act", lambda v: v == "silu", "silu", "jaxperf's SwiGLU uses SiLU")
    H = hf["num_attention_heads"]
    D = hf["hidden_size"]
    flags = {"attention_bias": bool(hf.get("attention_bias", False)), "mlp_bias": bool(hf.get("mlp_bias", False))}
    cfg = ModelConfig(
        style="llama", vocab_size=hf["vocab_size"], vocab_multiple=1,
        max_seq_len=hf.get("max_position_embeddings", 2048),
        d_model=D, n_layers=hf["num_hidden_layers"], n_heads=H, n_kv_heads=hf.get("num_key_value_heads") or H,
        head_dim=hf.get("head_dim") or D // H, mlp_dim=hf["intermediate_size"], norm="rmsnorm", position="rope",
        mlp_act="swiglu", use_bias=flags["attention_bias"] or flags["mlp_bias"],
        tie_embeddings=hf.get("tie_word_embeddings", False), rope_theta=_rope_theta(hf),
        norm_eps=hf.get("rms_norm_eps", 1e-6), dtype="float32", param_dtype="float32")
    return cfg, flags


def _full_attention(hf: dict, max_len: int) -> None:
    """Refuse sliding-window layers (Qwen2's use_sliding_window): jaxperf attends over the whole context."""
    if hf.get("use_sliding_window"):
        _require(hf, "sliding_window", lambda v: v is None or v >= max_len, None,
                 f"with use_sliding_window=true the window must be null or at least max_position_embeddings="
                 f"{max_len}: jaxperf attends over the whole context")


def _qwen2_config(hf: dict) -> tuple[ModelConfig, dict]:
    """Llama's mapping with biases on q, k and v alone (`qkv_bias`; Qwen2's output projection and MLP have none)."""
    hf = {**hf, "attention_bias": False, "mlp_bias": False}
    cfg, _ = _llama_config(hf)
    _full_attention(hf, cfg.max_seq_len)
    qkv = bool(hf.get("qkv_bias", True))  # Qwen2-MoE's config names it; Qwen2's always has them
    return dataclasses.replace(cfg, qkv_bias=qkv), {"attention_bias": False, "mlp_bias": False, "qkv_bias": qkv}


def _qwen2_moe_config(hf: dict) -> tuple[ModelConfig, dict]:
    """Qwen2's attention; every layer's MLP routed experts (softmax, top num_experts_per_tok, renormalised only with
    norm_topk_prob) beside one shared expert of its own width whose output a sigmoid gate scales per token."""
    cfg, flags = _qwen2_config(hf)
    E = _require(hf, "num_experts", lambda v: isinstance(v, int) and v >= 1, None,
                 "a Qwen2-MoE config needs num_experts >= 1")
    k = _require(hf, "num_experts_per_tok", lambda v: isinstance(v, int) and 1 <= v <= E, 4,
                 f"each token goes to 1 to num_experts={E} experts")
    _require(hf, "decoder_sparse_step", lambda v: v == 1, 1,
             "jaxperf imports Qwen2-MoE with every layer's MLP routed (decoder_sparse_step=1)")
    _require(hf, "mlp_only_layers", lambda v: not v, None,
             "jaxperf imports Qwen2-MoE with every layer's MLP routed (no mlp_only_layers)")
    shared = _require(hf, "shared_expert_intermediate_size", lambda v: isinstance(v, int) and v >= 1, None,
                      "Qwen2-MoE's shared expert needs a width >= 1")
    return dataclasses.replace(
        cfg, n_experts=E, experts_per_token=k, moe_mlp_dim=hf["moe_intermediate_size"], n_shared_experts=1,
        shared_mlp_dim=shared, shared_expert_gate=True, router="softmax",
        router_norm_topk=bool(hf.get("norm_topk_prob", False)),
        router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)), router_z_loss_coef=0.0), {
            **flags, "fused": False}


def _mixtral_config(hf: dict) -> tuple[ModelConfig, dict]:
    """Llama's mapping plus the experts: dropless softmax routing over num_local_experts, top num_experts_per_tok."""
    cfg, _ = _llama_config(hf)
    E = _require(hf, "num_local_experts", lambda v: isinstance(v, int) and v >= 1, None,
                 "a Mixtral config needs num_local_experts >= 1")
    _require(hf, "num_experts_per_tok", lambda v: isinstance(v, int) and 1 <= v <= E, 2,
             f"each token goes to 1 to num_local_experts={E} experts")
    _require(hf, "sliding_window", lambda v: v is None or v >= cfg.max_seq_len, None,
             f"jaxperf attends over the whole context, so the window must be null or at least "
             f"max_position_embeddings={cfg.max_seq_len}")
    _require(hf, "router_jitter_noise", lambda v: not v, 0.0, "jaxperf's router has no jitter")
    # HF's Mixtral trains with the load-balancing loss alone: no router z-loss
    return dataclasses.replace(
        cfg, n_experts=E, experts_per_token=hf.get("num_experts_per_tok", 2), moe_mlp_dim=hf["intermediate_size"],
        router="softmax", router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
        router_z_loss_coef=0.0), {"attention_bias": False, "mlp_bias": False, "fused": False}


# --------------------------------------------------------------------------------------------------------------------
# Tensor maps


def _gpt2_maps(c: ModelConfig) -> tuple[list[_Map], list[_Map]]:
    """(per-layer maps relative to "h.{i}.", model-level maps)."""
    D, H, Dh, F = c.d_model, c.n_heads, c.head_dim, c.mlp_dim
    layer = [
        _bands("attn.c_attn.weight", (D, 3 * D), ("attn.wq_DxHxDh", "attn.wk_DxKxDh", "attn.wv_DxKxDh"), (D,), (H, Dh)),
        _bands("attn.c_attn.bias", (3 * D,), ("attn.bias_q_HxDh", "attn.bias_k_KxDh", "attn.bias_v_KxDh"), (), (H, Dh)),
        _Map("attn.c_proj.weight", (D, D), (_Part("attn.wo_HxDhxD", (H, Dh), (D,)),)),
        _same("attn.c_proj.bias", "attn.bias_o_D", (D,)),
        _same("mlp.c_fc.weight", "mlp.w_in_DxF", (D, F)),
        _same("mlp.c_fc.bias", "mlp.bias_in_F", (F,)),
        _same("mlp.c_proj.weight", "mlp.w_out_FxD", (F, D)),
        _same("mlp.c_proj.bias", "mlp.bias_out_D", (D,)),
    ]
    for hf_norm, jp_norm in (("ln_1", "attn_norm"), ("ln_2", "mlp_norm")):
        layer += [_same(f"{hf_norm}.{p}", f"{jp_norm}.{q}", (D,)) for p, q in (("weight", "scale"), ("bias", "bias"))]
    top = [
        _same("wte.weight", "embed_VxD", (c.vocab_size, D)),
        _same("wpe.weight", "pos_LxD", (c.max_seq_len, D)),
        _same("ln_f.weight", "final_norm.scale", (D,)),
        _same("ln_f.bias", "final_norm.bias", (D,)),
    ]
    if not c.tie_embeddings:
        top.append(_linear_t("lm_head.weight", "head_DxV", (D,), (c.vocab_size,)))
    return layer, top


def _llama_maps(c: ModelConfig, flags: dict) -> tuple[list[_Map], list[_Map]]:
    D, H, K, Dh, F = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.mlp_dim
    layer = [
        _linear_t("self_attn.q_proj.weight", "attn.wq_DxHxDh", (D,), (H, Dh)),
        _linear_t("self_attn.k_proj.weight", "attn.wk_DxKxDh", (D,), (K, Dh)),
        _linear_t("self_attn.v_proj.weight", "attn.wv_DxKxDh", (D,), (K, Dh)),
        _linear_t("self_attn.o_proj.weight", "attn.wo_HxDhxD", (H, Dh), (D,)),
        _linear_t("mlp.gate_proj.weight", "mlp.w_gate_DxF", (D,), (F,)),
        _linear_t("mlp.up_proj.weight", "mlp.w_in_DxF", (D,), (F,)),
        _linear_t("mlp.down_proj.weight", "mlp.w_out_FxD", (F,), (D,)),
        _same("input_layernorm.weight", "attn_norm.scale", (D,)),
        _same("post_attention_layernorm.weight", "mlp_norm.scale", (D,)),
    ]
    if flags["attention_bias"] or flags.get("qkv_bias"):
        for n, jp, heads in (("q", "bias_q_HxDh", H), ("k", "bias_k_KxDh", K), ("v", "bias_v_KxDh", K)):
            layer.append(_Map(f"self_attn.{n}_proj.bias", (heads * Dh,), (_Part(f"attn.{jp}", (), (heads, Dh)),)))
    if flags["attention_bias"]:
        layer.append(_same("self_attn.o_proj.bias", "attn.bias_o_D", (D,)))
    if flags["mlp_bias"]:
        layer += [
            _Map("mlp.gate_proj.bias", (F,), (), zero_only=True),
            _same("mlp.up_proj.bias", "mlp.bias_in_F", (F,)),
            _same("mlp.down_proj.bias", "mlp.bias_out_D", (D,)),
        ]
    top = [
        _same("embed_tokens.weight", "embed_VxD", (c.vocab_size, D)),
        _same("norm.weight", "final_norm.scale", (D,)),
    ]
    if not c.tie_embeddings:
        top.append(_linear_t("lm_head.weight", "head_DxV", (D,), (c.vocab_size,)))
    return layer, top


def _expert_maps(c: ModelConfig, fused: bool, hub: tuple[str, str, str, str]) -> list[_Map]:
    """The router and the routed experts: in transformers' fused layout (mlp.gate; mlp.experts.gate_up_proj
    [E, 2F, D], gate rows first; mlp.experts.down_proj [E, D, F]) or in the hub one, `hub` naming the router and one
    expert's gate, up and down projections ("{j}" the expert)."""
    D, E, F = c.d_model, c.n_experts, c.moe_mlp_dim
    if fused:
        return [
            _linear_t("mlp.gate.weight", "mlp.router_DxE", (D,), (E,)),
            _Map("mlp.experts.gate_up_proj", (2 * F, D), (_Part("mlp.w_gate_ExDxF", (D,), (F,), t=True),
                                                           _Part("mlp.w_in_ExDxF", (D,), (F,), offset=F, t=True)),
                 experts=E),
            _linear_t("mlp.experts.down_proj", "mlp.w_out_ExFxD", (F,), (D,), experts=E),
        ]
    router, gate, up, down = hub
    return [
        _linear_t(router, "mlp.router_DxE", (D,), (E,)),
        _linear_t(gate, "mlp.w_gate_ExDxF", (D,), (F,), experts=E),
        _linear_t(up, "mlp.w_in_ExDxF", (D,), (F,), experts=E),
        _linear_t(down, "mlp.w_out_ExFxD", (F,), (D,), experts=E),
    ]


def _mixtral_maps(c: ModelConfig, flags: dict) -> tuple[list[_Map], list[_Map]]:
    """Llama's attention, norms and embeddings; the experts in the hub layout (one tensor per expert) or, with
    flags["fused"], in transformers' fused one."""
    layer, top = _llama_maps(c, {"attention_bias": False, "mlp_bias": False})
    moe = "block_sparse_moe."
    hub = (moe + "gate.weight", moe + "experts.{j}.w1.weight", moe + "experts.{j}.w3.weight",
           moe + "experts.{j}.w2.weight")
    return [m for m in layer if not m.hf.startswith("mlp.")] + _expert_maps(c, flags.get("fused"), hub), top


def _qwen2_moe_maps(c: ModelConfig, flags: dict) -> tuple[list[_Map], list[_Map]]:
    """Qwen2's attention; the routed experts (hub layout: mlp.experts.{j}.gate_proj/up_proj/down_proj, or fused),
    the shared expert (mlp.shared_expert.*) and its gate (mlp.shared_expert_gate, [1, D])."""
    D, S = c.d_model, c.shared_mlp_dim
    layer, top = _llama_maps(c, {**flags, "mlp_bias": False})
    hub = ("mlp.gate.weight", *(f"mlp.experts.{{j}}.{p}_proj.weight" for p in ("gate", "up", "down")))
    layer = [m for m in layer if not m.hf.startswith("mlp.")] + _expert_maps(c, flags.get("fused"), hub)
    layer += [
        _linear_t("mlp.shared_expert.gate_proj.weight", "mlp.shared.w_gate_DxF", (D,), (S,)),
        _linear_t("mlp.shared_expert.up_proj.weight", "mlp.shared.w_in_DxF", (D,), (S,)),
        _linear_t("mlp.shared_expert.down_proj.weight", "mlp.shared.w_out_FxD", (S,), (D,)),
        _linear_t("mlp.shared_expert_gate.weight", "mlp.shared_gate_Dx1", (D,), (1,)),
    ]
    return layer, top


# Layer and model prefixes of each architecture (HF saves GPT-2 with or without "transformer.").
_PREFIXES = {"gpt2": (("transformer.", ""), "h.{i}."),
             **{arch: (("model.",), "layers.{i}.") for arch in ("llama", "mixtral", "qwen2", "qwen2_moe")}}
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")


def _full(prefix: str, name: str) -> str:
    """The LM head sits outside the body's prefix in both architectures."""
    return name if name.startswith("lm_head.") else prefix + name


def _maps(arch: str, cfg: ModelConfig, flags: dict):
    if arch == "gpt2":
        return _gpt2_maps(cfg)
    return {"mixtral": _mixtral_maps, "qwen2_moe": _qwen2_moe_maps}.get(arch, _llama_maps)(cfg, flags)


# --------------------------------------------------------------------------------------------------------------------
# One part, both ways


def _span(dims: tuple[int, ...], index: list[tuple[int, int]]) -> tuple[int, int, tuple[slice, ...]]:
    """The flat range of a group of dims that covers a block of them (whole inner dims), and the block within it."""
    if not dims:
        return 0, 1, ()
    inner = math.prod(dims[1:])
    (lo, hi), rest = index[0], index[1:]
    return lo * inner, hi * inner, tuple(slice(a, b) for a, b in rest)


def _read_part(src: Checkpoint, name: str, part: _Part, index: list[tuple[int, int]],
               lead: tuple[int, ...] = ()) -> np.ndarray:
    """The block `index` ((start, stop) per jaxperf dim) of the jaxperf tensor `part` of HF tensor `name` (of its
    slice `lead` along its leading dims: an expert of a fused tensor), reading only the rows and columns of the HF
    tensor that hold it."""
    n = len(part.rows)
    r_lo, r_hi, r_sub = _span(part.rows, index[:n])
    c_lo, c_hi, c_sub = _span(part.cols, index[n:])
    c_lo, c_hi = c_lo + part.offset, c_hi + part.offset
    if not part.rows:
        block = src.read(name, (*lead, slice(c_lo, c_hi)))
    elif part.t:
        block = src.read(name, (*lead, slice(c_lo, c_hi), slice(r_lo, r_hi))).T
    else:
        block = src.read(name, (*lead, slice(r_lo, r_hi), slice(c_lo, c_hi)))
    lead = (index[0][1] - index[0][0],) if part.rows else ()
    shape = lead + part.rows[1:] + (index[n][1] - index[n][0],) + part.cols[1:]
    return block.reshape(shape)[(slice(None),) * bool(part.rows) + r_sub + (slice(None),) + c_sub]


def _to_hf(m: _Map, get: Callable[[str], np.ndarray]) -> np.ndarray:
    """The HF tensor of map `m` from its jaxperf tensors (`get(path)` gives each on the host)."""
    if m.zero_only:
        return np.zeros(m.hf_shape, np.float32)
    if len(m.parts) == 1 and m.parts[0].offset == 0:
        p = m.parts[0]
        a = get(p.jp).reshape(m.hf_shape[::-1] if p.t else m.hf_shape)
        return a.T if p.t else a
    blocks = [(p, get(p.jp)) for p in m.parts]
    out = np.empty(m.hf_shape, blocks[0][1].dtype)
    for p, a in blocks:
        width = math.prod(p.cols)
        if len(m.hf_shape) == 1:
            out[p.offset: p.offset + width] = a.reshape(width)
        elif p.t:
            out[p.offset: p.offset + width, :] = a.reshape(math.prod(p.rows), width).T
        else:
            out[:, p.offset: p.offset + width] = a.reshape(math.prod(p.rows), width)
    return out


# --------------------------------------------------------------------------------------------------------------------
# Reading


def _read_config(directory: str, name: str = "config.json") -> dict:
    path = os.path.join(directory, name)
    if not os.path.exists(path):
        raise HFCheckpointError(f"{path} does not exist: a Hugging Face checkpoint directory holds config.json and "
                                f"*.safetensors")
    with open(path) as f:
        return json.load(f)


def read_generation_config(directory: str) -> dict | None:
    """The checkpoint's generation_config.json as a dict, or None when it has none."""
    path = os.path.join(directory, "generation_config.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _hf_config_to_jaxperf(hf: dict) -> tuple[str, ModelConfig, dict]:
    arch = _architecture(hf)
    if arch == "gpt2":
        cfg, flags = _gpt2_config(hf), {}
    else:
        cfg, flags = {"mixtral": _mixtral_config, "qwen2": _qwen2_config, "qwen2_moe": _qwen2_moe_config,
                      "llama": _llama_config}[arch](hf)
    return arch, validate_model(cfg), flags


def _check_overrides(overrides: dict) -> None:
    bad = sorted(set(overrides) - set(RUNTIME_FIELDS))
    if bad:
        raise HFCheckpointError(f"cannot override {bad} on import: they would change what the checkpoint computes; "
                                f"allowed: {list(RUNTIME_FIELDS)}")


def hf_model_config(directory: str, *, check_weights: bool = False, **overrides) -> ModelConfig:
    """The resolved jaxperf ModelConfig of a Hugging Face checkpoint, from its config.json.

    With `check_weights` the safetensors headers are read too and every tensor checked for presence and shape (no
    values are read): the errors `import_hf` would raise, raised now. `**overrides`: RUNTIME_FIELDS only (dtype,
    param_dtype, scan_layers, remat, kernels...)."""
    if check_weights:
        return _plan(directory, **overrides).cfg
    _check_overrides(overrides)
    _, cfg, _ = _hf_config_to_jaxperf(_read_config(directory))
    return validate_model(dataclasses.replace(cfg, **overrides))


def _template(cfg: ModelConfig) -> dict:
    """Pure dict of ShapeDtypeStructs of the jaxperf GPT for cfg (nothing allocated)."""
    with _compat.no_eager_sharding():
        abstract = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))
    return nnx.to_pure_dict(nnx.state(abstract, nnx.Param))


def _key(k) -> str:
    return str(getattr(k, "key", getattr(k, "idx", k)))


@dataclass
class _Plan:
    """Where each jaxperf parameter of a checkpoint lives: the checked config and, per leaf, its HF tensor."""

    arch: str
    cfg: ModelConfig
    src: Checkpoint
    prefix: str
    layer_fmt: str
    top: dict[str, tuple[str, _Part]]  # jaxperf path -> (full HF name, part)
    layer: dict[str, tuple[_Map, _Part]]  # per-layer jaxperf path -> (its map, HF names relative to the layer)

    def reader(self, path: tuple[str, ...], dtype) -> Callable[[list[tuple[int, int]]], np.ndarray]:
        """`read(index) -> np.ndarray` in `dtype`: a block ((start, stop) per dim) of the leaf at `path` (zeros for
        a bias the checkpoint lacks). A block of stacked layers is filled layer by layer, in place."""
        zeros = lambda index: np.zeros([b - a for a, b in index], dtype)  # noqa: E731
        if path[0] != "blocks":
            if ".".join(path) not in self.top:
                return zeros
            name, part = self.top[".".join(path)]
            return lambda index: _read_part(self.src, name, part, index).astype(dtype, copy=False)
        stacked = self.cfg.scan_layers
        source = self.layer.get(".".join(path[1:] if stacked else path[2:]))
        if source is None:
            return zeros
        m, part = source

        def layer(i: int, index) -> np.ndarray:
            base = self.prefix + self.layer_fmt.format(i=i)
            if not m.experts:
                return _read_part(self.src, base + m.hf, part, index).astype(dtype, copy=False)
            out = np.empty([b - a for a, b in index], dtype)  # expert by expert, in place
            for e, j in enumerate(range(*index[0])):
                name, lead = m.expert_source(j)
                out[e] = _read_part(self.src, base + name, part, index[1:], lead)
            return out

        if not stacked:
            return lambda index: layer(int(path[1]), index)

        def read(index):
            out = np.empty([b - a for a, b in index], dtype)
            for j, i in enumerate(range(*index[0])):
                out[j] = layer(i, index[1:])
            return out

        return read


def _plan(directory: str, **overrides) -> _Plan:
    """Read and check config.json and the safetensors headers (no tensor values except Llama's gate biases)."""
    _check_overrides(overrides)
    arch, cfg, flags = _hf_config_to_jaxperf(_read_config(directory))
    cfg = validate_model(dataclasses.replace(cfg, **overrides))
    src = Checkpoint(directory)
    model_prefixes, layer_fmt = _PREFIXES[arch]
    prefix = next((p for p in model_prefixes if any(k.startswith(p) for k in src.shapes)), model_prefixes[-1])
    if arch in MOE_ARCHS:  # the layout of the experts: hub (one tensor per expert) or fused
        flags["fused"] = any(k.endswith(".mlp.experts.gate_up_proj") for k in src.shapes)
    layer_maps, top_maps = _maps(arch, cfg, flags)

    wanted: list[tuple[str, tuple[int, ...], _Map]] = [(_full(prefix, m.hf), m.hf_shape, m) for m in top_maps]
    for i in range(cfg.n_layers):
        wanted += [(prefix + layer_fmt.format(i=i) + name, shape, m)
                   for m in layer_maps for name, shape, _ in m.stored()]
    missing = [name for name, _, _ in wanted if name not in src.shapes]
    if missing:
        raise HFCheckpointError(f"{len(missing)} tensor(s) missing from {directory} for a {SUPPORTED[arch]} with "
                                f"{cfg.n_layers} layers: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    known = {name for name, _, _ in wanted} | ({"lm_head.weight"} if cfg.tie_embeddings else set())
    extra = sorted(k for k in src.shapes if k not in known and not k.endswith(_IGNORED_SUFFIXES))
    if extra:
        raise HFCheckpointError(f"{len(extra)} tensor(s) in {directory} have no place in jaxperf's model (a feature "
                                f"it lacks, or more layers than config.json says): {extra[:5]}")
    for name, shape, m in wanted:
        if src.shapes[name] != shape:
            raise HFCheckpointError(f"tensor {name} has shape {src.shapes[name]} but config.json implies "
                                    f"{shape}: the config and the weights disagree")
        if m.zero_only:
            a = src.read(name).astype(np.float32)
            if np.any(a != 0):
                raise HFCheckpointError(
                    f"{name} is non-zero (max |b| = {float(np.max(np.abs(a))):.3g}): jaxperf's SwiGLU has biases on "
                    f"the up and down projections only, so this checkpoint cannot be represented exactly")
    top = {p.jp: (_full(prefix, m.hf), p) for m in top_maps for p in m.parts}
    layer = {p.jp: (m, p) for m in layer_maps for p in m.parts}
    return _Plan(arch, cfg, src, prefix, layer_fmt, top, layer)


def _leaves(cfg: ModelConfig):
    """[(path, ShapeDtypeStruct)] of the jaxperf model's parameters and the treedef to rebuild the pure dict."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(_template(cfg))
    return [(tuple(_key(k) for k in path), leaf) for path, leaf in flat], treedef


def import_hf(directory: str, **overrides) -> tuple[ModelConfig, dict]:
    """Read a Hugging Face checkpoint (`SUPPORTED`: GPT-2, Llama, Mixtral, Qwen2, Qwen2-MoE) into jaxperf's layout,
    on the host.

    Args:
      directory: holds config.json and *.safetensors (one file, or shards listed in model.safetensors.index.json).
      **overrides: ModelConfig fields that do not change the computation (`RUNTIME_FIELDS`: dtype, param_dtype,
        scan_layers, remat, attention_impl, norm_impl, loss_impl...).

    Returns:
      (cfg, params): a resolved ModelConfig reproducing the HF model (float32, vocab_multiple=1) and the pure-dict
      parameters as numpy arrays in cfg.param_dtype, layers stacked on a leading axis when cfg.scan_layers. The
      whole model passes through the host; `load_hf_params` instead places each device's block on its own.

    Raises HFCheckpointError before anything is compiled for unsupported architectures or settings, missing or
    unexpected tensors and shape mismatches.
    """
    plan = _plan(directory, **overrides)
    leaves, treedef = _leaves(plan.cfg)
    values = [plan.reader(path, leaf.dtype)([(0, d) for d in leaf.shape]) for path, leaf in leaves]
    return plan.cfg, _plain(jax.tree_util.tree_unflatten(treedef, values))


def load_hf_params(directory: str, cfg: ModelConfig, shardings: Any) -> dict:
    """The checkpoint's parameters as jax Arrays placed with `shardings`, each device reading its own slice.

    No device ever holds more of a tensor than its own shard, and the host one device's block at a time: each block
    is read from just the rows and columns of the HF tensor that make it up (memory-mapped safetensors), copied to
    its device(s) and dropped (`_place`), so a model larger than one device, or than the host's free memory, loads
    onto a mesh that holds it.

    Args:
      directory: the Hugging Face checkpoint.
      cfg: the jaxperf ModelConfig to load into: the checkpoint's (`hf_model_config`) with any RUNTIME_FIELDS changed
        (scan_layers, param_dtype...); any other difference is an HFCheckpointError naming both values.
      shardings: a pure dict of `jax.sharding.Sharding`s with the parameters' structure (`Task.param_shardings`).
    """
    cfg = validate_model(cfg)
    want = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(ModelConfig) if f.name in RUNTIME_FIELDS}
    plan = _plan(directory, **want)
    differ = [f"model.{f.name}={getattr(cfg, f.name)!r} (the checkpoint has {getattr(plan.cfg, f.name)!r})"
              for f in dataclasses.fields(ModelConfig) if getattr(cfg, f.name) != getattr(plan.cfg, f.name)]
    if differ:
        raise HFCheckpointError(f"{directory} does not hold this model: {'; '.join(differ[:3])}")
    leaves, treedef = _leaves(plan.cfg)
    arrays = [_place(leaf.shape, sharding, plan.reader(path, leaf.dtype))
              for (path, leaf), sharding in zip(leaves, treedef.flatten_up_to(shardings))]
    return _plain(jax.tree_util.tree_unflatten(treedef, arrays))


def _place(shape: tuple[int, ...], sharding, read: Callable[[list[tuple[int, int]]], np.ndarray]) -> jax.Array:
    """A global array from `read(block)`, one block at a time: each distinct block of this process's devices is
    read, copied to the devices that hold it and dropped before the next one is read, so the host holds one
    device's share of one parameter at a time (`jax.make_array_from_callback` would read every device's block
    first)."""
    blocks: dict[tuple, list] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        blocks.setdefault(tuple(s.indices(d)[:2] for s, d in zip(index, shape)), []).append(device)
    arrays = []
    for block, devices in blocks.items():
        host = read(list(block))
        arrays += [jax.device_put(host, d, may_alias=False) for d in devices]
        del host
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def _plain(tree):
    """Plain nested dicts (nnx pure dicts can be other mappings); integer keys of unscanned layers stay ints."""
    if isinstance(tree, dict) or hasattr(tree, "items"):
        return {k: _plain(v) for k, v in tree.items()}
    return tree


# --------------------------------------------------------------------------------------------------------------------
# Building a model


def load_hf_model(directory: str, *, mesh=None, rules="fsdp", **overrides):
    """A jaxperf `GPT` (Flax NNX module) holding a Hugging Face checkpoint's weights.

    Without a mesh the parameters are plain arrays on the default device. With a mesh they are placed with the
    shardings that `Task.create(..., mesh, rules, ...)` derives for the model (strategy name or `Rules`), each device
    reading only its slice (`load_hf_params`), so the model is ready for sharded inference, and
    `nnx.to_pure_dict(nnx.state(model, nnx.Param))` gives sharded params for a `TrainState`. `**overrides` as in
    `import_hf`.

        model = load_hf_model("ckpt/")
        logits_BxLxV = model(tokens_BxL)
    """
    cfg = hf_model_config(directory, **overrides)
    if mesh is not None:
        task = Task.create(lambda r: GPT(cfg, rngs=r), mesh, get_rules(rules, mesh))
        return task.merge(load_hf_params(directory, cfg, task.param_shardings))
    with _compat.no_eager_sharding():
        abstract = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))
    graphdef, template, other = nnx.split(abstract, nnx.Param, ...)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    params = load_hf_params(directory, cfg, jax.tree.map(lambda _: device, nnx.to_pure_dict(template)))
    nnx.replace_by_pure_dict(template, params)
    return nnx.merge(graphdef, template, other)


# --------------------------------------------------------------------------------------------------------------------
# Writing


def default_arch(cfg: ModelConfig) -> str:
    """The HF architecture a model exports as when none is named: Qwen2-MoE for an MoE model with shared experts,
    Mixtral for one without, Qwen2 for a Llama-style model with q/k/v biases alone, else the model's style."""
    cfg = cfg.resolved()
    if cfg.n_experts:
        return "qwen2_moe" if cfg.n_shared_experts else "mixtral"
    if cfg.style == "llama" and cfg.qkv_bias and not cfg.use_bias:
        return "qwen2"
    return cfg.style


def _export_check(cfg: ModelConfig, arch: str) -> None:
    llama = {"norm": "rmsnorm", "position": "rope", "mlp_act": "swiglu"}
    qwen2 = {**llama, "use_bias": False, "qkv_bias": True}
    need = {
        "gpt2": {"norm": "layernorm", "position": "learned", "mlp_act": ("gelu", "gelu_exact"), "use_bias": True,
                 "qkv_bias": True},
        "llama": {**llama, "qkv_bias": cfg.use_bias},  # attention_bias: q, k, v and o, or none
        "mixtral": {**llama, "use_bias": False, "qkv_bias": False, "router": "softmax", "router_norm_topk": True,
                    "moe_every": 1, "n_shared_experts": 0},
        "qwen2": qwen2,
        "qwen2_moe": {**qwen2, "router": "softmax", "moe_every": 1, "shared_expert_gate": True},
    }[arch]
    if arch in MOE_ARCHS and not cfg.n_experts:
        raise HFCheckpointError(f"cannot export a dense model (model.n_experts=0) as {SUPPORTED[arch]}: export it as "
                                f"'{'llama' if arch == 'mixtral' else 'qwen2'}'")
    if arch not in MOE_ARCHS and cfg.n_experts:
        raise HFCheckpointError(f"cannot export a mixture-of-experts model (model.n_experts={cfg.n_experts}) as "
                                f"{SUPPORTED[arch]}: export it as {' or '.join(map(repr, MOE_ARCHS))}")
    if cfg.router_bias:
        raise HFCheckpointError(f"cannot export model.router_bias=true as {SUPPORTED[arch]}: no Hugging Face format "
                                f"jaxperf writes holds a routing bias, and without it the tokens would take other "
                                f"experts; keep the run in jaxperf's format (generate and serve read it), or train "
                                f"with model.router_bias=false to export")
    if arch == "qwen2_moe" and not cfg.n_shared_experts:
        raise HFCheckpointError("cannot export model.n_shared_experts=0 as Qwen2MoeForCausalLM, whose layers each "
                                "have a gated shared expert: export it as 'mixtral'")
    for key, value in need.items():
        ok = value if isinstance(value, tuple) else (value,)
        if getattr(cfg, key) not in ok:
            raise HFCheckpointError(f"cannot export model.{key}={getattr(cfg, key)!r} as {SUPPORTED[arch]}, which "
                                    f"needs {key}={' or '.join(map(repr, ok))}; pick the arch that matches the model")
    if arch == "gpt2" and (cfg.n_kv_heads != cfg.n_heads or cfg.n_heads * cfg.head_dim != cfg.d_model):
        raise HFCheckpointError(
            f"GPT-2 needs n_kv_heads == n_heads and n_heads * head_dim == d_model; got n_heads={cfg.n_heads}, "
            f"n_kv_heads={cfg.n_kv_heads}, head_dim={cfg.head_dim}, d_model={cfg.d_model}: export as 'llama' instead")


def _nonzero(x) -> bool:
    return bool(jnp.any(x != 0)) if isinstance(x, jax.Array) else bool(np.any(np.asarray(x) != 0))


def _llama_bias_flags(cfg: ModelConfig, params: dict) -> dict:
    """Llama's attention_bias / mlp_bias: written only for the groups of jaxperf biases that are not all zero."""
    if not cfg.use_bias:
        return {"attention_bias": False, "mlp_bias": False}
    layers = [params["blocks"]] if cfg.scan_layers else list(params["blocks"].values())
    nonzero = lambda part, names: any(_nonzero(lay[part][n]) for lay in layers for n in names)  # noqa: E731
    return {"attention_bias": nonzero("attn", ("bias_q_HxDh", "bias_k_KxDh", "bias_v_KxDh", "bias_o_D")),
            "mlp_bias": nonzero("mlp", ("bias_in_F", "bias_out_D"))}


def _hf_config(cfg: ModelConfig, arch: str, flags: dict, dtype: str) -> dict:
    if arch == "gpt2":
        act = {v: k for k, v in GPT2_ACTIVATIONS.items() if k != "gelu_pytorch_tanh"}[cfg.mlp_act]
        return {
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
            "n_positions": cfg.max_seq_len, "n_embd": cfg.d_model, "n_layer": cfg.n_layers, "n_head": cfg.n_heads,
            "n_inner": cfg.mlp_dim, "activation_function": act, "layer_norm_epsilon": cfg.norm_eps,
            "tie_word_embeddings": cfg.tie_embeddings, "scale_attn_weights": True, "torch_dtype": dtype,
        }
    theta = float(cfg.rope_theta)
    if arch in ("qwen2", "qwen2_moe"):
        out = {
            "architectures": [SUPPORTED[arch]], "model_type": arch, "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model, "intermediate_size": cfg.mlp_dim, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
            "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
            "rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
            "use_sliding_window": False, "sliding_window": None, "tie_word_embeddings": cfg.tie_embeddings,
            "torch_dtype": dtype,
        }
        if arch == "qwen2_moe":
            out.update({
                "num_experts": cfg.n_experts, "num_experts_per_tok": cfg.experts_per_token,
                "moe_intermediate_size": cfg.moe_mlp_dim, "shared_expert_intermediate_size": cfg.shared_mlp_dim,
                "norm_topk_prob": cfg.router_norm_topk, "decoder_sparse_step": 1, "mlp_only_layers": [],
                "router_aux_loss_coef": cfg.router_aux_loss_coef, "output_router_logits": False, "qkv_bias": True,
            })
        return out
    if arch == "mixtral":
        return {
            "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model, "intermediate_size": cfg.moe_mlp_dim, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
            "num_local_experts": cfg.n_experts, "num_experts_per_tok": cfg.experts_per_token,
            "router_aux_loss_coef": cfg.router_aux_loss_coef, "router_jitter_noise": 0.0, "sliding_window": None,
            "output_router_logits": False, "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len,
            "rms_norm_eps": cfg.norm_eps, "rope_theta": theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": theta},
            "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": dtype,
        }
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "intermediate_size": cfg.mlp_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": theta, "rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "attention_bias": flags["attention_bias"], "mlp_bias": flags["mlp_bias"],
        "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": dtype,
    }


def _host(x, lead: tuple[int, ...] = ()) -> np.ndarray:
    """A parameter, or its slice `lead` along its leading dims (one layer of a stacked one, one expert), on the host,
    copied shard by shard from its devices: the host holds this one tensor, the devices keep theirs."""
    if not isinstance(x, jax.Array):
        return np.asarray(x)[lead]
    if not x.is_fully_addressable:
        raise HFCheckpointError("export_hf writes from one process: this parameter is spread over several processes; "
                                "export the run's checkpoint with `jaxperf export` (one process) instead")
    n = len(lead)
    shape = x.shape[n:]
    out = np.empty(shape, x.dtype)
    done = set()
    for shard in x.addressable_shards:
        index, data = shard.index, shard.data
        if n:
            spans = [s.indices(d)[:2] for s, d in zip(index[:n], x.shape[:n])]
            if not all(lo <= i < hi for (lo, hi), i in zip(spans, lead)):
                continue
            local = tuple(i - lo for (lo, _), i in zip(spans, lead))
            # On CPU the shard is host memory already: take the slice as a view. Elsewhere slice on the device, so
            # that only this slice crosses to the host.
            on_host = shard.device.platform == "cpu"
            index, data = index[n:], (np.asarray(data)[local] if on_host else data[local])
        key = tuple(s.indices(d)[:2] for s, d in zip(index, shape))
        if key not in done:
            done.add(key)
            out[index] = np.asarray(data)
    return out


def _get(tree: dict, dotted: str):
    for p in dotted.split("."):
        tree = tree[p]
    return tree


def _write_tokenizer(tokenizer: str, directory: str, cfg: ModelConfig, special: dict) -> None:
    """tokenizer.json and, beside it in the source, tokenizer_config.json / special_tokens_map.json (a minimal
    tokenizer_config.json naming the special tokens is written when the source has none)."""
    file = os.path.join(tokenizer, "tokenizer.json") if os.path.isdir(tokenizer) else tokenizer
    if not os.path.isfile(file):
        raise HFCheckpointError(f"tokenizer={tokenizer!r}: no tokenizer.json there")
    source = os.path.dirname(os.path.abspath(file))
    if os.path.abspath(directory) != source:
        shutil.copyfile(file, os.path.join(directory, "tokenizer.json"))
        for name in TOKENIZER_FILES[1:]:
            if os.path.exists(os.path.join(source, name)):
                shutil.copyfile(os.path.join(source, name), os.path.join(directory, name))
    if not os.path.exists(os.path.join(directory, "tokenizer_config.json")):
        tok = Tokenizer.from_file(file)
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.max_seq_len}
        for key in SPECIAL_TOKENS:
            if special.get(key) is not None:
                config[key.removesuffix("_id")] = tok.id_to_token(special[key])
        with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
            json.dump(config, f, indent=2)


def export_hf(cfg: ModelConfig, params, directory: str, arch: str | None = None, *,
              special_tokens: dict[str, int | None] | None = None, generation_config: dict | None = None,
              tokenizer: str | None = None, max_shard_size: int | str = "2GB", dtype: str = "float32") -> list[str]:
    """Write a directory that `transformers` loads with `from_pretrained(directory)`, and generates from.

    Writes config.json (with bos/eos/pad_token_id), generation_config.json, the weights as model.safetensors, or as
    model-0000k-of-0000n.safetensors shards with model.safetensors.index.json when they exceed `max_shard_size`, and
    the tokenizer files when `tokenizer` is given. The weights are streamed: one tensor at a time is copied from its
    devices to the host (one layer of a stacked parameter), converted and written, so the host never holds more than
    one tensor, whatever the model's size.

    Args:
      cfg: the model's ModelConfig.
      params: pure-dict parameters (`TrainState.params`, sharded jax Arrays or numpy) or a jaxperf GPT module.
      directory: created if needed; existing config files and model*.safetensors are replaced.
      arch: "gpt2" (GPT2LMHeadModel), "llama" (LlamaForCausalLM), "mixtral" (MixtralForCausalLM), "qwen2"
        (Qwen2ForCausalLM) or "qwen2_moe" (Qwen2MoeForCausalLM); the experts are written in the hub layout (one
        tensor per expert and projection). None: `default_arch(cfg)`.
      special_tokens: {"bos_token_id", "eos_token_id", "pad_token_id"} (missing ones are written as null), e.g.
        `jaxperf.data.special_token_ids(source_dir)` or the tokenizer's ids.
      generation_config: the source's generation_config.json (`read_generation_config`); the special token ids fill
        the keys it lacks.
      tokenizer: a tokenizer.json (or a directory holding one) copied with its tokenizer_config.json and
        special_tokens_map.json.
      max_shard_size: bytes or "2GB"-style; each weight file stays under it (a bigger tensor gets a file alone).
      dtype: "float32", "bfloat16" or "float16" for the written weights.

    Returns the weight files written. Rows of a padded vocabulary (cfg.padded_vocab > cfg.vocab_size) are dropped.
    """
    cfg = validate_model(cfg)
    arch = arch or default_arch(cfg)
    if arch not in SUPPORTED:
        raise HFCheckpointError(f"arch={arch!r}: export supports {sorted(SUPPORTED)}")
    if dtype not in EXPORT_DTYPES:
        raise HFCheckpointError(f"dtype={dtype!r}: export writes {', '.join(EXPORT_DTYPES)}")
    _export_check(cfg, arch)
    max_bytes = parse_size(max_shard_size)
    if isinstance(params, nnx.Module):
        params = nnx.to_pure_dict(nnx.state(params, nnx.Param))
    params = _plain(params)
    _check_against(params, _template(cfg))

    V = cfg.vocab_size
    trim = {"embed_VxD": lambda a: a[:V], "head_DxV": lambda a: a[:, :V]}
    flags = {"mixtral": {"fused": False}, "qwen2": {"attention_bias": False, "mlp_bias": False, "qkv_bias": True},
             "qwen2_moe": {"attention_bias": False, "mlp_bias": False, "qkv_bias": True, "fused": False}}.get(arch)
    flags = flags or _llama_bias_flags(cfg, params)
    out_cfg = dataclasses.replace(cfg, vocab_multiple=1)
    layer_maps, top_maps = _maps(arch, out_cfg, flags)
    prefix, layer_fmt = _PREFIXES[arch][0][0], _PREFIXES[arch][1]

    def top_value(path: str) -> np.ndarray:
        return trim.get(path, lambda a: a)(_host(_get(params, path)))

    def layer_value(i: int, path: str, expert: int | None) -> np.ndarray:
        lead = () if expert is None else (expert,)
        if cfg.scan_layers:
            return _host(_get(params["blocks"], path), (i, *lead))
        return _host(_get(params["blocks"][i], path), lead)

    tensors = [(_full(prefix, m.hf), m.hf_shape, lambda m=m: _to_hf(m, top_value)) for m in top_maps]
    for i in range(cfg.n_layers):
        for m in layer_maps:
            assert not m.experts or "{j}" in m.hf, "export writes one tensor per expert"
            tensors += [(prefix + layer_fmt.format(i=i) + name, shape,
                         lambda i=i, m=m, j=j: _to_hf(m, lambda path: layer_value(i, path, j)))
                        for name, shape, j in m.stored()]
    special = {key: (special_tokens or {}).get(key) for key in SPECIAL_TOKENS}
    os.makedirs(directory, exist_ok=True)
    files = write_shards(directory, tensors, jnp.dtype(dtype), max_bytes)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({**_hf_config(cfg, arch, flags, dtype), **special}, f, indent=2)
    generation = {k: v for k, v in (generation_config or {}).items() if k != "_from_model_config"}
    generation.update({k: v for k, v in special.items() if v is not None and k not in generation})
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump(generation, f, indent=2)
    if tokenizer is not None:
        _write_tokenizer(str(tokenizer), directory, cfg, special)
    return files


def _check_against(params: dict, template: dict, where: str = "") -> None:
    """Same keys and shapes as the jaxperf model (an internal invariant on import, a user error on export)."""
    if set(params) != set(template):
        raise HFCheckpointError(f"parameters at {where or '<root>'} have keys {sorted(map(str, params))}, the jaxperf "
                                f"model for this config has {sorted(map(str, template))}")
    for k, t in template.items():
        p = params[k]
        if isinstance(t, dict):
            _check_against(p, t, f"{where}{k}.")
        elif tuple(np.shape(p)) != tuple(t.shape):
            raise HFCheckpointError(f"parameter {where}{k} has shape {tuple(np.shape(p))}, the jaxperf model for this "
                                    f"config expects {tuple(t.shape)}")

