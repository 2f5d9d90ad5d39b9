"""The OpenAI-compatible completions API: `POST /v1/completions` bodies in, completion objects and SSE chunks out.

    settings = parse_completion(body, limits, model="tiny")      # BadRequest (400, 404 for another model) on error
    completion(final_event, ...)                                  # {"id", "object": "text_completion", "choices", ...}
    sse(chunk(...)), sse("[DONE]")                                # streaming: `data: {...}` lines, then [DONE]

Accepted fields: model (must be the served one when given), prompt (a string, or a list holding one string),
max_tokens (default 16), temperature (default 1), top_p, seed (default: a fresh random one per request, as OpenAI
does), stop (a string or up to 4), stream, stream_options.include_usage, echo, user, and `top_k` as vLLM accepts it.
Fields OpenAI defines that this server cannot honour (n > 1, best_of > 1, logprobs, suffix, presence or frequency
penalties, logit_bias) are refused with 400 naming the field rather than silently ignored; unknown fields too.
The same settings give the same tokens as `/generate` (same seed, same sampling path). Errors use OpenAI's shape:
{"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from jaxperf.generate.requests import BadRequest, Limits, prompt_ids, sampling_fields

MAX_STOPS = 4
FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
          "echo", "user", "n", "best_of", "logprobs", "suffix", "presence_penalty", "frequency_penalty", "logit_bias"}
# Field -> the values that mean "not used" (anything else asks for a feature this server does not have).
_UNSUPPORTED = {"n": (1,), "best_of": (1,), "logprobs": (0,), "suffix": ("",), "presence_penalty": (0, 0.0),
                "frequency_penalty": (0, 0.0), "logit_bias": ({},)}


def parse_completion(body: Any, limits: Limits, *, model: str) -> dict[str, Any]:
    """Validate a /v1/completions body; returns the engine settings plus stream, include_usage, echo and stop."""
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise BadRequest(f"unknown field(s) {unknown}; accepted: {sorted(FIELDS)}", param=unknown[0])
    asked = body.get("model")
    if asked is not None and asked != model:
        raise BadRequest(f"the model {asked!r} is not served here; this server serves {model!r} (GET /v1/models)",
                         status=404, param="model")
    for name, neutral in _UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and not (type(value) is not bool and value in neutral):
            raise BadRequest(f"'{name}'={value!r} is not supported by this server (only {neutral[0]!r} or null)",
                             param=name)
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise BadRequest("'prompt' as a list must hold exactly one string (one completion per request)",
                             param="prompt")
        prompt = prompt[0]
    settings = sampling_fields(body, limits, default_max_tokens=min(16, limits.max_tokens), default_temperature=1.0,
                               default_seed=secrets.randbelow(2**32))
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"'stream' must be true or false, got {stream!r}", param="stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream or not isinstance(options, dict) or set(options) - {"include_usage"} \
                or not isinstance(options.get("include_usage", False), bool):
            raise BadRequest("'stream_options' must be {\"include_usage\": true|false} and needs \"stream\": true",
                             param="stream_options")
        include_usage = options.get("include_usage", False)
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise BadRequest(f"'echo' must be true or false, got {echo!r}", param="echo")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise BadRequest(f"'user' must be a string, got {user!r}", param="user")
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest(f"'stop' must be a non-empty string or a list of at most {MAX_STOPS} of them, got {stop!r}",
                         param="stop")
    return {"prompt_ids": prompt_ids(prompt, limits), **settings, "stream": stream, "include_usage": include_usage,
            "echo": echo, "stop": tuple(stops), "prompt": prompt}


def error(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    kind = {404: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
            499: "cancelled", 504: "timeout"}.get(status, "invalid_request_error" if status < 500 else "server_error")
    code = "model_not_found" if status == 404 and param == "model" else None
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def envelope(request_id: str, model: str, created: int) -> dict[str, Any]:
    return {"id": f"cmpl-{request_id}", "object": "text_completion", "created": created, "model": model}


def completion(final: dict, *, request_id: str, model: str, created: int, prefix: str = "") -> dict[str, Any]:
    """The non-streaming answer for a final scheduler event."""
    prompt, done = final["prompt_tokens"], final["completion_tokens"]
    return {**envelope(request_id, model, created),
            "choices": [{"text": prefix + (final["text"] or ""), "index": 0, "logprobs": None,
                         "finish_reason": final["finish_reason"]}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}}


def chunk(text: str, finish_reason: str | None, *, request_id: str, model: str, created: int) -> dict[str, Any]:
    """One streamed piece."""
    return {**envelope(request_id, model, created),
            "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}]}


def usage_chunk(final: dict, *, request_id: str, model: str, created: int) -> dict[str, Any]:
    prompt, done = final["prompt_tokens"], final["completion_tokens"]
    return {**envelope(request_id, model, created), "choices": [],
            "usage": {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}}


def sse(data: Any) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def models(model: str, created: int | None = None) -> dict[str, Any]:
    """GET /v1/models."""
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created or int(time.time()),
                                        "owned_by": "jaxperf"}]}


__all__ = ["FIELDS", "chunk", "completion", "error", "models", "parse_completion", "sse", "usage_chunk"]
