"""FLOPs per token of a decoder-only Transformer, for MFU and HFU.

Training FLOPs per token (forward + backward = 3 x forward, each multiply-add = 2 FLOPs):

    6 * N_matmul  +  6 * n_layers * L * H * Dh        (causal: half of the 12 * n_layers * L * H * Dh of full attention)

N_matmul counts the parameters used in matrix multiplies: every weight of every layer plus the output projection D x V
(the embedding lookup and position table are gathers, not matmuls; a tied embedding still counts once, as the output
projection). The attention term is QK^T and PV: 2 matmuls of L x Dh per head per token, forward 4 * L * H * Dh FLOPs,
times 3 for training, halved for causal masks because half the score matrix is never needed.

HFU (hardware FLOPs utilisation) also counts work the remat policy makes the hardware redo: with full remat the forward
runs twice, so 8 instead of 6 per parameter; partial policies sit between (we count them as full: an upper bound).
"""

from __future__ import annotations

from jaxperf.config import ModelConfig


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters that take part in matmuls (see module docstring)."""
    r = cfg.resolved()
    D, H, K, Dh, F = r.d_model, r.n_heads, r.n_kv_heads, r.head_dim, r.mlp_dim
    attn = D * H * Dh + 2 * D * K * Dh + H * Dh * D
    mlp = (3 if r.mlp_act == "swiglu" else 2) * D * F
    return r.n_layers * (attn + mlp) + D * r.padded_vocab


def attention_flops_per_token(cfg: ModelConfig, seq_len: int, *, causal: bool = True) -> float:
    """Training FLOPs per token spent in QK^T and PV."""
    r = cfg.resolved()
    full = 12 * r.n_layers * seq_len * r.n_heads * r.head_dim
    return full / 2 if causal else full


def flops_per_token(cfg: ModelConfig, seq_len: int, *, causal: bool = True, hardware: bool = False) -> float:
    """Training FLOPs per token; `hardware=True` adds the forward recomputed by remat (for HFU)."""
    per_param = 6
    attn = attention_flops_per_token(cfg, seq_len, causal=causal)
    if hardware and cfg.remat != "none":
        per_param = 8
        attn *= 4 / 3
    return per_param * matmul_params(cfg) + attn
