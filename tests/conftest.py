"""Test set-up: 8 simulated CPU devices, strict rank promotion, quiet platform probing.

Everything here must run before JAX initialises its backends, so it sits at import time of conftest.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The TPU tests only compile: let each pytest-xdist worker (and each `jaxperf compile` subprocess, which inherits this)
# load libtpu, instead of the second one failing on libtpu's lock file (/tmp/libtpu_lockfile).
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# The persistent compilation cache (JAX's, and the trainer's default, which follows it) is off: nothing the tests
# compile lands in, or is read from, the user's cache. JAXPERF_TEST_XLA_CACHE names a directory of the test run's own
# instead (.ci/run: a fresh one per phase), shared by the workers and the `jaxperf` subprocesses they start, so a
# program that many tests compile alike (the tiny models' steps) compiles once a run; programs that compile in under
# half a second are not stored. A test of the cache names a directory of its own.
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ.get("JAXPERF_TEST_XLA_CACHE", "")
if os.environ["JAX_COMPILATION_CACHE_DIR"]:
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
# XLA:CPU (jaxlib 0.10) runs the devices' parts of programs and the per-device launches of multi-device programs on
# one pool of max(cores, devices) threads: 8 on a 2-core host. A launch waiting for its device's in-flight limit holds
# a thread, as does each device waiting in a collective for the others; once they hold all 8, the work that would free
# the limit or join the collective never runs, and XLA aborts the process after 40 s ("Termination timeout for `all
# reduce RendezvousKey{...}` ... but only 7 of them arrived on time"). Under load that lost a pytest-xdist worker in
# whichever test dispatched op by op on sharded arrays. 32 threads hold a blocked collective (7) and the launches of
# two dispatching threads (8 each) with room to spare. XLA reads PJRT_NPROC when it makes the CPU client; the
# `jaxperf` subprocesses of the tests inherit it.
os.environ.setdefault("PJRT_NPROC", "32")
# The tests compile far more than they run (small shapes, a few steps): XLA:CPU without LLVM's optimisations compiles
# their programs 30-40% faster for the same suite (tests/test_flavours.py with tests/test_moe.py: 96 -> 60 s on two
# cores). No test times anything. The `jaxperf` subprocesses of the tests take the same flag (helpers.cli_env).
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()

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
# supported jax range (.ci/run: -m "(not slow or accelerator_proof) and not extended").
ACCELERATOR_PROOF_FILES = ("test_topology.py", "test_dispatch.py", "test_memory_tpu.py", "test_kernels_")


# The longest tests (TPU compiles of whole models, one to six minutes each on 2 cores) run first: under pytest-xdist a
# long test picked up last leaves the other worker idle until it ends.
LONGEST_FIRST = ("test_memory_tpu.py", "test_topology.py")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name.startswith(ACCELERATOR_PROOF_FILES):
            item.add_marker(pytest.mark.accelerator_proof)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)) if item.get_closest_marker("slow") else len(rank))


# The compile report at the end of a run: how many programs each test compiled in its own process (XLA backend
# compiles; the `jaxperf` subprocesses some tests start are not seen) and the seconds they took, summed over the run
# and listed for the tests that compiled longest. JAX times a persistent-cache hit as a compile (its load time): the
# hits are counted apart and left out of the programs. Compiling is ~40% of the suite's test time; this says where.
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
COMPILE_REPORT_TESTS = 15
_compiled = {"programs": 0, "seconds": 0.0, "cache_hits": 0}
_COMPILED_AT_START = pytest.StashKey[dict]()


def _on_duration(event: str, duration: float, **_):
    if event == COMPILE_EVENT:
        _compiled["programs"] += 1
        _compiled["seconds"] += duration


def _on_event(event: str, **_):
    if event == CACHE_HIT_EVENT:
        _compiled["cache_hits"] += 1


jax.monitoring.register_event_duration_secs_listener(_on_duration)
jax.monitoring.register_event_listener(_on_event)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    item.stash[_COMPILED_AT_START] = dict(_compiled)
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if call.when == "teardown" and _COMPILED_AT_START in item.stash:  # user_properties reach the xdist controller
        start = item.stash[_COMPILED_AT_START]
        report.user_properties += [(f"xla_{k}", _compiled[k] - start[k]) for k in _compiled]


_compile_report: dict[str, dict[str, float]] = {}  # nodeid -> programs, seconds, cache_hits, wall


def pytest_runtest_logreport(report):
    row = _compile_report.setdefault(report.nodeid, dict.fromkeys((*_compiled, "wall"), 0))
    row["wall"] += report.duration
    for name, value in report.user_properties:
        if name.startswith("xla_") and name[4:] in row:
            row[name[4:]] += value


def pytest_terminal_summary(terminalreporter):
    rows = [(nodeid, row["programs"] - row["cache_hits"], row["seconds"], row["cache_hits"], row["wall"])
            for nodeid, row in _compile_report.items()]
    if not any(r[2] for r in rows):
        return
    programs, seconds, hits, wall = (sum(r[i] for r in rows) for i in (1, 2, 3, 4))
    tr = terminalreporter
    tr.section("XLA compiles in the test processes")
    tr.write_line(f"{programs} programs compiled and {hits} loaded from the persistent cache in {seconds:.0f} s, "
                  f"{seconds / max(wall, 1e-9):.0%} of the tests' {wall:.0f} s; the {COMPILE_REPORT_TESTS} tests that "
                  f"compiled longest:")
    for nodeid, n, s, _, w in sorted(rows, key=lambda r: -r[2])[:COMPILE_REPORT_TESTS]:
        tr.write_line(f"{s:7.1f} s {n:5d} programs {w:7.1f} s wall  {nodeid}")
