"""How fast are the hand-written all-reduces against psum, and does an alpha-beta model of the link explain them?

    python benchmarks/bench_collectives.py                # 1 KiB .. 64 MiB per device (.. 4 MiB on CPU)
    python benchmarks/bench_collectives.py --tiny         # three sizes, seconds on CPU
    JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/bench_collectives.py --tiny

Every visible device takes part (one mesh axis). For each message size (fp32 bytes per device) and each algorithm in
jaxperf.explicit.collectives (psum, ring, bidirectional ring, halving-doubling when the device count is a power of
two), the result is first checked against psum, then timed. One record per (algorithm, size): value = bus bandwidth
in GB/s (nbytes / seconds * 2(n-1)/n), with the measured seconds beside the cost model's prediction from a link
(alpha, beta) fitted to the psum timings, psum modelled as a ring. A `link/psum_fit` record carries the fitted link.
Where the chip's interconnect is in jaxperf.perf.hardware, pct_of_peak compares bus bandwidth with one direction of it
(a bidirectional ring can exceed 100%). A PNG (bus bandwidth vs size, measured solid, predicted dashed) goes to --out.

On CPU the "devices" are threads of one process and a ppermute is a memory copy: the figures show the algorithms'
step counts and copies, not a network.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxperf.perf.cpu_host import reexec_with_huge_pages
from jaxperf.benchmarks._common import check_close, emit, record
from jaxperf import _compat
from jaxperf.explicit import collectives as C, cost_model
from jaxperf.perf.hardware import chip_for
from jaxperf.perf.timing import benchmark

NAME = "collectives"
TAKES_OUT = True  # jaxperf bench passes its --out folder for the PNG
KiB, MiB = 1 << 10, 1 << 20


def size_label(nbytes: int) -> str:
    return f"{nbytes // MiB}MiB" if nbytes >= MiB else f"{nbytes // KiB}KiB"


def message_sizes(tiny: bool, platform: str) -> list[int]:
    """Bytes per device: powers of 4 from 1 KiB; CPU stops at 4 MiB (8 copies of each buffer live in host memory)."""
    if tiny:
        return [1 * KiB, 32 * KiB, 1 * MiB]
    top = 4 * MiB if platform == "cpu" else 64 * MiB
    return [KiB << (2 * k) for k in range(20) if KiB << (2 * k) <= top]


def algorithms(n: int) -> list[str]:
    return [a for a in C.ALL_REDUCES if a != "halving_doubling" or n & (n - 1) == 0]


def all_reduce_fn(algo: str, mesh: Mesh):
    """jit(shard_map(algo)) over the mesh's one axis: (n, M) sharded by row -> every row the sum of all rows."""
    fn = C.ALL_REDUCES[algo]
    return jax.jit(_compat.shard_map(lambda x_1xM: fn(x_1xM, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))


def measure(mesh: Mesh, sizes: list[int], algos: list[str], iters: int) -> dict[str, dict[int, dict]]:
    """{algo: {nbytes: timing dict}}, each algorithm checked against psum before it is timed."""
    n = mesh.devices.size
    fns = {a: all_reduce_fn(a, mesh) for a in algos}
    out: dict[str, dict[int, dict]] = {a: {} for a in algos}
    for nbytes in sizes:
        m = nbytes // 4
        x_NxM = jax.device_put(jax.random.normal(jax.random.key(nbytes), (n, m), jnp.float32),
                               NamedSharding(mesh, P("x")))
        want = np.asarray(fns["psum"](x_NxM))
        for algo in algos:
            if algo != "psum":
                check_close(f"{algo}/{size_label(nbytes)}", fns[algo](x_NxM), want, rtol=1e-5, atol=1e-5)
            out[algo][nbytes] = benchmark(fns[algo], x_NxM, warmup=2, iters=iters).as_dict()
    return out


def plot(rows: list[dict], path: Path) -> str | None:
    """Bus bandwidth vs message size, one colour per algorithm: measured solid, predicted dashed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench_collectives: no plot (`pip install matplotlib`)", file=sys.stderr)
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k, algo in enumerate(dict.fromkeys(r["algorithm"] for r in rows)):
        mine = sorted((r for r in rows if r["algorithm"] == algo), key=lambda r: r["nbytes"])
        xs = [r["nbytes"] for r in mine]
        ax.plot(xs, [r["value"] for r in mine], "-o", color=f"C{k}", label=f"{algo} measured")
        pred = [(x, r["predicted_bus_GBps"]) for x, r in zip(xs, mine) if r["predicted_bus_GBps"]]
        if pred:
            ax.plot(*zip(*pred), "--", color=f"C{k}", label=f"{algo} model")
    r0 = rows[0]
    ax.set(xscale="log", yscale="log", xlabel="bytes per device", ylabel="bus bandwidth (GB/s)",
           title=f"all-reduce over {r0['n']} x {r0['device']} (jax {r0['versions']['jax']})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="three sizes, few iterations: seconds on CPU (CI)")
    p.add_argument("--iters", type=int, default=None, help="timed calls per point (default 5 tiny, 20 otherwise)")
    p.add_argument("--out", default="bench_results", help="folder for the PNG")
    a = p.parse_args(argv)
    devices = jax.devices()
    n = len(devices)
    if n < 2:
        return [emit(record(NAME, "all_reduce", None, "GB/s", skipped=f"{n} device: an all-reduce needs two or more"))]
    mesh = Mesh(np.array(devices), ("x",))
    sizes, algos = message_sizes(a.tiny, jax.default_backend()), algorithms(n)
    timings = measure(mesh, sizes, algos, a.iters or (5 if a.tiny else 20))

    link = cost_model.fit_link([(nb, t["median_s"]) for nb, t in timings["psum"].items()], n=n, algorithm="psum")
    chip = chip_for()
    peak = chip.interconnect_bw / 1e9 if chip else None
    link_fields = {"alpha_s": link.alpha_s, "beta_s_per_byte": link.beta_s_per_byte}
    recs = [record(NAME, "link/psum_fit", link.bandwidth / 1e9 if link.beta_s_per_byte > 0 else None, "GB/s",
                   n=n, sizes=sizes, **link_fields,
                   **({} if link.beta_s_per_byte > 0 else {"skipped": "the fit found no bandwidth term"}))]
    rows = []
    for algo in algos:
        for nbytes, t in timings[algo].items():
            pred_s = cost_model.predict(algo, nbytes, n, link)
            rows.append(record(
                NAME, f"{algo}/{size_label(nbytes)}", cost_model.bus_bandwidth(nbytes, n, t["median_s"]) / 1e9, "GB/s",
                peak=peak, algorithm=algo, nbytes=nbytes, n=n, dtype="float32", seconds=t["median_s"],
                predicted_s=pred_s, predicted_bus_GBps=cost_model.bus_bandwidth(nbytes, n, pred_s) / 1e9 if pred_s > 0 else None,
                model_ratio=t["median_s"] / pred_s if pred_s > 0 else None, timing=t, link=link_fields,
                **({"peak_source": f"table:{chip.name} interconnect, one direction"} if chip else {})))
    recs += rows
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    png = plot(rows, out / "collectives.png")
    if png:
        print(f"bench_collectives: wrote {png}", file=sys.stderr)
    return [emit(r) for r in recs]


if __name__ == "__main__":
    reexec_with_huge_pages()  # XLA:CPU step buffers on huge pages (jaxperf.perf.cpu_host)
    main(sys.argv[1:])
