"""`python -m jaxperf.cli ...` is the `jaxperf` command."""

from jaxperf.cli import run

run()
