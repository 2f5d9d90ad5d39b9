"""Training: the sharded step builder, the optimizer, the trainer loop and checkpoints."""

from jaxperf.train.checkpoint import Checkpointer
from jaxperf.train.optimizer import lr_schedule, make_optimizer
from jaxperf.train.step import Task, TrainState, decay_mask, next_token_loss
from jaxperf.train.trainer import Trainer

__all__ = [
    "Checkpointer", "Task", "TrainState", "Trainer", "decay_mask", "lr_schedule", "make_optimizer", "next_token_loss",
]
