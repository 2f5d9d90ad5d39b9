"""Hugging Face interop: logits parity with transformers both ways, clear errors for checkpoints jaxperf cannot hold.

The parity tests build small random models with transformers on CPU (skipped when torch/transformers are missing);
the error tests write fake checkpoints with safetensors.numpy and need neither.
"""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from helpers import forward, hf_tokenizer
from jaxperf.config import ModelConfig, ParallelConfig, get_config, validate_model
from jaxperf.data import HFTokenizer, special_token_ids
from jaxperf.generate import Generator
from jaxperf.interop import (
    RUNTIME_FIELDS, HFCheckpointError, default_arch, export_hf, hf_model_config, import_hf, load_hf_model,
    load_hf_params, read_generation_config,
)
from jaxperf.interop._safetensors import Checkpoint, write_shards
from jaxperf.models import GPT
from jaxperf.parallel import make_mesh

V, L = 101, 16  # a vocabulary that no vocab_multiple divides, so padding mistakes show


def _tokens(seed=0, batch=2):
    return np.random.default_rng(seed).integers(0, V, (batch, L)).astype(np.int32)


# --------------------------------------------------------------------------------------------------------------------
# Parity with transformers


def _hf():
    # exc_type=ImportError: a torch that is installed but cannot load (missing native libraries) also skips.
    torch = pytest.importorskip("torch", reason="torch is not importable (pip install 'jaxperf[hf]')",
                                exc_type=ImportError)
    transformers = pytest.importorskip("transformers", reason="transformers is not importable (pip install "
                                       "'jaxperf[hf]')", exc_type=ImportError)
    return torch, transformers


def _randomize(torch, model, seed=0):
    """Default HF init leaves norms at 1/0 and biases at 0, which would hide mapping mistakes: draw everything."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model.eval()


def _hf_logits(torch, model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


def _gpt2(torch, transformers, **kw):
    cfg = transformers.GPT2Config(vocab_size=V, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=0,
                                  eos_token_id=0, **kw)
    return _randomize(torch, transformers.GPT2LMHeadModel(cfg))


def _llama(torch, transformers, **kw):
    cfg = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=32, rope_theta=500.0, rms_norm_eps=1e-5,
               bos_token_id=0, eos_token_id=0)
    cfg.update(kw)
    return _randomize(torch, transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)))


def _roundtrip(torch, transformers, hf_model, tmp_path, **save_kw):
    """HF -> jaxperf (scanned and looped layers) -> HF; every logits tensor must equal the original model's."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    hf_model.save_pretrained(src, **save_kw)
    tokens = _tokens()
    ref = _hf_logits(torch, hf_model, tokens)
    for scan in (True, False):
        model = load_hf_model(str(src), scan_layers=scan)
        assert model.cfg.padded_vocab == V
        # fp32 on both sides agrees to ~1e-6 here; the tanh GELU instead of the exact one is off by ~1e-4
        np.testing.assert_allclose(np.asarray(forward(model, jnp.asarray(tokens))), ref, atol=2e-5, rtol=1e-5)
    cfg, params = import_hf(str(src))
    export_hf(cfg, params, str(dst))
    back = transformers.AutoModelForCausalLM.from_pretrained(dst).eval()
    assert type(back) is type(hf_model)
    np.testing.assert_allclose(_hf_logits(torch, back, tokens), ref, atol=1e-5, rtol=1e-5)
    # The written tensors are the original ones, bit for bit (tied heads are not stored by either side).
    original = {k: v.detach().numpy() for k, v in hf_model.state_dict().items()}
    for name, value in load_file(str(dst / "model.safetensors")).items():
        np.testing.assert_array_equal(value, original[name], err_msg=name)
    return cfg


@pytest.mark.parametrize("hf_act, jp_act", [("gelu_new", "gelu"), ("gelu", "gelu_exact")])
def test_gpt2_roundtrip(tmp_path, hf_act, jp_act):
    """The tanh GELU (gelu_new) and the exact one (gelu) each reproduce transformers' logits and export back as
    themselves (swapping them moves these logits by ~1e-4, five times the tolerance)."""
    torch, transformers = _hf()
    cfg = _roundtrip(torch, transformers, _gpt2(torch, transformers, activation_function=hf_act), tmp_path)
    assert (cfg.norm, cfg.position, cfg.mlp_act, cfg.use_bias, cfg.tie_embeddings) == (
        "layernorm", "learned", jp_act, True, True)
    assert json.loads((tmp_path / "dst" / "config.json").read_text())["activation_function"] == hf_act


@pytest.mark.parametrize("tied", [False, True])
def test_llama_gqa_roundtrip(tmp_path, tied):
    torch, transformers = _hf()
    hf_model = _llama(torch, transformers, tie_word_embeddings=tied)
    # A tiny shard size forces a sharded checkpoint with model.safetensors.index.json.
    cfg = _roundtrip(torch, transformers, hf_model, tmp_path, max_shard_size="20KB")
    assert len([f for f in os.listdir(tmp_path / "src") if f.endswith(".safetensors")]) > 1
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rope_theta, cfg.tie_embeddings) == (4, 2, 8, 500.0, tied)


def test_llama_attention_bias_roundtrip(tmp_path):
    torch, transformers = _hf()
    cfg = _roundtrip(torch, transformers, _llama(torch, transformers, attention_bias=True), tmp_path)
    assert cfg.use_bias


def test_llama_nonzero_gate_bias_is_refused(tmp_path):
    torch, transformers = _hf()
    _llama(torch, transformers, mlp_bias=True).save_pretrained(tmp_path)
    with pytest.raises(HFCheckpointError, match="gate_proj.bias is non-zero"):
        import_hf(str(tmp_path))


def test_load_on_mesh_is_sharded_and_matches(tmp_path):
    torch, transformers = _hf()
    hf_model = _llama(torch, transformers)
    hf_model.save_pretrained(tmp_path)
    mesh = make_mesh(ParallelConfig(strategy="tp", data=4, fsdp=1, tensor=2))
    model = load_hf_model(str(tmp_path), mesh=mesh, rules="tp")
    wq = model.blocks.attn.wq_DxHxDh[...]
    assert wq.shape == (2, 32, 4, 8)
    assert wq.sharding.shard_shape(wq.shape) == (2, 32, 2, 8)  # heads split over tensor=2
    tokens = _tokens()
    np.testing.assert_allclose(np.asarray(forward(model, jnp.asarray(tokens))), _hf_logits(torch, hf_model, tokens),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("use_bias, scan", [(False, True), (True, False)])
def test_export_jaxperf_model(tmp_path, use_bias, scan):
    """A jaxperf-born Llama with a padded vocabulary (and, with use_bias, random biases everywhere jaxperf has them)
    exports its real rows; HF logits = jaxperf logits[..., :V]."""
    torch, transformers = _hf()
    cfg = ModelConfig(style="llama", vocab_size=V, vocab_multiple=64, d_model=32, n_layers=2, n_heads=4,
                      n_kv_heads=2, max_seq_len=32, tie_embeddings=False, rope_theta=1000.0, init_std=0.2,
                      use_bias=use_bias, scan_layers=scan)
    model = GPT(cfg, rngs=nnx.Rngs(3))
    assert model.cfg.padded_vocab == 128
    if use_bias:
        rng = np.random.default_rng(4)
        for path, var in nnx.iter_graph(model):
            if isinstance(var, nnx.Param) and str(path[-1]).startswith("bias"):
                var[...] = jnp.asarray(rng.normal(0.0, 0.2, var[...].shape), jnp.float32)
    export_hf(cfg, model, str(tmp_path), arch="llama")
    hf_cfg = json.loads((tmp_path / "config.json").read_text())
    assert (hf_cfg["attention_bias"], hf_cfg["mlp_bias"]) == (use_bias, use_bias)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tokens = _tokens(seed=1)
    np.testing.assert_allclose(_hf_logits(torch, back, tokens),
                               np.asarray(forward(model, jnp.asarray(tokens)))[..., :V], atol=1e-4, rtol=1e-4)


TEXT = "Once upon a time a small model read a short story, and then it read the story again. " * 40


def test_export_round_trips_for_real_use(tmp_path):
    """A Llama whose bos/eos/pad are 5/7/9, with its tokenizer, loaded sharded over 8 devices and exported in several
    weight files: transformers reloads the ids (config and generation config), the tokenizer and the logits, and its
    greedy generation is jaxperf's. Without the ids, export writes null rather than letting Llama's 1/2 defaults in."""
    torch, transformers = _hf()
    src, dst = tmp_path / "src", tmp_path / "dst"
    tok = hf_tokenizer(src, TEXT)
    vocab = tok.get_vocab_size() + 13  # embeddings larger than the tokenizer, as in many released models
    hf_model = _llama(torch, transformers, vocab_size=vocab, bos_token_id=5, eos_token_id=7, pad_token_id=9)
    hf_model.save_pretrained(src)
    model = load_hf_model(str(src), mesh=make_mesh(ParallelConfig(strategy="fsdp", fsdp=8)))
    files = export_hf(model.cfg, model, str(dst), special_tokens=special_token_ids(src),
                      generation_config=read_generation_config(str(src)), tokenizer=str(src), max_shard_size="40KB")
    assert len(files) > 1 and files == sorted(f for f in os.listdir(dst) if f.endswith(".safetensors"))
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    back = transformers.AutoModelForCausalLM.from_pretrained(dst).eval()
    ids = (back.config.bos_token_id, back.config.eos_token_id, back.config.pad_token_id)
    gen_ids = (back.generation_config.bos_token_id, back.generation_config.eos_token_id,
               back.generation_config.pad_token_id)
    assert ids == gen_ids == (5, 7, 9)
    hf_tok = transformers.AutoTokenizer.from_pretrained(dst)
    assert hf_tok("a small model")["input_ids"] == tok.encode("a small model").ids
    tokens = np.random.default_rng(2).integers(0, vocab, (2, L))
    np.testing.assert_allclose(_hf_logits(torch, back, tokens), _hf_logits(torch, hf_model, tokens), atol=1e-6)

    prompt = tok.encode("Once upon a time").ids
    ours = Generator(model, HFTokenizer.from_file(src)).generate([prompt], max_tokens=10, temperature=0.0, stop=[7])
    with torch.no_grad():
        theirs = back.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0, len(prompt):].tolist()
    assert ours[0].tokens == [t for t in theirs if t != 7][: len(ours[0].tokens)] and len(ours[0].tokens) > 0
    assert ours[0].tokens == theirs[: len(ours[0].tokens)]

    export_hf(model.cfg, model, str(tmp_path / "bare"))
    written = json.loads((tmp_path / "bare" / "config.json").read_text())
    assert [written[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")] == [None, None, None]
    assert transformers.AutoConfig.from_pretrained(tmp_path / "bare").bos_token_id is None


# --------------------------------------------------------------------------------------------------------------------
# Mixtral: the experts in the hub layout (one w1/w2/w3 per expert) and transformers' fused one


def _mixtral(torch, transformers, **kw):
    cfg = dict(vocab_size=V, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
               rope_theta=500.0, rms_norm_eps=1e-5, router_aux_loss_coef=0.02, bos_token_id=0, eos_token_id=0)
    cfg.update(kw)
    return _randomize(torch, transformers.MixtralForCausalLM(transformers.MixtralConfig(**cfg)))


def _jaxperf_logits(directory, tokens, **kw):
    return np.asarray(forward(load_hf_model(str(directory), **kw), jnp.asarray(tokens)))


def _hub_tensors(directory) -> dict:
    files = [f for f in os.listdir(directory) if f.endswith(".safetensors")]
    return {k: v for f in files for k, v in load_file(str(directory / f)).items()}


def _reloads_as_the_source(torch, transformers, dst, hf_model, tokens, ref, source: dict) -> None:
    """The exported directory `dst` loads in transformers as `hf_model`'s class with its logits `ref`, and holds the
    `source` tensors under their names, bit for bit."""
    back = transformers.AutoModelForCausalLM.from_pretrained(dst).eval()
    assert type(back) is type(hf_model)
    np.testing.assert_allclose(_hf_logits(torch, back, tokens), ref, atol=1e-5, rtol=1e-5)
    out = _hub_tensors(dst)
    assert set(out) == set(source)
    for name, value in out.items():
        np.testing.assert_array_equal(value, source[name], err_msg=name)


def test_mixtral_roundtrip(tmp_path):
    """transformers' Mixtral (saved with the experts in the hub layout, sharded) -> jaxperf (scanned and looped
    layers): the same logits; jaxperf -> export -> transformers: the same logits and, bit for bit, the same tensors
    under the same names."""
    torch, transformers = _hf()
    src, dst = tmp_path / "src", tmp_path / "dst"
    hf_model = _mixtral(torch, transformers)
    hf_model.save_pretrained(src, max_shard_size="20KB")
    source = _hub_tensors(src)
    assert "model.layers.1.block_sparse_moe.experts.3.w1.weight" in source and len(
        [f for f in os.listdir(src) if f.endswith(".safetensors")]) > 1
    tokens = _tokens()
    ref = _hf_logits(torch, hf_model, tokens)
    for scan in (True, False):
        np.testing.assert_allclose(_jaxperf_logits(src, tokens, scan_layers=scan), ref, atol=1e-5, rtol=1e-5)
    cfg, params = import_hf(str(src))
    assert (cfg.style, cfg.n_experts, cfg.experts_per_token, cfg.moe_mlp_dim, cfg.router, cfg.capacity_factor) == (
        "llama", 4, 2, 24, "softmax", None)
    assert (cfg.router_aux_loss_coef, cfg.router_z_loss_coef, cfg.rope_theta, cfg.n_kv_heads) == (0.02, 0.0, 500.0, 2)
    export_hf(cfg, params, str(dst))  # an MoE model exports as Mixtral without naming the arch
    written = json.loads((dst / "config.json").read_text())
    assert (written["architectures"], written["num_local_experts"], written["num_experts_per_tok"],
            written["intermediate_size"]) == (["MixtralForCausalLM"], 4, 2, 24)
    _reloads_as_the_source(torch, transformers, dst, hf_model, tokens, ref, source)


def test_mixtral_imports_with_a_zero_router_bias_to_fine_tune_balanced(tmp_path):
    """init_from a Mixtral with loss-free balancing: the bias starts at zero, so the model is transformers' to the
    logit; once it holds a bias the model no longer exports as Mixtral."""
    torch, transformers = _hf()
    hf_model = _mixtral(torch, transformers)
    hf_model.save_pretrained(tmp_path / "src")
    tokens = _tokens()
    biased = _jaxperf_logits(tmp_path / "src", tokens, router_bias=True, router_bias_update_rate=0.001)
    np.testing.assert_allclose(biased, _hf_logits(torch, hf_model, tokens), atol=1e-5, rtol=1e-5)
    cfg, params = import_hf(str(tmp_path / "src"), router_bias=True)
    np.testing.assert_array_equal(params["blocks"]["mlp"]["router_bias_E"], np.zeros((2, 4), np.float32))
    with pytest.raises(HFCheckpointError, match="no Hugging Face format jaxperf writes holds a routing bias"):
        export_hf(cfg, params, str(tmp_path / "dst"))


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_fused_expert_layout_imports_to_the_same_logits(tmp_path, arch):
    """transformers 5's own modules hold the experts fused (mlp.experts.gate_up_proj [E, 2F, D], gate rows first;
    mlp.experts.down_proj [E, D, F]; router mlp.gate): a directory written in that layout imports to the logits of
    the hub layout."""
    torch, transformers = _hf()
    hf_model = {"mixtral": _mixtral, "qwen2_moe": _qwen2_moe}[arch](torch, transformers, tie_word_embeddings=True)
    hf_model.save_pretrained(tmp_path / "hub")
    fused = {k: v.detach().numpy().copy() for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    assert fused["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 48, 32)
    os.makedirs(tmp_path / "fused")
    save_file(fused, str(tmp_path / "fused" / "model.safetensors"))
    (tmp_path / "fused" / "config.json").write_text((tmp_path / "hub" / "config.json").read_text())
    tokens = _tokens(seed=3)
    ref = _hf_logits(torch, hf_model, tokens)
    np.testing.assert_allclose(_jaxperf_logits(tmp_path / "fused", tokens), ref, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(_jaxperf_logits(tmp_path / "hub", tokens), ref, atol=1e-5, rtol=1e-5)
    _, params = import_hf(str(tmp_path / "fused"))
    np.testing.assert_array_equal(params["blocks"]["mlp"]["w_gate_ExDxF"][1, 2],
                                  fused["model.layers.1.mlp.experts.gate_up_proj"][2, :24].T)


def test_mixtral_experts_split_over_a_mesh(tmp_path):
    """Loaded with the experts split over an expert axis (4 ways) and the embed dim over fsdp (2 ways): each device
    reads its experts' block, the logits are transformers', and the export from those shards is the source, bit for
    bit."""
    torch, transformers = _hf()
    hf_model = _mixtral(torch, transformers)
    hf_model.save_pretrained(tmp_path / "src")
    mesh = make_mesh(ParallelConfig(strategy="fsdp", data=1, fsdp=2, expert=4))
    model = load_hf_model(str(tmp_path / "src"), mesh=mesh)
    w = model.blocks.mlp.w_gate_ExDxF[...]
    assert w.shape == (2, 4, 32, 24) and w.sharding.shard_shape(w.shape) == (2, 1, 16, 24)
    tokens = _tokens(seed=1)
    np.testing.assert_allclose(np.asarray(forward(model, jnp.asarray(tokens))), _hf_logits(torch, hf_model, tokens),
                               atol=1e-5, rtol=1e-5)
    export_hf(model.cfg, model, str(tmp_path / "dst"), arch="mixtral")
    source = _hub_tensors(tmp_path / "src")
    for name, value in _hub_tensors(tmp_path / "dst").items():
        np.testing.assert_array_equal(value, source[name], err_msg=name)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_moe_generates_as_transformers(tmp_path, arch):
    """The KV-cache forward of an imported Mixtral or Qwen2-MoE: jaxperf's greedy tokens are transformers'."""
    torch, transformers = _hf()
    tok = hf_tokenizer(tmp_path, TEXT)
    hf_model = {"mixtral": _mixtral, "qwen2_moe": _qwen2_moe}[arch](
        torch, transformers, vocab_size=tok.get_vocab_size(), max_position_embeddings=64, bos_token_id=None,
        eos_token_id=None)
    hf_model.save_pretrained(tmp_path)
    prompt = tok.encode("Once upon a time").ids
    ours = Generator(load_hf_model(str(tmp_path)), HFTokenizer.from_file(tmp_path)).generate(
        [prompt], max_tokens=12, temperature=0.0)
    with torch.no_grad():
        theirs = hf_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):]
    assert ours[0].tokens == theirs.tolist()


@pytest.mark.parametrize("config, match", [
    ({"sliding_window": 16}, r"config.json sliding_window=16 is not supported: .*at least max_position_embeddings=32"),
    ({"num_experts_per_tok": 5}, r"num_experts_per_tok=5 is not supported: .*1 to num_local_experts=4"),
    ({"router_jitter_noise": 0.1}, r"router_jitter_noise=0.1 .*no jitter"),
])
def test_mixtral_refusals(tmp_path, config, match):
    """Settings jaxperf's Mixtral cannot reproduce are refused from config.json, in one line, before any tensor is
    read; a window as long as the context is no window and imports."""
    hf = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": V, "hidden_size": D,
          "intermediate_size": F, "num_hidden_layers": NL, "num_attention_heads": H, "num_key_value_heads": H,
          "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 32, "hidden_act": "silu",
          "sliding_window": 32}
    os.makedirs(tmp_path, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert hf_model_config(str(tmp_path)).n_experts == 4
    _refused_in_one_line(tmp_path, {**hf, **config}, match)


def _refused_in_one_line(directory, hf: dict, match: str) -> None:
    """config.json `hf` in `directory` is refused in one line matching `match`."""
    (directory / "config.json").write_text(json.dumps(hf))
    with pytest.raises(HFCheckpointError, match=match) as err:
        hf_model_config(str(directory))
    assert "\n" not in str(err.value)


def test_mixtral_8x7b_preset_is_the_released_config(tmp_path):
    """The preset's model is what Mixtral-8x7B's config.json imports to, but for its training context (4096 of the
    32768 positions) and the settings that change how it runs (dtype, remat)."""
    hf = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096,
          "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
          "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "sliding_window": None,
          "num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02, "hidden_act": "silu",
          "tie_word_embeddings": False, "router_jitter_noise": 0.0, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    imported = hf_model_config(str(tmp_path))
    preset = validate_model(get_config("mixtral-8x7b").model)
    differ = {f.name for f in dataclasses.fields(ModelConfig)
              if getattr(imported, f.name) != getattr(preset, f.name)}
    assert differ <= {"max_seq_len", "vocab_multiple", *RUNTIME_FIELDS}, differ
    assert (preset.max_seq_len, imported.max_seq_len, preset.padded_vocab) == (4096, 32768, 32000)


def test_mixtral_export_errors(tmp_path):
    moe = ModelConfig(style="llama", vocab_size=V, d_model=D, n_layers=1, n_heads=H, max_seq_len=32, n_experts=4)
    model = GPT(moe, rngs=nnx.Rngs(0))
    with pytest.raises(HFCheckpointError, match=r"mixture-of-experts model \(model.n_experts=4\) as "
                                                r"LlamaForCausalLM: export it as 'mixtral'"):
        export_hf(moe, model, str(tmp_path), arch="llama")
    dense = dataclasses.replace(moe, n_experts=0)
    with pytest.raises(HFCheckpointError, match=r"dense model \(model.n_experts=0\) as MixtralForCausalLM"):
        export_hf(dense, GPT(dense, rngs=nnx.Rngs(0)), str(tmp_path), arch="mixtral")
    shared = dataclasses.replace(moe, n_shared_experts=1)
    with pytest.raises(HFCheckpointError, match=r"model.n_shared_experts=1 as MixtralForCausalLM"):
        export_hf(shared, GPT(shared, rngs=nnx.Rngs(0)), str(tmp_path), arch="mixtral")
    assert not os.path.exists(tmp_path / "config.json")


# --------------------------------------------------------------------------------------------------------------------
# Qwen2 (biases on q, k and v alone) and Qwen2-MoE (Qwen2's attention; routed experts whose top-k weights are kept as
# the softmax scored them unless norm_topk_prob; one shared expert of its own width, scaled per token by a sigmoid
# gate)


def _qwen2(torch, transformers, **kw):
    cfg = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=32, rope_theta=500.0, rms_norm_eps=1e-5,
               bos_token_id=0, eos_token_id=0)
    cfg.update(kw)
    return _randomize(torch, transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**cfg)))


def _qwen2_moe(torch, transformers, **kw):
    cfg = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
               shared_expert_intermediate_size=40, max_position_embeddings=32, rope_theta=500.0, rms_norm_eps=1e-5,
               router_aux_loss_coef=0.02, bos_token_id=0, eos_token_id=0)
    cfg.update(kw)
    return _randomize(torch, transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**cfg)))


def test_qwen2_roundtrip(tmp_path):
    """Qwen2 (tied head, as its small releases): the logits both ways, the same tensors back; jaxperf holds the q/k/v
    biases and no other."""
    torch, transformers = _hf()
    cfg = _roundtrip(torch, transformers, _qwen2(torch, transformers, tie_word_embeddings=True), tmp_path)
    assert (cfg.qkv_bias, cfg.use_bias, cfg.tie_embeddings) == (True, False, True)
    _, params = import_hf(str(tmp_path / "src"))
    assert set(params["blocks"]["attn"]) == {"wq_DxHxDh", "wk_DxKxDh", "wv_DxKxDh", "wo_HxDhxD", "bias_q_HxDh",
                                             "bias_k_KxDh", "bias_v_KxDh"}
    assert set(params["blocks"]["mlp"]) == {"w_in_DxF", "w_gate_DxF", "w_out_FxD"}


@pytest.mark.parametrize("norm_topk", [False, True])
def test_qwen2_moe_roundtrip(tmp_path, norm_topk):
    """transformers' Qwen2-MoE (experts in the hub layout, sharded) -> jaxperf (scanned and looped layers): the same
    logits, with the top-k weights renormalised or not; -> export -> transformers: the same logits and, bit for bit,
    the same tensors under the same names."""
    torch, transformers = _hf()
    src, dst = tmp_path / "src", tmp_path / "dst"
    hf_model = _qwen2_moe(torch, transformers, norm_topk_prob=norm_topk)
    hf_model.save_pretrained(src, max_shard_size="20KB")
    source = _hub_tensors(src)
    assert {"model.layers.1.mlp.experts.3.gate_proj.weight", "model.layers.1.mlp.shared_expert_gate.weight",
            "model.layers.0.self_attn.q_proj.bias"} <= set(source)
    tokens = _tokens()
    ref = _hf_logits(torch, hf_model, tokens)
    for scan in (True, False):
        np.testing.assert_allclose(_jaxperf_logits(src, tokens, scan_layers=scan), ref, atol=1e-5, rtol=1e-5)
    cfg, params = import_hf(str(src))
    assert (cfg.n_experts, cfg.experts_per_token, cfg.moe_mlp_dim, cfg.n_shared_experts, cfg.shared_mlp_dim,
            cfg.shared_expert_gate, cfg.router_norm_topk) == (4, 2, 24, 1, 40, True, norm_topk)
    assert (cfg.qkv_bias, cfg.use_bias, cfg.router_aux_loss_coef, cfg.router_z_loss_coef) == (True, False, 0.02, 0.0)
    assert params["blocks"]["mlp"]["shared_gate_Dx1"].shape == (2, 32, 1)
    export_hf(cfg, params, str(dst))  # an MoE model with shared experts exports as Qwen2-MoE without naming the arch
    written = json.loads((dst / "config.json").read_text())
    assert (written["architectures"], written["norm_topk_prob"], written["shared_expert_intermediate_size"]) == (
        ["Qwen2MoeForCausalLM"], norm_topk, 40)
    _reloads_as_the_source(torch, transformers, dst, hf_model, tokens, ref, source)


_QWEN2_MOE_JSON = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "vocab_size": V,
                   "hidden_size": 16, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                   "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
                   "shared_expert_intermediate_size": 12, "max_position_embeddings": 32, "hidden_act": "silu",
                   "use_sliding_window": False, "sliding_window": 16, "decoder_sparse_step": 1, "mlp_only_layers": []}


@pytest.mark.parametrize("config, match", [
    ({"use_sliding_window": True}, r"config.json sliding_window=16 is not supported: with use_sliding_window=true "
                                   r"the window must be null or at least max_position_embeddings=32"),
    ({"decoder_sparse_step": 2}, r"decoder_sparse_step=2 is not supported: .*every layer's MLP routed"),
    ({"mlp_only_layers": [1]}, r"mlp_only_layers=\[1\] is not supported"),
    ({"num_experts_per_tok": 5}, r"num_experts_per_tok=5 is not supported: .*1 to num_experts=4"),
    ({"shared_expert_intermediate_size": 0}, r"shared_expert_intermediate_size=0 is not supported"),
    ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True},
     r"config.json sliding_window=16 is not supported"),
])
def test_qwen2_refusals(tmp_path, config, match):
    """Settings jaxperf's Qwen2 and Qwen2-MoE cannot reproduce are refused from config.json, in one line, before any
    tensor is read; a window turned off (or as long as the context) is no window."""
    os.makedirs(tmp_path, exist_ok=True)
    for ok in ({}, {"use_sliding_window": True, "sliding_window": 32}):
        (tmp_path / "config.json").write_text(json.dumps({**_QWEN2_MOE_JSON, **ok}))
        assert hf_model_config(str(tmp_path)).shared_mlp_dim == 12
    _refused_in_one_line(tmp_path, {**_QWEN2_MOE_JSON, **config}, match)


def test_qwen2_export_errors_and_the_default_arch(tmp_path):
    """Each architecture exports only the models it holds exactly, and says which one to name instead."""
    base = ModelConfig(style="llama", vocab_size=V, d_model=D, n_layers=1, n_heads=H, max_seq_len=32)
    qwen2 = dataclasses.replace(base, use_bias=False, qkv_bias=True)
    qwen_moe = dataclasses.replace(qwen2, n_experts=4, n_shared_experts=1, shared_mlp_dim=12,
                                   shared_expert_gate=True, router_norm_topk=False)
    assert [default_arch(c) for c in (base, qwen2, qwen_moe, dataclasses.replace(base, n_experts=4))] == [
        "llama", "qwen2", "qwen2_moe", "mixtral"]
    refused = [
        (qwen2, "llama", r"model.qkv_bias=True as LlamaForCausalLM, which needs qkv_bias=False"),
        (base, "qwen2", r"model.qkv_bias=False as Qwen2ForCausalLM, which needs qkv_bias=True"),
        (dataclasses.replace(qwen_moe, n_shared_experts=0, shared_mlp_dim=None, shared_expert_gate=False),
         "qwen2_moe", r"model.n_shared_experts=0 as Qwen2MoeForCausalLM.*export it as 'mixtral'"),
        (dataclasses.replace(qwen_moe, shared_expert_gate=False), "qwen2_moe",
         r"model.shared_expert_gate=False as Qwen2MoeForCausalLM, which needs shared_expert_gate=True"),
        (qwen_moe, "mixtral", r"model.qkv_bias=True as MixtralForCausalLM"),
        (dataclasses.replace(qwen_moe, qkv_bias=False), "mixtral", r"model.router_norm_topk=False as Mixtral"),
        (qwen2, "qwen2_moe", r"dense model \(model.n_experts=0\) as Qwen2MoeForCausalLM: export it as 'qwen2'"),
    ]
    for cfg, arch, match in refused:
        with pytest.raises(HFCheckpointError, match=match):
            export_hf(cfg, GPT(cfg, rngs=nnx.Rngs(0)), str(tmp_path), arch=arch)
    assert not os.path.exists(tmp_path / "config.json")


# --------------------------------------------------------------------------------------------------------------------
# Fake checkpoints (numpy + safetensors only): import/export consistency and the errors


D, H, NL, F = 16, 2, 2, 64


def _fake_gpt2(path, *, config=None, drop=(), extra=None, reshape=None, prefix="transformer."):
    """A GPT-2 checkpoint written by hand: random tensors under HF's names."""
    rng = np.random.default_rng(0)
    shapes = {"wte.weight": (V, D), "wpe.weight": (32, D), "ln_f.weight": (D,), "ln_f.bias": (D,)}
    for i in range(NL):
        shapes.update({
            f"h.{i}.ln_1.weight": (D,), f"h.{i}.ln_1.bias": (D,), f"h.{i}.ln_2.weight": (D,), f"h.{i}.ln_2.bias": (D,),
            f"h.{i}.attn.c_attn.weight": (D, 3 * D), f"h.{i}.attn.c_attn.bias": (3 * D,),
            f"h.{i}.attn.c_proj.weight": (D, D), f"h.{i}.attn.c_proj.bias": (D,),
            f"h.{i}.mlp.c_fc.weight": (D, F), f"h.{i}.mlp.c_fc.bias": (F,),
            f"h.{i}.mlp.c_proj.weight": (F, D), f"h.{i}.mlp.c_proj.bias": (D,),
        })
    shapes.update(reshape or {})
    tensors = {prefix + k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items() if k not in drop}
    tensors.update(extra or {})
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    cfg = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": V, "n_positions": 32,
           "n_embd": D, "n_layer": NL, "n_head": H, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5}
    cfg.update(config or {})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return tensors


def test_fake_gpt2_import_export_is_lossless(tmp_path):
    """Import a hand-written checkpoint (no 'transformer.' prefix, as old GPT-2 files), check a few mapped values by
    hand, export and compare every tensor with the original."""
    src = _fake_gpt2(tmp_path / "src", prefix="")
    cfg, params = import_hf(str(tmp_path / "src"))
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.mlp_dim, cfg.vocab_size, cfg.padded_vocab) == (
        D, NL, H, F, V, V)
    qkv = src["h.1.attn.c_attn.weight"]
    np.testing.assert_array_equal(params["blocks"]["attn"]["wk_DxKxDh"][1], qkv[:, D:2 * D].reshape(D, H, D // H))
    np.testing.assert_array_equal(params["blocks"]["attn"]["wo_HxDhxD"][0],
                                  src["h.0.attn.c_proj.weight"].reshape(H, D // H, D))
    export_hf(cfg, params, str(tmp_path / "dst"))
    out = load_file(str(tmp_path / "dst" / "model.safetensors"))
    assert set(out) == {"transformer." + k for k in src}
    for k, v in src.items():
        np.testing.assert_array_equal(out["transformer." + k], v, err_msg=k)
    cfg2, params2 = import_hf(str(tmp_path / "dst"), scan_layers=False)
    np.testing.assert_array_equal(params2["blocks"][1]["attn"]["wk_DxKxDh"], params["blocks"]["attn"]["wk_DxKxDh"][1])
    assert cfg2.scan_layers is False


def test_sharded_load_reads_only_each_device_slice(tmp_path, monkeypatch):
    """Under fsdp over 8 devices every read from disk is at most an eighth of the largest tensor (the embedding
    [V, D] split along D): no tensor passes through the host whole. The values are import_hf's."""
    _fake_gpt2(tmp_path)
    reads = []
    read = Checkpoint.read

    def spy(self, name, index=None):
        out = read(self, name, index)
        reads.append((name, out.size))
        return out

    monkeypatch.setattr(Checkpoint, "read", spy)
    mesh = make_mesh(ParallelConfig(strategy="fsdp", fsdp=8))
    model = load_hf_model(str(tmp_path), mesh=mesh)
    assert max(n for _, n in reads) == V * D // 8, sorted(reads, key=lambda r: -r[1])[:3]
    wq = model.blocks.attn.wq_DxHxDh[...]
    assert wq.sharding.shard_shape(wq.shape) == (NL, D // 8, H, D // H)
    _, params = import_hf(str(tmp_path))
    loaded = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(loaded)[0], jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), b, err_msg=jax.tree_util.keystr(path))


def test_bfloat16_checkpoint_is_read(tmp_path):
    """Most released Llama checkpoints are bfloat16, which the safetensors numpy API cannot read."""
    src = _fake_gpt2(tmp_path)
    write_shards(str(tmp_path), [(k, v.shape, lambda v=v: v) for k, v in src.items()], jnp.bfloat16, 1 << 30)
    _, params = import_hf(str(tmp_path))
    want = src["transformer.h.1.mlp.c_fc.weight"].astype(jnp.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(params["blocks"]["mlp"]["w_in_DxF"][1], want)
    assert params["blocks"]["mlp"]["w_in_DxF"].dtype == np.float32
    bf16 = load_hf_model(str(tmp_path), param_dtype="bfloat16")
    assert bf16.blocks.mlp.w_in_DxF[...].dtype == jnp.bfloat16


def test_load_into_another_model_names_both_values(tmp_path):
    _fake_gpt2(tmp_path)
    cfg = hf_model_config(str(tmp_path), scan_layers=False)
    shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]),
                             nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))), nnx.Param)))
    params = load_hf_params(str(tmp_path), cfg, shardings)  # runtime fields (scan_layers) may differ
    assert params["blocks"][1]["attn"]["wq_DxHxDh"].shape == (D, H, D // H)
    with pytest.raises(HFCheckpointError, match=r"does not hold this model: model.n_layers=3 \(the checkpoint has "
                                                r"2\)"):
        load_hf_params(str(tmp_path), dataclasses.replace(cfg, n_layers=3), shardings)


@pytest.mark.parametrize("config, match", [
    ({"model_type": "bert", "architectures": ["BertForMaskedLM"]}, r"unsupported checkpoint.*bert.*GPT2LMHeadModel"),
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}, r"LlamaForCausalLM \(model_type='llama'\)"),
    ({"activation_function": "relu"}, r"activation_function='relu'.*tanh-approximated GELU.*exact one"),
    ({"scale_attn_by_inverse_layer_idx": True}, "per-layer score scaling"),
])
def test_unsupported_configs(tmp_path, config, match):
    _fake_gpt2(tmp_path, config=config)
    with pytest.raises(HFCheckpointError, match=match):
        import_hf(str(tmp_path))


def test_rope_scaling_is_refused(tmp_path):
    _fake_gpt2(tmp_path, config={
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": D, "intermediate_size": F,
        "num_hidden_layers": NL, "num_attention_heads": H, "hidden_act": "silu",
        "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    with pytest.raises(HFCheckpointError, match=r"rope_scaling=.*'linear' is not supported"):
        import_hf(str(tmp_path))


def test_missing_tensor(tmp_path):
    _fake_gpt2(tmp_path, drop=("h.1.mlp.c_fc.bias",))
    with pytest.raises(HFCheckpointError, match=r"1 tensor\(s\) missing.*'transformer\.h\.1\.mlp\.c_fc\.bias'"):
        import_hf(str(tmp_path))


def test_shape_mismatch_names_tensor_and_shapes(tmp_path):
    _fake_gpt2(tmp_path, reshape={"h.0.mlp.c_fc.weight": (D, F + 8)})
    with pytest.raises(HFCheckpointError, match=r"transformer\.h\.0\.mlp\.c_fc\.weight has shape \(16, 72\) but "
                                                r"config\.json implies \(16, 64\)"):
        import_hf(str(tmp_path))


def test_unexpected_tensor(tmp_path):
    _fake_gpt2(tmp_path, extra={"transformer.h.2.ln_1.weight": np.ones(D, np.float32)})
    with pytest.raises(HFCheckpointError, match=r"no place in jaxperf.*transformer\.h\.2\.ln_1\.weight"):
        import_hf(str(tmp_path))


def test_missing_files_and_bad_overrides(tmp_path):
    with pytest.raises(HFCheckpointError, match="config.json does not exist"):
        import_hf(str(tmp_path))
    _fake_gpt2(tmp_path)
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(HFCheckpointError, match=r"no \*\.safetensors file"):
        import_hf(str(tmp_path))
    with pytest.raises(HFCheckpointError, match=r"cannot override \['n_heads'\]"):
        import_hf(str(tmp_path), n_heads=8)


def test_export_errors(tmp_path):
    llama = ModelConfig(style="llama", vocab_size=V, d_model=D, n_layers=1, n_heads=H, max_seq_len=32)
    model = GPT(llama, rngs=nnx.Rngs(0))
    with pytest.raises(HFCheckpointError, match=r"model.norm='rmsnorm' as GPT2LMHeadModel.*norm='layernorm'"):
        export_hf(llama, model, str(tmp_path), arch="gpt2")
    with pytest.raises(HFCheckpointError, match=r"arch='bert'"):
        export_hf(llama, model, str(tmp_path), arch="bert")
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    params["embed_VxD"] = params["embed_VxD"][:, :8]
    with pytest.raises(HFCheckpointError, match=r"parameter embed_VxD has shape \(128, 8\).*expects \(128, 16\)"):
        export_hf(llama, params, str(tmp_path))
    assert not os.path.exists(tmp_path / "config.json")
