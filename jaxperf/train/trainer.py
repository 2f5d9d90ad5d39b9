"""The training loop: data -> sharded step -> metrics one step late -> eval, checkpoints, a sample at the end.

    trainer = Trainer(get_config("tiny"))                 # the built-in GPT on the default corpus
    trainer = Trainer(cfg, make_model=MyModel, loss_fn=my_loss, train_data=ds)   # research code brings its own
    summary = trainer.fit()

The host never waits on the device inside the loop: step n is dispatched before the metrics of step n-1 are read, so
the device always has the next step queued. Checkpoints hold the train state and the data position; since batches are
a pure function of (seed, step), resuming at step n sees exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxperf.config import TrainConfig, mesh_shape, to_dict, validate
from jaxperf.parallel.mesh import make_mesh
from jaxperf.parallel.rules import get_rules
from jaxperf.parallel.sharding import check_sharding, format_report
from jaxperf.perf.flops import flops_per_token
from jaxperf.perf.hardware import peak_flops
from jaxperf.explicit.flavours import FlavouredStep, build_train_step, check_flavour
from jaxperf.step.health import HealthOptions
from jaxperf.step.optimizer import make_optimizer
from jaxperf.step.task import LossFn, Task, TrainState, decay_mask, next_token_loss


def _log(msg: str) -> None:
    if jax.process_index() == 0:
        print(msg, flush=True)


class MetricsWriter:
    """JSON lines in run_dir/metrics.jsonl, plus TensorBoard events when tensorboardX is installed."""

    def __init__(self, run_dir: Path, tensorboard: bool):
        self.active = jax.process_index() == 0
        self.file = open(run_dir / "metrics.jsonl", "a") if self.active else None  # noqa: SIM115
        self.tb = None
        if self.active and tensorboard:
            try:
                from tensorboardX import SummaryWriter

                self.tb = SummaryWriter(str(run_dir / "tensorboard"))
            except ImportError:
                pass

    def write(self, step: int, record: dict[str, Any]) -> None:
        if not self.active:
            return
        clean = {k: (int(v) if isinstance(v, (np.integer, int)) else float(v) if isinstance(v, (np.floating, float)) else v)
                 for k, v in record.items()}
        self.file.write(json.dumps({"step": step, **clean}) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in clean.items():
                if isinstance(v, float):
                    self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.tb is not None:
            self.tb.close()


class Progress:
    """A one-line progress bar on a terminal, periodic plain lines otherwise."""

    def __init__(self, total: int, start: int):
        self.total, self.start = total, start
        self.tty = sys.stdout.isatty() and jax.process_index() == 0

    def update(self, step: int, text: str) -> None:
        frac = step / max(self.total, 1)
        bar = "#" * int(24 * frac) + "." * (24 - int(24 * frac))
        line = f"step {step:>6}/{self.total} [{bar}] {text}"
        if self.tty:
            print("\r" + line, end="", flush=True)
        else:
            _log(line)

    def close(self) -> None:
        if self.tty:
            print(flush=True)


class Trainer:
    """Runs a TrainConfig end to end on the mesh it describes.

    Args:
      cfg: the run's configuration.
      make_model: `rngs -> nnx.Module` whose parameters carry logical axes; default: the built-in GPT of cfg.model.
      loss_fn: `(model, batch) -> (mean_loss, aux)`; default: masked next-token cross-entropy.
      train_data / val_data: objects with `.batch(step, batch_size, rows=slice) -> dict of numpy arrays`; default:
        TokenDatasets over cfg.data.
      devices: devices for the mesh (default all).
      flops_per_token: for MFU when bringing your own model (the built-in GPT's is computed from its config).
    """

    def __init__(
        self,
        cfg: TrainConfig,
        *,
        make_model: Callable[[nnx.Rngs], nnx.Module] | None = None,
        loss_fn: LossFn | None = None,
        train_data: Any = None,
        val_data: Any = None,
        tokenizer: Any = None,
        devices: list[jax.Device] | None = None,
        flops_per_token: float | None = None,
    ):
        devices = list(jax.devices()) if devices is None else devices
        self.mesh_shape = mesh_shape(cfg.parallel, len(devices))
        validate(cfg, len(devices), self.mesh_shape, model=make_model is None)  # every check before compiling
        self.custom_model = make_model is not None
        if cfg.check_memory and make_model is None:
            _check_memory(cfg, self.mesh_shape, devices[0])
        self.tokenizer = tokenizer
        if train_data is None:
            train_data, val_data, self.tokenizer, cfg = _default_data(cfg)
        self.cfg = cfg
        self.train_data, self.val_data = train_data, val_data
        self.mesh = make_mesh(cfg.parallel, devices)
        self.rules = get_rules(cfg.parallel.strategy, self.mesh)
        self.loss_fn = loss_fn or next_token_loss
        if make_model is None:
            from jaxperf.models import GPT

            model_cfg = cfg.model
            make_model = lambda rngs: GPT(model_cfg, rngs=rngs)  # noqa: E731
            flops_per_token = flops_per_token or _gpt_flops(cfg)
        self.flops_per_token = flops_per_token
        probe = Task.create(make_model, self.mesh, self.rules, None, seed=cfg.seed)
        self.tx, self.schedule = make_optimizer(cfg.optim, cfg.max_steps, decay_mask(probe.param_axes, probe.abstract_params))
        self.task = Task.create(make_model, self.mesh, self.rules, self.tx, seed=cfg.seed, health=health_options(cfg))
        check_flavour(cfg.parallel.flavour, self.task)  # e.g. pmap with sharded parameters: refused before compiling
        self.run_dir = Path(cfg.run_dir)
        self._train_step = None
        self._eval_step = None

    # ----------------------------------------------------------------------------------------------------------------
    def _steps(self) -> tuple[FlavouredStep, Callable]:
        """(train step of cfg.parallel.flavour, jit eval step); the eval step takes the usual state in every flavour."""
        if self._train_step is None:
            self._train_step = build_train_step(self.task, self.loss_fn, self.cfg.parallel.flavour,
                                                microbatches=self.cfg.microbatches, schedule=self.schedule,
                                                overlap_grad_reduce=self.cfg.parallel.overlap_grad_reduce)
            self._eval_step = self.task.eval_step(self.loss_fn)
        return self._train_step, self._eval_step

    def make_batch(self, data, step: int, digests: dict[int, int] | None = None) -> dict[str, jax.Array]:
        """The global batch of `step`, each process reading only its rows, placed on the mesh. With `digests`, the
        CRC-32 of this process's rows is recorded under `step` (logged as batch_crc32: resume checks use it)."""
        from jaxperf.data import process_rows, to_global_array

        rows = process_rows(self.cfg.batch_size)
        host = data.batch(step, self.cfg.batch_size, rows=rows)
        if digests is not None:
            crc = 0
            for key in sorted(host):
                crc = zlib.crc32(np.ascontiguousarray(host[key]).tobytes(), crc)
            digests[step] = crc
        return to_global_array(host, self.task.batch_sharding(), self.cfg.batch_size)

    def init_or_restore(self, checkpointer) -> tuple[TrainState, int]:
        """The newest intact checkpoint (read straight into this run's shardings, whatever mesh wrote it), or a
        fresh state. A corrupt newest checkpoint is reported and the one before it is used."""
        if checkpointer is not None and self.cfg.resume and checkpointer.latest_step() is not None:
            state, meta, _ = checkpointer.restore_latest(self.task.abstract_state())
            start = int(meta.get("data_step", int(jax.device_get(state.step))))
            saved_seed = meta.get("seed", self.cfg.seed)
            if saved_seed != self.cfg.seed:
                _log(f"warning: the checkpoint was trained with seed={saved_seed} but this run has seed="
                     f"{self.cfg.seed}: the data order from here on differs from an uninterrupted run")
            where = f" (saved on mesh {meta['mesh']})" if meta.get("mesh") not in (None, self._mesh_text()) else ""
            _log(f"resumed from {self.run_dir / 'checkpoints'} at step {start}{where}")
            return state, start
        return self.task.init_state(), 0

    def _mesh_text(self) -> str:
        return " ".join(f"{a}={n}" for a, n in self.mesh.shape.items())

    def _metadata(self, data_step: int) -> dict:
        return {"data_step": int(data_step), "seed": self.cfg.seed, "mesh": self._mesh_text(),
                "processes": jax.process_count()}

    def evaluate(self, state: TrainState) -> float:
        _, eval_step = self._steps()
        total, weight = 0.0, 0.0
        for i in range(self.cfg.eval_batches):
            m = jax.device_get(eval_step(state, self.make_batch(self.val_data, i)))
            total += float(m["loss"]) * float(m["tokens"])
            weight += float(m["tokens"])
        return total / max(weight, 1.0)

    def fit(self, state: TrainState | None = None) -> dict[str, Any]:
        """Train to cfg.max_steps; returns a summary (final loss, losses per step, tokens/s, MFU, state)."""
        from jaxperf.data import Prefetcher
        from jaxperf.train.checkpoint import Checkpointer

        cfg = self.cfg
        if cfg.compile_cache_dir:
            from jaxperf.perf.compile import enable_compilation_cache

            # Only programs that take a while to compile: caching every small helper costs more than it saves.
            enable_compilation_cache(cfg.compile_cache_dir, min_compile_time_s=1.0)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if jax.process_index() == 0:
            (self.run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=1))
        ckpt = Checkpointer(self.run_dir / "checkpoints", keep=cfg.keep_checkpoints,
                            keep_every=cfg.keep_checkpoints_every or None)
        start = 0
        if state is None:
            state, start = self.init_or_restore(ckpt)
        self.report_startup(state)
        if start >= cfg.max_steps:
            _log(f"the run in {self.run_dir} is already at step {start} >= max_steps={cfg.max_steps}: nothing to train")
        train_step, _ = self._steps()
        state = train_step.to_step(state)  # the flavour's layout (pmap: a leading device axis); `usual` undoes it
        usual = train_step.from_step
        writer = MetricsWriter(self.run_dir, cfg.tensorboard)
        progress = Progress(cfg.max_steps, start)
        peak, peak_src = peak_flops(cfg.model.dtype)
        n_dev = self.mesh.devices.size
        tokens_per_step = cfg.batch_size * cfg.train_seq_len
        losses: dict[int, float] = {}
        digests: dict[int, int] = {}
        pending = None
        t_last, step_last = time.perf_counter(), start
        summary: dict[str, Any] = {"peak_flops": peak, "peak_source": peak_src}

        def consume(step: int, metrics) -> None:
            nonlocal t_last, step_last
            m = {k: float(v) for k, v in jax.device_get(metrics).items()}  # waits for step `step` only
            losses[step] = m["loss"]
            crc = digests.pop(step, None)
            if m.get("skipped"):
                writer.write(step + 1, {"skipped_step": 1.0, "loss": m["loss"], "grad_norm": m["grad_norm"]})
                _log(f"step {step + 1}: update skipped (loss {m['loss']}, grad norm {m['grad_norm']}), "
                     f"{int(m['consecutive_skips'])} in a row")
                if m["consecutive_skips"] >= cfg.max_consecutive_skips:
                    raise FloatingPointError(
                        f"{int(m['consecutive_skips'])} consecutive steps were skipped for a non-finite or spiking loss "
                        f"(the last at step {step + 1}); stopping. The newest checkpoint holds the last good state: "
                        f"lower the learning rate, check the data near step {step + 1}, or raise max_consecutive_skips")
            done = step + 1
            if done % cfg.log_every == 0 or done == cfg.max_steps:
                now = time.perf_counter()
                dt = (now - t_last) / max(done - step_last, 1)
                t_last, step_last = now, done
                tps = tokens_per_step / dt
                m.update(step_time=dt, tokens_per_sec=tps)
                if crc is not None:
                    m["batch_crc32"] = crc
                if self.flops_per_token:
                    m["mfu"] = tps * self.flops_per_token / (peak * n_dev)
                    summary["mfu"] = m["mfu"]
                summary["tokens_per_sec"] = tps
                writer.write(done, m)
                mfu = f" mfu {100 * m['mfu']:.1f}%" if "mfu" in m else ""
                progress.update(done, f"loss {m['loss']:.4f} | {tps:,.0f} tok/s | {1e3 * dt:.0f} ms/step{mfu}")

        stop = StopRequest(enabled=cfg.handle_signals)
        with stop, Prefetcher(lambda s: self.make_batch(self.train_data, s, digests), start, depth=cfg.data.prefetch) as batches:
            for step, batch in batches:
                if step >= cfg.max_steps:
                    break
                t_dispatch = time.perf_counter()
                state, metrics = train_step(state, batch)  # dispatched asynchronously
                if step == start:  # the first call traces and compiles before it dispatches
                    summary["compile_s"] = time.perf_counter() - t_dispatch
                    _log(f"train step compiled in {summary['compile_s']:.1f} s")
                    t_last = time.perf_counter()
                if pending is not None:
                    consume(*pending)  # the previous step's metrics, ready or nearly so
                pending = (step, metrics)
                done = step + 1
                if stop.agreed(done) and done < cfg.max_steps:
                    consume(*pending)
                    pending = None
                    progress.close()
                    ckpt.save(done, usual(state), metadata=self._metadata(done), force=True)
                    _log(f"{stop.reason}: saved a checkpoint at step {done} in {self.run_dir / 'checkpoints'}; "
                         "run the same command again to continue")
                    summary["stopped_at"] = done
                    break
                if cfg.eval_every and done % cfg.eval_every == 0 and self.val_data is not None:
                    consume(*pending)
                    pending = None
                    val = self.evaluate(usual(state))
                    writer.write(done, {"val_loss": val})
                    progress.close()
                    _log(f"step {done}: val_loss {val:.4f}")
                    t_last, step_last = time.perf_counter(), done
                if cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and done < cfg.max_steps:
                    ckpt.save(done, usual(state), metadata=self._metadata(done))
        if pending is not None:
            consume(*pending)
        progress.close()
        state = usual(state)
        if int(jax.device_get(state.step)) > 0:
            ckpt.save(int(jax.device_get(state.step)), state, metadata=self._metadata(start + len(losses)), force=True)
        ckpt.close()
        writer.close()
        summary.update(state=state, losses=losses, final_loss=losses[max(losses)] if losses else None)
        if self.val_data is not None and cfg.eval_batches:
            summary["val_loss"] = self.evaluate(state)
            _log(f"final val_loss {summary['val_loss']:.4f}")
        return summary

    def report_startup(self, state: TrainState) -> dict:
        """Log the mesh and check bytes per device against what the strategy should give."""
        weight_axes = {a for _, axes in self.rules.params for a in ((axes,) if isinstance(axes, str) else axes or ())}
        factor = int(np.prod([self.mesh.shape[a] for a in weight_axes])) if weight_axes else 1
        report = check_sharding({"params": state.params, "opt_state": state.opt_state}, self.mesh,
                                {"params": factor, "opt_state": factor})
        n_params = sum(x.size for x in jax.tree.leaves(state.params))
        _log(f"{n_params / 1e6:.2f}M parameters, strategy {self.rules.name}, flavour {self.cfg.parallel.flavour}, "
             f"{format_report(report, self.mesh)}")
        if jax.default_backend() == "cpu":
            from jaxperf.perf.hostmem import host_memory

            host = host_memory()
            if host.can_enable:  # the step would run faster restarted with huge pages: say how
                _log(host.describe())
        for name, r in report.items():
            if r["ratio_to_expected"] > 1.5:
                _log(f"warning: {name} uses {r['ratio_to_expected']:.1f}x the expected bytes per device: some dims "
                     f"do not divide over the mesh and stay replicated")
        return report

    def sample(self, state: TrainState, prompt: str, n_tokens: int, *, temperature: float = 0.8, seed: int = 0) -> str:
        """Text from the trained model (full recomputation over a fixed window: one compilation, no KV cache)."""
        if self.tokenizer is None or self.custom_model:
            raise ValueError("sampling needs the built-in GPT and a tokenizer")
        window = self.cfg.model.max_seq_len
        vocab = self.tokenizer.vocab_size
        task = self.task

        @jax.jit
        def next_token(params, tokens_1xW, pos, key):
            logits = task.merge(params)(tokens_1xW)[0, pos].astype(jnp.float32)[:vocab]
            return jax.random.categorical(key, logits / temperature)

        ids = [int(t) for t in self.tokenizer.encode(prompt)] or [0]
        key = jax.random.key(seed)
        params = jax.device_put(jax.device_get(state.params))  # gathered onto one device: a small model
        for _ in range(n_tokens):
            ctx = ids[-window:]
            buf = np.zeros((1, window), np.int32)
            buf[0, : len(ctx)] = ctx
            key, sub = jax.random.split(key)
            ids.append(int(next_token(params, jnp.asarray(buf), len(ctx) - 1, sub)))
        return self.tokenizer.decode(np.asarray(ids, np.int64))


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
            from jax.experimental import multihost_utils

            if multihost_utils.reached_preemption_sync_point(step):
                self.reason = self.reason or "preempted"
                return True
            return False
        return self.reason is not None


def health_options(cfg: TrainConfig) -> HealthOptions:
    """The step's numerical-health settings from the run config."""
    if cfg.loss_scale not in ("auto", "dynamic", "none"):
        from jaxperf.config import ConfigError

        raise ConfigError(f"loss_scale={cfg.loss_scale!r} is not one of auto, dynamic, none")
    scaling = cfg.loss_scale == "dynamic" or (cfg.loss_scale == "auto" and cfg.model.dtype == "float16")
    return HealthOptions(skip_nonfinite=cfg.skip_nonfinite, spike_sigma=cfg.spike_sigma,
                         spike_window=cfg.spike_window, loss_scale=scaling)


def _check_memory(cfg: TrainConfig, shape: dict[str, int], device: jax.Device) -> None:
    """Before compiling: does the estimated per-device memory fit the device? (Skipped where the capacity is unknown.)"""
    from jaxperf.perf.hardware import chip_for
    from jaxperf.perf.memory import OutOfMemoryAdvice, check_fits, estimate, live_device_memory

    stats = live_device_memory(device) or {}
    chip = chip_for(device)
    capacity = stats.get("bytes_limit") or (chip.hbm_bytes if chip else None)
    if not capacity:
        return
    try:
        check_fits(estimate(cfg, shape), capacity)
    except OutOfMemoryAdvice as e:
        raise OutOfMemoryAdvice(f"{e}\n(the estimate can be off by a third; check_memory=false tries anyway)") from None


def _gpt_flops(cfg: TrainConfig) -> float:
    return flops_per_token(cfg.model, cfg.train_seq_len)


def _default_data(cfg: TrainConfig):
    """TokenDatasets for train and validation over cfg.data, and the tokenizer; cfg.model.vocab_size follows it."""
    import dataclasses

    from jaxperf.config import ConfigError
    from jaxperf.data import TokenDataset, corpus_texts, get_tokenizer, load_tokens, source_fingerprint, split_tokens

    d = cfg.data
    cache = os.path.expanduser(d.cache_dir)
    tok = get_tokenizer(d.tokenizer, vocab_size=cfg.model.vocab_size, path=d.tokenizer_path,
                        texts_fn=lambda: corpus_texts(d.source, max_bytes=d.max_bytes), cache_dir=cache,
                        cache_key=source_fingerprint(d.source, d.max_bytes) if d.tokenizer == "bpe" else None)
    if tok.vocab_size > cfg.model.padded_vocab:
        raise ConfigError(f"the {d.tokenizer} tokenizer has {tok.vocab_size} tokens but the model's vocabulary is "
                          f"{cfg.model.padded_vocab}: set model.vocab_size={tok.vocab_size}")
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=max(tok.vocab_size, 1)))
    tokens = load_tokens(d.source, tok, cache_dir=cache, max_bytes=d.max_bytes)
    train, val = split_tokens(tokens, d.val_fraction)
    seq = cfg.train_seq_len
    val_ds = TokenDataset(val, seq, cfg.seed + 1) if len(val) > seq + 1 else None
    return TokenDataset(train, seq, cfg.seed), val_ds, tok, cfg
