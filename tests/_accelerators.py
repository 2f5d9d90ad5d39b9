"""Accelerator lowering from a CPU-only host, shared by the kernel tests.

- TPU: with libtpu on the path, `jax.experimental.topologies` describes a TPU slice that is not attached, and
  `jit(...).lower(...).compile()` against its devices runs the real TPU compiler (Mosaic kernels included).
  `tpu_devices` finds libtpu (importable, or in the directory named by JAXPERF_LIBTPU_PATH) or skips the test; with
  JAXPERF_REQUIRE_LIBTPU=1 (as in CI) a missing libtpu fails the test instead, so the TPU proof cannot be skipped.
- GPU: `lower_for_cuda` runs the Pallas GPU lowering on this CPU-only jaxlib and returns the StableHLO text, where each
  Triton kernel is a custom call that carries its kernel name (`gpu_kernel_names`). It catches lowering errors (block
  shapes, unsupported ops, layouts), not PTX compilation or speed. The target GPU is named by an abstract device
  (an H100): jax 0.10 assumes compute capability 9.0 without one, jax 0.12 refuses to lower Triton kernels without.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import sys

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# The TPU compiler the newest supported jax pins (jax 0.12: libtpu 0.0.50) compiles the big programs; an older jax's
# compiler, whose figures match it, the smaller ones only (tests/test_memory_tpu.py, tests/test_topology.py).
NEWEST_TPU_COMPILER = jax.__version_info__ >= (0, 12)
LIBTPU_PATH_ENV = "JAXPERF_LIBTPU_PATH"
REQUIRE_LIBTPU_ENV = "JAXPERF_REQUIRE_LIBTPU"
TRITON_CALL_TARGET = "__gpu$xla.gpu.triton"
CUDA_TARGET = "NVIDIA H100"  # the device kind the GPU lowering is for (its compute capability picks Triton features)


def _libtpu_missing_reason() -> str | None:
    """None when libtpu can be imported (after adding $JAXPERF_LIBTPU_PATH to sys.path), else why not."""
    extra = os.environ.get(LIBTPU_PATH_ENV)
    if extra:
        if not os.path.isdir(os.path.join(extra, "libtpu")):
            return f"{LIBTPU_PATH_ENV}={extra!r} has no libtpu package in it"
        if extra not in sys.path:
            sys.path.append(extra)
            importlib.invalidate_caches()
    if importlib.util.find_spec("libtpu") is not None:
        return None
    return (
        "libtpu is absent, so TPU compilation cannot be checked here. Install the libtpu that matches this jax in a "
        "directory of its own (`pip install --target DIR 'libtpu==<version jax[tpu] pins>'`) and set "
        f"{LIBTPU_PATH_ENV}=DIR (or install 'jax[tpu]==<your jax version>' in a separate venv); run with "
        "JAX_PLATFORMS=cpu."
    )


def require_libtpu() -> None:
    """Skip the calling test, with the reason and the fix, when libtpu cannot be found; fail it instead when
    $JAXPERF_REQUIRE_LIBTPU is 1. On return libtpu is importable in this process."""
    reason = _libtpu_missing_reason()
    if reason is None:
        return
    if os.environ.get(REQUIRE_LIBTPU_ENV) == "1":
        pytest.fail(f"{REQUIRE_LIBTPU_ENV}=1 but {reason[0].lower()}{reason[1:]}", pytrace=False)
    pytest.skip(reason)


def libtpu_pythonpath() -> str:
    """The directory to put on a subprocess's PYTHONPATH so that it finds libtpu ("" when it is importable anyway);
    skips or fails like `require_libtpu`."""
    require_libtpu()
    return os.environ.get(LIBTPU_PATH_ENV, "")


@functools.cache
def _topology_devices(topology: str):
    from jax.experimental import topologies

    # Compiling only: several test processes may load libtpu at once (pytest-xdist) without fighting over its lock
    # file. conftest.py sets this before anything starts; kept here for callers outside the test suite.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    return tuple(topologies.get_topology_desc(topology, platform="tpu").devices)


def tpu_devices(topology: str = "v5p:2x2x1"):
    """The devices of a TPU slice described by `topology` (e.g. "v5p:2x2x1"), for AOT compilation on this host.

    Skips the calling test, with the reason and the fix, when libtpu cannot be found (fails it under
    JAXPERF_REQUIRE_LIBTPU=1).
    """
    require_libtpu()
    return _topology_devices(topology)


def tpu_replicated(topology: str = "v5p:2x2x1") -> NamedSharding:
    """A sharding that places an array whole on the first device of the TPU slice (skips as `tpu_devices`)."""
    devices = tpu_devices(topology)
    return NamedSharding(Mesh(np.array(devices[:1]), ("x",)), PartitionSpec())


def lower_for_cuda(fn, *args) -> str:
    """StableHLO text of `jax.jit(fn)` lowered for CUDA (an H100): runs the Pallas GPU lowering of every kernel in
    `fn`."""
    device = jax.sharding.AbstractDevice(device_kind=CUDA_TARGET, num_cores=132, platform="gpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("gpu",), abstract_device=device)):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def gpu_kernel_names(stablehlo_text: str) -> list[str]:
    """Names of the Pallas Triton kernels in lowered text, one per custom call, in program order."""
    names = []
    for line in stablehlo_text.splitlines():
        if f"custom_call @{TRITON_CALL_TARGET}(" in line:
            match = re.search(r'\bname = "([^"]*)"', line)
            names.append(match.group(1) if match else "?")
    return names
