"""How the one train step is written: `parallel.flavour` names a builder registered here, and every run gets its
step from `build_train_step`.

    step = build_train_step(task, task.loss_fn, cfg.parallel.flavour, microbatches=2)
    state = step.to_step(task.init_state())        # the identity except for pmap
    state, metrics = step(state, batch)            # batch placed with task.batch_sharding()
    state = step.from_step(state)                  # back to task.state_shardings(), e.g. for a checkpoint

`jit` (GSPMD: XLA derives every collective from the rule table's shardings) is registered here. jaxperf.explicit
registers `shard_map` and `pmap`, the same step with its collectives written by hand, when the `jaxperf` package is
imported; the names are those of `jaxperf.config.FLAVOURS`. A flavour is a builder and a check that refuses, before
anything compiles, what it cannot run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jaxperf.config import FLAVOURS, ConfigError
from jaxperf.step.task import LossFn, Task, TrainState


def _identity(x):
    return x


@dataclass(frozen=True)
class FlavouredStep:
    """A train step and the conversions at its boundary; `step(state, batch) -> (state, metrics)`.

    `to_step` turns a state laid out by `task.state_shardings()` into the step's own layout and `from_step` turns it
    back (both the identity for jit and shard_map, whose states are laid out exactly like the jit step's). Batches and
    metrics keep the jit step's form on the outside.
    """

    flavour: str
    fn: Callable
    to_step: Callable[[TrainState], Any] = _identity
    from_step: Callable[[Any], TrainState] = _identity
    prepare_batch: Callable[[Any], Any] = _identity
    finish_metrics: Callable[[Any], Any] = _identity

    def __call__(self, state, batch):
        state, metrics = self.fn(state, self.prepare_batch(batch))
        return state, self.finish_metrics(metrics)


@dataclass(frozen=True)
class Flavour:
    """A registered way to write the step: `build(task, loss_fn, *, microbatches, schedule, donate, **options)` and
    `check(task)`, which raises ConfigError for what it cannot run; `options` are the keyword options it takes beyond
    those (e.g. "overlap_grad_reduce")."""

    build: Callable[..., FlavouredStep]
    check: Callable[[Task], None]
    options: frozenset[str] = frozenset()


_REGISTRY: dict[str, Flavour] = {}


def register_flavour(name: str, build: Callable[..., FlavouredStep], check: Callable[[Task], None] = lambda task: None,
                     *, options: tuple[str, ...] = ()) -> None:
    """Make `parallel.flavour=name` build its step with `build` after `check` (see `Flavour`)."""
    if name not in FLAVOURS:
        raise ValueError(f"flavour {name!r} is not one of jaxperf.config.FLAVOURS {FLAVOURS}: add it to the Flavour "
                         "Literal in jaxperf/config/schema.py first")
    _REGISTRY[name] = Flavour(build, check, frozenset(options))


def registered_flavours() -> list[str]:
    return list(_REGISTRY)


def _flavour(name: str) -> Flavour:
    if name not in FLAVOURS:
        raise ConfigError(f"unknown parallel.flavour {name!r}; choose one of {', '.join(FLAVOURS)}")
    if name not in _REGISTRY:
        raise ConfigError(f"parallel.flavour={name} has no step builder registered: import jaxperf (its package "
                          "registers shard_map and pmap from jaxperf.explicit)")
    return _REGISTRY[name]


def check_flavour(flavour: str, task: Task) -> None:
    """Raise ConfigError, before anything compiles, when `flavour` cannot run the task's rule table on its mesh."""
    _flavour(flavour).check(task)


def build_train_step(task: Task, loss_fn: LossFn, flavour: str = "jit", *, microbatches: int = 1, schedule=None,
                     donate: bool = True, overlap_grad_reduce: bool = False) -> FlavouredStep:
    """The train step of `flavour` (jit | shard_map | pmap) for `task`, checked before anything compiles.

    `overlap_grad_reduce` (shard_map only) all-reduces each layer's gradients inside the backward pass; under jit
    XLA schedules the gradient all-reduces itself (and overlaps them with the backward where the backend runs
    collectives asynchronously)."""
    spec = _flavour(flavour)
    spec.check(task)
    options = {}
    if overlap_grad_reduce:
        if "overlap_grad_reduce" not in spec.options:
            raise ConfigError(f"parallel.overlap_grad_reduce is a shard_map option (the step names its collectives); "
                              f"flavour={flavour} does not take it: set parallel.flavour=shard_map strategy=dp")
        options["overlap_grad_reduce"] = True
    return spec.build(task, loss_fn, microbatches=microbatches, schedule=schedule, donate=donate, **options)


def _jit_step(task: Task, loss_fn: LossFn, *, microbatches: int, schedule, donate: bool) -> FlavouredStep:
    return FlavouredStep("jit", task.train_step(loss_fn, microbatches=microbatches, schedule=schedule, donate=donate))


register_flavour("jit", _jit_step)
