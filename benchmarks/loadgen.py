"""The client side of bench_serve: sends a schedule of streaming /generate requests and times them. Standard library
only, run as its own process (`python loadgen.py < schedule.json > results.json`), so the load it puts on the
server does not share the server's interpreter (its GIL, its threads).

Input (stdin): {"port": int, "timeout": float, "requests": [{"arrival", "prompt", "max_tokens", "seed"}, ...]}.
Output (stdout): {"wall_s": float, "results": [{"sent", "first", "done", "tokens", "error"}, ...]} with times in
seconds after the start, in the order of the input. Arrival times are followed with a sleeping dispatcher; each
request runs on its own thread; every wait is bounded by `timeout`.
"""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time


def one(port: int, req: dict, t0: float, timeout: float, out: dict) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        out["sent"] = time.perf_counter() - t0
        body = {"prompt": req["prompt"], "max_tokens": req["max_tokens"], "temperature": 0.8, "seed": req["seed"],
                "stream": True}
        conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            out["error"] = f"HTTP {resp.status}: {resp.read()[:200]!r}"
            return
        for line in resp:
            event = json.loads(line)
            if "error" in event:
                out["error"] = event["error"]
                return
            if event.get("tokens") and out.get("first") is None:
                out["first"] = time.perf_counter() - t0
            if event.get("done"):
                out["tokens"] = event["completion_tokens"]
                out["done"] = time.perf_counter() - t0
                return
        out["error"] = "the stream ended without a final answer"
    except Exception as e:  # noqa: BLE001 - recorded per request
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        conn.close()


def run(port: int, requests: list[dict], timeout: float) -> dict:
    results = [{"sent": None, "first": None, "done": None, "tokens": 0, "error": None} for _ in requests]
    t0 = time.perf_counter()
    threads = []
    for req, out in zip(requests, results):
        wait = req["arrival"] - (time.perf_counter() - t0)
        if wait > 0:
            time.sleep(wait)
        th = threading.Thread(target=one, args=(port, req, t0, timeout, out), daemon=True)
        th.start()
        threads.append(th)
    deadline = time.perf_counter() + timeout
    for th in threads:
        th.join(timeout=max(0.0, deadline - time.perf_counter()))
    for out in results:
        if out["done"] is None and out["error"] is None:
            out["error"] = f"no answer within {timeout:g} s"
    done = [r["done"] for r in results if r["done"] is not None]
    return {"wall_s": max(done) if done else time.perf_counter() - t0, "results": results}


if __name__ == "__main__":
    spec = json.load(sys.stdin)
    json.dump(run(int(spec["port"]), spec["requests"], float(spec["timeout"])), sys.stdout)
