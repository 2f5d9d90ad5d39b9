"""Choices a model config leaves to the platform its step is compiled for.

    model_cfg = for_platform(cfg.model, "cpu")

The platform is that of the mesh's devices (jaxperf.step.task.platform_of), not of the host: a TPU topology described
on a CPU machine compiles TPU programs. Model code never asks which backend it runs on; `build_task` settles these
fields once, here.

| field | None becomes |
|---|---|
| matmul_grad_barrier | True on CPU (XLA:CPU fuses elementwise gradients into transposing copies), False elsewhere |
"""

from __future__ import annotations

import dataclasses

from jaxperf.config import ModelConfig

PLATFORMS = ("cpu", "gpu", "tpu")


def for_platform(cfg: ModelConfig, platform: str) -> ModelConfig:
    """`cfg` with every platform-dependent field that is None set for `platform` ("cpu", "gpu" or "tpu")."""
    if platform not in PLATFORMS:
        raise ValueError(f"unknown platform {platform!r}; expected one of {PLATFORMS}")
    changes = {}
    if cfg.matmul_grad_barrier is None:
        changes["matmul_grad_barrier"] = platform == "cpu"
    return dataclasses.replace(cfg, **changes) if changes else cfg
