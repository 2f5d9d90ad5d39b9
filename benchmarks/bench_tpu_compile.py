"""How much memory and how much time per step does a TPU slice need for the same model, compiled by jaxperf and by
MaxText? Bytes per chip, compile time and predicted step time side by side, from the real TPU compiler on this host.

    python benchmarks/bench_tpu_compile.py                   # Llama-3.1-8B, 32 chips, batch 32 x 8192, remat full
    python benchmarks/bench_tpu_compile.py --model mixtral-8x7b   # Mixtral-8x7B shapes, 32 chips, batch 32 x 4096
    python benchmarks/bench_tpu_compile.py --tiny            # a 2-layer model on 4 chips (minutes on CPU)
    python benchmarks/bench_tpu_compile.py --maxtext-python /path/to/venv/bin/python
    python benchmarks/bench_tpu_compile.py --matrix --list   # the comparison matrix's cases, nothing compiled
    python benchmarks/bench_tpu_compile.py --matrix --models llama2-7b --topologies v5p-32 --rows 2 --seqs 4096
                                                             # one case of it, appended to benchmarks/results/tpu.jsonl

Each compile runs in a subprocess of its own (`JAX_PLATFORMS=cpu`; libtpu from the environment or from
`JAXPERF_LIBTPU_PATH`), one after the other. jaxperf is compiled twice: with its default settings and with Pallas
flash attention plus the chunked loss; an MoE model a third time, the latter with expert parallelism. MaxText
(`maxtext.trainers.pre_train.train_compile`, which installs with Python 3.12) compiles the same model, topology, batch
and remat policy when its package is importable by `--maxtext-python` (default: this interpreter); otherwise its
record says why it was skipped. Both sides' step times come from jaxperf.perf.predict applied to each compiled
program, with the same FLOP count (jaxperf.perf.flops for the shared shapes), so the comparison is of the programs,
not of two FLOP formulas. Each record names the jax and libtpu it compiled with (`compiler`): MaxText's interpreter
imports its own libtpu unless its PYTHONPATH names another.

`--matrix` compares every dense Llama-family model MaxText ships up to 13B (MATRIX_MODELS) on v5p, v6e and v5e slices
of 8 to 64 chips, at 1, 2 and 4 rows per chip, 2048 to 8192 tokens, with remat full and MaxText's default
remat_policy (read from its base.yml; "full" in maxtext 0.2.5, so the two are one case). `--models`, `--topologies`,
`--rows`, `--seqs`, `--remats` and `--limit` take a slice; `--list` prints the cases without compiling. Each case
compiles jaxperf's default settings, then MaxText, and appends one record (name "matrix_case") to `--out`: bytes per
chip of both sides and jaxperf's estimate, both predicted step times, compile times, both sides' jax and libtpu, and
per side a status, "ok", "does_not_fit" (the compiler ran out of HBM, or the program is larger than the chip's HBM),
"error" or "skipped". A MaxText remat_policy is compiled by jaxperf with the model.remat of MAXTEXT_REMAT, named in
the record (`remat_stand_in`).
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from jaxperf.benchmarks._common import emit, record, strict_json
from jaxperf.models.layers import REMAT_SAVES

LIBTPU_PATH = os.environ.get("JAXPERF_LIBTPU_PATH", "/tmp/libtpu_pkg")
REPO = Path(__file__).resolve().parents[1]

# Dense Llama-family shapes as MaxText's configs/models/<model_name>.yml give them (maxtext 0.2.5): head_dim 128
# (d_model / n_heads), SwiGLU (mlp_activations silu, linear), RMSNorm eps 1e-5, untied embeddings
# (logits_via_embedding false), full causal attention. rope_theta is MaxText's rope_max_timescale (base.yml: 10_000
# unless the model sets it).
LLAMA2_7B = {"d_model": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 32, "mlp_dim": 11008, "vocab_size": 32000,
             "rope_theta": 10000.0}
LLAMA2_13B = {"d_model": 5120, "n_layers": 40, "n_heads": 40, "n_kv_heads": 40, "mlp_dim": 13824, "vocab_size": 32000,
              "rope_theta": 10000.0}
# Llama-3-8B and Llama-3.1-8B: 32 layers, d_model 4096, 32 query / 8 KV heads, SwiGLU 14336, vocab 128256.
LLAMA31_8B = {"d_model": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "mlp_dim": 14336,
              "vocab_size": 128256, "rope_theta": 500000.0}
# Mistral-7B (MaxText's decoder_block "mistral": no sliding window): Llama-3-8B's layers, vocab 32000, rope 1e6.
MISTRAL_7B = {"d_model": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "mlp_dim": 14336, "vocab_size": 32000,
              "rope_theta": 1000000.0}
# Mixtral-8x7B: Mistral-7B's attention and widths, each MLP 8 SwiGLU experts of width 14336 (top-2).
MIXTRAL_8X7B = {**MISTRAL_7B, "n_experts": 8, "experts_per_token": 2}
TINY = {"d_model": 512, "n_layers": 2, "n_heads": 8, "n_kv_heads": 2, "mlp_dim": 1536, "vocab_size": 32000,
        "rope_theta": 500000.0}
# --model -> (shapes, jaxperf overrides beyond the shapes, MaxText's model_name, default sequence length). Mixtral
# routes dropless on both sides (jaxperf: capacity_factor None, grouped matmuls; MaxText: sparse_matmul with megablox,
# capacity_factor -1) with softmax top-2 and the router losses of jaxperf's mixtral-8x7b preset (MaxText's
# load_balance_loss_weight stays at its default, 0).
MODELS = {
    "llama2-7b": (LLAMA2_7B, [], "llama2-7b", 4096),
    "llama2-13b": (LLAMA2_13B, [], "llama2-13b", 4096),
    "llama3-8b": (LLAMA31_8B, [], "llama3-8b", 8192),
    "llama3.1-8b": (LLAMA31_8B, [], "llama3.1-8b", 8192),
    "mistral-7b": (MISTRAL_7B, [], "mistral-7b", 8192),
    "mixtral-8x7b": (MIXTRAL_8X7B, ["model.router=softmax", "model.router_aux_loss_coef=0.02",
                                    "model.router_z_loss_coef=0.0", "model.norm_eps=1e-5"], "mixtral-8x7b", 4096),
}
# jaxperf topology name -> MaxText's compile_topology (maxtext/utils/accelerator_to_spec_map.py). MaxText's v5p names
# count TensorCores, two per chip (v5p-32 is 16 chips, jaxperf's v5p:2x2x4); its v6e and v5e names count chips.
MAXTEXT_TOPOLOGY = {"v5p:2x2x1": "v5p-8", "v5p:2x2x2": "v5p-16", "v5p:2x2x4": "v5p-32", "v5p:2x4x4": "v5p-64",
                    "v5p:4x4x4": "v5p-128",
                    "v6e:2x2": "v6e-4", "v6e:2x4": "v6e-8", "v6e:4x4": "v6e-16", "v6e:4x8": "v6e-32",
                    "v6e:8x8": "v6e-64",
                    "v5e:2x2": "v5e-4", "v5e:2x4": "v5e-8", "v5e:4x4": "v5e-16", "v5e:4x8": "v5e-32",
                    "v5e:8x8": "v5e-64"}

# --matrix: every dense Llama-family model MaxText ships up to 13B, on v5p, v6e and v5e slices of 8 to 64 chips.
MATRIX_MODELS = ("llama2-7b", "llama2-13b", "llama3-8b", "llama3.1-8b", "mistral-7b")
MATRIX_TOPOLOGIES = ("v5p:2x2x2", "v5p:2x2x4", "v5p:2x4x4", "v5p:4x4x4",
                     "v6e:2x4", "v6e:4x4", "v6e:4x8", "v6e:8x8",
                     "v5e:2x4", "v5e:4x4", "v5e:4x8", "v5e:8x8")
MATRIX_ROWS = (1, 2, 4)
MATRIX_SEQS = (2048, 4096, 8192)
MATRIX_REMATS = ("full", "default")  # "default": MaxText's remat_policy as its base.yml sets it
# MaxText remat_policy -> the jaxperf model.remat compiled for it: the same name, since jaxperf's layers tag their
# activations with MaxText's names (jaxperf.models.layers.REMAT_SAVES); "custom" needs its per-tensor settings.
MAXTEXT_REMAT = {name: name for name in ("none", *REMAT_SAVES) if name != "save_attn_proj"}
MAXTEXT_DEFAULT_REMAT = "full"  # base.yml `remat_policy: 'full'` in maxtext 0.2.5; read from base.yml when it is here
DEFAULT_OUT = REPO / "benchmarks" / "results" / "tpu.jsonl"
# What the TPU compiler says when a program needs more HBM than the chip has (its RESOURCE_EXHAUSTED error).
OOM_MARKERS = ("resource_exhausted", "ran out of memory", "exceeded hbm capacity")


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


class CompileFailed(RuntimeError):
    """A compile subprocess that gave no result; `oom` when its output says the program needs more memory than the
    chip has (the case does not fit, rather than the benchmark being broken)."""

    def __init__(self, message: str, oom: bool = False):
        super().__init__(message)
        self.oom = oom


def _failure(side: str, out: subprocess.CompletedProcess) -> CompileFailed:
    """The error of a failed compile: the first line that names an out-of-memory if any (the real cause sits above
    the traceback's last line), else the last line of stderr."""
    lines = [x.strip() for x in (out.stderr or "").splitlines() if x.strip()]
    oom = next((x for x in lines if any(m in x.lower() for m in OOM_MARKERS)), None)
    tail = oom or (lines[-1] if lines else "no output")
    return CompileFailed(f"{side} failed (exit {out.returncode}): {tail[:2000]}", oom=oom is not None)


def run_jaxperf(topology: str, overrides: list[str], timeout: float, hlo_out: str | None = None) -> dict:
    env = _env(_libtpu_dir())
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, "-m", "jaxperf.cli", "compile", "--topology", topology, "--json", *overrides]
    if hlo_out:
        cmd += ["--hlo-out", hlo_out]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if out.returncode not in (0, 1) or not out.stdout.strip():
        raise _failure("jaxperf compile", out)
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
                                        "prediction": pred, "compiler": compiler,
                                        "device_kind": chip.name if chip else None,
                                        "hbm_bytes": chip.hbm_bytes if chip else None}))
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
                hlo_out: str | None = None, compiler_options: tuple[str, ...] = ()) -> dict:
    """MaxText's train_compile of the same shapes in `python`; `compiler_options` ("name=value") reach its compile
    through LIBTPU_INIT_ARGS, after any the environment sets."""
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
    if compiler_options:
        env["LIBTPU_INIT_ARGS"] = " ".join([env.get("LIBTPU_INIT_ARGS", ""), *(f"--{o}" for o in compiler_options)]
                                           ).strip()
    out = subprocess.run([python, "-c", _MAXTEXT_DRIVER, json.dumps(argv), str(model_flops), str(hardware_flops),
                          hlo_out or ""],
                         capture_output=True, text=True, env=env, timeout=timeout)
    line = next((x for x in out.stdout.splitlines() if x.startswith("MAXTEXT_JSON ")), None)
    if line is None:
        raise _failure("MaxText train_compile", out)
    return json.loads(line.removeprefix("MAXTEXT_JSON "))


@functools.lru_cache(maxsize=None)
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


def _chips(topology: str) -> int:
    return math.prod(int(d) for d in topology.split(":")[1].split("x"))


def maxtext_default_remat(base_yml: str | None = None) -> str:
    """MaxText's default `remat_policy`: read from its base.yml when that file is given and readable, else the value
    maxtext 0.2.5 ships (MAXTEXT_DEFAULT_REMAT)."""
    try:
        text = Path(base_yml).read_text() if base_yml else ""
    except OSError:
        text = ""
    m = re.search(r"^remat_policy:\s*['\"]?([A-Za-z0-9_]+)", text, re.M)
    return m.group(1) if m else MAXTEXT_DEFAULT_REMAT


def _split(value: str | None, cast=str) -> list | None:
    return None if value is None else [cast(v.strip()) for v in value.split(",") if v.strip()]


def select_topologies(names: list[str] | None) -> list[str]:
    """The matrix's topologies that `names` picks: a jaxperf name (v5p:2x2x4), MaxText's (v5p-32) or a chip family
    (v6e); any jaxperf name MAXTEXT_TOPOLOGY knows may be named even outside the matrix's default list."""
    if not names:
        return list(MATRIX_TOPOLOGIES)
    by_maxtext = {v: k for k, v in MAXTEXT_TOPOLOGY.items()}
    out = []
    for n in names:
        if n in MAXTEXT_TOPOLOGY:
            picked = [n]
        elif n in by_maxtext:
            picked = [by_maxtext[n]]
        else:
            picked = [t for t in MATRIX_TOPOLOGIES if t.split(":")[0] == n]
        if not picked:
            raise SystemExit(f"bench_tpu_compile: unknown topology {n!r}; give a jaxperf name "
                             f"({', '.join(MAXTEXT_TOPOLOGY)}), MaxText's name (v5p-32, v6e-16, v5e-16) or a family "
                             "(v5p, v6e, v5e)")
        out += [t for t in picked if t not in out]
    return out


def matrix_cases(models: list[str] | None = None, topologies: list[str] | None = None, rows: list[int] | None = None,
                 seqs: list[int] | None = None, remats: list[str] | None = None,
                 default_remat: str = MAXTEXT_DEFAULT_REMAT, limit: int | None = None) -> list[dict]:
    """The cases of the comparison matrix, model x topology x rows per chip x sequence x remat, in that nesting order
    (the first `limit` of them). A remat is a MaxText remat_policy name or "default" (MaxText's `default_remat`); each
    case names the jaxperf policy that stands in for it, and a default that equals another remat of the list is one
    case (marked `remat_is_maxtext_default`)."""
    models = models or list(MATRIX_MODELS)
    for m in models:
        if m not in MODELS:
            raise SystemExit(f"bench_tpu_compile: unknown model {m!r}; choose from {', '.join(MODELS)}")
    policies = []
    for r in remats or list(MATRIX_REMATS):
        name = default_remat if r == "default" else r
        if name not in MAXTEXT_REMAT:
            raise SystemExit(f"bench_tpu_compile: no jaxperf stand-in for MaxText remat_policy {name!r}; known: "
                             f"{', '.join(MAXTEXT_REMAT)} and default (MaxText's: {default_remat})")
        if name not in policies:
            policies.append(name)
    cases = []
    for model in models:
        for topology in select_topologies(topologies):
            for r in rows or list(MATRIX_ROWS):
                for seq in seqs or list(MATRIX_SEQS):
                    for remat in policies:
                        chips = _chips(topology)
                        cases.append({
                            "model": model, "maxtext_model_name": MODELS[model][2], "topology": topology,
                            "maxtext_topology": MAXTEXT_TOPOLOGY[topology], "chips": chips, "rows_per_chip": r,
                            "batch": r * chips, "seq": seq, "remat": remat, "maxtext_remat": remat,
                            "jaxperf_remat": MAXTEXT_REMAT[remat], "remat_is_maxtext_default": remat == default_remat,
                            "remat_stand_in": f"jaxperf model.remat={MAXTEXT_REMAT[remat]} for MaxText "
                                              f"remat_policy={remat}"})
    return cases[:limit] if limit is not None else cases


def case_key(case: dict) -> tuple:
    """A case's identity for --resume: its shape and the compiler options both sides compiled it with (given with
    --compiler-option, and whatever LIBTPU_INIT_ARGS set)."""
    options = json.dumps(case.get("compiler_options") or {}, sort_keys=True)
    return (*(case.get(k) for k in ("model", "topology", "rows_per_chip", "seq", "remat")), options,
            case.get("libtpu_init_args") or None)


def _side(run, *args) -> tuple[dict | None, dict]:
    """Run one side's compile: (its result or None, the record's fields for the side: status ok / does_not_fit /
    error, with the wall time of the subprocess)."""
    t0 = time.perf_counter()
    try:
        r = run(*args)
    except CompileFailed as e:
        return None, {"status": "does_not_fit" if e.oom else "error", "fits": False if e.oom else None,
                      "error": str(e), "wall_s": time.perf_counter() - t0}
    except Exception as e:  # a timeout, a broken interpreter: an error of this case, not of the run
        return None, {"status": "error", "fits": None, "error": f"{type(e).__name__}: {e}",
                      "wall_s": time.perf_counter() - t0}
    total, hbm = r["bytes_per_chip"]["total"], r.get("hbm_bytes")
    fits = r.get("fits", total <= hbm if hbm else None)
    return r, {"status": "does_not_fit" if fits is False else "ok", "fits": fits, "wall_s": time.perf_counter() - t0}


def _estimate(overrides: list[str], topology: str) -> int | None:
    """jaxperf's own estimate of bytes per chip (jaxperf.perf.memory) when no compile reported it."""
    try:
        from jaxperf.config import get_config, mesh_shape
        from jaxperf.perf.memory import estimate
        cfg = get_config(None, overrides)
        est = estimate(cfg, mesh_shape(cfg.parallel, _chips(topology)), platform="tpu")
        return int(est.total) if est else None
    except Exception:
        return None


# The parts of a step-time prediction each side's record keeps beside step_s (jaxperf.perf.predict): a compute-bound
# step is the same FLOP count at the same peak on both sides, so the programs differ in these.
PREDICTION_PARTS = ("step_s_no_overlap", "compute_s", "hbm_s", "collective_s", "collective_wire_bytes")


def run_case(case: dict, python: str | None, why: str, timeout: float, hlo_dir: str | None = None,
             no_jaxperf: bool = False, maxtext_record: dict | None = None) -> dict:
    """Compile one matrix case with jaxperf (default settings) and with MaxText, one after the other; one record.
    The case's `compiler_options` ({name: value}) go to both: jaxperf's `compiler_options`, MaxText's
    LIBTPU_INIT_ARGS. With `maxtext_record` (an earlier record of the same case, --maxtext-from) the MaxText side is
    that record's, not compiled again, and the record says when it was compiled (`maxtext_compiled`)."""
    from jaxperf.config import get_config
    from jaxperf.perf.flops import flops_per_token

    shapes, model_overrides, model_name, _ = MODELS[case["model"]]
    seq, batch, topology = case["seq"], case["batch"], case["topology"]
    overrides = jaxperf_overrides(shapes, batch, seq, case["jaxperf_remat"]) + model_overrides
    from jaxperf.config.validate import compiler_option_entries
    options = tuple(compiler_option_entries(case.get("compiler_options")))
    if options:
        overrides.append(f"compiler_options={','.join(options)}")
    tag = f"{case['model']}_{topology.replace(':', '-')}_r{case['rows_per_chip']}_s{seq}_{case['remat']}"
    rec = dict(case)
    jp = None
    if no_jaxperf:
        jside = {"status": "skipped", "fits": None, "error": "--no-jaxperf", "wall_s": 0.0}
    elif _libtpu_dir() is None:
        jside = {"status": "skipped", "fits": None, "wall_s": 0.0,
                 "error": "libtpu is not installed (pip install 'jax[tpu]', or set JAXPERF_LIBTPU_PATH)"}
    else:
        jp, jside = _side(run_jaxperf, topology, overrides, timeout, _hlo_path(hlo_dir, f"jaxperf_{tag}"))
    jc = _jaxperf_compiler()
    rec.update({f"jaxperf_{k}": v for k, v in jside.items()})
    rec.update({"jaxperf_bytes": jp["bytes_per_chip"]["total"] if jp else None,
                "jaxperf_bytes_parts": jp["bytes_per_chip"] if jp else None,
                "estimate_bytes": jp.get("estimated_bytes_per_chip") if jp else _estimate(overrides, topology),
                "estimate_parts": jp.get("estimated_parts") if jp else None,
                "jaxperf_step_s": jp.get("predicted_step_s") if jp else None,
                "jaxperf_mfu": jp.get("predicted_mfu") if jp else None,
                "jaxperf_bound_by": jp["prediction"].get("bound_by") if jp else None,
                **{f"jaxperf_{k}": jp["prediction"].get(k) if jp else None for k in PREDICTION_PARTS},
                "jaxperf_compile_s": jp.get("compile_s") if jp else None,
                "jaxperf_implementations": jp.get("implementations") if jp else None,
                "jaxperf_settled": jp.get("settled") if jp else None,
                "jaxperf_mesh": jp.get("mesh") if jp else None,
                "device_kind": jp.get("device_kind") if jp else None,
                "hbm_bytes": jp.get("hbm_bytes") if jp else None})
    if jp:
        flops = (jp["model_flops_per_chip"], jp["flops_per_chip"])
    else:
        cfg = get_config(None, overrides)
        flops = (flops_per_token(cfg.model, seq) * batch * seq / case["chips"],
                 flops_per_token(cfg.model, seq, hardware=True) * batch * seq / case["chips"])
    mt = None
    if maxtext_record is not None:
        rec.update({k: v for k, v in maxtext_record.items() if k.startswith("maxtext_") and k != "maxtext_compiled"})
        rec.update({"maxtext_compiled": maxtext_record.get("maxtext_compiled") or maxtext_record.get("date"),
                    "model_flops_per_chip": flops[0], "hardware_flops_per_chip": flops[1],
                    "jax": {"jaxperf": jc["jax"], "maxtext": (maxtext_record.get("jax") or {}).get("maxtext")},
                    "libtpu": {"jaxperf": jc["libtpu"],
                               "maxtext": (maxtext_record.get("libtpu") or {}).get("maxtext")},
                    "jaxperf_overrides": overrides})
        if rec["hbm_bytes"] is None:
            rec["hbm_bytes"] = maxtext_record.get("hbm_bytes")
    elif python is None:
        mside = {"status": "skipped", "fits": None, "error": why, "wall_s": 0.0}
    else:
        mt, mside = _side(run_maxtext, python, topology, shapes, case["rows_per_chip"], seq, case["maxtext_remat"],
                          *flops, timeout, model_name, _hlo_path(hlo_dir, f"maxtext_{tag}"), options)
    if maxtext_record is None:
        _maxtext_fields(rec, mt, mside, why, flops, jc, overrides)
    if rec["hbm_bytes"] is None and mt:
        rec["hbm_bytes"] = mt.get("hbm_bytes")
    both = rec["jaxperf_bytes"] and rec["maxtext_bytes"]
    rec["bytes_ratio"] = rec["jaxperf_bytes"] / rec["maxtext_bytes"] if both else None
    steps = rec["jaxperf_step_s"] and rec["maxtext_step_s"]
    rec["step_ratio"] = rec["jaxperf_step_s"] / rec["maxtext_step_s"] if steps else None
    rec["same_compiler"] = (rec["jax"]["jaxperf"] == rec["jax"]["maxtext"]
                            and rec["libtpu"]["jaxperf"] == rec["libtpu"]["maxtext"]) \
        if (mt or (maxtext_record and rec["jax"]["maxtext"])) else None
    return record("tpu_compile", "matrix_case", rec["bytes_ratio"], "ratio", **rec)


def _maxtext_fields(rec: dict, mt: dict | None, mside: dict, why: str, flops: tuple, jc: dict, overrides: list):
    """A record's MaxText side from its compile `mt` (None when skipped or failed, `mside` says why)."""
    rec.update({f"maxtext_{k}": v for k, v in mside.items()})
    mcomp = (mt or {}).get("compiler") or {}
    rec.update({"maxtext_bytes": mt["bytes_per_chip"]["total"] if mt else None,
                "maxtext_bytes_parts": mt["bytes_per_chip"] if mt else None,
                "maxtext_step_s": mt["prediction"].get("step_s") if mt else None,
                "maxtext_mfu": mt["prediction"].get("mfu") if mt else None,
                "maxtext_bound_by": mt["prediction"].get("bound_by") if mt else None,
                **{f"maxtext_{k}": mt["prediction"].get(k) if mt else None for k in PREDICTION_PARTS},
                "maxtext_compile_s": mt.get("compile_s") if mt else None,
                "maxtext_interpreter": why, "model_flops_per_chip": flops[0], "hardware_flops_per_chip": flops[1],
                "jax": {"jaxperf": jc["jax"], "maxtext": mcomp.get("jax")},
                "libtpu": {"jaxperf": jc["libtpu"], "maxtext": mcomp.get("libtpu")},
                "maxtext_version": mcomp.get("maxtext"), "jaxperf_overrides": overrides})


def _matrix_records(path: Path) -> list[dict]:
    """The matrix-case records of a JSON lines file (lines that do not parse are skipped)."""
    records = []
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if isinstance(r, dict) and r.get("name") == "matrix_case":
            records.append(r)
    return records


def run_matrix(a) -> list[dict]:
    """--matrix: enumerate the cases the filters pick; --list prints them; otherwise compile each (jaxperf, then
    MaxText, one compile at a time) and append one record per case to --out as soon as it is done."""
    python, why = (None, "--no-maxtext") if a.no_maxtext else maxtext_python(a.maxtext_python)
    base_yml = _maxtext_base(python) if (python and not a.list) else None
    default_remat = maxtext_default_remat(base_yml)
    cases = matrix_cases(_split(a.models), _split(a.topologies), _split(a.rows, int), _split(a.seqs, int),
                         _split(a.remats), default_remat)
    from jaxperf.config import ConfigError
    from jaxperf.config.validate import compiler_options
    try:
        options = compiler_options(a.compiler_option, "tpu")
    except ConfigError as e:
        raise SystemExit(f"bench_tpu_compile: --compiler-option: {e}") from None
    for c in cases:  # what reaches both sides' compiler besides the shapes: the options, and the environment's
        c["compiler_options"] = options
        c["libtpu_init_args"] = os.environ.get("LIBTPU_INIT_ARGS") or None
    out = Path(a.out) if a.out else DEFAULT_OUT
    finished = ("ok", "does_not_fit")
    if a.resume and out.is_file():
        done = {case_key(r) for r in _matrix_records(out)
                if r.get("jaxperf_status") in finished and r.get("maxtext_status") in finished}
        cases = [c for c in cases if case_key(c) not in done]
    earlier = {}  # --maxtext-from: the last record of each case whose MaxText side was compiled (or did not fit)
    if a.maxtext_from:
        if not Path(a.maxtext_from).is_file():
            raise SystemExit(f"bench_tpu_compile: --maxtext-from {a.maxtext_from}: no such file")
        earlier = {case_key(r): r for r in _matrix_records(Path(a.maxtext_from))
                   if r.get("maxtext_status") in finished}
    if a.limit is not None:
        cases = cases[:a.limit]
    if a.list:
        for c in cases:
            print(json.dumps(c))
        return cases
    records = []
    out.parent.mkdir(parents=True, exist_ok=True)
    for i, case in enumerate(cases):
        print(f"bench_tpu_compile: case {i + 1}/{len(cases)}: {case['model']} {case['topology']} "
              f"({case['maxtext_topology']}) rows {case['rows_per_chip']} seq {case['seq']} remat {case['remat']}",
              file=sys.stderr, flush=True)
        rec = emit(run_case(case, python, why, a.timeout, a.hlo_dir, a.no_jaxperf, earlier.get(case_key(case))))
        with out.open("a") as f:
            f.write(json.dumps(strict_json(rec)) + "\n")
        records.append(rec)
    return records


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=list(MODELS), default="llama3.1-8b")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model on v5p:2x2x1 (4 chips); with an MoE "
                                                        "--model, its experts and top-k")
    ap.add_argument("--topology", default=None, help="default v5p:2x4x4, 32 chips (MaxText calls it v5p-64: its "
                                                     "names count TensorCores); --tiny: v5p:2x2x1")
    ap.add_argument("--per-device-batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=None, help="default the model's (MODELS): 8192 for llama3.1-8b, "
                                                          "4096 for mixtral-8x7b (--tiny: 1024)")
    ap.add_argument("--remat", default="full")
    ap.add_argument("--layers", type=int, default=None, help="override the number of layers")
    ap.add_argument("--maxtext-python", default=None, help="an interpreter with the maxtext package")
    ap.add_argument("--no-maxtext", action="store_true")
    ap.add_argument("--no-jaxperf", action="store_true", help="compile only the MaxText side")
    ap.add_argument("--timeout", type=float, default=7200.0, help="seconds per compile")
    ap.add_argument("--hlo-dir", default=None, help="write each compiled program's HLO text into this folder")
    m = ap.add_argument_group("comparison matrix", "--matrix compiles every case of model x topology x rows per "
                              "chip x sequence x remat that the filters pick (comma-separated lists; default all: "
                              f"models {','.join(MATRIX_MODELS)}; topologies {','.join(MATRIX_TOPOLOGIES)}; rows "
                              f"{','.join(map(str, MATRIX_ROWS))}; seqs {','.join(map(str, MATRIX_SEQS))}; remats "
                              f"{','.join(MATRIX_REMATS)}), one record per case appended to --out")
    m.add_argument("--matrix", action="store_true")
    m.add_argument("--models", default=None)
    m.add_argument("--topologies", default=None, help="jaxperf names (v5p:2x2x4), MaxText names (v5p-32) or "
                                                       "families (v6e)")
    m.add_argument("--rows", default=None, help="rows (sequences) per chip")
    m.add_argument("--seqs", default=None)
    m.add_argument("--remats", default=None, help=f"MaxText remat_policy names ({', '.join(MAXTEXT_REMAT)}) or "
                                                  "default (MaxText's base.yml remat_policy)")
    m.add_argument("--limit", type=int, default=None, help="only the first N cases")
    m.add_argument("--compiler-option", action="append", default=[], metavar="NAME=VALUE",
                   help="an XLA option for both sides' compiles (jaxperf's compiler_options, MaxText's "
                        "LIBTPU_INIT_ARGS), kept in each record; repeat for more")
    m.add_argument("--list", action="store_true", help="print the cases (one JSON line each) without compiling")
    m.add_argument("--resume", action="store_true", help="skip the cases --out already holds with both sides "
                                                         "compiled or out of memory")
    m.add_argument("--maxtext-from", default=None, metavar="JSONL",
                   help="take each case's MaxText side from the last record of the same case and compiler options "
                        "in this file (e.g. benchmarks/results/tpu.jsonl) instead of compiling it again: after a "
                        "change to jaxperf, only its side is compiled; the record keeps the MaxText side's jax, "
                        "libtpu and its compile date (maxtext_compiled); a case is its shape, remat and compiler "
                        "options, so a record made before a change to MODELS' shapes would be taken as it is")
    m.add_argument("--out", default=None, help=f"JSON lines file the records are appended to (default "
                                               f"{DEFAULT_OUT.relative_to(REPO)})")
    a = ap.parse_args(argv)
    if a.matrix:
        return run_matrix(a)
    if a.compiler_option:
        ap.error("--compiler-option applies to --matrix cases")
    if a.list:
        ap.error("--list lists the cases of --matrix")

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
                                             mesh=r.get("mesh"), compiler=_jaxperf_compiler(),
                                             estimate_bytes=r.get("estimated_bytes_per_chip")), **case)))

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
    if a.out:
        with Path(a.out).open("a") as f:
            f.writelines(json.dumps(strict_json(r)) + "\n" for r in records)
    return records


if __name__ == "__main__":
    main(sys.argv[1:])
