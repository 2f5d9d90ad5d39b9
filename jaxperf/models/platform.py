"""Choices a model config leaves to the platform and mesh its step is compiled for, settled once.

    model_cfg = settle(cfg, {"data": 1, "fsdp": 32, ...}, "tpu")   # a ModelConfig with no "auto" or None left
    for choice in implementation_choices(cfg, {"data": 1, "fsdp": 32, ...}, "tpu"):
        print(choice.describe())                                  # attention=pallas (flash attention ...)

The platform is that of the mesh's devices (read by `build_task`), not of the host: a TPU topology
described on a CPU machine compiles TPU programs, and the kernels are built for it. `build_task` settles the model
config when the config meets the mesh; the model then reads settings (`cfg.platform`, `cfg.attention_impl`, ...) and
never asks which backend it runs on or which mesh is installed. The start-up log prints the settled config
(`describe_settled`), and `jaxperf info` and the memory estimate use the same functions before anything is compiled.

Fields `settle` fills:

| field | becomes |
|---|---|
| platform | the mesh's devices' platform |
| keep_head_dims (None) | True on TPU (the attention projections keep [D, H, Dh]: the backward gathers each weight once, llama2-7b on v5p 1708 -> 1449 GB of HBM traffic per step), False elsewhere |
| round_weights_before_cast (None) | True on TPU (each layer rounds its fp32 weight slice to bf16 bits before the cast, so the compiler makes no bf16 copy of the whole stacked weights before the layer loop: llama2-7b on 16 v5p chips 11.84 -> 11.03 GB per chip), False elsewhere |
| layer_grads_in_compute_dtype (None) | True on TPU (remat full over scanned layers: each layer's weight gradients stacked in bf16 inside the backward loop, cast to fp32 after it, the same bits; llama2-7b on v6e:4x4 at 2 x 4096: 10.59 -> 9.82 GB per chip), False elsewhere |
| norm_grads_in_compute_dtype (None) | True on TPU unless norm_impl is pallas (the norms' scale gradients summed over the batch rows in bf16 after fp32 sums within each row, so their all-reduce sends half the bytes, as MaxText's: mistral-7b and llama3-8b on v6e:8x8 at 1 x 2048, collective-bound: 1.000018x -> 0.999999998x MaxText's predicted step), False elsewhere |
| mlp_slices (None) | on TPU under remat full, with the MLP's width whole on each device: the fewest equal slices of whole 128-lane tiles (`mlp_slices_choice`) that keep one slice's hidden values per device at 128 MiB or less (`sliced_mlp` computes them in turn: llama2-7b on v5e:8x8 at 2 x 4096 per chip, 5.418 -> 5.261 GB per chip, the same predicted step and ICI); 1 elsewhere |
| gather_mlp_weights (None) | True on TPU for MLP weights of 4 MiB or more in the compute dtype (each gathered whole before its matmul, its gradient reduce-scattered straight back, where the compiler would gather it window by window: llama2-7b on v6e:2x4 at 1 x 2048 per chip, predicted step 0.155 -> 0.125 s; `GATHER_MLP_MIN_BYTES` says why not below), False elsewhere |
| loss_gather_once (None) | True on TPU (the chunked loss under FSDP gathers the output weights whole once per microbatch and keeps them for its backward, where it gathered each vocabulary block in both passes: llama3-8b on v6e:8x8 at 1 x 2048 per chip, 60.2 -> 59.2 GB over ICI, predicted step 0.1344 -> 0.1321 s, collective-bound; on v6e:2x4 the same bytes per chip), False elsewhere |
| ragged_all_to_all (None) | True on TPU (dropless expert parallelism sends only the token slots routed, `jax.lax.ragged_all_to_all`: Mixtral-8x7B over expert=8 on v5p, 45.1 -> 11.5 GB of all-to-all a step as the compiled program predicts under balanced routing), False on CPU, whose XLA has none, and on GPU, where it has not run (one block of the worst case to every device; true asks for it) |
| matmul_grad_barrier (None) | True on CPU (XLA:CPU fuses elementwise gradients into transposing copies), False elsewhere |
| scan_unroll (None) | on GPU n_layers: the whole stack in one iteration, parameters still stacked (measured on an H100: gpt2-small 1.50x the tokens/s of a rolled scan in 0.64x the memory, llama-1b 1.10x; benchmarks/RESULTS.md, "GPU"); on CPU n_layers when n_layers <= 4 (a rolled scan over so few layers is slow there), else 1; on TPU 1 (one layer's recomputed activations live at a time) |
| attention_impl, loss_impl, norm_impl, grouped_matmul_impl ("auto") | the table below, for the train step's shapes (sequence, dtype, heads, rows per device) |

| op | TPU | GPU | CPU |
|---|---|---|---|
| attention | Pallas flash attention (Mosaic) when the kernel takes the shapes | cuDNN (bf16/fp16, no segment ids, L == S) | XLA |
| loss | chunked when the fp32 logits of one device pass 128 MiB | chunked when they pass 8 GiB (the full logits are faster on GPU) | XLA (full logits) |
| norm | XLA | XLA | XLA |
| grouped_matmul (MoE) | XLA's ragged dot (a grouped-matmul kernel) | XLA's ragged dot | loop (XLA:CPU runs a ragged dot as one dense matmul per expert, and the tiled version's batched matmul at about 0.4 of a dense one's rate); with the expert weights whole on the device the MoE layer runs expert blocks instead (`moe._blocked`) |

Otherwise XLA, with the reason. The chunked loss gives way to the full logits when the vocabulary or the sequence is
split across devices (it works on whole rows of one device's batch), and under a pipeline (its last stage computes
the logits per microbatch). A sequence split over `seq` runs ring attention whatever attention_impl says. An explicit
choice that cannot run raises. A model built from an unsettled config (`GPT(ModelConfig())`) runs the portable
choices: XLA for every "auto", scan_unroll 1, no barrier.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from jaxperf.config import MESH_AXES, ConfigError, ModelConfig, TrainConfig
from pallas_kernels.flash_attention import unavailable_reason as flash_unavailable_reason

PLATFORMS = ("cpu", "gpu", "tpu")
# The fp32 logits one device may hold for the loss before "auto" switches to the chunked loss, per accelerator. On
# TPU the chunked loss costs little and saves much HBM: at 256 MiB a 13B Llama-2 shape on v5e:8x8 at 1 x 2048 per
# chip (250 MiB of logits) needed 0.903x MaxText's bytes with the full logits and 0.837x chunked, for the same
# predicted step, so every 32k-vocabulary model at 2,048 tokens a chip now chunks. On GPU its loop of [chunk, V]
# matmuls was slower than the full logits for both presets measured (benchmarks/RESULTS.md, "GPU"), so there only
# logits that would crowd the device are chunked.
CHUNKED_LOSS_BYTES = 128 * 2**20
GPU_CHUNKED_LOSS_BYTES = 8 * 2**30


# The size of one MLP weight in the compute dtype from which the TPU default gathers it whole before its matmul
# (`gather_mlp_weights`). Below it the compiler's own program was as good or better: the llama-1b preset cut to
# d_model 512 and mlp_dim 2048 (a 2 MiB weight) compiled to the same predicted step and collectives either way,
# tiny's (256 KiB) to a program that moves 6% more HBM bytes with the gather, while gpt2-small's (4.5 MiB) and the
# 7B-8B models' (86 MiB) predicted steps are shorter with it (docs/performance.md, "The small-batch v6e step").
# The MoE layers' shared experts follow the dense width's choice.
GATHER_MLP_MIN_BYTES = 4 * 2**20


def mlp_weight_bytes(cfg: ModelConfig) -> int:
    """Bytes of one dense MLP weight [d_model, mlp_dim] in the compute dtype."""
    return cfg.d_model * cfg.resolved().mlp_dim * jnp.dtype(cfg.dtype).itemsize


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


# The model fields whose None `for_platform` settles; `jaxperf compile` reports each as settled.
PLATFORM_FIELDS = ("matmul_grad_barrier", "scan_unroll", "keep_head_dims", "round_weights_before_cast",
                   "layer_grads_in_compute_dtype", "norm_grads_in_compute_dtype", "gather_mlp_weights",
                   "loss_gather_once", "ragged_all_to_all")
# ... and with the ones `settle` fills from the step's shapes too (what `jaxperf compile` reports as settled)
SETTLED_FIELDS = (*PLATFORM_FIELDS, "mlp_slices")


def for_platform(cfg: ModelConfig, platform: str) -> ModelConfig:
    """`cfg` with its platform and the fields that depend on the platform (and the model's widths) settled (platform
    and PLATFORM_FIELDS); the implementations stay as they are (`settle` picks them for a train step)."""
    _check(platform)
    if cfg.platform is not None and cfg.platform != platform:
        raise ConfigError(f"model.platform={cfg.platform!r} but the mesh's devices are {platform!r}: leave "
                          f"model.platform unset (it follows the mesh)")
    changes = {"platform": platform}
    if cfg.matmul_grad_barrier is None:
        changes["matmul_grad_barrier"] = platform == "cpu"
    if cfg.scan_unroll is None:
        changes["scan_unroll"] = default_scan_unroll(platform, cfg.n_layers)
    if cfg.keep_head_dims is None:
        changes["keep_head_dims"] = platform == "tpu"
    if cfg.round_weights_before_cast is None:
        changes["round_weights_before_cast"] = platform == "tpu"
    if cfg.layer_grads_in_compute_dtype is None:
        changes["layer_grads_in_compute_dtype"] = platform == "tpu"
    if cfg.norm_grads_in_compute_dtype is None:
        changes["norm_grads_in_compute_dtype"] = platform == "tpu" and cfg.norm_impl != "pallas"
    elif cfg.norm_grads_in_compute_dtype and cfg.norm_impl == "pallas":
        raise ConfigError("model.norm_grads_in_compute_dtype=true needs the XLA norm, but model.norm_impl=pallas "
                          "(its kernel sums the scale's gradient itself): set model.norm_impl=xla or leave "
                          "model.norm_grads_in_compute_dtype unset")
    if cfg.gather_mlp_weights is None:
        changes["gather_mlp_weights"] = platform == "tpu" and mlp_weight_bytes(cfg) >= GATHER_MLP_MIN_BYTES
    if cfg.loss_gather_once is None:
        changes["loss_gather_once"] = platform == "tpu"
    if cfg.ragged_all_to_all is None:
        changes["ragged_all_to_all"] = platform == "tpu"
    elif cfg.ragged_all_to_all and platform == "cpu" and cfg.n_experts and not cfg.capacity_factor:
        raise ConfigError("model.ragged_all_to_all=true but XLA:CPU has no ragged all-to-all: leave it unset (dense "
                          "blocks on CPU) or set it false")
    return dataclasses.replace(cfg, **changes)


def settle(cfg: TrainConfig, mesh_shape: Mapping[str, int], platform: str) -> ModelConfig:
    """`cfg.model` with nothing left to the platform: every "auto" implementation and every None of the table above
    settled for the train step of `cfg` on a mesh of `mesh_shape` whose devices are `platform`."""
    chosen = {c.op: c.impl for c in _choices(cfg, mesh_shape, platform)}
    model = for_platform(cfg.model, platform)
    if model.mlp_slices is None:
        shape = _mesh(mesh_shape)
        tokens = _rows_per_device(cfg, shape) * cfg.train_seq_len // shape["seq"]
        model = dataclasses.replace(model, mlp_slices=mlp_slices_choice(
            platform, tokens_per_device=tokens, model=model.resolved(), tensor=shape["tensor"]))
    return dataclasses.replace(model, attention_impl=chosen["attention"], loss_impl=chosen["loss"],
                               norm_impl=chosen["norm"],
                               grouped_matmul_impl=chosen.get("grouped_matmul", model.grouped_matmul_impl))


# On TPU, the most bytes one device's hidden MLP values (tokens x mlp_dim in the compute dtype) may take before
# `model.mlp_slices` computes the MLP in slices of its width (each slice a whole number of 128-lane tiles wide), at
# most MAX_MLP_SLICES of them.
MLP_SLICE_BYTES = 128 * 2**20
MAX_MLP_SLICES = 8


def mlp_slices_choice(platform: str, *, tokens_per_device: int, model: ModelConfig, tensor: int = 1) -> int:
    """The slices of its hidden width the MLP runs in when model.mlp_slices is None: on TPU under remat full, with
    the width whole on each device, the fewest equal slices of whole 128-lane tiles that bring one slice's hidden
    values per device to MLP_SLICE_BYTES or less (the most, up to MAX_MLP_SLICES, when none does; 1 when the width
    cuts into no such slices); 1 elsewhere."""
    _check(platform)
    if platform != "tpu" or model.remat != "full" or tensor > 1:
        return 1
    hidden = tokens_per_device * model.mlp_dim * jnp.dtype(model.dtype).itemsize
    if hidden <= MLP_SLICE_BYTES:
        return 1
    tiled = [n for n in range(2, MAX_MLP_SLICES + 1) if model.mlp_dim % (128 * n) == 0]
    small = [n for n in tiled if hidden / n <= MLP_SLICE_BYTES]
    return (small or tiled[-1:] or [1])[0]


def describe_settled(cfg: TrainConfig, mesh_shape: Mapping[str, int], platform: str) -> str:
    """One line for the start-up log: each implementation the step runs and why, then the other settled fields."""
    model = settle(cfg, mesh_shape, platform)
    choices = "; ".join(c.describe() for c in implementation_choices(cfg, mesh_shape, platform))
    return (f"settled for {platform}: {choices}; scan_unroll={layers_per_iteration(model)} "
            f"matmul_grad_barrier={model.matmul_grad_barrier}")


# Stacks this shallow run unrolled on CPU (model.scan_unroll=None).
CPU_UNROLL_LAYERS = 4


def default_scan_unroll(platform: str, n_layers: int) -> int:
    """Layers per scan iteration when `model.scan_unroll` is None (see the table above)."""
    _check(platform)
    if platform == "gpu" or (platform == "cpu" and n_layers <= CPU_UNROLL_LAYERS):
        return n_layers
    return 1


def layers_per_iteration(cfg: ModelConfig, platform: str | None = None) -> int:
    """Layers one iteration of the scanned stack runs (the scan's `unroll`): the settled `cfg.scan_unroll`, else the
    default of `platform` (or 1, the portable choice, when neither is known)."""
    platform = platform or cfg.platform
    default = default_scan_unroll(platform, cfg.n_layers) if platform is not None else 1
    return min(cfg.scan_unroll or default, cfg.n_layers)


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
        return Choice("loss", "chunked", f"{size} > {limit // 2**20} MiB: the chunked loss keeps one [chunk, vocab "
                                         "block] tile live")
    return Choice("loss", "xla", f"{size} <= {limit // 2**20} MiB")


def norm_choice(platform: str) -> Choice:
    """What norm impl "auto" runs: XLA everywhere (it fuses the norm with its neighbours)."""
    _check(platform)
    return Choice("norm", "xla", "XLA fuses the norm into the neighbouring ops")


def implementation_choices(cfg: TrainConfig, mesh_shape: Mapping[str, int], platform: str) -> list[Choice]:
    """The attention, loss and norm implementations the train step of `cfg` uses on a mesh of `mesh_shape` and
    `platform`, with the reason for each, before anything is traced (ring attention where the sequence is split)."""
    choices = _choices(cfg, mesh_shape, platform)
    seq = int(mesh_shape.get("seq", 1))
    if seq > 1:
        choices[0] = Choice("attention", "ring", f"the sequence is split over seq={seq} (ring attention)")
    return choices


def _mesh(mesh_shape: Mapping[str, int]) -> dict[str, int]:
    return {a: int(mesh_shape.get(a, 1)) for a in MESH_AXES}


def _rows_per_device(cfg: TrainConfig, shape: dict[str, int]) -> int:
    """Batch rows one device holds in a microbatch (the batch splits over data, fsdp and expert)."""
    return cfg.batch_size // max(cfg.microbatches, 1) // (shape["data"] * shape["fsdp"] * shape["expert"])


def _choices(cfg: TrainConfig, mesh_shape: Mapping[str, int], platform: str) -> list[Choice]:
    """[attention, loss, norm] (and grouped_matmul for an MoE model) as `settle` writes them into the model config."""
    _check(platform)
    m = cfg.model.resolved()
    shape = _mesh(mesh_shape)
    seq_len = cfg.train_seq_len
    if m.attention_impl != "auto":
        attention = Choice("attention", m.attention_impl, "model.attention_impl")
    else:
        attention = attention_choice(platform, dtype=m.dtype, head_dim=m.head_dim, heads=m.n_heads,
                                     kv_heads=m.n_kv_heads, q_len=seq_len, kv_len=seq_len,
                                     segment_ids=False)  # the built-in data gives whole sequences
    if shape["stage"] > 1:
        loss = Choice("loss", "xla", "the pipeline's last stage computes fp32 logits per microbatch")
    elif m.loss_impl != "auto":
        loss = Choice("loss", m.loss_impl, "model.loss_impl")
    else:
        rows = _rows_per_device(cfg, shape) * seq_len
        loss = loss_choice(platform, rows_per_device=rows, vocab=m.padded_vocab, vocab_split=shape["tensor"] > 1,
                           seq_split=shape["seq"] > 1)
    norm = norm_choice(platform) if m.norm_impl == "auto" else Choice("norm", m.norm_impl, "model.norm_impl")
    if not m.n_experts:
        return [attention, loss, norm]
    if m.grouped_matmul_impl != "auto":
        grouped = Choice("grouped_matmul", m.grouped_matmul_impl, "model.grouped_matmul_impl")
    else:
        grouped = grouped_matmul_choice(platform)
    return [attention, loss, norm, grouped]


def grouped_matmul_choice(platform: str) -> Choice:
    """What grouped matmul "auto" runs in the dropless MoE layers: a loop over each expert's rows on CPU, XLA's ragged
    dot elsewhere."""
    _check(platform)
    if platform == "cpu":
        return Choice("grouped_matmul", "loop", "XLA:CPU expands jax.lax.ragged_dot into one dense matmul per expert; "
                      "a loop of plain matmuls over each expert's rows runs at a dense matmul's rate")
    return Choice("grouped_matmul", "xla", "jax.lax.ragged_dot (a grouped-matmul kernel on TPU)")
