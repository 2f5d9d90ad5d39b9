"""Training: the sharded step builder, the optimizer, the trainer loop and checkpoints."""

from jaxperf.train.checkpoint import Checkpointer
from jaxperf.train.explicit import FlavouredStep, build_train_step, check_flavour, pmap_train_step, shard_map_train_step
from jaxperf.train.optimizer import lr_schedule, make_optimizer
from jaxperf.train.step import Task, TrainState, decay_mask, next_token_loss
from jaxperf.train.trainer import Trainer

__all__ = [
    "Checkpointer", "FlavouredStep", "Task", "TrainState", "Trainer", "build_train_step", "check_flavour", "decay_mask",
    "lr_schedule", "make_optimizer", "next_token_loss", "pmap_train_step", "shard_map_train_step",
]
