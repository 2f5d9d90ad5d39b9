"""FLOPs per token of a decoder-only Transformer, for MFU and HFU.

Training FLOPs per token (forward + backward = 3 x forward, each multiply-add = 2 FLOPs):

    6 * N_matmul  +  6 * n_layers * L * H * Dh        (causal: half of the 12 * n_layers * L * H * Dh of full attention)

N_matmul counts the parameters used in matrix multiplies: every weight of every layer plus the output projection D x V
(the embedding lookup and position table are gathers, not matmuls; a tied embedding still counts once, as the output
projection). The attention term is QK^T and PV: 2 matmuls of L x Dh per head per token, forward 4 * L * H * Dh FLOPs,
times 3 for training, halved for causal masks because half the score matrix is never needed.

HFU (hardware FLOPs utilisation) also counts the forward work the remat policy makes the hardware redo in the backward
pass (`recompute_flops_per_token`). Each layer is one checkpointed function, so what is recomputed is the part of the
layer's forward that its backward needs and the policy did not save:

    full                 every matmul of the layer except the MLP output projection (its result only feeds the
                         residual stream, i.e. the next layer's saved input, so XLA drops it), plus the attention core
    save_dots            nothing (every matmul output is saved; only elementwise work, which we do not count, is redone)
    save_dots_no_batch   the attention core (QK^T and PV are the only dots with batch dims)
    named policies       the attention core, and each of the q, k, v, output and MLP input (gate, up) projections
                         whose output the policy neither saves nor offloads (minimal: the core alone;
                         save_dot_except_mlpwi, alias save_attn_proj: the core and the MLP input projections)

A mixture-of-experts layer (jaxperf.models.moe) counts the parameters one token uses: the router (D x E), its k
routed experts and the shared experts. Experts a token is not routed to do no work for it, so MFU is that of the
active parameters; on the capacity path the padding of half-empty expert buffers is not counted either (it is not
useful work), and neither is the routing itself (sorting, gathers, top-k).

These agree with XLA's own count (`compiled.cost_analysis()["flops"]` of a train step) to about 2% on the built-in
GPT with XLA attention and unrolled layers; tests/test_perf.py checks it. Two things XLA counts differently:
it computes the whole score matrix, so compare it with `causal=False`; and it counts a `lax.scan` body once, not once
per layer, so compare with `scan_layers=False`. It also counts elementwise work (norms, softmax, activations), which
is why its figure sits a little above ours.
"""

from __future__ import annotations

from jaxperf.config import ModelConfig
from jaxperf.models.layers import remat_saves
from jaxperf.models.moe import is_moe_layer


def _layer_matmul_params(r: ModelConfig, layer: int = 0) -> dict[str, int]:
    """Matmul parameters one token meets in layer `layer`; in an MoE layer "mlp_in" also holds the router's."""
    D, H, K, Dh, F = r.d_model, r.n_heads, r.n_kv_heads, r.head_dim, r.mlp_dim
    gate = 2 if r.mlp_act == "swiglu" else 1
    if is_moe_layer(r, layer):  # the k routed experts (moe_mlp_dim wide each), the shared ones and their gate
        F = r.experts_per_token * r.moe_mlp_dim + (r.shared_mlp_dim if r.n_shared_experts else 0)
        router = D * r.n_experts + (D if r.n_shared_experts and r.shared_expert_gate else 0)
    else:
        router = 0
    return {
        "qkv": D * H * Dh + 2 * D * K * Dh,
        "attn_out": H * Dh * D,
        "mlp_in": gate * D * F + router,
        "mlp_out": F * D,
    }


def _layers(r: ModelConfig) -> list[dict[str, int]]:
    return [_layer_matmul_params(r, i) for i in range(r.n_layers)]


def matmul_params(cfg: ModelConfig) -> int:
    """Parameters that take part in matmuls for one token (see module docstring): with MoE, the active ones."""
    r = cfg.resolved()
    return sum(sum(p.values()) for p in _layers(r)) + r.d_model * r.padded_vocab


def attention_flops_per_token(cfg: ModelConfig, seq_len: int, *, causal: bool = True) -> float:
    """Training FLOPs per token spent in QK^T and PV."""
    r = cfg.resolved()
    full = 12 * r.n_layers * seq_len * r.n_heads * r.head_dim
    return full / 2 if causal else full


def recompute_flops_per_token(cfg: ModelConfig, seq_len: int, *, causal: bool = True) -> float:
    """Matmul FLOPs per token that the remat policy `cfg.remat` recomputes in the backward pass (see module doc)."""
    r = cfg.resolved()
    layers = _layers(r)
    attn_fwd = attention_flops_per_token(r, seq_len, causal=causal) / 3
    if r.remat == "none" or r.remat == "save_dots":
        return 0.0
    if r.remat == "save_dots_no_batch":
        return attn_fwd
    names = remat_saves(r)
    if names is None:
        raise ValueError(f"no recompute count for remat policy {r.remat!r}: add it to recompute_flops_per_token")
    kept = set(names[0]) | set(names[1])  # an offloaded activation comes back from the host, it is not recomputed
    q_share = r.n_heads / (r.n_heads + 2 * r.n_kv_heads)  # of the q, k, v projection parameters
    qkv = q_share * ("query_proj" not in kept) + (1 - q_share) / 2 * (("key_proj" not in kept)
                                                                      + ("value_proj" not in kept))
    if r.mlp_act == "swiglu":
        mlp_in = (("mlpwi_0" not in kept) + ("mlpwi_1" not in kept)) / 2
    else:
        mlp_in = float("mlpwi" not in kept)
    # No named activation holds the attention probabilities (XLA) or the row logsumexp (flash), so the attention
    # core's forward is counted whole even where the policy keeps its output ("context"): with XLA attention that
    # is an upper bound, by QK^T's half, PV then being needed no more.
    return 2 * sum(p["qkv"] * qkv + p["attn_out"] * ("out_proj" not in kept) + p["mlp_in"] * mlp_in
                   for p in layers) + attn_fwd


def flops_per_token(cfg: ModelConfig, seq_len: int, *, causal: bool = True, hardware: bool = False) -> float:
    """Training FLOPs per token; `hardware=True` adds the forward work recomputed by remat (for HFU)."""
    model = 6 * matmul_params(cfg) + attention_flops_per_token(cfg, seq_len, causal=causal)
    if hardware:
        model += recompute_flops_per_token(cfg, seq_len, causal=causal)
    return model
