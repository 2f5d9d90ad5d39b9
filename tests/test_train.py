"""Training end to end: memorisation, golden numbers, no recompilation, user models, resume, the CLI."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from helpers import SMALL_RUN, fixed_batch, losses as run_losses, make_task, run_cli
from jaxperf.config import ConfigError, OptimConfig, ParallelConfig, from_dict, get_config
from jaxperf.step.task import next_token_loss
from jaxperf.checkpoint import Checkpointer
from jaxperf.train.trainer import Trainer


def _task(model_cfg, parallel=ParallelConfig(strategy="fsdp", fsdp=8), lr=3e-3, steps=100, devices=None, seed=0):
    return make_task(model_cfg, parallel, optim=OptimConfig(lr=lr, warmup_steps=5), steps=steps, devices=devices,
                     seed=seed)


def test_tiny_model_memorises_a_fixed_batch():
    cfg = get_config("tiny", ["d_model=64", "n_layers=2", "max_seq_len=32"]).model
    task = _task(cfg)
    step = task.train_step()
    state = task.init_state()
    batch = jax.device_put(fixed_batch(), task.batch_sharding())
    losses = []
    for _ in range(100):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    assert losses[0] > 5.0, losses[0]  # ~ln(256) = 5.55 at initialisation
    assert losses[-1] < 0.1, f"the model did not memorise 8 sequences: loss {losses[0]:.3f} -> {losses[-1]:.3f}"


# One step of the `tiny` preset's model from seed 0 on fixed_batch(seed=0), one device. If you changed the model's
# initialisation, the optimizer or the loss on purpose, rerun this test and paste the new values here.
GOLDEN_LOSS_STEP0 = 5.577000617980957
GOLDEN_LOSS_STEP1 = 5.24527645111084


def test_golden_loss_of_tiny():
    cfg = get_config("tiny").model
    task = _task(cfg, ParallelConfig(strategy="dp", data=1, fsdp=1), lr=2e-3, devices=jax.devices()[:1])
    step = task.train_step()
    state = task.init_state()
    batch = jax.device_put(fixed_batch(batch=4, seq=128), task.batch_sharding())
    state, m0 = step(state, batch)
    _, m1 = step(state, batch)
    got = (float(m0["loss"]), float(m1["loss"]))
    np.testing.assert_allclose(got, (GOLDEN_LOSS_STEP0, GOLDEN_LOSS_STEP1), rtol=1e-5,
                               err_msg="golden losses changed: if intended, update GOLDEN_LOSS_STEP0/1 to these values")


def test_no_recompilation_after_first_step():
    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    cfg = get_config("tiny", ["d_model=64", "n_layers=2", "max_seq_len=32"]).model
    task = _task(cfg, ParallelConfig(strategy="fsdp_tp", fsdp=4, tensor=2))
    step = task.train_step(microbatches=2)
    state = task.init_state()
    batches = [jax.device_put(fixed_batch(seed=i), task.batch_sharding()) for i in range(5)]
    state, m = step(state, batches[0])
    jax.block_until_ready(m)
    before = len(compiles)
    for b in batches[1:]:
        state, m = step(state, b)
    jax.block_until_ready(m)
    assert len(compiles) == before, f"{len(compiles) - before} compilations after the first step"
    assert step._cache_size() == 1


class BagOfWordsLM(nnx.Module):
    """A user model unrelated to the built-in GPT: embed, a tanh MLP, unembed; logical axes on every parameter."""

    def __init__(self, vocab: int, embed: int, hidden: int, *, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.embed = nnx.Embed(vocab, embed, embedding_init=nnx.with_partitioning(init, ("vocab", "embed")), rngs=rngs)
        self.up = nnx.Linear(embed, hidden, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")),
                             bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("mlp",)), rngs=rngs)
        self.down = nnx.Linear(hidden, vocab, kernel_init=nnx.with_partitioning(init, ("mlp", "vocab")),
                               bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("vocab",)), rngs=rngs)

    def __call__(self, tokens):
        return self.down(jnp.tanh(self.up(self.embed(tokens))))


class RepeatingData:
    """Batches of a fixed pattern (token t is followed by t + 1 mod V), deterministic in (step, rows)."""

    def batch(self, step, batch_size, *, rows=None):
        rng = np.random.default_rng([7, step])
        start = rng.integers(0, 64, (batch_size, 1))
        tokens = ((start + np.arange(17)[None, :]) % 64).astype(np.int32)
        out = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": np.ones((batch_size, 16), np.float32)}
        return {k: v[rows] if rows is not None else v for k, v in out.items()}


def test_user_model_trains_through_trainer_under_fsdp_tp(tmp_path):
    cfg = get_config("tiny", [
        "parallel.strategy=fsdp_tp", "parallel.fsdp=4", "parallel.tensor=2", "batch_size=16", "max_steps=40",
        "eval_every=0", "eval_batches=0", "checkpoint_every=0", f"run_dir={tmp_path}", "lr=3e-2", "warmup_steps=2",
        "sample_tokens=0", "log_every=10",
    ])
    trainer = Trainer(cfg, make_model=lambda rngs: BagOfWordsLM(64, 32, 64, rngs=rngs), loss_fn=next_token_loss,
                      train_data=RepeatingData())
    summary = trainer.fit()
    losses = summary["losses"]
    assert losses[0] > 3.5 and losses[39] < 0.5, (losses[0], losses[39])
    params = summary["state"].params
    shard = lambda x: x.addressable_shards[0].data.shape  # noqa: E731
    assert shard(params["embed"]["embedding"]) == (32, 8)  # vocab 64 / tensor 2, embed 32 / fsdp 4
    assert shard(params["up"]["kernel"]) == (8, 32)
    assert shard(params["down"]["kernel"]) == (32, 64)  # mlp takes `tensor` first; vocab stays whole
    assert shard(params["down"]["bias"]) == (32,)
    assert (tmp_path / "checkpoints").exists() and (tmp_path / "metrics.jsonl").exists()


def test_trainer_takes_any_optax_transformation(tmp_path):
    """Trainer(tx=...) trains with it end to end (here Adam at a fixed rate, no weight decay, no schedule: no "lr"
    metric), with its state sharded like the parameters, checkpointed and resumed."""
    cfg = get_config("tiny", ["batch_size=8", "max_steps=30", "eval_every=0", "eval_batches=0", "checkpoint_every=0",
                              f"run_dir={tmp_path}", "sample_tokens=0", "log_every=10", "tensorboard=false"])
    make = lambda rngs: BagOfWordsLM(64, 32, 64, rngs=rngs)  # noqa: E731
    trainer = Trainer(cfg, make_model=make, loss_fn=next_token_loss, train_data=RepeatingData(), tx=optax.adam(3e-2))
    summary = trainer.fit()
    losses = summary["losses"]
    assert losses[29] < 0.5 * losses[0], (losses[0], losses[29])
    mu = summary["state"].opt_state[0].mu  # Adam's first moment
    assert mu["up"]["kernel"].sharding == summary["state"].params["up"]["kernel"].sharding
    assert "lr" not in json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    more = Trainer(dataclasses.replace(cfg, max_steps=32), make_model=make, loss_fn=next_token_loss,
                   train_data=RepeatingData(), tx=optax.adam(3e-2)).fit()
    assert sorted(more["losses"]) == [30, 31]  # resumed from the saved Adam state


def test_a_model_smaller_than_the_vocabulary_is_refused_before_compiling(tmp_path):
    """A vocab-128 model on the byte tokenizer's 256 ids would give NaN losses (targets without a logit): refused
    with both numbers and the fix, from the model's output shape traced abstractly."""
    cfg = get_config("tiny", [f"run_dir={tmp_path}", "data.max_bytes=20000"])
    with pytest.raises(ConfigError, match=r"the model outputs 128 logits per token but the byte tokenizer has 256 ids: "
                                          r"give the model an output of at least 256 \(e.g. nnx.Embed\(256"):
        Trainer(cfg, make_model=lambda rngs: BagOfWordsLM(128, 32, 64, rngs=rngs), loss_fn=next_token_loss)
    Trainer(cfg, make_model=lambda rngs: BagOfWordsLM(256, 32, 64, rngs=rngs), loss_fn=next_token_loss)
    # A model called on something else than tokens alone is not checked (nothing to trace).
    Trainer(cfg, make_model=lambda rngs: NeedsABatch(rngs=rngs), loss_fn=lambda m, b: m.loss(b))


class NeedsABatch(nnx.Module):
    def __init__(self, *, rngs):
        self.w = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (256, 8)))

    def __call__(self, batch):
        return self.w[...][batch["inputs"]]

    def loss(self, batch):
        return jnp.mean(self(batch) ** 2), {}


def test_trainer_rejects_batch_that_does_not_divide_before_compiling(tmp_path):
    cfg = get_config("tiny", ["batch_size=12", "parallel.fsdp=8", f"run_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="not divisible by the data-parallel size"):
        Trainer(cfg, train_data=RepeatingData())


# ---------------------------------------------------------------------------------------------------------------------
# Subprocesses: the real CLI, and resume across processes.

def _cli(args, tmp_path, timeout=300):
    return run_cli(tmp_path, *args, devices=None, timeout=timeout)


def _final_params(run_dir: Path, step: int):
    with Checkpointer(run_dir / "checkpoints") as ckpt:
        assert ckpt.latest_step() == step
        target = jax.tree.map(lambda x: x, _abstract_for(run_dir))
        state, meta = ckpt.restore(step, target)
    return state, meta


def _abstract_for(run_dir: Path):
    cfg = from_dict(json.loads((run_dir / "config.json").read_text()))
    parallel = ParallelConfig(strategy="dp", data=1, fsdp=1)
    return make_task(cfg.model, parallel, optim=cfg.optim, steps=cfg.max_steps, devices=jax.devices()[:1]).abstract_state()


@pytest.mark.slow
def test_resume_in_a_new_process_is_exact(tmp_path):
    straight = _cli(["train", *SMALL_RUN, "max_steps=6", "run_dir=straight"], tmp_path)
    assert straight.returncode == 0, straight.stderr[-3000:]
    first = _cli(["train", *SMALL_RUN, "max_steps=3", "run_dir=resumed"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    second = _cli(["train", *SMALL_RUN, "max_steps=6", "run_dir=resumed"], tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout and "at step 3" in second.stdout, second.stdout

    a, b = run_losses(tmp_path / "straight"), run_losses(tmp_path / "resumed")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
    assert a == b, f"losses differ after resume:\n{a}\n{b}"  # exact float equality
    sa, ma = _final_params(tmp_path / "straight", 6)
    sb, mb = _final_params(tmp_path / "resumed", 6)
    assert ma["data_step"] == mb["data_step"] == 6
    for x, y in zip(jax.tree.leaves(sa), jax.tree.leaves(sb)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
def test_cli_train_tiny_runs(tmp_path):
    out = _cli(["train", "--preset", "tiny", "max_steps=20", "run_dir=run", "sample_tokens=40"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "tok/s" in out.stdout and "mfu" in out.stdout and "loss" in out.stdout, out.stdout
    assert "---- sample ----" in out.stdout
    losses = run_losses(tmp_path / "run")
    assert losses[20] < losses[10] < 5.6
    assert (tmp_path / "run" / "checkpoints" / "20").is_dir()


def test_cli_rejects_unknown_key(tmp_path):
    out = _cli(["train", "max_step=20"], tmp_path, timeout=120)
    assert out.returncode == 2
    assert "unknown config key 'max_step'" in out.stderr and "'max_steps'" in out.stderr
