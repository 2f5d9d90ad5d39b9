"""The device mesh: axes `data`, `fsdp`, `tensor` with sizes from config (-1 = the rest of the devices)."""

from __future__ import annotations

import math

import jax
from jax.sharding import Mesh

from jaxperf import _compat
from jaxperf.config import ConfigError, ParallelConfig

MESH_AXES = ("data", "fsdp", "tensor")


def mesh_shape(parallel: ParallelConfig, num_devices: int) -> dict[str, int]:
    """Resolve the axis sizes (one may be -1) against a device count, or raise ConfigError with the fix."""
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


def make_mesh(parallel: ParallelConfig, devices: list[jax.Device] | None = None) -> Mesh:
    """Build the mesh for `parallel` over `devices` (default: all devices, in physical-topology order).

    A mesh smaller than the device count uses the first devices (useful for tests and for debugging on a slice).
    """
    devices = list(jax.devices()) if devices is None else list(devices)
    sizes = mesh_shape(parallel, len(devices))
    n = math.prod(sizes.values())
    shape = tuple(sizes[a] for a in MESH_AXES)
    if n == len(jax.devices()) and devices == list(jax.devices()):
        return _compat.make_mesh(shape, MESH_AXES)
    return _compat.make_mesh(shape, MESH_AXES, devices=devices[:n])


def describe(mesh: Mesh) -> str:
    """One line, e.g. `mesh data=1 fsdp=4 tensor=2 (8 x cpu)`."""
    axes = " ".join(f"{a}={s}" for a, s in mesh.shape.items())
    kind = {d.device_kind for d in mesh.devices.flat}
    return f"mesh {axes} ({mesh.devices.size} x {'/'.join(sorted(kind))})"
