"""One error discipline for every `jaxperf` command: a user error is one line, a traceback is a bug.

Every command runs through `run_command`. A mistake of the user or of the environment (a flag or setting out of
range, a path that cannot be used, a checkpoint that cannot be read, a port in use) ends the command with one line on
stderr, `jaxperf COMMAND: <the flag or setting, its value, the fix>`, and one of these exit statuses:

    0    done (train: also stopped by SIGTERM or one Ctrl-C after saving)
    1    ran, with a negative answer: `compile` (the step does not fit the chip), `bench` (a benchmark failed)
    2    refused: a flag, a setting, a path, a checkpoint or a port that cannot be used; nothing was written
    3    an output could not be written: a checkpoint save (train), a disk full, a file too large, an I/O error
    4    train stopped on numerical trouble or on data that changed under it
    130  stopped by Ctrl-C (train: by a second Ctrl-C, without saving)
    141  the reader of its output went away (`jaxperf info | head -1`): nothing is printed about it

Commands raise `CommandError` for their own flags; the library's error types (`REFUSALS`, `OSError`) are turned
into the same line here, so no command copies a try/except of its own.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from collections.abc import Callable, Iterator

from jaxperf.checkpoint import (CheckpointPermissionError, CheckpointSaveError, CorruptCheckpointError,
                                IncompatibleCheckpointError, NoIntactCheckpointError)
from jaxperf.config import ConfigError
from jaxperf.data.loader import DataError
from jaxperf.interop import HFCheckpointError
from jaxperf.train.rundir import RunDirError
from jaxperf.train.topology import TopologyError

OK, NEGATIVE, REFUSED, WRITE_FAILED, STOPPED, INTERRUPTED, PIPE_CLOSED = 0, 1, 2, 3, 4, 130, 141

# The library's errors that are the user's (or the environment's) to fix; each message names the path or setting.
REFUSALS: tuple[type[BaseException], ...] = (
    ConfigError, DataError, RunDirError, TopologyError, HFCheckpointError, IncompatibleCheckpointError,
    CorruptCheckpointError, NoIntactCheckpointError, CheckpointPermissionError,
)
# OSErrors that say a path given cannot be used as asked (exit 2); any other (a full disk, a file too large, an I/O
# error) is a write that failed (exit 3).
_PATH_ERRNOS = frozenset({errno.ENOENT, errno.EEXIST, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EISDIR,
                          errno.EROFS, errno.ENOTEMPTY, errno.ENAMETOOLONG, errno.ELOOP, errno.EADDRINUSE,
                          errno.EADDRNOTAVAIL})


class CommandError(Exception):
    """A user error a command reports in one line (the flag, its value and the fix), ending it with `code`."""

    def __init__(self, message: str, code: int = REFUSED):
        super().__init__(message)
        self.code = code


def one_line(text: str) -> str:
    """`text` on one line: its lines joined with spaces."""
    return " ".join(line.strip() for line in str(text).splitlines() if line.strip())


def describe_os_error(e: OSError) -> str:
    """`path: Permission denied [errno 13]` for an OSError from the system; its own message for one raised by code."""
    if e.errno is None or e.strerror is None:
        return str(e)
    where = f"{e.filename}: " if e.filename is not None else ""
    if e.filename2 is not None:
        where = f"{e.filename} -> {e.filename2}: "
    return f"{where}{e.strerror} [errno {e.errno}]"


def os_error_code(e: OSError) -> int:
    """2 for a path that cannot be used as asked (or an error raised with a message), 3 for a write that failed."""
    return REFUSED if e.errno is None or e.errno in _PATH_ERRNOS else WRITE_FAILED


def fail(command: str, message: str, code: int) -> int:
    """Print `jaxperf COMMAND: message` as one line on stderr; returns `code`."""
    with contextlib.suppress(OSError):  # stdout may be a closed pipe
        sys.stdout.flush()
    print(f"jaxperf {command}: {one_line(message)}", file=sys.stderr, flush=True)
    return code


@contextlib.contextmanager
def refused(*types: type[BaseException], prefix: str = "") -> Iterator[None]:
    """Turn the given exception types (a library call's documented ValueError, say) into a CommandError (exit 2)."""
    try:
        yield
    except types as e:
        raise CommandError(prefix + str(e)) from None


def run_command(command: str, main: Callable[[list[str]], int | None], argv: list[str]) -> int:
    """Run `main(argv)`, turning user errors into one line and an exit status (see the module docstring).

    argparse's own usage errors (SystemExit 2) pass through; anything else is a bug and keeps its traceback.
    """
    try:
        return int(main(argv) or 0)
    except BrokenPipeError:
        # Whoever read stdout has gone: say nothing, and keep Python's exit from failing to flush it again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return PIPE_CLOSED
    except CommandError as e:
        return fail(command, str(e), e.code)
    except CheckpointSaveError as e:
        return fail(command, str(e), WRITE_FAILED)
    except REFUSALS as e:
        return fail(command, str(e), REFUSED)
    except OSError as e:
        return fail(command, describe_os_error(e), os_error_code(e))
    except KeyboardInterrupt:
        return fail(command, "interrupted (Ctrl-C)", INTERRUPTED)


__all__ = ["INTERRUPTED", "NEGATIVE", "OK", "PIPE_CLOSED", "REFUSALS", "REFUSED", "STOPPED", "WRITE_FAILED", "CommandError",
           "describe_os_error", "fail", "one_line", "os_error_code", "refused", "run_command"]
