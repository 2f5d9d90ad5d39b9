"""Implementations of jaxperf's models in other frameworks, run as subprocesses by the benchmarks for comparison.

Each peer is a script that imports only its own framework (it may run in an interpreter without jax), takes a JSON
config on the command line and prints one JSON line with its figures.
"""
