"""jaxperf.perf: hardware table, roofline, FLOP counts against XLA, memory estimate, export, host-sync audit, traces."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxperf.config import ModelConfig, get_config
from jaxperf.models import GPT
from jaxperf.perf import compile as pcompile
from jaxperf.perf import hardware, memory, profile, roofline
from jaxperf.parallel.mesh import make_mesh
from jaxperf.perf.flops import flops_per_token
from jaxperf.step.task import build_task, step_microbatches

# ----------------------------------------------------------------------------------------------------------------------
# hardware


@pytest.mark.parametrize("kind,name", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"), ("NVIDIA H100 PCIe", "H100 PCIe"), ("NVIDIA H200", "H200 SXM"),
    ("NVIDIA A100-SXM4-40GB", "A100 40GB"), ("NVIDIA A100-PCIE-40GB", "A100 40GB"), ("NVIDIA A100-SXM4-80GB", "A100 80GB"),
    ("NVIDIA L4", "L4"), ("TPU v4", "TPU v4"), ("TPU v5 lite", "TPU v5e"), ("TPU v5", "TPU v5p"),
    ("TPU v6 lite", "TPU v6e"), ("cpu", None),
])
def test_chip_table_matches_device_kinds(kind, name):
    class Fake:
        device_kind = kind

    chip = hardware.chip_for(Fake())
    assert (chip.name if chip else None) == name


def test_describe_cpu_is_measured_and_formats():
    d = hardware.describe()
    assert d["platform"] == "cpu" and d["count"] == 8 and d["source"] == "measured"
    assert d["fp32_flops"] > 1e8 and d["hbm_bw"] > 1e8, d  # any machine that runs the tests does this much
    text = hardware.format_info(d)
    assert "measured" in text and "ridge point" in text


# ----------------------------------------------------------------------------------------------------------------------
# roofline (fixed synthetic device so the classification does not depend on this machine)

SYNTH = roofline.DeviceSpec("synthetic", peak_flops=100e12, peak_bw=1e12)  # ridge at 100 FLOP/byte


def test_roofline_classifies_matmul_and_add():
    n = 512
    a = jax.ShapeDtypeStruct((n, n), jnp.float32)
    mm = roofline.analyze(jax.jit(lambda x, y: x @ y), a, a, name="matmul", device=SYNTH)
    add = roofline.analyze(jax.jit(lambda x, y: x + y), a, a, name="add", device=SYNTH)
    assert mm.flops == pytest.approx(2 * n**3, rel=0.01)
    assert mm.bytes_accessed == pytest.approx(3 * n * n * 4, rel=0.01)
    assert mm.intensity == pytest.approx(2 * n**3 / (12 * n * n), rel=0.01)  # 85 FLOP/B... below ridge for n=512
    assert add.bound == "memory" and add.intensity < 1
    assert add.attainable_flops == pytest.approx(add.intensity * SYNTH.peak_bw)
    big = jax.ShapeDtypeStruct((2048, 2048), jnp.float32)
    mm_big = roofline.analyze(jax.jit(lambda x, y: x @ y), big, big, name="matmul 2048", device=SYNTH)
    assert mm_big.bound == "compute" and mm_big.attainable_flops == SYNTH.peak_flops
    assert mm.bound == "memory"  # 85 < 100: small matmuls sit left of this device's ridge
    timed = roofline.point("x", 1e12, 1e9, SYNTH, time_s=0.1)
    assert timed.achieved_flops == pytest.approx(1e13) and timed.fraction_of_attainable == pytest.approx(0.1)


def test_roofline_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib", reason="drawing the roofline needs matplotlib (pip install 'jaxperf[plot]')")
    pts = [roofline.point("add", 1e6, 1.2e7, SYNTH, time_s=1e-4), roofline.point("matmul", 1e12, 1e9, SYNTH)]
    path = roofline.plot(pts, str(tmp_path / "roof.png"), title="test")
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_roofline_rejects_plain_function():
    with pytest.raises(TypeError, match="jax.jit"):
        roofline.analyze(lambda x: x, jnp.ones(3))


# ----------------------------------------------------------------------------------------------------------------------
# flops_per_token against XLA's count. XLA counts the whole score matrix (compare with causal=False) and a scan body
# once (so layers are unrolled here); it also counts elementwise work we leave out, so it sits slightly above.

FLOPS_TOL = 0.10


def _xla_flops(compiled) -> float:
    return roofline.cost_analysis(compiled)["flops"]


def _grad_flops(cfg: ModelConfig, B: int, L: int) -> float:
    model = GPT(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    tokens = jax.ShapeDtypeStruct((B, L), jnp.int32)

    def loss(s, t):
        return jnp.mean(nnx.merge(graphdef, s)(t).astype(jnp.float32))

    return _xla_flops(jax.jit(jax.grad(loss)).lower(state, tokens).compile())


@pytest.mark.parametrize("kw", [
    dict(style="llama", n_kv_heads=2, tie_embeddings=False),
    dict(style="llama", n_kv_heads=1, remat="full"),
    dict(style="gpt2", tie_embeddings=False, remat="save_attn_proj"),
])
def test_flops_per_token_matches_xla(kw):
    B, L = 2, 32
    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=4, max_seq_len=L, scan_layers=False, attention_impl="xla", **kw)
    xla = _grad_flops(cfg, B, L)
    ours = flops_per_token(cfg, L, causal=False, hardware=True) * B * L
    assert abs(xla / ours - 1) < FLOPS_TOL, f"{kw}: XLA {xla:.4g} vs flops_per_token {ours:.4g} ({xla / ours:.3f})"
    if cfg.remat != "none":  # the recompute really is counted: without it we would be further from XLA
        model_only = flops_per_token(cfg, L, causal=False) * B * L
        assert abs(xla / ours - 1) < abs(xla / model_only - 1) / 2, (xla, ours, model_only)


def test_named_remat_policies_recompute_what_xla_recomputes():
    # Differences from `minimal` (which recomputes only the attention core), so XLA's count of the elementwise work
    # every policy redoes cancels: what is left is the projections each policy recomputes. A narrow MLP and a small
    # vocabulary let the attention projections weigh in.
    B, L = 2, 32
    base = ModelConfig(d_model=64, n_layers=2, n_heads=4, max_seq_len=L, scan_layers=False, attention_impl="xla",
                       style="llama", mlp_dim=32, vocab_size=64, remat="minimal")
    ours = lambda c: flops_per_token(c, L, causal=False, hardware=True) * B * L  # noqa: E731
    xla_minimal, ours_minimal = _grad_flops(base, B, L), ours(base)
    for policy in ("save_qkv_proj", "save_dot_except_mlp", "save_out_proj", "full"):
        cfg = dataclasses.replace(base, remat=policy)
        xla, mine = _grad_flops(cfg, B, L) - xla_minimal, ours(cfg) - ours_minimal
        assert mine > 0 and abs(xla / mine - 1) < 0.1, f"{policy}: XLA recomputes {xla:.4g} more, we count {mine:.4g}"


# ----------------------------------------------------------------------------------------------------------------------
# memory: the estimate's total against XLA's argument + temp bytes of the compiled train step (per device)

MEM_TOL = 0.25


def _compiled_step_memory(cfg):
    p = cfg.parallel
    n = p.data * max(p.fsdp, 1) * p.tensor * p.stage * p.seq
    mesh = make_mesh(cfg.parallel, jax.devices()[:n])
    task = build_task(cfg, mesh)
    step = task.train_step(microbatches=step_microbatches(cfg))
    shape = (cfg.batch_size, cfg.train_seq_len)
    batch = {k: jax.ShapeDtypeStruct(shape, d, sharding=task.batch_sharding())
             for k, d in (("inputs", jnp.int32), ("targets", jnp.int32), ("mask", jnp.float32))}
    compiled, _ = pcompile.aot_compile(step, task.abstract_state(), batch)
    return memory.compiled_memory(compiled), mesh


@pytest.mark.parametrize("overrides", [
    ["d_model=64", "n_layers=2", "max_seq_len=64", "batch_size=2", "parallel.strategy=dp", "data=1", "fsdp=1"],
    # Remat as the estimate models it: under a rolled scan (see jaxperf.perf.memory on unrolled layers).
    ["d_model=64", "n_layers=2", "max_seq_len=64", "batch_size=32", "remat=full", "parallel.strategy=fsdp", "fsdp=8",
     "scan_unroll=1"],
    # A pipeline: the stage's layers, one microbatch at a time, and the schedule's stash. (The ring of seq > 1 is
    # checked against the TPU compiler in tests/test_topology.py: XLA:CPU keeps every ring step's buffers apart.)
    ["d_model=64", "n_layers=4", "max_seq_len=128", "batch_size=32", "remat=full", "parallel.strategy=fsdp",
     "fsdp=4", "stage=2", "microbatches=4", "scan_unroll=1"],
])
def test_memory_estimate_close_to_compiled(overrides):
    cfg = get_config("tiny", overrides)
    xla, mesh = _compiled_step_memory(cfg)
    est = memory.estimate(cfg, mesh)
    compared = xla["argument"] + xla["temp"]
    assert abs(est.total / compared - 1) < MEM_TOL, f"estimate {est}\nvs XLA {xla} (argument+temp {compared})"
    # Params + optimizer state + batch are what the step takes as arguments: those must match closely.
    assert abs((est.params + est.opt_state + est.batch) / xla["argument"] - 1) < 0.05, (est, xla)


def test_memory_estimate_sharding_and_advice():
    base = get_config("tiny", ["d_model=64", "n_layers=2", "max_seq_len=64", "batch_size=64"])
    dp = memory.estimate(memory._with(base, parallel={"strategy": "dp", "data": 8, "fsdp": 1}), 8)
    fsdp = memory.estimate(memory._with(base, parallel={"strategy": "fsdp", "data": 1, "fsdp": 8}), 8)
    # Weights split 8 ways along embed; the norms' scales and biases and the few biases without an embed dim (q/k/v,
    # mlp-in) stay whole.
    assert dp.params / 8 < fsdp.params < 1.1 * dp.params / 8
    assert fsdp.opt_state == 2 * fsdp.params and dp.activations == fsdp.activations
    remat = memory.estimate(memory._with(base, model={"remat": "full"}), 8)
    micro = memory.estimate(memory._with(base, microbatches=2), 8)
    assert remat.activations < 0.7 * fsdp.activations and micro.activations == pytest.approx(fsdp.activations / 2, abs=2)

    assert fsdp.largest() == "activations"
    with pytest.raises(memory.OutOfMemoryAdvice, match="largest: activations") as e:
        memory.check_fits(fsdp, capacity_bytes=fsdp.total / 2)
    assert "model.remat=full" in str(e.value) and "microbatches=2" in str(e.value)
    assert dp.largest() in ("opt_state", "params", "activations")
    small_batch = memory.estimate(memory._with(base, batch_size=8, seq_len=16, parallel={"strategy": "dp", "data": 8, "fsdp": 1}), 8)
    assert small_batch.largest() == "opt_state"
    assert "parallel.strategy=fsdp" in memory.advise(small_batch, small_batch.total / 2)
    assert memory.check_fits(fsdp, capacity_bytes=fsdp.total * 2) is fsdp
    assert memory.live_device_memory() is None  # CPU keeps no counters


def test_the_estimate_counts_layer_gradient_stacks_in_the_compute_dtype():
    """With model.layer_grads_in_compute_dtype (remat full, bf16 over fp32 weights) the gradients part holds the cast
    weights' stacks at 2 bytes a value (wq, wk, wv, wo, w_in, w_gate, w_out of 3 layers, split 8 ways by fsdp); the
    norm scales stay at 4."""
    base = get_config("tiny", ["style=llama", "d_model=64", "n_layers=3", "n_heads=4", "n_kv_heads=2", "mlp_dim=128",
                               "max_seq_len=64", "batch_size=64", "dtype=bfloat16", "remat=full", "fsdp=8"])
    plain, compact = (memory.estimate(memory._with(base, model={"layer_grads_in_compute_dtype": on}), 8)
                      for on in (False, True))
    cast_weights = 3 * (2 * 64 * 64 + 2 * 64 * 2 * 16 + 3 * 64 * 128)  # q and o, k and v, the MLP's three
    assert plain.grads - compact.grads == cast_weights * 2 // 8
    off = memory._with(base, model={"layer_grads_in_compute_dtype": True, "remat": "save_dots"})
    assert memory.estimate(off, 8).grads == memory.estimate(memory._with(off, model={
        "layer_grads_in_compute_dtype": False}), 8).grads  # only remat full runs the compact stacks


# ----------------------------------------------------------------------------------------------------------------------
# compile: cache, AOT, export / import


def test_enable_compilation_cache_is_idempotent(tmp_path):
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    before = {n: getattr(jax.config, n) for n in names}
    try:
        p1 = pcompile.enable_compilation_cache(tmp_path / "xla")
        assert pcompile.enable_compilation_cache(tmp_path / "xla") == p1
        assert jax.config.jax_compilation_cache_dir == p1 and jax.config.jax_persistent_cache_min_compile_time_secs == 0
    finally:  # the rest of this process compiles without the cache again, as conftest set it
        for n, v in before.items():
            jax.config.update(n, v)
        from jax._src import compilation_cache

        compilation_cache.reset_cache()
        pcompile._CACHE_DIR = None


def test_the_trainer_cache_follows_jax_own_setting(monkeypatch):
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/elsewhere/xla")
    assert get_config("tiny").compile_cache_dir == "/elsewhere/xla"
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "")
    assert get_config("tiny").compile_cache_dir == ""
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    assert get_config("tiny").compile_cache_dir == "~/.cache/jaxperf/xla"


def test_export_forward_roundtrip(tmp_path):
    cfg = ModelConfig(style="llama", d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16)
    model = GPT(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 256, jnp.int32)
    want = nnx.jit(lambda m, t: m(t))(model, tokens)  # compiled, like the exported program (eager differs in ulps)
    pcompile.export_forward(model, batch=2, seq_len=16, path=tmp_path / "fwd.jax")
    got = pcompile.load_exported(tmp_path / "fwd.jax")(pcompile.forward_params(model), tokens)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    pcompile.export_forward(model, batch=2, seq_len=16, path=tmp_path / "baked.jax", with_params=True)
    np.testing.assert_array_equal(np.asarray(pcompile.load_exported(tmp_path / "baked.jax")(tokens)), np.asarray(want))


def test_export_train_step_roundtrip(tmp_path):
    cfg = get_config("tiny", ["d_model=32", "n_layers=1", "max_seq_len=16", "parallel.strategy=fsdp", "fsdp=8"])
    task = build_task(cfg, make_mesh(cfg.parallel))
    step = task.train_step(donate=False)
    state = task.init_state()
    rng = np.random.default_rng(0)
    tok = rng.integers(0, 256, (8, 17)).astype(np.int32)
    batch = jax.device_put({"inputs": tok[:, :-1], "targets": tok[:, 1:], "mask": np.ones((8, 16), np.float32)},
                           task.batch_sharding())
    want_state, want_metrics = step(state, batch)
    pcompile.export_fn(step, state, batch, path=tmp_path / "step.jax")
    loaded = pcompile.load_exported(tmp_path / "step.jax")
    assert loaded.flat  # TrainState is a custom pytree: exported over its leaves
    got = loaded(state, batch)
    want = jax.tree.leaves((want_state, want_metrics))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


# ----------------------------------------------------------------------------------------------------------------------
# profile


def test_host_sync_audit_finds_per_step_reads():
    step = jax.jit(lambda x: (x * 0.5 + 1.0, jnp.sum(x)))
    x = jnp.ones((4, 4))
    with profile.audit_host_syncs() as syncing:
        for _ in range(5):
            x, loss = step(x)
            float(loss)  # the host waits for the device every step
    assert syncing.count == 5 and len(syncing.by_location()) == 1, syncing.report()
    assert "test_perf.py" in next(iter(syncing.by_location()))

    with profile.audit_host_syncs() as clean:
        for _ in range(5):
            x, loss = step(x)
        jax.block_until_ready(loss)
    assert clean.clean, clean.report()

    with profile.audit_host_syncs(disallow=True):
        x, loss = step(x)
        with pytest.raises(profile.HostSyncError, match="test_perf.py"):
            loss.item()
    # The wrapper is gone after the block: reads are not recorded anywhere.
    assert profile._originals == {} and isinstance(float(loss), float)


def test_trace_writes_files(tmp_path):
    f = jax.jit(lambda x: x @ x)
    with profile.trace(tmp_path / "prof") as logdir:
        for i in range(2):
            with profile.step_annotation(i):
                f(jnp.ones((64, 64))).block_until_ready()
    files = profile.trace_files(logdir)
    assert any(p.endswith(".xplane.pb") for p in files), files


def test_tpu_compiler_generation_from_libtpu_else_jax(monkeypatch):
    """The estimate's loss placement follows the installed libtpu's version, else the libtpu the installed jax pins
    for its "tpu" extra, else jax's own version."""
    assert memory._release("0.12.0.1") == (0, 12, 0, 1) and memory._release("0.13.0rc1") == (0, 13, 0)
    assert memory._release("0.0.52.dev20260101") == (0, 0, 52)
    decide = memory.tpu_compiler_overlaps_loss.__wrapped__
    versions = {"libtpu": "0.0.42.1"}
    requires = ["jaxlib ==0.12.0", "libtpu==0.0.50.*; extra == 'tpu'", "requests; extra == 'tpu'"]

    def version(name):
        if name not in versions:
            raise memory.importlib.metadata.PackageNotFoundError(name)
        return versions[name]

    monkeypatch.setattr(memory.importlib.metadata, "version", version)
    monkeypatch.setattr(memory.importlib.metadata, "requires", lambda name: list(requires))
    monkeypatch.setattr(memory.jax, "__version__", "0.12.0.1")
    assert decide() is False  # the installed libtpu wins over jax's pin and version
    versions["libtpu"] = "0.0.52"
    assert decide() is True
    del versions["libtpu"]
    assert memory._pinned_libtpu() == "0.0.50"
    assert decide() is False  # jax 0.12.0.1 pins libtpu 0.0.50.*, which keeps the loss apart
    requires[1] = 'libtpu==0.0.52; extra == "tpu"'
    assert decide() is True
    requires[1] = "libtpu==0.0.52; extra == 'cuda12'"  # a pin under another extra is not the TPU compiler's
    assert memory._pinned_libtpu() is None and decide() is False  # no pin: jax's version, 0.12.0.1
    monkeypatch.setattr(memory.jax, "__version__", "0.12.1")
    assert decide() is True
    monkeypatch.setattr(memory.jax, "__version__", "0.10.2")
    assert decide() is False


@pytest.mark.parametrize("newer_compiler", [False, True])
def test_the_tpu_estimate_counts_layers_per_scan_iteration(monkeypatch, newer_compiler):
    """k layers per scan iteration add k-1 shares of a layer's backward working set (UNROLL_SHARES, per TPU compiler
    generation); the TPU default, one per iteration, adds none, and scan_unroll means nothing to a Python loop."""
    monkeypatch.setattr(memory, "tpu_compiler_overlaps_loss", lambda: newer_compiler)

    def activations(*overrides):
        cfg = get_config("gpt2-small", ["batch_size=4", "attention_impl=xla", "loss_impl=xla", *overrides])
        return memory.estimate(cfg, 4, platform="tpu").activations

    one, two, four = activations("scan_unroll=1"), activations("scan_unroll=2"), activations("scan_unroll=4")
    assert one < two < four and four - one == pytest.approx(3 * (two - one), rel=1e-6)
    assert activations() == one
    assert activations("scan_unroll=64") == activations("scan_unroll=12")  # no more than the 12 layers there are
    assert activations("scan_layers=false", "scan_unroll=4") == activations("scan_layers=false")
    # gpt2-small saves everything (remat none): an extra layer adds only its attention gradient buffers' share
    _, share = memory.UNROLL_SHARES[newer_compiler]
    r = get_config("gpt2-small").model
    assert two - one == pytest.approx(share * 1 * r.n_heads * 1024 * 1024 * (4 + 2), rel=1e-6)


def test_the_newer_tpu_compiler_holds_a_share_of_a_scanned_layers_recomputation(monkeypatch):
    """From libtpu 0.0.52 a scanned layer's backward holds BACKWARD_RECOMPUTE_SHARE of what its remat policy
    recomputes; the older compilers all of it."""
    cfg = get_config("llama-1b", ["batch_size=16", "attention_impl=pallas", "loss_impl=chunked", "remat=full"])
    layer = memory._settled(cfg, memory._resolve_mesh(cfg, 4), "tpu").resolved()
    L, lanes = cfg.train_seq_len, bool(layer.head_dim % 128)  # the Pallas operands in 128-lane tiles (0.0.52)
    per_row = {remat: memory._layer_bytes_per_row(layer, L, remat, False, False, lanes) for remat in ("none", "full")}
    recompute = 4 * (per_row["none"] - per_row["full"])  # 4 rows per chip

    def activations(newer, shares):
        monkeypatch.setattr(memory, "tpu_compiler_overlaps_loss", lambda: newer)
        monkeypatch.setattr(memory, "BACKWARD_RECOMPUTE_SHARE", shares)
        return memory.estimate(cfg, 4, platform="tpu").activations

    fitted, whole = memory.BACKWARD_RECOMPUTE_SHARE, {False: 1.0, True: 1.0}
    share = fitted[True]
    assert 0 < share < 1 and fitted[False] == 1.0
    # at 4 rows per chip the layer's backward outweighs the gathered weights and the loss, so all of it shows
    assert activations(True, whole) - activations(True, fitted) == pytest.approx((1 - share) * recompute, rel=1e-6)
    assert activations(False, whole) == activations(False, fitted)


def _tpu_matrix_records():
    """The dense cases of benchmarks/bench_tpu_compile.py --matrix compiled with libtpu 0.0.52 at the defaults of
    2026-11-28 (benchmarks/results/tpu.jsonl), the last record of each."""
    import json
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "tpu.jsonl"
    cases = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if (r.get("name") == "matrix_case" and r.get("jaxperf_status") == "ok" and r.get("date", "") >= "2026-11-28"
                and (r.get("libtpu") or {}).get("jaxperf") == "0.0.52"):
            options = json.dumps(r.get("compiler_options") or {}, sort_keys=True), r.get("libtpu_init_args")
            cases[(r["model"], r["topology"], r["rows_per_chip"], r["seq"], r["remat"], *options)] = r
    return list(cases.values())


# Recorded cases the estimate misses by more than 6%, open (benchmarks/RESULTS.md, 2026-12-02): at one row of 2,048
# per chip, 32 v6e chips compile 6-7.5% below the estimate (as 64 do by 5-6%). (llama3-8b on 64 v5p chips, 28% above
# it when that slice was compiled without its torus, is 1.5% under it since.)
KNOWN_ESTIMATE_MISSES = {
    ("mistral-7b", "v6e:4x8", 1, 2048): 1.075,
    ("llama2-13b", "v6e:4x8", 1, 2048): 1.061,
}


def test_the_tpu_estimate_within_6_percent_of_the_recorded_matrix(monkeypatch):
    """The estimate for libtpu 0.0.52 against what that compiler reported for each recorded matrix case (7B to 13B
    Llama-family models on v5p, v6e and v5e): nothing is compiled here, so a change to the estimate or to the model
    that moves it off the compiler's figures shows without libtpu. A record whose program the defaults no longer
    build is compiled again with bench_tpu_compile.py --matrix."""
    monkeypatch.setattr(memory, "tpu_compiler_overlaps_loss", lambda: True)
    records = _tpu_matrix_records()
    assert len(records) >= 104
    off, still_off = [], []
    for r in records:
        cfg = get_config(None, r["jaxperf_overrides"])
        chips = int(np.prod([int(n) for n in r["topology"].split(":")[1].split("x")]))
        ratio = memory.estimate(cfg, chips, platform="tpu").total / r["jaxperf_bytes"]
        # the goal is 10%; 6% holds the fitted shares (0.954-1.056 on the 62 cases as last compiled on 2026-12-01:
        # v6e:8x8 at 1 x 2048 compiles 5-6% below the estimate, llama2-7b on v5e:8x8 at 1 x 4096 4.6% above it)
        case = (r["model"], r["topology"], r["rows_per_chip"], r["seq"])
        if abs(ratio - 1) > 0.06:
            (still_off if case in KNOWN_ESTIMATE_MISSES else off).append(f"{' '.join(map(str, case))}: {ratio:.3f}")
    assert not off, off
    # a case named below that comes back within 6% leaves the list
    assert len(still_off) == len(KNOWN_ESTIMATE_MISSES), (still_off, KNOWN_ESTIMATE_MISSES)


# Allocator peaks (`peak_bytes_in_use`) of GPU train steps, GiB, measured with benchmarks/gpu_check.py
# (benchmarks/results/gpu.jsonl): H100 80GB, jax 0.11.2, 2026-11-26 (the first five), H200, 2026-11-26 (the last).
GPU_PEAKS = [
    ("gpt2-small", ["batch_size=32", "scan_unroll=1"], 29.8),
    ("gpt2-small", ["batch_size=32"], 19.1),  # the GPU default: the whole stack in one scan iteration
    ("gpt2-small", ["batch_size=32", "scan_layers=false"], 19.1),
    ("llama-1b", ["batch_size=8", "scan_unroll=1"], 29.7),
    ("llama-1b", ["batch_size=8"], 28.9),
    ("gpt2-small", ["batch_size=32", "scan_unroll=1", "loss_impl=chunked"], 25.3),
]


@pytest.mark.parametrize("preset,overrides,peak_gib", GPU_PEAKS)
def test_the_gpu_estimate_within_10_percent_of_the_measured_peak(preset, overrides, peak_gib):
    """The estimate of a one-GPU step, made on this CPU host, against the peak the device's allocator reported. A
    scan that runs every layer in one iteration is counted as the Python loop it compiles to on GPU, whose logits
    XLA:GPU keeps in fp32."""
    est = memory.estimate(get_config(preset, overrides), 1, platform="gpu")
    assert est.total / 2**30 == pytest.approx(peak_gib, rel=0.10)


def test_unrolled_layers_keep_matmul_operands_and_recompute_elementwise_chains():
    """With the layers in a Python loop XLA fuses elementwise values into the backward's ops instead of keeping them:
    a residual made by elementwise ops counts as the values its chain starts from, unless a matmul reads it. Under a
    scan every residual counts."""
    w1 = jax.ShapeDtypeStruct((64, 256), jnp.float32)
    w2 = jax.ShapeDtypeStruct((256, 64), jnp.float32)
    x = jax.ShapeDtypeStruct((32, 64), jnp.float32)

    def mlp(w1, w2, x):
        h = x @ w1
        a = 0.5 * h * (1 + jnp.tanh(0.8 * (h + 0.04 * h ** 3)))  # tanh GELU: a matmul reads a, not its parts
        return (a @ w2).sum()

    shapes = lambda res: sorted(a.shape for a in res)  # noqa: E731
    scanned, unrolled = memory._residuals(mlp, w1, w2, x), memory._residuals(mlp, w1, w2, x, fused=True)
    assert shapes(unrolled) == sorted([(64, 256), (256, 64), (32, 64), (32, 256), (32, 256)])  # w1, w2, x, h, a
    assert shapes(scanned).count((32, 256)) > 2  # the GELU's intermediates as well

    # gpt2-small, one row of 1,024 positions, unrolled: the fp32 scores and bf16 probabilities, q, k, v, the five
    # bf16 [L, D] values the norms and projections start from or read (the layer's input, the two normed inputs, the
    # attention's output, the residual stream after it), the MLP's pre-activation and activation, and the fp32
    # statistics of the two norms and the softmax; not the norms' fp32 intermediates nor the GELU's
    cfg = get_config("gpt2-small", ["attention_impl=xla"]).model.resolved()
    L, D, H = 1024, cfg.d_model, cfg.n_heads
    plain = memory._layer_bytes_per_row(cfg, L, "none")
    fused = memory._layer_bytes_per_row(cfg, L, "none", True)
    assert fused == L * (H * L * (4 + 2) + 3 * D * 2 + 5 * D * 2 + 2 * 4 * D * 2) + 2 * 2 * L * 4 + 2 * H * L * 4
    assert plain > fused + L * 2 * 3 * D * 4  # at least the norms' fp32 intermediates more

    def estimate(*overrides):
        c = get_config("gpt2-small", ["batch_size=4", "attention_impl=xla", "loss_impl=xla", *overrides])
        return memory.estimate(c, 4, platform="tpu").activations

    assert estimate("scan_layers=false") == pytest.approx(estimate() - cfg.n_layers * (plain - fused), rel=1e-6)
    # FSDP gathers a Python loop's layers one at a time too
    gathered = [memory.estimate(get_config("gpt2-small", ["batch_size=4", *o]), 4, platform="tpu").gathered
                for o in ([], ["scan_layers=false"])]
    assert gathered[0] > 0 and gathered[1] == gathered[0]


def test_lane_padding_counts_the_head_dim_arrays_a_layer_keeps():
    # The TPU lays arrays with head_dim minor (64 here) out in 128-lane tiles: under save_qkv_proj the saved q, k and
    # v take twice their values' bytes; under remat full a layer keeps none of them, so nothing is padded.
    cfg = get_config("llama-1b", ["attention_impl=xla"]).model.resolved()
    L, H, K, Dh, s = 256, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, 2
    assert Dh == 64
    qkv = memory._layer_bytes_per_row(cfg, L, "save_qkv_proj", lanes=True) - memory._layer_bytes_per_row(
        cfg, L, "save_qkv_proj")
    assert qkv == L * (H + 2 * K) * (128 - Dh) * s
    assert memory._layer_bytes_per_row(cfg, L, "full", lanes=True) == memory._layer_bytes_per_row(cfg, L, "full")


def test_unrolled_layers_free_their_saved_arrays_for_their_gradients():
    """In a Python loop a layer's backward writes its gradients where its own saved arrays were (llama-1b, save_dots:
    the layer's backward working set exceeds the loss's, so it is the one reduced)."""
    cfg = get_config("llama-1b", ["batch_size=4", "attention_impl=xla", "loss_impl=xla", "scan_layers=false"])
    unrolled, r = memory.estimate(cfg, 4, platform="tpu").activations, cfg.model.resolved()
    L = r.max_seq_len
    saved = memory._layer_bytes_per_row(r, L, "save_dots", True)
    recompute = memory._layer_bytes_per_row(r, L, "none", True) - saved
    attention_grads = r.n_heads * L * L * (8 + 2)
    assert unrolled == pytest.approx(r.n_layers * saved + recompute + attention_grads - saved, rel=1e-6)
