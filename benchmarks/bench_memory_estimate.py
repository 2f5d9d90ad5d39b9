"""jaxperf's memory estimate against the TPU compiler's bytes per chip, for every preset and Llama-3.1-8B shapes.

    PYTHONPATH=/path/to/libtpu JAX_PLATFORMS=cpu python benchmarks/bench_memory_estimate.py        # needs libtpu
    python benchmarks/bench_memory_estimate.py --only llama-8b --topologies v5p:2x4x4
    python benchmarks/bench_memory_estimate.py --compiled earlier.jsonl    # re-estimate, reuse compiled figures

Each run's train step is compiled for a TPU slice described by libtpu on this (CPU) machine
(jaxperf.train.topology.compile_for_topology); the record sets `jaxperf.perf.memory.estimate` (made before compiling,
for the same mesh and platform) against the compiled total (arguments + outputs - aliased + temporaries + code) and
prints one JSON line per run: the estimate's parts, the compiled parts and their ratio. Presets run as they are
(on 4 chips: v5p:2x2x1, v6e:2x2); the 8B shapes (d_model 4096, 32 layers, 32 heads / 8 KV heads, MLP 14336,
vocabulary 128256, untied, batch 32 x 8192, remat full, fsdp over 32 chips) on v5p:2x4x4 and v6e:4x8, once with the
XLA attention and full logits and once with the Pallas attention and the chunked loss.

`--compiled FILE` takes the compiled figures from an earlier run's JSON lines (same names and topologies) and only
recomputes the estimate: a change to the estimate can be checked against the compiler in seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

GiB = 2**30

LLAMA_8B = ["style=llama", "d_model=4096", "n_layers=32", "n_heads=32", "n_kv_heads=8", "mlp_dim=14336",
            "vocab_size=128256", "tie_embeddings=false", "max_seq_len=8192", "rope_theta=500000", "dtype=bfloat16",
            "remat=full", "batch_size=32"]
KERNELS = ["attention_impl=pallas", "loss_impl=chunked"]

# (name, preset, overrides, topologies)
RUNS = [
    ("tiny", "tiny", [], ("v5p:2x2x1", "v6e:2x2")),
    ("gpt2-small", "gpt2-small", [], ("v5p:2x2x1", "v6e:2x2")),
    ("gpt2-medium", "gpt2-medium", [], ("v5p:2x2x1", "v6e:2x2")),
    ("llama-1b", "llama-1b", [], ("v5p:2x2x1", "v6e:2x2")),
    ("gpt2-small+kernels", "gpt2-small", KERNELS, ("v5p:2x2x1", "v6e:2x2")),
    ("llama-1b+kernels", "llama-1b", KERNELS, ("v5p:2x2x1", "v6e:2x2")),
    ("llama-8b", "llama-1b", LLAMA_8B, ("v5p:2x4x4", "v6e:4x8")),
    ("llama-8b+kernels", "llama-1b", LLAMA_8B + KERNELS, ("v5p:2x4x4", "v6e:4x8")),
]


def record(name: str, preset: str, overrides: list[str], topology: str, compiled: dict | None) -> dict:
    from jaxperf.config import get_config, mesh_shape
    from jaxperf.perf.memory import estimate
    from jaxperf.train.topology import compile_for_topology, topology_devices

    cfg = get_config(preset, overrides)
    # a slice of chip:AxBxC has A*B*C chips, all TPUs (no need to load libtpu to know it)
    chips = math.prod(int(n) for n in topology.split(":")[1].split("x"))
    t0 = time.perf_counter()
    if compiled is None:
        devices = topology_devices(topology)
        try:
            report = compile_for_topology(cfg, topology)
            compiled = {**report["bytes_per_chip"], "device_kind": report["device_kind"],
                        "compile_s": report["compile_s"]}
        except Exception as e:  # noqa: BLE001 - the compiler refuses a step that does not fit HBM
            compiled = _out_of_memory(cfg, devices, e, time.perf_counter() - t0)
    est = estimate(cfg, mesh_shape(cfg.parallel, chips), platform="tpu")
    return {
        "name": name, "topology": topology, "preset": preset, "overrides": overrides,
        "device": "TPU compiler via libtpu, compiled on CPU", "device_kind": compiled.get("device_kind"),
        "estimate_bytes": est.total, "compiled_bytes": compiled["total"], "ratio": est.total / compiled["total"],
        "estimate": est.components(), "compiled": compiled, "seconds": time.perf_counter() - t0,
    }


def _out_of_memory(cfg, devices, error: Exception, seconds: float) -> dict:
    """The compiler's figure for a step that does not fit: it refuses with the bytes its temporaries need; the
    arguments (state and batch shards) are summed from their shardings, exactly as the compiled step would take
    them; the code is unknown (counted as 0)."""
    import math
    import re

    import jax

    from jaxperf.config import mesh_shape
    from jaxperf.parallel.mesh import make_mesh
    from jaxperf.step.task import build_task

    m = re.search(r"HLO temporaries \(([0-9.]+)([KMGT]?)\)", str(error))
    if m is None:
        raise error
    temp = float(m.group(1)) * 1024 ** " KMGT".index(m.group(2) or " ")
    task = build_task(cfg, make_mesh(cfg.parallel, devices))
    state = task.abstract_state()
    args = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(state))
    shape = mesh_shape(cfg.parallel, len(devices))
    args += cfg.batch_size * cfg.train_seq_len * 12 // (shape["data"] * shape["fsdp"])  # inputs, targets, mask
    return {"arguments": int(args), "temp": int(temp), "code": 0, "total": int(args + temp), "fits": False,
            "device_kind": devices[0].device_kind, "compile_s": seconds, "from": "the compiler's out-of-memory message"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="*", help="run names to keep (default: all)")
    p.add_argument("--topologies", nargs="*", help="topologies to keep (default: each run's own)")
    p.add_argument("--compiled", help="JSON lines of an earlier run: reuse its compiled figures")
    args = p.parse_args(argv)
    earlier = {}
    if args.compiled:
        for line in open(args.compiled):
            if line.startswith("{"):
                r = json.loads(line)
                earlier[(r["name"], r["topology"])] = r["compiled"]
    import jax
    import jaxlib
    try:
        from importlib.metadata import version
        libtpu = version("libtpu")
    except Exception:  # noqa: BLE001 - libtpu on a path without metadata
        libtpu = None
    for name, preset, overrides, topologies in RUNS:
        if args.only and name not in args.only:
            continue
        for topology in topologies:
            if args.topologies and topology not in args.topologies:
                continue
            r = record(name, preset, overrides, topology, earlier.get((name, topology)))
            r.update(jax=jax.__version__, jaxlib=jaxlib.__version__, libtpu=libtpu)
            print(json.dumps(r), flush=True)
            print(f"# {name:<20} {topology:<10} estimate {r['estimate_bytes'] / GiB:7.2f} GiB  compiled "
                  f"{r['compiled_bytes'] / GiB:7.2f} GiB  ratio {r['ratio']:.3f}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
