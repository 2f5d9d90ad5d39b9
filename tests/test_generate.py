"""Generation: the cached decode reproduces the full forward, sampling rules, stops, one compilation, meshes, the CLI."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxperf.config import ModelConfig, ParallelConfig, get_config
from jaxperf.data.tokenizer import ByteTokenizer
from jaxperf.generate import Generator, apply_top_k, filter_logits, nucleus_mask, sample
from jaxperf.models import GPT
from jaxperf.parallel.mesh import make_mesh
from helpers import forward

VOCAB = 100


def _cfg(style: str, scan: bool = True, **kw) -> ModelConfig:
    extra = {"n_kv_heads": 2} if style == "llama" else {}
    return ModelConfig(style=style, d_model=32, n_layers=2, n_heads=4, max_seq_len=32, vocab_size=VOCAB,
                       vocab_multiple=64, scan_layers=scan, attention_impl="xla", **{**extra, **kw})


def _model(style: str, scan: bool = True, seed: int = 0, **kw) -> GPT:
    # A larger init spreads the logits, so greedy and top-k tests see distinct tokens rather than near ties.
    return GPT(_cfg(style, scan, init_std=0.3, **kw), rngs=nnx.Rngs(seed))


_GENERATORS: dict[str, tuple[GPT, Generator]] = {}


def _shared(style: str) -> tuple[GPT, Generator]:
    """One model and Generator per style for the whole file: tests with the same buckets reuse its programs."""
    if style not in _GENERATORS:
        model = _model(style)
        _GENERATORS[style] = (model, Generator(model))
    return _GENERATORS[style]


@pytest.mark.parametrize("style,scan", [("gpt2", True), ("llama", True), ("llama", False)])
def test_cached_decode_equals_full_forward_for_ragged_prompts(style, scan):
    model = _model(style, scan)
    prompts = [[5, 9, 2], [7, 1, 4, 4, 8, 3], [11]]
    B, P, S, steps = len(prompts), 8, 16, 5
    new_BxT = np.random.default_rng(0).integers(0, VOCAB, (B, steps)).astype(np.int32)
    tokens = np.zeros((B, P), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    k, v = model.init_cache(B, S)
    positions = jnp.broadcast_to(jnp.arange(P)[None], (B, P))
    h, k, v = jax.jit(lambda m, t, k, v: m.cached(t, positions, k, v))(model, jnp.asarray(tokens), k, v)
    got = [[h[i, len(p) - 1] @ model.output_weights()] for i, p in enumerate(prompts)]  # after each prompt
    step = jax.jit(lambda m, t, k, v, i: m.cached(t[:, None], i[:, None], k, v, i))
    index_B = jnp.asarray([len(p) for p in prompts], jnp.int32)  # per-row slot = position of the new token
    for t in range(steps):
        h, k, v = step(model, jnp.asarray(new_BxT[:, t]), k, v, index_B)
        index_B = index_B + 1
        for i in range(B):
            got[i].append(h[i, 0] @ model.output_weights())
    for i, p in enumerate(prompts):
        # Causal: the full forward of the final sequence holds the logits after every prefix at once.
        full = forward(model, jnp.asarray([p + new_BxT[i].tolist()]))[0, len(p) - 1:]
        np.testing.assert_allclose(np.stack(got[i]), full, atol=1e-4, rtol=1e-4, err_msg=f"{style} row {i}")


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_greedy_generation_follows_argmax_of_the_full_forward(style):
    model, gen = _shared(style)
    prompts = [[3, 4, 5], [8, 1, 2, 9, 9, 6, 7], [2]]
    out = gen.generate(prompts, max_tokens=8, temperature=0.0)
    for prompt, row in zip(prompts, out):
        assert len(row.tokens) == 8 and row.finish_reason == "length"
        logits = forward(model, jnp.asarray([prompt + row.tokens]))[0, len(prompt) - 1: -1, :VOCAB]
        assert row.tokens == np.argmax(logits, axis=-1).tolist(), (prompt, row.tokens)
    assert len({tuple(r.tokens) for r in out}) > 1  # the rows really differ


def test_seeded_sampling_is_reproducible_and_streaming_matches():
    _, gen = _shared("llama")
    prompts = [[1, 2, 3], [4, 5]]
    kw = dict(max_tokens=8, temperature=1.0, top_k=20, top_p=0.9)
    a = gen.generate(prompts, seed=7, **kw)
    b = gen.generate(prompts, seed=7, **kw)
    c = gen.generate(prompts, seed=8, **kw)
    assert [r.tokens for r in a] == [r.tokens for r in b]
    assert [r.tokens for r in a] != [r.tokens for r in c]
    it = gen.stream(prompts, seed=7, chunk=5, **kw)
    pieces = [[], []]
    try:
        while True:
            new = next(it)
            for i in range(2):
                pieces[i] += new[i]
    except StopIteration as e:
        streamed = e.value
    assert pieces == [r.tokens for r in a] == [r.tokens for r in streamed]


def test_top_k_one_equals_greedy():
    _, gen = _shared("gpt2")
    prompts = [[1, 2, 3], [9, 8]]
    greedy = gen.generate(prompts, max_tokens=8, temperature=0.0)
    top1 = gen.generate(prompts, max_tokens=8, temperature=1.5, top_k=1, seed=3)
    assert [r.tokens for r in greedy] == [r.tokens for r in top1]


def test_top_p_keeps_exactly_the_nucleus():
    # compiled, as decoding runs them (op by op, every operation compiles a program of its own)
    mask, filt, top_k = (jax.jit(f) for f in (nucleus_mask, filter_logits, apply_top_k))
    probs = jnp.asarray([[0.05, 0.4, 0.1, 0.3, 0.15], [0.9, 0.02, 0.03, 0.04, 0.01]])
    # Row 0 in decreasing order: 0.4, 0.3, 0.15, 0.1, 0.05 (cumulative 0.4, 0.7, 0.85, 0.95, 1.0).
    np.testing.assert_array_equal(mask(probs, 0.65), [[0, 1, 0, 1, 0], [1, 0, 0, 0, 0]])
    np.testing.assert_array_equal(mask(probs, 0.75), [[0, 1, 0, 1, 1], [1, 0, 0, 0, 0]])
    np.testing.assert_array_equal(mask(probs, 0.01), [[0, 1, 0, 0, 0], [1, 0, 0, 0, 0]])
    np.testing.assert_array_equal(mask(probs, 0.92), [[0, 1, 1, 1, 1], [1, 0, 0, 1, 0]])
    np.testing.assert_array_equal(mask(probs, 0.975), [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    logits = jnp.log(probs)
    kept = filt(logits, 1.0, 0, 0.65)
    assert np.isfinite(np.asarray(kept)).tolist() == [[False, True, False, True, False], [True] + [False] * 4]
    # Order: top-k first, then the nucleus of the renormalised survivors (0.4 / 0.7 = 0.57 < 0.6, so 0.3 joins).
    kept = filt(logits[:1], 1.0, 2, 0.6)
    assert np.isfinite(np.asarray(kept)).tolist() == [[False, True, False, True, False]]
    assert np.isfinite(np.asarray(top_k(logits, 3))).sum(axis=-1).tolist() == [3, 3]
    draws = jax.jit(jax.vmap(lambda k: sample(k, logits, 1.0, 0, 0.65)))(jax.random.split(jax.random.key(0), 400))
    assert set(np.asarray(draws[:, 0]).tolist()) == {1, 3} and set(np.asarray(draws[:, 1]).tolist()) == {0}


def test_stop_tokens_end_rows_and_stopped_rows_stay_padded():
    _, gen = _shared("llama")
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    free = gen.generate(prompts, max_tokens=8, temperature=0.0)
    stop_at = free[0].tokens[3]
    first = free[0].tokens.index(stop_at)
    out = gen.generate(prompts, max_tokens=8, temperature=0.0, stop=[stop_at])
    assert out[0].tokens == free[0].tokens[:first] and out[0].finish_reason == "stop"
    if stop_at in free[1].tokens:
        assert out[1].tokens == free[1].tokens[: free[1].tokens.index(stop_at)]
    else:
        assert out[1].tokens == free[1].tokens and out[1].finish_reason == "length"
    assert out.decode_tokens == sum(len(r.tokens) for r in out) + sum(r.finish_reason == "stop" for r in out)
    with pytest.raises(ValueError, match="top_p"):
        gen.generate(prompts, top_p=0.0)
    with pytest.raises(ValueError, match="max_seq_len"):
        gen.generate([[1] * 40])


def test_one_compilation_for_a_long_generation():
    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    gen = Generator(_model("gpt2"))
    gen.generate([[1, 2], [3]], max_tokens=4, temperature=0.0)  # compiles empty + insert + decode (B=2, P=8, S=8)
    before, programs = len(compiles), gen.compilations
    out = gen.generate([[5, 6, 7], [8]], max_tokens=5, temperature=0.7, top_p=0.9, seed=1)  # same buckets
    assert sum(len(r.tokens) for r in out) == 10
    stream = list(gen.stream([[9, 9], [1]], max_tokens=5, chunk=1))  # 5 calls of the same decode program
    assert len(stream) == 5
    assert gen.compilations == programs == 3  # an empty state, an insert, a decode
    assert len(compiles) == before, f"{len(compiles) - before} compilations for same-bucket generations"
    long = Generator(_model("gpt2"))
    long.generate([[1, 2, 3]], max_tokens=28, temperature=0.0)
    assert long.compilations == 3  # 28 tokens: one insert (prefill) program, one decode program


@pytest.mark.parametrize("strategy,parallel", [("tp", dict(data=4, fsdp=1, tensor=2)),
                                               ("fsdp_tp", dict(data=1, fsdp=2, tensor=4))])
def test_generation_on_a_mesh_equals_single_device(strategy, parallel):
    """Sharded generation gives the single device's tokens. The MLP's whole-weight gathers are a train-step setting
    (`model.gather_mlp_weights`, on for large TPU models): a model trained with them serves without."""
    model = _model("llama", n_kv_heads=4, gather_mlp_weights=True)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [3, 3]]
    kw = dict(max_tokens=6, temperature=0.9, top_k=30, seed=5)
    single = Generator(model).generate(prompts, **kw)
    mesh = make_mesh(ParallelConfig(strategy=strategy, **parallel))
    sharded_gen = Generator(model, mesh=mesh, strategy=strategy)
    assert sharded_gen.cfg.gather_mlp_weights is False and sharded_gen.cfg.scan_layers is False
    wq = sharded_gen.params["blocks"][0]["attn"]["wq_DxHxDh"]  # layers unstacked for serving
    assert wq.addressable_shards[0].data.shape[1] == 4 // parallel["tensor"]  # [D, H, Dh]: heads split
    sharded = sharded_gen.generate(prompts, **kw)
    assert [r.tokens for r in sharded] == [r.tokens for r in single]


def test_rows_split_over_devices_decode_in_loops_of_their_own():
    """Rows over 2 devices (tensor 1): each device runs its own decode loop, with no collective in the program,
    stops when its own rows are done, and every row's tokens equal the single-device engine's."""
    from jaxperf import _compat

    model, single = _shared("llama")
    mesh = _compat.make_mesh((2, 1, 1), ("data", "fsdp", "tensor"), devices=jax.devices()[:2])
    gen = Generator(model, mesh=mesh)
    assert gen._rows_local()
    prompts, budgets = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]], [2, 3, 7, 9]  # rows 0-1 on device 0, 2-3 on 1
    kw = dict(temperature=0.9, top_k=30, top_p=1.0)
    state = gen.insert(gen.new_state(4, 32), prompts, [0, 1, 2, 3], seeds=[1, 2, 3, 4], max_tokens=budgets,
                       **{k: [v] * 4 for k, v in kw.items()})
    state, out = gen.decode(state, 8, exit_on_finish=True)
    # Device 0 leaves its loop when row 0 finishes (2 steps), device 1 when row 2 does (7 steps).
    assert [len(t) for t in out.tokens] == [2, 2, 7, 7] and out.steps == 7
    exe, = [e for k, e in gen._compiled.items() if k[0] == "decode"]
    collectives = re.findall(r"all-reduce|all-gather|collective-permute|all-to-all|reduce-scatter", exe.as_text())
    assert not collectives, f"the per-device decode loops communicate: {sorted(set(collectives))}"
    state, more = gen.decode(state, 8)
    got = [a + b for a, b in zip(out.tokens, more.tokens)]
    want = [single.generate([p], n, seed=[s], **kw)[0].tokens for p, n, s in zip(prompts, budgets, [1, 2, 3, 4])]
    assert got == want
    state = gen.insert(state, prompts, [0, 1, 2, 3], seeds=[1, 2, 3, 4], max_tokens=[5] * 4,
                       **{k: [v] * 4 for k, v in kw.items()})
    state, out = gen.decode(state, 3, cancel=[2])  # a row of the second device: its own flags reach it
    assert [len(t) for t in out.tokens] == [3, 3, 0, 3] and out.done.tolist() == [False, False, True, False]


@pytest.mark.slow
def test_cli_generates_from_a_trained_checkpoint(tmp_path, capsys):
    from jaxperf.cli import main
    from jaxperf.train.trainer import Trainer

    class Repeating:
        def batch(self, step, batch_size, *, rows=None):
            rng = np.random.default_rng([3, step])
            tokens = ((rng.integers(97, 110, (batch_size, 1)) + np.arange(17)[None]) % 256).astype(np.int32)
            out = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": np.ones((batch_size, 16), np.float32)}
            return {k: x[rows] if rows is not None else x for k, x in out.items()}

    cfg = get_config("tiny", [
        "d_model=32", "n_layers=1", "n_heads=2", "max_seq_len=32", "batch_size=8", "max_steps=2", "eval_every=0",
        "eval_batches=0", "checkpoint_every=0", "sample_tokens=0", "tensorboard=false",
        f"run_dir={tmp_path}", "parallel.fsdp=8",
    ])
    Trainer(cfg, train_data=Repeating(), tokenizer=ByteTokenizer()).fit()
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(tmp_path), "--prompt", "abc", "--max-tokens", "12", "--seed", "1",
                 "--chunk", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("abc"), out
    assert "12 new tokens at" in out and "tok/s" in out and "3 prompt tokens" in out, out
    gen = Generator.from_checkpoint(tmp_path)
    again = gen.generate(["abc"], max_tokens=12, temperature=0.8, seed=1)
    assert out.startswith("abc" + again[0].text), (out, again[0].text)  # same seed: the text the CLI streamed


def test_per_row_settings_and_seeds_match_each_row_run_alone():
    _, gen = _shared("llama")
    prompts = [[1, 2, 3], [4, 5], [6]]
    kw = dict(max_tokens=[6, 3, 5], temperature=[1.0, 0.0, 0.7], top_k=[0, 0, 5], top_p=[0.9, 1.0, 1.0],
              seed=[11, 12, 13])
    together = gen.generate(prompts, **kw)
    assert [len(r.tokens) for r in together] == [6, 3, 5]  # each row's own budget
    for i, p in enumerate(prompts):
        alone = gen.generate([p], **{k: v[i] for k, v in kw.items() if k != "seed"}, seed=[kw["seed"][i]])
        assert alone[0].tokens == together[i].tokens, i
    greedy = gen.generate(prompts[1:2], max_tokens=3, temperature=0.0)
    assert greedy[0].tokens == together[1].tokens  # the greedy row is unaffected by its sampling neighbours
    with pytest.raises(ValueError, match="3 values for 2 prompts"):
        gen.generate(prompts[:2], max_tokens=[1, 2, 3])
    with pytest.raises(ValueError, match="temperature=-1"):
        gen.generate(prompts, temperature=[0.5, -1, 0.5])


def _copies_of_the_cache(hlo: str, cache_elements: int) -> list[str]:
    """Copy or transpose instructions whose result holds as many elements as one layer's cache (a re-layout)."""
    found = []
    for line in hlo.splitlines():
        m = re.search(r"= f32\[([\d,]+)\][^ ]* (copy|transpose)\(", line)
        if m and math.prod(int(d) for d in m.group(1).split(",")) == cache_elements:
            found.append(line.strip()[:160])
    return found


def test_a_decode_step_reads_the_cache_where_it_lies():
    _, gen = _shared("llama")
    gen.generate([[1, 2, 3]] * 4, max_tokens=20, temperature=0.0)  # B=4 rows, S=32 slots
    B, K, S, Dh = 4, gen.cfg.n_kv_heads, 32, gen.cfg.head_dim
    exe, = [e for k, e in gen._compiled.items() if k[0] == "decode" and ((B, K, S, Dh), "float32") in k[1]]
    assert gen.new_state(B, S).k_cache[0].shape == (B, K, S, Dh)  # [rows, kv heads, slots, head dim]
    copies = _copies_of_the_cache(exe.as_text(), B * K * S * Dh)
    assert not copies, "the decode program copies or transposes the KV cache:\n" + "\n".join(copies)


def test_requests_inserted_into_a_running_state_equal_each_request_alone():
    _, gen = _shared("llama")
    kw = dict(temperature=0.9, top_k=30, top_p=1.0)
    a, b, c = [1, 2, 3], [4, 5, 6, 7, 8], [9, 9]
    want = {name: gen.generate([p], n, seed=[s], **kw)[0].tokens
            for name, p, n, s in (("a", a, 12, 1), ("b", b, 3, 2), ("c", c, 5, 3))}
    state = gen.new_state(4, 32)
    settings = lambda n: dict(temperature=[kw["temperature"]], top_k=[kw["top_k"]], top_p=[1.0], max_tokens=[n])
    state = gen.insert(state, [a], [2], seeds=[1], **settings(12))
    got = {"a": [], "b": [], "c": []}
    state, out = gen.decode(state, 4)
    got["a"] += out.tokens[2]
    state = gen.insert(state, [b], [0], seeds=[2], **settings(3))  # joins while `a` is decoding
    state, out = gen.decode(state, 8, exit_on_finish=True)  # returns as soon as `b` finishes (3 tokens)
    assert out.steps == 3 and out.done[0] and not out.done[2]
    got["a"] += out.tokens[2]
    got["b"] += out.tokens[0]
    state = gen.insert(state, [c], [0], seeds=[3], **settings(5))  # reuses b's slot
    while not (out.done[0] and out.done[2]):
        state, out = gen.decode(state, 4)
        got["a"] += out.tokens[2]
        got["c"] += out.tokens[0]
    assert got == want
    state = gen.insert(state, [a], [1], seeds=[1], **settings(12))
    state, out = gen.decode(state, 4, cancel=[1])  # a cancelled row stops at once
    assert out.steps == 0 and out.done[1] and out.tokens[1] == []


def test_first_argmax_is_argmax_and_the_draw_is_categorical():
    from jaxperf.generate.sampling import first_argmax

    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, 50)).astype(np.float32)
    x[:8, 3] = x[:8, 40] = 9.0  # ties: the first index wins
    x[8] = -np.inf  # a row of -inf
    x[9, [7, 20]] = np.nan  # NaN counts as the maximum, as in jnp.argmax
    x[10, rng.integers(0, 50, 10)] = -np.inf
    np.testing.assert_array_equal(first_argmax(jnp.asarray(x)), jnp.argmax(jnp.asarray(x), axis=-1))
    logits = jnp.asarray(rng.normal(size=(16, 50)) * 3, jnp.float32)
    keys = jax.random.split(jax.random.key(3), 16)
    want = jax.vmap(jax.random.categorical)(keys, logits)
    np.testing.assert_array_equal(sample(keys, logits, temperature=1.0), want)


def test_the_decode_program_has_no_variadic_argmax():
    """XLA:CPU runs the (value, index) reduction of jnp.argmax one element at a time; decode uses first_argmax."""
    _, gen = _shared("llama")
    gen.generate([[1, 2, 3]] * 4, max_tokens=20, temperature=0.7)
    texts = [e.as_text() for k, e in gen._compiled.items() if k[0] == "decode"]
    assert texts
    for text in texts:
        assert not re.findall(r"= \([^)]*\) reduce\(", text), "a variadic reduce (jnp.argmax) in the decode step"


def test_top_k_and_top_p_without_sorting_equal_the_sorted_definitions():
    rng = np.random.default_rng(0)
    top_k, nucleus = jax.jit(apply_top_k), jax.jit(nucleus_mask)  # k and p traced: one compilation each
    for _ in range(100):
        x = rng.normal(size=(3, 50)).astype(np.float32)
        x[0, rng.integers(0, 50, 5)] = x[0, 0]  # ties
        k = int(rng.integers(1, 51))
        kth = np.sort(x, axis=-1)[:, ::-1][:, k - 1: k]
        np.testing.assert_array_equal(np.isfinite(np.asarray(top_k(jnp.asarray(x), k))), x >= kth)
        probs = np.asarray(jax.nn.softmax(jnp.asarray(x)))
        p = float(rng.uniform(0.01, 0.99))
        order = np.argsort(-probs, axis=-1, kind="stable")
        ranked = np.take_along_axis(probs, order, axis=-1)
        keep_ranked = np.cumsum(ranked, axis=-1) - ranked < p
        keep = np.zeros_like(keep_ranked)
        np.put_along_axis(keep, order, keep_ranked, axis=-1)
        got = np.asarray(nucleus(jnp.asarray(probs), p))
        untied = np.array([len(set(r)) == len(r) for r in probs])
        np.testing.assert_array_equal(got[untied], keep[untied])
        # With ties at the boundary, every token as probable as the last one taken is taken too.
        last = np.where(keep, probs, np.inf).min(axis=-1, keepdims=True)
        np.testing.assert_array_equal(got, probs >= last)
