"""What the training loop does besides stepping, one small object per concern, each with its own cadence.

    class PrintGradNorm(Hook):
        def __init__(self, every):
            self.every = every

        def on_metrics(self, loop, step, metrics):      # host metrics of `step`, read one step late
            print(step, metrics["grad_norm"])

    Trainer(cfg, hooks=[PrintGradNorm(every=50)]).fit()

A hook's methods are called by `jaxperf.train.trainer.Trainer.fit`:

  on_start(loop)                   once, after the state is restored or created
  on_metrics(loop, step, metrics)  with the host metrics of step `step` (1-based: steps done) when step % every == 0
                                   or it is the last step; read one step late, so the device always has work queued
  on_step(loop, step)              right after step `step` is dispatched, when step % every == 0 (loop.state is the
                                   state after it); may call loop.request_stop(reason)
  on_stop(loop, step)              when the run stops early at `step` (preemption, Ctrl-C)
  on_end(loop)                     once, after the last step (not after an exception)
  close()                          always, last: release files, signal handlers

The default hooks of a run (`default_hooks`) are numerical health, logging with throughput and MFU, evaluation,
checkpoints and preemption; `Trainer(hooks=[...])` adds more.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxperf.checkpoint import CheckpointSaveError
from jaxperf.perf.hardware import peak_flops
from jaxperf.train.rundir import RunDirError


def log(msg: str) -> None:
    """Print on the first process only."""
    if jax.process_index() == 0:
        print(msg, flush=True)


class Hook:
    """Base class: every method does nothing; `every` is the cadence of on_metrics and on_step."""

    every: int = 1

    def on_start(self, loop) -> None: ...

    def on_metrics(self, loop, step: int, metrics: dict[str, float]) -> None: ...

    def on_step(self, loop, step: int) -> None: ...

    def on_stop(self, loop, step: int) -> None: ...

    def on_end(self, loop) -> None: ...

    def close(self) -> None: ...


class MetricsWriteError(CheckpointSaveError):
    """run_dir/metrics.jsonl could not be written (a full disk, a read-only file system, a permission): the run
    saved a checkpoint where it could and stopped. A CheckpointSaveError, so it takes the same exit as a failed save
    (`jaxperf train` exits with status 3); the message names the file, the errno and the last good step."""

    def __init__(self, path: Path, step: int, error: OSError, *, saved: int | None, last_good: int | None,
                 save_failure: str | None = None):
        self.path, self.step, self.directory, self.last_good = Path(path), step, str(Path(path).parent), last_good
        self.reason = f"{error.strerror or error} [errno {error.errno}]"
        if saved is not None:
            after = (f"saved a checkpoint at step {saved}: fix that and run the same command again to continue from "
                     f"it")
        else:
            good = (f"step {last_good} is the last good checkpoint" if last_good is not None
                    else "no checkpoint is saved")
            after = f"the checkpoint could not be saved either ({save_failure}); {good}"
        RuntimeError.__init__(self, f"the record {path} could not be written at step {step}: {self.reason}; {after}")


class MetricsWriter:
    """JSON lines in run_dir/metrics.jsonl, plus TensorBoard events when tensorboardX is installed.

    Each record is built whole and handed to the kernel in one write (O_APPEND), so the file holds whole lines: a
    torn last line exists only when the process died inside that write, and `open` cuts it off (saying so) before
    the run appends again. A write that fails (ENOSPC, EROFS, EACCES...) writes nothing more and is kept in `error`
    as (step, OSError); the loop then saves a checkpoint and stops with MetricsWriteError. Only process 0 writes.
    """

    def __init__(self, run_dir: Path, tensorboard: bool):
        self.active = jax.process_index() == 0
        self.path = Path(run_dir) / "metrics.jsonl"
        self.tensorboard = tensorboard
        self.error: tuple[int, OSError] | None = None
        self.fd: int | None = None
        self.tb = None

    def open(self) -> str | None:
        """Open the file for appending (process 0; the others write nothing). A torn last line is cut off first;
        returns the one line that says so, else None. RunDirError when the file cannot be opened for writing."""
        if not self.active or self.fd is not None:
            return None
        try:
            note = _cut_torn_tail(self.path)
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            raise RunDirError(f"cannot write {self.path}: {e.strerror} [errno {e.errno}]: make it writable (chmod "
                              f"u+w) or choose another run_dir") from None
        if self.tensorboard:
            try:
                from tensorboardX import SummaryWriter  # an optional dependency
            except ImportError:
                SummaryWriter = None
            if SummaryWriter is not None:
                self.tb = SummaryWriter(str(self.path.parent / "tensorboard"))
        return note

    def write(self, step: int, record: dict[str, Any]) -> None:
        """Append {"step": step, **record} as one line (numbers as JSON numbers); nothing after a failed write."""
        if not self.active or self.error is not None:
            return
        if self.fd is None:
            self.open()
        clean = {k: (int(v) if isinstance(v, (np.integer, int)) else float(v) if isinstance(v, (np.floating, float))
                     else v) for k, v in record.items()}
        line = (json.dumps({"step": step, **clean}) + "\n").encode()
        try:
            _write_whole(self.fd, line)
        except OSError as e:
            self.error = (step, e)
            return
        if self.tb is not None:
            for k, v in clean.items():
                if isinstance(v, float):
                    self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None


def _write_whole(fd: int, data: bytes) -> None:
    """Write all of `data` at the end of the file; on an error, the part already written is taken back (best
    effort: on a file system gone read-only it stays, and the next start cuts it off)."""
    start = os.fstat(fd).st_size
    done = 0
    try:
        while done < len(data):
            done += os.write(fd, data[done:])
    except OSError:
        if done:
            try:
                os.ftruncate(fd, start)
            except OSError:
                pass
        raise


def _cut_torn_tail(path: Path) -> str | None:
    """Cut a last line that is not a whole JSON record (no newline: the process died inside its write; or not
    JSON) off `path`; a whole record missing only its newline gets it. Returns what was done, or None."""
    try:
        f = open(path, "r+b")  # noqa: SIM115
    except FileNotFoundError:
        return None
    with f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return None
        # The start of the last line: after the last newline before the file's final byte.
        end, start, chunk = size - 1, None, 1 << 16
        pos = end
        while start is None and pos > 0:
            lo = max(0, pos - chunk)
            f.seek(lo)
            buf = f.read(pos - lo)
            i = buf.rfind(b"\n")
            if i >= 0:
                start = lo + i + 1
            pos = lo
        start = start or 0
        f.seek(start)
        tail = f.read()
        try:
            whole = isinstance(json.loads(tail), dict)
        except ValueError:
            whole = False
        if whole and tail.endswith(b"\n"):
            return None
        if whole:
            f.write(b"\n")
            return None
        f.truncate(start)
    return (f"{path}: cut off a torn last line ({len(tail)} bytes, not a whole record: the run stopped while writing "
            f"it); the record continues from the resumed step")


class Progress:
    """A one-line progress bar on a terminal, periodic plain lines otherwise."""

    def __init__(self, total: int):
        self.total = total
        self.tty = sys.stdout.isatty() and jax.process_index() == 0
        self.open = False

    def update(self, step: int, text: str) -> None:
        frac = step / max(self.total, 1)
        bar = "#" * int(24 * frac) + "." * (24 - int(24 * frac))
        line = f"step {step:>6}/{self.total} [{bar}] {text}"
        if self.tty:
            print("\r" + line, end="", flush=True)
            self.open = True
        else:
            log(line)

    def close(self) -> None:
        if self.open:
            print(flush=True)
            self.open = False


# ---------------------------------------------------------------------------------------------------------------------
# The default hooks


class HealthHook(Hook):
    """Reports skipped steps (non-finite or spiking loss) and stops the run after `max_consecutive` in a row."""

    def __init__(self, max_consecutive: int):
        self.max_consecutive = max_consecutive

    def on_metrics(self, loop, step, m):
        if not m.get("skipped"):
            return
        loop.writer.write(step, {"skipped_step": 1.0, "loss": m["loss"], "grad_norm": m["grad_norm"]})
        loop.log(f"step {step}: update skipped (loss {m['loss']}, grad norm {m['grad_norm']}), "
                 f"{int(m['consecutive_skips'])} in a row")
        if m["consecutive_skips"] >= self.max_consecutive:
            saved = loop.checkpointer.latest_step() if loop.checkpointer is not None else None
            where = (f"the newest checkpoint (step {saved}) holds the last good state" if saved is not None
                     else "no checkpoint was saved yet")
            raise FloatingPointError(
                f"{int(m['consecutive_skips'])} consecutive steps were skipped for a non-finite or spiking loss (the "
                f"last at step {step}); stopping, {where}: lower the learning rate, check the data near step {step}, "
                f"or raise max_consecutive_skips")


class LogHook(Hook):
    """Every `every` steps: loss, tokens/s, step time and MFU to metrics.jsonl and the progress line."""

    def __init__(self, every: int, *, tokens_per_step: int, flops_per_token: float | None, dtype: str,
                 n_devices: int):
        self.every, self.tokens_per_step = every, tokens_per_step
        self.flops_per_token, self.n_devices = flops_per_token, n_devices
        self.peak, self.peak_source = peak_flops(dtype)
        self.t_last = self.step_last = None

    def on_start(self, loop):
        loop.summary.update(peak_flops=self.peak, peak_source=self.peak_source)
        self.mark(loop.start)

    def mark(self, step: int) -> None:
        """Start timing from now at `step` (after compilation, or after an evaluation that should not count)."""
        self.t_last, self.step_last = time.perf_counter(), step

    def on_metrics(self, loop, step, m):
        now = time.perf_counter()
        dt = (now - self.t_last - loop.paused_s) / max(step - self.step_last, 1)
        self.t_last, self.step_last, loop.paused_s = now, step, 0.0
        tps = self.tokens_per_step / dt
        record = {**m, "step_time": dt, "tokens_per_sec": tps}
        if self.flops_per_token:
            record["mfu"] = tps * self.flops_per_token / (self.peak * self.n_devices)
            loop.summary["mfu"] = record["mfu"]
        loop.summary["tokens_per_sec"] = tps
        loop.writer.write(step, record)
        mfu = f" mfu {100 * record['mfu']:.1f}%" if "mfu" in record else ""
        loop.progress.update(step, f"loss {m['loss']:.4f} | {tps:,.0f} tok/s | {1e3 * dt:.0f} ms/step{mfu}")


class EvalHook(Hook):
    """Every `every` steps: the validation loss over the trainer's eval batches (time excluded from tokens/s)."""

    def __init__(self, every: int):
        self.every = every

    def on_step(self, loop, step):
        t0 = time.perf_counter()
        loop.read_metrics()  # the metrics of this step first, so the log stays in step order
        val = loop.trainer.evaluate(loop.usual_state())
        loop.writer.write(step, {"val_loss": val})
        loop.log(f"step {step}: val_loss {val:.4f}")
        loop.paused_s += time.perf_counter() - t0


class CheckpointHook(Hook):
    """Every `interval` steps (and at the end, and when the run stops early): a checkpoint of the state and data
    position; `interval` 0 saves only at the end. After every step it checks, without waiting, whether the last save
    committed: a failed save raises CheckpointSaveError at the next step, which stops the run."""

    every = 1

    def __init__(self, interval: int):
        self.interval = interval or 0

    def on_step(self, loop, step):
        saved = loop.checkpointer.poll()
        if saved is not None:
            loop.log(f"checkpoint step {saved} saved in {loop.checkpointer.directory}")
        if self.interval and step % self.interval == 0 and step < loop.max_steps:
            loop.save(step)

    def on_stop(self, loop, step):
        loop.save(step, force=True)
        loop.checkpointer.wait()  # confirmed before it is reported
        loop.log(f"{loop.stop_reason}: saved a checkpoint at step {step} in {loop.checkpointer.directory}; run the "
                 "same command again to continue")

    def on_end(self, loop):
        step = int(jax.device_get(loop.usual_state().step))
        if step > 0:
            loop.save(step, data_step=loop.data_step, force=True)


class StopRequest:
    """Turns SIGTERM and Ctrl-C into "save at the next step and exit cleanly".

    One process: the signal handler sets a flag the loop reads after each step. Several processes: all of them must
    save the same step, so the loop asks JAX's preemption sync point (`reached_preemption_sync_point`), which the
    coordination service triggers on a SIGTERM to any process (and on a TPU maintenance notice) and which answers
    True on every process at the same step. A second Ctrl-C interrupts at once (KeyboardInterrupt).
    Handlers are installed only from the main thread, and the previous ones are put back on exit.

    Python runs a signal handler between any two bytecodes of the main thread, so the KeyboardInterrupt can land where
    exceptions are only reported, never raised: in a garbage-collector callback (JAX registers one), a `__del__`, a
    weakref callback. While installed, the handler also watches sys.unraisablehook: such a swallowed KeyboardInterrupt
    is not printed but raised again (the signal re-sent from a thread while the handler is still installed), so a
    second Ctrl-C is not lost that way (one that code catches with `except BaseException` still is).
    """

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.reason: str | None = None
        self._previous: dict[int, Any] = {}
        self._previous_unraisable: Any = None
        self._resend: threading.Timer | None = None

    def __enter__(self) -> StopRequest:
        if self._previous or not self.enabled or threading.current_thread() is not threading.main_thread():
            return self  # (installed already: entered twice)
        signals = [signal.SIGINT]
        if jax.process_count() == 1:  # with several processes JAX's preemption notifier owns SIGTERM
            signals.append(signal.SIGTERM)
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        self._previous_unraisable, sys.unraisablehook = sys.unraisablehook, self._unraisable
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self._resend is not None:
            self._resend.cancel()
        if self._previous_unraisable is not None:
            sys.unraisablehook, self._previous_unraisable = self._previous_unraisable, None

    def _unraisable(self, info) -> None:
        if info.exc_type is KeyboardInterrupt and self.reason is not None and self._previous_unraisable is not None:
            # Sent again a moment later from another thread: handled once the main thread is back in code that can
            # raise (sent from here, the handler would run at once, still inside this hook).
            self._resend = threading.Timer(0.05, self._send_again)
            self._resend.daemon = True
            self._resend.start()
            return
        (self._previous_unraisable or sys.__unraisablehook__)(info)

    def _send_again(self) -> None:
        if self._previous_unraisable is not None:  # still installed: after `__exit__` the stop has been handled
            os.kill(os.getpid(), signal.SIGINT)

    def _handle(self, signum, frame) -> None:
        if self.reason is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.reason = "interrupted (Ctrl-C)" if signum == signal.SIGINT else "terminated (SIGTERM)"
        print(f"\n{self.reason}: stopping after the current step (Ctrl-C again to stop at once)", file=sys.stderr,
              flush=True)

    def agreed(self, step: int) -> bool:
        """Whether to stop after `step`: the same answer on every process."""
        if not self.enabled:
            return False
        if jax.process_count() > 1:
            if multihost_utils.reached_preemption_sync_point(step):
                self.reason = self.reason or "preempted"
                return True
            return False
        return self.reason is not None


class PreemptionHook(Hook):
    """After every step: stop (saving a checkpoint) when SIGTERM, Ctrl-C or a preemption notice arrived."""

    def __init__(self, enabled: bool):
        self.request = StopRequest(enabled)

    def on_start(self, loop):
        self.request.__enter__()

    def on_step(self, loop, step):
        if self.request.agreed(step) and step < loop.max_steps:
            loop.request_stop(self.request.reason)

    def close(self):
        self.request.__exit__()


def default_hooks(cfg, *, tokens_per_step: int, flops_per_token: float | None, n_devices: int,
                  evaluate: bool) -> list[Hook]:
    """The hooks every run gets, in the order they run at a step: preemption (a stop skips the rest of the step's
    hooks), health, logging, evaluation (off with eval_every=0 or eval_batches=0, the latter said once),
    checkpoints."""
    hooks: list[Hook] = [
        PreemptionHook(cfg.handle_signals),
        HealthHook(cfg.max_consecutive_skips),
        LogHook(cfg.log_every, tokens_per_step=tokens_per_step, flops_per_token=flops_per_token,
                dtype=cfg.model.dtype, n_devices=n_devices),
    ]
    if evaluate and cfg.eval_every and cfg.eval_batches:
        hooks.append(EvalHook(cfg.eval_every))
    elif evaluate and cfg.eval_every:  # no batch to measure a validation loss on: none is logged
        log(f"eval_batches=0: evaluation is off (no val_loss is measured or logged); set eval_batches to 1 or more "
            f"to evaluate every {cfg.eval_every} steps, or eval_every=0 to say it is off")
    hooks.append(CheckpointHook(cfg.checkpoint_every))
    return hooks
