"""Checkpointing: a thin wrapper over Orbax's `CheckpointManager`.

What it adds to Orbax:

- **Any pytree, exact structure back.** The state is flattened to a flat ``{keypath: leaf}`` dict
  (``jax.tree_util.keystr`` names such as ``"['opt_state'][1][0].mu['w']"``) before it is saved, and restore rebuilds
  the tree with the *target's* treedef. Optax namedtuple states, empty nodes (``EmptyState``, ``MaskedNode``), dicts
  with int keys and any registered pytree node therefore round-trip exactly, whatever Orbax thinks of custom nodes.
  Saved and target key sets must match; a mismatch raises a short ``ValueError`` naming the differing keys.
- **Scalars.** Python and NumPy scalars are saved as 0-d NumPy arrays and come back as the type the target leaf has.
- **Restore onto any mesh.** Each target leaf gives shape, dtype and sharding (a ``jax.ShapeDtypeStruct`` or a concrete
  array); arrays are read straight into that sharding, so a checkpoint written on 8 devices restores onto 4, or onto a
  2-D mesh. Shapes must match the saved ones; dtypes are cast if they differ.
- **Committed-only view.** ``latest_step``/``all_steps`` leave out a step whose asynchronous save is still running.
- **Parameters apart.** A state whose top level has a `params` entry (a TrainState, a dict) is saved as two Orbax
  items, ``params`` and ``state`` (everything else: step, optimizer, health), so parameters restore without building
  an optimizer: pass a target that holds only ``{"params": ...}``. Checkpoints written with a single ``state`` item
  (all arrays together) still restore, whole or parameters only.
- **Metadata.** A small JSON dict (data position, config...) is saved as a third Orbax item inside the same step
  directory, so it is committed atomically with the arrays.
- **Checksums.** Orbax commits atomically but does not notice flipped bits in array data. Every array gets a 64-bit
  checksum at save time (computed on device over the *global* array, so it does not depend on the mesh), stored with the
  metadata and verified after every restore, also onto another mesh. NumPy leaves get a SHA-256 of their bytes.
- **Metadata checksum.** The metadata (with the checksum table) carries its own SHA-256, so a flipped digit in the data
  position is caught like a flipped bit in an array.
- **Fallback.** ``restore_latest`` tries the newest committed step first; a step that fails to read (truncated file,
  missing manifest, garbled metadata) or fails its checksums is reported by step, directory and array or file, moved
  aside to ``<step>.corrupt`` (never deleted) and the next older step is tried. When none is intact,
  ``NoIntactCheckpointError``; a step this process may not read is a ``CheckpointPermissionError`` and stays put.
- **Readers never write.** ``Checkpointer(directory, read_only=True)`` (generation, serving, quantizing, export,
  ``init_from``) creates nothing, removes no temporary directory of a save in progress and moves no corrupt step
  aside: it falls back to the newest intact step and says so in one line. Only the process that holds the run's lock
  (training) opens its checkpoints for writing.
- **Saves that fail loudly.** ``poll`` (after every step, without waiting) and ``wait`` raise ``CheckpointSaveError``
  for a save that did not commit, naming the cause and the last good step; ``close`` waits at most a bounded time.

Orbax facts this relies on (0.12.8): saves go to a temporary directory that is renamed on commit; device-to-host
copies happen before ``save`` returns (buffers may be donated right after), the writes happen in a background thread.
Like every Orbax call, ``save``/``restore``/``wait`` must be called by all processes of a multi-process job.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import sys
import threading
import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

__all__ = ["Checkpointer", "CorruptCheckpointError", "IncompatibleCheckpointError", "checksums"]

_PARAMS, _STATE, _META = "params", "state", "meta"  # Orbax item names inside each step directory.
_ARRAY_ITEMS = (_PARAMS, _STATE)
_CHECKSUMS = "__checksums__"  # key of the checksum table inside the saved metadata
_META_CHECKSUM = "__meta_checksum__"  # SHA-256 of the rest of the metadata (data position, seed...) and the table
CLOSE_TIMEOUT_S = 120.0  # longest `close` waits for Orbax's writer threads before giving up on them
_SCALARS = (bool, int, float, np.generic)


_logger = logging.getLogger("jaxperf.checkpoint")
# Orbax's read coroutines, which a failed restore may create and drop without starting.
_ORBAX_UNSTARTED_READS = (r"coroutine '(_read_array_index_and_device_put|_read_shard|_read_and_create_array|"
                          r"async_deserialize)' was never awaited")


def _first_line(e: BaseException, limit: int = 300) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else "")[:limit]


_READ_ONLY_NOTES = ("CheckpointManagerOptions.read_only=True", "Given directory is read only")


class _DropOrbaxInfo(logging.Filter):
    """Drops Orbax's INFO/DEBUG chatter (it logs a dozen lines per save through absl) and the tracebacks its writer
    threads log for a failed save (the Checkpointer reports that failure itself, in one line); keeps its warnings."""

    def filter(self, record: logging.LogRecord) -> bool:
        if f"{os.sep}orbax{os.sep}" not in record.pathname:
            return True
        if record.getMessage().startswith(_READ_ONLY_NOTES):  # what read_only=True asked for, not a warning
            return False
        return record.levelno >= logging.WARNING and not record.exc_info


def _quiet_orbax_logging() -> None:
    logger = logging.getLogger("absl")  # absl.logging, which Orbax uses, forwards to this stdlib logger.
    if not any(isinstance(f, _DropOrbaxInfo) for f in logger.filters):
        logger.addFilter(_DropOrbaxInfo())
    if not getattr(sys.unraisablehook, "_jaxperf", False):
        previous = sys.unraisablehook

        def hook(unraisable):
            # After a failed save, TensorStore completes the other writes of that save and calls back into Orbax's
            # event loop, which is closed by then: one "Event loop is closed" traceback per write. The failure itself
            # is reported once, by the Checkpointer.
            if isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed":
                return
            # After a failed read, the reads Orbax had started for the other arrays are dropped unfinished: one
            # traceback with a TensorStore spec per array. The failure itself is reported once, by the Checkpointer.
            code = getattr(unraisable.object, "cr_code", None)
            if code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename:
                return
            previous(unraisable)

        hook._jaxperf = True
        sys.unraisablehook = hook
    # The same dropped reads, when the restore fails before they start: Python warns once per coroutine at collection
    # ("coroutine ... was never awaited", two lines each, at any time up to exit).
    warnings.filterwarnings("ignore", message=_ORBAX_UNSTARTED_READS, category=RuntimeWarning)


def _manager_options(keep: int, keep_every: int | None, async_save: bool,
                     read_only: bool = False) -> ocp.CheckpointManagerOptions:
    """Retention = the newest `keep` steps plus every multiple of `keep_every`. A reader creates no directory and
    leaves the temporary directories of a save in progress alone (they may be a running job's)."""
    common = dict(enable_async_checkpointing=async_save, create=not read_only, cleanup_tmp_directories=not read_only,
                  read_only=read_only)
    policies = getattr(ocp, "checkpoint_managers", None)
    if policies is not None and hasattr(policies, "AnyPreservationPolicy"):
        keepers = [policies.LatestN(n=keep)]
        if keep_every is not None:
            keepers.append(policies.EveryNSteps(interval_steps=keep_every))
        return ocp.CheckpointManagerOptions(preservation_policy=policies.AnyPreservationPolicy(keepers), **common)
    # Older Orbax without preservation policies: the (later deprecated) options that mean the same.
    return ocp.CheckpointManagerOptions(max_to_keep=keep, keep_period=keep_every, **common)  # pragma: no cover


def _flatten(tree: Any) -> tuple[dict[str, Any], jax.tree_util.PyTreeDef]:
    """({name: leaf}, treedef). Leaves under a top-level `params` entry (an attribute or a dict key alike) are named
    "params" + their path inside it, so a TrainState and a {"params": ...} dict name the same parameters the same."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    flat = {}
    for path, leaf in leaves:
        first = path[0] if path else None
        if getattr(first, "name", getattr(first, "key", None)) == _PARAMS:
            flat[_PARAMS + jax.tree_util.keystr(path[1:])] = leaf
        else:
            flat[jax.tree_util.keystr(path)] = leaf
    return flat, treedef


def _item_of(name: str) -> str:
    """The Orbax item a leaf is stored in: the parameters apart from everything else."""
    return _PARAMS if name.startswith(_PARAMS) else _STATE


_LEGACY_PARAMS = (".params", "['params']")  # how a single-item checkpoint spelled the parameters' paths


def _canonical(item: str, stored: str) -> str:
    """The name of a leaf stored under `stored` in `item` (the params item keeps paths relative to the parameters;
    a checkpoint written as one item keeps full paths)."""
    if item == _PARAMS:
        return _PARAMS + stored
    for prefix in _LEGACY_PARAMS:
        if stored.startswith(prefix):
            return _PARAMS + stored[len(prefix):]
    return stored


def _metadata_checksum(meta: dict) -> str:
    body = {k: v for k, v in meta.items() if k != _META_CHECKSUM}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:32]


def _savable(name: str, leaf: Any) -> Any:
    if isinstance(leaf, jax.Array):
        return leaf
    if isinstance(leaf, (np.ndarray, *_SCALARS)):
        return np.array(leaf)  # a private copy: the caller may mutate its NumPy buffers while the save runs
    raise TypeError(f"checkpoint state leaf {name} is a {type(leaf).__name__}; expected a jax.Array, array or scalar")


def _abstract(name: str, leaf: Any) -> Any:
    """What Orbax should restore `leaf` as: a ShapeDtypeStruct with a sharding (-> jax.Array) or a NumPy array."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        # Without a sharding Orbax would rebuild the *saved* sharding, which may not exist here: use the default device.
        sharding = leaf.sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
    if isinstance(leaf, jax.Array):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
    if isinstance(leaf, (np.ndarray, *_SCALARS)):
        return np.zeros(np.shape(leaf), np.asarray(leaf).dtype)
    raise TypeError(f"restore target leaf {name} is a {type(leaf).__name__}; expected a ShapeDtypeStruct or an array")


def _like(value: Any, target: Any) -> Any:
    """Gives a restored NumPy value the scalar type of its target leaf (int stays int, np.int32 stays np.int32)."""
    if isinstance(target, (bool, int, float)):
        return type(target)(value.item())
    if isinstance(target, np.generic):
        return value[()]
    return value


class IncompatibleCheckpointError(ValueError):
    """A checkpoint whose arrays do not fit the target: written by a model of another configuration."""


class CorruptCheckpointError(RuntimeError):
    """A committed checkpoint step that cannot be read back as it was written."""

    def __init__(self, step: int, directory: str, reason: str):
        self.step, self.directory, self.reason = step, directory, reason
        super().__init__(f"checkpoint step {step} in {directory} is corrupt: {reason}")


class NoIntactCheckpointError(FileNotFoundError):
    """Checkpoints were written but none of them reads back intact (the corrupt ones are kept as <step>.corrupt)."""


class CheckpointPermissionError(PermissionError):
    """A checkpoint this process may not read: its files are intact, so nothing is moved aside."""


class CheckpointSaveError(RuntimeError):
    """A save that did not commit; names the step, the directory, the cause and the last step that did commit."""

    def __init__(self, step: int, directory: str, reason: str, last_good: int | None):
        self.step, self.directory, self.reason, self.last_good = step, directory, reason, last_good
        good = f"step {last_good} is the last good checkpoint" if last_good is not None else "no checkpoint is saved"
        super().__init__(f"checkpoint step {step} could not be saved in {directory}: {reason}; {good}")


_OS_ERROR = re.compile(r"os_error_code='?(\d+)")


def _short_reason(e: BaseException, limit: int = 240) -> str:
    """One readable line for an exception from Orbax or TensorStore: the OS error by name where there is one, else
    the most specific status message in the exception's chain; JSON specs left out."""
    chain, seen, x = [], set(), e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        chain.append(x)
        x = x.__cause__ or x.__context__
    for x in chain:
        code = _OS_ERROR.search(str(x))
        if code:
            errno_ = int(code.group(1))
            path = (re.search(r'Failed (?:writing|reading): "([^"]+)"', str(x))
                    or re.search(r'at local file "([^"]+)"', str(x)))
            where = f" ({path.group(1)})" if path else ""
            return f"{os.strerror(errno_)} [errno {errno_}]{where}"[:limit]
        if isinstance(x, OSError) and x.errno:
            return f"{x.strerror} [errno {x.errno}]" + (f" ({x.filename})" if x.filename else "")
    status = [x for x in chain if re.match(r"[A-Z_]{4,}: ", _first_line(x))]
    x = status[0] if status else e
    line = _first_line(x, 10 * limit).split(" See full TensorStore")[0]
    line = re.sub(r"\{.*", "{...}", line) if "{" in line else line
    return (line if status else f"{type(x).__name__}: {line}")[:limit]


# ----------------------------------------------------------------------------------------------------------------------
# Checksums: two position-weighted sums of the array's bits, mod 2**32. Integer sums are exact and associative, so
# the value is the same however the array is sharded; the weights make it sensitive to where a bit flipped.

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _array_checksum(x: jax.Array) -> jax.Array:
    if x.dtype == jnp.bool_:
        bits = x.astype(jnp.uint32)
    else:
        bits = jax.lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize]).astype(jnp.uint32)
    bits = bits.reshape(-1)
    idx = jnp.arange(bits.shape[0], dtype=jnp.uint32)
    h1 = jnp.sum(bits * (2 * idx + 1), dtype=jnp.uint32)
    mixed = (bits ^ (idx * jnp.uint32(0x9E3779B9))) * jnp.uint32(0x85EBCA6B)
    h2 = jnp.sum(mixed ^ (mixed >> 13), dtype=jnp.uint32)
    return jnp.stack([h1, h2])


@functools.partial(jax.jit)
def _device_checksums(arrays: dict[str, jax.Array]) -> dict[str, jax.Array]:
    return {name: _array_checksum(x) for name, x in arrays.items()}


def checksums(flat: dict[str, Any]) -> dict[str, str]:
    """``{name: "<dtype>:<hex>"}`` for a flat dict of jax.Arrays (on device, any sharding) and NumPy values."""
    device = {n: x for n, x in flat.items() if isinstance(x, jax.Array) and x.dtype.itemsize <= 4}
    out: dict[str, str] = {}
    groups: dict[frozenset, dict[str, jax.Array]] = {}  # one jitted call per set of devices the arrays live on
    for name, x in device.items():
        groups.setdefault(frozenset(d.id for d in x.sharding.device_set), {})[name] = x
    for group in groups.values():
        for name, h in jax.device_get(_device_checksums(group)).items():
            out[name] = f"{device[name].dtype}:{int(h[0]):08x}{int(h[1]):08x}"
    for name, x in flat.items():
        if name not in out:
            a = np.ascontiguousarray(np.asarray(x))
            out[name] = f"{a.dtype}:" + hashlib.sha256(a.tobytes() + str(a.shape).encode()).hexdigest()[:16]
    return out


def _corrupt_summary(failures: list[CorruptCheckpointError]) -> str:
    """"steps 30, 20 are corrupt (step 30: <reason>)": the corrupt steps a reader met, newest first, in one line."""
    steps = ", ".join(str(e.step) for e in failures)
    noun = "step" if len(failures) == 1 else "steps"
    verb = "is" if len(failures) == 1 else "are"
    return f"checkpoint {noun} {steps} {verb} corrupt (step {failures[0].step}: {failures[0].reason})"


def _diff(names: list[str], limit: int = 5) -> str:
    if not names:
        return "nothing"
    return ", ".join(names[:limit]) + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def _bias_hint(missing: list[str], extra: list[str]) -> str:
    """The fix when the MoE router bias (model.router_bias) is all that differs, e.g. a moe-tiny run saved before
    the preset turned it on."""
    def biases(names):
        return bool(names) and all(n.endswith("router_bias_E']") for n in names)

    if biases(missing) and not extra:
        return ("; the checkpoint was saved without a router bias: resume it with model.router_bias=false "
                "model.router_bias_update_rate=0, or start_over=true")
    if biases(extra) and not missing:
        return "; the checkpoint was saved with a router bias: resume it with model.router_bias=true"
    return ""


class Checkpointer:
    """Orbax CheckpointManager wrapper: async save, atomic commit, retention, restore with target shardings.

    Args:
        directory: root directory; step ``N`` lives in ``directory/N`` (created if missing, unless `read_only`).
        keep: how many of the newest checkpoints to keep.
        keep_every: also keep every step that is a multiple of this (None: only the newest `keep`).
        async_save: write in a background thread (``save`` returns once the data is on the host).
        read_only: for a process that reads a run it does not hold (generate, serve, quantize, export, init_from):
            nothing on disk is created, cleaned up or moved, a corrupt step is skipped where it lies, and ``save``
            raises. The writer (the training run holding the run directory's lock) leaves it False.

    Example:
        >>> with Checkpointer("runs/x/checkpoints", read_only=True) as ckpt:
        ...     restored, meta, step = ckpt.restore_latest({"params": task.abstract_params_sharded()})
    """

    def __init__(
        self, directory: str | os.PathLike, *, keep: int = 3, keep_every: int | None = None, async_save: bool = True,
        read_only: bool = False,
    ):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        if keep_every is not None and keep_every < 1:
            raise ValueError(f"keep_every must be >= 1 or None, got {keep_every}")
        _quiet_orbax_logging()
        self.directory = os.path.abspath(os.fspath(directory))
        self.read_only = read_only
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=_manager_options(keep, keep_every, async_save, read_only),
            item_handlers={_PARAMS: ocp.PyTreeCheckpointHandler(), _STATE: ocp.PyTreeCheckpointHandler(),
                           _META: ocp.JsonCheckpointHandler()},
        )
        self._pending: int | None = None  # step of the last save started, until it is known to be committed
        self._closed = False
        steps = self._manager.all_steps()
        self.last_saved: int | None = max(steps) if steps else None  # the newest step known to be committed
        self._failed: CheckpointSaveError | None = None

    def save(self, step: int, state: Any, *, metadata: dict | None = None, force: bool = False) -> bool:
        """Starts saving `state` (a pytree of jax.Arrays, NumPy arrays, scalars) and `metadata` (a JSON-able dict).

        Returns whether a save was started: False, doing nothing, when `step` is already saved, or (unless `force`)
        when it is not newer than the latest step. Asynchronous: returns once the arrays have been copied off the
        devices, before anything is written; waits first for the previous save to finish.
        """
        step = int(step)
        if self.read_only:
            raise ValueError(f"this Checkpointer of {self.directory} is read_only: open it with read_only=False (only "
                             f"the process that holds the run directory may write to it)")
        self.wait()  # a failure of the previous save surfaces here, before another one starts
        if step in self._manager.all_steps() or (not force and not self._manager.should_save(step)):
            return False
        flat, _ = _flatten(state)
        flat = {name: _savable(name, leaf) for name, leaf in flat.items()}
        meta = json.loads(json.dumps(metadata or {}))  # fails here, not in the writer thread; a snapshot of the dict
        if _CHECKSUMS in meta:
            raise ValueError(f"metadata key {_CHECKSUMS!r} is reserved for the array checksums")
        meta[_CHECKSUMS] = checksums(flat)  # before save() returns: the caller may donate the buffers right after
        meta[_META_CHECKSUM] = _metadata_checksum(meta)
        by_item = {_PARAMS: {n[len(_PARAMS):]: x for n, x in flat.items() if _item_of(n) == _PARAMS},
                   _STATE: {n: x for n, x in flat.items() if _item_of(n) == _STATE}}
        args = ocp.args.Composite(**{item: ocp.args.PyTreeSave(tree) for item, tree in by_item.items() if tree},
                                  **{_META: ocp.args.JsonSave(meta)})
        try:
            started = self._manager.save(step, args=args, force=True)
        except Exception as e:  # noqa: BLE001 - the synchronous part: a directory that cannot be made, a full disk
            raise CheckpointSaveError(step, self.directory, _short_reason(e), self.last_saved) from e
        if started:
            self._pending = step
        return started

    def poll(self) -> int | None:
        """Without waiting: the step of the last save once it is known to be committed (returned once), else None.
        Raises CheckpointSaveError when that save failed."""
        if self._pending is None or self._manager.is_saving_in_progress():
            return None
        step = self._pending
        self.wait()
        return step

    def _committed(self) -> list[int]:
        steps = sorted(self._manager.all_steps())
        if self._pending is not None and self._manager.is_saving_in_progress():
            steps = [s for s in steps if s != self._pending]
        return steps

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        steps = self._committed()
        return steps[-1] if steps else None

    def all_steps(self) -> list[int]:
        """All committed steps still kept, ascending."""
        return self._committed()

    def restore(self, step: int | None, target: Any, *, verify: bool = True) -> tuple[Any, dict]:
        """Restores `step` (None: the latest) into the structure, shapes and shardings of `target`.

        `target` leaves are ``jax.ShapeDtypeStruct``s with a sharding (without one: the default device), concrete
        jax.Arrays (their shape/dtype/sharding are used) or NumPy arrays/scalars (restored on the host, same type).
        Returns ``(state, metadata)``. Waits for a pending save first. Raises FileNotFoundError if there is no such
        step, ValueError if the saved keys or shapes differ from the target's (a checkpoint of another model), and
        CorruptCheckpointError if the step cannot be read or (with `verify`) an array fails its checksum.
        """
        self.wait()
        available = self.all_steps()
        if step is None:
            if not available:
                raise FileNotFoundError(f"no checkpoint to restore in {self.directory}: available steps: []")
            step = available[-1]
        elif int(step) not in available:
            raise FileNotFoundError(
                f"checkpoint step {step} not found in {self.directory}: available steps: {available}"
            )
        return self._restore_step(int(step), target, verify)

    def restore_step_or_latest(self, step: int | None, target: Any) -> tuple[Any, dict, int]:
        """``(state, metadata, step)``: `restore(step, target)` for a given step, `restore_latest(target)` (the newest
        intact step, corrupt ones moved aside) for None."""
        if step is None:
            return self.restore_latest(target)
        state, meta = self.restore(step, target)
        return state, meta, step

    def restore_latest(self, target: Any, *, verify: bool = True) -> tuple[Any, dict, int]:
        """Restores the newest step that reads back intact: ``(state, metadata, step)``.

        A corrupt step is reported (a warning naming the step, directory and reason), moved aside to
        ``<step>.corrupt`` so that a later save of the same step is not refused, and the next older step is tried.
        Read-only, the corrupt steps stay where they are and one warning names them and the step used instead.
        Raises FileNotFoundError when there is no step, NoIntactCheckpointError when none is intact (naming the
        directory and the corrupt steps); a checkpoint of another model (IncompatibleCheckpointError) or one this
        process may not read (CheckpointPermissionError) is raised at once and nothing is moved.
        """
        self.wait()
        failures: list[CorruptCheckpointError] = []
        for step in reversed(self.all_steps()):
            self._check_readable(step)
            try:
                state, meta = self._restore_step(step, target, verify)
            except CorruptCheckpointError as e:
                failures.append(e)
                if not self.read_only:
                    _logger.warning("%s; falling back to an older step", e)
                    self._quarantine(step)
                continue
            if failures and self.read_only:
                _logger.warning("%s; using step %d, the newest intact one (nothing was moved: only the run that "
                                "holds this directory moves corrupt steps aside)", _corrupt_summary(failures), step)
            return state, meta, step
        if self.read_only and (failures or self.corrupt_steps()):
            kept = self.corrupt_steps()
            aside = f"; kept aside earlier: {', '.join(kept)}" if kept else ""
            found = f": {_corrupt_summary(failures)}" if failures else ""
            raise NoIntactCheckpointError(f"no intact checkpoint in {self.directory}{found}{aside}; nothing was "
                                          f"changed")
        if failures or self.corrupt_steps():
            raise NoIntactCheckpointError(
                f"no intact checkpoint in {self.directory}: {', '.join(self.corrupt_steps())} failed to read back "
                f"and are kept aside{(' (' + str(failures[0]) + ')') if failures else ''}")
        raise FileNotFoundError(f"no checkpoint to restore in {self.directory}: available steps: []")

    def corrupt_steps(self) -> list[str]:
        """Names of the step directories moved aside as corrupt (`<step>.corrupt`, `<step>.corrupt.<time>`)."""
        try:
            names = os.listdir(self.directory)
        except OSError:
            return []
        return sorted((n for n in names if ".corrupt" in n), key=lambda n: (int(n.split(".")[0]), n))

    def _check_readable(self, step: int) -> None:
        """CheckpointPermissionError naming the first file or directory of `step` this process may not read."""
        root = self._step_dir(step)

        def refuse(path: str):
            raise CheckpointPermissionError(f"checkpoint step {step}: {path} cannot be read by this user (permission "
                                            f"denied): fix it with chmod -R u+rX {root}")

        if not os.access(root, os.R_OK | os.X_OK):
            refuse(root)
        for here, dirs, files in os.walk(root, onerror=lambda e: refuse(e.filename or root)):
            for d in dirs:
                if not os.access(os.path.join(here, d), os.R_OK | os.X_OK):
                    refuse(os.path.join(here, d))
            for f in files:
                if not os.access(os.path.join(here, f), os.R_OK):
                    refuse(os.path.join(here, f))

    def _step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def _saved_keys(self, step: int) -> dict[str, tuple[str, str, Any]]:
        """{name: (item, stored name, array metadata)} of every array saved at `step`, whichever item holds it."""
        try:
            metadata = self._manager.item_metadata(step)
        except Exception as e:  # noqa: BLE001 - any failure to read the array index means an unreadable step
            raise CorruptCheckpointError(step, self.directory, f"cannot read the array index in "
                                         f"{self._step_dir(step)}: {_short_reason(e)}") from e
        saved: dict[str, tuple[str, str, Any]] = {}
        for item in _ARRAY_ITEMS:
            try:
                tree = metadata[item] if item in metadata else None
                if tree is None and os.path.isdir(os.path.join(self._step_dir(step), item)):
                    raise FileNotFoundError(f"the array index (_METADATA / manifest) of {item}/ is missing")
                entries = dict(tree.items()) if tree is not None else {}
            except Exception as e:  # noqa: BLE001
                raise CorruptCheckpointError(step, self.directory, f"cannot read the array index in "
                                             f"{self._step_dir(step)}/{item}: {_short_reason(e)}") from e
            saved.update({_canonical(item, name): (item, name, m) for name, m in entries.items()})
        if not saved:
            raise CorruptCheckpointError(step, self.directory, f"{self._step_dir(step)} holds no array index "
                                         f"(neither {_PARAMS}/ nor {_STATE}/ can be read)")
        return saved

    def _restore_step(self, step: int, target: Any, verify: bool) -> tuple[Any, dict]:
        where = self.directory
        flat_target, treedef = _flatten(target)
        saved = self._saved_keys(step)
        wanted = {_item_of(n) for n in flat_target}  # the items this target asks for: params, state or both
        missing = sorted(set(flat_target) - set(saved))
        extra = sorted(n for n in saved if n not in flat_target and _item_of(n) in wanted)
        if missing or extra:
            raise IncompatibleCheckpointError(
                f"checkpoint {self._step_dir(step)} does not match the target (a checkpoint of another model?): "
                f"not in checkpoint: {_diff(missing)}; not in target: {_diff(extra)}{_bias_hint(missing, extra)}"
            )
        wrong = [f"{n}: saved {tuple(saved[n][2].shape)}, target {tuple(np.shape(leaf))}"
                 for n, leaf in flat_target.items()
                 if getattr(saved[n][2], "shape", None) is not None
                 and tuple(saved[n][2].shape) != tuple(np.shape(leaf))]
        if wrong:
            raise IncompatibleCheckpointError(
                f"checkpoint {self._step_dir(step)} is of a model with another configuration: {_diff(wrong, 2)}; use "
                "the config.json of its run directory, or start a new run directory"
            )
        restore = {}
        for item in _ARRAY_ITEMS:
            abstract = {saved[n][1]: _abstract(n, leaf) for n, leaf in flat_target.items() if saved[n][0] == item}
            if abstract:
                complete = len(abstract) == sum(1 for it, _, _ in saved.values() if it == item)
                restore[item] = ocp.args.PyTreeRestore(
                    abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
                    partial_restore=not complete)
        args = ocp.args.Composite(**restore, **{_META: ocp.args.JsonRestore()})
        try:
            restored = self._manager.restore(step, args=args)
            meta = restored[_META]
            if not isinstance(meta, dict):
                raise ValueError(f"metadata is a {type(meta).__name__}, not a dict")
        except Exception as e:  # noqa: BLE001 - truncated files, missing manifests, garbled JSON all end up here
            raise CorruptCheckpointError(step, where, self._read_failure(step, restore, e)) from e
        flat = {_canonical(item, n): x for item in restore for n, x in restored[item].items()}
        meta = dict(meta)
        meta_sum = meta.pop(_META_CHECKSUM, None)
        if verify and meta_sum is not None and meta_sum != _metadata_checksum(meta):
            raise CorruptCheckpointError(step, where, f"the metadata in {self._step_dir(step)}/{_META} (data "
                                         f"position, seed, array checksums) does not match the checksum written "
                                         f"with it")
        expected = meta.pop(_CHECKSUMS, None)
        if expected is not None:
            expected = {_canonical(_STATE, n): h for n, h in expected.items()}
        if verify and expected is not None:
            got = checksums(flat)
            bad = [n for n, h in got.items() if n in expected and expected[n].split(":")[0] == h.split(":")[0]
                   and expected[n] != h]
            if bad:
                raise CorruptCheckpointError(step, where, f"array data of {_diff(bad, 3)} in {self._step_dir(step)}"
                                             f" does not match the checksum written with it")
        leaves = [_like(flat[name], leaf) for name, leaf in flat_target.items()]
        return jax.tree_util.tree_unflatten(treedef, leaves), meta

    def _read_failure(self, step: int, restore: dict, error: Exception) -> str:
        """Which array (or metadata file) of a step that failed to read is to blame, and why, in one line."""
        for item, args in restore.items():
            for name, abstract in args.item.items():
                one = {name: abstract}
                try:
                    self._manager.restore(step, args=ocp.args.Composite(**{item: ocp.args.PyTreeRestore(
                        one, restore_args=ocp.checkpoint_utils.construct_restore_args(one), partial_restore=True)}))
                except Exception as e:  # noqa: BLE001 - the first array that does not read is the answer
                    return f"array {_canonical(item, name)} in {self._step_dir(step)}/{item} cannot be read: " \
                           f"{_short_reason(e)}"
        return f"reading {self._step_dir(step)} failed: {_short_reason(error)}"

    def _quarantine(self, step: int) -> None:
        """Moves a corrupt step aside (kept for inspection) and makes Orbax forget it."""
        if jax.process_index() == 0:
            src = self._step_dir(step)
            dst = src + ".corrupt"
            if os.path.exists(dst):
                dst = f"{src}.corrupt.{int(time.time())}"
            try:
                os.rename(src, dst)
                _logger.warning("moved corrupt checkpoint %s to %s", src, dst)
            except OSError as e:
                _logger.warning("could not move corrupt checkpoint %s aside: %s", src, e)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"jaxperf_quarantine_{step}")
        self._manager.reload()

    def wait(self) -> None:
        """Blocks until pending asynchronous saves are committed (and old steps deleted); a save that failed raises
        CheckpointSaveError, and so does every later call (the checkpointer cannot be trusted to save again)."""
        if self._failed is not None:
            raise self._failed
        step, self._pending = self._pending, None
        try:
            self._manager.wait_until_finished()
            self._manager.check_for_errors()
        except Exception as e:  # noqa: BLE001 - whatever the writer thread hit: EFBIG, EACCES, ENOSPC...
            self._failed = CheckpointSaveError(step if step is not None else -1, self.directory, _short_reason(e),
                                               self.last_saved)
            raise self._failed from e
        if step is not None:
            self.last_saved = step

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Waits for pending saves (at most `timeout_s`), then releases Orbax's threads. Idempotent.

        Raises CheckpointSaveError when the last save failed or did not finish in time. After a failed save the
        writer threads are left as they are (their other writes may still be in flight): exit the process."""
        if self._closed:
            return
        self._closed = True
        if self._failed is not None:
            raise self._failed
        outcome: list[BaseException | None] = []

        def run():
            try:
                self.wait()
            except BaseException as e:  # noqa: BLE001 - handed to the caller below
                outcome.append(e)
                return
            try:
                self._manager.close()
            except BaseException as e:  # noqa: BLE001
                outcome.append(e)
            outcome.append(None)

        worker = threading.Thread(target=run, name="jaxperf-checkpoint-close", daemon=True)
        worker.start()
        worker.join(timeout_s)
        if worker.is_alive():
            raise CheckpointSaveError(self._pending or -1, self.directory, f"the checkpoint writer did not finish "
                                      f"within {timeout_s:.0f} s", self.last_saved)
        errors = [e for e in outcome if e is not None]
        if errors:
            raise errors[0]

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Checkpointer({self.directory!r}, steps={self.all_steps()})"
