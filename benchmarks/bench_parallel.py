"""Step time per parallelism strategy and step flavour on the devices at hand. JSON lines and a PNG bar chart.

    python benchmarks/bench_parallel.py                 # the tiny preset on every visible device
    python benchmarks/bench_parallel.py --tiny          # a smaller model and fewer steps (CI)
    JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/bench_parallel.py --tiny
    python benchmarks/bench_parallel.py --pairs 'jit/*,pmap/dp'   # only the pairs whose names match a glob

Every supported (flavour, strategy) pair is built from the same preset on the same devices: jit with dp, fsdp, tp and
fsdp_tp (tensor = 2 where the heads divide), shard_map with the same four and dp with each layer's gradients reduced
inside the backward (`dp+overlap`), pmap with dp; then the pipeline, context and sequence-parallel axes under jit
(on 4 or more devices, for models whose layers split in two): stage=2 x tensor=2 with 1F1B and GPipe over 8
microbatches, seq=2 (zigzag ring),
tensor=2 with sequence parallelism, and stage=2 x seq=2 x fsdp. Each pipeline record carries its compiled step's
temporary bytes per device (`temp_bytes`), and two `memory/...` records set 1F1B against GPipe at the same
microbatches. Before timing, the first step's
loss of each pair is checked against the jit dp step on the same batch (all start from the same parameters), so a pair
that computes something else is refused, not timed. Value: tokens/s (median over the timed steps, each blocked on),
with the step time and MFU (tokens/s x FLOPs/token over devices x per-device peak) as % of peak. With one device every
pair runs unsplit and the figures say what the flavours cost in overhead alone.
"""

from __future__ import annotations

import argparse
import fnmatch
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

from jaxperf.perf.cpu_host import reexec_with_huge_pages
from jaxperf.benchmarks._common import check_close, emit, make_train_step, peak_flops, record

NAME = "parallel"
OVERLAP = "parallel.overlap_grad_reduce=true"
TAKES_OUT = True  # jaxperf bench passes its --out folder for the PNG


def pairs(n_devices: int, n_heads: int, n_layers: int = 2) -> list[tuple[str, str, str, list[str]]]:
    """(name, flavour, strategy, mesh overrides) for every combination that runs on n devices."""
    tensor = max(t for t in (1, 2, 4, 8) if n_devices % t == 0 and n_heads % t == 0)
    out = []
    for flavour in ("jit", "shard_map"):
        out += [(flavour, "dp", ["data=-1", "fsdp=1"]), (flavour, "fsdp", ["fsdp=-1"]),
                (flavour, "tp", [f"tensor={tensor}", "data=-1", "fsdp=1"])]
        if n_devices % 2 == 0 and n_heads % 2 == 0:
            out.append((flavour, "fsdp_tp", ["tensor=2", "fsdp=-1"]))
    # shard_map dp again, each layer's gradients all-reduced inside the backward pass
    out.append(("shard_map", "dp", ["data=-1", "fsdp=1", OVERLAP]))
    out.append(("pmap", "dp", ["data=-1", "fsdp=1"]))
    named = [(f"{f}/{s}" + ("+overlap" if OVERLAP in m else ""), f, s, m) for f, s, m in out]
    if n_devices % 4 == 0 and n_layers % 2 == 0 and n_heads % 2 == 0:
        # 8 microbatches over 2 stages: 1F1B stashes 2 x 2 stage inputs, GPipe all 8
        pipe = ["stage=2", "microbatches=8", "tensor=2", "data=-1", "fsdp=1"]
        named += [("jit/stage2-1f1b", "jit", "tp", [*pipe, "parallel.schedule=1f1b"]),
                  ("jit/stage2-gpipe", "jit", "tp", [*pipe, "parallel.schedule=gpipe"]),
                  ("jit/seq2", "jit", "dp", ["seq=2", "data=-1", "fsdp=1"]),
                  ("jit/tp+sp", "jit", "tp", ["tensor=2", "data=-1", "fsdp=1", "parallel.sequence_parallel=true"]),
                  ("jit/stage2+seq2+fsdp", "jit", "fsdp", ["stage=2", "seq=2", "fsdp=-1", "microbatches=2"])]
    return named


def plot(records: list[dict], path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    timed = [r for r in records if r.get("unit") == "tokens/s"]
    if not timed:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh([r["name"] for r in timed], [r["value"] for r in timed], color="tab:blue")
    ax.set_xlabel("tokens/s (higher is better)")
    ax.set_title(f"train step by flavour/strategy: {timed[0]['n_devices']} x {timed[0]['device']}")
    ax.invert_yaxis()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--tiny", action="store_true", help="a smaller model and fewer steps")
    p.add_argument("--steps", type=int, default=None, help="timed steps per pair (default 10, 3 with --tiny)")
    p.add_argument("--out", default="bench_results", help="folder for the PNG")
    p.add_argument("--pairs", default=None, help="comma-separated globs of pair names to run (default: all)")
    p.add_argument("overrides", nargs="*", help="config key=value for every pair")
    a = p.parse_args(argv)
    from jaxperf.perf.flops import flops_per_token

    overrides = list(a.overrides)
    if a.tiny:
        overrides = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.max_seq_len=64",
                     "batch_size=16", *overrides]
    steps = a.steps or (3 if a.tiny else 10)
    n = jax.device_count()
    from jaxperf.config import get_config

    base = get_config(a.preset, overrides)
    records, reference, initial = [], None, None
    chosen = a.pairs.split(",") if a.pairs else ["*"]
    for name, flavour, strategy, mesh in pairs(n, base.model.n_heads, base.model.n_layers):
        if not any(fnmatch.fnmatchcase(name, glob) for glob in chosen):
            continue
        try:
            # Every pair starts from the same parameters: the first jit pair's initial state, placed in each pair's
            # shards (no initialisation compiled per pair; a pair whose state is laid out otherwise makes its own).
            step, state, batch, cfg = make_train_step(a.preset, [*overrides, f"parallel.strategy={strategy}", *mesh,
                                                                 f"parallel.flavour={flavour}"], init=initial)
            if initial is None and flavour == "jit":
                initial = jax.device_get(state)  # before the step donates it
            t0 = time.perf_counter()
            state, metrics = step(state, batch)
            loss = float(jax.device_get(metrics["loss"]))
            first_s = time.perf_counter() - t0
            if reference is None:
                reference = loss
            check_close(name, np.float32(loss), np.float32(reference), rtol=1e-4, atol=1e-5)
            temp = None
            if cfg.parallel.stage > 1:  # the pipeline schedule's memory, from the compiled step
                temp = int(step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes)
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                state, metrics = step(state, batch)
                jax.block_until_ready(metrics)
                times.append(time.perf_counter() - t0)
        except Exception as e:  # one pair failing must not hide the others
            records.append(emit(record(NAME, name, None, None, error=f"{type(e).__name__}: {e}")))
            continue
        dt = statistics.median(times)
        tokens = cfg.batch_size * cfg.train_seq_len
        peak, src = peak_flops(cfg.model.dtype)
        fpt = flops_per_token(cfg.model, cfg.train_seq_len)
        mesh_shape = {k: int(v) for k, v in step_mesh(cfg).items()}
        records.append(emit(record(
            NAME, name, tokens / dt, "tokens/s", value_per_s=tokens / dt * fpt, peak_per_s=peak * n,
            step_s=dt, step_s_p10=float(np.percentile(times, 10)), step_s_p90=float(np.percentile(times, 90)),
            first_step_s=first_s, loss=loss, flavour=flavour, strategy=strategy, mesh=mesh_shape,
            batch=cfg.batch_size, seq_len=cfg.train_seq_len, steps=steps, peak_source=src, preset=a.preset,
            tiny=a.tiny, microbatches=cfg.microbatches, temp_bytes=temp)))
    records += memory_records(records)
    png = plot(records, Path(a.out) / "parallel.png")
    if png:
        print(f"wrote {png}", file=sys.stderr)
    return records


def memory_records(records: list[dict]) -> list[dict]:
    """1F1B against GPipe: the compiled step's temporary bytes per device at the same stages and microbatches."""
    by_name = {r["name"]: r for r in records if r.get("temp_bytes")}
    pair = by_name.get("jit/stage2-1f1b"), by_name.get("jit/stage2-gpipe")
    if None in pair:
        return []
    ratio = pair[0]["temp_bytes"] / pair[1]["temp_bytes"]
    return [emit(record(NAME, f"memory/stage2-{r['parallel_schedule']}", float(r["temp_bytes"]), "bytes",
                        microbatches=r["microbatches"], stages=2, ratio_1f1b_to_gpipe=ratio, preset=r["preset"],
                        tiny=r["tiny"]))
            for r in ({**pair[0], "parallel_schedule": "1f1b"}, {**pair[1], "parallel_schedule": "gpipe"})]


def step_mesh(cfg) -> dict[str, int]:
    from jaxperf.parallel.mesh import mesh_shape

    return mesh_shape(cfg.parallel, jax.device_count())


if __name__ == "__main__":
    reexec_with_huge_pages()  # XLA:CPU step buffers on huge pages (jaxperf.perf.cpu_host)
    main()
