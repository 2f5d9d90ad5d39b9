"""Choices a model config leaves to the platform its step is compiled for.

    model_cfg = for_platform(cfg.model, "tpu")
    for choice in implementation_choices(cfg, {"data": 1, "fsdp": 32, ...}, "tpu"):
        print(choice.describe())                                  # attention=pallas (flash attention ...)

The platform is that of the mesh's devices (jaxperf.parallel.mesh.platform_of), not of the host: a TPU topology
described on a CPU machine compiles TPU programs, and the kernels are built for it (`target_platform`). Model code
never asks which backend it runs on.

Fields `for_platform` settles once, in `build_task`:

| field | None becomes |
|---|---|
| matmul_grad_barrier | True on CPU (XLA:CPU fuses elementwise gradients into transposing copies), False elsewhere |
| scan_unroll | on CPU n_layers when n_layers <= 4 (a rolled scan over so few layers is slow there), else 1; 1 on TPU and GPU (one layer's recomputed activations live at a time) |

Implementations "auto" picks while the step is traced, from the shapes it sees (the same functions answer for the
start-up report and `jaxperf info` before anything is compiled):

| op | TPU | GPU | CPU |
|---|---|---|---|
| attention | Pallas flash attention (Mosaic) when the kernel takes the shapes | cuDNN (bf16/fp16, no segment ids, L == S) | XLA |
| loss | chunked when the fp32 logits of one device pass 256 MiB | chunked when they pass 8 GiB (the full logits are faster on GPU) | XLA (full logits) |
| norm | XLA | XLA | XLA |

Otherwise XLA, with the reason. The chunked loss gives way to the full logits when the vocabulary or the sequence is
split across devices (it works on whole rows of one device's batch). An explicit choice that cannot run raises.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from jaxperf.config import ModelConfig, TrainConfig
from pallas_kernels.flash_attention import unavailable_reason as flash_unavailable_reason

PLATFORMS = ("cpu", "gpu", "tpu")
# The fp32 logits one device may hold for the loss before "auto" switches to the chunked loss, per accelerator. On
# TPU the chunked loss costs little and saves much HBM. On GPU its loop of [chunk, V] matmuls was slower than the
# full logits for both presets measured (benchmarks/RESULTS.md, "GPU"), so there only logits that would crowd the
# device are chunked.
CHUNKED_LOSS_BYTES = 256 * 2**20
GPU_CHUNKED_LOSS_BYTES = 8 * 2**30


def chunked_loss_bytes(platform: str) -> int:
    """The logits size above which "auto" picks the chunked loss on `platform` (accelerators only)."""
    return GPU_CHUNKED_LOSS_BYTES if platform == "gpu" else CHUNKED_LOSS_BYTES


@dataclasses.dataclass(frozen=True)
class Choice:
    """The implementation of `op` a step uses, and why."""

    op: str
    impl: str
    why: str

    def describe(self) -> str:
        return f"{self.op}={self.impl} ({self.why})"


def for_platform(cfg: ModelConfig, platform: str) -> ModelConfig:
    """`cfg` with every platform-dependent field that is None set for `platform` ("cpu", "gpu" or "tpu")."""
    _check(platform)
    changes = {}
    if cfg.matmul_grad_barrier is None:
        changes["matmul_grad_barrier"] = platform == "cpu"
    if cfg.scan_unroll is None:
        changes["scan_unroll"] = default_scan_unroll(platform, cfg.n_layers)
    return dataclasses.replace(cfg, **changes) if changes else cfg


# Stacks this shallow run unrolled on CPU (model.scan_unroll=None).
CPU_UNROLL_LAYERS = 4


def default_scan_unroll(platform: str, n_layers: int) -> int:
    """Layers per scan iteration when `model.scan_unroll` is None (see the table above)."""
    _check(platform)
    return n_layers if platform == "cpu" and n_layers <= CPU_UNROLL_LAYERS else 1


def layers_per_iteration(cfg: ModelConfig, platform: str) -> int:
    """Layers one iteration of the scanned stack runs on `platform` (the scan's `unroll`)."""
    return min(cfg.scan_unroll or default_scan_unroll(platform, cfg.n_layers), cfg.n_layers)


def _check(platform: str) -> None:
    if platform not in PLATFORMS:
        raise ValueError(f"unknown platform {platform!r}; expected one of {PLATFORMS}")


def attention_choice(platform: str, *, dtype, head_dim: int, heads: int, kv_heads: int, q_len: int, kv_len: int,
                     segment_ids: bool) -> Choice:
    """What attention impl "auto" runs on `platform` for these shapes (q [., q_len, heads, head_dim], k and v
    [., kv_len, kv_heads, head_dim])."""
    _check(platform)
    dtype = jnp.dtype(dtype)
    if platform == "tpu":
        q = jax.ShapeDtypeStruct((1, q_len, heads, head_dim), dtype)
        kv = jax.ShapeDtypeStruct((1, kv_len, kv_heads, head_dim), dtype)
        why = flash_unavailable_reason(q, kv, kv, backend="tpu")
        if why is None:
            return Choice("attention", "pallas", "flash attention kernel (Mosaic TPU): no [L, S] scores in HBM")
        return Choice("attention", "xla", f"the flash kernel cannot take these shapes: {why}")
    if platform == "gpu":
        if dtype not in (jnp.bfloat16, jnp.float16):
            return Choice("attention", "xla", f"cuDNN attention needs bfloat16 or float16, the compute dtype is {dtype}")
        if segment_ids:
            return Choice("attention", "xla", "cuDNN attention here takes no segment ids (packed documents)")
        if q_len != kv_len:
            return Choice("attention", "xla", f"cuDNN attention here needs equal query and key lengths ({q_len} vs "
                                              f"{kv_len})")
        return Choice("attention", "cudnn", "cuDNN fused attention")
    return Choice("attention", "xla", "Pallas kernels only interpret on CPU; XLA is faster there")


def loss_choice(platform: str, *, rows_per_device: int, vocab: int, vocab_split: bool = False,
                seq_split: bool = False) -> Choice:
    """What loss impl "auto" runs on `platform` when one device holds `rows_per_device` tokens of a `vocab`-wide
    output (padded vocabulary)."""
    _check(platform)
    logits = rows_per_device * vocab * 4
    size = f"{logits / 2**20:.0f} MiB of fp32 logits per device"
    if platform == "cpu":
        return Choice("loss", "xla", f"full logits on CPU ({size})")
    if vocab_split:
        return Choice("loss", "xla", "the vocabulary is split over tensor: the chunked loss would gather the output "
                                     "matrix")
    if seq_split:
        return Choice("loss", "xla", "the sequence is split over seq: the chunked loss works on one device's rows")
    limit = chunked_loss_bytes(platform)
    if logits > limit:
        return Choice("loss", "chunked", f"{size} > {limit // 2**20} MiB: the chunked loss keeps one [chunk, vocab] "
                                         "tile live")
    return Choice("loss", "xla", f"{size} <= {limit // 2**20} MiB")


def norm_choice(platform: str) -> Choice:
    """What norm impl "auto" runs: XLA everywhere (it fuses the norm with its neighbours)."""
    _check(platform)
    return Choice("norm", "xla", "XLA fuses the norm into the neighbouring ops")


def implementation_choices(cfg: TrainConfig, mesh_shape: Mapping[str, int], platform: str) -> list[Choice]:
    """The attention, loss and norm implementations the train step of `cfg` uses on a mesh of `mesh_shape` and
    `platform`, with the reason for each, before anything is traced (the same rules "auto" applies while tracing)."""
    m = cfg.model.resolved()
    shape = {a: int(mesh_shape.get(a, 1)) for a in ("data", "stage", "fsdp", "seq", "tensor")}
    seq_len = cfg.train_seq_len
    out = []
    if shape["seq"] > 1:
        out.append(Choice("attention", "ring", f"the sequence is split over seq={shape['seq']} (ring attention)"))
    elif m.attention_impl != "auto":
        out.append(Choice("attention", m.attention_impl, "model.attention_impl"))
    else:
        out.append(attention_choice(platform, dtype=m.dtype, head_dim=m.head_dim, heads=m.n_heads,
                                    kv_heads=m.n_kv_heads, q_len=seq_len, kv_len=seq_len,
                                    segment_ids=False))  # the built-in data gives whole sequences
    if shape["stage"] > 1:
        out.append(Choice("loss", "xla", "the pipeline's last stage computes fp32 logits per microbatch"))
    elif m.loss_impl != "auto":
        out.append(Choice("loss", m.loss_impl, "model.loss_impl"))
    else:
        batch_split = shape["data"] * shape["fsdp"]
        rows = cfg.batch_size // max(cfg.microbatches, 1) // batch_split * seq_len
        out.append(loss_choice(platform, rows_per_device=rows, vocab=m.padded_vocab,
                               vocab_split=shape["tensor"] > 1, seq_split=shape["seq"] > 1))
    out.append(norm_choice(platform) if m.norm_impl == "auto" else Choice("norm", m.norm_impl, "model.norm_impl"))
    return out
