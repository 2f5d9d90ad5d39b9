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
- **Metadata.** A small JSON dict (data position, config...) is saved as a second Orbax item inside the same step
  directory, so it is committed atomically with the arrays.

Orbax facts this relies on (0.12.8): saves go to a temporary directory that is renamed on commit; device-to-host
copies happen before ``save`` returns (buffers may be donated right after), the writes happen in a background thread.
Like every Orbax call, ``save``/``restore``/``wait`` must be called by all processes of a multi-process job.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

__all__ = ["Checkpointer"]

_STATE, _META = "state", "meta"  # Orbax item names inside each step directory.
_SCALARS = (bool, int, float, np.generic)


class _DropOrbaxInfo(logging.Filter):
    """Drops Orbax's INFO/DEBUG chatter (it logs a dozen lines per save through absl); keeps its warnings."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or f"{os.sep}orbax{os.sep}" not in record.pathname


def _quiet_orbax_logging() -> None:
    logger = logging.getLogger("absl")  # absl.logging, which Orbax uses, forwards to this stdlib logger.
    if not any(isinstance(f, _DropOrbaxInfo) for f in logger.filters):
        logger.addFilter(_DropOrbaxInfo())


def _manager_options(keep: int, keep_every: int | None, async_save: bool) -> ocp.CheckpointManagerOptions:
    """Retention = the newest `keep` steps plus every multiple of `keep_every`."""
    common = dict(enable_async_checkpointing=async_save, create=True, cleanup_tmp_directories=True)
    policies = getattr(ocp, "checkpoint_managers", None)
    if policies is not None and hasattr(policies, "AnyPreservationPolicy"):
        keepers = [policies.LatestN(n=keep)]
        if keep_every is not None:
            keepers.append(policies.EveryNSteps(interval_steps=keep_every))
        return ocp.CheckpointManagerOptions(preservation_policy=policies.AnyPreservationPolicy(keepers), **common)
    # Older Orbax without preservation policies: the (later deprecated) options that mean the same.
    return ocp.CheckpointManagerOptions(max_to_keep=keep, keep_period=keep_every, **common)  # pragma: no cover


def _flatten(tree: Any) -> tuple[dict[str, Any], jax.tree_util.PyTreeDef]:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(path): leaf for path, leaf in leaves}, treedef


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


def _diff(names: list[str], limit: int = 5) -> str:
    if not names:
        return "nothing"
    return ", ".join(names[:limit]) + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


class Checkpointer:
    """Orbax CheckpointManager wrapper: async save, atomic commit, retention, restore with target shardings.

    Args:
        directory: root directory; step ``N`` lives in ``directory/N`` (created if missing).
        keep: how many of the newest checkpoints to keep.
        keep_every: also keep every step that is a multiple of this (None: only the newest `keep`).
        async_save: write in a background thread (``save`` returns once the data is on the host).
    """

    def __init__(
        self, directory: str | os.PathLike, *, keep: int = 3, keep_every: int | None = None, async_save: bool = True
    ):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        if keep_every is not None and keep_every < 1:
            raise ValueError(f"keep_every must be >= 1 or None, got {keep_every}")
        _quiet_orbax_logging()
        self.directory = os.path.abspath(os.fspath(directory))
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=_manager_options(keep, keep_every, async_save),
            item_handlers={_STATE: ocp.StandardCheckpointHandler(), _META: ocp.JsonCheckpointHandler()},
        )
        self._pending: int | None = None  # step of the last save started, until it is known to be committed
        self._closed = False

    def save(self, step: int, state: Any, *, metadata: dict | None = None, force: bool = False) -> bool:
        """Starts saving `state` (a pytree of jax.Arrays, NumPy arrays, scalars) and `metadata` (a JSON-able dict).

        Returns whether a save was started: False, doing nothing, when `step` is already saved, or (unless `force`)
        when it is not newer than the latest step. Asynchronous: returns once the arrays have been copied off the
        devices, before anything is written; waits first for the previous save to finish.
        """
        step = int(step)
        if step in self._manager.all_steps() or (not force and not self._manager.should_save(step)):
            return False
        flat, _ = _flatten(state)
        flat = {name: _savable(name, leaf) for name, leaf in flat.items()}
        meta = json.loads(json.dumps(metadata or {}))  # fails here, not in the writer thread; a snapshot of the dict
        args = ocp.args.Composite(**{_STATE: ocp.args.StandardSave(flat), _META: ocp.args.JsonSave(meta)})
        started = self._manager.save(step, args=args, force=True)
        if started:
            self._pending = step
        return started

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

    def restore(self, step: int | None, target: Any) -> tuple[Any, dict]:
        """Restores `step` (None: the latest) into the structure, shapes and shardings of `target`.

        `target` leaves are ``jax.ShapeDtypeStruct``s with a sharding (without one: the default device), concrete
        jax.Arrays (their shape/dtype/sharding are used) or NumPy arrays/scalars (restored on the host, same type).
        Returns ``(state, metadata)``. Waits for a pending save first. Raises FileNotFoundError if there is no such
        step, ValueError if the saved keys or shapes differ from the target's.
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
        step = int(step)
        flat_target, treedef = _flatten(target)
        saved = set(self._manager.item_metadata(step)[_STATE].keys())
        missing, extra = sorted(set(flat_target) - saved), sorted(saved - set(flat_target))
        if missing or extra:
            raise ValueError(
                f"checkpoint {self.directory}/{step} does not match the target: "
                f"not in checkpoint: {_diff(missing)}; not in target: {_diff(extra)}"
            )
        abstract = {name: _abstract(name, leaf) for name, leaf in flat_target.items()}
        args = ocp.args.Composite(**{_STATE: ocp.args.StandardRestore(abstract), _META: ocp.args.JsonRestore()})
        restored = self._manager.restore(step, args=args)
        flat = restored[_STATE]
        leaves = [_like(flat[name], leaf) for name, leaf in flat_target.items()]
        return jax.tree_util.tree_unflatten(treedef, leaves), dict(restored[_META] or {})

    def wait(self) -> None:
        """Blocks until pending asynchronous saves are committed (and old steps deleted); re-raises their errors."""
        self._manager.wait_until_finished()
        self._manager.check_for_errors()
        self._pending = None

    def close(self) -> None:
        """Waits for pending saves, then releases Orbax's threads. Idempotent."""
        if not self._closed:
            self._closed = True
            self._manager.close()
            self._pending = None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Checkpointer({self.directory!r}, steps={self.all_steps()})"
