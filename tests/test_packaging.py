"""The wheel carries everything a user runs: the library, the kernels and the benchmark suite (`jaxperf bench`)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_jaxperf_bench_runs_from_an_installed_wheel(tmp_path):
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(tmp_path / "dist"), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    wheel = next((tmp_path / "dist").glob("jaxperf-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "jaxperf/benchmarks/run.py" in names and "jaxperf/benchmarks/bench_async_dispatch.py" in names
    assert "pallas_kernels/flash_attention/_tpu.py" in names and "jaxperf/cli/__main__.py" in names
    site = tmp_path / "site"
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                                str(wheel)], capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr[-2000:]
    # Run from an unrelated folder with the installed copy first on the path: nothing may come from the checkout.
    env = {**os.environ, "PYTHONPATH": str(site), "JAX_PLATFORMS": "cpu", "JAXPERF_HUGE_PAGES": "0"}
    env.pop("XLA_FLAGS", None)
    where = subprocess.run([sys.executable, "-c", "import jaxperf.benchmarks.run as r; print(r.__file__)"],
                           capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert where.stdout.strip().startswith(str(site)), where.stdout + where.stderr
    out = tmp_path / "results"
    bench = subprocess.run([sys.executable, "-m", "jaxperf.cli", "bench", "--tiny", "async_dispatch", "--out",
                            str(out)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert bench.returncode == 0, bench.stdout[-2000:] + bench.stderr[-2000:]
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert records and all(r["benchmark"] == "async_dispatch" and "error" not in r for r in records), records


def test_the_readme_stays_a_guide():
    """A user reads the README in ten minutes: at most 150 lines; depth and dated figures live in docs/ and
    benchmarks/RESULTS.md, and every document it links to exists."""
    root = Path(__file__).resolve().parents[1]
    text = (root / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        assert (root / link).exists(), link
