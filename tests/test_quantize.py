"""int8 weights: at most 0.3x the fp32 bytes, logits close to fp32, the engine decodes the int8 model faithfully,
`jaxperf quantize` writes a checkpoint that serves and reports perplexity, and a damaged scale is refused clearly."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxperf.config import get_config, to_dict, validate_model
from jaxperf.data.tokenizer import ByteTokenizer
from jaxperf.generate import Generator
from jaxperf.generate.quantize import QUANT_FILE, quantize_run, split_scales
from jaxperf.models import GPT
from jaxperf.models.quant import Int8Weight, quantize_int8, quantize_params, tree_bytes
from jaxperf.checkpoint import Checkpointer, CorruptCheckpointError
from helpers import forward

# int8 logits of a model at the default init (weights of a trained model's scale) stay within this fraction of the
# spread (standard deviation) of its fp32 logits, at every position.
LOGIT_TOLERANCE = 0.1


def _tiny_cfg(**kw):
    cfg = get_config("tiny", ["model.n_layers=2", "model.max_seq_len=64", *kw.pop("overrides", [])])
    return dataclasses.replace(cfg, model=validate_model(dataclasses.replace(cfg.model, **kw)))


def _merged(model, params):
    state = jax.tree.map(lambda x: x, nnx.state(model, nnx.Param))
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(nnx.graphdef(model), state)


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_int8_weights_are_at_most_0_3x_and_logits_stay_close(style):
    extra = {"style": "llama", "n_kv_heads": 2} if style == "llama" else {}
    cfg = _tiny_cfg(**extra).model
    model = GPT(cfg, rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    qparams = quantize_params(params)
    ratio = tree_bytes(qparams) / tree_bytes(params)
    assert ratio <= 0.3, f"int8 weights are {ratio:.3f}x of fp32"
    kinds = {type(x).__name__ for x in jax.tree.leaves(qparams, is_leaf=lambda x: isinstance(x, Int8Weight))}
    assert kinds == {"Int8Weight", "ArrayImpl"}  # norms and biases stay fp32
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (4, 48)))
    want = forward(model, tokens)[..., : cfg.vocab_size]
    got = forward(_merged(model, qparams), tokens)[..., : cfg.vocab_size]
    worst = float(jnp.max(jnp.abs(got - want)))
    assert worst <= LOGIT_TOLERANCE * float(jnp.std(want)), (worst, float(jnp.std(want)))
    assert worst > 0  # the weights really were quantized


def test_per_channel_int8_round_trip_is_within_half_a_step():
    w = jax.random.normal(jax.random.key(0), (3, 64, 4, 8)) * jnp.arange(1, 5)[None, None, :, None]
    q = quantize_int8(w, (1,))  # a stacked [N, D, H, Dh] weight: one scale per layer, head and head dim
    assert q.q.dtype == jnp.int8 and q.scale.shape == (3, 1, 4, 8)
    assert int(jnp.max(jnp.abs(q.q))) == 127
    err = jnp.abs(q.dequantize() - w)
    assert bool(jnp.all(err <= q.scale / 2 + 1e-6))
    zero = quantize_int8(jnp.zeros((4, 2)), (0,))
    assert bool(jnp.all(zero.scale == 1)) and bool(jnp.all(zero.q == 0))


def test_the_int8_engine_decodes_the_int8_model():
    cfg = _tiny_cfg(style="llama", n_kv_heads=2).model
    model = GPT(cfg, rngs=nnx.Rngs(1))
    gen = Generator(model, quantize="int8")
    assert gen.quantized and gen.weight_bytes <= 0.3 * Generator(model).weight_bytes
    qmodel = _merged(model, quantize_params(nnx.to_pure_dict(nnx.state(model, nnx.Param))))
    prompts = [[5, 6, 7], [9, 1]]
    out = gen.generate(prompts, max_tokens=6, temperature=0.0)
    for prompt, row in zip(prompts, out):
        logits = qmodel(jnp.asarray([prompt + row.tokens]))[0, len(prompt) - 1: -1, : cfg.vocab_size]
        assert row.tokens == np.argmax(logits, axis=-1).tolist()


def _fake_run(tmp_path, seed=0):
    """A run directory as `jaxperf train` leaves it (config.json + a checkpoint of random parameters)."""
    cfg = _tiny_cfg()
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(to_dict(cfg)))
    model = GPT(cfg.model, rngs=nnx.Rngs(seed))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    with Checkpointer(run / "checkpoints") as ckpt:
        ckpt.save(7, {"params": params})
    return run, model


@pytest.mark.slow
def test_a_quantized_checkpoint_serves_and_a_damaged_scale_is_refused(tmp_path, capsys):
    run, model = _fake_run(tmp_path)
    out = tmp_path / "int8"
    report = quantize_run(run, out, eval_batches=0)
    assert report["source_step"] == 7 and report["ratio"] <= 0.3
    assert "blocks/attn/wq_DxHxDh" in report["quantized"] and "embed_VxD" in report["quantized"]
    assert json.loads((out / QUANT_FILE).read_text())["weight_bytes_after"] == report["weight_bytes_after"]
    gen = Generator.from_checkpoint(out)
    assert gen.quantized and gen.tokenizer is not None
    want = Generator(model, ByteTokenizer(), quantize="int8").generate(["abc"], 8, temperature=0.0)[0].tokens
    assert gen.generate(["abc"], 8, temperature=0.0)[0].tokens == want
    with pytest.raises(FileExistsError, match="not empty"):
        quantize_run(run, out, eval_batches=0)

    # Damage the scales (they are the checkpoint's `state` item): the checksum catches it and names them.
    step_dir = out / "checkpoints" / "7" / "state"
    files = [os.path.join(d, f) for d, _, names in os.walk(step_dir) for f in names]
    path = max(files, key=os.path.getsize)
    data = bytearray(open(path, "rb").read())
    for i in range(len(data) // 3, len(data) // 3 + 8):
        data[i] ^= 0xFF
    open(path, "wb").write(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"step 7 .* is corrupt") as e:
        Generator.from_checkpoint(out)
    assert "scales" in str(e.value)  # the damaged arrays are named (a failed checksum or an unreadable index)
    assert (out / "checkpoints" / "7").is_dir()  # the user's directory is left as it was
    from jaxperf.cli import main

    capsys.readouterr()
    assert main(["serve", "--checkpoint", str(out), "--no-warmup", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jaxperf serve: checkpoint step 7") and "scales" in err and len(err.splitlines()) == 1


def test_a_scale_that_is_not_a_positive_number_is_refused(tmp_path):
    run, model = _fake_run(tmp_path)
    out = tmp_path / "int8"
    quantize_run(run, out, eval_batches=0)
    # Rewrite the checkpoint with one scale zeroed (consistent checksums: the damage came from elsewhere).
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    tree, scales = split_scales(quantize_params(params))
    scales["blocks/mlp/w_in_DxF"] = scales["blocks/mlp/w_in_DxF"].at[0, 0, 3].set(0.0)
    with Checkpointer(out / "checkpoints") as ckpt:
        ckpt.save(8, {"params": tree, "scales": scales}, force=True)
    with pytest.raises(ValueError, match=r"int8 scales of \['blocks'\]\['mlp'\]\['w_in_DxF'\] hold 1 value\(s\) that "
                                         r"are not positive finite numbers"):
        Generator.from_checkpoint(out)


@pytest.mark.slow
def test_cli_quantize_reports_bytes_and_perplexity_of_a_trained_run(tmp_path, capsys):
    from jaxperf.cli import main
    from jaxperf.train.trainer import Trainer

    cfg = get_config("tiny", [
        "n_layers=2", "max_seq_len=64", "batch_size=8", "max_steps=30", "eval_every=0", "eval_batches=0",
        "checkpoint_every=0", "sample_tokens=0", "tensorboard=false", "data.max_bytes=300000",
        f"run_dir={tmp_path / 'run'}",
    ])
    Trainer(cfg).fit()
    capsys.readouterr()
    assert main(["quantize", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "int8"),
                 "--eval-batches", "4"]) == 0
    out = capsys.readouterr().out
    assert "weight bytes" in out and "perplexity on 2,048 held-out tokens" in out, out
    report = json.loads((tmp_path / "int8" / QUANT_FILE).read_text())
    assert report["ratio"] <= 0.3
    before, after = report["perplexity_before"], report["perplexity_after"]
    assert before < 200  # trained: far below the 256 of a uniform guess over bytes
    assert abs(after - before) / before < 0.02, (before, after)


def test_an_int8_model_with_mlp_slices_runs_its_mlp_whole():
    """model.mlp_slices (a training setting, remat full) leaves an int8 model's MLP to the plain matmuls, which take
    int8 weights: the same logits as with no slices."""
    cfg = dataclasses.replace(_tiny_cfg(style="llama", n_kv_heads=2).model, remat="full")
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 32)))
    got = []
    for slices in (1, 2):
        model = GPT(dataclasses.replace(cfg, mlp_slices=slices), rngs=nnx.Rngs(0))
        qparams = quantize_params(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
        got.append(np.asarray(forward(_merged(model, qparams), tokens)))
    np.testing.assert_array_equal(got[0], got[1])
