"""jaxperf: fast, correctly sharded Transformer training in JAX/Flax NNX.

    from jaxperf import get_config, Trainer
    Trainer(get_config("tiny", ["max_steps=100"])).fit()
"""

__version__ = "0.1.0"

from jaxperf.config import ConfigError, TrainConfig, get_config  # noqa: E402
from jaxperf.models import GPT  # noqa: E402
from jaxperf.step import Task, build_task  # noqa: E402
from jaxperf.train import Trainer  # noqa: E402

# Registers the shard_map and pmap step flavours with jaxperf.step.flavours (parallel.flavour).
import jaxperf.explicit  # noqa: E402, F401

__all__ = ["ConfigError", "GPT", "Task", "TrainConfig", "Trainer", "build_task", "get_config", "__version__"]
