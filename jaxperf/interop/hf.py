"""Hugging Face checkpoints in and out: GPT-2 (`GPT2LMHeadModel`) and Llama (`LlamaForCausalLM`).

    cfg, params = import_hf("path/to/gpt2")          # ModelConfig + pure-dict params (numpy, float32)
    model = load_hf_model("path/to/llama", mesh=mesh) # a jaxperf GPT with those params, sharded on the mesh
    export_hf(cfg, params, "out/", arch="llama")     # config.json + model.safetensors for from_pretrained("out/")

Only `config.json` and `*.safetensors` files are read (sharded checkpoints through `model.safetensors.index.json`),
with the `safetensors` package's numpy API: no torch, no network. `params` has exactly the structure of
`nnx.to_pure_dict(nnx.state(GPT(cfg), nnx.Param))`, i.e. of `TrainState.params` and of what `Task.merge` takes, so an
imported checkpoint can be merged into a model (`load_hf_model` does it), evaluated or trained further.

How the two layouts line up (jaxperf legend: D embed, H heads, K kv heads, Dh head dim, F mlp, V vocab):
- GPT-2 stores `Conv1D` weights as [in, out] (jaxperf's own order) and fuses q, k, v into `c_attn` [D, 3D]; it ties
  the LM head to the token embedding and uses the tanh-approximated GELU (`gelu_new`), which is exactly jaxperf's
  `jax.nn.gelu(approximate=True)`. An exact-erf `gelu` checkpoint is refused rather than silently approximated.
- Llama stores `nn.Linear` weights as [out, in], so every matrix is transposed. Its RoPE is the rotate-half form with
  frequencies theta^(-2i/Dh) over the two halves of each head; jaxperf's `rope` is the same form with the same
  frequencies, so q and k weights need no permutation (the permutation some converters apply maps Meta's interleaved
  layout to this one; HF checkpoints are already in it).
- The imported config sets `vocab_multiple=1`, so the embedding and head have exactly the checkpoint's vocabulary and
  the logits match the HF model's one for one. Exporting a model trained with a padded vocabulary drops the padded
  rows (never produced by a tokenizer); their share of the softmax during training is then gone, a tiny difference.

Refused with an error that names the tensor or setting: other architectures, missing or unexpected tensors, shapes
that do not match the config, RoPE scaling (`rope_scaling`/`rope_parameters` other than "default"), activations other
than tanh-GELU (GPT-2) or SiLU (Llama), a non-zero Llama `gate_proj` bias (jaxperf's SwiGLU has no gate bias), and
GPT-2 variants (`scale_attn_by_inverse_layer_idx`, unscaled attention, cross-attention). Llama `attention_bias` and
`mlp_bias` map to jaxperf's `use_bias=True` (the biases jaxperf has and the checkpoint lacks are zero).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxperf import _compat
from jaxperf.config import ModelConfig, validate_model
from jaxperf.models.gpt import GPT
from jaxperf.parallel.rules import get_rules
from jaxperf.step.task import Task

SUPPORTED = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}
# ModelConfig fields that change how the model runs but not what it computes: safe to override on import.
RUNTIME_FIELDS = ("dtype", "param_dtype", "scan_layers", "scan_unroll", "remat", "attention_impl", "norm_impl",
                  "loss_impl")


class HFCheckpointError(ValueError):
    """A checkpoint jaxperf cannot represent exactly, or a malformed one; the message names the tensor or setting."""


@dataclass(frozen=True)
class _Map:
    """One HF tensor <-> one or more jaxperf tensors of a layer (or of the whole model)."""

    hf: str  # HF name (per-layer names are relative to the layer prefix)
    hf_shape: tuple[int, ...]
    jp: tuple[str, ...]  # dotted jaxperf paths, e.g. "attn.wq_DxHxDh"
    to_jp: Callable  # hf array -> tuple of jaxperf arrays
    to_hf: Callable  # tuple of jaxperf arrays -> hf array


def _linear_t(hf: str, jp: str, out: int, inn: int, jp_shape) -> _Map:
    """nn.Linear [out, in] <-> jaxperf [in, ...] (transposed, then the trailing dims split)."""
    return _Map(hf, (out, inn), (jp,), lambda a: (a.T.reshape(jp_shape),), lambda t: t[0].reshape(inn, out).T)


# --------------------------------------------------------------------------------------------------------------------
# Config translation


def _architecture(hf: dict) -> str:
    model_type = hf.get("model_type")
    archs = hf.get("architectures") or []
    for arch, cls in SUPPORTED.items():
        if model_type == arch or (model_type is None and cls in archs):
            return arch
    raise HFCheckpointError(
        f"unsupported checkpoint: model_type={model_type!r}, architectures={archs}. jaxperf imports "
        f"{', '.join(f'{cls} (model_type={a!r})' for a, cls in SUPPORTED.items())}")


def _require(hf: dict, key: str, ok: Callable, default, why: str):
    value = hf.get(key, default)
    if not ok(value):
        raise HFCheckpointError(f"config.json {key}={value!r} is not supported: {why}")
    return value


def _gpt2_config(hf: dict) -> ModelConfig:
    _require(hf, "activation_function", lambda v: v in ("gelu_new", "gelu_pytorch_tanh"), "gelu_new",
             "jaxperf's MLP uses the tanh-approximated GELU (jax.nn.gelu(approximate=True)), which equals HF's "
             "'gelu_new' / 'gelu_pytorch_tanh'")
    _require(hf, "scale_attn_weights", lambda v: v is True, True, "jaxperf always scales scores by head_dim**-0.5")
    _require(hf, "scale_attn_by_inverse_layer_idx", lambda v: not v, False, "jaxperf has no per-layer score scaling")
    _require(hf, "add_cross_attention", lambda v: not v, False, "jaxperf is decoder-only without cross-attention")
    d = hf["n_embd"]
    return ModelConfig(
        style="gpt2", vocab_size=hf["vocab_size"], vocab_multiple=1, max_seq_len=hf.get("n_positions", 1024),
        d_model=d, n_layers=hf["n_layer"], n_heads=hf["n_head"], n_kv_heads=hf["n_head"], head_dim=d // hf["n_head"],
        mlp_dim=hf.get("n_inner") or 4 * d, norm="layernorm", position="learned", mlp_act="gelu", use_bias=True,
        tie_embeddings=hf.get("tie_word_embeddings", True), norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        dtype="float32", param_dtype="float32")


def _rope_theta(hf: dict) -> float:
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    for src, block in (("rope_parameters", params), ("rope_scaling", scaling)):
        kind = block.get("rope_type", block.get("type", "default"))
        if kind != "default":
            raise HFCheckpointError(
                f"config.json {src}={block!r}: RoPE scaling {kind!r} is not supported; jaxperf implements plain RoPE "
                f"(rope_type 'default') with a single rope_theta")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _llama_config(hf: dict) -> tuple[ModelConfig, dict]:
    _require(hf, "hidden_act", lambda v: v == "silu", "silu", "jaxperf's SwiGLU uses SiLU")
    H = hf["num_attention_heads"]
    D = hf["hidden_size"]
    flags = {"attention_bias": bool(hf.get("attention_bias", False)), "mlp_bias": bool(hf.get("mlp_bias", False))}
    cfg = ModelConfig(
        style="llama", vocab_size=hf["vocab_size"], vocab_multiple=1,
        max_seq_len=hf.get("max_position_embeddings", 2048),
        d_model=D, n_layers=hf["num_hidden_layers"], n_heads=H, n_kv_heads=hf.get("num_key_value_heads") or H,
        head_dim=hf.get("head_dim") or D // H, mlp_dim=hf["intermediate_size"], norm="rmsnorm", position="rope",
        mlp_act="swiglu", use_bias=flags["attention_bias"] or flags["mlp_bias"],
        tie_embeddings=hf.get("tie_word_embeddings", False), rope_theta=_rope_theta(hf),
        norm_eps=hf.get("rms_norm_eps", 1e-6), dtype="float32", param_dtype="float32")
    return cfg, flags


# --------------------------------------------------------------------------------------------------------------------
# Tensor maps


def _gpt2_maps(c: ModelConfig) -> tuple[list[_Map], list[_Map]]:
    """(per-layer maps relative to "h.{i}.", model-level maps)."""
    D, H, Dh, F = c.d_model, c.n_heads, c.head_dim, c.mlp_dim
    layer = [
        _Map("attn.c_attn.weight", (D, 3 * D), ("attn.wq_DxHxDh", "attn.wk_DxKxDh", "attn.wv_DxKxDh"),
             lambda a: tuple(w.reshape(D, H, Dh) for w in np.split(a, 3, axis=1)),
             lambda t: np.concatenate([w.reshape(D, D) for w in t], axis=1)),
        _Map("attn.c_attn.bias", (3 * D,), ("attn.bias_q_HxDh", "attn.bias_k_KxDh", "attn.bias_v_KxDh"),
             lambda a: tuple(b.reshape(H, Dh) for b in np.split(a, 3)),
             lambda t: np.concatenate([b.reshape(D) for b in t])),
        _Map("attn.c_proj.weight", (D, D), ("attn.wo_HxDhxD",), lambda a: (a.reshape(H, Dh, D),),
             lambda t: t[0].reshape(D, D)),
        _Map("attn.c_proj.bias", (D,), ("attn.bias_o_D",), lambda a: (a,), lambda t: t[0]),
        _Map("mlp.c_fc.weight", (D, F), ("mlp.w_in_DxF",), lambda a: (a,), lambda t: t[0]),
        _Map("mlp.c_fc.bias", (F,), ("mlp.bias_in_F",), lambda a: (a,), lambda t: t[0]),
        _Map("mlp.c_proj.weight", (F, D), ("mlp.w_out_FxD",), lambda a: (a,), lambda t: t[0]),
        _Map("mlp.c_proj.bias", (D,), ("mlp.bias_out_D",), lambda a: (a,), lambda t: t[0]),
    ]
    for hf_norm, jp_norm in (("ln_1", "attn_norm"), ("ln_2", "mlp_norm")):
        layer += [_Map(f"{hf_norm}.{p}", (D,), (f"{jp_norm}.{q}",), lambda a: (a,), lambda t: t[0])
                  for p, q in (("weight", "scale"), ("bias", "bias"))]
    top = [
        _Map("wte.weight", (c.vocab_size, D), ("embed_VxD",), lambda a: (a,), lambda t: t[0]),
        _Map("wpe.weight", (c.max_seq_len, D), ("pos_LxD",), lambda a: (a,), lambda t: t[0]),
        _Map("ln_f.weight", (D,), ("final_norm.scale",), lambda a: (a,), lambda t: t[0]),
        _Map("ln_f.bias", (D,), ("final_norm.bias",), lambda a: (a,), lambda t: t[0]),
    ]
    if not c.tie_embeddings:
        top.append(_Map("lm_head.weight", (c.vocab_size, D), ("head_DxV",), lambda a: (a.T,), lambda t: t[0].T))
    return layer, top


def _llama_maps(c: ModelConfig, flags: dict) -> tuple[list[_Map], list[_Map]]:
    D, H, K, Dh, F = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.mlp_dim
    layer = [
        _linear_t("self_attn.q_proj.weight", "attn.wq_DxHxDh", H * Dh, D, (D, H, Dh)),
        _linear_t("self_attn.k_proj.weight", "attn.wk_DxKxDh", K * Dh, D, (D, K, Dh)),
        _linear_t("self_attn.v_proj.weight", "attn.wv_DxKxDh", K * Dh, D, (D, K, Dh)),
        _linear_t("self_attn.o_proj.weight", "attn.wo_HxDhxD", D, H * Dh, (H, Dh, D)),
        _linear_t("mlp.gate_proj.weight", "mlp.w_gate_DxF", F, D, (D, F)),
        _linear_t("mlp.up_proj.weight", "mlp.w_in_DxF", F, D, (D, F)),
        _linear_t("mlp.down_proj.weight", "mlp.w_out_FxD", D, F, (F, D)),
        _Map("input_layernorm.weight", (D,), ("attn_norm.scale",), lambda a: (a,), lambda t: t[0]),
        _Map("post_attention_layernorm.weight", (D,), ("mlp_norm.scale",), lambda a: (a,), lambda t: t[0]),
    ]
    if flags["attention_bias"]:
        qkv = (("q", "bias_q_HxDh", (H, Dh)), ("k", "bias_k_KxDh", (K, Dh)), ("v", "bias_v_KxDh", (K, Dh)))
        for n, jp, shape in qkv:
            layer.append(_Map(f"self_attn.{n}_proj.bias", (shape[0] * Dh,), (f"attn.{jp}",),
                              lambda a, s=shape: (a.reshape(s),), lambda t: t[0].reshape(-1)))
        layer.append(_Map("self_attn.o_proj.bias", (D,), ("attn.bias_o_D",), lambda a: (a,), lambda t: t[0]))
    if flags["mlp_bias"]:
        layer += [
            _Map("mlp.gate_proj.bias", (F,), (), _zero_gate_bias, lambda t: np.zeros((F,), np.float32)),
            _Map("mlp.up_proj.bias", (F,), ("mlp.bias_in_F",), lambda a: (a,), lambda t: t[0]),
            _Map("mlp.down_proj.bias", (D,), ("mlp.bias_out_D",), lambda a: (a,), lambda t: t[0]),
        ]
    top = [
        _Map("embed_tokens.weight", (c.vocab_size, D), ("embed_VxD",), lambda a: (a,), lambda t: t[0]),
        _Map("norm.weight", (D,), ("final_norm.scale",), lambda a: (a,), lambda t: t[0]),
    ]
    if not c.tie_embeddings:
        top.append(_Map("lm_head.weight", (c.vocab_size, D), ("head_DxV",), lambda a: (a.T,), lambda t: t[0].T))
    return layer, top


def _zero_gate_bias(a):
    if np.any(a != 0):
        raise HFCheckpointError(
            f"mlp.gate_proj.bias is non-zero (max |b| = {float(np.max(np.abs(a))):.3g}): jaxperf's SwiGLU has biases "
            f"on the up and down projections only, so this checkpoint cannot be represented exactly")
    return ()


# Layer and model prefixes of each architecture (HF saves GPT-2 with or without "transformer.").
_PREFIXES = {"gpt2": (("transformer.", ""), "h.{i}."), "llama": (("model.",), "layers.{i}.")}
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")


def _full(prefix: str, name: str) -> str:
    """The LM head sits outside the body's prefix in both architectures."""
    return name if name.startswith("lm_head.") else prefix + name


# --------------------------------------------------------------------------------------------------------------------
# Reading


class _Tensors:
    """Name -> file of every tensor in a (possibly sharded) safetensors checkpoint; shapes known before loading."""

    def __init__(self, directory: str):
        self._open = safe_open
        index = os.path.join(directory, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
        if not files:
            raise HFCheckpointError(
                f"no *.safetensors file in {directory}: save the model with save_pretrained(..., "
                f"safe_serialization=True) (PyTorch .bin checkpoints are not read)")
        self.where: dict[str, str] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for name in files:
            path = os.path.join(directory, name)
            with safe_open(path, framework="np") as f:
                for key in f.keys():
                    self.where[key] = path
                    self.shapes[key] = tuple(f.get_slice(key).get_shape())

    def get(self, key: str) -> np.ndarray:
        with self._open(self.where[key], framework="np") as f:
            return np.asarray(f.get_tensor(key)).astype(np.float32)


def _read_config(directory: str) -> dict:
    path = os.path.join(directory, "config.json")
    if not os.path.exists(path):
        raise HFCheckpointError(f"{path} does not exist: a Hugging Face checkpoint directory holds config.json and "
                                f"*.safetensors")
    with open(path) as f:
        return json.load(f)


def _hf_config_to_jaxperf(hf: dict) -> tuple[str, ModelConfig, dict]:
    arch = _architecture(hf)
    if arch == "gpt2":
        cfg, flags = _gpt2_config(hf), {}
    else:
        cfg, flags = _llama_config(hf)
    return arch, validate_model(cfg), flags


def _maps(arch: str, cfg: ModelConfig, flags: dict):
    return _gpt2_maps(cfg) if arch == "gpt2" else _llama_maps(cfg, flags)


def _set(tree: dict, dotted: str, value) -> None:
    *parents, leaf = dotted.split(".")
    for p in parents:
        tree = tree.setdefault(p, {})
    tree[leaf] = value


def _template(cfg: ModelConfig) -> dict:
    """Pure dict of ShapeDtypeStructs of the jaxperf GPT for cfg (nothing allocated)."""
    with _compat.no_eager_sharding():
        abstract = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))
    return nnx.to_pure_dict(nnx.state(abstract, nnx.Param))


def import_hf(directory: str, **overrides) -> tuple[ModelConfig, dict]:
    """Read a Hugging Face GPT-2 or Llama checkpoint into jaxperf's layout.

    Args:
      directory: holds config.json and *.safetensors (one file, or shards listed in model.safetensors.index.json).
      **overrides: ModelConfig fields that do not change the computation (`RUNTIME_FIELDS`: dtype, param_dtype,
        scan_layers, remat, attention_impl, norm_impl, loss_impl).

    Returns:
      (cfg, params): a resolved ModelConfig reproducing the HF model (float32, vocab_multiple=1) and the pure-dict
      parameters as numpy arrays in cfg.param_dtype, layers stacked on a leading axis when cfg.scan_layers.

    Raises HFCheckpointError before anything is compiled for unsupported architectures or settings, missing or
    unexpected tensors and shape mismatches.
    """
    bad = sorted(set(overrides) - set(RUNTIME_FIELDS))
    if bad:
        raise HFCheckpointError(f"cannot override {bad} on import: they would change what the checkpoint computes; "
                                f"allowed: {list(RUNTIME_FIELDS)}")
    arch, cfg, flags = _hf_config_to_jaxperf(_read_config(directory))
    cfg = validate_model(dataclasses.replace(cfg, **overrides))
    tensors = _Tensors(directory)
    model_prefixes, layer_fmt = _PREFIXES[arch]
    prefix = next((p for p in model_prefixes if any(k.startswith(p) for k in tensors.where)), model_prefixes[-1])
    layer_maps, top_maps = _maps(arch, cfg, flags)

    wanted: list[tuple[str, _Map, int | None]] = [(_full(prefix, m.hf), m, None) for m in top_maps]
    for i in range(cfg.n_layers):
        wanted += [(prefix + layer_fmt.format(i=i) + m.hf, m, i) for m in layer_maps]
    missing = [name for name, _, _ in wanted if name not in tensors.shapes]
    if missing:
        raise HFCheckpointError(f"{len(missing)} tensor(s) missing from {directory} for a {SUPPORTED[arch]} with "
                                f"{cfg.n_layers} layers: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    known = {name for name, _, _ in wanted} | ({"lm_head.weight"} if cfg.tie_embeddings else set())
    extra = sorted(k for k in tensors.shapes if k not in known and not k.endswith(_IGNORED_SUFFIXES))
    if extra:
        raise HFCheckpointError(f"{len(extra)} tensor(s) in {directory} have no place in jaxperf's model (a feature "
                                f"it lacks, or more layers than config.json says): {extra[:5]}")
    for name, m, _ in wanted:
        if tensors.shapes[name] != m.hf_shape:
            raise HFCheckpointError(f"tensor {name} has shape {tensors.shapes[name]} but config.json implies "
                                    f"{m.hf_shape}: the config and the weights disagree")

    per_layer: list[dict] = [{} for _ in range(cfg.n_layers)]
    top: dict = {}
    for name, m, i in wanted:
        for path, value in zip(m.jp, m.to_jp(tensors.get(name))):
            (top if i is None else per_layer[i])[path] = value

    template = _template(cfg)
    block_tpl = template["blocks"] if cfg.scan_layers else template["blocks"][0]
    params: dict = {}
    for path, value in top.items():
        _set(params, path, value)
    for path in _leaf_paths(block_tpl):
        values = [layer.get(path) for layer in per_layer]
        shape = _get(block_tpl, path).shape[1:] if cfg.scan_layers else _get(block_tpl, path).shape
        values = [np.zeros(shape, np.float32) if v is None else v for v in values]  # biases the HF model lacks
        if cfg.scan_layers:
            _set(params, "blocks." + path, np.stack(values))
        else:
            for i, v in enumerate(values):
                params.setdefault("blocks", {}).setdefault(i, {})
                _set(params["blocks"][i], path, v)
    _check_against(params, template)
    pd = np.dtype(_jnp_dtype(cfg.param_dtype))
    return cfg, _tree_map(lambda a: np.ascontiguousarray(a, dtype=pd), params)


def _jnp_dtype(name: str):
    return jnp.dtype(name)


def _leaf_paths(tree: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in tree.items():
        if isinstance(v, dict):
            out += _leaf_paths(v, f"{prefix}{k}.")
        else:
            out.append(f"{prefix}{k}")
    return out


def _get(tree: dict, dotted: str):
    for p in dotted.split("."):
        tree = tree[int(p) if isinstance(next(iter(tree)), int) else p]
    return tree


def _tree_map(fn, tree):
    return {k: _tree_map(fn, v) if isinstance(v, dict) else fn(v) for k, v in tree.items()}


def _check_against(params: dict, template: dict, where: str = "") -> None:
    """Same keys and shapes as the jaxperf model (an internal invariant on import, a user error on export)."""
    if set(params) != set(template):
        raise HFCheckpointError(f"parameters at {where or '<root>'} have keys {sorted(map(str, params))}, the jaxperf "
                                f"model for this config has {sorted(map(str, template))}")
    for k, t in template.items():
        p = params[k]
        if isinstance(t, dict):
            _check_against(p, t, f"{where}{k}.")
        elif tuple(np.shape(p)) != tuple(t.shape):
            raise HFCheckpointError(f"parameter {where}{k} has shape {tuple(np.shape(p))}, the jaxperf model for this "
                                    f"config expects {tuple(t.shape)}")


# --------------------------------------------------------------------------------------------------------------------
# Building a model


def load_hf_model(directory: str, *, mesh=None, rules="fsdp", **overrides):
    """A jaxperf `GPT` (Flax NNX module) holding a Hugging Face checkpoint's weights.

    Without a mesh the parameters are plain device arrays on the default device. With a mesh they are placed with the
    shardings that `Task.create(..., mesh, rules, ...)` derives for the model (strategy name or `Rules`), so the model
    is ready for sharded inference, and `nnx.to_pure_dict(nnx.state(model, nnx.Param))` gives sharded params for a
    `TrainState`. `**overrides` as in `import_hf`.

        model = load_hf_model("ckpt/")
        logits_BxLxV = model(tokens_BxL)
    """
    cfg, params = import_hf(directory, **overrides)
    if mesh is not None:
        task = Task.create(lambda r: GPT(cfg, rngs=r), mesh, get_rules(rules, mesh))
        return task.merge(jax.device_put(params, task.param_shardings))
    with _compat.no_eager_sharding():
        abstract = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))
    graphdef, template, other = nnx.split(abstract, nnx.Param, ...)
    nnx.replace_by_pure_dict(template, jax.tree.map(jax.numpy.asarray, params))
    return nnx.merge(graphdef, template, other)


# --------------------------------------------------------------------------------------------------------------------
# Writing


def _export_check(cfg: ModelConfig, arch: str) -> None:
    need = {
        "gpt2": {"norm": "layernorm", "position": "learned", "mlp_act": "gelu", "use_bias": True},
        "llama": {"norm": "rmsnorm", "position": "rope", "mlp_act": "swiglu"},
    }[arch]
    for key, value in need.items():
        if getattr(cfg, key) != value:
            raise HFCheckpointError(f"cannot export model.{key}={getattr(cfg, key)!r} as {SUPPORTED[arch]}, which "
                                    f"needs {key}={value!r}; pick the arch that matches the model")
    if arch == "gpt2" and (cfg.n_kv_heads != cfg.n_heads or cfg.n_heads * cfg.head_dim != cfg.d_model):
        raise HFCheckpointError(
            f"GPT-2 needs n_kv_heads == n_heads and n_heads * head_dim == d_model; got n_heads={cfg.n_heads}, "
            f"n_kv_heads={cfg.n_kv_heads}, head_dim={cfg.head_dim}, d_model={cfg.d_model}: export as 'llama' instead")


def _llama_bias_flags(cfg: ModelConfig, params: dict) -> dict:
    """Llama's attention_bias / mlp_bias: written only for the groups of jaxperf biases that are not all zero."""
    if not cfg.use_bias:
        return {"attention_bias": False, "mlp_bias": False}
    blocks = params["blocks"] if cfg.scan_layers else params["blocks"].values()
    layers = [blocks] if cfg.scan_layers else list(blocks)
    nonzero = lambda part, names: any(np.any(lay[part][n] != 0) for lay in layers for n in names)  # noqa: E731
    return {"attention_bias": nonzero("attn", ("bias_q_HxDh", "bias_k_KxDh", "bias_v_KxDh", "bias_o_D")),
            "mlp_bias": nonzero("mlp", ("bias_in_F", "bias_out_D"))}


def _hf_config(cfg: ModelConfig, arch: str, flags: dict) -> dict:
    if arch == "gpt2":
        return {
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
            "n_positions": cfg.max_seq_len, "n_embd": cfg.d_model, "n_layer": cfg.n_layers, "n_head": cfg.n_heads,
            "n_inner": cfg.mlp_dim, "activation_function": "gelu_new", "layer_norm_epsilon": cfg.norm_eps,
            "tie_word_embeddings": cfg.tie_embeddings, "scale_attn_weights": True, "torch_dtype": "float32",
        }
    theta = float(cfg.rope_theta)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "intermediate_size": cfg.mlp_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": theta, "rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "attention_bias": flags["attention_bias"], "mlp_bias": flags["mlp_bias"],
        "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": "float32",
    }


def export_hf(cfg: ModelConfig, params, directory: str, arch: str | None = None) -> None:
    """Write config.json and model.safetensors (float32) that `transformers` loads with `from_pretrained(directory)`.

    Args:
      cfg: the model's ModelConfig.
      params: pure-dict parameters (`TrainState.params`, `import_hf`'s output) or a jaxperf GPT module.
      directory: created if needed; existing config.json / model.safetensors are overwritten.
      arch: "gpt2" (GPT2LMHeadModel) or "llama" (LlamaForCausalLM); None picks cfg.style.

    Rows of a padded vocabulary (cfg.padded_vocab > cfg.vocab_size) are dropped.
    """
    cfg = validate_model(cfg)
    arch = arch or cfg.style
    if arch not in SUPPORTED:
        raise HFCheckpointError(f"arch={arch!r}: export supports {sorted(SUPPORTED)}")
    _export_check(cfg, arch)
    if isinstance(params, nnx.Module):
        params = nnx.to_pure_dict(nnx.state(params, nnx.Param))
    params = jax.tree.map(lambda a: np.asarray(jax.device_get(a), np.float32), params)
    params = _tree_map(lambda a: a, params)  # nnx pure dicts can be other mappings: make them plain dicts
    _check_against(params, _template(cfg))

    V = cfg.vocab_size
    params["embed_VxD"] = params["embed_VxD"][:V]
    if "head_DxV" in params:
        params["head_DxV"] = params["head_DxV"][:, :V]
    flags = _llama_bias_flags(cfg, params)
    out_cfg = dataclasses.replace(cfg, vocab_multiple=1)
    layer_maps, top_maps = _maps(arch, out_cfg, flags)
    prefix, layer_fmt = _PREFIXES[arch][0][0], _PREFIXES[arch][1]
    tensors = {_full(prefix, m.hf): m.to_hf(tuple(_get(params, p) for p in m.jp)) for m in top_maps}
    for i in range(cfg.n_layers):
        layer = params["blocks"] if cfg.scan_layers else params["blocks"][i]
        pick = (lambda a: a[i]) if cfg.scan_layers else (lambda a: a)
        for m in layer_maps:
            tensors[prefix + layer_fmt.format(i=i) + m.hf] = m.to_hf(tuple(pick(_get(layer, p)) for p in m.jp))
    os.makedirs(directory, exist_ok=True)
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in tensors.items()},
              os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(_hf_config(cfg, arch, flags), f, indent=2)
