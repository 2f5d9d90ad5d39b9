"""int8 checkpoints: `jaxperf quantize` writes them, `Generator.from_checkpoint` and `jaxperf serve` read them.

    report = quantize_run("runs/tiny", "runs/tiny-int8")     # weight bytes and held-out perplexity, before and after
    gen = Generator.from_checkpoint("runs/tiny-int8")         # int8 weights, scales verified

A quantized directory looks like a run directory: `config.json` (the run's), `quantization.json` (the scheme, the
source checkpoint, which weights are int8, bytes and perplexity) and `checkpoints/<step>/`, written by the same
`Checkpointer` as training. The checkpoint holds two trees: `params`, the run's parameter tree with every weight of
`jaxperf.models.quant.QUANTIZED` as its int8 values (same keys, same shapes), and `scales`, one fp32 array per such
weight (keyed by its path). Every array carries the checkpoint's checksum, so a damaged scale is refused with its
name (CorruptCheckpointError); scales are then checked to be positive finite numbers (ValueError otherwise), which
also catches a scale written wrong by some other tool.

Perplexity is exp(mean next-token cross-entropy) over the run's held-out tokens (the tail `datasets_for` keeps
apart), through the model's full forward with the weights as they are held.

Legend: B batch, L length.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxperf import _compat
from jaxperf.config import from_dict
from jaxperf.data import datasets_for, tokenizer_for
from jaxperf.models.gpt import cross_entropy_from_logits
from jaxperf.models.quant import QUANTIZED, Int8Weight, check_scales, is_int8, quantize_params, tree_bytes
from jaxperf.step.task import build_task
from jaxperf.checkpoint import Checkpointer

QUANT_FILE = "quantization.json"
SCHEME = "int8 weight-only, symmetric, one fp32 scale per output channel (absmax / 127)"


def is_quantized_dir(path: str | Path) -> bool:
    return (Path(path) / QUANT_FILE).is_file()


def _path_name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def split_scales(qparams: Any) -> tuple[Any, dict[str, jax.Array]]:
    """(the tree with each Int8Weight as its int8 values, {path: scale}) for saving."""
    scales: dict[str, jax.Array] = {}

    def one(path, x):
        if is_int8(x):
            scales[_path_name(path)] = x.scale
            return x.q
        return x

    return jax.tree_util.tree_map_with_path(one, qparams, is_leaf=is_int8), scales


def join_scales(params: Any, scales: dict[str, Any]) -> Any:
    """The inverse of `split_scales`: int8 leaves with a scale become Int8Weight again."""
    def one(path, x):
        name = _path_name(path)
        return Int8Weight(x, scales[name]) if name in scales else x

    return jax.tree_util.tree_map_with_path(one, params)


def _quantized_names(abstract: Any) -> list[str]:
    names = []
    for path, _ in jax.tree_util.tree_flatten_with_path(abstract)[0]:
        last = path[-1]
        if str(getattr(last, "key", getattr(last, "name", last))) in QUANTIZED:
            names.append(_path_name(path))
    return names


def _target(abstract: Any, names: list[str]) -> dict:
    """Restore target: the params with int8 dtype where quantized, and the scales (replicated; they are small)."""
    scale_shapes: dict[str, tuple[int, ...]] = {}
    shapes = jax.eval_shape(quantize_params, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), abstract))
    for path, x in jax.tree_util.tree_flatten_with_path(shapes, is_leaf=is_int8)[0]:
        if is_int8(x):
            scale_shapes[_path_name(path)] = x.scale.shape

    def param(path, x):
        dtype = jnp.int8 if _path_name(path) in names else x.dtype
        return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)

    some = jax.tree.leaves(abstract)[0].sharding
    rep = NamedSharding(some.mesh, P()) if isinstance(some, NamedSharding) else some
    return {"params": jax.tree_util.tree_map_with_path(param, abstract),
            "scales": {n: jax.ShapeDtypeStruct(scale_shapes[n], jnp.float32, sharding=rep) for n in names}}


def restore_quantized(run_dir: str | Path, abstract_params: Any, *, step: int | None = None) -> Any:
    """The int8 parameter tree (Int8Weight leaves) of a directory written by `quantize_run`, verified.

    `abstract_params` is the run's fp32 parameter tree as ShapeDtypeStructs with shardings (Task
    .abstract_params_sharded()). Raises CorruptCheckpointError for an array that does not match its checksum
    (nothing is moved aside: the directory is the user's), ValueError for scales that are not positive finite.
    """
    run_dir = Path(run_dir)
    info = json.loads((run_dir / QUANT_FILE).read_text())
    names = list(info["quantized"])
    target = _target(abstract_params, names)
    with Checkpointer(run_dir / "checkpoints", read_only=True) as ckpt:
        restored, _ = ckpt.restore(step, target)
    params = join_scales(restored["params"], restored["scales"])
    check_scales(params)
    return params


def _restore_fp32(run_dir: Path, step: int | None):
    cfg = from_dict(json.loads((run_dir / "config.json").read_text()))
    mesh = _compat.make_mesh((1, 1, 1), ("data", "fsdp", "tensor"), devices=jax.devices()[:1])
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, strategy="tp"))
    task = build_task(cfg, mesh, with_optimizer=False)
    target = {"params": task.abstract_params_sharded()}
    with Checkpointer(run_dir / "checkpoints", read_only=True) as ckpt:
        restored, _, step = ckpt.restore_step_or_latest(step, target)
    return cfg, task, restored["params"], int(step)


def perplexity(task, params: Any, dataset, *, batches: int, batch_size: int) -> float:
    """exp(mean next-token loss) of the task's model with `params` (fp32 or int8) over `batches` held-out batches."""
    @jax.jit
    def loss(params, batch):
        template = jax.tree.map(lambda x: x, task.param_template)
        nnx.replace_by_pure_dict(template, params)
        model = nnx.merge(task.graphdef, template, task.model_state)
        total, aux = cross_entropy_from_logits(model(batch["inputs"]), batch["targets"], batch["mask"])
        return total * aux["weight"], aux["weight"]

    nll, count = 0.0, 0.0
    for i in range(batches):
        b = dataset.batch(i, batch_size)
        s, w = jax.device_get(loss(params, {k: jnp.asarray(v) for k, v in b.items()}))
        nll, count = nll + float(s), count + float(w)
    return math.exp(nll / max(count, 1.0))


def quantize_run(run_dir: str | Path, out_dir: str | Path, *, step: int | None = None, eval_batches: int = 8,
                 batch_size: int = 8) -> dict[str, Any]:
    """Write the int8 version of a run's checkpoint to `out_dir`; returns the report (also in quantization.json).

    The report holds the weight bytes before and after and, with eval_batches > 0 and a held-out split, the
    perplexity of both on the same held-out tokens.
    """
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    if not (run_dir / "config.json").exists():
        raise FileNotFoundError(f"{run_dir}/config.json not found: --checkpoint takes the run_dir of a `jaxperf "
                                f"train` run")
    if is_quantized_dir(run_dir):
        raise ValueError(f"{run_dir} is already quantized ({QUANT_FILE}); give the run it came from")
    if out_dir.resolve() == run_dir.resolve():
        raise ValueError("--out must be another directory than --checkpoint: the run's checkpoints stay as they are")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not empty: give a new directory (or remove it)")
    cfg, task, params, step = _restore_fp32(run_dir, step)
    qparams = quantize_params(params)
    report: dict[str, Any] = {
        "scheme": SCHEME, "source": str(run_dir.resolve()), "source_step": step,
        "quantized": [n for n in _quantized_names(params)],
        "weight_bytes_before": tree_bytes(params), "weight_bytes_after": tree_bytes(qparams),
    }
    report["ratio"] = report["weight_bytes_after"] / report["weight_bytes_before"]
    if eval_batches > 0:
        _, val = datasets_for(cfg, tokenizer_for(cfg))
        if val is not None:
            report["eval_tokens"] = eval_batches * batch_size * cfg.train_seq_len
            report["perplexity_before"] = perplexity(task, params, val, batches=eval_batches, batch_size=batch_size)
            report["perplexity_after"] = perplexity(task, qparams, val, batches=eval_batches, batch_size=batch_size)
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(run_dir / "config.json", out_dir / "config.json")
    tree, scales = split_scales(qparams)
    with Checkpointer(out_dir / "checkpoints") as ckpt:
        ckpt.save(step, {"params": tree, "scales": scales}, metadata={"quantization": report}, force=True)
    (out_dir / QUANT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    return report


__all__ = ["QUANT_FILE", "is_quantized_dir", "join_scales", "perplexity", "quantize_run", "restore_quantized",
           "split_scales"]
