"""`jaxperf serve`: an HTTP JSON API over a Generator that batches concurrent requests into one decode batch.

    jaxperf serve --checkpoint runs/tiny --port 8000
    curl -s localhost:8000/generate -d '{"prompt": "def ", "max_tokens": 64, "temperature": 0.8}'
    curl -sN localhost:8000/generate -d '{"prompt": "def ", "stream": true}'     # one JSON object per line

Routes:
  POST /generate  {"prompt": str, "max_tokens": int, "temperature": float, "top_k": int, "top_p": float,
                   "seed": int, "stream": bool}; only "prompt" is required. Answers {"text", "tokens",
                   "prompt_tokens", "completion_tokens", "finish_reason", "batch_size", "queue_s", "timings"}, or with
                   "stream": true, newline-delimited JSON: {"text": piece} as tokens arrive, then the same final object
                   with "done": true. A bad request gets 400 (422 for a prompt too long for the model) and
                   {"error": message}.
  GET /health     {"status": "ok", model and device description}
  GET /metrics    counters: requests, batches, rows per batch (last, max, mean), tokens, queue depth
  GET /           a page to type a prompt and watch the continuation appear

Batching: one thread owns the model. It takes the first waiting request, waits up to `batch_window_s` for more (up to
`max_batch`), and runs them together: one prefill, then the compiled decode loop in chunks of `chunk` steps, sending
each request its new tokens after every chunk. Requests that arrive meanwhile wait for the next batch. Every request
keeps its own settings and seed (see `Generator.stream`), so an answer does not depend on what it was batched with.
Shapes are bucketed, so a handful of programs serve all traffic; `warmup()` compiles the common ones before the
first request.
"""

from __future__ import annotations

import asyncio
import html
import dataclasses
import json
import math
import queue
import threading
import time
from contextlib import asynccontextmanager
from typing import Any

from jaxperf.generate.engine import TextStream

FIELDS = {"prompt", "max_tokens", "temperature", "top_k", "top_p", "seed", "stream"}


class BadRequest(ValueError):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclasses.dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stream: bool
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    arrived: float = dataclasses.field(default_factory=time.perf_counter)


def parse_request(body: Any, tokenizer, *, max_tokens_limit: int, max_seq_len: int, default_max_tokens: int = 64,
                  default_temperature: float = 0.8) -> dict[str, Any]:
    """Validate a /generate body; returns the settings or raises BadRequest with what is wrong and how to fix it."""
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise BadRequest(f"unknown field(s) {unknown}; accepted: {sorted(FIELDS)}")
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("'prompt' is required and must be a non-empty string")

    def number(name, kind, default):
        value = body.get(name, default)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if kind is int:
            ok = ok and float(value).is_integer()
        if not ok:
            raise BadRequest(f"'{name}' must be {'an integer' if kind is int else 'a number'}, got {value!r}")
        return kind(value)

    max_tokens = number("max_tokens", int, default_max_tokens)
    if not 1 <= max_tokens <= max_tokens_limit:
        raise BadRequest(f"'max_tokens'={max_tokens} must lie in [1, {max_tokens_limit}] (the server's limit)")
    temperature = number("temperature", float, default_temperature)
    if temperature < 0:
        raise BadRequest(f"'temperature'={temperature} must be >= 0 (0 = greedy)")
    top_k = number("top_k", int, 0)
    if top_k < 0:
        raise BadRequest(f"'top_k'={top_k} must be >= 0 (0 = off)")
    top_p = number("top_p", float, 1.0)
    if not 0 < top_p <= 1:
        raise BadRequest(f"'top_p'={top_p} must lie in (0, 1] (1 = off)")
    seed = number("seed", int, 0)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"'stream' must be true or false, got {stream!r}")
    ids = [int(t) for t in tokenizer.encode(prompt)]
    if not ids:
        raise BadRequest("the prompt encodes to no tokens")
    if len(ids) >= max_seq_len:
        raise BadRequest(f"the prompt is {len(ids)} tokens; the model takes at most {max_seq_len - 1} before "
                         f"generating (model.max_seq_len={max_seq_len}): shorten it", status=422)
    return {"prompt_ids": ids, "max_tokens": max_tokens, "temperature": temperature, "top_k": top_k,
            "top_p": top_p, "seed": seed, "stream": stream}


class Metrics:
    """Counters the server exposes at /metrics (thread-safe)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests = 0
        self.rejected = 0
        self.batches = 0
        self.rows = 0
        self.last_batch_size = 0
        self.max_batch_size = 0
        self.tokens_generated = 0
        self.decode_s = 0.0

    def add(self, **counts):
        with self._lock:
            for k, v in counts.items():
                setattr(self, k, getattr(self, k) + v)

    def batch(self, size: int, tokens: int, decode_s: float):
        with self._lock:
            self.batches += 1
            self.rows += size
            self.last_batch_size = size
            self.max_batch_size = max(self.max_batch_size, size)
            self.tokens_generated += tokens
            self.decode_s += decode_s

    def as_dict(self, queue_depth: int) -> dict[str, Any]:
        with self._lock:
            return {"requests": self.requests, "rejected": self.rejected, "batches": self.batches,
                    "last_batch_size": self.last_batch_size, "max_batch_size": self.max_batch_size,
                    "mean_batch_size": self.rows / self.batches if self.batches else 0.0,
                    "tokens_generated": self.tokens_generated,
                    "decode_tokens_per_s": self.tokens_generated / self.decode_s if self.decode_s else 0.0,
                    "queue_depth": queue_depth}


class Batcher:
    """Owns the Generator on one thread and runs waiting requests together (see the module docstring)."""

    def __init__(self, generator, *, max_batch: int = 8, batch_window_s: float = 0.01, chunk: int = 8,
                 metrics: Metrics | None = None):
        if max_batch < 1 or chunk < 1 or batch_window_s < 0:
            raise ValueError(f"max_batch={max_batch} and chunk={chunk} must be >= 1, batch_window_s >= 0")
        self.gen, self.max_batch, self.window, self.chunk = generator, max_batch, batch_window_s, chunk
        self.metrics = metrics or Metrics()
        self._queue: queue.Queue[Request | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="jaxperf-batcher", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=60)
            self._thread = None

    def submit(self, request: Request) -> None:
        self._queue.put(request)

    def warmup(self, prompt_ids: list[int], max_tokens: int = 16) -> float:
        """Compile the programs of a one-row request of this size before serving; returns the compile seconds."""
        before = self.gen.compile_s
        it = self.gen.stream([prompt_ids], max_tokens, temperature=0.0, chunk=self.chunk)
        for _ in it:
            pass
        return self.gen.compile_s - before

    def _collect(self) -> list[Request] | None:
        first = self._queue.get()
        if first is None:
            return None
        batch = [first]
        deadline = time.perf_counter() + self.window
        while len(batch) < self.max_batch:
            timeout = deadline - time.perf_counter()
            try:
                nxt = self._queue.get(timeout=max(timeout, 0)) if timeout > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if nxt is None:
                self._queue.put(None)
                break
            batch.append(nxt)
        return batch

    def _run(self) -> None:
        while True:
            batch = self._collect()
            if batch is None:
                return
            try:
                self._serve(batch)
            except Exception as e:  # a failed batch answers its requests with the error; the server stays up
                for r in batch:
                    self._send(r, {"error": f"generation failed: {type(e).__name__}: {e}", "done": True})

    @staticmethod
    def _send(r: Request, event: dict) -> None:
        r.loop.call_soon_threadsafe(r.events.put_nowait, event)

    def _serve(self, batch: list[Request]) -> None:
        started = time.perf_counter()
        texts = [TextStream(self.gen.tokenizer) for _ in batch]
        stream = self.gen.stream([r.prompt_ids for r in batch], [r.max_tokens for r in batch],
                                 temperature=[r.temperature for r in batch], top_k=[r.top_k for r in batch],
                                 top_p=[r.top_p for r in batch], seed=[r.seed for r in batch], chunk=self.chunk)
        while True:
            try:
                new = next(stream)
            except StopIteration as e:
                result = e.value
                break
            for r, t, ids in zip(batch, texts, new):
                piece = t.push(ids)
                if r.stream and piece:
                    self._send(r, {"text": piece})
        self.metrics.batch(len(batch), result.decode_tokens, result.decode_s)
        for r, t, row in zip(batch, texts, result):
            tail = t.finish()
            if r.stream and tail:
                self._send(r, {"text": tail})
            self._send(r, {
                "done": True, "text": row.text, "tokens": row.tokens,
                "prompt_tokens": row.prompt_tokens, "completion_tokens": len(row.tokens),
                "finish_reason": row.finish_reason, "batch_size": len(batch), "queue_s": started - r.arrived,
                "timings": {k: v for k, v in result.timings().items() if math.isfinite(v)},
            })


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>jaxperf serve</title>
<style>
body { font-family: system-ui, sans-serif; max-width: 46rem; margin: 2rem auto; padding: 0 1rem; }
textarea { width: 100%; height: 6rem; font: inherit; }
#out { white-space: pre-wrap; font-family: ui-monospace, monospace; border: 1px solid #ccc; padding: .75rem;
       min-height: 8rem; }
label { margin-right: 1rem; } input[type=number] { width: 5rem; } #stats { color: #666; }
</style></head><body>
<h1>jaxperf serve</h1>
<p>MODEL_DESCRIPTION</p>
<textarea id="prompt">Once upon a time</textarea>
<p><label>max tokens <input id="max_tokens" type="number" value="200" min="1"></label>
<label>temperature <input id="temperature" type="number" value="0.8" step="0.1" min="0"></label>
<label>top-p <input id="top_p" type="number" value="0.95" step="0.05" min="0" max="1"></label>
<button id="go">Generate</button></p>
<div id="out"></div><p id="stats"></p>
<script>
document.getElementById("go").onclick = async () => {
  const out = document.getElementById("out"), stats = document.getElementById("stats");
  const prompt = document.getElementById("prompt").value;
  out.textContent = prompt; stats.textContent = "";
  const body = {prompt, stream: true,
    max_tokens: parseInt(document.getElementById("max_tokens").value),
    temperature: parseFloat(document.getElementById("temperature").value),
    top_p: parseFloat(document.getElementById("top_p").value)};
  const resp = await fetch("/generate", {method: "POST", body: JSON.stringify(body)});
  if (!resp.ok) { stats.textContent = (await resp.json()).error; return; }
  const reader = resp.body.getReader(), decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, {stream: true});
    let nl;
    while ((nl = buffer.indexOf("\\n")) >= 0) {
      const event = JSON.parse(buffer.slice(0, nl)); buffer = buffer.slice(nl + 1);
      if (event.error) { stats.textContent = event.error; }
      else if (event.done) {
        stats.textContent = event.completion_tokens + " tokens, " + event.finish_reason + ", batch of " +
          event.batch_size + ", " + Math.round(event.timings.decode_tokens_per_s || 0) + " tok/s decode";
      } else { out.textContent += event.text; }
    }
  }
};
</script></body></html>
"""


def create_app(generator, *, max_batch: int = 8, batch_window_s: float = 0.01, chunk: int = 8,
               max_tokens_limit: int = 512, description: str = ""):
    """The Starlette application; the batcher thread starts and stops with the app's lifespan.

    `app.state.batcher` and `app.state.metrics` are reachable for tests and embedding.
    """
    from starlette.applications import Starlette
    from starlette.requests import Request as HTTPRequest
    from starlette.responses import HTMLResponse, JSONResponse, StreamingResponse
    from starlette.routing import Route

    metrics = Metrics()
    batcher = Batcher(generator, max_batch=max_batch, batch_window_s=batch_window_s, chunk=chunk, metrics=metrics)
    cfg = generator.cfg
    limit = min(max_tokens_limit, cfg.max_seq_len - 1)
    info = {"model": {"style": cfg.style, "d_model": cfg.d_model, "n_layers": cfg.n_layers,
                      "vocab_size": cfg.vocab_size, "max_seq_len": cfg.max_seq_len},
            "mesh": {k: int(v) for k, v in generator.mesh.shape.items()},
            "device": str(generator.mesh.devices.flat[0].device_kind), "max_batch": max_batch,
            "max_tokens_limit": limit}
    description = description or (f"{cfg.style} model, {cfg.n_layers} layers, d_model {cfg.d_model}, "
                                   f"context {cfg.max_seq_len}, on {info['device']}")

    async def generate(request: HTTPRequest):
        try:
            try:
                body = json.loads(await request.body() or b"null")
            except json.JSONDecodeError as e:
                raise BadRequest(f"the body is not valid JSON: {e}") from None
            settings = parse_request(body, generator.tokenizer, max_tokens_limit=limit, max_seq_len=cfg.max_seq_len,
                                     default_max_tokens=min(64, limit))
        except BadRequest as e:
            metrics.add(rejected=1)
            return JSONResponse({"error": str(e)}, status_code=e.status)
        metrics.add(requests=1)
        loop = asyncio.get_running_loop()
        req = Request(**settings, loop=loop, events=asyncio.Queue())
        batcher.submit(req)
        if not req.stream:
            while True:
                event = await req.events.get()
                if event.get("done"):
                    return JSONResponse(event, status_code=500 if "error" in event else 200)

        async def lines():
            while True:
                event = await req.events.get()
                yield json.dumps(event) + "\n"
                if event.get("done"):
                    return

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    async def health(_):
        return JSONResponse({"status": "ok", **info})

    async def metrics_route(_):
        return JSONResponse(metrics.as_dict(batcher.queue_depth))

    async def page(_):
        return HTMLResponse(PAGE.replace("MODEL_DESCRIPTION", html.escape(description)))

    @asynccontextmanager
    async def lifespan(_app):
        batcher.start()
        try:
            yield
        finally:
            batcher.stop()

    app = Starlette(routes=[Route("/generate", generate, methods=["POST"]), Route("/health", health),
                            Route("/metrics", metrics_route), Route("/", page)], lifespan=lifespan)
    app.state.batcher, app.state.metrics = batcher, metrics
    return app
