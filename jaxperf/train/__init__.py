"""Training runs: the Trainer loop, its checkpoints, and compiling a run's step for a TPU slice."""

from jaxperf.train.checkpoint import Checkpointer
from jaxperf.train.trainer import Trainer

__all__ = ["Checkpointer", "Trainer"]
