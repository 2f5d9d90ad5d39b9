"""Profiling: device traces for TensorBoard / Perfetto, step markers, and an audit of host synchronisations.

    with trace("runs/x/profile") as logdir:        # jax.profiler trace of the region; open with TensorBoard
        for step in range(5):
            with step_annotation(step):
                state, m = train_step(state, batch)

    with audit_host_syncs() as audit:              # which lines made the host wait for the device?
        for _ in range(10):
            state, m = train_step(state, batch)
            print(float(m["loss"]))                # a sync every step: the device idles while Python prints
    print(audit.report())                          # 10 host syncs: 10 x ...py:12 float32[] ...

JAX dispatches asynchronously: a step call returns at once while the device works, so the host can queue the next
step. Reading a value (`float(x)`, `x.item()`, `np.asarray(x)`, `jax.device_get`, printing it) blocks until the
device has produced it and copies it to the host; done every step, that keeps the device idle between steps.

How the audit counts: `jax.transfer_guard_device_to_host` would be the natural tool, but it does nothing on CPU
(arrays already live in host memory, so no transfer happens; checked on jax 0.10.2). Every host read of a
`jax.Array` goes through its `_value` property, so for the duration of the context the audit wraps that property
(and `item`) and counts the reads of arrays whose value is not already cached on the host, with the first user-code
line of the call stack: `float(x)`, `int(x)`, `bool(x)`, `x.item()`, `x.tolist()`, `jax.device_get(x)`, `print(x)`, and
on GPU/TPU also `np.asarray(x)`. Not seen: `np.asarray(x)` of a CPU array (numpy reads CPU buffers through the buffer
protocol, in C, without a copy) and `jax.block_until_ready` (a wait, but no transfer). It is process-wide while active (reads from other threads count too), and it
relies on a private attribute of `jax.Array`: if a jax version renames it, `audit_host_syncs` raises at entry
rather than report a clean run that it could not observe. `disallow=True` turns the first sync into an error.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import jax
from jax.profiler import ProfileData


@contextlib.contextmanager
def trace(logdir: str | os.PathLike, *, create_perfetto_link: bool = False):
    """Record a jax.profiler trace of the block into `logdir` (created); yields the absolute logdir.

    View it with `tensorboard --logdir <logdir>` (profile plugin) or load the `.trace.json.gz` into Perfetto.
    """
    path = Path(logdir).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    with jax.profiler.trace(str(path), create_perfetto_link=create_perfetto_link):
        yield str(path)


def step_annotation(step: int, name: str = "train"):
    """Mark one training step in the trace (the profiler's step-time view groups device work by these)."""
    return jax.profiler.StepTraceAnnotation(name, step_num=int(step))


def trace_files(logdir: str | os.PathLike) -> list[str]:
    """The files a trace wrote under `logdir` (e.g. plugins/profile/<run>/<host>.xplane.pb)."""
    return sorted(str(p) for p in Path(logdir).rglob("*") if p.is_file())


def device_time_by_op(logdir: str | os.PathLike, *, steps: int = 1, top: int = 25) -> dict:
    """Where the device time of a trace went: kernel time summed per XLA op (the `hlo_op` a kernel ran for; the
    kernel's own name where there is none, or where XLA replays many kernels as one command buffer), per step, from
    the `.xplane.pb` files under `logdir` (jax.profiler.ProfileData).

    Returns {"device_planes", "kernel_ms_per_step" (every kernel's time, summed over streams), "ops": [[op,
    ms_per_step, kernels_per_step, share], ...] for the `top` ops by time}. On CPU the XLA:CPU thread pool's ops are
    counted instead of GPU kernels. Empty "ops" when the trace holds no device events.
    """
    totals: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    planes = []
    for path in Path(logdir).rglob("*.xplane.pb"):
        for plane in ProfileData.from_file(str(path)).planes:
            gpu = plane.name.startswith("/device:GPU")
            if not (gpu or plane.name == "/host:CPU"):
                continue
            seen = False
            for line in plane.lines:
                if not gpu and not line.name.startswith("tf_XLA"):
                    continue
                for ev in line.events:
                    stats = dict(ev.stats)
                    if not gpu and "hlo_op" not in stats:
                        continue
                    op = str(stats.get("hlo_op") or ev.name)
                    if op.startswith("command_buffer"):  # a CUDA graph of many kernels: name the kernel instead
                        op = ev.name
                    totals[op] += ev.duration_ns
                    counts[op] += 1
                    seen = True
            if seen:
                planes.append(plane.name)
    total_ns = sum(totals.values())
    ops = [[op, ns / 1e6 / steps, counts[op] / steps, ns / total_ns if total_ns else 0.0]
           for op, ns in totals.most_common(top)]
    return {"device_planes": planes, "kernel_ms_per_step": total_ns / 1e6 / steps, "ops": ops}


class HostSyncError(RuntimeError):
    """A device-to-host read inside `audit_host_syncs(disallow=True)`."""


@dataclass
class HostSync:
    where: str  # file:line of the first frame outside jax / numpy / this module
    shape: tuple[int, ...]
    dtype: str


@dataclass
class SyncAudit:
    """What `audit_host_syncs` saw: every device-to-host read, in order."""

    syncs: list[HostSync] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.syncs)

    @property
    def clean(self) -> bool:
        return not self.syncs

    def by_location(self) -> dict[str, int]:
        return dict(collections.Counter(s.where for s in self.syncs).most_common())

    def report(self) -> str:
        if self.clean:
            return "no host syncs"
        lines = [f"{self.count} host sync(s):"]
        for where, n in self.by_location().items():
            example = next(s for s in self.syncs if s.where == where)
            lines.append(f"  {n:5d} x {where}  ({example.dtype}{list(example.shape)})")
        return "\n".join(lines)


_SKIP = (os.sep + "jax" + os.sep, os.sep + "jaxlib" + os.sep, os.sep + "numpy" + os.sep, __file__, "<frozen")
_lock = threading.Lock()
_active: list[tuple[SyncAudit, bool]] = []
_originals: dict = {}


def _caller() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not any(s in name for s in _SKIP):
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"


def _array_class():
    from jax._src.array import ArrayImpl

    return ArrayImpl


_depth = threading.local()


def _record(arr) -> None:
    sync = HostSync(_caller(), tuple(arr.shape), str(arr.dtype))
    for audit, disallow in list(_active):
        audit.syncs.append(sync)
        if disallow:
            raise HostSyncError(f"device-to-host read of {sync.dtype}{list(sync.shape)} at {sync.where} inside "
                                "audit_host_syncs(disallow=True): keep the value on the device, or read it one step "
                                "later / every N steps")


def _counted(read):
    """Wrap a reading function: record the read unless an outer wrapped read is already recording it."""

    def wrapped(self, *args, **kwargs):
        if getattr(_depth, "n", 0) == 0 and getattr(self, "_npy_value", None) is None:
            _record(self)
        _depth.n = getattr(_depth, "n", 0) + 1
        try:
            return read(self, *args, **kwargs)
        finally:
            _depth.n -= 1

    return wrapped


def _install() -> None:
    global _originals
    cls = _array_class()
    value, item = cls.__dict__.get("_value"), cls.__dict__.get("item")
    if not isinstance(value, property) or not callable(item):
        raise RuntimeError(
            f"audit_host_syncs cannot wrap jax.Array's `_value`/`item` in jax {jax.__version__}: use "
            "jax.transfer_guard_device_to_host('disallow') on GPU/TPU instead")
    _originals = {"_value": value, "item": item}
    cls._value = property(_counted(value.fget))
    cls.item = _counted(item)


def _uninstall() -> None:
    global _originals
    cls = _array_class()
    for name, original in _originals.items():
        setattr(cls, name, original)
    _originals = {}


@contextlib.contextmanager
def audit_host_syncs(*, disallow: bool = False):
    """Count device-to-host reads of jax.Arrays inside the block; yields a `SyncAudit` (filled as the block runs).

    disallow=True raises `HostSyncError` at the first read instead. Audits nest.
    """
    audit = SyncAudit()
    with _lock:
        if not _active:
            _install()
        _active.append((audit, disallow))
    try:
        yield audit
    finally:
        with _lock:
            del _active[next(i for i, (a, _) in enumerate(_active) if a is audit)]
            if not _active:
                _uninstall()


def count_host_syncs(fn, *args, **kwargs) -> tuple[object, SyncAudit]:
    """Call `fn(*args, **kwargs)` under `audit_host_syncs`; returns (its result, the audit)."""
    with audit_host_syncs() as audit:
        out = fn(*args, **kwargs)
    return out, audit
