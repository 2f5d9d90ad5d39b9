"""The built-in GPT with its Transformer blocks run through the GPipe pipeline (jaxperf.parallel.pipeline).

    loss, aux = pipeline_loss(model, batch, mesh, n_micro=8)     # equals model.next_token_loss(batch)

The embedding, final norm, output projection and loss run outside the pipeline as ordinary (GSPMD) ops; only the
blocks run per stage.

Legend: M microbatches, B rows, L length, D embed.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxperf.models.gpt import REMAT_POLICIES, cross_entropy_from_logits
from jaxperf.parallel.pipeline import check_layers, gpipe, scan_stage, split_microbatches


def _stacked_blocks(model) -> tuple[nnx.GraphDef, Any]:
    """(graphdef of one block, block state with every leaf stacked on a leading layers axis)."""
    if model.cfg.scan_layers:
        return nnx.split(model.blocks)
    graphdef, first = nnx.split(model.blocks[0])
    states = [first] + [nnx.split(b)[1] for b in list(model.blocks)[1:]]
    return graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *states)


def pipeline_hidden(model, tokens_BxL: jax.Array, mesh: Mesh, n_micro: int, axis: str = "stage", *,
                    batch_axes=None) -> jax.Array:
    """`model.hidden(tokens)` with the blocks run through `gpipe`: final-norm hidden states [B, L, D].

    Positions are 0..L-1 and there are no segment ids, as in `GPT.next_token_loss`. The model's `remat` setting applies
    to each layer as in `GPT.hidden`.
    """
    cfg = model.cfg
    B, L = tokens_BxL.shape
    if L > cfg.max_seq_len:
        raise ValueError(f"sequence length {L} is above model.max_seq_len={cfg.max_seq_len}")
    if axis not in mesh.shape:
        raise ValueError(f"mesh axes {tuple(mesh.shape)} have no pipeline axis {axis!r}")
    check_layers(cfg.n_layers, mesh.shape[axis])
    tokens_MxBmxL = split_microbatches(tokens_BxL, n_micro)
    dt = jnp.dtype(cfg.dtype)
    x_MxBmxLxD = jnp.take(model.embed_VxD[...], tokens_MxBmxL, axis=0).astype(dt)
    if model.pos_LxD is not None:
        x_MxBmxLxD = x_MxBmxLxD + model.pos_LxD[...][:L].astype(dt)[None, None]

    graphdef, block_state = _stacked_blocks(model)

    def layer(state, x_BxLxD):
        positions_BxL = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32)[None], x_BxLxD.shape[:2])
        return nnx.merge(graphdef, state)(x_BxLxD, positions_BxL, None)

    if cfg.remat != "none":
        layer = jax.checkpoint(layer, policy=REMAT_POLICIES[cfg.remat])
    y_MxBmxLxD = gpipe(scan_stage(layer), block_state, x_MxBmxLxD, mesh, axis, batch_axes=batch_axes)
    return model.final_norm(y_MxBmxLxD.reshape(B, L, -1))


def pipeline_loss(model, batch: dict[str, jax.Array], mesh: Mesh, n_micro: int, axis: str = "stage", *,
                  batch_axes=None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`GPT.next_token_loss` (fp32 logits path) with the Transformer blocks pipelined over `axis` in `n_micro` parts.

    The embedding, final norm, output projection and loss run outside the pipeline as ordinary (GSPMD) ops; only the
    blocks run per stage. The loss is the mean over every unmasked token of the whole batch, so it and its gradients
    equal the unpipelined model's. Fits the step builder's `LossFn` with
    `functools.partial(pipeline_loss, mesh=mesh, n_micro=8)`.

        loss, aux = pipeline_loss(model, {"inputs": x_BxL, "targets": y_BxL}, mesh, n_micro=8)
    """
    inputs, targets = batch["inputs"], batch["targets"]
    mask = batch.get("mask")
    mask = jnp.ones(targets.shape, jnp.float32) if mask is None else mask.astype(jnp.float32)
    h_BxLxD = pipeline_hidden(model, inputs, mesh, n_micro, axis, batch_axes=batch_axes)
    logits_BxLxV = jnp.einsum("bld,dv->blv", h_BxLxD, model.output_weights().astype(h_BxLxD.dtype))
    return cross_entropy_from_logits(logits_BxLxV, targets, mask)

