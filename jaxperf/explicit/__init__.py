"""The same train step with its collectives written out by hand, and the classic collectives themselves.

`parallel.flavour` picks how the one step is written: `jit` (jaxperf.step, XLA derives every collective) or, from this
package, `shard_map` and `pmap` (jaxperf.explicit.flavours), each checked against the jit step. Beside them: ring,
bidirectional-ring and halving-doubling all-reduces spelled out as `ppermute` steps (collectives) and an alpha-beta
cost model that predicts their time (cost_model). Read these to see what GSPMD does for you; train with `jit`
unless you want to change a collective.
"""

from jaxperf.explicit.collectives import (
    ALL_REDUCES, bidirectional_ring_all_reduce, halving_doubling_all_reduce, ring_all_gather, ring_all_reduce,
    ring_reduce_scatter,
)
from jaxperf.explicit.cost_model import LinkModel, bus_bandwidth, cost_terms, fit_link, predict
from jaxperf.explicit.flavours import (
    FlavouredStep, build_train_step, check_flavour, pmap_train_step, shard_map_train_step,
)

__all__ = [
    "ALL_REDUCES", "FlavouredStep", "LinkModel", "bidirectional_ring_all_reduce", "build_train_step", "bus_bandwidth",
    "check_flavour", "cost_terms", "fit_link", "halving_doubling_all_reduce", "pmap_train_step", "predict",
    "ring_all_gather", "ring_all_reduce", "ring_reduce_scatter", "shard_map_train_step",
]
