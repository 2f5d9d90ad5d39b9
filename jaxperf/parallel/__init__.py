"""Parallelism: the device mesh, logical-axis rule tables per strategy, and sharding checks."""

from jaxperf.parallel.mesh import MESH_AXES, describe, make_mesh, mesh_shape
from jaxperf.parallel.rules import STRATEGIES, Rules, activation_sharding, constrain, get_rules, logical_to_spec
from jaxperf.parallel.sharding import batch_sharding, check_sharding, tree_shardings

__all__ = [
    "MESH_AXES", "STRATEGIES", "Rules", "activation_sharding", "batch_sharding", "check_sharding", "constrain",
    "describe", "get_rules", "logical_to_spec", "make_mesh", "mesh_shape", "tree_shardings",
]
