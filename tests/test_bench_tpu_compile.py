"""benchmarks/bench_tpu_compile.py --matrix: which cases the filters pick, in which order, and how a remat policy of
MaxText's maps onto jaxperf's, all without compiling (--list)."""

import json
import subprocess

import pytest

from jaxperf.benchmarks import run as bench


@pytest.fixture(scope="module")
def tpu_bench():
    return bench.load_script("tpu_compile")


def test_matrix_list_limit_enumerates_model_topology_rows_seq_remat(tpu_bench, capsys, tmp_path):
    out = tmp_path / "never_written.jsonl"
    cases = tpu_bench.main(["--matrix", "--list", "--no-maxtext", "--limit", "4", "--out", str(out)])
    printed = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert printed == cases and not out.exists()  # listed, not compiled, nothing appended
    assert [(c["model"], c["topology"], c["rows_per_chip"], c["seq"], c["remat"]) for c in cases] == [
        ("llama2-7b", "v5p:2x2x2", 1, 2048, "full"), ("llama2-7b", "v5p:2x2x2", 1, 4096, "full"),
        ("llama2-7b", "v5p:2x2x2", 1, 8192, "full"), ("llama2-7b", "v5p:2x2x2", 2, 2048, "full")]
    assert cases[3]["batch"] == 16 and cases[3]["maxtext_topology"] == "v5p-16"
    # MaxText's default remat_policy is "full": the "default" remat is the same case, marked as MaxText's default
    assert all(c["remat_is_maxtext_default"] and c["jaxperf_remat"] == "full" for c in cases)


def test_matrix_filters_and_names(tpu_bench):
    cases = tpu_bench.matrix_cases(["mistral-7b", "llama2-13b"], ["v5p-32", "v6e", "v5e:4x4"], [2], [4096],
                                   ["default", "full", "minimal"])
    assert {c["model"] for c in cases} == {"mistral-7b", "llama2-13b"}
    assert [c["topology"] for c in cases if c["model"] == "mistral-7b" and c["remat"] == "full"] == [
        "v5p:2x2x4", "v6e:2x4", "v6e:4x4", "v6e:4x8", "v6e:8x8", "v5e:4x4"]
    assert {(c["remat"], c["jaxperf_remat"]) for c in cases} == {("full", "full"), ("minimal", "minimal")}
    assert {c["maxtext_topology"] for c in cases} >= {"v5p-32", "v6e-8", "v6e-64", "v5e-16"}
    assert len(tpu_bench.matrix_cases()) == 5 * 12 * 3 * 3  # models x topologies x rows x seqs, one remat
    with pytest.raises(SystemExit):
        tpu_bench.matrix_cases(topologies=["v7x-16"])
    assert tpu_bench.maxtext_default_remat(None) == "full"


def test_dense_models_carry_maxtexts_shapes(tpu_bench):
    shapes = {name: tpu_bench.MODELS[name][0] for name in tpu_bench.MATRIX_MODELS}
    assert shapes["llama2-7b"] == {"d_model": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 32,
                                  "mlp_dim": 11008, "vocab_size": 32000, "rope_theta": 10000.0}
    assert (shapes["llama2-13b"]["n_layers"], shapes["llama2-13b"]["d_model"], shapes["llama2-13b"]["mlp_dim"]) == (
        40, 5120, 13824)
    assert shapes["llama3-8b"] == shapes["llama3.1-8b"] and shapes["llama3-8b"]["vocab_size"] == 128256
    assert (shapes["mistral-7b"]["n_kv_heads"], shapes["mistral-7b"]["rope_theta"]) == (8, 1e6)


def test_a_compiler_option_reaches_both_sides_and_the_record(tpu_bench, monkeypatch, capsys):
    """--compiler-option goes to jaxperf as compiler_options and to MaxText through LIBTPU_INIT_ARGS; the record and
    --resume's key carry it, so a flagged case is not taken for the default one."""
    flag = "xla_tpu_enable_windowed_einsum_for_reduce_scatter=false"
    real_maxtext = tpu_bench.run_maxtext
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_scoped_vmem_limit_kib=98304")
    cases = tpu_bench.main(["--matrix", "--list", "--no-maxtext", "--limit", "1", "--compiler-option", flag])
    capsys.readouterr()
    assert cases[0]["compiler_options"] == {"xla_tpu_enable_windowed_einsum_for_reduce_scatter": False}
    assert cases[0]["libtpu_init_args"] == "--xla_tpu_scoped_vmem_limit_kib=98304"
    for other in ({"compiler_options": {}}, {"libtpu_init_args": None}):  # --resume tells them apart
        assert tpu_bench.case_key(cases[0]) != tpu_bench.case_key({**cases[0], **other})
    with pytest.raises(SystemExit, match="is not name=value"):
        tpu_bench.main(["--matrix", "--list", "--no-maxtext", "--compiler-option", "xla_tpu_foo"])
    with pytest.raises(SystemExit):  # the single compile does not take it
        tpu_bench.main(["--no-maxtext", "--compiler-option", flag])

    seen = {}
    prediction = {"step_s": 1.0, "mfu": 0.5, "bound_by": "compute", "hbm_bytes": 1.0, "collective_wire_bytes": 1.0,
                  "collectives": {}, "unknown_trip_counts": []}

    def fake_jaxperf(topology, overrides, timeout, hlo_out=None):
        seen["jaxperf"] = overrides
        return {"bytes_per_chip": {"total": 1}, "prediction": prediction, "model_flops_per_chip": 1.0,
                "flops_per_chip": 1.0}

    def fake_maxtext(*args):
        seen["maxtext"] = args[-1]
        return {"bytes_per_chip": {"total": 2}, "prediction": prediction, "compile_s": 1.0, "compiler": {}}

    monkeypatch.setattr(tpu_bench, "run_jaxperf", fake_jaxperf)
    monkeypatch.setattr(tpu_bench, "run_maxtext", fake_maxtext)
    monkeypatch.setattr(tpu_bench, "_libtpu_dir", lambda: "/nowhere")
    rec = tpu_bench.run_case(cases[0], "python", "test", 1.0)
    assert seen["jaxperf"][-1] == f"compiler_options={flag}" and seen["maxtext"] == (flag,)
    assert rec["compiler_options"] == cases[0]["compiler_options"]
    assert rec["libtpu_init_args"] == "--xla_tpu_scoped_vmem_limit_kib=98304"

    def fake_run(cmd, **kw):
        seen["env"] = kw["env"]
        return subprocess.CompletedProcess(cmd, 0, stdout='MAXTEXT_JSON {"ok": 1}\n', stderr="")

    monkeypatch.setattr(tpu_bench.subprocess, "run", fake_run)
    monkeypatch.setattr(tpu_bench, "_maxtext_base", lambda python: "base.yml")
    assert real_maxtext("python", "v5p:2x2x2", {}, 1, 2048, "full", 1.0, 1.0, 1.0, "llama2-7b", None, (flag,)) == {
        "ok": 1}
    assert seen["env"]["LIBTPU_INIT_ARGS"] == f"--xla_tpu_scoped_vmem_limit_kib=98304 --{flag}"


def test_maxtext_from_takes_the_recorded_maxtext_side_and_compiles_only_jaxperfs(tpu_bench, monkeypatch, capsys,
                                                                                  tmp_path):
    """--maxtext-from: a case recorded before (same shape, same compiler options) keeps that record's MaxText side,
    its versions and its compile date; only jaxperf's side is compiled; a case not recorded there is compiled (or,
    with --no-maxtext, skipped) as usual; a missing file is one line."""
    args = ["--matrix", "--models", "llama2-7b", "--topologies", "v5p:2x2x2", "--rows", "1", "--seqs", "2048,4096",
            "--remats", "full", "--no-maxtext"]
    cases = tpu_bench.main([*args, "--list"])
    capsys.readouterr()
    earlier = {**cases[0], "name": "matrix_case", "date": "2026-11-28T13:29:37+00:00", "maxtext_status": "ok",
               "maxtext_fits": True, "maxtext_bytes": 400, "maxtext_step_s": 2.0, "maxtext_collective_s": 0.5,
               "jaxperf_bytes": 999, "jax": {"jaxperf": "0.12.0.1", "maxtext": "0.12.0.1"},
               "libtpu": {"jaxperf": "0.0.52", "maxtext": "0.0.52"}, "maxtext_version": "0.2.5"}
    flagged = {**earlier, "compiler_options": {"xla_foo": False}, "maxtext_bytes": 1}  # another case
    recorded = tmp_path / "tpu.jsonl"
    recorded.write_text("not json\n" + json.dumps(earlier) + "\n" + json.dumps(flagged) + "\n")
    compiled = []
    prediction = {"step_s": 1.0, "mfu": 0.5, "bound_by": "compute", "hbm_bytes": 1.0, "collective_wire_bytes": 1.0,
                  "collectives": {}, "unknown_trip_counts": []}

    def fake_jaxperf(topology, overrides, timeout, hlo_out=None):
        compiled.append(overrides)
        return {"bytes_per_chip": {"total": 300}, "prediction": prediction, "predicted_step_s": 1.0,
                "model_flops_per_chip": 1.0, "flops_per_chip": 1.0}

    monkeypatch.setattr(tpu_bench, "run_jaxperf", fake_jaxperf)
    monkeypatch.setattr(tpu_bench, "run_maxtext", lambda *a: pytest.fail("MaxText compiled"))
    monkeypatch.setattr(tpu_bench, "_libtpu_dir", lambda: "/nowhere")
    monkeypatch.setattr(tpu_bench, "_jaxperf_compiler", lambda: {"jax": "0.12.0.1", "libtpu": "0.0.52"})
    out = tmp_path / "new.jsonl"
    reused, fresh = tpu_bench.main([*args, "--maxtext-from", str(recorded), "--out", str(out)])
    assert len(compiled) == 2 and len(out.read_text().splitlines()) == 2
    assert (reused["maxtext_bytes"], reused["maxtext_step_s"], reused["maxtext_version"]) == (400, 2.0, "0.2.5")
    assert reused["maxtext_compiled"] == earlier["date"] and reused["jaxperf_bytes"] == 300
    assert reused["bytes_ratio"] == 0.75 and reused["step_ratio"] == 0.5 and reused["same_compiler"] is True
    assert fresh["maxtext_status"] == "skipped" and fresh["maxtext_bytes"] is None and "maxtext_compiled" not in fresh
    with pytest.raises(SystemExit, match="no such file"):
        tpu_bench.main([*args, "--maxtext-from", str(tmp_path / "missing.jsonl")])
