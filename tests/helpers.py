"""What the tests share: tasks of small models on the simulated devices, deterministic batches, flat views of
parameter trees, and `jaxperf` commands run in subprocesses (every wait bounded)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jaxperf.config import ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from jaxperf.parallel.mesh import make_mesh
from jaxperf.step.task import Task, build_task

# A run small enough for a subprocess test: one layer of width 32 on bytes, logged every step, no eval or sample.
SMALL_RUN = [
    "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.max_seq_len=32", "batch_size=8",
    "data.max_bytes=300000", "optim.decay_steps=6", "optim.warmup_steps=2", "log_every=1", "eval_every=0",
    "checkpoint_every=0", "sample_tokens=0", "tensorboard=false",
]


# ---------------------------------------------------------------------------------------------------------------------
# In-process tasks and data


def make_task(model: ModelConfig, parallel: ParallelConfig = ParallelConfig(), *, optim: OptimConfig = OptimConfig(),
              steps: int = 10, devices=None, seed: int = 0, microbatches: int = 1, **kw) -> Task:
    """The Task `jaxperf train` would build for this model, mesh and optimizer (`build_task`); `devices` picks the
    simulated devices of the mesh (default all 8); `microbatches` are the pipeline's when parallel.stage > 1; `**kw`
    goes to build_task (make_model, loss_fn, tx)."""
    cfg = TrainConfig(model=model, optim=optim, parallel=parallel, max_steps=steps, seed=seed,
                      microbatches=microbatches)
    return build_task(cfg, make_mesh(parallel, devices), **kw)


def flat(tree) -> dict[str, jax.Array]:
    """{"blocks/attn/wq_DxHxDh": leaf, ...}: a parameter tree keyed by slash-joined paths."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        out["/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)] = leaf
    return out


@jax.jit
def forward(model, tokens):
    """A model's output for `tokens` as one compiled program, as a user runs it (op by op, every operation compiles a
    program of its own: most of a small test's time)."""
    return model(tokens)


def random_batches(n: int, *, batch: int, seq: int, vocab: int = 256, keep: float = 1.0, seed: int = 1) -> list[dict]:
    """n batches of random tokens; each token is kept in the loss with probability `keep` (a ragged mask makes
    devices and microbatches hold different token counts)."""
    rng = np.random.default_rng(seed)
    return [
        {
            "inputs": rng.integers(0, vocab, (batch, seq)).astype(np.int32),
            "targets": rng.integers(0, vocab, (batch, seq)).astype(np.int32),
            "mask": (rng.random((batch, seq)) < keep).astype(np.float32),
        }
        for _ in range(n)
    ]


def fixed_batch(batch: int = 8, seq: int = 32, vocab: int = 256, seed: int = 0, masked_prefix: int = 0) -> dict:
    """One batch of a random token stream (targets are the inputs shifted by one); the first `masked_prefix` tokens
    of every row are left out of the loss."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (batch, seq + 1)).astype(np.int32)
    mask = np.ones((batch, seq), np.float32)
    mask[:, :masked_prefix] = 0.0
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask}


def hf_tokenizer(directory, text: str, vocab_size: int = 300, specials=("<s>", "</s>", "<pad>")) -> Tokenizer:
    """A byte-level BPE (GPT-2's pre-tokenization) trained on `text`, saved as directory/tokenizer.json: what a
    Hugging Face model directory ships. The special tokens get ids 0, 1, 2..."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text], trainer=trainer)
    Path(directory).mkdir(parents=True, exist_ok=True)
    tok.save(str(Path(directory) / "tokenizer.json"))
    return tok


# ---------------------------------------------------------------------------------------------------------------------
# The jaxperf command in subprocesses


def cli_env(tmp_path, devices: int | None = 8, **extra) -> dict:
    """The environment of a CPU run with `devices` simulated devices (None: JAX's default, one) and its own cache;
    the test session's other XLA flags (conftest.py) carry over."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XDG_CACHE_HOME": str(tmp_path / "cache"), **extra}
    flags = [f for f in env.pop("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    return env


def run_cli(tmp_path, *args, devices: int | None = 8, timeout: float = 300, **env) -> subprocess.CompletedProcess:
    """`jaxperf *args` run to completion in tmp_path, output captured."""
    return subprocess.run([sys.executable, "-m", "jaxperf.cli", *args], capture_output=True, text=True,
                          env=cli_env(tmp_path, devices, **env), cwd=tmp_path, timeout=timeout)


def start_train(tmp_path, args, devices: int = 8, **env) -> subprocess.Popen:
    """`jaxperf train *args` started in tmp_path, output captured."""
    return subprocess.Popen([sys.executable, "-m", "jaxperf.cli", "train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=cli_env(tmp_path, devices, **env), cwd=tmp_path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def start_pair(tmp_path, args, devices: int = 4, **env) -> list[subprocess.Popen]:
    """Two processes of one job (a coordinator on a free localhost port), `devices` CPU devices each."""
    port = free_port()
    return [start_train(tmp_path, args, devices, JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES="2",
                        JAX_PROCESS_ID=str(i), **env) for i in range(2)]


def finish(procs, timeout: float = 300) -> list[tuple[int, str, str]]:
    """(return code, stdout, stderr) of each process; on a timeout every process is killed and the error raised."""
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs


def metrics_by_step(run_dir: Path) -> dict[int, dict]:
    """step -> the last metrics record of that step (a resumed run appends to the same file)."""
    out = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "loss" in r:
            out[r["step"]] = r
    return out


def wait_for_steps(run_dir: Path, n: int, proc, timeout: float = 180) -> None:
    """Wait until `proc` has logged `n` steps to run_dir/metrics.jsonl (failing if it exits or times out)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        f = Path(run_dir) / "metrics.jsonl"
        if f.exists() and len(f.read_text().splitlines()) >= n:
            return
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"no {n} steps logged in {timeout}s")


def losses(run_dir: Path) -> dict[int, float]:
    """step -> loss from a run's metrics.jsonl."""
    return {step: r["loss"] for step, r in metrics_by_step(run_dir).items()}
