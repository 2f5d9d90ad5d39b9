"""Test set-up: 8 simulated CPU devices, strict rank promotion, quiet platform probing.

Everything here must run before JAX initialises its backends, so it sits at import time of conftest.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The TPU tests only compile: let each pytest-xdist worker (and each `jaxperf compile` subprocess, which inherits this)
# load libtpu, instead of the second one failing on libtpu's lock file (/tmp/libtpu_lockfile).
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# No persistent compilation cache (JAX's, and the trainer's default, which follows it): each test process compiles
# its own programs, and nothing the tests compile lands in, or is read from, the user's cache or another worker's.
# A test of the cache names a directory of its own.
os.environ["JAX_COMPILATION_CACHE_DIR"] = ""

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")

import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _eight_devices():
    # On a GPU machine (JAX_PLATFORMS=cuda,cpu, for tests/test_gpu.py) the CPU devices are the second backend.
    n = len(jax.devices("cpu"))
    assert n == 8, f"tests expect 8 simulated CPU devices, found {n}: was JAX initialised before conftest?"
    yield


# The files that prove the TPU and GPU paths by compiling on this host (libtpu, the Pallas GPU lowering): their slow
# tests carry the marker `accelerator_proof` too, so one run can take them with the fast tests at the other end of the
# supported jax range (.ci/run: -m "not slow or accelerator_proof").
ACCELERATOR_PROOF_FILES = ("test_topology.py", "test_dispatch.py", "test_memory_tpu.py", "test_kernels_")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name.startswith(ACCELERATOR_PROOF_FILES):
            item.add_marker(pytest.mark.accelerator_proof)
