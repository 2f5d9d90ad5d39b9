"""The benchmark scripts run in --tiny mode and emit well-formed records; `jaxperf bench` writes results.jsonl; the
PyTorch peer computes the same losses as jaxperf from the same parameters (when an interpreter with torch is known).
"""

import importlib
import importlib.util
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxperf import cli
from jaxperf.benchmarks import run as bench

CONTEXT_KEYS = ("benchmark", "name", "value", "unit", "device", "platform", "n_devices", "versions", "date")


def load(name):
    return bench.load_script(name)


def check_records(records, benchmark, expect_names):
    assert isinstance(records, list) and records, f"{benchmark}: no records"
    for r in records:
        json.loads(json.dumps(r, allow_nan=False))  # strict JSON: no NaN/inf, only plain types
        missing = [k for k in CONTEXT_KEYS if k not in r]
        assert not missing, f"{benchmark} record {r.get('name')} lacks {missing}"
        assert r["benchmark"] == benchmark
        assert r["platform"] == "cpu" and r["n_devices"] == 8
        assert set(r["versions"]) >= {"jax", "flax"}
        if r.get("error") or r.get("skipped"):
            continue
        assert isinstance(r["value"], float) and math.isfinite(r["value"]) and r["value"] > 0, r
        assert r["unit"], r
        if "pct_of_peak" in r:
            assert r["pct_of_peak"] > 0, r
    names = {r["name"] for r in records}
    assert set(expect_names) <= names, f"{benchmark}: missing {set(expect_names) - names}"


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """`jaxperf bench --tiny compiled_vs_eager --out DIR` through the CLI, once for the tests below."""
    out = tmp_path_factory.mktemp("bench")
    rc = cli.main(["bench", "--tiny", "compiled_vs_eager", "--out", str(out)])
    return rc, out


@pytest.mark.slow
def test_cli_bench_writes_results(cli_run, capsys):
    rc, out = cli_run
    assert rc == 0
    lines = (out / "results.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    check_records(records, "compiled_vs_eager",
                  ["mlp_fwd_bwd/eager", "mlp_fwd_bwd/jit", "mlp_fwd_bwd/speedup", "train_step/eager",
                   "train_step/jit", "train_step/speedup"])
    by_name = {r["name"]: r for r in records}
    # the speedup is the ratio of the two medians that were measured, not an independent number
    for w in ("mlp_fwd_bwd", "train_step"):
        ratio = by_name[f"{w}/eager"]["value"] / by_name[f"{w}/jit"]["value"]
        assert by_name[f"{w}/speedup"]["value"] == pytest.approx(ratio)
    assert by_name["mlp_fwd_bwd/speedup"]["value"] > 1, "jit should beat op-by-op dispatch on a 2-layer MLP"


def test_async_dispatch_tiny():
    records = load("async_dispatch").main(["--tiny"])
    check_records(records, "async_dispatch", ["chain/dispatch_per_call", "chain/device_per_call",
                                              "loop/sync_every_step", "loop/lagged_metrics"])
    r = {x["name"]: x for x in records}
    assert r["chain/device_per_call"]["value"] >= r["chain/dispatch_per_call"]["value"]


def test_auto_parallel_tiny():
    records = load("auto_parallel").main(["--tiny"])
    check_records(records, "auto_parallel", ["chains/independent", "chains/sequential", "prefetch/no_prefetch",
                                             "prefetch/prefetch"])


def test_sequential_chains_are_really_ordered():
    import jax

    mod = load("auto_parallel")
    xs, w = np.ones((2, 4, 4), np.float32), np.eye(4, dtype=np.float32)
    text = mod.make_chains(2, True).lower(xs, w).as_text()
    assert "optimization_barrier" in text
    assert "optimization_barrier" not in mod.make_chains(2, False).lower(xs, w).as_text()
    np.testing.assert_allclose(mod.make_chains(2, True)(xs, w), jax.numpy.tanh(jax.numpy.tanh(xs)), rtol=1e-6)


def test_hardware_tiny():
    records = load("hardware").main(["--tiny", "--dtypes", "float32"])
    check_records(records, "hardware", ["matmul/float32/n64", "matmul/float32/n256", "memory/copy", "memory/reduce",
                                        "transfer/host_to_device", "transfer/device_to_host"])
    mm = next(r for r in records if r["name"] == "matmul/float32/n256")
    assert mm["unit"] == "TFLOP/s" and "pct_of_peak" in mm  # a measured fp32 peak exists on CPU
    rl = mm["roofline"]
    assert rl["flops"] == 2 * 256**3 and rl["bytes"] == 3 * 256 * 256 * 4
    pts = bench.roofline_points(records)
    assert len(pts) == 4 and all(p.achieved_flops > 0 for p in pts)


def test_kernels_tiny_checks_then_times_every_impl():
    recs = load("kernels").main(["--tiny", "--ops", "rms_norm", "cross_entropy"])
    check_records(recs, "kernels", ["rms_norm/pallas/both", "linear_cross_entropy/chunked/both"])
    assert not [r for r in recs if r.get("error")], recs
    got = {(r["op"], r["impl"], r["pass_name"]) for r in recs}
    for op, impls in (("rms_norm", ("xla", "pallas")), ("linear_cross_entropy", ("xla", "chunked", "pallas"))):
        for impl in impls:
            assert {(op, impl, p) for p in ("forward", "backward", "both")} <= got
    assert all(r["value"] > 0 for r in recs)
    fused = [r for r in recs if r["op"] == "linear_cross_entropy" and r["impl"] == "pallas"]
    naive = [r for r in recs if r["op"] == "linear_cross_entropy" and r["impl"] == "xla"]
    assert fused[0]["fwd_bwd_temp_plus_output_bytes"] < naive[0]["fwd_bwd_temp_plus_output_bytes"]
    assert all("speed_vs_xla" in r for r in recs if r["impl"] != "xla")


def test_collectives_tiny_checks_then_times_every_algorithm(tmp_path):
    recs = load("collectives").main(["--tiny", "--iters", "2", "--out", str(tmp_path)])
    algos = ("psum", "ring", "bidirectional_ring", "halving_doubling")
    check_records(recs, "collectives", ["link/psum_fit"] + [f"{a}/{s}" for a in algos for s in ("1KiB", "1MiB")])
    for r in recs[1:]:
        assert r["unit"] == "GB/s" and r["seconds"] > 0 and r["predicted_s"] > 0, r
        assert r["value"] == pytest.approx(r["nbytes"] / r["seconds"] * 2 * 7 / 8 / 1e9)  # bus bandwidth, n=8
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "collectives.png").stat().st_size > 0


@pytest.mark.slow
def test_parallel_tiny_times_each_kind_of_pair(tmp_path):
    """One pair of each kind the script builds (every flavour, tensor splits both ways, the overlapped reduction, both
    pipeline schedules and their memory records, the four-axis mesh) and the pairs not asked for left out; that each
    flavour x strategy trains alike is tests/test_flavours.py's."""
    chosen = ["jit/fsdp_tp", "jit/tp", "shard_map/tp", "shard_map/dp+overlap", "pmap/dp", "jit/stage2-1f1b",
              "jit/stage2-gpipe", "jit/stage2+seq2+fsdp"]
    recs = load("parallel").main(["--tiny", "--steps", "1", "--out", str(tmp_path), "--pairs", ",".join(chosen)])
    check_records(recs, "parallel", chosen + ["memory/stage2-1f1b", "memory/stage2-gpipe"])
    assert {r["name"] for r in recs} == {*chosen, "memory/stage2-1f1b", "memory/stage2-gpipe"}
    assert not [r for r in recs if r.get("error")], [r["error"] for r in recs if r.get("error")]
    by_name = {r["name"]: r for r in recs}
    assert by_name["jit/stage2+seq2+fsdp"]["mesh"] == {"data": 1, "stage": 2, "fsdp": 2, "expert": 1, "seq": 2,
                                                       "tensor": 1}
    one_f_one_b, gpipe = by_name["memory/stage2-1f1b"], by_name["memory/stage2-gpipe"]
    assert 0 < one_f_one_b["value"] < gpipe["value"] and one_f_one_b["ratio_1f1b_to_gpipe"] < 1
    assert one_f_one_b["value"] == by_name["jit/stage2-1f1b"]["temp_bytes"]
    recs = [r for r in recs if r["unit"] == "tokens/s"]
    assert by_name["jit/fsdp_tp"]["mesh"] == {"data": 1, "stage": 1, "fsdp": 4, "expert": 1, "seq": 1, "tensor": 2}
    assert by_name["jit/tp"]["mesh"] == by_name["shard_map/tp"]["mesh"] == \
        {"data": 2, "stage": 1, "fsdp": 1, "expert": 1, "seq": 1, "tensor": 4}
    losses = {r["loss"] for r in recs}
    assert max(losses) - min(losses) < 1e-3 * max(losses)  # the same first step, however it is written
    for r in recs:
        assert r["value"] == pytest.approx(r["batch"] * r["seq_len"] / r["step_s"])
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "parallel.png").stat().st_size > 0


@pytest.mark.slow
def test_generate_tiny_checks_then_times_prefill_and_decode():
    recs = load("generate").main(["--tiny"])
    check_records(recs, "generate", ["prefill_b1", "decode_b1", "prefill_b4", "decode_b4"])
    by_name = {r["name"]: r for r in recs}
    for b in (1, 4):
        d = by_name[f"decode_b{b}"]
        assert d["unit"] == "tokens/s" and d["value"] == pytest.approx(b * d["max_tokens"] / d["decode_s"])
        # % of the bandwidth limit is the floor over the measured step
        assert d["pct_of_peak"] == pytest.approx(100 * d["bandwidth_floor_s"] / d["step_s"], rel=1e-2, abs=6e-4)  # rounded to 3 decimals
    rows = {r["name"]: r for r in load("generate").main(["--tiny", "--data", "2", "--batch-sizes", "1"])}
    assert rows["decode_b1"]["data"] == 2 and rows["decode_b1"]["shapes"]["batch"] == 2  # a row per device
    with pytest.raises(SystemExit):
        load("generate").main(["--tiny", "--data", "99"])


@pytest.mark.slow
def test_serve_tiny_measures_every_scenario_on_loopback():
    pytest.importorskip("uvicorn")
    recs = load("serve").main(["--tiny", "--requests", "16"])
    check_records(recs, "serve", ["static", "continuous", "continuous_vs_static", "continuous_x2", "continuous_rows_x2",
                                  "continuous_int8", "int8_weight_bytes", "decode_b1", "decode_b32", "decode_b32_vs_b1",
                                  "decode_b32_vs_b1_rows_x2"])
    by_name = {r["name"]: r for r in recs}
    for name in ("static", "continuous", "continuous_x2", "continuous_rows_x2", "continuous_int8"):
        r = by_name[name]
        assert r["completed"] == r["requests"] == 16 and not r["errors"], r
        assert r["compiles_during_run"] == 0, r  # warmed up: nothing compiled while timed
        assert r["value"] == pytest.approx(r["completed"] / r["wall_s"])
        assert 0 < r["ttft_p50_s"] <= r["latency_p50_s"] <= r["latency_p99_s"], r
    assert by_name["static"]["batching"] == "static" and by_name["continuous"]["batching"] == "continuous"
    assert by_name["continuous_x2"]["replicas"] == 2 and min(by_name["continuous_x2"]["per_replica_requests"]) > 0
    assert by_name["continuous_int8"]["int8"] and by_name["int8_weight_bytes"]["value"] <= 0.3
    ratio = by_name["continuous_vs_static"]
    assert ratio["value"] == pytest.approx(by_name["continuous"]["goodput_rps"] / by_name["static"]["goodput_rps"])
    assert by_name["decode_b32_vs_b1"]["value"] == pytest.approx(by_name["decode_b32"]["value"]
                                                                 / by_name["decode_b1"]["value"])


@pytest.mark.slow
def test_tpu_compile_tiny_reports_jaxperf_and_says_why_maxtext_is_missing():
    recs = load("tpu_compile").main(["--tiny", "--seq", "256"])  # 256 tokens: each compile a third shorter
    names = {"jaxperf/default", "jaxperf/pallas+chunked", "maxtext"}
    check_records(recs, "tpu_compile", names)
    assert not [r for r in recs if r.get("error")], [r["error"] for r in recs if r.get("error")]
    by_name = {r["name"]: r for r in recs}
    if importlib.util.find_spec("maxtext") is None:
        assert "maxtext package is not importable" in by_name["maxtext"]["skipped"]
    for name in ("jaxperf/default", "jaxperf/pallas+chunked"):
        r = by_name[name]
        if r.get("skipped"):
            assert "libtpu" in r["skipped"]
            continue
        assert r["value"] == pytest.approx(r["bytes_per_chip"]["total"] / 1e9)
        assert r["predicted_step_s"] == max(r["compute_s"], r["hbm_s"], r["collective_s"]) > 0
        assert 0 < r["predicted_mfu"] < 1 and r["collectives"]["all-gather"]["ops"] > 0  # fsdp gathers weights
        assert 0.5 < r["estimate_bytes"] / r["bytes_per_chip"]["total"] < 2  # the estimate made before compiling
    assert not by_name["jaxperf/default"].get("unknown_trip_counts")  # the scanned layers and their inner loops


def test_runner_passes_its_out_folder_to_scripts_that_take_one(tmp_path, monkeypatch):
    seen = {}
    modules = {name: load(name) for name in ("collectives", "async_dispatch")}
    for name, module in modules.items():
        monkeypatch.setattr(module, "main", lambda argv, name=name: seen.setdefault(name, argv) and [])
        monkeypatch.setattr(bench, "load_script", lambda _n, _d=None, module=module: module)
        bench.run_one(name, ["--tiny"], out=tmp_path)
    assert seen == {"collectives": ["--tiny", "--out", str(tmp_path)], "async_dispatch": ["--tiny"]}


def test_hardware_rejects_unknown_dtype():
    with pytest.raises(SystemExit, match="int4"):
        load("hardware").main(["--tiny", "--dtypes", "int4"])


@pytest.mark.slow
def test_train_tiny_without_peer():
    records = load("train").main(["--tiny", "--peer", "none", "--rounds", "2"])
    check_records(records, "train", ["tiny/jaxperf", "tiny/torch"])
    r = {x["name"]: x for x in records}
    jx = r["tiny/jaxperf"]
    assert len(jx["rounds"]) == 2 and jx["value"] == max(jx["rounds"])  # the best of two measured rounds
    # pct_of_peak is rounded to 3 decimals
    assert 0 < jx["mfu"] < 1 and jx["pct_of_peak"] == pytest.approx(100 * jx["mfu"], rel=1e-3, abs=6e-4)
    assert r["tiny/torch"]["value"] is None and r["tiny/torch"]["skipped"] == "--peer none"


def test_peer_python_reports_missing_torch(monkeypatch):
    mod = load("train")
    monkeypatch.delenv("JAXPERF_PEER_PYTHON", raising=False)
    python, why = mod.peer_python(None)
    if importlib.util.find_spec("torch") is None:
        assert python is None and "torch not installed" in why
    else:
        assert python == sys.executable
    assert mod.peer_python("/x/python") == ("/x/python", "--peer-python")


def test_peer_gets_huge_pages_where_jaxperf_has_them(monkeypatch):
    from jaxperf.perf import cpu_host

    mod = load("train")
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    for glibc_tunable, expected in ((f"{cpu_host.TUNABLE}=1", {"THP_MEM_ALLOC_ENABLE": "1"}), (None, {})):
        monkeypatch.setattr(cpu_host, "host_memory", lambda: cpu_host.HostMemory((2, 36), "madvise", glibc_tunable))
        env, changed = mod.peer_env()
        assert changed == expected and env.get("THP_MEM_ALLOC_ENABLE") == expected.get("THP_MEM_ALLOC_ENABLE")


def test_runner_reports_a_broken_script_and_goes_on(tmp_path, capsys):
    (tmp_path / "bench_kernels.py").write_text("from pallas_kernels.nothing_here import x\n")
    recs = bench.run_one("kernels", ["--tiny"], tmp_path)
    assert len(recs) == 1 and recs[0]["name"] == "error" and "ModuleNotFoundError" in recs[0]["error"]
    assert "kernels" in bench.table(recs)
    with pytest.raises(SystemExit):
        bench.main(["no_such_benchmark"])


def _peer_python():
    env = os.environ.get("JAXPERF_PEER_PYTHON")
    if env:
        return env
    return sys.executable if importlib.util.find_spec("torch") is not None else None


@pytest.mark.slow
@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_torch_peer_matches_jaxperf(style, tmp_path):
    """Same parameters and batch: the peer's loss equals jaxperf's, and so do the losses after AdamW updates."""
    python = _peer_python()
    if python is None:
        pytest.skip("torch not installed here: set JAXPERF_PEER_PYTHON to an interpreter with torch to test the peer")
    import jax

    from jaxperf.benchmarks._common import make_train_step

    mod = load("train")
    overrides = ["model.n_layers=2", "model.d_model=64", "model.n_heads=2", "batch_size=8", "seq_len=16",
                 "optim.warmup_steps=2", "max_steps=10"]
    if style == "llama":
        overrides += ["model.style=llama", "model.n_kv_heads=1"]
    step, state, batch, cfg = make_train_step("tiny", overrides, donate=False)
    flat = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state.params)[0]:
        flat[".".join(str(getattr(k, "key", k)) for k in path)] = np.asarray(leaf)
    b = jax.device_get(batch)
    flat["__tokens__"] = np.concatenate([b["inputs"], b["targets"][:, -1:]], axis=1)
    np.savez(tmp_path / "params.npz", **flat)
    losses = []
    for _ in range(3):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    config = mod.peer_config(cfg, 1, 1, "eager", "cpu")
    proc = subprocess.run([python, str(mod.PEER_SCRIPT), "--config", json.dumps(config), "--parity",
                           str(tmp_path / "params.npz"), "--out", str(tmp_path / "out.npz"), "--parity-steps", "3"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    peer = np.load(tmp_path / "out.npz")["losses"]
    np.testing.assert_allclose(peer[0], losses[0], rtol=1e-5)  # forward parity
    np.testing.assert_allclose(peer[1:], losses[1:], rtol=1e-4)  # AdamW, schedule, clipping and decay parity
    assert losses[2] < losses[0]  # the updates did something, so matching them means something


def _gpu_check():
    return importlib.import_module("jaxperf.benchmarks.gpu_check")


def test_gpu_check_plans_stages_in_order_and_reads_attention_against_the_fastest(tmp_path):
    gc = _gpu_check()
    jobs = gc.plan(list(gc.DEFAULT_STAGES), dry=False, full=False, nanogpt_dir=tmp_path)
    assert [j.stage for j in jobs] == sorted((j.stage for j in jobs), key=gc.STAGES.index)
    assert {j.stage for j in jobs} == set(gc.DEFAULT_STAGES)
    full = {j.name for j in gc.plan(["train"], dry=False, full=True, nanogpt_dir=tmp_path)}
    assert {"gpt2-small_b32", "gpt2-small_b32_fullloss", "gpt2-small_b32_maxtext_flags", "llama-1b_b8_profile"} <= full
    # The default pass fits a 7-minute window with start-up to spare.
    assert sum(gc.STAGE_LIMIT_S[s] for s in gc.DEFAULT_STAGES) <= gc.DEFAULT_BUDGET_S <= 7 * 60 - 30
    rows = [{"bench": "attention", "seq": 1024, "head_dim": 64, "pass": "both", "impl": i, "ms": ms}
            for i, ms in (("xla", 5.0), ("cudnn", 1.0), ("auto", 1.1), ("pallas", 2.0))]
    (auto,) = gc._attention_auto(rows)
    assert auto["fastest"] == "cudnn" and auto["auto_over_fastest"] == 1.1
    recs = [{"bench": "train_step", "stage": "train", "preset": "gpt2-small", "job": j, "tokens_per_s": t, "mfu": 0.3,
             "mfu_nanogpt_count": 0.32} for j, t in (("a", 100.0), ("b", 300.0))]
    recs.append({"bench": "train_step", "peer": "nanogpt+torch.compile", "peer_tokens_per_s": 200.0})
    gc._peer_ratio(recs)
    assert recs[-1]["jaxperf_job"] == "b" and recs[-1]["ratio"] == 1.5
    assert gc._cannot_run(gc.Job("peer", "x", [], 1), tmp_path)  # no nanoGPT source there: skipped, with the reason


@pytest.mark.slow
def test_gpu_check_dry_run_runs_every_stage_on_cpu(tmp_path):
    """What CI runs so that the GPU script never rots: every stage at tiny shapes, records for each."""
    script = os.path.join(os.path.dirname(bench.__file__), "gpu_check.py")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, script, "--out", str(tmp_path), "--dry-run", "--label", "test"],
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = [json.loads(line) for line in (tmp_path / "gpu.jsonl").read_text().splitlines()]
    by_stage = {}
    for r in recs:
        by_stage.setdefault(r["stage"], []).append(r)
        assert r["commit"] == "test" and "error" not in r, r
    assert set(by_stage) == {"env", "correctness", "train", "peer", "attention", "decode", "serve", "memory"}
    tests = {r["test"]: r["outcome"] for r in by_stage["correctness"]}
    assert any(t.startswith("test_flash_attention_matches_reference_on_device") for t in tests)
    assert {o for t, o in tests.items() if "cudnn" not in t} == {"passed"}, tests
    train = {r["job"]: r for r in by_stage["train"]}
    assert train["gpt2-small_b32"]["tokens_per_s"] > 0 and train["gpt2-small_b32"]["flops_per_token_nanogpt"] > 0
    (memory,) = by_stage["memory"]
    assert memory["profile"]["ops"]  # device time per op, from a trace
    assert memory["estimate_bytes"] > 0 and memory["estimate_over_compiled_bound"] > 0
    assert any(r.get("fastest") for r in by_stage["attention"])
    assert any(r["bench"] == "decode" and r["tokens_per_s"] > 0 for r in by_stage["decode"])
    assert any(r["bench"] == "serve" and r.get("unit") == "requests/s" for r in by_stage["serve"])
    peer = by_stage["peer"][0]
    assert peer.get("skipped") or peer["peer_tokens_per_s"] > 0
    assert "stage" in proc.stdout and "total" in proc.stdout  # the table printed last
