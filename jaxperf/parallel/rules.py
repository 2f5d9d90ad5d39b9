"""Logical-axis rules: how each strategy maps the model's named axes onto the mesh.

Models name their axes (batch, seq, embed, heads, kv_heads, head_dim, mlp, vocab, layers, norm); a strategy is a pair of
tables, one for parameters and one for activations, from those names to mesh axes. Data parallel, fully sharded and
tensor parallel training are these tables over one model and one step; adding a strategy means adding a table.

Parameters and activations get separate tables because the same logical name means different things: a parameter's
`embed` dim is where FSDP shards weights, while an activation's batch dim already uses the fsdp axis.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxperf import _compat
from jaxperf.config import ConfigError

MeshAxes = str | tuple[str, ...] | None


def _axes_tuple(axes: MeshAxes) -> tuple[str, ...]:
    """A table entry's mesh axes as a tuple: one name, several, or none."""
    return (axes,) if isinstance(axes, str) else tuple(axes or ())


@dataclass(frozen=True)
class Rules:
    """Logical name -> mesh axis (or tuple of axes, or None = replicated), for parameters and for activations."""

    name: str
    params: tuple[tuple[str, MeshAxes], ...]
    activations: tuple[tuple[str, MeshAxes], ...]

    def mesh_axes_used(self) -> set[str]:
        used = set()
        for _, axes in self.params + self.activations:
            used.update(_axes_tuple(axes))
        return used


# Activations: the batch is split over every data-parallel axis; TP splits heads / mlp / vocab.
_ACTIVATIONS = (
    ("batch", ("data", "fsdp")),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
)
# Weights: FSDP (ZeRO-3) splits every weight along its embed dim; Megatron TP splits heads, mlp and vocab. Norm scales
# and biases are named `norm`, which no table maps: whole on every device, as MaxText keeps them. Split over fsdp, each
# layer would gather both of its norms' scales twice a step (forward and recomputation: 64 small all-reduces for 32
# layers, 4.1 MB at 64 chips) to save 3 x 16 KB per norm of parameters and Adam moments (a 4096-wide model).
_FSDP_PARAMS = (("embed", "fsdp"),)
_TP_PARAMS = (("heads", "tensor"), ("kv_heads", "tensor"), ("mlp", "tensor"), ("vocab", "tensor"))

STRATEGIES: dict[str, Rules] = {
    "dp": Rules("dp", (), _ACTIVATIONS[:1]),
    "fsdp": Rules("fsdp", _FSDP_PARAMS, _ACTIVATIONS[:1]),
    "tp": Rules("tp", _TP_PARAMS, _ACTIVATIONS),
    "fsdp_tp": Rules("fsdp_tp", _FSDP_PARAMS + _TP_PARAMS, _ACTIVATIONS),
}

# Pipeline and context parallelism go with every strategy, added when the mesh has the axis: `stage` splits the
# stacked layers (each stage stores its own layers), `seq` splits the sequence of every activation (attention runs as a
# ring over it). `residual_seq` names the sequence dim of the residual stream between layers, which Megatron-style
# sequence parallelism also splits over `tensor`.
_STAGE_PARAMS = (("layers", "stage"),)
# Expert parallelism: an MoE layer's stacked experts split over `expert`, and everywhere else the axis splits the
# batch like `data` (the last mapping of a name wins in a table).
_EXPERT_PARAMS = (("expert", "expert"),)


def mesh_rules(rules: Rules, mesh: Mesh, *, sequence_parallel: bool = False) -> Rules:
    """`rules` with the mappings the mesh's stage, expert and seq axes (and sequence parallelism over tensor) need."""
    params, acts = rules.params, rules.activations
    if mesh.shape.get("stage", 1) > 1:
        params = _STAGE_PARAMS + params
    if mesh.shape.get("expert", 1) > 1:
        params = _EXPERT_PARAMS + params
        batch = dict(acts).get("batch")
        batch = _axes_tuple(batch)
        acts = acts + (("batch", batch + ("expert",)),)
    seq = ("seq",) if mesh.shape.get("seq", 1) > 1 else ()
    residual = seq + (("tensor",) if sequence_parallel and mesh.shape.get("tensor", 1) > 1 else ())
    if seq:
        acts = acts + (("seq", "seq"),)
    if residual:
        acts = acts + (("residual_seq", residual if len(residual) > 1 else residual[0]),)
    if (params, acts) == (rules.params, rules.activations):
        return rules
    return Rules(rules.name, params, acts)


def get_rules(strategy: str | Rules, mesh: Mesh | None = None, *, sequence_parallel: bool = False) -> Rules:
    """The rule table of a strategy; with a mesh, the stage / seq mappings it needs (`mesh_rules`) and a check that
    every mesh axis larger than 1 is used by the table."""
    if isinstance(strategy, Rules):
        rules = strategy
    elif strategy in STRATEGIES:
        rules = STRATEGIES[strategy]
    else:
        raise ConfigError(f"unknown parallel.strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if mesh is not None:
        rules = mesh_rules(rules, mesh, sequence_parallel=sequence_parallel)
        unused = [a for a, s in mesh.shape.items() if s > 1 and a not in rules.mesh_axes_used()]
        if unused:
            axes = ", ".join(f"{a}={mesh.shape[a]}" for a in unused)
            users = [n for n, r in STRATEGIES.items() if set(unused) <= r.mesh_axes_used()]
            raise ConfigError(
                f"the mesh has {axes} but strategy {rules.name!r} maps nothing onto it, so every device on that axis "
                f"would repeat the same work: use strategy {' or '.join(map(repr, users)) or 'another'} or set "
                f"{' and '.join(f'parallel.{a}=1' for a in unused)}"
            )
    return rules


def logical_to_spec(
    logical_axes: Sequence[str | None] | None,
    table: Sequence[tuple[str, MeshAxes]],
    mesh: Mesh | None = None,
    shape: Sequence[int] | None = None,
) -> P:
    """PartitionSpec for a tensor with these logical axes.

    A mesh axis is used at most once per tensor (the first logical dim that asks for it wins). Given the mesh and the
    tensor's shape, a dim that does not divide evenly over its mesh axes stays replicated instead of failing at compile
    time; `jaxperf.parallel.sharding.check_sharding` reports how far that leaves us from the ideal.
    """
    if logical_axes is None:
        return P()
    lookup = dict(table)
    used: set[str] = set()
    spec = []
    for i, name in enumerate(logical_axes):
        axes = lookup.get(name) if name is not None else None
        axes = _axes_tuple(axes)
        axes = tuple(a for a in axes if a not in used and (mesh is None or a in mesh.shape))
        if mesh is not None:
            axes = tuple(a for a in axes if mesh.shape[a] > 1)
        if mesh is not None and shape is not None and axes:
            size = 1
            for a in axes:
                size *= mesh.shape[a]
            if shape[i] % size:
                axes = ()
        used.update(axes)
        spec.append(axes[0] if len(axes) == 1 else (axes or None))
    while spec and spec[-1] is None:
        spec.pop()
    return P(*spec)


# --------------------------------------------------------------------------------------------------------------------
# Activation constraints: the step builder installs (mesh, rules) while tracing; models call `constrain`.

_ACTIVE: contextvars.ContextVar[tuple[Mesh, Rules] | None] = contextvars.ContextVar("jaxperf_rules", default=None)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh, rules: Rules):
    """Within this context `constrain(x, names)` pins activations to the mesh according to `rules`."""
    token = _ACTIVE.set((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def current() -> tuple[Mesh, Rules] | None:
    """The (mesh, rules) installed by `activation_sharding`, or None outside it."""
    return _ACTIVE.get()


def sequence_is_split() -> bool:
    """True inside `activation_sharding` on a mesh whose `seq` axis splits the sequence (context parallelism)."""
    active = _ACTIVE.get()
    return active is not None and active[0].shape.get("seq", 1) > 1


def activation_spec(logical_axes: Sequence[str | None], shape: Sequence[int] | None = None) -> P | None:
    """The PartitionSpec `constrain` would use for these names, or None outside `activation_sharding`."""
    active = _ACTIVE.get()
    if active is None:
        return None
    mesh, rules = active
    return logical_to_spec(logical_axes, rules.activations, mesh, shape)


def param_spec(logical_axes: Sequence[str | None], shape: Sequence[int] | None = None) -> P | None:
    """The PartitionSpec the installed rules place a parameter with these names by, or None outside
    `activation_sharding` (for code that takes a parameter into shard_map as it lies)."""
    active = _ACTIVE.get()
    if active is None:
        return None
    mesh, rules = active
    return logical_to_spec(logical_axes, rules.params, mesh, shape)


def gather_weight(w: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """A weight laid out as the activation rules place these names (under fsdp: whole on every device), its gradient
    sent straight back to the parameter's own sharding; a no-op outside `activation_sharding`.

    `constrain(w, names)` would gather the same way, but its transpose pins the weight's gradient to the gathered
    layout too: an all-reduce of the whole gradient, each device then keeping its shard. Here the backward constrains
    the gradient to the parameter's layout, which the partitioner reaches by a reduce-scatter. Left alone, the TPU
    compiler gathers an fsdp weight inside the matmul, one window at a time; `model.gather_mlp_weights` (on for TPU)
    gathers the MLP weights whole instead, which moves fewer bytes through HBM where the step is bound by it (llama2-7b
    on v6e:2x4 at 1 x 2048 per chip: predicted step 0.155 -> 0.125 s; docs/performance.md)."""
    layouts = _gather_layouts(w, logical_axes)
    return w if layouts is None else _gather_to(w, *layouts)


def gathers(w: jax.Array, logical_axes: Sequence[str | None]) -> bool:
    """Whether `gather_weight(w, logical_axes)` changes the weight's layout here (false outside `activation_sharding`
    and where the parameter already lies as the activation rules say, e.g. under `tp` or `dp`)."""
    return _gather_layouts(w, logical_axes) is not None


def _gather_layouts(w, logical_axes) -> tuple[NamedSharding, NamedSharding] | None:
    """(the activation rules' layout, the parameter's) of a weight with these names, or None where they agree."""
    active = _ACTIVE.get()
    if active is None:
        return None
    mesh, rules = active
    if len(logical_axes) != w.ndim:
        raise ValueError(f"gather_weight: {len(logical_axes)} names {tuple(logical_axes)} for a weight of shape "
                         f"{w.shape}")
    cmesh = _compat.context_mesh(mesh)
    gathered = NamedSharding(cmesh, logical_to_spec(logical_axes, rules.activations, mesh, w.shape))
    own = NamedSharding(cmesh, logical_to_spec(logical_axes, rules.params, mesh, w.shape))
    return None if gathered.spec == own.spec else (gathered, own)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather_to(w, gathered, own):
    return jax.lax.with_sharding_constraint(w, gathered)


def _gather_to_fwd(w, gathered, own):
    return _gather_to(w, gathered, own), None


def _gather_to_bwd(gathered, own, _, dw):
    return (jax.lax.with_sharding_constraint(dw, own),)


_gather_to.defvjp(_gather_to_fwd, _gather_to_bwd)


def cast_table_rows(rows: jax.Array, dtype, logical_axes: Sequence[str | None]) -> jax.Array:
    """Rows taken from a parameter table (`rows` [..., D], named `logical_axes`, the last the table's own D name) cast
    to `dtype`, their cotangent moved to the table's layout while still in `dtype` and only then cast back.

    Left to the partitioner, the backward of `take(table, ids).astype(bf16)` casts the bf16 cotangent to fp32 first and
    then sends it to where the table's D shard lies (under fsdp an all-to-all from the batch split to the D split),
    moving twice the bytes it needs to: 33 MB per chip instead of 16.5 for a 4096-wide model at 2,048 tokens a chip.
    Here the cotangent is resharded in `dtype`: the leading dims as the activation rules split them, less the mesh axes
    the table's D takes, D as the parameter rules split it. The values are the same (a cast commutes with a move); a
    plain cast outside `activation_sharding`, where the two layouts agree, and on a mesh with an `expert` axis (there
    the partitioner's own placement measured cheaper)."""
    rows = jnp.asarray(rows)
    target = _table_cotangent_sharding(logical_axes, rows.shape)
    if target is None:
        return rows.astype(dtype)
    return _cast_resharded(rows, jnp.dtype(dtype), target)


def _table_cotangent_sharding(logical_axes, shape) -> NamedSharding | None:
    active = _ACTIVE.get()
    if active is None:
        return None
    mesh, rules = active
    if mesh.shape.get("expert", 1) > 1:
        # the partitioner's own placement moved fewer bytes there (moe-tiny on expert=2 x fsdp=2, v5p:2x2x1: 6.73 MB
        # a step against 7.06 MB with this constraint, which added an all-to-all and a permute of the gradient)
        return None
    if len(logical_axes) != len(shape):
        raise ValueError(f"cast_table_rows: {len(logical_axes)} names {tuple(logical_axes)} for rows of shape {shape}")
    d_spec = logical_to_spec(logical_axes[-1:], rules.params, mesh, shape[-1:])
    d_axes = d_spec[0] if len(d_spec) else None
    taken = set(_axes_tuple(d_axes))
    if not taken:
        return None
    lead_table = tuple((name, tuple(a for a in _axes_tuple(axes) if a not in taken))
                       for name, axes in rules.activations)
    lead = tuple(logical_to_spec(logical_axes[:-1], lead_table, mesh, shape[:-1]))
    spec = P(*lead, *([None] * (len(shape) - 1 - len(lead))), d_axes)
    if spec == logical_to_spec(logical_axes, rules.activations, mesh, shape):
        return None
    return NamedSharding(_compat.context_mesh(mesh), spec)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _cast_resharded(rows, dtype, target):
    return rows.astype(dtype)


def _cast_resharded_fwd(rows, dtype, target):
    return rows.astype(dtype), jnp.zeros((), rows.dtype)


def _cast_resharded_bwd(dtype, target, like, g):
    return (jax.lax.with_sharding_constraint(g, target).astype(like.dtype),)


_cast_resharded.defvjp(_cast_resharded_fwd, _cast_resharded_bwd)


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """`with_sharding_constraint` by logical names; a no-op outside `activation_sharding` (e.g. eager calls)."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    if len(logical_axes) != x.ndim:
        raise ValueError(f"constrain: {len(logical_axes)} names {tuple(logical_axes)} for an array of shape {x.shape}")
    spec = logical_to_spec(logical_axes, rules.activations, mesh, x.shape)
    return jax.lax.with_sharding_constraint(x, NamedSharding(_compat.context_mesh(mesh), spec))
