"""jaxperf's benchmark suite, installed as `jaxperf.benchmarks`: one script per question, JSON lines out.

`run.py` is the runner behind `jaxperf bench`; `_common.py` holds the record format every script emits; `peers/`
holds implementations in other frameworks that some scripts compare with. Each `bench_<name>.py` runs alone
(`python benchmarks/bench_<name>.py --tiny` or `python -m jaxperf.benchmarks.bench_<name>`) and has
`main(argv) -> list[dict]` for the runner.
"""
