"""A run directory has one writer at a time and describes its own checkpoints.

    with RunDir(cfg.run_dir) as run:          # the lock: a second `jaxperf train` on the same run_dir is refused
        run.check_writable()
        run.record_config(cfg_dict, step)     # config.json only after the resume check; changes kept in history

- **Lock.** `run_dir/.lock` is held with `fcntl.flock` for the life of the process and names its holder (host, pid,
  start time). A second process on the same host gets a RunDirError naming the holder. A lock left by a process
  that died is released by the kernel with it, so a crash never blocks the next start; on another host the file
  names the holder and the error says how to check it.
- **Config.** `config.json` describes the checkpoints in `checkpoints/`. It is written only after the resume check
  passed; a resume that changes settings appends the old and new values to `config_history.jsonl` (with the step
  the change took effect at) before config.json is replaced, so what earlier steps were trained with stays on record.
- **Starting over.** `resume=false` on a run_dir that holds checkpoints is refused; `start_over=true` moves the
  checkpoints, metrics and config into `run_dir/previous/<time>/` first (nothing is deleted).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

LOCK_NAME = ".lock"
HISTORY_NAME = "config_history.jsonl"
RUN_FILES = ("checkpoints", "config.json", "metrics.jsonl", "tensorboard", HISTORY_NAME)


class RunDirError(RuntimeError):
    """The run directory cannot be used as asked; the message names the path and the fix."""


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{dotted key: value}, a tuple as the list config.json holds (a config read back compares equal to its own)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v
    return out


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{dotted key: (old value, new value)} for every setting that differs between two config dicts."""
    a, b = _flatten(old), _flatten(new)
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


class RunDir:
    """One run directory, locked for this process while the context is open (process 0 of a job holds the lock)."""

    def __init__(self, path: str | os.PathLike, *, lock: bool = True):
        self.path = Path(path)
        self.lock = lock
        self._fd: int | None = None

    # ----------------------------------------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Create the directory; RunDirError when it is a file or cannot be written."""
        if self.path.exists() and not self.path.is_dir():
            raise RunDirError(f"run_dir {self.path} is a file, not a directory: choose another run_dir")
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RunDirError(f"cannot create run_dir {self.path}: {e.strerror}: choose a writable run_dir") from None
        if not os.access(self.path, os.W_OK | os.X_OK):
            raise RunDirError(f"run_dir {self.path} is not writable by this user: fix its permissions or choose "
                              f"another run_dir")
        ckpt = self.path / "checkpoints"
        if ckpt.exists() and not os.access(ckpt, os.R_OK | os.W_OK | os.X_OK):
            raise RunDirError(f"{ckpt} cannot be read and written by this user: fix its permissions (chmod u+rwx)")

    def acquire(self) -> None:
        """Take the lock or raise RunDirError naming the process that holds it."""
        if not self.lock or self._fd is not None:
            return
        self.prepare()
        lock_path = self.path / LOCK_NAME
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise RunDirError(f"run_dir {self.path} is in use by {self.holder() or 'another process'}: wait for it "
                              f"to finish, or train in another run_dir") from None
        previous = self.holder()
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                 "started": time.strftime("%Y-%m-%dT%H:%M:%S")}).encode())
        os.fsync(fd)
        self._fd = fd
        self.stale_holder = previous  # a holder recorded by a process that is gone (its lock died with it)

    def holder(self) -> str | None:
        """"pid P on host H since T" of the lock file's last writer, or None."""
        try:
            info = json.loads((self.path / LOCK_NAME).read_text() or "{}")
        except (OSError, ValueError):
            return None
        if not info:
            return None
        return f"pid {info.get('pid')} on host {info.get('host')} (since {info.get('started')})"

    def release(self) -> None:
        if self._fd is not None:
            try:
                os.ftruncate(self._fd, 0)
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            finally:
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> RunDir:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    # ----------------------------------------------------------------------------------------------------------------
    def has_run(self) -> bool:
        """Whether anything of an earlier run is here (checkpoints, corrupt checkpoints or metrics)."""
        ckpt = self.path / "checkpoints"
        return (ckpt.is_dir() and any(ckpt.iterdir())) or (self.path / "metrics.jsonl").exists()

    def start_over(self) -> Path | None:
        """Move an earlier run's files into run_dir/previous/<time>/ (nothing is deleted); returns where, or None."""
        present = [name for name in RUN_FILES if (self.path / name).exists()]
        if not present:
            return None
        dest = self.path / "previous" / time.strftime("%Y%m%d-%H%M%S")
        n = 0
        while dest.exists():
            n += 1
            dest = dest.with_name(f"{dest.name.split('.')[0]}.{n}")
        dest.mkdir(parents=True)
        for name in present:
            os.rename(self.path / name, dest / name)
        return dest

    def saved_config(self) -> dict[str, Any] | None:
        """The config.json of the run here, or None."""
        path = self.path / "config.json"
        if not path.exists():
            return None
        try:
            return json.loads(path.read_text())
        except ValueError as e:
            raise RunDirError(f"{path} is not valid JSON ({e}): restore it, or start over with start_over=true") \
                from None

    def record_config(self, cfg_dict: dict[str, Any], step: int) -> dict[str, tuple[Any, Any]]:
        """Write config.json; when it replaces another one, append the differences to config_history.jsonl first.

        Returns the changes (empty for a new run or an unchanged config)."""
        old = self.saved_config()
        changes = config_changes(old, cfg_dict) if old is not None else {}
        if changes:
            entry = {"step": int(step), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                     "changes": {k: {"old": a, "new": b} for k, (a, b) in changes.items()}}
            with open(self.path / HISTORY_NAME, "a") as f:
                f.write(json.dumps(entry) + "\n")
                f.flush()
                os.fsync(f.fileno())
        tmp = self.path / "config.json.tmp"
        tmp.write_text(json.dumps(cfg_dict, indent=1))
        os.replace(tmp, self.path / "config.json")
        return changes
