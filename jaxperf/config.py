"""Configuration: frozen dataclasses, presets, `key=value` overrides and validation before anything compiles.

    cfg = get_config("tiny", ["max_steps=20", "model.d_model=64", "lr=1e-3"])

A key is a dotted path (`model.n_layers`) or a bare field name that is unique across sections (`n_layers`,
`max_steps`). An unknown key or a value of the wrong type raises `ConfigError` naming the key and the closest valid ones.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A configuration that cannot work; the message names the numbers and the fix."""


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only Transformer. `style` picks GPT-2 or Llama defaults; fields left None follow the style."""

    style: str = "gpt2"  # "gpt2": LayerNorm, learned positions, GELU, MHA. "llama": RMSNorm, RoPE, SwiGLU, GQA.
    vocab_size: int = 256  # rounded up to `vocab_multiple` for the embedding table
    vocab_multiple: int = 128  # pad the vocabulary to a multiple of this (tensor cores, even sharding)
    max_seq_len: int = 128  # longest sequence the model accepts (size of the learned position table)
    d_model: int = 128  # embed
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None  # None = n_heads (multi-head); fewer = grouped-query; 1 = multi-query
    head_dim: int | None = None  # None = d_model // n_heads
    mlp_dim: int | None = None  # None = 4 * d_model (gelu) or 8/3 * d_model rounded up to 64 (swiglu)
    norm: str | None = None  # "layernorm" | "rmsnorm"
    position: str | None = None  # "learned" | "rope"
    mlp_act: str | None = None  # "gelu" | "swiglu"
    use_bias: bool | None = None  # biases in projections and norms (gpt2: yes, llama: no)
    tie_embeddings: bool = True  # output projection = embedding table transposed
    scan_layers: bool = True  # one compiled layer body under lax.scan (fast compiles) or a Python loop
    scan_unroll: int = 1  # layers per scan iteration; >= n_layers unrolls the stack (loop speed, stacked params;
    # remat then saves little: see jaxperf.perf.memory)
    remat: str = "none"  # none | full | save_dots | save_dots_no_batch | save_attn_proj
    dtype: str = "float32"  # compute dtype: float32 | bfloat16 | float16 (parameters stay param_dtype)
    param_dtype: str = "float32"
    attention_impl: str = "auto"  # auto | xla | cudnn | pallas | any name registered with register_attention
    norm_impl: str = "auto"  # auto | xla | pallas (see jaxperf.models.kernels)
    loss_impl: str = "auto"  # auto | xla | pallas | chunked: pallas and chunked never build [tokens, vocab] logits
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02

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
        return dataclasses.replace(
            self,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            mlp_dim=mlp,
            norm=self.norm or ("rmsnorm" if llama else "layernorm"),
            position=self.position or ("rope" if llama else "learned"),
            mlp_act=act,
            use_bias=(not llama) if self.use_bias is None else self.use_bias,
        )

    @property
    def padded_vocab(self) -> int:
        return self.vocab_multiple * math.ceil(self.vocab_size / self.vocab_multiple)


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warm-up, cosine decay to `min_lr_ratio * lr`, and global-norm clipping."""

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
    """The device mesh (axes data x fsdp x tensor; -1 = the rest of the devices) and the sharding strategy."""

    strategy: str = "fsdp"  # dp | fsdp | tp | fsdp_tp (see jaxperf.parallel.rules)
    data: int = 1
    fsdp: int = -1
    tensor: int = 1
    # Slices of a multi-slice TPU job (or any groups of devices joined by a slower network, DCN): the `data` axis
    # spans them, so only the gradient all-reduce crosses DCN; data/fsdp/tensor above describe one slice.
    dcn_data: int = 1
    flavour: str = "jit"  # how the step is written: jit (GSPMD) | shard_map | pmap (see jaxperf.explicit.flavours)
    # shard_map dp: all-reduce each layer's gradients inside the backward pass, as soon as that layer is done
    overlap_grad_reduce: bool = False


MESH_AXES = ("data", "fsdp", "tensor")


def mesh_shape(parallel: ParallelConfig, num_devices: int) -> dict[str, int]:
    """Resolve the axis sizes (one may be -1) against a device count, or raise ConfigError with the fix.

    With dcn_data = S > 1 the sizes are resolved against num_devices / S devices (one slice) and `data` is then
    multiplied by S.
    """
    slices = int(getattr(parallel, "dcn_data", 1))
    if slices < 1:
        raise ConfigError(f"parallel.dcn_data={slices} must be >= 1 (the number of slices)")
    if slices > 1:
        if num_devices % slices:
            raise ConfigError(f"parallel.dcn_data={slices} slices do not split the {num_devices} devices evenly: use "
                              f"a divisor of {num_devices}")
        sizes = mesh_shape(dataclasses.replace(parallel, dcn_data=1), num_devices // slices)
        return {**sizes, "data": sizes["data"] * slices}
    sizes = {a: int(getattr(parallel, a)) for a in MESH_AXES}
    free = [a for a, s in sizes.items() if s == -1]
    if len(free) > 1:
        raise ConfigError(f"only one mesh axis may be -1 ('the rest'), got {', '.join(free)} = -1")
    bad = {a: s for a, s in sizes.items() if s == 0 or s < -1}
    if bad:
        raise ConfigError(f"mesh axis sizes must be positive or -1, got {bad}")
    fixed = math.prod(s for s in sizes.values() if s != -1)
    if free:
        if num_devices % fixed:
            raise ConfigError(
                f"the mesh axes {({a: s for a, s in sizes.items() if s != -1})} use {fixed} devices, which does not "
                f"divide the {num_devices} devices; '{free[0]}=-1' needs a divisor of {num_devices}"
            )
        sizes[free[0]] = num_devices // fixed
    total = math.prod(sizes.values())
    if total > num_devices:
        raise ConfigError(
            f"the mesh data*fsdp*tensor = {sizes['data']}*{sizes['fsdp']}*{sizes['tensor']} = {total} is larger than "
            f"the {num_devices} available devices: make the product at most {num_devices} (e.g. set one axis to -1)"
        )
    return sizes



@dataclass(frozen=True)
class DataConfig:
    """Where tokens come from. The default corpus is the Python standard library's own source (always present)."""

    source: str = "stdlib"  # "stdlib" | a text file or glob | a token file "x.bin" or "x.bin:uint32"
    tokenizer: str = "byte"  # "byte" | "bpe" (trained on the corpus with model.vocab_size, or tokenizer_path)
    tokenizer_path: str | None = None  # a tokenizer.json for "bpe"
    max_bytes: int | None = None  # use only this prefix of a text corpus
    val_fraction: float = 0.01  # tail of the token stream held out for evaluation
    cache_dir: str = "~/.cache/jaxperf"  # tokenizer and tokenized-corpus cache
    prefetch: int = 2  # batches prepared ahead on a background thread


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
    eval_batches: int = 4
    checkpoint_every: int = 100  # 0 = only at the end
    keep_checkpoints: int = 3  # the newest k checkpoints are kept ...
    keep_checkpoints_every: int = 0  # ... plus every step that is a multiple of this (0 = none)
    compile_cache_dir: str = "~/.cache/jaxperf/xla"  # JAX's persistent compilation cache ("" = off)
    check_memory: bool = True  # estimate per-device memory before compiling; refuse with advice when it cannot fit
    handle_signals: bool = True  # SIGTERM / Ctrl-C: save a checkpoint at the next step and exit cleanly
    run_dir: str = "runs/default"
    resume: bool = True  # continue from the newest checkpoint in run_dir
    sample_tokens: int = 200  # length of the text sample printed at the end (0 = none)
    sample_prompt: str = "def "
    tensorboard: bool = True  # also write TensorBoard events when tensorboardX is installed
    skip_nonfinite: bool = True  # a step with a non-finite loss or gradient leaves the state untouched (counted)
    max_consecutive_skips: int = 10  # stop the run after this many skipped steps in a row
    spike_sigma: float = 0.0  # also skip a step whose loss exceeds mean + sigma * std of recent losses (0 = off)
    spike_window: int = 100
    loss_scale: str = "auto"  # auto (dynamic for float16 compute) | dynamic | none

    @property
    def train_seq_len(self) -> int:
        return self.seq_len or self.model.max_seq_len


# --------------------------------------------------------------------------------------------------------------------
# Presets

PRESETS: dict[str, dict[str, Any]] = {
    # ~0.8M parameters on bytes: 2 CPU cores train it in a few minutes and the loss falls from 5.5 to ~2.
    "tiny": {
        "model.d_model": 128, "model.n_layers": 4, "model.n_heads": 4, "model.max_seq_len": 128,
        "model.scan_unroll": 4,  # four layers unrolled: ~1.3x the steps/s of a rolled scan on XLA:CPU
        "batch_size": 16, "max_steps": 300, "optim.lr": 2e-3, "optim.warmup_steps": 30, "run_dir": "runs/tiny",
        "data.max_bytes": 8_000_000,
    },
    # GPT-2 small, 124M parameters (vocab padded to 50304 as in nanoGPT).
    "gpt2-small": {
        "model.vocab_size": 50257, "model.d_model": 768, "model.n_layers": 12, "model.n_heads": 12,
        "model.max_seq_len": 1024, "model.dtype": "bfloat16", "data.tokenizer": "bpe", "batch_size": 32,
        "optim.lr": 6e-4, "optim.warmup_steps": 700, "max_steps": 20_000, "run_dir": "runs/gpt2-small",
        "eval_every": 500, "checkpoint_every": 1000,
    },
    # GPT-2 medium, 350M parameters.
    "gpt2-medium": {
        "model.vocab_size": 50257, "model.d_model": 1024, "model.n_layers": 24, "model.n_heads": 16,
        "model.max_seq_len": 1024, "model.dtype": "bfloat16", "data.tokenizer": "bpe", "batch_size": 32,
        "optim.lr": 3e-4, "optim.warmup_steps": 700, "max_steps": 40_000, "run_dir": "runs/gpt2-medium",
        "eval_every": 500, "checkpoint_every": 1000, "model.remat": "save_dots",
    },
    # Llama-style ~1.0B: RMSNorm, RoPE, SwiGLU, 32 heads sharing 8 KV heads, tied embeddings.
    "llama-1b": {
        "model.style": "llama", "model.vocab_size": 32000, "model.d_model": 2048, "model.n_layers": 16,
        "model.n_heads": 32, "model.n_kv_heads": 8, "model.mlp_dim": 8192, "model.max_seq_len": 2048,
        "model.dtype": "bfloat16", "model.rope_theta": 500_000.0, "model.remat": "save_dots",
        "data.tokenizer": "bpe", "batch_size": 64, "optim.lr": 3e-4, "optim.warmup_steps": 1000,
        "max_steps": 50_000, "run_dir": "runs/llama-1b", "eval_every": 1000, "checkpoint_every": 1000,
    },
}
DEFAULT_PRESET = "tiny"


# --------------------------------------------------------------------------------------------------------------------
# key=value overrides

_SECTIONS = ("model", "optim", "parallel", "data")


def _all_keys(cfg: TrainConfig) -> dict[str, tuple[str | None, dataclasses.Field]]:
    """dotted key -> (section or None, field)."""
    keys: dict[str, tuple[str | None, dataclasses.Field]] = {}
    for f in dataclasses.fields(cfg):
        if f.name in _SECTIONS:
            for g in dataclasses.fields(getattr(cfg, f.name)):
                keys[f"{f.name}.{g.name}"] = (f.name, g)
        else:
            keys[f.name] = (None, f)
    return keys


def _resolve_key(key: str, keys: dict[str, tuple[str | None, dataclasses.Field]]) -> str:
    if key in keys:
        return key
    bare = [k for k in keys if k.split(".")[-1] == key]
    if len(bare) == 1:
        return bare[0]
    if len(bare) > 1:
        raise ConfigError(f"config key {key!r} is ambiguous: say one of {', '.join(bare)}")
    names = list(keys) + sorted({k.split(".")[-1] for k in keys})
    close = difflib.get_close_matches(key, names, n=3, cutoff=0.5)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise ConfigError(f"unknown config key {key!r}.{hint} Valid keys: {', '.join(keys)}")


def _parse(key: str, text: str, annotation: str) -> Any:
    types = [t.strip() for t in str(annotation).split("|")]
    if "None" in types and text.strip().lower() in ("none", "null", ""):
        return None
    base = next(t for t in types if t != "None")
    try:
        if base == "bool":
            low = text.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if base == "int":
            as_float = float(text)
            if not as_float.is_integer():
                raise ValueError(text)
            return int(as_float)
        if base == "float":
            return float(text)
    except ValueError:
        raise ConfigError(f"config key {key!r} wants {annotation}, got {text!r}") from None
    return text


def apply_overrides(cfg: TrainConfig, overrides: dict[str, Any] | list[str]) -> TrainConfig:
    """Apply `{"model.d_model": 64}` or `["model.d_model=64", ...]` to a config, checking keys and types."""
    if isinstance(overrides, (list, tuple)):
        pairs = {}
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"override {item!r} is not key=value (for example max_steps=20)")
            k, v = item.split("=", 1)
            pairs[k.strip()] = v
        overrides = pairs
    keys = _all_keys(cfg)
    sections = {s: {} for s in _SECTIONS}
    top = {}
    for raw_key, value in overrides.items():
        key = _resolve_key(raw_key, keys)
        section, f = keys[key]
        if isinstance(value, str):
            value = _parse(key, value, f.type)
        else:
            value = _check_type(key, value, f.type)
        (sections[section] if section else top)[f.name] = value
    new_sections = {s: dataclasses.replace(getattr(cfg, s), **kv) for s, kv in sections.items() if kv}
    return dataclasses.replace(cfg, **new_sections, **top)


def _check_type(key: str, value: Any, annotation: str) -> Any:
    types = [t.strip() for t in str(annotation).split("|")]
    if value is None and "None" in types:
        return value
    base = next(t for t in types if t != "None")
    ok = {
        "bool": isinstance(value, bool),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
        "str": isinstance(value, str),
    }.get(base, True)
    if not ok:
        raise ConfigError(f"config key {key!r} wants {annotation}, got {value!r} ({type(value).__name__})")
    return float(value) if base == "float" else value


def get_config(preset: str | None = None, overrides: dict[str, Any] | list[str] | None = None) -> TrainConfig:
    """The config of a preset (default `tiny`) with overrides applied."""
    name = preset or DEFAULT_PRESET
    if name not in PRESETS:
        close = difflib.get_close_matches(name, list(PRESETS), n=2)
        hint = f" Did you mean {' or '.join(close)}?" if close else ""
        raise ConfigError(f"unknown preset {name!r}.{hint} Presets: {', '.join(PRESETS)}")
    cfg = apply_overrides(TrainConfig(), PRESETS[name])
    return apply_overrides(cfg, overrides or {})


def to_dict(cfg: TrainConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def from_dict(d: dict[str, Any]) -> TrainConfig:
    sections = {s: globals()[c](**d[s]) for s, c in zip(_SECTIONS, ("ModelConfig", "OptimConfig", "ParallelConfig", "DataConfig"))}
    return TrainConfig(**sections, **{k: v for k, v in d.items() if k not in _SECTIONS})


# --------------------------------------------------------------------------------------------------------------------
# Validation (runs before any compilation)

_MODEL_CHOICES = {
    "style": ("gpt2", "llama"),
    "norm": ("layernorm", "rmsnorm"),
    "position": ("learned", "rope"),
    "mlp_act": ("gelu", "swiglu"),
    "remat": ("none", "full", "save_dots", "save_dots_no_batch", "save_attn_proj"),
    "dtype": ("float32", "bfloat16", "float16"),
    "param_dtype": ("float32", "bfloat16"),
    "norm_impl": ("auto", "xla", "pallas"),
    "loss_impl": ("auto", "xla", "pallas", "chunked"),
}


# Step flavours and the strategies each can run (jaxperf.explicit.flavours writes the explicit-collective ones).
FLAVOURS: dict[str, tuple[str, ...]] = {
    "jit": ("dp", "fsdp", "tp", "fsdp_tp"),
    "shard_map": ("dp", "fsdp", "tp", "fsdp_tp"),
    "pmap": ("dp",),
}


def validate_flavour(parallel: ParallelConfig) -> None:
    """Raise ConfigError for an unknown `parallel.flavour` or a flavour that cannot run `parallel.strategy`."""
    flavour, strategy = parallel.flavour, parallel.strategy
    if flavour not in FLAVOURS:
        close = difflib.get_close_matches(str(flavour), list(FLAVOURS), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"unknown parallel.flavour {flavour!r}; choose one of {', '.join(FLAVOURS)}.{hint}")
    supported = FLAVOURS[flavour]
    # Only the built-in strategy names are judged here; a table registered by the user is checked against the mesh
    # when the step is built (jaxperf.explicit.flavours.check_flavour), and an unknown name by get_rules.
    if strategy in FLAVOURS["jit"] and strategy not in supported:
        others = [f for f, s in FLAVOURS.items() if strategy in s]
        raise ConfigError(
            f"parallel.flavour={flavour} supports parallel.strategy {' and '.join(supported)}, not {strategy!r}: use "
            f"{' or '.join(f'parallel.flavour={f}' for f in others) or 'another strategy'} for {strategy}"
        )


def validate_model(m: ModelConfig) -> ModelConfig:
    """Check a model config and return it resolved (style defaults filled in)."""
    for name, choices in _MODEL_CHOICES.items():
        value = getattr(m, name)
        if value is not None and value not in choices:
            raise ConfigError(f"model.{name}={value!r} is not one of {choices}")
    r = m.resolved()
    if r.n_heads % r.n_kv_heads:
        raise ConfigError(
            f"model.n_heads={r.n_heads} is not a multiple of model.n_kv_heads={r.n_kv_heads}: each KV head serves a "
            f"whole group of query heads; pick n_kv_heads among {[d for d in range(1, r.n_heads + 1) if r.n_heads % d == 0]}"
        )
    if r.position == "rope" and r.head_dim % 2:
        raise ConfigError(f"RoPE needs an even head_dim, got {r.head_dim}")
    if r.scan_unroll < 1:
        raise ConfigError(f"model.scan_unroll={r.scan_unroll} must be at least 1 (layers per scan iteration; "
                          f"{r.n_layers} unrolls all of them)")
    return r


def validate(cfg: TrainConfig, num_devices: int, shape: dict[str, int] | None = None, *, model: bool = True):
    """Raise ConfigError for a run that cannot work, before compiling anything.

    `shape` is the resolved mesh ({"data": d, "fsdp": f, "tensor": t}), by default `mesh_shape(cfg.parallel, ...)`.
    `model=False` skips the checks of the built-in model's config (for runs that bring their own model).
    """
    validate_flavour(cfg.parallel)
    if cfg.parallel.overlap_grad_reduce and (cfg.parallel.flavour, cfg.parallel.strategy, cfg.microbatches) != (
            "shard_map", "dp", 1):
        raise ConfigError(
            f"parallel.overlap_grad_reduce runs with parallel.flavour=shard_map, parallel.strategy=dp and "
            f"microbatches=1 (each layer's gradients are all-reduced once, inside the backward pass), not flavour="
            f"{cfg.parallel.flavour}, strategy={cfg.parallel.strategy}, microbatches={cfg.microbatches}; under jit XLA "
            f"schedules the gradient reduction itself")
    shape = shape or mesh_shape(cfg.parallel, num_devices)
    dp = shape["data"] * shape["fsdp"]
    if cfg.microbatches < 1 or cfg.batch_size % cfg.microbatches:
        raise ConfigError(
            f"batch_size={cfg.batch_size} is not divisible by microbatches={cfg.microbatches}: pick a batch size that "
            f"is a multiple of {cfg.microbatches}"
        )
    micro = cfg.batch_size // cfg.microbatches
    if micro % dp:
        raise ConfigError(
            f"the global batch per microbatch ({cfg.batch_size}/{cfg.microbatches}={micro}) is not divisible by the "
            f"data-parallel size data*fsdp={shape['data']}*{shape['fsdp']}={dp}: use batch_size="
            f"{cfg.microbatches * dp * max(1, round(micro / dp))} or change the mesh"
        )
    if not model:
        return
    m = validate_model(cfg.model)
    seq = cfg.train_seq_len
    if seq > m.max_seq_len:
        raise ConfigError(
            f"seq_len={seq} is above the model's maximum model.max_seq_len={m.max_seq_len}: lower seq_len or raise "
            f"model.max_seq_len"
        )
    t = shape["tensor"]
    for name, value in (("n_heads", m.n_heads), ("n_kv_heads", m.n_kv_heads), ("mlp_dim", m.mlp_dim)):
        if value % t:
            raise ConfigError(
                f"model.{name}={value} is not divisible by the tensor-parallel size parallel.tensor={t}: pick a "
                f"tensor size that divides it (e.g. {math.gcd(value, t)}) or change model.{name}"
            )
