"""jaxperf: fast, correctly sharded Transformer training in JAX/Flax NNX."""

__version__ = "0.1.0"
