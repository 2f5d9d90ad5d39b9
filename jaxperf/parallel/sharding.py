"""From logical axes to NamedShardings for whole pytrees, and the start-up check that things really are sharded."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxperf.parallel.mesh import describe
from jaxperf.parallel.rules import Rules, logical_to_spec


def tree_shardings(abstract: Any, logical_axes: Any, mesh: Mesh, rules: Rules) -> Any:
    """NamedShardings for a pytree of arrays/ShapeDtypeStructs given a matching pytree of logical-axis tuples."""
    return jax.tree.map(
        lambda x, axes: NamedSharding(mesh, logical_to_spec(axes, rules.params, mesh, x.shape)),
        abstract,
        logical_axes,
        is_leaf=lambda a: isinstance(a, tuple) or a is None,
    )


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, rules: Rules, ndim: int = 2) -> NamedSharding:
    """Sharding of a [batch, ...] input array: the batch dim over the data-parallel axes."""
    return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (ndim - 1), rules.activations, mesh))


def per_device_bytes(tree: Any) -> dict[jax.Device, int]:
    """Bytes each device holds for the arrays in `tree` (addressable shards only)."""
    out: dict[jax.Device, int] = {}
    for leaf in jax.tree.leaves(tree):
        if not isinstance(leaf, jax.Array):
            continue
        for shard in leaf.addressable_shards:
            out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return out


def check_sharding(named_trees: Mapping[str, Any], mesh: Mesh, expected_factor: Mapping[str, int] | None = None) -> dict:
    """Compare bytes per device with the ideal, for each tree (e.g. params, opt_state).

    `expected_factor[name]` is how many devices each tree should be split over (the product of the mesh axes the
    strategy uses for weights). Returns {name: {"total", "max_per_device", "expected_per_device", "ratio"}}; a ratio
    well above 1 means something is less sharded than the strategy says (a rule that did not apply).
    """
    report = {}
    for name, tree in named_trees.items():
        total = sum(x.nbytes for x in jax.tree.leaves(tree) if isinstance(x, jax.Array))
        per_dev = per_device_bytes(tree)
        worst = max(per_dev.values()) if per_dev else 0
        factor = (expected_factor or {}).get(name, 1)
        expected = total / factor if factor else total
        report[name] = {
            "total_bytes": int(total),
            "max_bytes_per_device": int(worst),
            "expected_bytes_per_device": int(expected),
            "ideal_bytes_per_device": int(total / mesh.devices.size),
            "ratio_to_expected": (worst / expected) if expected else 1.0,
        }
    return report


def device_memory_line(device: jax.Device | None = None) -> str | None:
    """'in use X GiB of Y GiB' from the runtime, where the platform reports it (GPU/TPU; not CPU)."""
    device = device or jax.local_devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - platforms without memory stats raise various errors
        stats = None
    if not stats or "bytes_in_use" not in stats:
        return None
    limit = stats.get("bytes_limit")
    used = stats["bytes_in_use"] / 2**30
    return f"{device}: {used:.2f} GiB in use" + (f" of {limit / 2**30:.2f} GiB" if limit else "")


def format_report(report: dict, mesh: Mesh) -> str:
    lines = [describe(mesh)]
    for name, r in report.items():
        lines.append(
            f"  {name:<10} total {r['total_bytes'] / 2**20:9.2f} MiB | per device {r['max_bytes_per_device'] / 2**20:8.2f}"
            f" MiB (expected {r['expected_bytes_per_device'] / 2**20:.2f}, ideal {r['ideal_bytes_per_device'] / 2**20:.2f})"
        )
    mem = device_memory_line()
    if mem:
        lines.append(f"  device memory: {mem}")
    return "\n".join(lines)
