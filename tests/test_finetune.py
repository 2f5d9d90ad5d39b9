"""Fine-tuning what people already have: Hugging Face weights in, `jaxperf train`, Hugging Face weights out.

The end-to-end tests build random tiny Llama and GPT-2 (exact GELU) models with transformers and a byte-level BPE
tokenizer.json, fine-tune them with `jaxperf train init_from=...` on a text file under fsdp over 8 simulated devices,
export with `jaxperf export` and check the result with transformers (skipped without transformers and torch). The
refusals and the memory test need neither: they write checkpoints with numpy.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from helpers import cli_env, hf_tokenizer, losses, run_cli
from jaxperf.config import ConfigError, ParallelConfig, from_dict, get_config
from jaxperf.data import ByteTokenizer, datasets_for, tokenizer_for
from jaxperf.generate import Generator
from jaxperf.interop._safetensors import write_shards
from jaxperf.parallel.mesh import make_mesh
from jaxperf.step.task import build_task
from jaxperf.checkpoint import Checkpointer, NoIntactCheckpointError
from jaxperf.generate.quantize import quantize_run
from jaxperf.train.pretrained import InitSource, checkpoint_kind, export_run
from jaxperf.train.trainer import Trainer

STORY = ("Once upon a time there was a little robot who liked to count the stars. Every night it climbed the hill "
         "behind the house, sat on a flat stone and counted, one, two, three, until the sun came up again. ") * 30
SPECIALS = ("<s>", "</s>", "<pad>")  # ids 0, 1, 2 of the tokenizer
RUN = ["data.source=story.txt", "seq_len=16", "batch_size=8", "log_every=1", "eval_every=0", "checkpoint_every=0",
       "sample_tokens=0", "tensorboard=false", "data.cache_dir=cache", "optim.schedule=constant",
       "lr=3e-3", "strategy=fsdp"]


def _hf():
    torch = pytest.importorskip("torch", reason="torch is not importable (pip install 'jaxperf[hf]')",
                                exc_type=ImportError)
    transformers = pytest.importorskip("transformers", reason="transformers is not importable (pip install "
                                       "'jaxperf[hf]')", exc_type=ImportError)
    return torch, transformers


def _hf_model(torch, transformers, arch: str, directory: Path, vocab: int):
    """A random tiny model saved with save_pretrained: Llama with grouped-query attention and bos/eos/pad 0/1/2 (its
    embeddings wider than the tokenizer), or GPT-2 with the exact GELU and its end-of-text token 1 as bos and eos."""
    if arch == "llama":
        cfg = transformers.LlamaConfig(vocab_size=vocab + 11, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                       max_position_embeddings=64, rope_theta=1000.0, bos_token_id=0,
                                       eos_token_id=1, pad_token_id=2)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                      activation_function="gelu", bos_token_id=1, eos_token_id=1)
        model = transformers.GPT2LMHeadModel(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)  # norms and biases away from 1 and 0, so that mapping mistakes show
    model.eval().save_pretrained(directory)
    return model


def _source(tmp_path: Path, arch: str):
    torch, transformers = _hf()
    src = tmp_path / f"hf-{arch}"
    tok = hf_tokenizer(src, STORY, vocab_size=300, specials=SPECIALS)
    (tmp_path / "story.txt").write_text(STORY)
    return torch, transformers, src, tok, _hf_model(torch, transformers, arch, src, tok.get_vocab_size())


def _run_params(run_dir: Path):
    """The newest checkpoint's parameters of a run, on one device, and the run's config."""
    cfg = from_dict(json.loads((run_dir / "config.json").read_text()))
    parallel = ParallelConfig(strategy="dp", data=1, fsdp=1)
    task = build_task(dataclasses.replace(cfg, parallel=parallel), make_mesh(parallel, jax.devices()[:1]),
                      with_optimizer=False)
    with Checkpointer(run_dir / "checkpoints") as ckpt:
        restored, meta, _ = ckpt.restore_latest({"params": task.abstract_params_sharded()})
    return cfg, task, restored["params"], meta


def _loss(torch, model, batch) -> float:
    with torch.no_grad():
        logits = model(torch.tensor(batch["inputs"], dtype=torch.long)).logits
        return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                       torch.tensor(batch["targets"], dtype=torch.long).reshape(-1)))


# --------------------------------------------------------------------------------------------------------------------
# End to end through the command line


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_finetune_export_generate_end_to_end(tmp_path, arch):
    torch, transformers, src, tok, hf_model = _source(tmp_path, arch)
    out = run_cli(tmp_path, "train", f"init_from={src}", *RUN, "max_steps=3", "run_dir=run")
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"initialised from {src}" in out.stdout, out.stdout

    # Step 0 trained on transformers' own model: the first logged loss is transformers' loss on the same batch.
    cfg, task, params, meta = _run_params(tmp_path / "run")
    assert (cfg.init_from, cfg.data.tokenizer, cfg.data.tokenizer_path) == (str(src), "hf", str(src / "tokenizer.json"))
    assert cfg.model.mlp_act == ("swiglu" if arch == "llama" else "gelu_exact") and cfg.model.vocab_multiple == 1
    assert meta["init_from"]["path"] == str(src) and meta["init_from"]["format"] == "hf"
    data = dataclasses.replace(cfg.data, source=str(tmp_path / "story.txt"), cache_dir=str(tmp_path / "cache"))
    train, _ = datasets_for(dataclasses.replace(cfg, data=data), tokenizer_for(cfg))
    first = losses(tmp_path / "run")[1]
    np.testing.assert_allclose(first, _loss(torch, hf_model, train.batch(0, 8)), rtol=1e-5)

    out = run_cli(tmp_path, "export", "--checkpoint", "run", "--out", "exported", "--max-shard-size", "30KB")
    assert out.returncode == 0, out.stderr[-3000:]
    exported = tmp_path / "exported"
    assert len(list(exported.glob("model-*-of-*.safetensors"))) > 1 and (exported / "tokenizer.json").exists()
    back = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    want = (0, 1, 2) if arch == "llama" else (1, 1, None)
    assert (back.config.bos_token_id, back.config.eos_token_id, back.config.pad_token_id) == want
    assert (back.generation_config.bos_token_id, back.generation_config.eos_token_id,
            back.generation_config.pad_token_id) == want
    if arch == "gpt2":
        assert back.config.activation_function == "gelu"  # the exact GELU again

    # The export is the trained model: transformers' logits are jaxperf's (and no longer the original's).
    tokens = np.asarray(train.batch(5, 2)["inputs"])
    ours = np.asarray(task.merge(params)(tokens))[..., : cfg.model.vocab_size]
    with torch.no_grad():
        theirs = back(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
        before = hf_model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(theirs, ours, atol=2e-5, rtol=1e-5)
    assert np.abs(theirs - before).max() > 1e-3, "training changed nothing: the test would not see a stale export"

    # Greedy generation: transformers on the export, jaxperf on the run, and `jaxperf generate` on the export.
    prompt = tok.encode("Once upon a time").ids
    gen = Generator.from_checkpoint(tmp_path / "run").generate([prompt], max_tokens=12, temperature=0.0)
    with torch.no_grad():
        hf_tokens = back.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert gen[0].tokens == hf_tokens
    out = run_cli(tmp_path, "generate", "--checkpoint", "exported", "--prompt", "Once upon a time", "--max-tokens",
                  "12", "--temperature", "0")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("Once upon a time" + tok.decode(hf_tokens, skip_special_tokens=False)), out.stdout


# --------------------------------------------------------------------------------------------------------------------
# Refusals before anything compiles


def _fake_llama(directory: Path, n_layers: int = 2, d: int = 16, vocab: int = 300):
    """The tensor shapes and config.json of a Llama (2 heads, MLP 3 x d) under HF's names."""
    f, heads = 3 * d, 2
    shapes = {"model.embed_tokens.weight": (vocab, d), "model.norm.weight": (d,), "lm_head.weight": (vocab, d)}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (d, d), p + "self_attn.k_proj.weight": (d, d),
                       p + "self_attn.v_proj.weight": (d, d), p + "self_attn.o_proj.weight": (d, d),
                       p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                       p + "mlp.down_proj.weight": (d, f), p + "input_layernorm.weight": (d,),
                       p + "post_attention_layernorm.weight": (d,)})
    directory.mkdir(parents=True, exist_ok=True)
    return shapes, {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
                    "hidden_size": d, "intermediate_size": f, "num_hidden_layers": n_layers,
                    "num_attention_heads": heads, "num_key_value_heads": heads, "max_position_embeddings": 64,
                    "hidden_act": "silu", "tie_word_embeddings": False}


def _write_fake_llama(directory: Path, max_shard_bytes: int = 1 << 30, tokenizer: bool = True, **kw) -> dict:
    """A Llama checkpoint written with numpy (no torch), constant tensors, and a tokenizer.json."""
    shapes, config = _fake_llama(directory, **kw)
    write_shards(str(directory), [(k, s, lambda s=s: np.full(s, 0.01, np.float32)) for k, s in shapes.items()],
                 np.float32, max_shard_bytes)
    (directory / "config.json").write_text(json.dumps(config))
    if tokenizer:
        hf_tokenizer(directory, STORY, vocab_size=config["vocab_size"])
    return config


@pytest.mark.slow
def test_contradicting_overrides_are_refused_before_compiling(tmp_path):
    src = tmp_path / "hf"
    _write_fake_llama(src)
    (tmp_path / "story.txt").write_text(STORY)
    with pytest.raises(ConfigError, match=rf"init_from={src}: model.n_layers=3 contradicts the checkpoint's "
                                          r"n_layers=2; the model comes from the checkpoint"):
        Trainer(get_config("tiny", [f"init_from={src}", "n_layers=3", f"run_dir={tmp_path}/run"]))
    # Settings that do not change what the model computes are the run's to choose.
    cfg = InitSource.open(src).configure(get_config("tiny", [f"init_from={src}", "remat=full", "dtype=bfloat16",
                                                             "scan_unroll=2", f"run_dir={tmp_path}/run"]))
    assert (cfg.model.n_layers, cfg.model.d_model, cfg.model.remat, cfg.model.dtype) == (2, 16, "full", "bfloat16")
    assert cfg.model.scan_unroll == 2  # a runtime setting
    # From the command line an override counts even when it equals the default (n_layers=4): refused, exit 2, nothing
    # compiled.
    out = run_cli(tmp_path, "train", f"init_from={src}", "n_layers=4", *RUN, timeout=120)
    assert out.returncode == 2 and "model.n_layers=4 contradicts the checkpoint's n_layers=2" in out.stderr, out
    assert "compiled" not in out.stdout
    out = run_cli(tmp_path, "train", f"init_from={tmp_path}/nowhere", *RUN, timeout=120)
    assert out.returncode == 2 and f"{tmp_path}/nowhere has no config.json" in out.stderr, out.stderr


def test_what_init_from_points_at(tmp_path):
    src = tmp_path / "hf"
    _write_fake_llama(src, tokenizer=False)
    assert checkpoint_kind(src) == "hf"
    with pytest.raises(ConfigError, match="has no tokenizer.json: save the model's tokenizer there"):
        InitSource.open(src).configure(get_config("tiny", [f"init_from={src}"]))
    for f in src.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ConfigError, match="a Hugging Face model without model\\*.safetensors"):
        checkpoint_kind(src)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"model": {}, "optim": {}}))
    with pytest.raises(ConfigError, match="a jaxperf run without checkpoints/ yet"):
        checkpoint_kind(run)
    (run / "checkpoints").mkdir()
    assert checkpoint_kind(run) == "run"


@pytest.mark.slow
def test_init_from_a_run_takes_its_weights_tokenizer_and_record(tmp_path):
    """A run fine-tuned from a Hugging Face directory can itself be the start of the next run: the parameters are
    the first run's newest ones, the tokenizer the same file, and the special token ids travel along for export."""
    src = tmp_path / "hf"
    _write_fake_llama(src)
    (tmp_path / "story.txt").write_text(STORY)
    common = [f"data.source={tmp_path}/story.txt", f"data.cache_dir={tmp_path}/cache", "seq_len=16", "batch_size=8",
              "eval_every=0", "eval_batches=0", "checkpoint_every=0", "sample_tokens=0", "tensorboard=false"]
    first = Trainer(get_config("tiny", [*common, "max_steps=2", f"run_dir={tmp_path}/first"]), init_from=str(src))
    trained = first.fit()["state"].params
    second = Trainer(get_config("tiny", [*common, f"run_dir={tmp_path}/second", f"init_from={tmp_path}/first"]))
    assert second.cfg.data.tokenizer_path == str(src / "tokenizer.json") and second.cfg.model == first.cfg.model
    state, start = second.init_or_restore(None)
    assert start == 0 and int(state.step) == 0
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(trained)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(state.opt_state))  # a fresh optimizer
    record = second.metadata(0)["init_from"]
    assert record["path"] == str(tmp_path / "first") and record["format"] == "jaxperf" and record["step"] == 2
    assert record["special_tokens"] == {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


@pytest.mark.slow
def test_init_from_a_run_keeps_the_bpe_it_trained(tmp_path):
    """A run whose BPE was trained on its own corpus (no tokenizer file) is continued on another text: the new run
    keeps that BPE as run_dir/tokenizer.json (a BPE trained on the new text would scramble every id)."""
    (tmp_path / "story.txt").write_text(STORY)
    (tmp_path / "other.txt").write_text("A different text, with different words in it. " * 50)
    small = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.max_seq_len=32", "seq_len=16",
             "batch_size=8", "max_steps=1", "eval_every=0", "eval_batches=0", "checkpoint_every=0", "sample_tokens=0",
             "tensorboard=false", f"data.cache_dir={tmp_path}/cache"]
    first = Trainer(get_config("tiny", [*small, "data.tokenizer=bpe", "model.vocab_size=300",
                                        f"data.source={tmp_path}/story.txt", f"run_dir={tmp_path}/first"]))
    first.fit()
    second = Trainer(get_config("tiny", [*small, f"data.source={tmp_path}/other.txt", f"run_dir={tmp_path}/second",
                                         f"init_from={tmp_path}/first"]))
    kept = tmp_path / "second" / "tokenizer.json"
    assert (second.cfg.data.tokenizer, second.cfg.data.tokenizer_path) == ("bpe", str(kept))
    assert second.tokenizer.fingerprint == first.tokenizer.fingerprint
    second.fit()
    assert kept.exists()
    assert Generator.from_checkpoint(tmp_path / "second").tokenizer.fingerprint == first.tokenizer.fingerprint


def _small_run(tmp_path: Path, *extra: str):
    """A one-layer byte-level run of two steps on a text file, one device: what the reader tests start from."""
    (tmp_path / "story.txt").write_text(STORY)
    return get_config("tiny", [
        "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.max_seq_len=32", "seq_len=16",
        "batch_size=8", "max_steps=2", "eval_every=0", "eval_batches=0", "sample_tokens=0", "tensorboard=false",
        f"data.source={tmp_path}/story.txt", f"data.cache_dir={tmp_path}/cache", *extra])


def _flip_params(step_dir: Path) -> None:
    big = max((p for p in (step_dir / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(big.read_bytes())
    data[len(data) // 3: len(data) // 3 + 8] = bytes(b ^ 0xFF for b in data[len(data) // 3: len(data) // 3 + 8])
    big.write_bytes(bytes(data))


def _tree(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


@pytest.mark.slow
def test_readers_of_a_run_change_nothing_in_it(tmp_path):
    """export, generate, quantize and init_from read a run whose newest step is corrupt from the step before it and
    leave the run as it was (no `.corrupt` renames: only the run that holds the directory moves steps aside); with no
    intact step init_from is refused before the new run holds anything, its source untouched."""
    first = tmp_path / "first"
    Trainer(_small_run(tmp_path, "checkpoint_every=1", f"run_dir={first}"), devices=jax.devices()[:1]).fit()
    _flip_params(first / "checkpoints" / "2")
    before = _tree(first)
    export_run(first, tmp_path / "exported")
    assert Generator.from_checkpoint(first).cfg.vocab_size == 256
    assert quantize_run(first, tmp_path / "int8", eval_batches=0)["source_step"] == 1
    assert _tree(first) == before
    _flip_params(first / "checkpoints" / "1")
    before = _tree(first)
    second = Trainer(_small_run(tmp_path, f"run_dir={tmp_path}/second", f"init_from={first}"),
                     devices=jax.devices()[:1])
    with pytest.raises(NoIntactCheckpointError) as e:
        second.fit()
    assert f"no intact checkpoint in {first}/checkpoints: checkpoint steps 2, 1 are corrupt" in str(e.value)
    assert _tree(first) == before
    assert not (tmp_path / "second" / "checkpoints").exists() and not (tmp_path / "second" / "config.json").exists()
    with pytest.raises(NoIntactCheckpointError):
        export_run(first, tmp_path / "again")
    assert _tree(first) == before


def test_export_then_init_from_round_trips_a_byte_level_run(tmp_path):
    """The default tokenizer (bytes) goes out as a tokenizer.json that encodes the same ids, so the export of a
    byte-level run is a directory init_from starts from: the same weights, the same tokens."""
    run = tmp_path / "run"
    trained = Trainer(_small_run(tmp_path, f"run_dir={run}"), devices=jax.devices()[:1]).fit()["state"].params
    export_run(run, tmp_path / "hf")
    again = Trainer(_small_run(tmp_path, f"run_dir={tmp_path}/again", f"init_from={tmp_path}/hf"),
                    devices=jax.devices()[:1])
    text = "héllo, wörld!\n\t 日本 🎉 \x00"
    np.testing.assert_array_equal(again.tokenizer.encode(text), ByteTokenizer().encode(text))
    assert again.tokenizer.decode(again.tokenizer.encode(text)) == text and again.cfg.model.vocab_size == 256
    state, start = again.init_or_restore(None)
    assert start == 0
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(trained), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# --------------------------------------------------------------------------------------------------------------------
# Host memory: one shard at a time


def test_peak_host_memory_of_loading_and_export_is_about_one_shard(tmp_path):
    """A Llama of ~440 MB (fp32, 8 layers) in 50 MB shards: loading it into its shards on 8 devices and exporting it
    again each need well under two shards of host memory beyond what the devices hold, a fraction of the model. Either
    path passing the whole model (or a whole stacked parameter) through the host would need hundreds of MB."""
    src, shard = tmp_path / "big", 50_000_000
    _write_fake_llama(src, max_shard_bytes=shard, tokenizer=False, n_layers=8, d=1024, vocab=4096)
    assert len(list(src.glob("*.safetensors"))) >= 8
    probe = Path(__file__).with_name("_peak_memory.py")
    out = subprocess.run([sys.executable, str(probe), str(src), str(tmp_path / "out"), str(shard)],
                         capture_output=True, text=True, env=cli_env(tmp_path), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    m = json.loads(out.stdout.splitlines()[-1])
    print(json.dumps(m, indent=1))
    assert m["model_bytes"] > 400e6 and m["export"]["files"] >= 8
    assert m["load"]["rss_peak_over_devices"] < 2 * shard, m
    assert m["export"]["rss_peak"] < 2 * shard, m
    assert m["load"]["traced_peak_over_final"] < 2 * shard and m["export"]["traced_peak"] < 2 * shard, m
    exported = tmp_path / "out"
    index = json.loads((exported / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == m["model_bytes"]
    assert max(f.stat().st_size for f in exported.glob("*.safetensors")) < shard + 100_000  # data + header
