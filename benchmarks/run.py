"""`jaxperf bench [names...] [--tiny] [--out DIR]`: run the benchmark scripts, collect their JSON lines, plot, tabulate.

    jaxperf bench                          # every benchmark, full sizes
    jaxperf bench --tiny compiled_vs_eager # one, small shapes (seconds on CPU)
    jaxperf bench train hardware --out /tmp/bench

The scripts sit beside this runner in the repository's benchmarks/ folder, which installs as the package
`jaxperf.benchmarks` (an editable install or a wheel alike): each `bench_<name>.py` has a `main(argv) -> list[dict]`.
They run in this process, one after the other; one that fails is recorded as an error and the suite goes on.
Results: DIR/results.jsonl (one record per line, this run only; default ./bench_results), DIR/roofline.png when
matplotlib is available and some record carries roofline counts, and a table on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import math
import sys
import traceback
from pathlib import Path
from typing import Any

from jaxperf.benchmarks._common import strict_json

# name -> script in benchmarks/. A script that sets TAKES_OUT = True also gets `--out DIR` for its plots.
BENCHMARKS: dict[str, str] = {
    "compiled_vs_eager": "bench_compiled_vs_eager.py",
    "async_dispatch": "bench_async_dispatch.py",
    "auto_parallel": "bench_auto_parallel.py",
    "hardware": "bench_hardware.py",
    "train": "bench_train.py",
    "kernels": "bench_kernels.py",
    "collectives": "bench_collectives.py",
    "parallel": "bench_parallel.py",
    "generate": "bench_generate.py",
    "serve": "bench_serve.py",
    "tpu_compile": "bench_tpu_compile.py",
}


OPTIONAL: frozenset[str] = frozenset()  # names whose failure is reported but does not fail the suite


def load_script(name: str, directory: Path | None = None):
    """The module of benchmark `name`: `jaxperf.benchmarks.bench_<name>`, or the file of that name in `directory`."""
    if name not in BENCHMARKS:
        raise KeyError(f"unknown benchmark {name!r}; choose from {', '.join(BENCHMARKS)}")
    if directory is None:
        return importlib.import_module(f"jaxperf.benchmarks.{Path(BENCHMARKS[name]).stem}")
    path = Path(directory) / BENCHMARKS[name]
    if not path.is_file():
        raise FileNotFoundError(f"benchmark script {path} is missing")
    spec = importlib.util.spec_from_file_location(f"jaxperf_bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_one(name: str, argv: list[str], directory: Path | None = None,
            out: Path | None = None) -> list[dict[str, Any]]:
    """Run one benchmark's main(argv); any failure becomes a single record with an "error" field."""
    try:
        module = load_script(name, directory)
        if out is not None and getattr(module, "TAKES_OUT", False):
            argv = [*argv, "--out", str(out)]
        records = module.main(argv)
        if not isinstance(records, list):
            raise TypeError(f"main() returned {type(records).__name__}, expected a list of records")
        for r in records:
            r.setdefault("benchmark", name)
        return records
    except (Exception, SystemExit) as e:  # a benchmark's argparse exits; one broken script must not stop the suite
        tail = traceback.format_exc().strip().splitlines()[-4:]
        print(f"jaxperf bench: {name} failed: {type(e).__name__}: {e}", file=sys.stderr)
        return [{"benchmark": name, "name": "error", "value": None, "unit": None,
                 "error": f"{type(e).__name__}: {e}", "traceback_tail": tail}]


def roofline_points(records: list[dict[str, Any]]):
    """RooflinePoints for records that carry {"roofline": {"flops", "bytes", "time_s", "dtype"}}."""
    from jaxperf.perf.roofline import DeviceSpec, point

    specs: dict[str, Any] = {}
    pts = []
    for r in records:
        rl = r.get("roofline")
        if not rl or not rl.get("bytes"):
            continue
        dtype = rl.get("dtype", "float32")
        if dtype not in specs:
            specs[dtype] = DeviceSpec.for_device(dtype)
        pts.append(point(r["name"], rl["flops"], rl["bytes"], specs[dtype], rl.get("time_s")))
    return pts


def write_roofline(records: list[dict[str, Any]], path: Path) -> str | None:
    """Draw the roofline PNG; returns the path, or None with a printed note when it cannot be drawn."""
    try:
        from jaxperf.perf import roofline
    except ImportError as e:
        print(f"jaxperf bench: no roofline plot (jaxperf.perf.roofline not available: {e})")
        return None
    try:
        pts = roofline_points(records)
        if not pts:
            print("jaxperf bench: no roofline plot (no record carries FLOP and byte counts; run `hardware`)")
            return None
        bf16 = [p for p in pts if "float32" not in p.device.name]
        peak_f = max(p.device.peak_flops for p in pts)
        return roofline.plot(pts, str(path), peak_flops=peak_f, peak_bw=pts[0].device.peak_bw,
                             title=f"roofline: {pts[0].device.name.split(' (')[0]}" + (" (bf16 roof)" if bf16 else ""))
    except ImportError as e:
        print(f"jaxperf bench: no roofline plot ({e}; `pip install matplotlib`)")
    return None


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        return f"{v:.4g}"
    return str(v)


def table(records: list[dict[str, Any]]) -> str:
    """One line per record: benchmark, name, value, unit, % of peak, and an error or skip reason if any."""
    rows = [("benchmark", "name", "value", "unit", "% peak", "note")]
    for r in records:
        note = r.get("error") or r.get("skipped") or ""
        rows.append((str(r.get("benchmark", "")), str(r.get("name", "")), _fmt(r.get("value")),
                     str(r.get("unit") or ""), _fmt(r.get("pct_of_peak")), note[:80]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row[:-1], widths)) + "  " + row[-1] for row in rows]
    return "\n".join(line.rstrip() for line in lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="jaxperf bench", description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", help=f"benchmarks to run (default all): {', '.join(BENCHMARKS)}")
    p.add_argument("--tiny", action="store_true", help="small shapes: the suite finishes quickly on CPU")
    p.add_argument("--out", default="bench_results", help="output folder (default: ./bench_results)")
    a = p.parse_args(argv)
    unknown = [n for n in a.names if n not in BENCHMARKS]
    if unknown:
        p.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
    names = a.names or list(BENCHMARKS)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    records: list[dict[str, Any]] = []
    for name in names:
        print(f"== {name}", flush=True)
        with contextlib.redirect_stdout(sys.stderr):  # the scripts' own JSON lines go to stderr; the table to stdout
            records += run_one(name, ["--tiny"] if a.tiny else [], out=out)
    results = out / "results.jsonl"
    with results.open("w") as f:
        for r in records:
            f.write(json.dumps(strict_json(r), default=str) + "\n")
    plot = write_roofline(records, out / "roofline.png")
    print(table(records))
    print(f"wrote {len(records)} records to {results}" + (f" and {plot}" if plot else ""))
    failed = sorted({r["benchmark"] for r in records if r.get("name") == "error"})
    if failed:
        print(f"failed: {', '.join(failed)} (see the error column)")
    return 1 if any(n not in OPTIONAL for n in failed) else 0
