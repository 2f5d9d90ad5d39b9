"""Training runs: the Trainer loop, its checkpoints, starting from existing weights (`init_from`) and exporting them
again (`export_run`), and compiling a run's step for a TPU slice."""

from jaxperf.checkpoint import Checkpointer
from jaxperf.train.pretrained import export_run
from jaxperf.train.trainer import Trainer

__all__ = ["Checkpointer", "Trainer", "export_run"]
