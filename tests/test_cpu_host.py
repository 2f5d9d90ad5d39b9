"""Host memory: huge pages for XLA:CPU's per-run buffers (jaxperf.perf.cpu_host) and the restart that turns them on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from jaxperf.perf import cpu_host
from jaxperf.perf.cpu_host import TUNABLE, HostMemory, host_memory, with_huge_pages


def _plain_env() -> dict[str, str]:
    """This environment without the tunable (so a child starts as a user's program would)."""
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", cpu_host.OPT_OUT, cpu_host._RESTARTED)}
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("XLA_FLAGS", None)  # one device is enough here
    return env


needs_madvise_thp = pytest.mark.skipif(not host_memory(_plain_env()).can_enable,
                                       reason="needs glibc >= 2.35 and transparent huge pages in madvise mode")


def test_thp_mode_reads_the_bracketed_choice(tmp_path):
    f = tmp_path / "enabled"
    for text, mode in (("always [madvise] never\n", "madvise"), ("[always] madvise never\n", "always"),
                       ("always madvise [never]\n", "never")):
        f.write_text(text)
        assert cpu_host._thp_mode(f) == mode
    assert cpu_host._thp_mode(tmp_path / "missing") is None


def test_with_huge_pages_appends_to_other_tunables_and_keeps_a_users_choice():
    assert with_huge_pages({})["GLIBC_TUNABLES"] == f"{TUNABLE}=1"
    env = with_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "HOME": "/h"})
    assert env["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{TUNABLE}=1" and env["HOME"] == "/h"
    assert with_huge_pages({"GLIBC_TUNABLES": f"{TUNABLE}=0"})["GLIBC_TUNABLES"] == f"{TUNABLE}=0"
    assert cpu_host._tunable_value({"GLIBC_TUNABLES": f"a.b=1:{TUNABLE}=2"}) == "2"


@pytest.mark.parametrize("glibc,mode,tunable,on,can", [
    ((2, 36), "madvise", None, False, True),
    ((2, 36), "madvise", "1", True, False),
    ((2, 36), "madvise", "0", False, False),  # the user said no
    ((2, 36), "always", None, True, False),  # the kernel already does it
    ((2, 36), "never", None, False, False),
    ((2, 31), "madvise", None, False, False),  # no such tunable before glibc 2.35
    (None, "madvise", None, False, False),  # not glibc
])
def test_when_huge_pages_are_on_and_when_a_restart_would_help(glibc, mode, tunable, on, can):
    h = HostMemory(glibc, mode, tunable)
    assert (h.huge_pages, h.can_enable) == (on, can)
    text = h.describe()
    assert text.startswith("host huge pages: on" if on else "host huge pages: off")
    if can:
        assert f"GLIBC_TUNABLES={TUNABLE}=1" in text


def test_only_cpu_only_hosts_are_restarted(monkeypatch, tmp_path):
    assert cpu_host.accelerator({"JAX_PLATFORMS": "cpu"}) is None
    assert cpu_host.accelerator({"JAX_PLATFORMS": "tpu,cpu"}) == "JAX_PLATFORMS=tpu,cpu"
    monkeypatch.setattr(cpu_host, "ACCELERATOR_PACKAGES", ())
    monkeypatch.setattr(cpu_host, "ACCELERATOR_DEVICES", (str(tmp_path / "nvidia0"),))
    assert cpu_host.accelerator({}) is None
    (tmp_path / "nvidia0").write_text("")
    assert cpu_host.accelerator({}) == f"{tmp_path / 'nvidia0'} exists"
    assert cpu_host.accelerator({"JAX_PLATFORMS": "cpu"}) is None  # the user's choice wins over what is installed
    monkeypatch.setattr(cpu_host, "ACCELERATOR_PACKAGES", ("json",))  # any importable name stands in for a plugin
    monkeypatch.setattr(cpu_host, "ACCELERATOR_DEVICES", ())
    assert cpu_host.accelerator({}) == "json is installed"
    gpu_host = HostMemory((2, 36), "madvise", None, accelerator="/dev/nvidia0 exists")
    assert not gpu_host.can_enable and "not a CPU-only host: /dev/nvidia0 exists" in gpu_host.describe()


CHILD = textwrap.dedent("""
    import json, resource
    import jax, jax.numpy as jnp
    from jaxperf.perf.cpu_host import host_memory

    def f(x, w):  # two 32 MiB intermediates and more: an 84 MB temporary buffer, allocated on every run
        a = jnp.tanh(x @ w)
        b = jnp.sin(a) @ w.T
        c = jnp.cos(b) @ w
        return (a * c).sum() + b.sum()

    x = jnp.full((2048, 2048), 0.01, jnp.float32)
    w = jnp.full((2048, 4096), 0.01, jnp.float32)
    c = jax.jit(f).lower(x, w).compile()
    for _ in range(3):
        c(x, w).block_until_ready()
    r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        c(x, w).block_until_ready()
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0) / 5
    print(json.dumps({"temp_bytes": c.memory_analysis().temp_size_in_bytes, "faults_per_run": faults,
                      "huge_pages": host_memory().huge_pages}))
""")


def _faults(env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@needs_madvise_thp
def test_huge_pages_stop_the_per_run_page_faults_of_the_temporary_buffer():
    plain = _faults(_plain_env())
    huge = _faults(with_huge_pages(_plain_env()))
    pages = plain["temp_bytes"] / 4096
    assert plain["temp_bytes"] > 64 * 2**20  # big enough that malloc maps it afresh on every run
    assert not plain["huge_pages"] and huge["huge_pages"]
    assert plain["faults_per_run"] > 0.5 * pages, plain  # each run faults the buffer in again, 4 KiB at a time
    # 2 MiB at a time: 26x fewer faults with jax 0.10.2, 8x with 0.12 (which maps some smaller blocks beside it)
    assert huge["faults_per_run"] < plain["faults_per_run"] / 4, (huge, plain)


@pytest.mark.slow
@needs_madvise_thp
def test_the_jaxperf_command_restarts_itself_with_huge_pages_unless_told_not_to():
    # `jaxperf train` as the console script starts it, with main() replaced by a report of the host's huge pages
    script = ("import sys; sys.argv = ['jaxperf', 'train']; import jaxperf.cli as cli; "
              "cli.main = lambda argv=None: print(cli.cpu_host.host_memory().describe()) or 0; cli.run()")
    cmd = [sys.executable, "-c", script]
    on = subprocess.run(cmd, env=_plain_env(), capture_output=True, text=True, timeout=300)
    assert on.returncode == 0, on.stderr[-2000:]
    assert f"host huge pages: on ({TUNABLE}=1)" in on.stdout
    off = subprocess.run(cmd, env={**_plain_env(), cpu_host.OPT_OUT: "0"}, capture_output=True, text=True, timeout=300)
    assert off.returncode == 0, off.stderr[-2000:]
    assert f"host huge pages: off; start Python with GLIBC_TUNABLES={TUNABLE}=1" in off.stdout


def test_only_the_commands_that_run_programs_here_restart_for_huge_pages(monkeypatch):
    import jaxperf.cli as cli

    restarts = []
    monkeypatch.setattr(cpu_host, "reexec_with_huge_pages", lambda: restarts.append(True))
    monkeypatch.setattr(cli, "main", lambda argv=None: 0)
    for argv, restarted in ((["jaxperf", "train"], True), (["jaxperf", "bench", "--tiny"], True), (["jaxperf", "info"], False),
                            (["jaxperf", "export"], False), (["jaxperf", "compile"], False), (["jaxperf"], False)):
        restarts.clear()
        monkeypatch.setattr(sys, "argv", argv)
        with pytest.raises(SystemExit):
            cli.run()
        assert bool(restarts) == restarted, argv


def test_meshes_whose_collectives_xla_cpu_runs_out_of_order_are_refused_on_cpu_only():
    from jaxperf.config import ConfigError, get_config

    shape = {"data": 1, "stage": 2, "fsdp": 2, "seq": 2, "tensor": 1}
    contiguous = get_config("tiny", ["parallel.context_layout=contiguous"])
    with pytest.raises(ConfigError, match="stage x fsdp x seq with context_layout=contiguous hangs on CPU devices"):
        cpu_host.check_collective_order(contiguous, shape, "cpu")
    cpu_host.check_collective_order(contiguous, shape, "tpu")  # accelerators run collectives in program order
    cpu_host.check_collective_order(get_config("tiny", ["parallel.context_layout=zigzag"]), shape, "cpu")
    cpu_host.check_collective_order(contiguous, {**shape, "fsdp": 1}, "cpu")
    tp = {"data": 1, "stage": 2, "fsdp": 2, "seq": 1, "tensor": 2}
    with pytest.raises(ConfigError, match="stage x fsdp x sequence_parallel"):
        cpu_host.check_collective_order(get_config("tiny", ["parallel.sequence_parallel=true"]), tp, "cpu")


def test_jaxperf_gives_xla_cpu_threads_for_its_simulated_devices(monkeypatch):
    """XLA:CPU's pool of max(cores, devices) threads can deadlock a collective of 8 simulated devices on 2 cores
    (tests/test_collectives.py checks the pool the tests run with): `jaxperf` sizes it through PJRT_NPROC unless the
    user did."""
    many = {"XLA_FLAGS": "--xla_cpu_foo=1 --xla_force_host_platform_device_count=8"}
    assert cpu_host.cpu_threads_env(many) == {"PJRT_NPROC": str(max(32, os.cpu_count()))}
    assert cpu_host.cpu_threads_env({**many, "PJRT_NPROC": "12"}) == {}  # the user's setting stands
    assert cpu_host.cpu_threads_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}) == {}
    assert cpu_host.cpu_threads_env({}) == {}
    from jaxperf import cli

    monkeypatch.delenv("PJRT_NPROC", raising=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=16")
    assert cli.main(["--help"]) == 0
    assert os.environ["PJRT_NPROC"] == str(max(64, os.cpu_count()))
