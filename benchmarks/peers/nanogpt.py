"""nanoGPT's own GPT (Karpathy's nanoGPT, model.py) trained with torch.compile: a peer for jaxperf's train step.

nanoGPT's source is not part of this repository and is never committed: put its model.py at `.peer/nanogpt/model.py`
(ignored by git), e.g. from a checkout of https://github.com/karpathy/nanoGPT:

    mkdir -p .peer/nanogpt && cp path/to/nanoGPT/model.py .peer/nanogpt/

then, in any interpreter with torch (jax is not needed):

    python benchmarks/peers/nanogpt.py --nanogpt-dir .peer/nanogpt --n-layer 12 --n-head 12 --n-embd 768 \\
        --block-size 1024 --vocab-size 50304 --batch 16 --steps 10 --warmup 3 [--compile 1] [--dtype bfloat16]

The step is nanoGPT's train.py step without gradient accumulation: GPT(GPTConfig(..., dropout=0.0, bias=True)), the
model's own configure_optimizers (AdamW, weight decay 0.1 on tensors with >= 2 dims, lr 6e-4, betas (0.9, 0.95), fused
on CUDA), torch.compile(model), autocast to --dtype on CUDA (none on CPU, as train.py), TF32 matmuls and convolutions
allowed; then forward with targets -> backward -> clip the global grad norm to 1.0 -> optimizer step -> zero_grad. A
float16 run scales the loss with a GradScaler, as train.py does. Inputs and targets are random token ids [B, T], T =
block size, a few batches on the device used in turn.

Timing: `--warmup` untimed steps (the first one compiles; its time is compile_s), then `--steps` steps each timed to
completion (CUDA synchronised); tokens_per_s = B * T / median step time.

FLOPs per token, nanoGPT's count (estimate_mfu, after PaLM appendix B): 6 N + 12 L H Q T, N = get_num_params() (all
parameters but the position embedding; the tied token embedding counts once), L layers, H heads, Q head dim, T block
size. flops_per_token_with_pos uses N = get_num_params(non_embedding=False). MFU = flops_per_token_nanogpt *
tokens_per_s / --peak-flops, on CUDA only.

One JSON line goes to stdout (nanoGPT's own prints go to stderr). Any failure (nanoGPT missing, torch.compile failing,
a non-finite loss) becomes an "error" field in that line, exit code 1, with the traceback on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

try:
    import torch
except ImportError as e:  # reported as the JSON line's error by main()
    torch, _TORCH_IMPORT_ERROR = None, e

H100_BF16_DENSE = 989e12  # H100 and H200 SXM, dense bf16 tensor-core peak (FLOP/s)
N_BATCHES = 4  # distinct random batches used in turn


def load_nanogpt(nanogpt_dir: str):
    """nanoGPT's model module, imported from `nanogpt_dir`/model.py."""
    path = Path(nanogpt_dir) / "model.py"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: put nanoGPT's model.py there (e.g. copy it from a checkout of "
                                "https://github.com/karpathy/nanoGPT to .peer/nanogpt/model.py)")
    spec = importlib.util.spec_from_file_location("nanogpt_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def flops_per_token(n_params: int, n_layer: int, n_head: int, n_embd: int, block_size: int) -> int:
    """nanoGPT's estimate_mfu count for one token of a forward and backward pass: 6 N + 12 L H Q T."""
    return 6 * n_params + 12 * n_layer * n_head * (n_embd // n_head) * block_size


def settings(a: argparse.Namespace) -> dict:
    return {"n_layer": a.n_layer, "n_head": a.n_head, "n_embd": a.n_embd, "block_size": a.block_size,
            "vocab_size": a.vocab_size, "batch": a.batch, "dtype": a.dtype, "compile": bool(a.compile)}


def benchmark(a: argparse.Namespace, out: dict) -> None:
    """Build nanoGPT's model and optimizer, time its train step and fill `out` with the figures."""
    if a.warmup < 1:
        raise ValueError(f"--warmup={a.warmup} must be >= 1: the first step compiles and is never timed")
    if a.steps < 1:
        raise ValueError(f"--steps={a.steps} must be >= 1")
    nanogpt = load_nanogpt(a.nanogpt_dir)
    device_type = "cuda" if a.device.startswith("cuda") else "cpu"
    out["device_kind"] = torch.cuda.get_device_name(a.device) if device_type == "cuda" else "cpu"
    torch.manual_seed(a.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

    with contextlib.redirect_stdout(sys.stderr):  # nanoGPT prints parameter counts; stdout holds only the JSON line
        config = nanogpt.GPTConfig(block_size=a.block_size, vocab_size=a.vocab_size, n_layer=a.n_layer,
                                   n_head=a.n_head, n_embd=a.n_embd, dropout=0.0, bias=True)
        model = nanogpt.GPT(config).to(a.device)
        optimizer = model.configure_optimizers(weight_decay=0.1, learning_rate=6e-4, betas=(0.9, 0.95),
                                               device_type=device_type)
    n_params, n_params_all = model.get_num_params(), model.get_num_params(non_embedding=False)
    out.update(n_params=n_params, n_params_with_pos=n_params_all,
               flops_per_token_nanogpt=flops_per_token(n_params, a.n_layer, a.n_head, a.n_embd, a.block_size),
               flops_per_token_with_pos=flops_per_token(n_params_all, a.n_layer, a.n_head, a.n_embd, a.block_size),
               fused_adamw=bool(optimizer.defaults.get("fused")))
    train_model = torch.compile(model) if a.compile else model

    ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[a.dtype]
    autocast = (torch.autocast(device_type, dtype=ptdtype) if device_type == "cuda" and a.dtype != "float32"
                else contextlib.nullcontext())
    out["autocast"] = a.dtype if device_type == "cuda" and a.dtype != "float32" else None
    scaler = torch.amp.GradScaler(device_type, enabled=a.dtype == "float16" and device_type == "cuda")
    B, T = a.batch, a.block_size
    gen = torch.Generator(device=a.device).manual_seed(a.seed)
    batches = [(torch.randint(0, a.vocab_size, (B, T), device=a.device, generator=gen, dtype=torch.int64),
                torch.randint(0, a.vocab_size, (B, T), device=a.device, generator=gen, dtype=torch.int64))
               for _ in range(N_BATCHES)]

    def step(i: int):
        x, y = batches[i % N_BATCHES]
        with autocast:
            _, loss = train_model(x, y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    sync = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)
    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats(a.device)
    losses, times = [], []
    for i in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        losses.append(step(i))
        sync()
        dt = time.perf_counter() - t0
        if i == 0:
            out["compile_s"] = dt  # the first step: torch.compile's tracing and code generation (or eager warm-up)
        if i >= a.warmup:
            times.append(dt)
    values = [float(v) for v in losses]
    if not all(math.isfinite(v) for v in values):
        raise FloatingPointError(f"non-finite loss: {values}")

    med = statistics.median(times)
    tokens_per_s = B * T / med
    out.update(tokens_per_s=tokens_per_s, step_time_s={"median": med, "min": min(times), "max": max(times)},
               loss_first_last=[values[0], values[-1]])
    if device_type == "cuda":
        out.update(mfu=out["flops_per_token_nanogpt"] * tokens_per_s / a.peak_flops, peak_flops=a.peak_flops,
                   peak_bytes=torch.cuda.max_memory_allocated(a.device),
                   peak_reserved_bytes=torch.cuda.max_memory_reserved(a.device))


def _one_line(e: BaseException) -> str:
    lines = [s.strip() for s in str(e).splitlines() if s.strip()]
    return f"{type(e).__name__}: {lines[0][:500] if lines else ''}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nanogpt-dir", default=".peer/nanogpt", help="folder holding nanoGPT's model.py")
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-head", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--block-size", type=int, default=1024, help="sequence length T of every batch")
    p.add_argument("--vocab-size", type=int, default=50304)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before them (>= 1; the first compiles)")
    p.add_argument("--compile", type=int, choices=(0, 1), default=1, help="1: torch.compile(model)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                   help="autocast dtype on CUDA (CPU runs without autocast, as nanoGPT's train.py)")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    p.add_argument("--peak-flops", type=float, default=None,
                   help=f"peak FLOP/s for MFU (default {H100_BF16_DENSE:g}, H100/H200 SXM dense bf16)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    out = {"bench": "train_step", "peer": "nanogpt+torch.compile" if a.compile else "nanogpt", "device_kind": None,
           "torch": None if torch is None else torch.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **settings(a),
           "tokens_per_s": None, "step_time_s": None, "compile_s": None, "flops_per_token_nanogpt": None,
           "flops_per_token_with_pos": None, "mfu": None, "peak_flops": None,
           "peak_source": "--peak-flops" if a.peak_flops is not None else "default: H100/H200 SXM dense bf16",
           "peak_bytes": None, "peak_reserved_bytes": None, "loss_first_last": None}
    if a.peak_flops is None:
        a.peak_flops = H100_BF16_DENSE
    rc = 0
    try:
        if torch is None:
            raise _TORCH_IMPORT_ERROR
        if a.device is None:
            a.device = "cuda" if torch.cuda.is_available() else "cpu"
        out["device"] = a.device
        if not a.device.startswith("cuda"):
            out["peak_source"] = None  # no MFU off CUDA
        benchmark(a, out)
    except Exception as e:
        traceback.print_exc(file=sys.stderr)
        out["error"] = _one_line(e)
        rc = 1
    print(json.dumps(out), flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
