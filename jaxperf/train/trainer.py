"""The training loop: data -> sharded step -> hooks (metrics one step late, eval, checkpoints, preemption).

    trainer = Trainer(get_config("tiny"))                 # the built-in GPT on the default corpus
    trainer = Trainer(cfg, make_model=MyModel, loss_fn=my_loss, train_data=ds)   # research code brings its own
    trainer = Trainer(cfg, init_from="path/to/hf-llama")   # fine-tune existing weights (jaxperf.train.pretrained)
    summary = trainer.fit()

The host never waits on the device inside the loop: step n is dispatched before the metrics of step n-1 are read, so
the device always has the next step queued. Everything else the loop does is a hook with its own cadence
(jaxperf.train.hooks). Checkpoints hold the train state and the data position; since batches are a pure function of
(seed, step), resuming at step n sees exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

import dataclasses
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils

from jaxperf.config import ConfigError, TrainConfig, mesh_shape, to_dict, validate
from jaxperf.config.validate import compiler_option_entries
from jaxperf.data import (Prefetcher, datasets_for, process_rows, to_global_array, tokenizer_for, vocab_note,
                          with_vocab)
from jaxperf.generate import Generator
from jaxperf.step.flavours import FlavouredStep, build_train_step, check_flavour
from jaxperf.models import moe
from jaxperf.models.hooks import LayerHooks
from jaxperf.models.platform import describe_settled
from jaxperf.parallel.mesh import make_mesh, normalize_platform, platform_of
from jaxperf.parallel.pipeline import describe as pipeline_describe
from jaxperf.parallel.sharding import check_sharding, format_report
from jaxperf.perf.compile import enable_compilation_cache
from jaxperf.perf.flops import flops_per_token
from jaxperf.perf.hardware import chip_for
from jaxperf.perf.cpu_host import host_memory
from jaxperf.perf.memory import OutOfMemoryAdvice, check_fits, estimate, live_device_memory
from jaxperf.step.task import LossFn, TrainState, build_task, step_microbatches
from jaxperf.checkpoint import Checkpointer, CheckpointSaveError, NoIntactCheckpointError
from jaxperf.train.hooks import Hook, MetricsWriteError, MetricsWriter, Progress, default_hooks, log
from jaxperf.train.pretrained import InitSource
from jaxperf.train.rundir import HISTORY_NAME, RunDir, RunDirError


class Trainer:
    """Runs a TrainConfig end to end on the mesh it describes.

    Args:
      cfg: the run's configuration.
      make_model: `rngs -> nnx.Module` whose parameters carry logical axes; default: the built-in GPT of cfg.model.
      loss_fn: `(model, batch) -> (mean_loss, aux)`; default: the built-in GPT's loss, or masked next-token
        cross-entropy from logits for a model of your own.
      tx: any optax transformation (its state sharded like the parameters, checkpointed and resumed); default: AdamW
        with warm-up, cosine decay (or `optim.schedule=constant`) and clipping from cfg.optim.
      train_data / val_data: objects with `.batch(step, batch_size, rows=slice) -> dict of numpy arrays`; default:
        TokenDatasets over cfg.data.
      tokenizer: the tokenizer of your data (default: the one cfg.data describes), for the sample at the end and
        the vocabulary check: a model whose output is smaller than the tokenizer's vocabulary is refused before
        compiling (its targets would have no logit).
      devices: devices for the mesh (default all).
      flops_per_token: for MFU when bringing your own model (the built-in GPT's is computed from its config).
      hooks: more jaxperf.train.hooks.Hook objects, run after the default ones.
      init_from: start from existing weights (sets cfg.init_from): a Hugging Face GPT-2 / Llama directory or a
        jaxperf run directory. The model config and tokenizer come from it, the parameters are loaded straight into
        their shards, the optimizer starts fresh (jaxperf.train.pretrained). Once run_dir holds a checkpoint, the
        run resumes from it instead.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        *,
        make_model: Callable[[nnx.Rngs], nnx.Module] | None = None,
        loss_fn: LossFn | None = None,
        tx: optax.GradientTransformation | None = None,
        train_data: Any = None,
        val_data: Any = None,
        tokenizer: Any = None,
        devices: list[jax.Device] | None = None,
        flops_per_token: float | None = None,
        hooks: list[Hook] | None = None,
        init_from: str | None = None,
    ):
        devices = list(jax.devices()) if devices is None else devices
        self.tokenizer = tokenizer
        self.source, self.init_record = None, None
        if init_from is not None:
            cfg = dataclasses.replace(cfg, init_from=str(init_from))
        if cfg.init_from:  # the checkpoint settles the model and the tokenizer
            if make_model is not None:
                raise ConfigError("init_from loads jaxperf's GPT from a checkpoint; a model of your own (make_model=) "
                                  "starts from its own initialisation: drop one of them")
            self.source = InitSource.open(cfg.init_from)
            cfg = self.source.configure(cfg)
            self.tokenizer = tokenizer or self.source.tokenizer(cfg)
        elif train_data is None:  # the tokenizer settles the vocabulary before anything is checked
            self.tokenizer = tokenizer or tokenizer_for(cfg)
            note = vocab_note(cfg, self.tokenizer)  # e.g. model.vocab_size=512 under the byte tokenizer
            if note:
                log(note)
            cfg = with_vocab(cfg, self.tokenizer)
        self.mesh_shape = mesh_shape(cfg.parallel, len(devices))
        validate(cfg, len(devices), self.mesh_shape, model=make_model is None)  # every check before compiling
        if cfg.check_memory and make_model is None:
            _check_memory(cfg, self.mesh_shape, devices[0])
        if train_data is None:
            train_data, val_data = datasets_for(cfg, self.tokenizer)
        self.cfg = cfg
        self.custom_model = make_model is not None
        self.train_data, self.val_data = train_data, val_data
        self.mesh = make_mesh(cfg.parallel, devices)
        self.task = build_task(cfg, self.mesh, make_model, loss_fn=loss_fn, tx=tx)
        if self.tokenizer is not None:
            check_vocab(self.task, self.tokenizer, cfg.train_seq_len)
        self.rules = self.task.rules
        self.flops_per_token = flops_per_token if self.custom_model else flops_per_token_of(cfg)
        check_flavour(cfg.parallel.flavour, self.task)  # e.g. pmap with sharded parameters: refused before compiling
        self.run_dir = Path(cfg.run_dir)
        self.extra_hooks = list(hooks or [])
        self._train_step = None
        self._eval_step = None

    # ----------------------------------------------------------------------------------------------------------------
    def _steps(self) -> tuple[FlavouredStep, Callable]:
        """(train step of cfg.parallel.flavour, jit eval step); the eval step takes the usual state in every flavour."""
        if self._train_step is None:
            self._train_step = build_train_step(self.task, self.task.loss_fn, self.cfg.parallel.flavour,
                                                microbatches=step_microbatches(self.cfg),
                                                overlap_grad_reduce=self.cfg.parallel.overlap_grad_reduce)
            self._eval_step = self.task.eval_step()
        return self._train_step, self._eval_step

    def make_batch(self, data, step: int, digests: dict[int, int] | None = None) -> dict[str, jax.Array]:
        """The global batch of `step`, each process reading only its rows, placed on the mesh. With `digests`, the
        CRC-32 of this process's rows is recorded under `step` (logged as batch_crc32: resume checks use it)."""
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
        fresh state. A corrupt newest checkpoint is reported and the one before it is used; when checkpoints were
        written but none is intact, RunDirError (never a silent start from step 0)."""
        if checkpointer is not None and self.cfg.resume and checkpointer.latest_step() is None \
                and checkpointer.corrupt_steps():
            raise RunDirError(_no_intact(checkpointer))
        if checkpointer is not None and self.cfg.resume and checkpointer.latest_step() is not None:
            try:
                state, meta, _ = checkpointer.restore_latest(self.task.abstract_state())
            except NoIntactCheckpointError:
                raise RunDirError(_no_intact(checkpointer)) from None
            start = int(meta.get("data_step", int(jax.device_get(state.step))))
            saved_seed = meta.get("seed", self.cfg.seed)
            if saved_seed != self.cfg.seed:
                log(f"warning: the checkpoint was trained with seed={saved_seed} but this run has seed="
                    f"{self.cfg.seed}: the data order from here on differs from an uninterrupted run")
            where = f" (saved on mesh {meta['mesh']})" if meta.get("mesh") not in (None, self._mesh_text()) else ""
            log(f"resumed from {checkpointer.directory} at step {start}{where}")
            self.init_record = meta.get("init_from")
            return state, start
        if self.source is not None:
            state, self.init_record = self.source.load(self.task, self.cfg.model)
            log(f"initialised from {self.source.describe()}; the optimizer starts fresh")
            return state, 0
        return self.task.init_state(), 0

    def _mesh_text(self) -> str:
        return " ".join(f"{a}={n}" for a, n in self.mesh.shape.items())

    def metadata(self, data_step: int) -> dict:
        """What a checkpoint records besides the arrays: the data position, seed, mesh and process count, and where
        the run's weights started from (init_from: the source, its special token ids and generation config)."""
        meta = {"data_step": int(data_step), "seed": self.cfg.seed, "mesh": self._mesh_text(),
                "processes": jax.process_count()}
        if self.init_record is not None:
            meta["init_from"] = self.init_record
        return meta

    def evaluate(self, state: TrainState) -> float:
        """The mean loss per token over the first cfg.eval_batches validation batches; ValueError without any (a
        loss that was not measured is never reported)."""
        if self.val_data is None or self.cfg.eval_batches < 1:
            raise ValueError(f"nothing to evaluate on: eval_batches={self.cfg.eval_batches} and the validation split "
                             f"is {'missing' if self.val_data is None else 'there'}; set eval_batches >= 1 (with "
                             f"data.val_fraction > 0)")
        _, eval_step = self._steps()
        total, weight = 0.0, 0.0
        for i in range(self.cfg.eval_batches):
            m = jax.device_get(eval_step(state, self.make_batch(self.val_data, i)))
            total += float(m["loss"]) * float(m["tokens"])
            weight += float(m["tokens"])
        return total / max(weight, 1.0)

    def hooks(self) -> list[Hook]:
        """The default hooks of cfg (jaxperf.train.hooks.default_hooks) followed by the ones given to the Trainer."""
        cfg = self.cfg
        return default_hooks(cfg, tokens_per_step=cfg.batch_size * cfg.train_seq_len,
                             flops_per_token=self.flops_per_token, n_devices=self.mesh.devices.size,
                             evaluate=self.val_data is not None) + self.extra_hooks

    def fit(self, state: TrainState | None = None) -> dict[str, Any]:
        """Train to cfg.max_steps; returns a summary (final loss, losses per step, tokens/s, MFU, state).

        The run directory is locked for the whole call (jaxperf.train.rundir): a second run on it is refused. Raises
        RunDirError for a run directory that cannot be used as asked, CheckpointSaveError when a save fails (the run
        stops at once; the last good step is named), MetricsWriteError (a CheckpointSaveError) when metrics.jsonl
        cannot be written (a checkpoint is saved first where possible)."""
        cfg = self.cfg
        if cfg.compile_cache_dir:  # only programs that take a while to compile: small helpers cost more than they save
            enable_compilation_cache(cfg.compile_cache_dir, min_compile_time_s=1.0)
        run = RunDir(self.run_dir, lock=jax.process_index() == 0)
        _on_first_process(run.acquire, "the run directory")
        try:
            return self._fit(run, state)
        finally:
            run.release()

    def _fit(self, run: RunDir, state: TrainState | None) -> dict[str, Any]:
        cfg = self.cfg
        if cfg.start_over:
            moved = _on_first_process(run.start_over, "moving the earlier run aside")
            if moved is not None:
                log(f"start_over: the earlier run in {self.run_dir} is now in {moved}")
        elif not cfg.resume and _on_first_process(run.has_run, "the run directory", share_bool=True):
            raise RunDirError(f"run_dir {self.run_dir} already holds a run and resume=false: resume it (resume=true), "
                              f"use another run_dir, or set start_over=true to move it to {self.run_dir}/previous/")
        ckpt_dir = self.run_dir / "checkpoints"
        made_ckpt_dir = not ckpt_dir.exists()
        ckpt = Checkpointer(ckpt_dir, keep=cfg.keep_checkpoints, keep_every=cfg.keep_checkpoints_every or None)
        writer = MetricsWriter(self.run_dir, cfg.tensorboard)
        try:
            start = 0
            if state is None:
                state, start = self.init_or_restore(ckpt)
            if self.source is not None:  # once the source has read back intact
                _on_first_process(lambda: self.source.save_tokenizer(self.tokenizer), "saving the tokenizer")
            note = _on_first_process(writer.open, "opening metrics.jsonl")
            if note:
                log(note)
            changes = _on_first_process(lambda: run.record_config(to_dict(cfg), start), "writing config.json")
            if changes:
                shown = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in list(changes.items())[:4])
                more = f" (+{len(changes) - 4} more)" if len(changes) > 4 else ""
                log(f"settings changed at step {start}: {shown}{more}; recorded in {run.path / HISTORY_NAME}")
        except BaseException:
            _close_quietly(ckpt)
            writer.close()
            if made_ckpt_dir:  # a start refused before its first save leaves no empty checkpoints/ behind
                _on_first_process(lambda: _remove_if_empty(ckpt_dir), "cleaning up")
            raise
        try:
            self.report_startup(state)
            if start >= cfg.max_steps:
                log(f"the run in {self.run_dir} is already at step {start} >= max_steps={cfg.max_steps}: nothing to "
                    f"train")
            train_step, _ = self._steps()
            loop = Loop(self, train_step, train_step.to_step(state), start, ckpt, writer=writer)
            loop.run(self.hooks())
        except BaseException:
            _close_quietly(ckpt)
            raise
        else:
            ckpt.close()  # every save confirmed (or CheckpointSaveError) before the run reports anything saved
        finally:
            writer.close()
        summary = loop.summary
        summary.update(state=loop.usual_state(), losses=loop.losses,
                       final_loss=loop.losses[max(loop.losses)] if loop.losses else None)
        if loop.stop_reason is None and self.val_data is not None and cfg.eval_batches:
            summary["val_loss"] = self.evaluate(summary["state"])
            log(f"final val_loss {summary['val_loss']:.4f}")
        return summary

    def report_startup(self, state: TrainState) -> dict:
        """Log the mesh and check bytes per device against what the strategy should give."""
        # the axes every weight is split over (an MoE layer's experts are split over `expert` as well)
        weight_axes = {a for _, axes in self.rules.params for a in ((axes,) if isinstance(axes, str) else axes or ())
                       if a != "expert"}
        factor = int(np.prod([self.mesh.shape[a] for a in weight_axes])) if weight_axes else 1
        report = check_sharding({"params": state.params, "opt_state": state.opt_state}, self.mesh,
                                {"params": factor, "opt_state": factor})
        n_params = sum(x.size for x in jax.tree.leaves(state.params))
        log(f"{n_params / 1e6:.2f}M parameters, strategy {self.rules.name}, flavour {self.cfg.parallel.flavour}, "
            f"{format_report(report, self.mesh)}")
        if not self.custom_model:
            log(describe_settled(self.cfg, dict(self.mesh.shape), platform_of(self.mesh)))
            if self.cfg.model.n_experts:
                log(moe.describe(self.cfg, dict(self.mesh.shape), platform_of(self.mesh)))
        if self.task.compiler_options:
            log("compiler options (this run's train and eval steps): "
                + ", ".join(compiler_option_entries(self.task.compiler_options)))
        pipeline = self.task.hooks.pipeline if self.task.hooks is not None else None
        if pipeline is not None and not self.custom_model:
            log(self._pipeline_line(pipeline))
        if self.mesh.devices.flat[0].platform == "cpu":
            host = host_memory()
            if host.can_enable:  # the step would run faster restarted with huge pages: say how
                log(host.describe())
        for name, r in report.items():
            if r["ratio_to_expected"] > 1.5:
                log(f"warning: {name} uses {r['ratio_to_expected']:.1f}x the expected bytes per device: some dims "
                    f"do not divide over the mesh and stay replicated")
        return report

    def _pipeline_line(self, spec) -> str:
        """The schedule, bubble and stashed stage inputs per device (jaxperf.parallel.pipeline.describe)."""
        shape, m = self.mesh.shape, self.cfg.model
        rows = self.cfg.batch_size // spec.n_micro // (shape["data"] * shape["fsdp"])
        positions = self.cfg.train_seq_len // shape["seq"]
        if self.cfg.parallel.sequence_parallel:
            positions //= shape["tensor"]
        nbytes = max(rows, 1) * positions * m.d_model * jnp.dtype(m.dtype).itemsize
        return pipeline_describe(spec.schedule, shape["stage"], spec.n_micro, nbytes)

    def sample(self, state: TrainState, prompt: str, n_tokens: int, *, temperature: float = 0.8, seed: int = 0) -> str:
        """The prompt and up to `n_tokens` tokens after it from the trained model, through the generation engine
        (jaxperf.generate: KV cache, the model's context as the limit), on one device."""
        if self.tokenizer is None or self.custom_model:
            raise ValueError("sampling needs the built-in GPT and a tokenizer")
        params = jax.device_get(state.params)  # gathered whole: a collective when the run spans processes
        # On one device: none of the step's hooks (pipeline, ring, sequence parallelism) apply.
        gen = Generator(self.task.merge(params, hooks=LayerHooks()), self.tokenizer)
        out = gen.generate([prompt], max_tokens=max(int(n_tokens), 1), temperature=temperature, seed=seed)[0]
        return prompt + out.text


class Loop:
    """One `fit`: the state in the step's layout, the metrics read one step late, and what hooks may use.

    Hooks read `trainer`, `cfg`, `start`, `max_steps`, `summary`, `losses`, `writer`, `progress`, `checkpointer`,
    `stop_reason`, `data_step` and `paused_s` (seconds the logging hook leaves out of tokens/s), and call `log`,
    `read_metrics`, `usual_state`, `save` and `request_stop`.
    """

    def __init__(self, trainer: Trainer, train_step: FlavouredStep, state, start: int, checkpointer: Checkpointer,
                 writer: MetricsWriter | None = None):
        self.trainer, self.cfg, self.train_step = trainer, trainer.cfg, train_step
        self.state, self.start, self.max_steps = state, start, trainer.cfg.max_steps
        self.checkpointer = checkpointer
        if writer is None:
            writer = MetricsWriter(trainer.run_dir, self.cfg.tensorboard)
            note = writer.open()
            if note:
                log(note)
        self.writer = writer
        self.progress = Progress(self.max_steps)
        self.summary: dict[str, Any] = {}
        self.losses: dict[int, float] = {}
        self.digests: dict[int, int] = {}
        self.data_step, self.paused_s = start, 0.0
        self.stop_reason: str | None = None
        self._pending = None
        self._hooks: list[Hook] = []

    def log(self, msg: str) -> None:
        self.progress.close()
        log(msg)

    def usual_state(self) -> TrainState:
        """The state in the usual TrainState layout (the step flavour's own layout undone)."""
        return self.train_step.from_step(self.state)

    def save(self, step: int, *, data_step: int | None = None, force: bool = False) -> bool:
        return self.checkpointer.save(step, self.usual_state(), force=force,
                                      metadata=self.trainer.metadata(step if data_step is None else data_step))

    def request_stop(self, reason: str) -> None:
        self.stop_reason = reason

    def _record_failed(self, step: int) -> bool:
        """Whether writing the record (metrics.jsonl) failed; with several processes, asked of process 0 (the one
        that writes) at logging steps and the last step only, so that every process agrees at the same step."""
        if jax.process_count() == 1:
            return self.writer.error is not None
        if step % self.cfg.log_every and step != self.max_steps:
            return False
        failed = np.asarray(self.writer.error is not None, np.int32)
        return bool(multihost_utils.broadcast_one_to_all(failed))

    def _stop_on_record(self, step: int) -> None:
        """The record could not be written: save a checkpoint at `step`, like a stop, and raise MetricsWriteError
        (the exit of a failed save: the message names the file, errno and last good step)."""
        failed_at, error = self.writer.error or (step, OSError(0, "failed on process 0"))
        saved, why = None, None
        try:
            self.save(step, force=True)
            self.checkpointer.wait()
            saved = step
        except CheckpointSaveError as e:
            why = e.reason
        raise MetricsWriteError(self.writer.path, failed_at, error, saved=saved,
                                last_good=self.checkpointer.last_saved, save_failure=why)

    def _due(self, hook: Hook, step: int) -> bool:
        return bool(hook.every) and (step % hook.every == 0 or step == self.max_steps)

    def read_metrics(self) -> None:
        """Read the pending step's metrics (waiting for that step only) and hand them to the hooks due."""
        if self._pending is None:
            return
        done, metrics = self._pending
        self._pending = None
        m = {k: float(v) for k, v in jax.device_get(metrics).items()}
        self.losses[done - 1] = m["loss"]
        crc = self.digests.pop(done - 1, None)
        if crc is not None:
            m["batch_crc32"] = crc
        for hook in self._hooks:
            if self._due(hook, done):
                hook.on_metrics(self, done, m)

    def run(self, hooks: list[Hook]) -> None:
        """Step to max_steps (or a stop), calling the hooks; `close()` of every hook runs whatever happens."""
        self._hooks = hooks
        trainer, cfg = self.trainer, self.cfg
        try:
            t_begin = time.perf_counter()
            for hook in hooks:
                hook.on_start(self)
            make = lambda s: trainer.make_batch(trainer.train_data, s, self.digests)  # noqa: E731
            with Prefetcher(make, self.start, depth=cfg.data.prefetch) as batches:
                for step, batch in batches:
                    if step >= self.max_steps:
                        break
                    t0 = time.perf_counter()
                    self.state, metrics = self.train_step(self.state, batch)  # dispatched asynchronously
                    if step == self.start:  # the first call traces and compiles before it dispatches
                        now = time.perf_counter()
                        self.summary["compile_s"] = now - t0
                        self.paused_s += now - t_begin  # start-up and compilation are not training throughput
                        log(f"train step compiled in {now - t0:.1f} s")
                    self.read_metrics()  # the previous step's, ready or nearly so
                    done = self.data_step = step + 1
                    self._pending = (done, metrics)
                    for hook in hooks:
                        if self.stop_reason is None and self._due(hook, done):
                            hook.on_step(self, done)
                    if self._record_failed(done):
                        self._stop_on_record(done)
                    if self.stop_reason is not None:
                        self.read_metrics()
                        for hook in hooks:
                            hook.on_stop(self, done)
                        self.summary["stopped_at"] = done
                        break
            self.read_metrics()
            self.progress.close()
            if self._record_failed(self.data_step):
                self._stop_on_record(self.data_step)
            if self.stop_reason is None:
                for hook in hooks:
                    hook.on_end(self)
        finally:
            for hook in hooks:
                hook.close()


def _no_intact(checkpointer: Checkpointer) -> str:
    corrupt = ", ".join(checkpointer.corrupt_steps()) or "every step"
    return (f"no intact checkpoint in {checkpointer.directory} ({corrupt} failed their checks and are kept aside): "
            f"set start_over=true to train from step 0 (they stay, moved with the run), or restore a backup")


def _on_first_process(fn: Callable[[], Any], what: str, *, share_bool: bool = False) -> Any:
    """Run `fn` on process 0 only and wait for it everywhere; raises on every process when it failed there. The
    result is process 0's (None elsewhere), or with `share_bool` a bool every process gets."""
    if jax.process_count() == 1:
        return fn()
    error, result = None, None
    if jax.process_index() == 0:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - reported on process 0, agreed on by all below
            error = e
    failed = multihost_utils.process_allgather(np.asarray(error is not None))
    if error is not None:
        raise error
    if bool(np.any(failed)):
        raise RunDirError(f"process 0 stopped the run while {what}: its output says why")
    if share_bool:
        return bool(multihost_utils.broadcast_one_to_all(np.asarray(bool(result), np.int32)))
    return result


def _remove_if_empty(directory: Path) -> None:
    try:
        directory.rmdir()  # only an empty directory: anything in it stays
    except OSError:
        pass


def _close_quietly(ckpt: Checkpointer) -> None:
    """Close the checkpointer while another error is on its way out (that error says more: this one is dropped)."""
    try:
        ckpt.close()
    except Exception:  # noqa: BLE001
        pass


def check_vocab(task, tokenizer, seq_len: int) -> None:
    """ConfigError, before compiling, when the model predicts fewer tokens than the tokenizer produces: a target id
    without a logit gives NaN losses. The model's output size is traced abstractly once (`Task.output_size`); a model
    not called on tokens alone is not checked."""
    size = task.output_size(seq_len)
    vocab = int(tokenizer.vocab_size)
    if size is not None and size < vocab:
        name = getattr(tokenizer, "name", type(tokenizer).__name__)
        raise ConfigError(f"the model outputs {size} logits per token but the {name} tokenizer has {vocab} ids: give "
                          f"the model an output of at least {vocab} (e.g. nnx.Embed({vocab}, ...)) or use a tokenizer "
                          f"with at most {size} ids")


def flops_per_token_of(cfg: TrainConfig) -> float:
    """Training FLOPs per token of the built-in GPT of cfg (jaxperf.perf.flops)."""
    return flops_per_token(cfg.model, cfg.train_seq_len)


def _check_memory(cfg: TrainConfig, shape: dict[str, int], device: jax.Device) -> None:
    """Before compiling: does the estimated per-device memory fit the device? (Skipped where the capacity is unknown,
    and with a line saying so where the model has MoE layers off TPU, where the estimate does not model them.)"""
    stats = live_device_memory(device) or {}
    chip = chip_for(device)
    capacity = stats.get("bytes_limit") or (chip.hbm_bytes if chip else None)
    if not capacity:
        return
    if cfg.model.n_experts and normalize_platform(device.platform) != "tpu":
        log(f"memory check skipped: the estimate models MoE layers (model.n_experts={cfg.model.n_experts}) for TPU "
            f"only")
        return
    try:
        check_fits(estimate(cfg, shape, platform=normalize_platform(device.platform)), capacity)
    except OutOfMemoryAdvice as e:
        raise OutOfMemoryAdvice(f"{e}\n(the estimate can be off by a third; check_memory=false tries anyway)") from None
