"""Parallelism: the device mesh, logical-axis rule tables per strategy, and sharding checks."""

from jaxperf.parallel.collectives import (
    ALL_REDUCES, LinkModel, all_gather_matmul, bidirectional_ring_all_reduce, bus_bandwidth, fit_link,
    halving_doubling_all_reduce, matmul_reduce_scatter, predict, ring_all_gather, ring_all_reduce, ring_reduce_scatter,
)
from jaxperf.parallel.pipeline import bubble_fraction, gpipe, pipeline_loss
from jaxperf.parallel.ring_attention import ring_attention, ring_attention_sharded
from jaxperf.parallel.mesh import MESH_AXES, describe, make_mesh, mesh_shape
from jaxperf.parallel.rules import (
    STRATEGIES, Rules, activation_sharding, constrain, explicit_tensor_parallel, get_rules, logical_to_spec,
    row_parallel_reduce,
)
from jaxperf.parallel.sharding import batch_sharding, check_sharding, tree_shardings

__all__ = [
    "MESH_AXES", "STRATEGIES", "Rules", "activation_sharding", "batch_sharding", "check_sharding", "constrain",
    "describe", "explicit_tensor_parallel", "get_rules", "logical_to_spec", "make_mesh", "mesh_shape",
    "row_parallel_reduce", "tree_shardings",
    # collectives
    "ALL_REDUCES", "LinkModel", "all_gather_matmul", "bidirectional_ring_all_reduce", "bus_bandwidth", "fit_link",
    "halving_doubling_all_reduce", "matmul_reduce_scatter", "predict", "ring_all_gather", "ring_all_reduce",
    "ring_reduce_scatter",
    # pipeline and sequence parallelism
    "bubble_fraction", "gpipe", "pipeline_loss", "ring_attention", "ring_attention_sharded",
]
