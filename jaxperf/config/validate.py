"""Checks that run before anything compiles: the mesh against the devices, the model against itself, the batch
against the mesh. Each error is one line with the numbers and the fix."""

from __future__ import annotations

import dataclasses
import difflib
import math
import re

from jaxperf.config.schema import (
    REMAT_NAMES, ConfigError, DataConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig, choices,
)

# Slowest-varying first: `data` spans slices and hosts, `tensor` the closest devices (its collectives are the most
# frequent); `stage` sends activations point to point, `expert` exchanges tokens all-to-all in every MoE layer, `seq`
# rotates key/value blocks around a ring.
MESH_AXES = ("data", "stage", "fsdp", "expert", "seq", "tensor")


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
            f"the mesh {'*'.join(MESH_AXES)} = {'*'.join(str(sizes[a]) for a in MESH_AXES)} = {total} is larger than "
            f"the {num_devices} available devices: make the product at most {num_devices} (e.g. set one axis to -1)"
        )
    return sizes


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
    # The rule table itself (a Rules object passed to build_task or the step builders) is checked against the mesh
    # when the step is built (jaxperf.explicit.flavours.check_flavour).
    if strategy in FLAVOURS["jit"] and strategy not in supported:
        others = [f for f, s in FLAVOURS.items() if strategy in s]
        raise ConfigError(
            f"parallel.flavour={flavour} supports parallel.strategy {' and '.join(supported)}, not {strategy!r}: use "
            f"{' or '.join(f'parallel.flavour={f}' for f in others) or 'another strategy'} for {strategy}"
        )


def validate_model(m: ModelConfig) -> ModelConfig:
    """Check a model config and return it resolved (style defaults filled in)."""
    check_ranges(m)
    for f in dataclasses.fields(ModelConfig):
        allowed, value = choices(ModelConfig, f.name), getattr(m, f.name)
        if allowed is not None and value is not None and value not in allowed:
            raise ConfigError(f"model.{f.name}={value!r} is not one of {allowed}")
    r = m.resolved()
    if r.n_heads % r.n_kv_heads:
        divisors = [d for d in range(1, r.n_heads + 1) if r.n_heads % d == 0]
        raise ConfigError(f"model.n_heads={r.n_heads} is not a multiple of model.n_kv_heads={r.n_kv_heads}: pick "
                          f"n_kv_heads among {divisors}")
    if r.position == "rope" and r.head_dim % 2:
        raise ConfigError(f"RoPE needs an even head_dim, got {r.head_dim}")
    if r.scan_unroll is not None and r.scan_unroll < 1:
        raise ConfigError(f"model.scan_unroll={r.scan_unroll} must be at least 1 (layers per scan iteration; "
                          f"{r.n_layers} unrolls all of them)")
    if r.mlp_slices is not None and (r.mlp_slices < 1 or r.mlp_dim % r.mlp_slices):
        divisors = [d for d in range(1, min(r.mlp_dim, 64) + 1) if r.mlp_dim % d == 0]
        raise ConfigError(f"model.mlp_slices={r.mlp_slices} does not cut model.mlp_dim={r.mlp_dim} into equal slices: "
                          f"use one of {divisors}")
    _validate_remat(r)
    _validate_moe(r)
    return r


def _validate_remat(r: ModelConfig) -> None:
    """The names of remat=custom: known, each in one list, and only with custom."""
    if r.remat != "custom":
        if r.remat_save or r.remat_offload:
            raise ConfigError(f"model.remat_save and model.remat_offload apply to model.remat=custom only (remat is "
                              f"{r.remat!r}): set model.remat=custom, or clear them")
        return
    for key, names in (("remat_save", r.remat_save), ("remat_offload", r.remat_offload)):
        unknown = [n for n in names if n not in REMAT_NAMES]
        if unknown:
            raise ConfigError(f"model.{key} names {', '.join(map(repr, unknown))}, which no layer tags: use names "
                              f"from {', '.join(REMAT_NAMES)}")
    both = sorted(set(r.remat_save) & set(r.remat_offload))
    if both:
        raise ConfigError(f"{', '.join(both)} is in both model.remat_save and model.remat_offload: keep each name in "
                          f"one list")


def _validate_moe(r: ModelConfig) -> None:
    """The mixture-of-experts fields against each other and the layer stack (jaxperf.models.moe)."""
    if not r.n_shared_experts:
        for key, value in (("shared_mlp_dim", r.shared_mlp_dim), ("shared_expert_gate", r.shared_expert_gate)):
            if value:
                raise ConfigError(f"model.{key}={value} shapes shared experts, and model.n_shared_experts=0: set "
                                  f"n_shared_experts >= 1, or clear {key}")
    if r.router_bias_update_rate and not r.router_bias:
        raise ConfigError(f"model.router_bias_update_rate={r.router_bias_update_rate} moves a router bias, and "
                          f"model.router_bias=false: set router_bias=true, or router_bias_update_rate=0")
    if not r.n_experts:
        if r.router_bias:
            raise ConfigError("model.router_bias=true biases the choice of experts, and model.n_experts=0: set "
                              "n_experts, or router_bias=false")
        if r.n_shared_experts:
            raise ConfigError(f"model.n_shared_experts={r.n_shared_experts} needs model.n_experts > 0 (shared experts "
                              f"sit beside routed ones): set n_experts, or widen model.mlp_dim for a dense MLP")
        return
    if r.experts_per_token > r.n_experts:
        raise ConfigError(f"model.experts_per_token={r.experts_per_token} is more than model.n_experts="
                          f"{r.n_experts}: use experts_per_token <= {r.n_experts}")
    if r.moe_every > r.n_layers:
        raise ConfigError(f"model.moe_every={r.moe_every} is above model.n_layers={r.n_layers}, so no layer would be "
                          f"MoE: use moe_every <= {r.n_layers}, or n_experts=0 for a dense model")
    if r.moe_every > 1 and r.scan_layers:
        raise ConfigError(f"model.moe_every={r.moe_every} mixes dense and MoE layers, which one scanned layer body "
                          f"cannot hold: set model.scan_layers=false, or moe_every=1")


def _validate_stage_seq(cfg: TrainConfig, shape: dict[str, int]) -> None:
    """The pipeline and context-parallel settings that do not depend on the model."""
    stage = shape["stage"]
    if stage > 1:
        if cfg.parallel.flavour != "jit":
            raise ConfigError(f"parallel.stage={stage} runs with parallel.flavour=jit, not {cfg.parallel.flavour}")
        if cfg.microbatches < stage:
            raise ConfigError(f"microbatches={cfg.microbatches} is fewer than the parallel.stage={stage} pipeline "
                              f"stages: use microbatches >= {stage} (e.g. {2 * stage}; more shrink the bubble)")
    if shape["seq"] > 1 and cfg.parallel.flavour != "jit":
        raise ConfigError(f"parallel.seq={shape['seq']} runs with parallel.flavour=jit, not {cfg.parallel.flavour}")
    if cfg.parallel.sequence_parallel:
        if shape["tensor"] < 2:
            raise ConfigError("parallel.sequence_parallel splits activations over `tensor`: set parallel.tensor > 1 "
                              "(with strategy tp or fsdp_tp)")
        if cfg.parallel.flavour != "jit":
            raise ConfigError(f"parallel.sequence_parallel runs with parallel.flavour=jit, not "
                              f"{cfg.parallel.flavour}")
        if shape["seq"] > 1:
            raise ConfigError(f"parallel.sequence_parallel and parallel.seq={shape['seq']} both split the sequence: "
                              f"use one of them")


_OPTION_NAME = re.compile(r"[a-z][a-z0-9_]*")
# the TPU compiler's own options: XLA:CPU and XLA:GPU refuse them ("No such compile option"); the xla_gpu_ and
# xla_cpu_ ones are fields of XLA's common debug options, which every backend takes
_TPU_PREFIXES = ("xla_tpu_", "xla_jf_")


def compiler_options(entries: tuple[str, ...] | list[str],
                     platform: str | None = None) -> dict[str, bool | int | float | str]:
    """{name: value} of `compiler_options` entries ("name=value"; true/false become bools, numbers numbers, a value
    in quotes stays text), for jax.jit's `compiler_options`. ConfigError, before anything compiles, for an entry that
    is not name=value, a name given twice, or a TPU compiler option where `platform` ("tpu", "gpu", "cpu") is
    another."""
    out: dict[str, bool | int | float | str] = {}
    for entry in entries:
        name, eq, raw = str(entry).partition("=")
        name, raw = name.strip(), raw.strip()
        if not eq or not raw or not _OPTION_NAME.fullmatch(name):
            raise ConfigError(f"compiler_options entry {entry!r} is not name=value (e.g. "
                              f"xla_tpu_enable_windowed_einsum_for_reduce_scatter=false)")
        if name in out:
            raise ConfigError(f"compiler_options names {name} twice: keep one value")
        if platform and platform != "tpu" and name.startswith(_TPU_PREFIXES):
            raise ConfigError(f"compiler_options: {name} is an option of the TPU compiler and this step compiles for "
                              f"{platform.upper()}: drop it, or run on TPU")
        out[name] = _option_value(raw)
    return out


def _option_value(raw: str) -> bool | int | float | str:
    """A compiler option's value: quoted text as text, true/false as a bool, a number as a number, else the text."""
    if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"":
        return raw[1:-1]
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    for number in (int, float):
        try:
            return number(raw)
        except ValueError:
            pass
    return raw


def compiler_option_entries(options: dict[str, bool | int | float | str] | None) -> list[str]:
    """["name=value", ...] of parsed options, as a user writes them (booleans as true/false)."""
    return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in (options or {}).items()]


def validate(cfg: TrainConfig, num_devices: int, shape: dict[str, int] | None = None, *, model: bool = True):
    """Raise ConfigError for a run that cannot work, before compiling anything.

    `shape` is the resolved mesh ({"data": d, "fsdp": f, "tensor": t}), by default `mesh_shape(cfg.parallel, ...)`.
    `model=False` skips the checks of the built-in model's config (for runs that bring their own model).
    """
    check_ranges(cfg)
    validate_flavour(cfg.parallel)
    compiler_options(cfg.compiler_options)
    if cfg.compiler_options and cfg.parallel.flavour == "pmap":
        raise ConfigError("compiler_options are given to jax.jit; parallel.flavour=pmap takes none: use "
                          "parallel.flavour=shard_map (or jit) for the same data-parallel step")
    if cfg.parallel.overlap_grad_reduce and (cfg.parallel.flavour, cfg.parallel.strategy, cfg.microbatches) != (
            "shard_map", "dp", 1):
        raise ConfigError(
            f"parallel.overlap_grad_reduce runs with parallel.flavour=shard_map, parallel.strategy=dp and "
            f"microbatches=1, not {cfg.parallel.flavour}, {cfg.parallel.strategy}, {cfg.microbatches}: set those, or "
            f"drop it (under jit XLA schedules the gradient reduction itself)")
    shape = shape or mesh_shape(cfg.parallel, num_devices)
    used = math.prod(shape[a] for a in MESH_AXES)
    if used < num_devices:
        raise ConfigError(
            f"the mesh {'*'.join(MESH_AXES)} = {'*'.join(str(shape[a]) for a in MESH_AXES)} = {used} uses {used} of "
            f"the {num_devices} devices, leaving {num_devices - used} idle: set one axis to -1 (the rest of the devices) "
            f"or make the product {num_devices}")
    dp = shape["data"] * shape["fsdp"] * shape["expert"]  # the expert axis splits the batch outside the experts too
    if cfg.microbatches < 1 or cfg.batch_size % cfg.microbatches:
        raise ConfigError(
            f"batch_size={cfg.batch_size} is not divisible by microbatches={cfg.microbatches}: pick a batch size that "
            f"is a multiple of {cfg.microbatches}"
        )
    micro = cfg.batch_size // cfg.microbatches
    if micro % dp:
        raise ConfigError(
            f"the global batch per microbatch ({cfg.batch_size}/{cfg.microbatches}={micro}) is not divisible by the "
            f"data-parallel size data*fsdp*expert={shape['data']}*{shape['fsdp']}*{shape['expert']}={dp}: use "
            f"batch_size="
            f"{cfg.microbatches * dp * max(1, round(micro / dp))} or change the mesh"
        )
    _validate_stage_seq(cfg, shape)
    if not model:
        return
    m = validate_model(cfg.model)
    seq = cfg.train_seq_len
    if seq > m.max_seq_len:
        raise ConfigError(
            f"seq_len={seq} is above the model's maximum model.max_seq_len={m.max_seq_len}: lower seq_len or raise "
            f"model.max_seq_len"
        )
    if shape["stage"] > 1:
        if m.n_layers % shape["stage"]:
            ok = [s for s in range(1, m.n_layers + 1) if m.n_layers % s == 0]
            raise ConfigError(f"model.n_layers={m.n_layers} does not split over parallel.stage={shape['stage']} "
                              f"pipeline stages: use stage in {ok} or a layer count that is a multiple of "
                              f"{shape['stage']}")
        if not m.scan_layers:
            raise ConfigError("parallel.stage > 1 needs model.scan_layers=true (the pipeline splits the stacked "
                              "layers over the stages)")
    if (m.mlp_slices or 1) > 1 and shape["tensor"] > 1:
        raise ConfigError(f"model.mlp_slices={m.mlp_slices} slices the MLP's hidden width, which "
                          f"parallel.tensor={shape['tensor']} splits over devices: set model.mlp_slices=1 (or leave it "
                          f"unset) or parallel.tensor=1")
    if shape["expert"] > 1 and (not m.n_experts or m.n_experts % shape["expert"]):
        raise ConfigError(f"parallel.expert={shape['expert']} splits the experts over {shape['expert']} devices but "
                          f"model.n_experts={m.n_experts}: "
                          + (f"use an expert count that is a multiple of {shape['expert']}" if m.n_experts else
                             "set parallel.expert=1 for a dense model (or give it experts)"))
    if m.n_experts and (shape["stage"] > 1 or cfg.parallel.flavour != "jit"):
        what = f"parallel.stage={shape['stage']}" if shape["stage"] > 1 else f"parallel.flavour={cfg.parallel.flavour}"
        raise ConfigError(f"model.n_experts={m.n_experts} (MoE) runs with parallel.flavour=jit and parallel.stage=1, "
                          f"not {what}: change that, or set n_experts=0")
    if shape["seq"] > 1:
        parts = shape["seq"] * (2 if cfg.parallel.context_layout == "zigzag" else 1)
        if seq % parts:
            raise ConfigError(f"seq_len={seq} does not split into {parts} equal chunks (parallel.seq={shape['seq']}"
                              f"{' x 2 for the zigzag layout' if parts > shape['seq'] else ''}): use a seq_len that is "
                              f"a multiple of {parts}")
        if m.attention_impl not in ("auto", "ring"):
            raise ConfigError(f"parallel.seq={shape['seq']} splits the sequence: attention must run as a ring "
                              f"(model.attention_impl=auto or ring), not {m.attention_impl!r}")
    if cfg.parallel.sequence_parallel and seq % (shape["tensor"] * shape["seq"]):
        raise ConfigError(f"parallel.sequence_parallel splits seq_len={seq} over tensor={shape['tensor']} (and seq="
                          f"{shape['seq']}): use a seq_len that is a multiple of {shape['tensor'] * shape['seq']}")
    t = shape["tensor"]
    for name, value in (("n_heads", m.n_heads), ("n_kv_heads", m.n_kv_heads), ("mlp_dim", m.mlp_dim)):
        if value % t:
            raise ConfigError(
                f"model.{name}={value} is not divisible by the tensor-parallel size parallel.tensor={t}: pick a "
                f"tensor size that divides it (e.g. {math.gcd(value, t)}) or change model.{name}"
            )


# ---------------------------------------------------------------------------------------------------------------------
# Numeric ranges: every number a run takes, checked before anything else happens.


def _at_least(n):
    return lambda v: None if v >= n else f"at least {n}"


def _positive(v):
    return None if v > 0 else "greater than 0"


def _fraction(v):  # [0, 1)
    return None if 0 <= v < 1 else "in [0, 1)"


def _unit(v):  # [0, 1]
    return None if 0 <= v <= 1 else "in [0, 1]"


# dotted key -> (check, what the number means). A None value passes where the field allows None.
RANGES = {
    "batch_size": (_at_least(1), "sequences per step"),
    "microbatches": (_at_least(1), "gradient accumulation steps"),
    "seq_len": (_at_least(1), "tokens per sequence; none = model.max_seq_len"),
    "max_steps": (_at_least(1), "steps to train to"),
    "log_every": (_at_least(1), "steps between log lines"),
    "eval_every": (_at_least(0), "steps between evaluations; 0 = none"),
    "eval_batches": (_at_least(0), "batches per evaluation (0: evaluation off)"),
    "checkpoint_every": (_at_least(0), "steps between checkpoints; 0 = only at the end"),
    "keep_checkpoints": (_at_least(1), "newest checkpoints kept"),
    "keep_checkpoints_every": (_at_least(0), "also keep multiples of this step; 0 = none"),
    "sample_tokens": (_at_least(0), "tokens sampled at the end; 0 = none"),
    "max_consecutive_skips": (_at_least(1), "skipped steps in a row before the run stops"),
    "spike_sigma": (_at_least(0), "loss-spike threshold in standard deviations; 0 = off"),
    "spike_window": (_at_least(1), "losses the spike test looks back over"),
    "model.vocab_size": (_at_least(1), "tokens in the vocabulary"),
    "model.vocab_multiple": (_at_least(1), "the vocabulary is padded to a multiple of this"),
    "model.max_seq_len": (_at_least(1), "longest sequence the model takes"),
    "model.d_model": (_at_least(1), "width of the residual stream"),
    "model.n_layers": (_at_least(1), "Transformer layers"),
    "model.n_heads": (_at_least(1), "attention heads"),
    "model.n_kv_heads": (_at_least(1), "key/value heads; none = n_heads"),
    "model.head_dim": (_at_least(1), "width of a head; none = d_model / n_heads"),
    "model.mlp_dim": (_at_least(1), "MLP width; none = the style's default"),
    "model.scan_unroll": (_at_least(1), "layers per scan iteration"),
    "model.n_experts": (_at_least(0), "experts per MoE layer; 0 = dense"),
    "model.experts_per_token": (_at_least(1), "experts each token is routed to (top-k)"),
    "model.n_shared_experts": (_at_least(0), "always-on experts per MoE layer"),
    "model.shared_mlp_dim": (_at_least(1), "the shared experts' hidden width; none = n_shared_experts * moe_mlp_dim"),
    "model.moe_every": (_at_least(1), "every Nth layer is MoE"),
    "model.moe_mlp_dim": (_at_least(1), "one expert's hidden width; none = mlp_dim"),
    "model.capacity_factor": (_at_least(0), "expert capacity over an even share; 0 or none = dropless"),
    "model.router_bias_update_rate": (_at_least(0), "step of the loss-free balancing bias per update; 0 = frozen"),
    "model.router_aux_loss_coef": (_at_least(0), "weight of the load-balancing loss"),
    "model.router_z_loss_coef": (_at_least(0), "weight of the router z-loss"),
    "model.rope_theta": (_positive, "RoPE base"),
    "model.norm_eps": (_positive, "norm epsilon"),
    "model.init_std": (_positive, "initialisation standard deviation"),
    "optim.lr": (_positive, "peak learning rate"),
    "optim.min_lr_ratio": (_unit, "final learning rate as a fraction of lr"),
    "optim.warmup_steps": (_at_least(0), "linear warm-up steps"),
    "optim.decay_steps": (_at_least(1), "cosine decay horizon; none = max_steps"),
    "optim.b1": (_fraction, "Adam's first-moment decay"),
    "optim.b2": (_fraction, "Adam's second-moment decay"),
    "optim.eps": (_positive, "Adam's epsilon"),
    "optim.weight_decay": (_at_least(0), "AdamW weight decay"),
    "optim.grad_clip": (_at_least(0), "global-norm clip; 0 = none"),
    "parallel.dcn_data": (_at_least(1), "slices of a multi-slice job"),
    "data.max_bytes": (_at_least(1), "bytes of the corpus used; none = all"),
    "data.val_fraction": (_fraction, "share of the tokens held out"),
    "data.prefetch": (_at_least(1), "batches prepared ahead"),
}


def _get(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _default(key: str):
    section, _, name = key.rpartition(".")
    cls = {"": TrainConfig, "model": ModelConfig, "optim": OptimConfig, "parallel": ParallelConfig,
           "data": DataConfig}[section]
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default


def check_ranges(cfg: TrainConfig | ModelConfig) -> None:
    """ConfigError for the first number out of its range (RANGES), naming the key, the value, the range and an
    example that works. A ModelConfig alone gets its `model.` ranges checked."""
    model_only = isinstance(cfg, ModelConfig)
    for key, (check, meaning) in RANGES.items():
        if model_only and not key.startswith("model."):
            continue
        value = _get(cfg, key.removeprefix("model.") if model_only else key)
        if value is None:
            continue
        if isinstance(value, float) and not math.isfinite(value):
            problem = "a finite number"
        else:
            problem = check(value)
        if problem is not None:
            example = _default(key)
            hint = f": e.g. {key}={example}" if example is not None and check(example) is None else ""
            raise ConfigError(f"{key}={value!r} must be {problem} ({meaning}){hint}")
