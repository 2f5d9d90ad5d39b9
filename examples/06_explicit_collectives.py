"""One train step written three ways (jit, shard_map, pmap) on 8 simulated CPU devices: the losses agree.

    python examples/06_explicit_collectives.py            # about a minute on 2 CPU cores

Each flavour trains a tiny GPT for a few steps on the same batches from the same initial parameters; the single-device
jit step is the reference. shard_map runs data parallel (lax.pmean of the gradients), ZeRO-3 / fsdp (lax.all_gather
of the parameters, lax.psum_scatter of the gradients) and Megatron tensor parallelism (each device its own heads and
MLP columns, lax.psum after the row-parallel matmuls); pmap runs data parallel with a leading device axis.
See jaxperf/explicit/flavours.py.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

from jaxperf.config import ModelConfig, OptimConfig, ParallelConfig, TrainConfig  # noqa: E402
from jaxperf.explicit.flavours import build_train_step  # noqa: E402
from jaxperf.parallel.mesh import describe, make_mesh  # noqa: E402
from jaxperf.step.task import build_task  # noqa: E402

MODEL = ModelConfig(d_model=32, n_layers=2, n_heads=4, max_seq_len=32)
OPTIM = OptimConfig(lr=3e-3, warmup_steps=0)
STEPS, BATCH, SEQ = 4, 16, 32

RUNS = [  # (flavour, strategy, mesh)
    ("jit", "dp", dict(data=1, fsdp=1)),  # the reference, on one device
    ("jit", "fsdp", dict(data=1, fsdp=8)),
    ("shard_map", "dp", dict(data=8, fsdp=1)),
    ("shard_map", "fsdp", dict(data=1, fsdp=8)),
    ("shard_map", "fsdp", dict(data=2, fsdp=4)),  # fsdp within groups of 4, data parallel across the 2 groups
    ("shard_map", "tp", dict(data=2, fsdp=1, tensor=4)),  # 4 heads, one per device; data parallel across 2 groups
    ("pmap", "dp", dict(data=8, fsdp=1)),
]


def batches():
    rng = np.random.default_rng(0)
    for _ in range(STEPS):
        tokens = rng.integers(0, 256, (BATCH, SEQ + 1)).astype(np.int32)
        yield {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": np.ones((BATCH, SEQ), np.float32)}


def train(flavour: str, strategy: str, mesh_kw: dict) -> tuple[list[float], str]:
    devices = jax.devices()[: int(np.prod(list(mesh_kw.values())))]
    parallel = ParallelConfig(strategy=strategy, **mesh_kw)
    mesh = make_mesh(parallel, devices)
    task = build_task(TrainConfig(model=MODEL, optim=OPTIM, parallel=parallel, max_steps=STEPS), mesh)
    step = build_train_step(task, task.loss_fn, flavour)
    state = step.to_step(task.init_state())
    losses = []
    for batch in batches():
        state, metrics = step(state, jax.device_put(batch, task.batch_sharding()))
        losses.append(float(metrics["loss"]))
    embed = step.from_step(state).params["embed_VxD"]
    return losses, f"{describe(mesh)}, embed {embed.shape} stored as {embed.addressable_shards[0].data.shape}"


reference = None
for flavour, strategy, mesh_kw in RUNS:
    losses, where = train(flavour, strategy, mesh_kw)
    reference = reference or losses
    gap = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
    shown = " ".join(f"{x:.5f}" for x in losses)
    print(f"{flavour:>9} {strategy:<4} losses {shown} | max rel. diff {gap:.1e} | {where}")
    assert gap < 1e-5, f"{flavour}/{strategy} does not match the single-device jit step"
print("all flavours agree with the single-device jit step")
