"""Every difference between the JAX / Flax versions we support (jax 0.10.2 to 0.12, flax >= 0.12) lives here."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

try:  # jax >= 0.6 exposes axis types at the top level of jax.sharding.
    from jax.sharding import AxisType
except ImportError:  # pragma: no cover - older jax
    AxisType = None

# Flax stores the logical axis names of a Variable under a metadata key that was renamed over time.
_LOGICAL_AXES_KEYS = ("out_sharding", "sharding_names", "sharding")


def make_mesh(shape: Sequence[int], names: Sequence[str], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with Auto (GSPMD) axes laid out along the physical topology where JAX knows it.

    `jax.make_mesh` defaults to Explicit axes since jax 0.10; jaxperf's jit steps rely on sharding propagation, so axes
    are Auto everywhere.
    """
    shape, names = tuple(int(s) for s in shape), tuple(names)
    kwargs = {"axis_types": (AxisType.Auto,) * len(names)} if AxisType is not None else {}
    if devices is None:
        return jax.make_mesh(shape, names, **kwargs)
    grid = np.asarray(list(devices), dtype=object).reshape(shape)
    return Mesh(grid, names, **kwargs)


def set_mesh(mesh: Mesh):
    """Context manager that makes `mesh` the ambient mesh (`jax.set_mesh` where it exists)."""
    if hasattr(jax, "set_mesh"):
        return jax.set_mesh(mesh)
    return mesh  # pragma: no cover - older jax: `with mesh:`


def context_mesh(mesh: Mesh):
    """The mesh to name shardings with while tracing: inside a region where some mesh axes are manual (a shard_map
    over part of the mesh, such as a pipeline stage) the context's abstract mesh, else `mesh`."""
    get = getattr(jax.sharding, "get_abstract_mesh", None)
    ctx = get() if get is not None else None
    if ctx is None or getattr(ctx, "empty", True) or AxisType is None:
        return mesh
    if any(t == AxisType.Manual for t in getattr(ctx, "axis_types", ())) and tuple(ctx.shape) == tuple(mesh.shape):
        return ctx
    return mesh


def variable_logical_axes(variable) -> tuple[str | None, ...] | None:
    """The logical axis names a Flax NNX Variable was annotated with (`nnx.with_partitioning`), or None."""
    meta = variable.get_metadata() if hasattr(variable, "get_metadata") else {}
    for key in _LOGICAL_AXES_KEYS:
        axes = meta.get(key)
        if axes is not None:
            return tuple(axes)
    return None


def no_eager_sharding():
    """Build NNX modules without Flax's eager sharding: jaxperf places parameters itself through jit out_shardings."""
    if hasattr(nnx, "use_eager_sharding"):
        return nnx.use_eager_sharding(False)
    return contextlib.nullcontext()  # pragma: no cover - flax without eager sharding


def variable_value(variable):
    """The array held by an NNX Variable (`.value` access is deprecated in flax 0.12)."""
    if hasattr(variable, "get_value"):
        return variable.get_value()
    return variable.value  # pragma: no cover


def shard_map(f, *, mesh: Mesh, in_specs, out_specs, check_vma: bool = True, axis_names=None):
    """`jax.shard_map` (jax >= 0.7); the experimental one with `check_rep` before that. `axis_names` makes only those
    mesh axes manual (the others stay with the automatic partitioner)."""
    if hasattr(jax, "shard_map"):
        kwargs = {"axis_names": set(axis_names)} if axis_names is not None else {}
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma, **kwargs)
    from jax.experimental.shard_map import shard_map as _sm  # pragma: no cover

    return _sm(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=check_vma)  # pragma: no cover


def varying_axes(x) -> frozenset:
    """The mesh axes a value inside shard_map varies over (its `vma`; jax 0.10 names it `manual_axis_type`)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", ()) or ())
