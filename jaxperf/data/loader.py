"""Batches: stateless random windows, per-process rows, global jax.Arrays, and a background prefetcher.

Shapes: B global batch, b this process's rows, L sequence length.

The data pipeline of a training step is

    rows = process_rows(B)                                    # this process's share of the global batch
    host = dataset.batch(step, B, rows=rows)                  # numpy, pure function of (seed, step)
    batch = to_global_array(host, sharding, B)                # one global jax.Array per field
    with Prefetcher(lambda s: to_global_array(dataset.batch(s, B, rows=rows), sharding, B), start) as it:
        for step, batch in it: ...

Because a batch depends only on (seed, step), a run resumed at step k sees exactly the batches an uninterrupted run
would, whatever the number of processes.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable

import jax
import numpy as np


class DataError(RuntimeError):
    """The data changed or broke under a running job (e.g. a token file truncated); names the file and the fix."""


class TokenDataset:
    """Random windows of L + 1 tokens from a flat token array.

    Args:
        tokens: 1-D array of ids. A memmap of a token file is read window by window with `os.pread`, never through the
            mapping: a file truncated while a job runs then gives a DataError naming it, not a SIGBUS.
        seq_len: L, the model's sequence length.
        seed: data seed; with the step it fixes every batch.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int):
        if np.ndim(tokens) != 1:
            raise ValueError(f"tokens must be 1-D, got shape {np.shape(tokens)}")
        if seq_len < 1:
            raise ValueError(f"{seq_len=} must be >= 1")
        if seed < 0:
            raise ValueError(f"{seed=} must be >= 0")
        if len(tokens) < seq_len + 1:
            raise ValueError(
                f"the data has {len(tokens)} tokens, one sequence needs {seq_len + 1} (seq_len + 1); "
                "use a smaller seq_len or more data"
            )
        self.tokens = tokens
        self.seq_len = int(seq_len)
        self.seed = int(seed)
        self._file = None
        if isinstance(tokens, np.memmap) and getattr(tokens, "filename", None):
            fd = os.open(tokens.filename, os.O_RDONLY)
            self._file = (fd, tokens.filename, int(tokens.offset), tokens.dtype, os.fstat(fd).st_size)

    def __del__(self):
        if getattr(self, "_file", None) is not None:
            os.close(self._file[0])
            self._file = None

    def _windows(self, starts_b: np.ndarray) -> np.ndarray:
        """[b, L + 1] token windows beginning at `starts_b`."""
        if self._file is None:
            return np.asarray(self.tokens[starts_b[:, None] + np.arange(self.seq_len + 1)], dtype=np.int32)
        fd, name, offset, dtype, size = self._file
        n = (self.seq_len + 1) * dtype.itemsize
        out = np.empty((len(starts_b), self.seq_len + 1), np.int32)
        for i, start in enumerate(starts_b):
            data = os.pread(fd, n, offset + int(start) * dtype.itemsize)
            if len(data) != n:
                now = os.fstat(fd).st_size
                raise DataError(f"token file {name} shrank from {size} to {now} bytes while training (truncated or "
                                f"replaced?): restore it and start again; the run resumes from its last checkpoint")
            out[i] = np.frombuffer(data, dtype)
        return out

    def __len__(self) -> int:
        """Number of distinct window start positions."""
        return len(self.tokens) - self.seq_len

    def starts(self, step: int, batch_size: int) -> np.ndarray:
        """Start offsets int64[B] of the global batch at `step`: a pure function of (seed, step, batch_size)."""
        if step < 0:
            raise ValueError(f"{step=} must be >= 0")
        rng = np.random.default_rng([self.seed, int(step)])
        return rng.integers(0, len(self), size=batch_size, dtype=np.int64)

    def batch(self, step: int, batch_size: int, *, rows: slice | None = None) -> dict[str, np.ndarray]:
        """Rows `rows` of the global batch at `step`.

        Args:
            step: training step; the batch depends only on (seed, step).
            batch_size: B, the global batch size.
            rows: which rows of the global batch to materialise (e.g. `process_rows(B)`); all when None.

        Returns:
            {"inputs": int32[b, L], "targets": int32[b, L] (inputs shifted left by one), "mask": float32[b, L] (ones)}.
        """
        if batch_size < 1:
            raise ValueError(f"{batch_size=} must be >= 1")
        starts_b = self.starts(step, batch_size)
        if rows is not None:
            starts_b = starts_b[rows]
        window_bxL1 = self._windows(starts_b)
        return {
            "inputs": np.ascontiguousarray(window_bxL1[:, :-1]),
            "targets": np.ascontiguousarray(window_bxL1[:, 1:]),
            "mask": np.ones((len(starts_b), self.seq_len), np.float32),
        }


def process_rows(global_batch: int, process_index: int | None = None, process_count: int | None = None) -> slice:
    """This process's contiguous rows of the global batch.

    Args:
        global_batch: B.
        process_index, process_count: default to `jax.process_index()` and `jax.process_count()`.

    Returns:
        slice(i * B // P, (i + 1) * B // P).
    """
    pi = jax.process_index() if process_index is None else process_index
    pc = jax.process_count() if process_count is None else process_count
    if global_batch % pc:
        raise ValueError(
            f"{global_batch=} is not divisible by {pc} processes; use a global batch that is a multiple of {pc}"
        )
    if not 0 <= pi < pc:
        raise ValueError(f"process_index={pi} must lie in [0, {pc})")
    per = global_batch // pc
    return slice(pi * per, (pi + 1) * per)


def to_global_array(
    host_batch: dict[str, np.ndarray], sharding: jax.sharding.NamedSharding, global_batch: int
) -> dict[str, jax.Array]:
    """Assembles each process's rows into global jax.Arrays of shape [B, ...] laid out by `sharding`.

    Args:
        host_batch: this process's rows, each [b, ...] with b = B / process_count.
        sharding: the batch sharding, e.g. NamedSharding(mesh, PartitionSpec("data")).
        global_batch: B.

    Returns:
        the same keys, as global jax.Arrays.
    """
    out = {}
    for name, local in host_batch.items():
        expected = global_batch // jax.process_count()
        if local.shape[0] != expected:
            raise ValueError(
                f"{name!r} has {local.shape[0]} rows on this process, expected {global_batch=} / "
                f"{jax.process_count()} processes = {expected}; build it with rows=process_rows({global_batch})"
            )
        out[name] = jax.make_array_from_process_local_data(sharding, local, (global_batch, *local.shape[1:]))
    return out


class Prefetcher:
    """Iterates `(step, make_batch(step))` for step = start_step, start_step + 1, ..., built ahead in a thread.

    The thread keeps up to `depth` finished batches queued (double buffering with depth 2), so host work and the
    host-to-device copy overlap the running step. An exception in `make_batch` re-raises in the consumer; `close()`
    (or leaving the `with` block) stops the thread without waiting for the queue to drain.

    Args:
        make_batch: step -> batch (does the host work and the device transfer).
        start_step: first step to produce.
        depth: number of batches kept ready.
    """

    _POLL_S = 0.05

    def __init__(self, make_batch: Callable[[int], dict[str, jax.Array]], start_step: int, depth: int = 2):
        if depth < 1:
            raise ValueError(f"{depth=} must be >= 1")
        self._make_batch = make_batch
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(
            target=self._work, args=(int(start_step),), name="jaxperf-prefetch", daemon=True
        )
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=self._POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _work(self, step: int) -> None:
        while not self._stop.is_set():
            try:
                item = (step, self._make_batch(step), None)
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, who re-raises it
                self._put((step, None, e))
                return
            if not self._put(item):
                return
            step += 1

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> tuple[int, dict[str, jax.Array]]:
        while not self._done:
            try:
                step, batch, error = self._queue.get(timeout=self._POLL_S)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self._done = True  # closed from another thread
                continue
            if error is not None:
                self.close()
                raise error
            return step, batch
        raise StopIteration

    def close(self) -> None:
        """Stops the thread and drops queued batches; safe to call twice."""
        self._done = True
        self._stop.set()
        while True:  # free the queue so a blocked put returns at once
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
