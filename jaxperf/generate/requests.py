"""Reading and validating request bodies, shared by `/generate` and the OpenAI-style `/v1/completions`.

    body = decode_body(raw_bytes)                       # strict UTF-8 and JSON, no lone surrogates
    settings = parse_generate(body, limits)             # /generate's fields, every number range-checked

Every problem raises `BadRequest(message, status, param)` with one line that names the field, the value, the allowed
range and the fix; the server turns it into a 4xx JSON answer. Ranges: max_tokens in [1, limit], temperature in
[0, 100], top_k in [0, vocabulary size], top_p in (0, 1], seed in [0, 2**32 - 1]. A prompt longer than the model's
context is 422; a body larger than the server's cap is 413 (checked before the body is read when it says its size).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from jaxperf.generate.sampling import MAX_TEMPERATURE

SEED_MAX = 2**32 - 1
GENERATE_FIELDS = {"prompt", "max_tokens", "temperature", "top_k", "top_p", "seed", "stream"}


class BadRequest(ValueError):
    """A request the server refuses: `status` (4xx) and the field it is about (`param`, or None)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


@dataclasses.dataclass(frozen=True)
class Limits:
    """What a request may ask of this server and model."""

    max_tokens: int  # the server's cap on max_tokens (at most max_seq_len - 1)
    max_seq_len: int  # prompt + output positions a request can have (the model's context, or a shorter cache)
    vocab_size: int
    tokenizer: Any
    max_body_bytes: int = 1 << 20


def decode_body(raw: bytes) -> Any:
    """The JSON value of a request body, decoded strictly (invalid UTF-8, NaN/Infinity and lone surrogates refused)."""
    if not raw.strip():
        raise BadRequest('the body is empty: send a JSON object such as {"prompt": "Once upon a time"}')
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(f"the body is not valid UTF-8 (byte {e.start}, 0x{raw[e.start]:02x}: {e.reason}); send "
                         f"the JSON encoded as UTF-8") from None

    def constant(name):
        raise BadRequest(f"the body holds {name}, which is not JSON; send a finite number")

    try:
        value = json.loads(text, parse_constant=constant)
    except json.JSONDecodeError as e:
        raise BadRequest(f"the body is not valid JSON: {e}") from None
    except RecursionError:
        raise BadRequest("the body's JSON is nested too deeply; send a flat object of fields") from None
    _check_strings(value, "")
    return value


def _check_strings(value: Any, where: str) -> None:
    """BadRequest for a string (key or value) holding a lone surrogate: it has no UTF-8 form, so no tokens."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            field = f"'{where}'" if where else "a string"
            raise BadRequest(f"{field} holds a lone surrogate (U+{ord(value[e.start]):04X} at character {e.start}); "
                             f"\\ud800-\\udfff escapes must come in high-low pairs", param=where or None) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_strings(k, where)
            _check_strings(v, k if not where else f"{where}.{k}")
    elif isinstance(value, list):
        for v in value:
            _check_strings(v, where)


def number(body: dict, name: str, kind: type, default: Any, lo: float, hi: float, *, lo_open: bool = False,
           hint: str = "") -> Any:
    """body[name] (or `default` when absent or null) as `kind`, refused unless lo <= x <= hi (lo < x if lo_open)."""
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and (isinstance(value, int) or math.isfinite(value))
    if kind is int:
        ok = ok and (isinstance(value, int) or float(value).is_integer())
    if not ok:
        raise BadRequest(f"'{name}' must be {'an integer' if kind is int else 'a number'}, got {value!r}", param=name)
    inside = (lo < value if lo_open else lo <= value) and value <= hi
    if not inside:
        lo_s, hi_s = (f"{lo:g}", f"{hi:g}") if kind is float else (str(int(lo)), str(int(hi)))
        interval = f"({lo_s}, {hi_s}]" if lo_open else f"[{lo_s}, {hi_s}]"
        raise BadRequest(f"'{name}'={value!r} must lie in {interval}{hint}", param=name)
    return kind(value)


def sampling_fields(body: dict, limits: Limits, *, default_max_tokens: int, default_temperature: float,
                    default_seed: int = 0) -> dict[str, Any]:
    """max_tokens, temperature, top_k, top_p and seed of a body, each range-checked (see the module docstring)."""
    return {
        "max_tokens": number(body, "max_tokens", int, default_max_tokens, 1, limits.max_tokens,
                             hint=" (the server's limit)"),
        "temperature": number(body, "temperature", float, default_temperature, 0.0, MAX_TEMPERATURE,
                              hint=" (0 = greedy)"),
        "top_k": number(body, "top_k", int, 0, 0, limits.vocab_size,
                        hint=f" (0 = off; the vocabulary has {limits.vocab_size} tokens)"),
        "top_p": number(body, "top_p", float, 1.0, 0.0, 1.0, lo_open=True, hint=" (1 = off)"),
        "seed": number(body, "seed", int, default_seed, 0, SEED_MAX),
    }


def prompt_ids(prompt: Any, limits: Limits) -> list[int]:
    """The token ids of a prompt string; 422 when it leaves no room to generate in the model's context."""
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("'prompt' is required and must be a non-empty string", param="prompt")
    ids = [int(t) for t in limits.tokenizer.encode(prompt)]
    if not ids:
        raise BadRequest("the prompt encodes to no tokens", param="prompt")
    if len(ids) >= limits.max_seq_len:
        raise BadRequest(f"the prompt is {len(ids)} tokens; this server takes at most {limits.max_seq_len - 1} "
                         f"before generating (a context of {limits.max_seq_len} tokens): shorten it", status=422,
                         param="prompt")
    return ids


def parse_generate(body: Any, limits: Limits) -> dict[str, Any]:
    """Validate a /generate body; returns the settings (prompt_ids, sampling fields, stream) or raises BadRequest."""
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - GENERATE_FIELDS)
    if unknown:
        raise BadRequest(f"unknown field(s) {unknown}; accepted: {sorted(GENERATE_FIELDS)}", param=unknown[0])
    settings = sampling_fields(body, limits, default_max_tokens=min(64, limits.max_tokens), default_temperature=0.8)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"'stream' must be true or false, got {stream!r}", param="stream")
    return {"prompt_ids": prompt_ids(body.get("prompt"), limits), **settings, "stream": stream}


__all__ = ["BadRequest", "GENERATE_FIELDS", "Limits", "SEED_MAX", "decode_body", "number", "parse_generate",
           "prompt_ids", "sampling_fields"]
