"""How many requests does `jaxperf serve` answer per second within a latency budget? A bounded load on loopback.

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python benchmarks/bench_serve.py         # tiny preset model
    python benchmarks/bench_serve.py --tiny                         # a smaller model and load (well under a minute)
    python benchmarks/bench_serve.py --checkpoint runs/tiny          # a trained run (meaningful perplexity)

The load: `--requests` requests with seeded Poisson arrivals at `--rate` requests/s (default: a multiple of what one
replica can sustain, see below), prompts of mixed lengths and outputs of mixed lengths (three in four short, one in
four long: the mix where static batching wastes the most). Each request is a streaming POST /generate from its own
client thread on 127.0.0.1; the client records when it was sent, when its first tokens arrived (time to first token)
and when its answer was complete (latency). The server runs in this process (uvicorn on a thread), as the real one.

Scenarios, each on the same load: static batching (the server before continuous batching: a batch runs until all its
requests are done), continuous batching, continuous batching over `--replicas` replicas (one per device; a CPU host
needs XLA_FLAGS=--xla_force_host_platform_device_count=N, else the scenario is recorded as skipped), continuous
batching on one replica whose rows are split over those N devices (`serve --replica-axis data`), and continuous
batching with int8 weights. Every scenario is warmed up first (its programs compiled) and the records say how many
programs compiled during the measured run (0 expected).

Per scenario: requests/s and tokens/s over the run (first arrival to last answer), latency and time to first token
p50 and p99, and goodput: requests/s answered within the latency budget. The budget is `--budget-s`, or 4x the
latency of one long request alone on an idle server (measured first). `continuous_vs_static` is the ratio of
goodputs at the same budget and load. Also: the engine's decode tokens/s at batch 1 and 32 (greedy, no server; also
with the rows over N devices), and
for int8 the weight bytes and the perplexity of both weight sets on held-out text (the preset's corpus; random
weights unless `--checkpoint`, so read that perplexity as a check of the quantization error, not of the model).
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np

from jaxperf.benchmarks._common import emit, record
from jaxperf.perf.cpu_host import reexec_with_huge_pages

NAME = "serve"
LOADGEN = Path(__file__).resolve().with_name("loadgen.py")  # the client, a process of its own
TINY_MODEL = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.max_seq_len=128", "data.max_bytes=300000"]


@dataclasses.dataclass
class Sent:
    arrival: float  # seconds after the start of the run
    prompt: str
    max_tokens: int
    seed: int
    sent: float = 0.0
    first: float | None = None
    done: float | None = None
    tokens: int = 0
    error: str | None = None


def workload(n: int, rate: float, rng: np.random.Generator, *, prompt_range, short_range, long_range) -> list[Sent]:
    """n requests, Poisson arrivals at `rate`/s, prompts and outputs of mixed lengths (1 in 4 long)."""
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n)) - 1.0 / rate
    words = "once upon a time there was a little dragon who lived in a cave by the sea and loved stories".split()
    out = []
    for i, t in enumerate(arrivals):
        length = int(rng.integers(*prompt_range))
        text = " ".join(rng.choice(words, length))[:length].strip() or "once"
        rng_out = long_range if rng.random() < 0.25 else short_range
        out.append(Sent(float(max(t, 0.0)), text, int(rng.integers(*rng_out)), int(rng.integers(0, 2**31))))
    return out


class LocalServer:
    """The Starlette app on a free loopback port, served by uvicorn on a thread."""

    def __init__(self, app):
        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="critical"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start within 60 s")
            time.sleep(0.02)

    def close(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def metrics(self) -> dict:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request("GET", "/metrics")
            return json.loads(conn.getresponse().read())
        finally:
            conn.close()


def run_load(server: LocalServer, load: list[Sent], timeout: float) -> float:
    """Send every request at its arrival time from a client process (benchmarks/loadgen.py); fills in each Sent's
    times and returns the run's wall clock (first arrival to last answer)."""
    spec = {"port": server.port, "timeout": timeout,
            "requests": [{"arrival": s.arrival, "prompt": s.prompt, "max_tokens": s.max_tokens, "seed": s.seed}
                         for s in load]}
    proc = subprocess.run([sys.executable, str(LOADGEN)], input=json.dumps(spec), capture_output=True, text=True,
                          timeout=timeout + 60)
    if proc.returncode != 0:
        raise RuntimeError(f"the load generator failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}")
    out = json.loads(proc.stdout)
    for s, r in zip(load, out["results"]):
        s.sent, s.first, s.done, s.tokens, s.error = r["sent"], r["first"], r["done"], r["tokens"], r["error"]
    return float(out["wall_s"])


def pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(load: list[Sent], wall: float, budget: float) -> dict:
    ok = [s for s in load if s.done is not None and s.error is None]
    lat = [s.done - s.arrival for s in ok]
    ttft = [s.first - s.arrival for s in ok if s.first is not None]
    return {
        "requests": len(load), "completed": len(ok), "errors": sorted({s.error for s in load if s.error})[:3],
        "wall_s": wall, "requests_per_s": len(ok) / wall, "tokens_per_s": sum(s.tokens for s in ok) / wall,
        "latency_p50_s": pct(lat, 50), "latency_p99_s": pct(lat, 99), "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "within_budget": sum(x <= budget for x in lat), "goodput_rps": sum(x <= budget for x in lat) / wall,
    }


def warm(server: LocalServer, prompt_range, timeout: float) -> None:
    """Compile what the load will use (every replica: each admission size of each prompt bucket, and decode), then
    send a small burst through HTTP so the server's own first-request costs are paid too."""
    server.app.state.scheduler.warmup(prompt_lengths=range(prompt_range[0], prompt_range[1]))
    rng = np.random.default_rng(123)
    run_load(server, [Sent(0.0, "a" * prompt_range[0], 4, int(rng.integers(0, 1000))) for _ in range(4)], timeout)


def engine_decode(gen, batch: int, prompt_len: int, max_tokens: int, repeats: int, rng) -> float:
    """Greedy decode tokens/s of the engine alone (median of `repeats` generations after one that compiles)."""
    prompts = [[int(t) for t in rng.integers(0, gen.cfg.vocab_size, prompt_len)] for _ in range(batch)]
    gen.generate(prompts, max_tokens, temperature=0.0)
    runs = [gen.generate(prompts, max_tokens, temperature=0.0) for _ in range(repeats)]
    return batch * max_tokens / statistics.median(r.decode_s for r in runs)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--tiny", action="store_true", help="a smaller model and load (for tests and CI)")
    parser.add_argument("--checkpoint", default=None, help="serve this run's checkpoint instead of random weights")
    parser.add_argument("--requests", type=int, default=None, help="requests per scenario (default 24 tiny, 128)")
    parser.add_argument("--rate", type=float, default=None, help="arrivals per second (default: 3x what one replica "
                                                                 "sustains, from a calibration run)")
    parser.add_argument("--budget-s", type=float, default=None, help="latency budget (default 4x a long request alone)")
    parser.add_argument("--slots", type=int, default=8, help="rows per replica (--max-batch)")
    parser.add_argument("--chunk", type=int, default=8)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("overrides", nargs="*", help="config key=value, e.g. model.n_layers=2")
    args = parser.parse_args(argv)

    from flax import nnx

    from jaxperf import _compat
    from jaxperf.config import from_dict, get_config, validate_model
    from jaxperf.data import datasets_for, tokenizer_for
    from jaxperf.generate import Generator, perplexity
    from jaxperf.generate.scheduler import replica_meshes
    from jaxperf.generate.server import create_app
    from jaxperf.models import GPT
    from jaxperf.models.quant import quantize_params
    from jaxperf.step.task import build_task

    tiny = args.tiny
    if args.checkpoint:
        gen = Generator.from_checkpoint(args.checkpoint)
        cfg = from_dict(json.loads((Path(args.checkpoint) / "config.json").read_text()))
    else:
        cfg = get_config(args.preset, (TINY_MODEL if tiny else []) + list(args.overrides))
        cfg = dataclasses.replace(cfg, model=validate_model(cfg.model))
        gen = Generator(GPT(cfg.model, rngs=nnx.Rngs(args.seed)), tokenizer_for(cfg))
    mcfg = gen.cfg
    n_requests = args.requests or (24 if tiny else 128)
    max_seq = mcfg.max_seq_len
    prompt_range = (4, min(9 if tiny else 48, max_seq // 4))  # tiny: one prompt bucket, fewer programs
    short_range = (4, 17 if tiny else 25)
    long_range = (min(48 if tiny else 64, max_seq // 2), min(65 if tiny else 97, max_seq - prompt_range[1]))
    timeout = 300.0
    rng = np.random.default_rng(args.seed)
    common = dict(preset=args.preset, tiny=tiny, slots=args.slots, chunk=args.chunk, model_d=mcfg.d_model,
                  model_layers=mcfg.n_layers, checkpoint=args.checkpoint, prompt_range=list(prompt_range),
                  short_range=list(short_range), long_range=list(long_range))
    records: list[dict] = []

    def serve(gens, batching: str):
        app = create_app(gens, max_batch=args.slots, chunk=args.chunk, batching=batching, batch_window_s=0.005,
                         max_tokens_limit=max_seq - 1, request_timeout_s=timeout)
        return LocalServer(app)

    # Calibration: one long request alone gives the budget; a saturating burst gives one replica's capacity.
    srv = serve([gen], "continuous")
    try:
        warm(srv, prompt_range, timeout)
        solos = []
        for _ in range(3):  # the best of three: one long request alone on an idle, warmed-up server
            solo = [Sent(0.0, "once upon a time"[: prompt_range[1] - 1], long_range[1] - 1, 1)]
            run_load(srv, solo, timeout)
            solos.append(solo[0].done - solo[0].arrival)
        solo_s = min(solos)
        budget = args.budget_s or 4.0 * solo_s
        burst = workload(2 * args.slots, 1e6, np.random.default_rng(7), prompt_range=prompt_range,
                         short_range=short_range, long_range=long_range)
        capacity = len(burst) / run_load(srv, burst, timeout)
    finally:
        srv.close()
    rate = args.rate or 3.0 * capacity
    common.update(arrival_rate=rate, budget_s=budget, solo_long_s=solo_s, capacity_rps=capacity)
    load_rng_seed = args.seed + 1

    started = time.perf_counter()

    def phase(what: str) -> None:  # where a run that ran out of time was (stderr, beside the records)
        print(f"bench_serve: {what} at {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)

    def scenario(name: str, gens, batching: str) -> dict:
        phase(f"scenario {name}")
        server = serve(gens, batching)
        try:
            warm(server, prompt_range, timeout)
            compiled = sum(g.compilations for g in gens)
            load = workload(n_requests, rate, np.random.default_rng(load_rng_seed), prompt_range=prompt_range,
                            short_range=short_range, long_range=long_range)
            before = server.metrics()["replicas"]
            wall = run_load(server, load, timeout)
            after = server.metrics()["replicas"]
        finally:
            server.close()
        s = summarize(load, wall, budget)
        delta = [{k: a[k] - b[k] for k in ("requests", "rows_decoded", "decode_steps")} for a, b in zip(after, before)]
        rec = record(NAME, name, s["requests_per_s"], "requests/s", batching=batching, replicas=len(gens),
                     int8=gens[0].quantized, compiles_during_run=sum(g.compilations for g in gens) - compiled,
                     mean_rows_per_step=[d["rows_decoded"] / max(d["decode_steps"], 1) for d in delta],
                     per_replica_requests=[d["requests"] for d in delta], **s, **common)
        return emit(rec)

    static = scenario("static", [gen], "static")
    cont = scenario("continuous", [gen], "continuous")
    records += [static, cont]
    ratio = cont["goodput_rps"] / static["goodput_rps"] if static["goodput_rps"] else None
    records.append(emit(record(NAME, "continuous_vs_static", ratio, "x", rps_ratio=cont["requests_per_s"] /
                               max(static["requests_per_s"], 1e-9), note="goodput at the same budget and load",
                               **common)))

    n_rep = args.replicas
    if len(jax.devices()) >= n_rep > 1:
        gens = [gen] + [gen.on(m) for m in replica_meshes(n_rep, 1)[1:]]  # gen is on the first device already
        rep = scenario(f"continuous_x{n_rep}", gens, "continuous")
        records.append(rep)
        records.append(emit(record(NAME, f"replicas_x{n_rep}_vs_1", rep["requests_per_s"] / cont["requests_per_s"],
                                   "x", **common)))
        # One replica whose rows are split over the same devices (serve --replica-axis data).
        rows_gen = gen.on(replica_meshes(1, n_rep, axis="data")[0])
        records.append(scenario(f"continuous_rows_x{n_rep}", [rows_gen], "continuous"))
    else:
        rows_gen = None
        why = (f"--replicas {n_rep}: nothing to compare one replica with" if n_rep <= 1 else
               f"{n_rep} replicas need {n_rep} devices, found {len(jax.devices())}: on a CPU host run with "
               f"XLA_FLAGS=--xla_force_host_platform_device_count={n_rep}, else pass --replicas "
               f"{len(jax.devices())} or fewer")
        for name in (f"continuous_x{n_rep}", f"continuous_rows_x{n_rep}"):
            records.append(emit(record(NAME, name, None, None, skipped=why, **common)))

    gen8 = gen.on(gen.mesh, quantize="int8") if not gen.quantized else gen
    records.append(scenario("continuous_int8", [gen8], "continuous"))

    # int8: bytes and held-out perplexity of both weight sets (the full forward, stacked layers as trained).
    phase("held-out perplexity, fp32 and int8")
    task = build_task(dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, strategy="tp")),
                      _compat.make_mesh((1, 1, 1), ("data", "fsdp", "tensor"), devices=jax.devices()[:1]),
                      with_optimizer=False)
    _, val = datasets_for(cfg, tokenizer_for(cfg))
    fp32_params = _stacked_params(gen, cfg.model.scan_layers)
    batches = 1 if tiny else 8
    if val is not None:
        ppl32 = perplexity(task, fp32_params, val, batches=batches, batch_size=8)
        ppl8 = perplexity(task, quantize_params(fp32_params), val, batches=batches, batch_size=8)
    else:
        ppl32 = ppl8 = None
    records.append(emit(record(
        NAME, "int8_weight_bytes", gen8.weight_bytes / gen.weight_bytes, "x of fp32", weight_bytes_fp32=gen.weight_bytes,
        weight_bytes_int8=gen8.weight_bytes, perplexity_fp32=ppl32, perplexity_int8=ppl8,
        perplexity_tokens=batches * 8 * cfg.train_seq_len, weights="trained" if args.checkpoint else "random init",
        **common)))

    # The engine alone: decode tokens/s at batch 1 and 32 (and int8 at 8), greedy, no server.
    phase("engine decode")
    prompt_len, new = (16, 32) if tiny else (32, 96)
    reps = 1 if tiny else 3
    d1 = engine_decode(gen, 1, prompt_len, new, reps, rng)
    d32 = engine_decode(gen, 32, prompt_len, new, reps, rng)
    records.append(emit(record(NAME, "decode_b1", d1, "tokens/s", prompt_len=prompt_len, new_tokens=new, **common)))
    records.append(emit(record(NAME, "decode_b32", d32, "tokens/s", prompt_len=prompt_len, new_tokens=new, **common)))
    records.append(emit(record(NAME, "decode_b32_vs_b1", d32 / d1, "x", **common)))
    if rows_gen is not None:  # the same with the rows over n_rep devices, each decoding its rows in its own loop
        r1, r32 = (engine_decode(rows_gen, b, prompt_len, new, reps, rng) for b in (1, 32))
        records.append(emit(record(NAME, f"decode_b32_vs_b1_rows_x{n_rep}", r32 / r1, "x", b1_tokens_per_s=r1,
                                   b32_tokens_per_s=r32, prompt_len=prompt_len, new_tokens=new, **common)))
    d8, d8q = (engine_decode(g, 8, prompt_len, new, reps, rng) for g in (gen, gen8))
    records.append(emit(record(NAME, "decode_b8_int8_vs_fp32", d8q / d8, "x", fp32_tokens_per_s=d8,
                               int8_tokens_per_s=d8q, **common)))
    return records


def _stacked_params(gen, scan_layers: bool):
    """The Generator's (unstacked, fp32) parameters in the run's layout (stacked layers when it scans them)."""
    params = jax.device_get(gen.params)
    if scan_layers:
        blocks = [params["blocks"][i] for i in range(gen.cfg.n_layers)]
        params = {**params, "blocks": jax.tree.map(lambda *xs: np.stack(xs), *blocks)}
    return params


if __name__ == "__main__":
    reexec_with_huge_pages()  # XLA:CPU step buffers on huge pages (jaxperf.perf.cpu_host)
    main()
