"""The configuration of a run: frozen dataclasses, one per section, every field with its type and a comment.

    TrainConfig(model=ModelConfig(...), optim=OptimConfig(...), parallel=ParallelConfig(...), data=DataConfig(...))

Fields with a fixed set of values are `Literal` types: the override parser (jaxperf.config.overrides) and
`validate_model` read the choices from the annotations, so they are written once, here.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal


class ConfigError(ValueError):
    """A configuration that cannot work; the message names the numbers and the fix."""


Style = Literal["gpt2", "llama"]  # gpt2: LayerNorm, learned positions, GELU, MHA; llama: RMSNorm, RoPE, SwiGLU, GQA
Norm = Literal["layernorm", "rmsnorm"]
Position = Literal["learned", "rope"]
# gelu: GELU's tanh approximation (GPT-2's `gelu_new`); gelu_exact: the erf form (HF `activation_function: "gelu"`)
MlpAct = Literal["gelu", "gelu_exact", "swiglu"]
# none, full, the op-based save_dots*, MaxText's remat_policy names (saved or offloaded activations by name), custom
# (model.remat_save and model.remat_offload); jaxperf.models.layers.REMAT_SAVES says what each keeps
Remat = Literal["none", "full", "save_dots", "save_dots_no_batch", "minimal", "minimal_with_context",
                "save_dot_with_context_except_mlp", "save_dot_except_mlpwi", "save_dot_except_mlp", "save_qkv_proj",
                "save_out_proj", "qkv_proj_offloaded", "minimal_offloaded", "save_attn_proj", "custom"]
# The activations a remat policy can keep, by the names the layers tag them with (checkpoint_name), which are
# MaxText's: q, k and v projections; the attention output before its projection (context); the output projection;
# the MLP's gate (mlpwi_0), up (mlpwi_1; mlpwi in a GELU MLP) and down (mlpwo) projections, experts' alike.
REMAT_NAMES = ("query_proj", "key_proj", "value_proj", "context", "out_proj", "mlpwi_0", "mlpwi_1", "mlpwi", "mlpwo")
Dtype = Literal["float32", "bfloat16", "float16"]
ParamDtype = Literal["float32", "bfloat16"]
NormImpl = Literal["auto", "xla", "pallas"]
LossImpl = Literal["auto", "xla", "pallas", "chunked"]
GroupedMatmulImpl = Literal["auto", "xla", "tiled", "loop"]
Platform = Literal["cpu", "gpu", "tpu"]
Strategy = Literal["dp", "fsdp", "tp", "fsdp_tp"]
Flavour = Literal["jit", "shard_map", "pmap"]
Tokenizer = Literal["byte", "bpe", "hf"]
LossScale = Literal["auto", "dynamic", "none"]
PipelineSchedule = Literal["gpipe", "1f1b"]
ContextLayout = Literal["zigzag", "contiguous"]
LrSchedule = Literal["warmup_cosine", "constant"]
# softmax: softmax over all experts, top-k, the k weights renormalised to sum to 1 (Mixtral). sigmoid: top-k of
# independent sigmoid scores, normalised over the k (DeepSeek-V3)
Router = Literal["softmax", "sigmoid"]


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only Transformer. `style` picks GPT-2 or Llama defaults; fields left None follow the style."""

    style: Style = "gpt2"  # "gpt2": LayerNorm, learned positions, GELU, MHA. "llama": RMSNorm, RoPE, SwiGLU, GQA.
    vocab_size: int = 256  # rounded up to `vocab_multiple` for the embedding table
    vocab_multiple: int = 128  # pad the vocabulary to a multiple of this (tensor cores, even sharding)
    max_seq_len: int = 128  # longest sequence the model accepts (size of the learned position table)
    d_model: int = 128  # embed
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None  # None = n_heads (multi-head); fewer = grouped-query; 1 = multi-query
    head_dim: int | None = None  # None = d_model // n_heads
    mlp_dim: int | None = None  # None = 4 * d_model (gelu, gelu_exact) or 8/3 * d_model rounded up to 64 (swiglu)
    norm: Norm | None = None
    position: Position | None = None
    mlp_act: MlpAct | None = None
    use_bias: bool | None = None  # biases in projections and norms (gpt2: yes, llama: no)
    # Biases on the query, key and value projections alone. None = use_bias; true with use_bias false is Qwen2's
    # layout (q/k/v biased, the output projection and the MLPs not)
    qkv_bias: bool | None = None
    tie_embeddings: bool = True  # output projection = embedding table transposed
    scan_layers: bool = True  # one compiled layer body under lax.scan (fast compiles) or a Python loop
    # Layers per scan iteration; >= n_layers unrolls the stack (loop speed, stacked params; remat then saves little:
    # see jaxperf.perf.memory). None: the platform's choice (jaxperf.models.platform.settle): on GPU the whole
    # stack; on CPU the whole stack when it has at most 4 layers, else 1; on TPU 1.
    scan_unroll: int | None = None
    remat: Remat = "none"  # what the backward recomputes (jaxperf.models.layers.REMAT_SAVES)
    # remat=custom: the activations kept in device memory, and those moved to pinned host memory, by name
    # (jaxperf.models.layers.REMAT_NAMES: query_proj, key_proj, value_proj, context, out_proj, mlpwi_0, mlpwi_1,
    # mlpwi, mlpwo); every other activation is recomputed
    remat_save: tuple[str, ...] = ()
    remat_offload: tuple[str, ...] = ()
    dtype: Dtype = "float32"  # compute dtype (parameters stay param_dtype)
    param_dtype: ParamDtype = "float32"
    attention_impl: str = "auto"  # auto | xla | cudnn | pallas | any name registered with register_attention
    norm_impl: NormImpl = "auto"  # see jaxperf.models.kernels
    loss_impl: LossImpl = "auto"  # pallas and chunked never build [tokens, vocab] logits
    # Materialise each matmul's output gradient before the backward matmuls (helps XLA:CPU, which otherwise fuses
    # elementwise gradients into slow transposing copies). None: on when the step is compiled for CPU devices.
    matmul_grad_barrier: bool | None = None
    # Contract q, k, v and the attention output with the weights' own [D, H, Dh] shapes, not flattened to [D, H*Dh].
    # None: the platform's choice (jaxperf.models.platform): on TPU, where the backward's recomputed projection and
    # its input gradient then share one FSDP gather of each weight (flattened, XLA gathered it twice)
    keep_head_dims: bool | None = None
    # Round each fp32 layer weight to bf16's bits (reduce_precision) before its cast to a bf16 compute dtype:
    # the same values and gradients, but the TPU compiler no longer casts the whole stacked weights once before the
    # layer loop, a copy live through the step (Llama2-7B over 16 v5p chips: 809 MB per chip). None: the platform's
    # choice (jaxperf.models.platform): on TPU, elsewhere the plain cast
    round_weights_before_cast: bool | None = None
    # remat=full over scanned layers: the backward loop stacks each layer's weight gradients in the compute dtype
    # where that is exact (a weight used only through its cast, so its gradient is a cast-back compute-dtype value)
    # and casts the stacks to param_dtype after the loop: the same bits, half the gradient stacks at the backward's
    # peak (jaxperf.models.layer_scan). None: the platform's choice (jaxperf.models.platform): on TPU
    layer_grads_in_compute_dtype: bool | None = None
    # The norms' scale and bias gradients summed over the batch rows in the compute dtype: each row's fp32 sum over
    # its positions, rounded, then summed over the rows, so the all-reduce over the batch's devices sends bf16, as
    # MaxText's (whose norms multiply by the scale in bf16) does; the forward stays fp32 (the XLA norm; refused with
    # norm_impl=pallas). None: the platform's choice (jaxperf.models.platform): on TPU
    norm_grads_in_compute_dtype: bool | None = None
    # remat=full: compute the MLP over this many equal slices of its hidden width in turn (jaxperf.models.layers.
    # sliced_mlp): one slice's hidden values live at a time in the forward and in the backward's recomputation, the
    # same FLOPs. None: the platform's choice (jaxperf.models.platform): on TPU, enough slices (of whole 128-lane
    # tiles) to keep each slice's hidden values per device under MLP_SLICE_BYTES; 1 elsewhere. An int8 model's MLP and
    # a shared expert whose width the slices do not cut evenly run whole
    mlp_slices: int | None = None
    # Gather each MLP weight whole before its matmul and send its gradient straight back to the weight's own sharding
    # (jaxperf.parallel.rules.gather_weight), rather than leave the compiler to gather it window by window inside the
    # matmul. None: the platform's choice (jaxperf.models.platform): on TPU for weights of 4 MiB or more, where the
    # windowed loops of the MLP's backward read the hidden-layer gradient from HBM again for each window
    gather_mlp_weights: bool | None = None
    # The chunked loss under FSDP: gather the output weights whole once and keep them from the forward to the
    # backward, rather than gather each vocabulary block in both passes (jaxperf.models.kernels.linear_cross_entropy):
    # one all-gather of the D x V weights per microbatch instead of two, for D x V in the compute dtype live across
    # the loss.
    # None: the platform's choice (jaxperf.models.platform): on TPU
    loss_gather_once: bool | None = None
    # The platform the kernels are built for. None: not settled yet; `jaxperf.models.platform.settle` sets it (with
    # every "auto" above) from the mesh's devices when the config meets the mesh. A model built from an unsettled
    # config runs the portable choices: XLA for every "auto", scan_unroll 1, no barrier.
    platform: Platform | None = None
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    # Mixture of experts (jaxperf.models.moe, docs/moe.md): the MLP of MoE layers is n_experts expert MLPs of which
    # each token uses experts_per_token, chosen by a router. 0 = dense MLPs everywhere.
    n_experts: int = 0
    experts_per_token: int = 2  # top-k: 1 <= k <= n_experts
    n_shared_experts: int = 0  # always-on experts (DeepSeek): a dense MLP n_shared_experts * moe_mlp_dim wide
    shared_mlp_dim: int | None = None  # the shared experts' hidden width; None = n_shared_experts * moe_mlp_dim
    # Scale the shared experts' output per token by sigmoid(x . w), a learned [D, 1] gate (Qwen2-MoE)
    shared_expert_gate: bool = False
    moe_every: int = 1  # layer i (from 0) is MoE when (i + 1) % moe_every == 0; > 1 needs scan_layers=false
    router: Router = "softmax"
    # Renormalise each token's k kept router weights to sum to 1 (Mixtral, DeepSeek-V3); false keeps them as the
    # router scored them (Qwen2-MoE's norm_topk_prob=false)
    router_norm_topk: bool = True
    moe_mlp_dim: int | None = None  # one expert's hidden width; None = mlp_dim
    # Each expert takes at most ceil(capacity_factor * tokens * k / n_experts) tokens, the rest are dropped (their
    # MoE output is zero; the residual carries them). None or 0: dropless (grouped matmuls over every routed token)
    capacity_factor: float | None = None
    # How the dropless path runs its grouped matmuls (jaxperf.models.moe): xla = jax.lax.ragged_dot (a grouped-matmul
    # kernel on TPU), tiled = fixed tiles of rows as one batched matmul, loop = a loop of plain matmuls over each
    # expert's chunks of rows. auto: loop on CPU, xla elsewhere
    grouped_matmul_impl: GroupedMatmulImpl = "auto"
    # Dropless expert parallelism sends each device's token slots to their experts and back with a ragged all-to-all
    # (jax.lax.ragged_all_to_all: only the rows routed cross the links) instead of one block of the worst case per
    # device. None: true on TPU; false on CPU (XLA:CPU has no ragged all-to-all) and on GPU (not yet run on GPUs)
    ragged_all_to_all: bool | None = None
    # Loss-free load balancing (DeepSeek-V3; MaxText's routed_bias): a per-expert bias, a parameter
    # `mlp.router_bias_E` of each MoE layer, added to the router's scores when the top k are chosen and never to the
    # weights the chosen experts' outputs are summed with. With router_bias_update_rate > 0 the built-in optimizer
    # moves it after every step by that rate against the sign of each expert's load over an even share (the busier
    # an expert, the lower its bias); 0 keeps it as loaded (a checkpoint's own bias, frozen)
    router_bias: bool = False
    router_bias_update_rate: float = 0.0
    router_aux_loss_coef: float = 0.01  # weight of the load-balancing loss in the train loss
    router_z_loss_coef: float = 0.001  # weight of the router z-loss (mean logsumexp(logits)^2)

    def resolved(self) -> "ModelConfig":
        """A copy with every style-dependent None filled in."""
        llama = self.style == "llama"
        n_kv = self.n_kv_heads or self.n_heads
        head_dim = self.head_dim or self.d_model // self.n_heads
        act = self.mlp_act or ("swiglu" if llama else "gelu")
        if self.mlp_dim is not None:
            mlp = self.mlp_dim
        elif act == "swiglu":
            mlp = 64 * math.ceil(8 * self.d_model / 3 / 64)
        else:
            mlp = 4 * self.d_model
        use_bias = (not llama) if self.use_bias is None else self.use_bias
        moe_mlp = (self.moe_mlp_dim or mlp) if self.n_experts else self.moe_mlp_dim
        return dataclasses.replace(
            self,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            mlp_dim=mlp,
            norm=self.norm or ("rmsnorm" if llama else "layernorm"),
            position=self.position or ("rope" if llama else "learned"),
            mlp_act=act,
            use_bias=use_bias,
            qkv_bias=use_bias if self.qkv_bias is None else self.qkv_bias,
            moe_mlp_dim=moe_mlp,
            shared_mlp_dim=(self.shared_mlp_dim or self.n_shared_experts * moe_mlp)
            if self.n_experts and self.n_shared_experts else self.shared_mlp_dim,
        )

    @property
    def padded_vocab(self) -> int:
        return self.vocab_multiple * math.ceil(self.vocab_size / self.vocab_multiple)


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warm-up, cosine decay to `min_lr_ratio * lr`, and global-norm clipping."""

    # warmup_cosine: warmup_steps up to lr, cosine down to min_lr_ratio * lr at decay_steps. constant: lr at every step
    # (warmup_steps, min_lr_ratio and decay_steps unused), e.g. for fine-tuning
    schedule: LrSchedule = "warmup_cosine"
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    decay_steps: int | None = None  # None = the run's max_steps
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1  # not applied to norms, biases (any parameter with fewer than 2 dims)
    grad_clip: float = 1.0  # global-norm clip; 0 disables


@dataclass(frozen=True)
class ParallelConfig:
    """The device mesh (axes data x stage x fsdp x expert x seq x tensor; one may be -1 = the rest of the devices)
    and the sharding strategy. `stage`, `expert` and `seq` work with every strategy (jaxperf.parallel.rules adds their
    mappings)."""

    strategy: Strategy = "fsdp"  # rule table for weights and activations (jaxperf.parallel.rules)
    data: int = 1  # data parallel: whole replicas
    fsdp: int = -1  # fully sharded data parallel (ZeRO-3): weights split along `embed`
    tensor: int = 1  # tensor parallel (Megatron): heads and MLP columns split
    stage: int = 1  # pipeline parallel: the layers split into this many stages
    seq: int = 1  # context parallel: the sequence split, attention as a ring over this axis
    # expert parallel (MoE): each device holds n_experts / expert of every MoE layer's experts, tokens reach them by
    # all-to-all; outside the experts the axis splits the batch like data
    expert: int = 1
    schedule: PipelineSchedule = "1f1b"  # pipeline schedule when stage > 1 (microbatches = TrainConfig.microbatches)
    context_layout: ContextLayout = "zigzag"  # seq > 1: zigzag balances causal work; contiguous keeps token order
    # tensor > 1: also split the activations between layers along the sequence over `tensor` (Megatron-SP), with
    # the all-gather / reduce-scatter overlapped with the matmuls (collective matmuls)
    sequence_parallel: bool = False
    # Slices of a multi-slice TPU job (or any groups of devices joined by a slower network, DCN): the `data` axis
    # spans them, so only the gradient all-reduce crosses DCN; data/fsdp/tensor above describe one slice.
    dcn_data: int = 1
    flavour: Flavour = "jit"  # how the step is written: jit (GSPMD) or by hand (jaxperf.explicit.flavours)
    # shard_map dp: all-reduce each layer's gradients inside the backward pass, as soon as that layer is done
    overlap_grad_reduce: bool = False


@dataclass(frozen=True)
class DataConfig:
    """Where tokens come from. The default corpus is the Python standard library's own source (always present)."""

    source: str = "stdlib"  # "stdlib" | a text file or glob | a token file "x.bin" or "x.bin:uint32"
    # bpe: trained on the corpus with model.vocab_size, or from tokenizer_path. hf: a Hugging Face model's own
    # tokenizer.json (tokenizer_path; init_from= a Hugging Face directory sets both)
    tokenizer: Tokenizer = "byte"
    tokenizer_path: str | None = None  # a tokenizer.json for "bpe"; for "hf" also the model directory that holds it
    max_bytes: int | None = None  # use only this prefix of a text corpus
    val_fraction: float = 0.01  # tail of the token stream held out for evaluation
    cache_dir: str = "~/.cache/jaxperf"  # tokenizer and tokenized-corpus cache
    prefetch: int = 2  # batches prepared ahead on a background thread


def default_compile_cache_dir() -> str:
    """Where the trainer keeps compiled programs unless told: JAX's own `JAX_COMPILATION_CACHE_DIR` where it is set
    ("" turns the cache off), else ~/.cache/jaxperf/xla."""
    return os.environ.get("JAX_COMPILATION_CACHE_DIR", "~/.cache/jaxperf/xla")


@dataclass(frozen=True)
class TrainConfig:
    """A whole training run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    batch_size: int = 16  # global batch, in sequences
    microbatches: int = 1  # gradient accumulation: the batch is split into this many sequential microbatches
    seq_len: int | None = None  # None = model.max_seq_len
    max_steps: int = 300
    seed: int = 0
    log_every: int = 10
    eval_every: int = 100  # 0 disables
    eval_batches: int = 4  # batches per evaluation; 0 turns evaluation off (said once at start-up)
    checkpoint_every: int = 100  # 0 = only at the end
    keep_checkpoints: int = 3  # the newest k checkpoints are kept ...
    keep_checkpoints_every: int = 0  # ... plus every step that is a multiple of this (0 = none)
    # JAX's persistent compilation cache ("" = off); by default JAX's own JAX_COMPILATION_CACHE_DIR where it is set
    compile_cache_dir: str = field(default_factory=default_compile_cache_dir)
    # XLA options for this run's train and eval steps alone, "name=value" each (comma-separated), e.g.
    # xla_tpu_enable_windowed_einsum_for_reduce_scatter=false: given to jax.jit, not to the process (LIBTPU_INIT_ARGS)
    compiler_options: tuple[str, ...] = ()
    check_memory: bool = True  # estimate per-device memory before compiling; refuse with advice when it cannot fit
    handle_signals: bool = True  # SIGTERM / Ctrl-C: save a checkpoint at the next step and exit cleanly
    run_dir: str = "runs/default"
    # Start from existing weights: a Hugging Face GPT-2 / Llama directory (config.json, model*.safetensors,
    # tokenizer.json) or a jaxperf run directory. The model and tokenizer come from it, the optimizer starts fresh;
    # once run_dir has a checkpoint, resuming takes precedence (jaxperf.train.pretrained)
    init_from: str | None = None
    resume: bool = True  # continue from the newest checkpoint in run_dir
    start_over: bool = False  # move an earlier run in run_dir to run_dir/previous/<time>/ and start from step 0
    sample_tokens: int = 200  # tokens of the text sample printed at the end, at most the model's context (0 = none)
    sample_prompt: str = "def "
    tensorboard: bool = True  # also write TensorBoard events when tensorboardX is installed
    skip_nonfinite: bool = True  # a step with a non-finite loss or gradient leaves the state untouched (counted)
    max_consecutive_skips: int = 10  # stop the run after this many skipped steps in a row
    spike_sigma: float = 0.0  # also skip a step whose loss exceeds mean + sigma * std of recent losses (0 = off)
    spike_window: int = 100
    loss_scale: LossScale = "auto"  # auto: dynamic for float16 compute

    @property
    def train_seq_len(self) -> int:
        return self.model.max_seq_len if self.seq_len is None else self.seq_len


SECTIONS = ("model", "optim", "parallel", "data")


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """{field name: resolved annotation} of a config dataclass."""
    return typing.get_type_hints(cls)


def choices(cls: type, name: str) -> tuple | None:
    """The values a Literal field allows (None also allowed when it is Optional), or None for other fields."""
    tp = field_types(cls)[name]
    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    lits = [a for a in args if typing.get_origin(a) is Literal]
    return typing.get_args(lits[0]) if lits else None


def to_dict(cfg: TrainConfig) -> dict[str, Any]:
    """The config as plain JSON-able data (the run directory's config.json)."""
    return dataclasses.asdict(cfg)


def from_dict(d: dict[str, Any], cls: type = TrainConfig) -> Any:
    """The config `to_dict` wrote (nested sections rebuilt, lists back to tuples); an unknown key is a ConfigError."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ConfigError(f"{cls.__name__} has no field(s) {', '.join(unknown)}: the config was written by another "
                          f"version of jaxperf; remove them or upgrade")
    kwargs = {}
    for name, value in d.items():
        tp = field_types(cls)[name]
        if dataclasses.is_dataclass(tp) and isinstance(value, dict):
            value = from_dict(value, tp)
        elif typing.get_origin(tp) is tuple and isinstance(value, list):
            value = tuple(value)
        kwargs[name] = value
    return cls(**kwargs)
