"""The built-in GPT's loss with its Transformer blocks run as a pipeline over a `stage` mesh axis.

    loss, aux = pipeline_loss(model, batch, mesh, n_micro=8, schedule="1f1b")   # equals model.next_token_loss(batch)

The embedding runs before the pipeline as an ordinary (GSPMD) op; the blocks run per stage; the last stage applies the
final norm, the output projection and the cross-entropy to each microbatch as soon as it arrives, so the backward of a
microbatch can start right away (jaxperf.parallel.pipeline.pipeline_value has the schedules). Every other mesh axis
(data, fsdp, seq, tensor) keeps its sharding inside a stage. `jaxperf.models.gpt.gpt_loss`, the loss the train
step uses for the built-in GPT, runs it when the model's hooks carry a `PipelineSpec` (the step sets it for meshes
with stage > 1).

Legend: M microbatches, B rows, b = B / M rows per microbatch, L length, D embed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxperf.models.layers import dense, remat_policy
from jaxperf.parallel.pipeline import check_layers, pipeline_value, split_microbatches
from jaxperf.parallel.ring_attention import zigzag_order

if TYPE_CHECKING:  # gpt.py imports this module for gpt_loss
    from jaxperf.models.gpt import GPT


def _stacked_blocks(model) -> tuple[nnx.GraphDef, Any]:
    """(graphdef of one block, block state with every leaf stacked on a leading layers axis)."""
    if model.cfg.scan_layers:
        return nnx.split(model.blocks)
    graphdef, first = nnx.split(model.blocks[0])
    states = [first] + [nnx.split(b)[1] for b in list(model.blocks)[1:]]
    return graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *states)


def pipeline_loss(model: GPT, batch: dict[str, jax.Array], mesh: Mesh, n_micro: int, axis: str = "stage", *,
                  schedule: str = "gpipe") -> tuple[jax.Array, dict[str, jax.Array]]:
    """`GPT.next_token_loss` (fp32 logits) with the blocks pipelined over `axis` in `n_micro` microbatches.

    The loss is the mean over every unmasked token of the whole batch, so it and its gradients equal the unpipelined
    model's. A batch's `positions` must be one token order shared by every row (the first row's are used); packed
    documents (`segment_ids`) are refused. Fits the step builder's `LossFn` with
    `functools.partial(pipeline_loss, mesh=mesh, n_micro=8)`.
    """
    cfg = model.cfg
    inputs, targets = batch["inputs"], batch["targets"]
    B, L = inputs.shape
    if L > cfg.max_seq_len:
        raise ValueError(f"sequence length {L} is above model.max_seq_len={cfg.max_seq_len}")
    if axis not in mesh.shape:
        raise ValueError(f"mesh axes {tuple(mesh.shape)} have no pipeline axis {axis!r}")
    check_layers(cfg.n_layers, mesh.shape[axis])
    split_microbatches(inputs, n_micro)  # checked before anything is computed
    if batch.get("segment_ids") is not None:
        raise ValueError("packed documents (a batch with segment_ids) do not run through the pipeline: use stage=1 "
                         "(seq, fsdp, tensor and data all take them), or rows of one document each")
    mask = batch.get("mask")
    mask = jnp.ones(targets.shape, jnp.float32) if mask is None else mask.astype(jnp.float32)
    positions_L = jnp.arange(L, dtype=jnp.int32) if batch.get("positions") is None else batch["positions"][0]
    x_BxLxD = model.embed(inputs, jnp.broadcast_to(positions_L[None], (B, L)))

    graphdef, block_state = _stacked_blocks(model)
    hooks = model.hooks

    def layer(state, x_BxLxD, pos_BxL):
        return nnx.merge(graphdef, state)(x_BxLxD, pos_BxL, None, hooks)

    if cfg.remat != "none":
        layer = jax.checkpoint(layer, policy=remat_policy(cfg))

    def stage_fn(params, x_bxLxD, pos_L):
        pos_bxL = jnp.broadcast_to(pos_L[None], x_bxLxD.shape[:2])
        return jax.lax.scan(lambda h, p: (layer(p, h, pos_bxL), None), x_bxLxD, params)[0]

    norm_def, norm_state = nnx.split(model.final_norm)

    def last_fn(last, y_BxLxD, aux, _):
        (norm, w_DxV), (t_BxL, m_BxL) = last, aux
        h = nnx.merge(norm_def, norm)(y_BxLxD)
        logits = dense(h, w_DxV.astype(h.dtype)).astype(jnp.float32)
        # The target's logit by a one-hot product rather than a gather: a gather along a vocabulary split over
        # `tensor` inside the stage-manual region trips XLA's partitioner.
        target = jnp.sum(logits * jax.nn.one_hot(t_BxL, logits.shape[-1], dtype=logits.dtype), axis=-1)
        nll = jax.nn.logsumexp(logits, axis=-1) - target
        return jnp.sum(nll * m_BxL), jnp.sum(m_BxL)

    micro = lambda a: split_microbatches(a, n_micro)  # noqa: E731
    total, count = pipeline_value(
        stage_fn, last_fn, block_state, (norm_state, model.output_weights()), micro(x_BxLxD), (micro(targets),
        micro(mask)), positions_L, mesh=mesh, axis=axis, schedule=schedule)
    return total / jnp.maximum(count, 1.0), {"weight": count}


def zigzag_batch(batch: dict[str, jax.Array], n: int) -> dict[str, jax.Array]:
    """The batch with its tokens in `zigzag_order` for a ring of n (the loss is a sum over tokens, so their order does
    not change it) and the `positions` the model needs to place them."""
    L = batch["inputs"].shape[1]
    order = zigzag_order(L, n)
    out = {k: (jnp.take(v, order, axis=1) if k in _PER_TOKEN and v is not None else v) for k, v in batch.items()}
    base = batch.get("positions")
    B = batch["inputs"].shape[0]
    out["positions"] = (jnp.broadcast_to(jnp.asarray(order, jnp.int32)[None], (B, L)) if base is None
                        else jnp.take(base, order, axis=1))
    return out


_PER_TOKEN = ("inputs", "targets", "mask", "segment_ids")
