"""`jaxperf compile --topology`: the train step compiled for a TPU slice on this CPU machine (needs libtpu).

libtpu is found either in the test environment or in a directory named by JAXPERF_LIBTPU_PATH (a `pip install
--target` of the libtpu wheel), which is put on the subprocess's PYTHONPATH. Without it the compile test is skipped
with the reason, and the error a user without libtpu gets is checked instead.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

LIBTPU_PATH = os.environ.get("JAXPERF_LIBTPU_PATH", "/tmp/libtpu_pkg")
HAVE_LIBTPU = importlib.util.find_spec("libtpu") is not None or (Path(LIBTPU_PATH) / "libtpu").is_dir()


def _compile(args, *, libtpu: bool, timeout=600):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    if libtpu and importlib.util.find_spec("libtpu") is None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (LIBTPU_PATH, env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "jaxperf.cli", "compile", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_LIBTPU, reason="libtpu is not installed (pip install 'jax[tpu]', or set "
                                            "JAXPERF_LIBTPU_PATH to a directory holding it)")
def test_compile_for_a_v5p_slice_reports_memory_and_flops_per_chip():
    common = ["model.d_model=256", "model.n_layers=2", "model.n_heads=4", "batch_size=16"]
    fsdp = _compile(["--topology", "v5p:2x2x1", "--json", *common], libtpu=True)
    assert fsdp.returncode == 0, fsdp.stderr[-3000:]
    r = json.loads(fsdp.stdout.strip().splitlines()[-1])
    assert r["chips"] == 4 and r["mesh"] == {"data": 1, "stage": 1, "fsdp": 4, "seq": 1, "tensor": 1}
    assert "v5" in r["device_kind"].lower() and r["hbm_bytes"] == 95 * 2**30 and r["fits"] is True
    b = r["bytes_per_chip"]
    assert 0 < b["arguments"] and 0 < b["temp"] and b["total"] < r["hbm_bytes"]
    assert r["flops_per_chip"] > 0
    p = r["prediction"]  # the step time read off the compiled program (jaxperf.perf.predict)
    assert r["predicted_step_s"] == p["step_s"] == max(p["compute_s"], p["hbm_s"], p["collective_s"]) > 0
    assert 0 < r["predicted_mfu"] <= r["model_flops_per_chip"] / r["flops_per_chip"] + 1e-9
    assert p["collectives"]["all-gather"]["ops"] > 0 and not p["unknown_trip_counts"]  # fsdp gathers the weights
    assert p["hbm_bytes"] > b["arguments"]  # every weight and optimizer state is read at least once
    # The same run with the batch and the weights replicated (dp on one chip's worth of work per chip is the same
    # batch slice, but the parameters and Adam state are no longer split four ways): more argument bytes per chip.
    dp = _compile(["--topology", "v5p:2x2x1", "--json", *common, "strategy=dp", "data=4", "fsdp=1"], libtpu=True)
    assert dp.returncode == 0, dp.stderr[-3000:]
    rd = json.loads(dp.stdout.strip().splitlines()[-1])
    assert rd["bytes_per_chip"]["arguments"] > 2 * b["arguments"], (rd["bytes_per_chip"], b)


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_LIBTPU, reason="libtpu is not installed (pip install 'jax[tpu]', or set "
                                            "JAXPERF_LIBTPU_PATH to a directory holding it)")
def test_compile_for_two_slices_keeps_fsdp_inside_a_slice():
    out = _compile(["--topology", "v5p:2x2x1", "--slices", "2", "--json", "model.d_model=128", "model.n_layers=2",
                    "model.n_heads=4", "batch_size=16"], libtpu=True)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["chips"] == 8 and r["slices"] == 2
    assert r["mesh"] == {"data": 2, "stage": 1, "fsdp": 4, "seq": 1, "tensor": 1}
    assert r["slices_per_data_index"] == [[0], [1]]  # each fsdp group is one slice; only data crosses DCN


@pytest.mark.skipif(HAVE_LIBTPU, reason="libtpu is installed here; the missing-libtpu message cannot be seen")
def test_compile_without_libtpu_says_how_to_install_it():
    out = _compile(["--topology", "v5p:2x2x1"], libtpu=False, timeout=120)
    assert out.returncode == 2
    assert "needs libtpu" in out.stderr and "pip install 'jax[tpu]'" in out.stderr, out.stderr


def test_compile_rejects_a_malformed_topology_before_anything_else():
    out = _compile(["--topology", "v5p"], libtpu=False, timeout=120)
    assert out.returncode == 2 and "should look like v5p:4x4x4" in out.stderr, out.stderr


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_LIBTPU, reason="libtpu is not installed (pip install 'jax[tpu]', or set "
                                            "JAXPERF_LIBTPU_PATH to a directory holding it)")
def test_compile_a_four_axis_mesh_for_a_v5p_slice():
    """data x stage x fsdp x seq on 16 chips: the pipeline and the ring compile for TPU, the 4-D step needs fewer
    temporary bytes per chip than data x fsdp (one microbatch of half the sequence at a time), and the estimate made
    before compiling stays near XLA's figure."""
    common = ["--topology", "v5p:2x2x4", "--json", "--preset", "gpt2-small", "model.n_layers=4", "batch_size=32"]
    runs = {}
    for name, mesh in (("plain", ["data=4", "fsdp=4"]),
                       ("4d", ["data=2", "stage=2", "fsdp=2", "seq=2", "microbatches=4"])):
        out = _compile([*common, *mesh], libtpu=True)
        assert out.returncode == 0, out.stderr[-3000:]
        runs[name] = json.loads(out.stdout.strip().splitlines()[-1])
    r = runs["4d"]
    assert r["chips"] == 16 and r["mesh"] == {"data": 2, "stage": 2, "fsdp": 2, "seq": 2, "tensor": 1}
    b, plain = r["bytes_per_chip"], runs["plain"]["bytes_per_chip"]
    assert b["temp"] < 0.8 * plain["temp"], (b, plain)
    assert abs(r["estimated_bytes_per_chip"] / b["total"] - 1) < 0.25, r
