"""Checks that run before anything compiles: the mesh against the devices, the model against itself, the batch
against the mesh. Each error is one line with the numbers and the fix."""

from __future__ import annotations

import dataclasses
import difflib
import math

from jaxperf.config.schema import ConfigError, ModelConfig, ParallelConfig, TrainConfig, choices

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
            f"microbatches=1, not {cfg.parallel.flavour}, {cfg.parallel.strategy}, {cfg.microbatches}: set those, or "
            f"drop it (under jit XLA schedules the gradient reduction itself)")
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
