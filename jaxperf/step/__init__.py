"""The one train step: a model placed on a mesh by a rule table (Task), its optimizer and its numerical health."""

from jaxperf.step.flavours import FlavouredStep, build_train_step, check_flavour, register_flavour
from jaxperf.step.health import HealthOptions
from jaxperf.step.optimizer import lr_schedule, make_optimizer, with_router_bias
from jaxperf.step.task import (
    LossFn, Task, TrainState, build_task, decay_mask, finish_step, next_token_loss, platform_of, step_microbatches,
)

__all__ = [
    "FlavouredStep", "build_train_step", "check_flavour", "register_flavour",
    "HealthOptions", "LossFn", "Task", "TrainState", "build_task", "decay_mask", "finish_step", "lr_schedule",
    "make_optimizer", "next_token_loss", "platform_of", "step_microbatches", "with_router_bias",
]
