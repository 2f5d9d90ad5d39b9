"""`jaxperf serve`: an HTTP API over replicas of a Generator with continuous batching (jaxperf.generate.scheduler).

    jaxperf serve --checkpoint runs/tiny --port 8000 --replicas 2
    curl -s localhost:8000/generate -d '{"prompt": "def ", "max_tokens": 64, "temperature": 0.8}'
    curl -sN localhost:8000/generate -d '{"prompt": "def ", "stream": true}'      # one JSON object per line
    curl -s localhost:8000/v1/completions -d '{"prompt": "def ", "max_tokens": 64}' # OpenAI-style; "stream": SSE

Routes:
  POST /generate        {"prompt": str, "max_tokens": int, "temperature": float, "top_k": int, "top_p": float,
                         "seed": int, "stream": bool}; only "prompt" is required. Answers {"text", "tokens",
                         "prompt_tokens", "completion_tokens", "finish_reason", "replica", "slot", "batch_size",
                         "queue_s", "ttft_s", "latency_s"}, or with "stream": true, newline-delimited JSON:
                         {"text": piece, "tokens": ids} as tokens arrive, then the same final object with "done": true.
  POST /v1/completions  OpenAI's completions API (jaxperf.generate.openai), JSON or server-sent events.
  GET /v1/models        the served model, as OpenAI lists models.
  GET /health           {"status": "ok", the model, replicas and their devices, limits}
  GET /metrics          counters: received, requests, completed, rejected, failed, timeouts, cancelled, tokens, queue,
                        active rows, slot uses, decode tokens/s, in total and per replica; client_gone (clients
                        that went away before their whole body arrived)
  GET /                 a page to type a prompt and watch the continuation appear

Every answer is JSON, errors included: a bad request gets 400 with {"error": message} naming the field, its value,
the allowed range and the fix (413 for a body over the cap, 422 for a prompt too long for the model; OpenAI's
error shape on /v1); a request that runs past the server's timeout gets 504 and frees its slot; an internal failure
gets 500 with the reason, and only the requests it touched fail. A client that disconnects is cancelled: its slot is
freed at the next chunk boundary; one that goes away before its whole body arrived is counted (`client_gone`) and
logged in one line, at most one every GONE_NOTE_S seconds (a flood of half-open clients is a few lines, not a
traceback each). Bodies are read up to `max_body_bytes` and parsed (and tokenized) off the event
loop, so a huge or slow body never stalls /health.
"""

from __future__ import annotations

import asyncio
import html
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from jaxperf.generate import openai
from jaxperf.generate.engine import Generator
from jaxperf.generate.requests import BadRequest, Limits, decode_body, parse_generate
from jaxperf.generate.scheduler import Request, Scheduler

POLL_S = 0.2  # how often a waiting handler checks that its client is still there
BACKSTOP_S = 30.0  # an answer later than timeout + this is given up by the handler itself (a stuck replica)
GONE_NOTE_S = 10.0  # at most one log line per this many seconds about clients gone before their body arrived

_logger = logging.getLogger("jaxperf.serve")


class ClientGone(Exception):
    """The client closed its connection before its whole request body arrived."""

    def __init__(self, received: int, length: int | None):
        self.received, self.length = received, length
        of = f" of {length}" if length is not None else ""
        super().__init__(f"the client went away after {received}{of} body bytes")


class _HTTPCounters:
    def __init__(self):
        self.lock = threading.Lock()
        self.rejected = 0  # 4xx answers
        self.errors = 0  # 5xx answers from the HTTP layer itself (an exception in a handler)
        self.client_gone = 0  # clients that went away before their whole body arrived
        self._gone_noted = 0  # client_gone when the last line about it was logged
        self._gone_note_at = -GONE_NOTE_S

    def add(self, name: str) -> None:
        with self.lock:
            setattr(self, name, getattr(self, name) + 1)

    def note_gone(self, where: str, e: ClientGone) -> None:
        """Count a client gone mid-body; log one line now unless one was logged in the last GONE_NOTE_S seconds."""
        with self.lock:
            self.client_gone += 1
            now = time.monotonic()
            if now - self._gone_note_at < GONE_NOTE_S:
                return
            since, self._gone_noted, self._gone_note_at = self.client_gone - self._gone_noted, self.client_gone, now
            total = self.client_gone
        more = f" ({since} since the last note)" if since > 1 else ""
        _logger.warning("%s: %s; %d such request(s) so far%s, counted as client_gone in /metrics", where, e, total,
                        more)


async def read_body(request, max_bytes: int) -> bytes:
    """The request body, refused with 413 past `max_bytes` (before reading when Content-Length says so);
    ClientGone when the client leaves before all of it arrived."""
    from starlette.requests import ClientDisconnect

    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise BadRequest(f"Content-Length {length!r} is not a number of bytes")
        if int(length) > max_bytes:
            raise BadRequest(f"the body is {int(length)} bytes; this server takes at most {max_bytes} "
                             f"(jaxperf serve --max-body-bytes)", status=413)
    chunks, size = [], 0
    try:
        async for part in request.stream():
            size += len(part)
            if size > max_bytes:
                raise BadRequest(f"the body is over {max_bytes} bytes, the most this server takes "
                                 f"(jaxperf serve --max-body-bytes)", status=413)
            chunks.append(part)
    except ClientDisconnect:
        raise ClientGone(size, None if length is None else int(length)) from None
    return b"".join(chunks)


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
        stats.textContent = event.completion_tokens + " tokens, " + event.finish_reason + ", first token after " +
          Math.round(1000 * event.ttft_s) + " ms, done after " + Math.round(1000 * event.latency_s) + " ms";
      } else { out.textContent += event.text; }
    }
  }
};
</script></body></html>
"""


def create_app(generators: Generator | Sequence[Generator], *, max_batch: int = 8, max_len: int | None = None,
               chunk: int = 8, batching: str = "continuous", batch_window_s: float = 0.01, prefill_budget: int = 2048,
               max_tokens_limit: int = 512, request_timeout_s: float | None = 120.0, max_body_bytes: int = 1 << 20,
               model_name: str = "jaxperf", description: str = ""):
    """The Starlette application; the replicas' threads start and stop with the app's lifespan.

    Args:
      generators: one Generator per replica (e.g. `gen.on(mesh)` for each of `scheduler.replica_meshes(n)`).
      max_batch: decode rows (slots) per replica; max_len: cache slots per row (default the model's context).
      chunk: decode steps per call between boundaries (admission, streaming, cancellation, timeouts).
      batching: "continuous" or "static" (the baseline; see jaxperf.generate.scheduler).
      batch_window_s: static batching waits this long to fill a batch.
      prefill_budget: padded prompt tokens one admission prefills at most.
      max_tokens_limit: the largest max_tokens a request may ask for.
      request_timeout_s: a request still unanswered after this many seconds gets 504 (None: no timeout).
      max_body_bytes: larger bodies get 413.
      model_name: the name /v1 answers to.
    `app.state.scheduler` and `app.state.http_counters` are reachable for tests and embedding.
    """
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request as HTTPRequest
    from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    gens = [generators] if isinstance(generators, Generator) else list(generators)
    scheduler = Scheduler(gens, slots=max_batch, max_len=max_len, chunk=chunk, batching=batching,
                          batch_window_s=batch_window_s, prefill_budget=prefill_budget)
    counters = _HTTPCounters()
    gen = gens[0]
    cfg = gen.cfg
    context = scheduler.replicas[0].max_len  # the cache slots per row: prompt and output together
    limits = Limits(max_tokens=max(1, min(max_tokens_limit, context - 1)), max_seq_len=context,
                    vocab_size=cfg.vocab_size, tokenizer=gen.tokenizer, max_body_bytes=max_body_bytes)
    info = {"model": {"name": model_name, "style": cfg.style, "d_model": cfg.d_model, "n_layers": cfg.n_layers,
                      "vocab_size": cfg.vocab_size, "max_seq_len": cfg.max_seq_len, "int8": gen.quantized,
                      "weight_bytes": gen.weight_bytes},
            "replicas": [{"devices": [str(d) for d in g.mesh.devices.flat],
                          "mesh": {k: int(v) for k, v in g.mesh.shape.items()}} for g in gens],
            "device": str(gen.mesh.devices.flat[0].device_kind), "max_batch": scheduler.replicas[0].slots,
            "batching": batching, "chunk": chunk, "max_tokens_limit": limits.max_tokens,
            "request_timeout_s": request_timeout_s, "max_body_bytes": max_body_bytes}
    description = description or (f"{cfg.style} model, {cfg.n_layers} layers, d_model {cfg.d_model}, context "
                                   f"{cfg.max_seq_len}, {len(gens)} replica(s) on {info['device']}"
                                   + (", int8 weights" if gen.quantized else ""))

    async def body_of(request: HTTPRequest, parse):
        """Read, decode and validate a body off the event loop; BadRequest on any problem."""
        raw = await read_body(request, max_body_bytes)
        return await asyncio.to_thread(lambda: parse(decode_body(raw)))

    def submit(settings: dict) -> tuple[Request, asyncio.Queue]:
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def deliver(event: dict) -> None:
            loop.call_soon_threadsafe(events.put_nowait, event)

        req = Request(settings["prompt_ids"], settings["max_tokens"], settings["temperature"], settings["top_k"],
                      settings["top_p"], settings["seed"], deliver, stop=settings.get("stop", ()),
                      timeout_s=request_timeout_s)
        scheduler.submit(req)
        return req, events

    async def events_of(req: Request, events: asyncio.Queue, http: HTTPRequest) -> AsyncIterator[dict]:
        """The request's events until its final one; cancels it if the client leaves or the caller stops early."""
        finished = False
        limit = None if request_timeout_s is None else request_timeout_s + BACKSTOP_S
        checked = time.perf_counter()
        try:
            while True:
                try:
                    event = await asyncio.wait_for(events.get(), POLL_S)
                except asyncio.TimeoutError:
                    event = None
                if event is not None:
                    finished = bool(event.get("done"))
                    yield event
                    if finished:
                        return
                now = time.perf_counter()
                if now - checked >= POLL_S:  # also while events flow: a non-streaming client sees none of them
                    checked = now
                    if await http.is_disconnected():
                        return
                if event is None and limit is not None and now - req.arrived > limit:
                    finished = True
                    req.cancel()
                    yield {"error": f"no answer within {limit:g} s: the server is overloaded or stuck; retry later",
                           "status": 504, "done": True}
                    return
        finally:
            if not finished:
                req.cancel()

    def reject(e: BadRequest, openai_shape: bool):
        counters.add("rejected")
        body = openai.error(str(e), e.status, e.param) if openai_shape else {"error": str(e)}
        return JSONResponse(body, status_code=e.status)

    def gone(request: HTTPRequest, e: ClientGone):
        client = f"{request.client.host}:{request.client.port}" if request.client else "a client"
        counters.note_gone(f"{client} {request.method} {request.url.path}", e)
        return Response(status_code=499)  # nobody reads it

    async def generate(request: HTTPRequest):
        try:
            settings = await body_of(request, lambda b: parse_generate(b, limits))
        except BadRequest as e:
            return reject(e, False)
        except ClientGone as e:
            return gone(request, e)
        req, events = submit(settings)
        if not settings["stream"]:
            async for event in events_of(req, events, request):
                if event.get("done"):
                    if "error" in event:
                        return JSONResponse({"error": event["error"]}, status_code=event["status"])
                    return JSONResponse(event)
            return Response(status_code=499)  # the client is gone

        async def lines():
            async for event in events_of(req, events, request):
                yield json.dumps({k: v for k, v in event.items() if k != "status"}) + "\n"

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    async def completions(request: HTTPRequest):
        try:
            settings = await body_of(request, lambda b: openai.parse_completion(b, limits, model=model_name))
        except BadRequest as e:
            return reject(e, True)
        except ClientGone as e:
            return gone(request, e)
        req, events = submit(settings)
        created = int(time.time())
        ids = dict(request_id=req.id, model=model_name, created=created)
        prefix = settings["prompt"] if settings["echo"] else ""
        if not settings["stream"]:
            async for event in events_of(req, events, request):
                if event.get("done"):
                    if "error" in event:
                        return JSONResponse(openai.error(event["error"], event["status"]),
                                            status_code=event["status"])
                    return JSONResponse(openai.completion(event, prefix=prefix, **ids))
            return Response(status_code=499)

        async def stream():
            if prefix:
                yield openai.sse(openai.chunk(prefix, None, **ids))
            async for event in events_of(req, events, request):
                if "error" in event:
                    yield openai.sse(openai.error(event["error"], event["status"]))
                elif event.get("done"):
                    yield openai.sse(openai.chunk("", event["finish_reason"], **ids))
                    if settings["include_usage"]:
                        yield openai.sse(openai.usage_chunk(event, **ids))
                elif event["text"] or event["tokens"]:
                    yield openai.sse(openai.chunk(event["text"], None, **ids))
            yield openai.sse("[DONE]")

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def health(_):
        return JSONResponse({"status": "ok", **info})

    async def metrics_route(_):
        with counters.lock:
            http = {"rejected": counters.rejected, "http_errors": counters.errors, "client_gone": counters.client_gone}
        return JSONResponse({**scheduler.metrics(), **http})

    async def models_route(_):
        return JSONResponse(openai.models(model_name))

    async def page(_):
        return HTMLResponse(PAGE.replace("MODEL_DESCRIPTION", html.escape(description)))

    async def http_error(request: HTTPRequest, exc: HTTPException):
        if exc.status_code < 500:
            counters.add("rejected")
        message = {404: f"no route {request.url.path}; see / for the page, /health, /metrics, /generate and /v1",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
        return JSONResponse({"error": message}, status_code=exc.status_code)

    async def internal_error(request: HTTPRequest, exc: Exception):
        counters.add("errors")
        message = f"internal error: {type(exc).__name__}: {str(exc)[:300]}"
        body = openai.error(message, 500) if request.url.path.startswith("/v1") else {"error": message}
        return JSONResponse(body, status_code=500)

    @asynccontextmanager
    async def lifespan(_app):
        scheduler.start()
        try:
            yield
        finally:
            scheduler.stop()

    app = Starlette(routes=[Route("/generate", generate, methods=["POST"]),
                            Route("/v1/completions", completions, methods=["POST"]),
                            Route("/v1/models", models_route), Route("/health", health),
                            Route("/metrics", metrics_route), Route("/", page)],
                    exception_handlers={HTTPException: http_error, Exception: internal_error}, lifespan=lifespan)
    app.state.scheduler, app.state.http_counters, app.state.limits = scheduler, counters, limits
    return app


__all__ = ["GONE_NOTE_S", "PAGE", "ClientGone", "create_app", "read_body"]
