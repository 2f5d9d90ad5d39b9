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
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxperf.perf.hardware import peak_flops


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


class MetricsWriter:
    """JSON lines in run_dir/metrics.jsonl, plus TensorBoard events when tensorboardX is installed."""

    def __init__(self, run_dir: Path, tensorboard: bool):
        self.active = jax.process_index() == 0
        self.file = open(run_dir / "metrics.jsonl", "a") if self.active else None  # noqa: SIM115
        self.tb = None
        if self.active and tensorboard:
            try:
                from tensorboardX import SummaryWriter  # an optional dependency
            except ImportError:
                SummaryWriter = None
            if SummaryWriter is not None:
                self.tb = SummaryWriter(str(run_dir / "tensorboard"))

    def write(self, step: int, record: dict[str, Any]) -> None:
        if not self.active:
            return
        clean = {k: (int(v) if isinstance(v, (np.integer, int)) else float(v) if isinstance(v, (np.floating, float))
                     else v) for k, v in record.items()}
        self.file.write(json.dumps({"step": step, **clean}) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in clean.items():
                if isinstance(v, float):
                    self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.file:
            self.file.close()
            self.file = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None


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
    """

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.reason: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        if not self.enabled or threading.current_thread() is not threading.main_thread():
            return self
        signals = [signal.SIGINT]
        if jax.process_count() == 1:  # with several processes JAX's preemption notifier owns SIGTERM
            signals.append(signal.SIGTERM)
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

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
    hooks), health, logging, evaluation, checkpoints."""
    hooks: list[Hook] = [
        PreemptionHook(cfg.handle_signals),
        HealthHook(cfg.max_consecutive_skips),
        LogHook(cfg.log_every, tokens_per_step=tokens_per_step, flops_per_token=flops_per_token,
                dtype=cfg.model.dtype, n_devices=n_devices),
    ]
    if evaluate and cfg.eval_every:
        hooks.append(EvalHook(cfg.eval_every))
    hooks.append(CheckpointHook(cfg.checkpoint_every))
    return hooks
