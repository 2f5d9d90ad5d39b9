"""The same GPT in PyTorch, trained the same way: the peer that jaxperf's tokens/s is compared with.

    python benchmarks/peers/torch_gpt.py --config '{"model": {...}, "optim": {...}, "batch_size": 16, ...}'
    python benchmarks/peers/torch_gpt.py --config '...' --parity params.npz --out result.npz

This file imports only torch and numpy (it runs in whatever interpreter has torch, possibly one without jax). The model
follows jaxperf.models.gpt for a resolved ModelConfig: pre-norm blocks; GPT-2 style (LayerNorm with bias, learned
positions, tanh-GELU MLP, biases in projections) or Llama style (RMSNorm, rotate-half RoPE, SwiGLU, grouped-query
heads, no biases); tied or separate output projection over the padded vocabulary; fp32 norms and cross-entropy.
Initialisation matches (normal(init_std); output projections scaled by 1/sqrt(2 n_layers); positions normal(0.01)).
The optimizer matches jaxperf.step.optimizer: AdamW(b1, b2, eps, weight_decay on tensors with >= 2 dims), linear
warm-up then cosine decay (step 0 already at lr / warmup_steps), global-norm clipping.

Timing matches benchmarks/bench_train_step.py: `warmup` untimed steps, then `steps` steps each timed to completion
(CUDA synchronised), the median reported. One JSON line goes to stdout; errors (e.g. torch.compile failing) become an
"error" field in that line rather than a crash.

Legend: B batch, L length, D embed, H heads, K kv heads, Dh head dim, F mlp, V padded vocab.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import traceback

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class Norm(nn.Module):
    def __init__(self, dim: int, kind: str, eps: float, use_bias: bool):
        super().__init__()
        self.kind, self.eps = kind, eps
        self.scale = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if use_bias and kind == "layernorm" else None

    def forward(self, x):
        dt = x.dtype
        x = x.float()
        if self.kind == "layernorm":
            x = F.layer_norm(x, (x.shape[-1],), self.scale.float(), None if self.bias is None else self.bias.float(),
                             self.eps)
        else:
            x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps) * self.scale.float()
        return x.to(dt)


def rope(x_BxLxNxDh, positions_L, theta: float):
    half = x_BxLxNxDh.shape[-1] // 2
    freq = theta ** (-torch.arange(half, dtype=torch.float32, device=x_BxLxNxDh.device) / half)
    angle = (positions_L.float()[:, None] * freq[None, :])[None, :, None, :]
    sin, cos = angle.sin(), angle.cos()
    x = x_BxLxNxDh.float()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x_BxLxNxDh.dtype)


def _normal(shape, std):
    return nn.Parameter(torch.randn(*shape) * std)


class Block(nn.Module):
    def __init__(self, m: dict):
        super().__init__()
        D, H, K, Dh, Fm = m["d_model"], m["n_heads"], m["n_kv_heads"], m["head_dim"], m["mlp_dim"]
        std, out_std = m["init_std"], m["init_std"] / math.sqrt(2 * m["n_layers"])
        self.m, self.H, self.K, self.Dh = m, H, K, Dh
        bias = m["use_bias"]
        self.attn_norm = Norm(D, m["norm"], m["norm_eps"], bias)
        self.mlp_norm = Norm(D, m["norm"], m["norm_eps"], bias)
        self.wq = _normal((D, H * Dh), std)
        self.wk = _normal((D, K * Dh), std)
        self.wv = _normal((D, K * Dh), std)
        self.wo = _normal((H * Dh, D), out_std)
        self.w_in = _normal((D, Fm), std)
        self.w_gate = _normal((D, Fm), std) if m["mlp_act"] == "swiglu" else None
        self.w_out = _normal((Fm, D), out_std)
        zeros = lambda n: nn.Parameter(torch.zeros(n)) if bias else None  # noqa: E731
        self.bq, self.bk, self.bv, self.bo = zeros(H * Dh), zeros(K * Dh), zeros(K * Dh), zeros(D)
        self.b_in, self.b_out = zeros(Fm), zeros(D)

    @staticmethod
    def _lin(x, w, b):
        y = x @ w.to(x.dtype)
        return y if b is None else y + b.to(x.dtype)

    def forward(self, x_BxLxD, positions_L):
        B, L, _ = x_BxLxD.shape
        h = self.attn_norm(x_BxLxD)
        q = self._lin(h, self.wq, self.bq).view(B, L, self.H, self.Dh)
        k = self._lin(h, self.wk, self.bk).view(B, L, self.K, self.Dh)
        v = self._lin(h, self.wv, self.bv).view(B, L, self.K, self.Dh)
        if self.m["position"] == "rope":
            q, k = rope(q, positions_L, self.m["rope_theta"]), rope(k, positions_L, self.m["rope_theta"])
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # B x N x L x Dh
        if self.K != self.H:  # query head h uses kv head h // (H / K), as in jaxperf's grouped layout
            k = k.repeat_interleave(self.H // self.K, dim=1)
            v = v.repeat_interleave(self.H // self.K, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        o = o.transpose(1, 2).reshape(B, L, self.H * self.Dh)
        x_BxLxD = x_BxLxD + self._lin(o, self.wo, self.bo)
        h = self.mlp_norm(x_BxLxD)
        u = self._lin(h, self.w_in, self.b_in)
        if self.w_gate is not None:
            u = F.silu(h @ self.w_gate.to(h.dtype)) * u
        else:
            u = F.gelu(u, approximate="none" if self.m["mlp_act"] == "gelu_exact" else "tanh")
        return x_BxLxD + self._lin(u, self.w_out, self.b_out)


class TorchGPT(nn.Module):
    """Token embedding -> blocks -> final norm -> logits over the padded vocabulary; `loss()` is next-token CE."""

    def __init__(self, m: dict):
        super().__init__()
        self.m = m
        D, V = m["d_model"], m["padded_vocab"]
        self.embed = _normal((V, D), m["init_std"])
        self.pos = _normal((m["max_seq_len"], D), 0.01) if m["position"] == "learned" else None
        self.blocks = nn.ModuleList([Block(m) for _ in range(m["n_layers"])])
        self.final_norm = Norm(D, m["norm"], m["norm_eps"], m["use_bias"])
        self.head = None if m["tie_embeddings"] else _normal((D, V), m["init_std"])
        self.dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[m["dtype"]]

    def forward(self, tokens_BxL):
        L = tokens_BxL.shape[1]
        positions = torch.arange(L, device=tokens_BxL.device)
        x = self.embed[tokens_BxL].to(self.dtype)
        if self.pos is not None:
            x = x + self.pos[positions][None].to(self.dtype)
        for block in self.blocks:
            x = block(x, positions)
        h = self.final_norm(x)
        w = self.embed.t() if self.head is None else self.head
        return h @ w.to(h.dtype)

    def loss(self, inputs_BxL, targets_BxL):
        logits = self(inputs_BxL).float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets_BxL.reshape(-1))


def lr_lambda(o: dict, max_steps: int):
    """Multiplier of o["lr"] at update `step` (0-based), equal to jaxperf.step.optimizer.lr_schedule."""
    warm = o["warmup_steps"]
    decay = max(o["decay_steps"] or max_steps, warm + 1)
    end = o["min_lr_ratio"]

    def f(step: int) -> float:
        t = step + 1
        if t < warm:
            return t / warm
        frac = min(t - warm, decay - warm) / (decay - warm)
        return end + (1 - end) * 0.5 * (1 + math.cos(math.pi * frac))

    return f


def make_optimizer(model: nn.Module, o: dict, max_steps: int, device: str):
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": o["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}]
    kw = dict(lr=o["lr"], betas=(o["b1"], o["b2"]), eps=o["eps"])
    try:
        opt, kind = torch.optim.AdamW(groups, fused=True, **kw), "AdamW(fused=True)"
    except (RuntimeError, TypeError, ValueError):
        opt, kind = torch.optim.AdamW(groups, **kw), "AdamW"
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(o, max_steps))
    return opt, sched, kind


def train_step_fn(model, loss_model, opt, sched, clip: float):
    def step(inputs, targets):
        loss = loss_model(inputs, targets)
        loss.backward()
        if clip and clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


class _LossModule(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, inputs, targets):
        return self.model.loss(inputs, targets)


def build(cfg: dict, device: str, mode: str):
    torch.manual_seed(cfg.get("seed", 0))
    model = TorchGPT(cfg["model"]).to(device)
    loss_model = _LossModule(model)
    if mode == "compile":
        loss_model = torch.compile(loss_model)
    opt, sched, kind = make_optimizer(model, cfg["optim"], cfg["max_steps"], device)
    return model, train_step_fn(model, loss_model, opt, sched, cfg["optim"]["grad_clip"]), kind


def benchmark(cfg: dict) -> dict:
    """Train `cfg["warmup"] + cfg["steps"]` steps on one random batch; tokens/s from the median timed step."""
    mode = cfg.get("mode", "eager")
    device = cfg.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    out = {"peer": "torch", "mode": mode, "torch": torch.__version__, "torch_device": device,
           "torch_threads": torch.get_num_threads(), "batch_size": cfg["batch_size"], "seq_len": cfg["seq_len"]}
    if device == "cuda":
        out["device_name"] = torch.cuda.get_device_name(0)
    try:
        B, L = cfg["batch_size"], cfg["seq_len"]
        model, step, out["optimizer"] = build(cfg, device, mode)
        rng = np.random.default_rng(cfg.get("seed", 0))
        tokens = torch.from_numpy(rng.integers(0, cfg["model"]["vocab_size"], (B, L + 1)).astype(np.int64)).to(device)
        inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        t0 = time.perf_counter()
        losses = [step(inputs, targets)]
        sync()
        out["first_step_s"] = time.perf_counter() - t0  # includes torch.compile's compilation in compile mode
        for _ in range(cfg["warmup"] - 1):
            losses.append(step(inputs, targets))
        sync()
        times = []
        for _ in range(cfg["steps"]):
            t0 = time.perf_counter()
            losses.append(step(inputs, targets))
            sync()
            times.append(time.perf_counter() - t0)
        values = [float(v) for v in losses]
        if not all(math.isfinite(v) for v in values):
            raise FloatingPointError(f"non-finite loss in the peer: {values}")
        med = statistics.median(times)
        out.update(step_time_s={"median": med, "min": min(times), "max": max(times)}, tokens_per_s=B * L / med,
                   loss_first_last=[values[0], values[-1]], n_params=sum(p.numel() for p in model.parameters()))
    except Exception as e:  # reported, not raised: the caller still gets the jaxperf side of the comparison
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback_tail"] = traceback.format_exc().splitlines()[-6:]
    return out


def load_jaxperf_params(model: TorchGPT, flat: dict[str, np.ndarray]) -> None:
    """Copy parameters from jaxperf's GPT (pure-dict leaves flattened to "a.b.c" names, layers stacked on axis 0)."""
    m = model.m
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a, np.float32))  # noqa: E731
    with torch.no_grad():
        model.embed.copy_(t(flat["embed_VxD"]))
        if model.pos is not None:
            model.pos.copy_(t(flat["pos_LxD"]))
        if model.head is not None:
            model.head.copy_(t(flat["head_DxV"]))
        model.final_norm.scale.copy_(t(flat["final_norm.scale"]))
        if model.final_norm.bias is not None:
            model.final_norm.bias.copy_(t(flat["final_norm.bias"]))
        D = m["d_model"]
        for i, blk in enumerate(model.blocks):
            g = lambda name: flat[f"blocks.{name}"][i]  # noqa: E731
            for norm in ("attn_norm", "mlp_norm"):
                getattr(blk, norm).scale.copy_(t(g(f"{norm}.scale")))
                if getattr(blk, norm).bias is not None:
                    getattr(blk, norm).bias.copy_(t(g(f"{norm}.bias")))
            blk.wq.copy_(t(g("attn.wq_DxHxDh").reshape(D, -1)))
            blk.wk.copy_(t(g("attn.wk_DxKxDh").reshape(D, -1)))
            blk.wv.copy_(t(g("attn.wv_DxKxDh").reshape(D, -1)))
            blk.wo.copy_(t(g("attn.wo_HxDhxD").reshape(-1, D)))
            blk.w_in.copy_(t(g("mlp.w_in_DxF")))
            blk.w_out.copy_(t(g("mlp.w_out_FxD")))
            if blk.w_gate is not None:
                blk.w_gate.copy_(t(g("mlp.w_gate_DxF")))
            if blk.bq is not None:
                for p, name in ((blk.bq, "attn.bias_q_HxDh"), (blk.bk, "attn.bias_k_KxDh"),
                                (blk.bv, "attn.bias_v_KxDh"), (blk.bo, "attn.bias_o_D"), (blk.b_in, "mlp.bias_in_F"),
                                (blk.b_out, "mlp.bias_out_D")):
                    p.copy_(t(g(name).reshape(-1)))


def parity(cfg: dict, params_npz: str, out_npz: str, steps: int) -> None:
    """Logits of jaxperf's parameters on the given tokens and the losses of `steps` eager train steps."""
    data = dict(np.load(params_npz))
    tokens = torch.from_numpy(data.pop("__tokens__").astype(np.int64))
    model, step, _ = build(cfg, "cpu", "eager")
    load_jaxperf_params(model, data)
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    with torch.no_grad():
        logits = model(inputs).float().numpy()
    losses = [float(step(inputs, targets)) for _ in range(steps)]
    np.savez(out_npz, logits=logits, losses=np.asarray(losses))


def main(argv: list[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="JSON: model (resolved fields + padded_vocab), optim, batch_size, "
                   "seq_len, steps, warmup, max_steps, mode (eager|compile), device")
    p.add_argument("--parity", default=None, help="npz of jaxperf parameters (+ __tokens__): write logits and losses")
    p.add_argument("--out", default=None, help="npz path for --parity results")
    p.add_argument("--parity-steps", type=int, default=2)
    a = p.parse_args(argv)
    cfg = json.loads(a.config)
    if a.parity:
        if not a.out:
            raise SystemExit("--parity needs --out PATH.npz for the results")
        parity(cfg, a.parity, a.out, a.parity_steps)
        return None
    result = benchmark(cfg)
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
