"""Configuration: typed frozen dataclasses, presets, `key=value` overrides and validation before anything compiles.

    cfg = get_config("tiny", ["max_steps=20", "model.d_model=64", "lr=1e-3"])

schema (the dataclasses) -> overrides (the parser) -> presets (named configs) and validate (the checks). A key is a
dotted path (`model.n_layers`) or a bare field name that is unique across sections (`n_layers`, `max_steps`); an
unknown key or a value of the wrong type raises `ConfigError` naming the key and the closest valid ones.
"""

from jaxperf.config.overrides import apply_overrides, parse_overrides
from jaxperf.config.presets import DEFAULT_PRESET, PRESETS, get_config, register_preset
from jaxperf.config.schema import (
    REMAT_NAMES, SECTIONS, ConfigError, DataConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig, from_dict, to_dict,
)
from jaxperf.config.validate import FLAVOURS, MESH_AXES, mesh_shape, validate, validate_flavour, validate_model

__all__ = [
    "DEFAULT_PRESET", "FLAVOURS", "MESH_AXES", "PRESETS", "REMAT_NAMES", "SECTIONS", "ConfigError", "DataConfig", "ModelConfig",
    "OptimConfig", "ParallelConfig", "TrainConfig", "apply_overrides", "from_dict", "get_config", "mesh_shape",
    "parse_overrides", "register_preset", "to_dict", "validate", "validate_flavour", "validate_model",
]
