"""Numerical health: bad steps are skipped bit-exactly and counted, too many stop the run, fp16 loss scaling."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from helpers import make_task
from jaxperf.config import ModelConfig, OptimConfig, ParallelConfig, get_config
from jaxperf.models.gpt import gpt_loss
from jaxperf.step.health import HealthOptions
from jaxperf.checkpoint import Checkpointer
from jaxperf.train.trainer import Trainer

MODEL = ModelConfig(d_model=32, n_layers=1, n_heads=2, max_seq_len=16)


def _task(health: HealthOptions, model=MODEL):
    task = make_task(model, ParallelConfig(strategy="fsdp", fsdp=4), optim=OptimConfig(lr=1e-2, warmup_steps=0),
                     steps=100, devices=jax.devices()[:4])
    return task.replace(health=health)


def _batch(seed=0, nan=False, boost=1.0):
    rng = np.random.default_rng(seed)
    t = rng.integers(0, 256, (8, 17)).astype(np.int32)
    mask = np.ones((8, 16), np.float32)
    if nan:
        mask[3, 5] = np.nan
    return {"inputs": t[:, :-1], "targets": t[:, 1:], "mask": mask, "boost": np.full((8, 16), boost, np.float32)}


def _boosted_loss(model, batch):
    loss, aux = gpt_loss(model, batch)
    return loss * batch["boost"][0, 0], aux


def test_nan_batch_is_skipped_and_leaves_state_bit_unchanged():
    task = _task(HealthOptions())
    step = task.train_step(_boosted_loss)
    state = task.init_state()
    state, _ = step(state, jax.device_put(_batch(0), task.batch_sharding()))
    before = jax.device_get((state.params, state.opt_state))
    state, m = step(state, jax.device_put(_batch(1, nan=True), task.batch_sharding()))
    after = jax.device_get((state.params, state.opt_state))
    assert int(m["skipped"]) == 1 and not np.isfinite(float(m["loss"]))
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before)):
        np.testing.assert_array_equal(a, b)
    assert int(state.health["skipped"]) == 1 and int(state.health["consecutive"]) == 1
    assert int(state.step) == 2  # the data position still moves on
    state, m = step(state, jax.device_put(_batch(2), task.batch_sharding()))
    assert int(m["skipped"]) == 0 and int(state.health["consecutive"]) == 0 and int(state.health["skipped"]) == 1
    changed = jax.device_get(state.params)
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(changed), jax.tree.leaves(after)))


@pytest.mark.slow
def test_loss_spike_is_skipped():
    task = _task(HealthOptions(spike_sigma=4.0, spike_window=4))
    step = task.train_step(_boosted_loss)
    state = task.init_state()
    for i in range(4):
        state, m = step(state, jax.device_put(_batch(i), task.batch_sharding()))
        assert int(m["skipped"]) == 0
    state, m = step(state, jax.device_put(_batch(9, boost=50.0), task.batch_sharding()))
    assert int(m["skipped"]) == 1 and int(state.health["skipped"]) == 1


class NaNAfter:
    """Token batches whose mask turns NaN from `start` on."""

    def __init__(self, start):
        self.start = start

    def batch(self, step, batch_size, *, rows=None):
        b = _batch(step, nan=step >= self.start)
        b.pop("boost")
        return {k: v[rows] if rows is not None else v for k, v in b.items()}


@pytest.mark.slow
def test_consecutive_skips_stop_the_run_with_the_step(tmp_path):
    cfg = get_config("tiny", ["d_model=32", "n_layers=1", "n_heads=2", "max_seq_len=16", "batch_size=8",
                              "max_steps=20", "max_consecutive_skips=3", f"run_dir={tmp_path}", "eval_every=0",
                              "checkpoint_every=0", "fsdp=1", "log_every=1", "sample_tokens=0"])
    trainer = Trainer(cfg, train_data=NaNAfter(5), devices=jax.devices()[:1])
    with pytest.raises(FloatingPointError, match=r"3 consecutive steps were skipped .*the last at step 8"):
        trainer.fit()


@pytest.mark.slow
def test_fp16_dynamic_loss_scale_halves_on_overflow_and_grows_when_clean(tmp_path):
    fp16 = ModelConfig(d_model=32, n_layers=1, n_heads=2, max_seq_len=16, dtype="float16")
    task = _task(HealthOptions(loss_scale=True, loss_scale_init=2.0**40, growth_interval=3), fp16)
    step = task.train_step(_boosted_loss)
    state = task.init_state()
    scales, skipped = [], []
    for i in range(40):
        state, m = step(state, jax.device_put(_batch(i), task.batch_sharding()))
        scales.append(float(m["loss_scale"]))
        skipped.append(int(m["skipped"]))
    assert skipped[0] == 1, "a 2^40 scale must overflow fp16"
    first_clean = skipped.index(0)
    for i in range(first_clean):  # every overflow halves the scale
        assert scales[i + 1] == scales[i] / 2
    clean_run = scales[first_clean:first_clean + 4]
    assert clean_run[:3] == [clean_run[0]] * 3 and clean_run[3] == 2 * clean_run[0], clean_run
    assert np.isfinite(float(m["loss"]))

    with Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(int(state.step), state)
        ckpt.wait()
        restored, _ = ckpt.restore(None, task.abstract_state())
    assert float(restored.health["loss_scale"]) == float(state.health["loss_scale"])
    assert int(restored.health["good_steps"]) == int(state.health["good_steps"])
