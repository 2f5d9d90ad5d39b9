"""Hugging Face interop: logits parity with transformers both ways, clear errors for checkpoints jaxperf cannot hold.

The parity tests build small random models with transformers on CPU (skipped when torch/transformers are missing);
the error tests write fake checkpoints with safetensors.numpy and need neither.
"""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxperf.config import ModelConfig, ParallelConfig
from jaxperf.interop import HFCheckpointError, export_hf, import_hf, load_hf_model
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
        np.testing.assert_allclose(np.asarray(model(jnp.asarray(tokens))), ref, atol=1e-4, rtol=1e-4)
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


def test_gpt2_roundtrip(tmp_path):
    torch, transformers = _hf()
    cfg = _roundtrip(torch, transformers, _gpt2(torch, transformers), tmp_path)
    assert (cfg.norm, cfg.position, cfg.mlp_act, cfg.use_bias, cfg.tie_embeddings) == (
        "layernorm", "learned", "gelu", True, True)


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
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(tokens))), _hf_logits(torch, hf_model, tokens),
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
    np.testing.assert_allclose(_hf_logits(torch, back, tokens), np.asarray(model(jnp.asarray(tokens)))[..., :V],
                               atol=1e-4, rtol=1e-4)


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


@pytest.mark.parametrize("config, match", [
    ({"model_type": "bert", "architectures": ["BertForMaskedLM"]}, r"unsupported checkpoint.*bert.*GPT2LMHeadModel"),
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}, r"LlamaForCausalLM \(model_type='llama'\)"),
    ({"activation_function": "gelu"}, r"activation_function='gelu'.*tanh-approximated"),
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
