"""Pallas kernels for jaxperf's hot ops. Each op lives in its own module with a pure-jnp reference beside it."""
