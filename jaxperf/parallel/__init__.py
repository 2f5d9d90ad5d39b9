"""Parallelism: the device mesh, logical-axis rule tables per strategy, sharding checks, the pipeline and ring
attention, collective matmuls and multi-process start-up."""

from jaxperf.parallel.collective_matmul import all_gather_matmul, matmul_reduce_scatter
from jaxperf.parallel.mesh import MESH_AXES, describe, make_mesh, mesh_shape
from jaxperf.parallel.pipeline import bubble_fraction, gpipe
from jaxperf.parallel.ring_attention import ring_attention, ring_attention_sharded
from jaxperf.parallel.rules import STRATEGIES, Rules, activation_sharding, constrain, get_rules, logical_to_spec
from jaxperf.parallel.sharding import batch_sharding, check_sharding, tree_shardings

__all__ = [
    "MESH_AXES", "STRATEGIES", "Rules", "activation_sharding", "all_gather_matmul", "batch_sharding",
    "bubble_fraction", "check_sharding", "constrain", "describe", "get_rules", "gpipe",
    "logical_to_spec", "make_mesh", "matmul_reduce_scatter", "mesh_shape", "ring_attention", "ring_attention_sharded",
    "tree_shardings",
]
