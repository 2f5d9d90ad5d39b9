"""How much memory and how much time per step does a TPU slice need for the same model, compiled by jaxperf and by
MaxText? Bytes per chip, compile time and predicted step time side by side, from the real TPU compiler on this host.

    python benchmarks/bench_tpu_compile.py                   # Llama-3.1-8B shapes, v5p-32, batch 32 x 8192, remat full
    python benchmarks/bench_tpu_compile.py --model mixtral-8x7b   # Mixtral-8x7B shapes, v5p-32, batch 32 x 4096
    python benchmarks/bench_tpu_compile.py --tiny            # a 2-layer model on 4 chips (minutes on CPU)
    python benchmarks/bench_tpu_compile.py --maxtext-python /path/to/venv/bin/python

Each compile runs in a subprocess of its own (`JAX_PLATFORMS=cpu`; libtpu from the environment or from
`JAXPERF_LIBTPU_PATH`), one after the other. jaxperf is compiled twice: with its default settings and with Pallas
flash attention plus the chunked loss; an MoE model a third time, the latter with expert parallelism. MaxText
(`maxtext.trainers.pre_train.train_compile`, which installs with Python 3.12) compiles the same model, topology, batch
and remat policy when its package is importable by `--maxtext-python` (default: this interpreter); otherwise its
record says why it was skipped. Both sides' step times come from jaxperf.perf.predict applied to each compiled
program, with the same FLOP count (jaxperf.perf.flops for the shared shapes), so the comparison is of the programs,
not of two FLOP formulas. Each record names the jax and libtpu it compiled with (`compiler`): MaxText's interpreter
imports its own libtpu unless its PYTHONPATH names another.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from jaxperf.benchmarks._common import emit, record

LIBTPU_PATH = os.environ.get("JAXPERF_LIBTPU_PATH", "/tmp/libtpu_pkg")
REPO = Path(__file__).resolve().parents[1]

# Llama-3.1-8B: 32 layers, d_model 4096, 32 query / 8 KV heads, SwiGLU 14336, vocab 128256, untied embeddings.
LLAMA31_8B = {"d_model": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "mlp_dim": 14336,
              "vocab_size": 128256, "rope_theta": 500000.0}
# Mixtral-8x7B: Llama-3.1-8B's attention and widths, each MLP 8 SwiGLU experts of width 14336 (top-2), vocab 32000.
MIXTRAL_8X7B = {"d_model": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "mlp_dim": 14336,
                "vocab_size": 32000, "rope_theta": 1000000.0, "n_experts": 8, "experts_per_token": 2}
TINY = {"d_model": 512, "n_layers": 2, "n_heads": 8, "n_kv_heads": 2, "mlp_dim": 1536, "vocab_size": 32000,
        "rope_theta": 500000.0}
# --model -> (shapes, jaxperf overrides beyond the shapes, MaxText's model_name, default sequence length). Mixtral
# routes dropless on both sides (jaxperf: capacity_factor None, grouped matmuls; MaxText: sparse_matmul with megablox,
# capacity_factor -1) with softmax top-2 and the router losses of jaxperf's mixtral-8x7b preset (MaxText's
# load_balance_loss_weight stays at its default, 0).
MODELS = {
    "llama3.1-8b": (LLAMA31_8B, [], "llama3.1-8b", 8192),
    "mixtral-8x7b": (MIXTRAL_8X7B, ["model.router=softmax", "model.router_aux_loss_coef=0.02",
                                    "model.router_z_loss_coef=0.0", "model.norm_eps=1e-5"], "mixtral-8x7b", 4096),
}
# jaxperf topology name -> MaxText's compile_topology (MaxText's v5p names count TensorCores, two per chip)
MAXTEXT_TOPOLOGY = {"v5p:2x2x1": "v5p-8", "v5p:2x2x2": "v5p-16", "v5p:2x2x4": "v5p-32", "v5p:2x4x4": "v5p-64",
                    "v5p:4x4x4": "v5p-128"}


def _env(extra_path: str | None = None) -> dict[str, str]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    paths = [str(REPO), env.get("PYTHONPATH")]
    if extra_path:
        paths.insert(1, extra_path)
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def jaxperf_overrides(shapes: dict, batch: int, seq: int, remat: str) -> list[str]:
    """The jaxperf overrides for a Llama-style model of `shapes` (bf16 compute, fp32 parameters, untied; `n_experts`
    and `experts_per_token` among the shapes make its MLPs mixtures of experts).

    They apply on top of the default preset. `model.scan_unroll=1` states what the TPU default gives anyway: one
    layer per loop iteration, as MaxText's rolled layer loop (k layers per iteration keep k layers' recomputed
    activations live).
    """
    model = [f"model.{k}={v}" for k, v in shapes.items()]
    return ["model.style=llama", *model, "model.scan_unroll=1", "model.tie_embeddings=false", "model.dtype=bfloat16",
            f"model.max_seq_len={seq}", f"seq_len={seq}", f"batch_size={batch}", f"model.remat={remat}",
            "strategy=fsdp"]


def _libtpu_dir() -> str | None:
    """The directory a subprocess needs on its PYTHONPATH to import libtpu: where this process finds it (its sys.path
    may have gained the directory at run time, which a subprocess does not inherit), else $JAXPERF_LIBTPU_PATH."""
    spec = importlib.util.find_spec("libtpu")
    if spec is not None and spec.submodule_search_locations:
        return str(Path(next(iter(spec.submodule_search_locations))).parent)
    return LIBTPU_PATH if (Path(LIBTPU_PATH) / "libtpu").is_dir() else None


def _jaxperf_compiler() -> dict[str, str | None]:
    """jax and libtpu as the jaxperf compiles see them: this interpreter's jax, the libtpu of `_libtpu_dir`. The
    MaxText side reports its own; the two compile with different TPU compilers unless both find the same libtpu (with
    jax 0.12.0.1, Mixtral-8x7B on v5p:2x4x4 took 13-19% more bytes per chip under libtpu 0.0.50.1 than under 0.0.52,
    on both sides)."""
    where = _libtpu_dir()
    tpu = next((d.version for d in importlib.metadata.distributions(path=[where]) if d.metadata["Name"] == "libtpu"),
               None) if where else None
    return {"jax": importlib.metadata.version("jax"), "libtpu": tpu}


def run_jaxperf(topology: str, overrides: list[str], timeout: float, hlo_out: str | None = None) -> dict:
    env = _env(_libtpu_dir())
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, "-m", "jaxperf.cli", "compile", "--topology", topology, "--json", *overrides]
    if hlo_out:
        cmd += ["--hlo-out", hlo_out]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if out.returncode not in (0, 1) or not out.stdout.strip():
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"jaxperf compile failed (exit {out.returncode}): {tail}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# Runs under the MaxText interpreter: compile through train_compile.main with its compile step wrapped, so the
# compiled object can be read afterwards; print one JSON line.
_MAXTEXT_DRIVER = textwrap.dedent("""
    import importlib.metadata, json, sys, time
    from maxtext.trainers.pre_train import train_compile as tc
    from jaxperf.perf.hardware import chip_for
    from jaxperf.perf.predict import predict_step
    argv, model_flops, hardware_flops = json.loads(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
    hlo_out = sys.argv[4] if len(sys.argv) > 4 else ""
    seen = {}
    inner = tc.jit_and_compile
    def timed(*a, **k):
        t0 = time.perf_counter()
        seen["compiled"] = inner(*a, **k)
        seen["compile_s"] = time.perf_counter() - t0
        return seen["compiled"]
    tc.jit_and_compile = timed
    tc.main(argv)
    c = seen["compiled"]
    m = c.memory_analysis()
    b = {k: int(getattr(m, f"{k}_size_in_bytes", 0)) for k in ("argument", "output", "alias", "temp",
                                                                "generated_code")}
    total = b["argument"] + b["output"] - b["alias"] + b["temp"] + b["generated_code"]
    dev = c.input_shardings[0]
    chip = None
    try:
        import jax.tree_util as tu
        first = tu.tree_leaves(dev)[0]
        chip = chip_for(next(iter(first.device_set)))
    except Exception:
        pass
    if hlo_out:
        with open(hlo_out, "w") as f:
            f.write(c.as_text())
    pred = predict_step(c.as_text(), model_flops=model_flops, hardware_flops=hardware_flops, chip=chip)
    compiler = {p: importlib.metadata.version(p) for p in ("jax", "libtpu", "maxtext")}
    print("MAXTEXT_JSON " + json.dumps({"bytes_per_chip": {**b, "total": total}, "compile_s": seen["compile_s"],
                                        "prediction": pred, "compiler": compiler}))
""")


def maxtext_python(arg: str | None) -> tuple[str | None, str]:
    """(interpreter with the maxtext package, or None, and why)."""
    if arg:
        return arg, "--maxtext-python"
    if importlib.util.find_spec("maxtext") is not None:
        return sys.executable, "this interpreter"
    return None, ("the maxtext package is not importable here (it installs with Python 3.12: pip install "
                  "'maxtext[tpu]'); pass --maxtext-python to use another interpreter")


def run_maxtext(python: str, topology: str, shapes: dict, per_device_batch: int, seq: int, remat: str,
                model_flops: float, hardware_flops: float, timeout: float, model_name: str | None,
                hlo_out: str | None = None) -> dict:
    if topology not in MAXTEXT_TOPOLOGY:
        raise ValueError(f"no MaxText name for topology {topology!r}; known: {', '.join(MAXTEXT_TOPOLOGY)}")
    argv = ["train_compile", str(_maxtext_base(python)), f"compile_topology={MAXTEXT_TOPOLOGY[topology]}",
            "compile_topology_num_slices=1", f"per_device_batch_size={per_device_batch}",
            f"max_target_length={seq}", f"remat_policy={remat}", "dataset_type=synthetic", "run_name=bench",
            "base_output_directory=/tmp/jaxperf_bench_maxtext", "enable_checkpointing=false"]
    if model_name:
        argv.append(f"model_name={model_name}")
    else:
        argv += [f"base_emb_dim={shapes['d_model']}", f"base_num_decoder_layers={shapes['n_layers']}",
                 f"base_num_query_heads={shapes['n_heads']}", f"base_num_kv_heads={shapes['n_kv_heads']}",
                 f"base_mlp_dim={shapes['mlp_dim']}", f"vocab_size={shapes['vocab_size']}",
                 f"head_dim={shapes['d_model'] // shapes['n_heads']}", "logits_via_embedding=false",
                 f"rope_max_timescale={int(shapes['rope_theta'])}"]
        if shapes.get("n_experts"):
            argv += ["decoder_block=mixtral", f"num_experts={shapes['n_experts']}",
                     f"num_experts_per_tok={shapes['experts_per_token']}", f"base_moe_mlp_dim={shapes['mlp_dim']}"]
        else:
            argv.append("decoder_block=llama2")
    env = _env()
    env.pop("XLA_FLAGS", None)
    out = subprocess.run([python, "-c", _MAXTEXT_DRIVER, json.dumps(argv), str(model_flops), str(hardware_flops),
                          hlo_out or ""],
                         capture_output=True, text=True, env=env, timeout=timeout)
    line = next((x for x in out.stdout.splitlines() if x.startswith("MAXTEXT_JSON ")), None)
    if line is None:
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"MaxText train_compile failed (exit {out.returncode}): {tail}")
    return json.loads(line.removeprefix("MAXTEXT_JSON "))


def _maxtext_base(python: str) -> str:
    out = subprocess.run([python, "-c", "import maxtext, os; print(os.path.dirname(maxtext.__file__))"],
                         capture_output=True, text=True, timeout=120)
    return str(Path(out.stdout.strip()) / "configs" / "base.yml")


def _hlo_path(folder: str | None, name: str) -> str | None:
    if not folder:
        return None
    Path(folder).mkdir(parents=True, exist_ok=True)
    return str(Path(folder) / (name.replace("/", "_").replace("+", "_") + ".hlo.txt"))


def _fields(r: dict, side: str, **extra) -> dict:
    p = r["prediction"]
    b = r["bytes_per_chip"]
    return {"side": side, "bytes_per_chip": b, "gb_per_chip": b["total"] / 1e9, "temp_gb": b["temp"] / 1e9,
            "compile_s": r["compile_s"], "predicted_step_s": p.get("step_s"), "predicted_mfu": p.get("mfu"),
            "predicted_step_s_no_overlap": p.get("step_s_no_overlap"),
            "predicted_mfu_no_overlap": p.get("mfu_no_overlap"), "bound_by": p.get("bound_by"),
            "compute_s": p.get("compute_s"), "hbm_s": p.get("hbm_s"), "collective_s": p.get("collective_s"),
            "hbm_bytes": p["hbm_bytes"], "collective_wire_bytes": p["collective_wire_bytes"],
            "collectives": p["collectives"], "unknown_trip_counts": p["unknown_trip_counts"], **extra}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=list(MODELS), default="llama3.1-8b")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model on v5p:2x2x1 (4 chips); with an MoE "
                                                        "--model, its experts and top-k")
    ap.add_argument("--topology", default=None, help="default v5p:2x4x4, 32 chips (MaxText calls it v5p-64: its "
                                                     "names count TensorCores); --tiny: v5p:2x2x1")
    ap.add_argument("--per-device-batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=None, help="default the model's: 8192 for llama3.1-8b, 4096 for "
                                                          "mixtral-8x7b (--tiny: 1024)")
    ap.add_argument("--remat", default="full")
    ap.add_argument("--layers", type=int, default=None, help="override the number of layers")
    ap.add_argument("--maxtext-python", default=None, help="an interpreter with the maxtext package")
    ap.add_argument("--no-maxtext", action="store_true")
    ap.add_argument("--no-jaxperf", action="store_true", help="compile only the MaxText side")
    ap.add_argument("--timeout", type=float, default=7200.0, help="seconds per compile")
    ap.add_argument("--hlo-dir", default=None, help="write each compiled program's HLO text into this folder")
    a = ap.parse_args(argv)

    from jaxperf.config import get_config
    from jaxperf.perf.flops import flops_per_token

    model_shapes, model_overrides, maxtext_name, model_seq = MODELS[a.model]
    moe = {k: model_shapes[k] for k in ("n_experts", "experts_per_token") if k in model_shapes}
    shapes = {**TINY, **moe} if a.tiny else dict(model_shapes)
    if a.layers:
        shapes["n_layers"] = a.layers
    topology = a.topology or ("v5p:2x2x1" if a.tiny else "v5p:2x4x4")
    chips = 1
    for d in topology.split(":")[1].split("x"):
        chips *= int(d)
    seq = a.seq or (1024 if a.tiny else model_seq)
    batch = a.per_device_batch * chips
    base = jaxperf_overrides(shapes, batch, seq, a.remat) + model_overrides
    label = ("tiny-mixtral" if moe else "tiny-llama") if a.tiny else a.model
    case = {"model": label, "shapes": shapes, "topology": topology, "chips": chips, "batch": batch, "seq_len": seq,
            "remat": a.remat, "fsdp": chips}
    records = []

    have_libtpu = _libtpu_dir() is not None
    variants = {"jaxperf/default": [], "jaxperf/pallas+chunked": ["model.attention_impl=pallas",
                                                                  "model.loss_impl=chunked"]}
    if moe:  # the experts split over as many chips as divide both (fsdp takes the rest)
        ep = math.gcd(moe["n_experts"], chips)
        variants[f"jaxperf/pallas+chunked+expert{ep}"] = [*variants["jaxperf/pallas+chunked"], f"parallel.expert={ep}"]
    flops = None
    for name, extra in ({} if a.no_jaxperf else variants).items():
        if not have_libtpu:
            records.append(emit(record("tpu_compile", name, None, "GB/chip", skipped="libtpu is not installed "
                                       "(pip install 'jax[tpu]', or set JAXPERF_LIBTPU_PATH)", **case)))
            continue
        try:
            r = run_jaxperf(topology, base + extra, a.timeout, _hlo_path(a.hlo_dir, name))
        except Exception as e:
            records.append(emit(record("tpu_compile", name, None, "GB/chip", error=f"{type(e).__name__}: {e}",
                                       **case)))
            continue
        flops = (r["model_flops_per_chip"], r["flops_per_chip"])
        records.append(emit(record("tpu_compile", name, r["bytes_per_chip"]["total"] / 1e9, "GB/chip",
                                   **_fields(r, "jaxperf", overrides=extra, device_kind=r["device_kind"],
                                             mesh=r.get("mesh"), compiler=_jaxperf_compiler()), **case)))

    if flops is None:  # the FLOP count does not need a compile
        cfg = get_config("llama-1b", base)
        flops = (flops_per_token(cfg.model, seq) * batch * seq / chips,
                 flops_per_token(cfg.model, seq, hardware=True) * batch * seq / chips)
    python, why = (None, "--no-maxtext") if a.no_maxtext else maxtext_python(a.maxtext_python)
    model_name = None if (a.tiny or a.layers) else maxtext_name
    if python is None:
        records.append(emit(record("tpu_compile", "maxtext", None, "GB/chip", skipped=why, **case)))
    else:
        try:
            r = run_maxtext(python, topology, shapes, a.per_device_batch, seq, a.remat, *flops, a.timeout,
                            model_name, _hlo_path(a.hlo_dir, "maxtext"))
            records.append(emit(record("tpu_compile", "maxtext", r["bytes_per_chip"]["total"] / 1e9, "GB/chip",
                                       **_fields(r, "maxtext", interpreter=why, model_name=model_name,
                                                 compiler=r.get("compiler")), **case)))
        except Exception as e:
            records.append(emit(record("tpu_compile", "maxtext", None, "GB/chip",
                                       error=f"{type(e).__name__}: {e}", **case)))
    by = {r["name"]: r for r in records}
    mt, jd = by.get("maxtext", {}), by.get("jaxperf/default", {})
    if mt.get("value") and jd.get("value"):
        records.append(emit(record("tpu_compile", "jaxperf_default_vs_maxtext_bytes", jd["value"] / mt["value"],
                                   "ratio", target=0.9, meets_target=jd["value"] <= 0.9 * mt["value"], **case)))
    return records


if __name__ == "__main__":
    main(sys.argv[1:])
