"""A decoder-only Transformer (GPT-2 or Llama style) as a Flax NNX module.

    model = GPT(ModelConfig(style="llama", n_kv_heads=2), rngs=nnx.Rngs(0))
    logits_BxLxV = model(tokens_BxL)

Layers are either stacked on a leading `layers` axis and run under `lax.scan` (one compiled body, fast compiles) or kept
as a list and run in a Python loop. Either way each layer can be rematerialised with a policy from `REMAT_POLICIES`.

Legend: B batch, L length, D embed, V (padded) vocab, N layers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxperf.config import ModelConfig, validate_model
from jaxperf.models import kernels
from jaxperf.models.layers import (REMAT_POLICIES, Block, Norm, _param, dense, embed_lookup, norm_grad_dtype,
                                   remat_policy)
from jaxperf.models.hooks import DEFAULT_HOOKS, ContextSpec, LayerHooks, PipelineSpec
from jaxperf.models.layer_scan import remat_full_scan
from jaxperf.models.moe import STATS, MoE, MoeStats, is_moe_layer
from jaxperf.models.pipelined import pipeline_loss, zigzag_batch
from jaxperf.models.platform import layers_per_iteration
from jaxperf.models.registry import implementation, register
from jaxperf.parallel.rules import constrain
from pallas_kernels.cross_entropy import unavailable_reason as ce_unavailable_reason

# Logical axes of one layer's KV cache [B, K, S, Dh]: rows follow the batch (data axes), KV heads the tensor axis.
CACHE_AXES = ("batch", "kv_heads", "seq", "head_dim")

def _stacked_blocks(cfg: ModelConfig, rngs: nnx.Rngs) -> Block:
    """N layers created at once: every parameter gets a leading `layers` axis."""

    @nnx.split_rngs(splits=cfg.n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(r: nnx.Rngs) -> Block:
        return _block(cfg, r, 0)  # a stack is all dense or all MoE (validate_model refuses moe_every > 1 here)

    return make(rngs)


def compact_layer_grads(cfg: ModelConfig) -> bool:
    """Whether the scanned layers run `layer_scan.remat_full_scan` (model.layer_grads_in_compute_dtype): remat full,
    a compute dtype narrower than the parameters'."""
    return bool(cfg.layer_grads_in_compute_dtype) and cfg.remat == "full" and (
        jnp.dtype(cfg.dtype).itemsize < jnp.dtype(cfg.param_dtype).itemsize)


def _block(cfg: ModelConfig, rngs: nnx.Rngs, layer: int) -> Block:
    """Layer `layer`, with an MoE MLP where the config puts one (jaxperf.models.moe.is_moe_layer)."""
    return Block(cfg, rngs=rngs, make_mlp=MoE if is_moe_layer(cfg, layer) else None)


class GPT(nnx.Module):
    """Token embedding -> N pre-norm blocks -> final norm -> logits over the padded vocabulary.

    `hooks` (jaxperf.models.hooks) lets a step written with explicit collectives reach into the layers: every layer's
    parameters pass through `hooks.layer_params` where the layer runs, and every row-parallel matmul's output through
    `hooks.row_parallel`. Stacked layers (`scan_layers`) keep their parameters under `layer_stack`.
    """

    hooks: LayerHooks = DEFAULT_HOOKS  # replaced per call by a step that needs them (Task.merge(..., hooks=))
    layer_stack = "blocks"  # where the stacked layers' parameters live in the parameter tree

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        cfg = validate_model(cfg)
        self.cfg = cfg
        D, V = cfg.d_model, cfg.padded_vocab
        pd = jnp.dtype(cfg.param_dtype)
        init = nnx.initializers.normal(cfg.init_std)
        self.embed_VxD = _param(rngs, init, (V, D), ("vocab", "embed"), pd)
        self.pos_LxD = (
            _param(rngs, nnx.initializers.normal(0.01), (cfg.max_seq_len, D), ("seq", "embed"), pd)
            if cfg.position == "learned"
            else None
        )
        if cfg.scan_layers:
            self.blocks = _stacked_blocks(cfg, rngs)
        else:
            self.blocks = nnx.List([_block(cfg, rngs, i) for i in range(cfg.n_layers)])
        self.final_norm = Norm(D, cfg.norm, eps=cfg.norm_eps, use_bias=cfg.use_bias, param_dtype=pd, rngs=rngs,
                               impl=cfg.norm_impl, platform=cfg.platform, grad_dtype=norm_grad_dtype(cfg))
        self.head_DxV = None if cfg.tie_embeddings else _param(rngs, init, (D, V), ("embed", "vocab"), pd)

    def embed(self, tokens_BxL: jax.Array, positions_BxL: jax.Array) -> jax.Array:
        """Token embeddings plus learned positions (when the style has them): [B, L, D] in the compute dtype."""
        dt = jnp.dtype(self.cfg.dtype)
        x_BxLxD = embed_lookup(self.embed_VxD[...], tokens_BxL, dt)
        if self.pos_LxD is not None:
            x_BxLxD = x_BxLxD + embed_lookup(self.pos_LxD[...], positions_BxL, dt)
        return constrain(x_BxLxD, ("batch", "residual_seq", "embed"))

    def hidden(self, tokens_BxL: jax.Array, positions_BxL=None, segment_ids_BxL=None) -> jax.Array:
        """Final-norm hidden states [B, L, D] in the compute dtype (for fused losses that skip the logits)."""
        cfg = self.cfg
        B, L = tokens_BxL.shape
        if L > cfg.max_seq_len:
            raise ValueError(f"sequence length {L} is above model.max_seq_len={cfg.max_seq_len}")
        if positions_BxL is None:
            positions_BxL = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32)[None], (B, L))
        x_BxLxD = self.embed(tokens_BxL, positions_BxL)

        policy = remat_policy(cfg)
        hooks = self.hooks

        def apply(graphdef, state, x, pos, seg):
            return nnx.merge(graphdef, hooks.layer_params(state)).forward(x, pos, seg, hooks)

        plain_apply = apply
        if cfg.remat != "none":
            apply = jax.checkpoint(apply, policy=policy, static_argnums=(0,))

        if cfg.scan_layers:
            graphdef, state = nnx.split(self.blocks)
            if compact_layer_grads(cfg):
                # remat full with the backward's weight-gradient stacks in the compute dtype (models.layer_scan)
                x_BxLxD, stats = remat_full_scan(
                    lambda s, x, pos, seg: plain_apply(graphdef, s, x, pos, seg), state, x_BxLxD,
                    (positions_BxL, segment_ids_BxL), unroll=layers_per_iteration(cfg), grad_dtype=jnp.dtype(cfg.dtype))
            else:
                def body(x, layer_state):
                    return apply(graphdef, layer_state, x, positions_BxL, segment_ids_BxL)

                x_BxLxD, stats = jax.lax.scan(body, x_BxLxD, state, unroll=layers_per_iteration(cfg))
            # every layer's MoE stats come out as the scan's stacked outputs ({} for dense layers)
            stats = [jax.tree.map(lambda v: jnp.mean(v, axis=0), stats)] if stats else []
        else:
            stats = []
            for block in self.blocks:
                graphdef, state = nnx.split(block)
                x_BxLxD, layer_stats = apply(graphdef, state, x_BxLxD, positions_BxL, segment_ids_BxL)
                stats += [layer_stats] if layer_stats else []
        if stats:
            # the mean over the MoE layers, so the loss coefficients do not depend on depth; taken by the loss
            self.moe_stats = MoeStats({k: jnp.mean(jnp.stack([s[k] for s in stats])) for k in STATS})
        return self.final_norm(x_BxLxD)

    def pop_moe_stats(self) -> dict[str, jax.Array]:
        """The MoE router statistics of the last `hidden` (`moe.STATS`: means over the MoE layers),
        removed from the module so they never become model state; {} for a dense model or before any forward."""
        if not hasattr(self, "moe_stats"):
            return {}
        stats = dict(self.moe_stats.get_value())
        del self.moe_stats
        return stats

    def init_cache(self, batch: int, max_len: int, dtype=None) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
        """Zeroed KV cache (k, v): one [B, K, max_len, Dh] array per layer, in the compute dtype (see `cached`).

        One array per layer, not one stacked [N, ...] array: a layer reads and writes its own buffer in place, where a
        stacked cache would be sliced (copied) for every layer of every step.
        """
        cfg = self.cfg
        shape = (batch, cfg.n_kv_heads, max_len, cfg.head_dim)
        dt = jnp.dtype(dtype or cfg.dtype)
        k = tuple(constrain(jnp.zeros(shape, dt), CACHE_AXES) for _ in range(cfg.n_layers))
        v = tuple(constrain(jnp.zeros(shape, dt), CACHE_AXES) for _ in range(cfg.n_layers))
        return k, v

    def layer_modules(self) -> list[Block]:
        """The N blocks as separate modules (stacked layers sliced per layer; a list as it is)."""
        if not self.cfg.scan_layers:
            return list(self.blocks)
        graphdef, state = nnx.split(self.blocks)
        return [nnx.merge(graphdef, jax.tree.map(lambda x, i=i: x[i], state)) for i in range(self.cfg.n_layers)]

    def cached(self, tokens_BxT, positions_BxT, k_cache, v_cache, index_B=None, *, attend=None):
        """The forward over a KV cache: (final-norm hidden [B, T, D], k_cache, v_cache).

        Prefill (`index_B` None): T prompt tokens per row fill cache slots [0, T) and attend causally, as in `hidden`
        (right-padded prompts: padding after a row's last token changes none of its real positions). Decode
        (`index_B` [B], T == 1): row b's token is written to slot index_B[b] and attends to slots [0, index_B[b]].
        `positions_BxT` are the tokens' positions (for learned positions and RoPE); the caches are tuples of one
        [B, K, S, Dh] array per layer as made by `init_cache`. `attend` replaces the decode attention (signature of
        `jaxperf.models.layers.decode_attention`). The layers run one after the other in Python, so each reads its
        own cache buffer; stacked (`scan_layers`) parameters are sliced per layer here, so a server keeps them
        unstacked (`jaxperf.generate` does). Remat does not apply: nothing is differentiated here.
        """
        cfg = self.cfg
        dt = jnp.dtype(cfg.dtype)
        if len(k_cache) != cfg.n_layers or len(v_cache) != cfg.n_layers:
            raise ValueError(f"the cache has {len(k_cache)} layers, the model {cfg.n_layers}: make it with init_cache")
        S = k_cache[0].shape[2]
        if tokens_BxT.shape[1] > S:
            raise ValueError(f"{tokens_BxT.shape[1]} tokens do not fit a cache of {S} slots: make the cache longer")
        x_BxTxD = embed_lookup(self.embed_VxD[...], tokens_BxT, dt)
        if self.pos_LxD is not None:
            x_BxTxD = x_BxTxD + embed_lookup(self.pos_LxD[...], positions_BxT, dt, mode="clip")
        x_BxTxD = constrain(x_BxTxD, ("batch", "seq", "embed"))
        k_out, v_out = [], []
        for block, k_l, v_l in zip(self.layer_modules(), k_cache, v_cache):
            x_BxTxD, k_l, v_l = block.cached(x_BxTxD, positions_BxT, k_l, v_l, index_B, attend=attend)
            k_out.append(constrain(k_l, CACHE_AXES))
            v_out.append(constrain(v_l, CACHE_AXES))
        return self.final_norm(x_BxTxD), tuple(k_out), tuple(v_out)

    def output_weights(self) -> jax.Array:
        """The output projection [D, V] (the embedding table transposed when tied; an `Int8Weight` when quantized)."""
        return self.embed_VxD[...].T if self.head_DxV is None else self.head_DxV[...]

    def __call__(self, tokens_BxL: jax.Array, positions_BxL=None, segment_ids_BxL=None) -> jax.Array:
        """Logits [B, L, V] in the compute dtype."""
        h_BxLxD = self.hidden(tokens_BxL, positions_BxL, segment_ids_BxL)
        logits = dense(h_BxLxD, self.output_weights().astype(h_BxLxD.dtype),
                       grad_barrier=bool(self.cfg.matmul_grad_barrier))
        return constrain(logits, ("batch", "seq", "vocab"))


    def next_token_loss(self, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Masked next-token cross-entropy (fp32): (mean over unmasked tokens, {"weight": unmasked tokens}).

        An MoE model (`n_experts > 0`) adds `router_aux_loss_coef * aux_loss + router_z_loss_coef * z_loss` to the
        mean (and the router bias's signal, zero but for its gradient: `jaxperf.models.moe.bias_signal`) and reports
        its router statistics as aux["metrics"] (moe_aux_loss, moe_z_loss, moe_dropped_fraction, moe_max_load: the
        busiest expert's slots over an even share, averaged over the MoE layers), which the train step adds to its
        metrics.

        With `loss_impl="pallas"` the output projection and the softmax are fused in one kernel that never builds the
        [tokens, vocab] logits; "chunked" does the same in plain JAX over chunks of tokens; "xla" materialises the
        logits in fp32; "auto" was settled to one of them with the config (jaxperf.models.platform.settle). The batch
        may carry `positions` and `segment_ids` [B, L] (packed documents; a token order other than 0..L-1).
        """
        mask = batch.get("mask")
        mask = jnp.ones(batch["targets"].shape, jnp.float32) if mask is None else mask.astype(jnp.float32)
        loss = implementation("loss", self.cfg.loss_impl, self, batch, platform=self.cfg.platform)
        total, count = loss(self, batch, mask, platform=self.cfg.platform)
        mean, aux = total / jnp.maximum(count, 1.0), {"weight": count}
        stats = self.pop_moe_stats()
        if stats:
            # An MoE model trains on the cross-entropy plus its router losses; each is reported as a step metric.
            cfg = self.cfg
            mean = (mean + cfg.router_aux_loss_coef * stats["aux_loss"] + cfg.router_z_loss_coef * stats["z_loss"]
                    + stats["bias_signal"])
            aux["metrics"] = {"moe_aux_loss": stats["aux_loss"], "moe_z_loss": stats["z_loss"],
                              "moe_dropped_fraction": stats["dropped"], "moe_max_load": stats["max_load"]}
        return mean, aux


def cross_entropy_from_logits(logits_BxLxV, targets_BxL, mask_BxL):
    """(mean of -log p(target) over the mask, {"weight": mask sum}) with the softmax in fp32."""
    total, weight = cross_entropy_sums(logits_BxLxV, targets_BxL, mask_BxL)
    return total / jnp.maximum(weight, 1.0), {"weight": weight}


def cross_entropy_sums(logits_BxLxV, targets_BxL, mask_BxL):
    """(sum of -log p(target) over the mask, mask sum) with the softmax in fp32."""
    logits = logits_BxLxV.astype(jnp.float32)
    logz = jax.nn.logsumexp(logits, axis=-1)
    # A one-hot product, not a gather: the partitioner keeps it in place when the vocabulary is split over `tensor`
    # and the sequence over `seq` (a gather there is all-gathered onto every device first).
    target_logit = jnp.sum(logits * jax.nn.one_hot(targets_BxL, logits.shape[-1], dtype=logits.dtype), axis=-1)
    return jnp.sum((logz - target_logit) * mask_BxL), jnp.sum(mask_BxL)


# ---------------------------------------------------------------------------------------------------------------------
# The loss implementations (jaxperf.models.registry): fn(model, batch, mask, *, platform) -> (sum of token losses,
# unmasked tokens).


def _xla_loss(model: GPT, batch, mask_BxL, *, platform=None):
    """The model's logits, materialised, then the softmax cross-entropy in fp32."""
    logits = model(batch["inputs"], batch.get("positions"), batch.get("segment_ids"))
    return cross_entropy_sums(logits, batch["targets"], mask_BxL)


def _fused_loss(impl: str):
    """The output projection and the softmax in one pass over row chunks (jaxperf.models.kernels.linear_cross_entropy:
    "chunked" in plain JAX, "pallas" the kernel): no [tokens, vocab] logits."""

    def loss(model: GPT, batch, mask_BxL, *, platform=None):
        h_BxLxD = model.hidden(batch["inputs"], batch.get("positions"), batch.get("segment_ids"))
        B, L, D = h_BxLxD.shape
        return kernels.linear_cross_entropy(
            h_BxLxD.reshape(B * L, D), model.output_weights().astype(h_BxLxD.dtype), batch["targets"].reshape(B * L),
            mask_BxL.reshape(B * L), impl=impl, platform=platform,
            gather_once=bool(model.cfg.loss_gather_once))

    return loss


def _pallas_loss_unavailable(model: GPT, batch, *, platform) -> str | None:
    cfg, (B, L) = model.cfg, batch["targets"].shape
    h = jax.ShapeDtypeStruct((B * L, cfg.d_model), jnp.dtype(cfg.dtype))
    w = jax.ShapeDtypeStruct((cfg.d_model, cfg.padded_vocab), jnp.dtype(cfg.dtype))
    return ce_unavailable_reason(h, w, backend=platform)


register("loss", "xla", _xla_loss)
register("loss", "chunked", _fused_loss("chunked"))
register("loss", "pallas", _fused_loss("pallas"), _pallas_loss_unavailable)


def count_params(cfg: ModelConfig, *, embeddings: bool = True) -> int:
    """Parameter count from the config alone (no allocation)."""
    model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))
    state = nnx.state(model, nnx.Param)
    total = sum(x.size for x in jax.tree.leaves(state))
    if not embeddings:
        r = model.cfg
        total -= r.padded_vocab * r.d_model * (1 if r.tie_embeddings else 2)
        total -= r.max_seq_len * r.d_model if r.position == "learned" else 0
    return int(total)


def gpt_loss(model: GPT, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The built-in GPT's train loss (a `LossFn` for jaxperf.step.Task): with the tokens in zigzag order when the
    model's hooks carry a ContextSpec, pipelined when they carry a PipelineSpec, else `model.next_token_loss`."""
    context: ContextSpec | None = model.hooks.context
    if context is not None and context.layout == "zigzag":
        batch = zigzag_batch(batch, context.n)
    spec: PipelineSpec | None = model.hooks.pipeline
    if spec is None:
        return model.next_token_loss(batch)
    return pipeline_loss(model, batch, spec.mesh, spec.n_micro, spec.axis, schedule=spec.schedule)
