"""The CPU host: everything jaxperf does for XLA:CPU alone, in one place, applied at the entry points.

- **Huge pages.** XLA:CPU allocates a compiled program's temporary buffer (every intermediate of the step) with malloc
  each time the program runs and frees it when the run ends. glibc serves a block that large with a fresh mmap and
  gives it back with munmap, so each step faults in every 4 KiB page of it again and the kernel zeroes each one.
  glibc's tunable `glibc.malloc.hugetlb=1` makes malloc advise transparent huge pages (madvise MADV_HUGEPAGE) on the
  memory it maps, so the same buffer comes in 2 MiB at a time, with far fewer faults and TLB misses.
  docs/cpu_hosts.md has the figures. The `jaxperf` commands that run programs on the host and the benchmark scripts
  restart themselves with it (`reexec_with_huge_pages`); the trainer's start-up log says when a run lacks it.
- **Collective order.** XLA:CPU runs some programs' collectives in different orders on different devices, where a
  step hangs and then aborts: `check_collective_order` refuses those meshes before compiling (`build_task` calls
  it).
- **Threads for simulated devices.** XLA:CPU (jaxlib 0.10) runs every device's part of a program, and each launch
  of a multi-device program, on one pool of max(cores, devices) threads. With 8 simulated devices on a 2-core host a
  collective waiting for its last devices beside the next program's launches can take all 8: the devices it waits for
  never run, and XLA aborts the process after 40 s ("Termination timeout for `all gather RendezvousKey`... only 5 of
  them arrived on time"). `cpu_threads_env` sizes the pool at 4 threads per simulated device (at least the cores)
  through PJRT_NPROC, which XLA reads when it creates the CPU client; `jaxperf` sets it at start-up unless it is set.
- The model's CPU settings (`matmul_grad_barrier` on, the scan of a shallow stack unrolled) are config fields,
  settled with the others in `jaxperf.models.platform.settle`: the model sees settings, not backends.

A tunable is read once, when the process starts, so it cannot be switched on from Python. `reexec_with_huge_pages()`
restarts the current program with it set; the `jaxperf` commands that run programs on the host (`HUGE_PAGE_COMMANDS`
in jaxperf.cli) and the benchmark scripts call it first thing. In your own program, start Python with it:

    GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python train.py

The restart happens on CPU-only hosts alone: when JAX_PLATFORMS names only cpu, or when no accelerator is found (no
libtpu or JAX GPU plugin installed, no /dev/nvidia0 or /dev/accel0), so a GPU or TPU host runs exactly the program
it was given. It also does nothing where it cannot help: not glibc (or glibc before 2.35, which lacks the tunable),
transparent huge pages set to `never` or `always` in /sys/kernel/mm/transparent_hugepage/enabled, the tunable
already set, or JAXPERF_HUGE_PAGES=0 in the environment (the way to turn it off).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from jaxperf.config import ConfigError

TUNABLE = "glibc.malloc.hugetlb"
OPT_OUT = "JAXPERF_HUGE_PAGES"  # "0": never restart the program for huge pages
_RESTARTED = "_JAXPERF_HUGE_PAGES_RESTARTED"  # set on the restarted process: never restart twice
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# What marks a host with an accelerator JAX would use: its plugin packages and its device files.
ACCELERATOR_PACKAGES = ("libtpu", "jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin")
ACCELERATOR_DEVICES = ("/dev/nvidia0", "/dev/accel0", "/dev/kfd")


@functools.cache  # fixed for the process; benchmark records ask on every record
def _glibc_version() -> tuple[int, int] | None:
    try:
        fn = ctypes.CDLL(None).gnu_get_libc_version
    except (OSError, AttributeError, TypeError):  # TypeError: Windows' CDLL wants a name
        return None  # not glibc (musl, macOS, Windows)
    fn.restype = ctypes.c_char_p
    major, minor = fn().decode().split(".")[:2]
    return int(major), int(minor)


def _thp_mode(path: Path = THP_ENABLED) -> str | None:
    """The bracketed choice in the sysfs file ("always", "madvise" or "never"); None where there is none."""
    try:
        text = path.read_text()
    except OSError:
        return None
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return None


def accelerator(env: dict[str, str]) -> str | None:
    """What makes JAX likely to run on an accelerator here (a plugin or device found), or None on a CPU-only host.

    Decided without starting JAX: JAX_PLATFORMS, when set, is taken at its word."""
    platforms = [p.strip() for p in env.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms:
        others = [p for p in platforms if p != "cpu"]
        return f"JAX_PLATFORMS={env['JAX_PLATFORMS']}" if others else None
    for name in ACCELERATOR_PACKAGES:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if found:
            return f"{name} is installed"
    for path in ACCELERATOR_DEVICES:
        if os.path.exists(path):
            return f"{path} exists"
    return None


def _tunable_value(env: dict[str, str]) -> str | None:
    for item in env.get("GLIBC_TUNABLES", "").split(":"):
        key, _, value = item.partition("=")
        if key == TUNABLE:
            return value
    return None


@dataclass(frozen=True)
class HostMemory:
    """What this process's host allocator does with large blocks, and whether a restart would change it."""

    glibc: tuple[int, int] | None  # (major, minor), None when the C library is not glibc
    thp_mode: str | None  # the kernel's transparent huge page mode, None when unknown
    tunable: str | None  # the value of glibc.malloc.hugetlb in GLIBC_TUNABLES, None when unset
    accelerator: str | None = None  # why this host is not CPU-only (jaxperf leaves such hosts alone), None if it is

    @property
    def huge_pages(self) -> bool:
        """Large malloc blocks get transparent huge pages."""
        return self.thp_mode == "always" or (self.thp_mode == "madvise" and self.tunable not in (None, "0"))

    @property
    def can_enable(self) -> bool:
        """Starting the program with glibc.malloc.hugetlb=1 would give it huge pages, and this is a CPU-only host."""
        return (not self.huge_pages and self.tunable is None and self.thp_mode == "madvise"
                and self.glibc is not None and self.glibc >= (2, 35) and self.accelerator is None)

    def describe(self) -> str:
        if self.huge_pages:
            how = "kernel mode always" if self.thp_mode == "always" else f"{TUNABLE}={self.tunable}"
            return f"host huge pages: on ({how})"
        if self.can_enable:
            return (f"host huge pages: off; start Python with GLIBC_TUNABLES={TUNABLE}=1 (the jaxperf command does): "
                    f"XLA:CPU maps its step buffers afresh every step and faults in each 4 KiB page")
        why = (f"not a CPU-only host: {self.accelerator}" if self.accelerator else
               "the C library is not glibc" if self.glibc is None else
               f"glibc {self.glibc[0]}.{self.glibc[1]} lacks {TUNABLE} (2.35+)" if self.glibc < (2, 35) else
               f"kernel transparent huge pages: {self.thp_mode or 'unknown'}")
        return f"host huge pages: off ({why})"


def host_memory(env: dict[str, str] | None = None) -> HostMemory:
    """This process's settings (or those a process started with `env` would have)."""
    env = os.environ if env is None else env
    return HostMemory(_glibc_version(), _thp_mode(), _tunable_value(env), accelerator(env))


def with_huge_pages(env: dict[str, str]) -> dict[str, str]:
    """A copy of `env` with glibc.malloc.hugetlb=1 added to GLIBC_TUNABLES (other tunables kept)."""
    out = dict(env)
    if _tunable_value(env) is None:
        out["GLIBC_TUNABLES"] = ":".join(x for x in (env.get("GLIBC_TUNABLES", ""), f"{TUNABLE}=1") if x)
    return out


def cpu_threads_env(env: dict[str, str]) -> dict[str, str]:
    """What to add to `env` so that XLA:CPU's thread pool holds a blocked collective of its simulated devices beside
    the next programs' launches (module docstring): {"PJRT_NPROC": 4 x devices, at least the cores} where
    XLA_FLAGS asks for more than one host device and PJRT_NPROC is unset, else {}."""
    if "PJRT_NPROC" in env:
        return {}
    found = re.search(r"--xla_force_host_platform_device_count=(\d+)", env.get("XLA_FLAGS", ""))
    devices = int(found.group(1)) if found else 1
    if devices <= 1:
        return {}
    return {"PJRT_NPROC": str(max(4 * devices, os.cpu_count() or 1))}


def reexec_with_huge_pages() -> bool:
    """Restart this program with glibc.malloc.hugetlb=1 when that gives it huge pages on a CPU-only host; False when
    it does not.

    Call it first thing in a program's entry point (before threads start or files are written): on success it does not
    return, the process image is replaced (same pid, arguments and environment plus the tunable). Never call it from
    library code or tests. JAXPERF_HUGE_PAGES=0 turns it off.
    """
    if os.environ.get(OPT_OUT) == "0" or os.environ.get(_RESTARTED) or not host_memory().can_enable:
        return False
    env = with_huge_pages(dict(os.environ))
    env[_RESTARTED] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError:
        return False  # the program goes on as it was
    return True  # not reached: execve does not return when it succeeds


def check_collective_order(cfg, mesh_shape: dict[str, int], platform: str) -> None:
    """ConfigError for the meshes whose step XLA:CPU runs with collectives in different orders on different devices
    (it hangs, then aborts): a pipeline over fsdp-sharded layers together with a contiguous ring or Megatron sequence
    parallelism puts two loops of collectives side by side. Accelerators run collectives in program order."""
    if platform != "cpu" or mesh_shape.get("stage", 1) == 1 or mesh_shape.get("fsdp", 1) == 1:
        return
    p = cfg.parallel
    other = ("seq with context_layout=contiguous" if mesh_shape.get("seq", 1) > 1 and p.context_layout == "contiguous"
             else "sequence_parallel" if p.sequence_parallel and mesh_shape.get("tensor", 1) > 1 else None)
    if other:
        raise ConfigError(f"stage x fsdp x {other} hangs on CPU devices (XLA:CPU runs the collectives out of order): "
                          f"use fsdp=1, or context_layout=zigzag / sequence_parallel=false")
