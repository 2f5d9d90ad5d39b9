"""The device mesh: axes `data`, `fsdp`, `tensor` with sizes from config (-1 = the rest of the devices).

With `parallel.dcn_data = S > 1` (a multi-slice TPU job: S slices joined by the data-center network) the sizes
describe one slice and the `data` axis is S times longer, slice-major: `fsdp` and `tensor` collectives stay inside a
slice on the fast interconnect (ICI) and only the data-parallel gradient reduction crosses slices. The device grid
comes from JAX's hybrid mesh builder, which groups devices by their `slice_index`.
"""

from __future__ import annotations

import math

import jax
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from jaxperf import _compat
from jaxperf.config import MESH_AXES, ConfigError, ParallelConfig, mesh_shape

def make_mesh(parallel: ParallelConfig, devices: list[jax.Device] | None = None) -> Mesh:
    """Build the mesh for `parallel` over `devices` (default: all devices, in physical-topology order).

    A mesh smaller than the device count uses the first devices (useful for tests and for debugging on a slice).
    """
    devices = list(jax.devices()) if devices is None else list(devices)
    sizes = mesh_shape(parallel, len(devices))
    n = math.prod(sizes.values())
    shape = tuple(sizes[a] for a in MESH_AXES)
    slices = int(getattr(parallel, "dcn_data", 1))
    if slices > 1:
        return _hybrid_mesh(shape, slices, devices[:n] if n < len(devices) else devices)
    if n == len(jax.devices()) and devices == list(jax.devices()):
        return _compat.make_mesh(shape, MESH_AXES)
    return _compat.make_mesh(shape, MESH_AXES, devices=physical_order(shape, devices[:n]))


def physical_order(shape: tuple[int, ...], devices: list[jax.Device]) -> list[jax.Device]:
    """`devices` in the order that lays the mesh axes of `shape` along a TPU slice's ICI links, as `jax.make_mesh`
    lays out the attached devices (`mesh_utils.create_device_mesh`); other devices, and TPU devices that do not form
    a whole slice (or that it cannot lay out), in their given order.

    A described slice (`jaxperf compile --topology`) lists its chips in libtpu's order, which walks 2 x 2 blocks: a
    mesh axis in that order does not run along the slice's physical axes one after the other. Over 64 v5p chips the
    TPU compiler then ran every fsdp all-gather as an all-reduce of a zeroed full-size buffer, even with the torus
    described (`jaxperf.train.topology.topology_wrap`): a program the same run on the attached slice does not get.
    """
    if not devices or devices[0].platform != "tpu":
        return devices
    try:
        return list(mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True).flat)
    except (ValueError, NotImplementedError, AssertionError, KeyError):
        return devices


def _hybrid_mesh(shape: tuple[int, ...], slices: int, devices: list) -> Mesh:
    """The mesh with `data` split as (slices x per-slice data), devices grouped by slice_index."""
    found = sorted({getattr(d, "slice_index", None) for d in devices}, key=str)
    if None in found or len(found) != slices:
        raise ConfigError(
            f"parallel.dcn_data={slices} needs devices from {slices} slices, but these devices come from "
            f"{'no slice (they have no slice_index)' if None in found else f'{len(found)} slice(s)'}: use "
            f"dcn_data=1 on a single slice, or set it to the number of slices of the job")
    ici = (shape[0] // slices, *shape[1:])
    grid = mesh_utils.create_hybrid_device_mesh(ici, (slices,) + (1,) * (len(shape) - 1), devices)
    return _compat.make_mesh(shape, MESH_AXES, devices=list(grid.flat))


def describe(mesh: Mesh) -> str:
    """One line, e.g. `mesh data=1 fsdp=4 tensor=2 (8 x cpu)`."""
    axes = " ".join(f"{a}={s}" for a, s in mesh.shape.items())
    kind = {d.device_kind for d in mesh.devices.flat}
    return f"mesh {axes} ({mesh.devices.size} x {'/'.join(sorted(kind))})"


# ---------------------------------------------------------------------------------------------------------------------
# The platform a program is compiled for: that of the mesh's devices, not of the host (a TPU topology described on a
# CPU machine compiles TPU programs). jaxperf.models.platform.settle writes it into the model config.


def normalize_platform(name: str) -> str:
    """"cpu", "gpu" or "tpu" for a jax platform or backend name ("cuda" and "rocm" are "gpu")."""
    name = name.lower()
    return "gpu" if name in ("cuda", "rocm") else name


def platform_of(mesh: Mesh) -> str:
    """The platform of the mesh's devices ("cpu", "gpu", "tpu")."""
    return normalize_platform(mesh.devices.flat[0].platform)
