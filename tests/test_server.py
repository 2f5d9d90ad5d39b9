"""`jaxperf serve`: the real server on localhost. Continuous batching (a short request overtakes a long one, slots are
reused, every answer equals the engine's answer for that request alone), cancellation on disconnect, timeouts,
replicas, the OpenAI-style /v1/completions, and hardening: every bad or poisonous request gets a clear JSON 4xx/5xx
while the valid requests sent with it succeed. Every wait is bounded."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
from flax import nnx

pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")

from jaxperf.config import ModelConfig  # noqa: E402
from jaxperf.data.tokenizer import ByteTokenizer  # noqa: E402
from jaxperf.generate import Generator  # noqa: E402
from jaxperf.generate.scheduler import replica_meshes  # noqa: E402
from jaxperf.generate.server import create_app  # noqa: E402
from jaxperf.models import GPT  # noqa: E402

MAX_SEQ = 48
LIMIT = 40
WAIT = 120  # seconds any single HTTP exchange may take (a first call may compile)


def _generator(device_index: int = 0) -> Generator:
    cfg = ModelConfig(style="llama", d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=MAX_SEQ,
                      vocab_size=256, attention_impl="xla", init_std=0.3)
    return Generator(GPT(cfg, rngs=nnx.Rngs(0)), ByteTokenizer())


class SlowDecode:
    """Wraps a Generator's decode with a pause per call, so a long request is certainly still running while the
    test acts (the model itself decodes these lengths in milliseconds)."""

    def __init__(self, gen: Generator, delay_s: float):
        self.gen, self.delay_s, self.decode = gen, delay_s, gen.decode

    def __call__(self, *args, **kwargs):
        time.sleep(self.delay_s)
        return self.decode(*args, **kwargs)


class Server:
    def __init__(self, app):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = app
        self.srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="critical"))
        self.thread = threading.Thread(target=self.srv.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while not self.srv.started:
            assert time.time() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.05)

    def close(self):
        self.srv.should_exit = True
        self.thread.join(timeout=30)

    def post(self, path: str, body=None, *, raw: bytes | None = None, timeout: float = WAIT):
        data = raw if raw is not None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def get(self, path: str):
        with urllib.request.urlopen(self.url + path, timeout=WAIT) as resp:
            return resp.status, resp.headers.get("content-type", ""), resp.read().decode()

    def metrics(self) -> dict:
        return json.loads(self.get("/metrics")[2])


def wait_until(predicate, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def alone(gen: Generator, body: dict, default_temperature: float = 0.8):
    """The engine's answer for this request alone (its own seed and settings, one row)."""
    return gen.generate([body["prompt"]], body.get("max_tokens", 64), temperature=body.get("temperature",
                                                                                           default_temperature),
                        top_k=body.get("top_k", 0), top_p=body.get("top_p", 1.0), seed=[body.get("seed", 0)])[0]


def concurrently(*calls):
    """Run the calls in threads; their results in order (every join bounded)."""
    out = [None] * len(calls)

    def run(i, fn):
        out[i] = fn()

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=WAIT)
    assert all(o is not None for o in out), "a request did not come back"
    return out


@pytest.fixture(scope="module")
def gen():
    return _generator()


@pytest.fixture(scope="module")
def server(gen):
    srv = Server(create_app(gen, max_batch=4, chunk=4, max_tokens_limit=LIMIT, max_body_bytes=64 * 1024,
                            model_name="tiny-test"))
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def slow(gen):
    """The same model with a pause per decode call and two slots: long requests are long, slots are scarce."""
    pace = SlowDecode(gen, 0.03)
    app = create_app(gen, max_batch=2, chunk=2, max_tokens_limit=LIMIT, request_timeout_s=60)
    for replica in app.state.scheduler.replicas:
        replica.gen = _Paced(gen, pace)
    srv = Server(app)
    yield srv
    srv.close()


class _Paced:
    """A Generator whose decode goes through `pace` (everything else is the Generator's)."""

    def __init__(self, gen, pace):
        self._gen, self.decode = gen, pace

    def __getattr__(self, name):
        return getattr(self._gen, name)


# ---------------------------------------------------------------------------------------------------------------------
# Continuous batching


@pytest.mark.slow
def test_concurrent_requests_each_get_their_own_answer(server, gen):
    bodies = [
        {"prompt": "Once upon", "max_tokens": 12, "temperature": 0.0},
        {"prompt": "a", "max_tokens": 7, "temperature": 0.9, "top_p": 0.9, "seed": 5},
        {"prompt": "The dragon slept", "max_tokens": 10, "temperature": 1.2, "top_k": 8, "seed": 6},
        {"prompt": "xyz", "max_tokens": 5, "temperature": 0.7, "seed": 7, "stream": True},
    ]
    results = concurrently(*[lambda b=b: server.post("/generate", b) for b in bodies])
    for (status, text), body in zip(results, bodies):
        assert status == 200, text
        if body.get("stream"):
            events = [json.loads(line) for line in text.splitlines()]
            answer = events[-1]
            assert answer["done"] and all("text" in e and "tokens" in e for e in events[:-1])
            assert "".join(e["text"] for e in events[:-1]) == answer["text"]  # the pieces add up to the answer
            assert sum((e["tokens"] for e in events[:-1]), []) == answer["tokens"]
        else:
            answer = json.loads(text)
        want = alone(gen, body)
        assert answer["tokens"] == want.tokens and answer["text"] == want.text, body
        assert answer["completion_tokens"] == body["max_tokens"] and answer["finish_reason"] == "length"
        assert answer["prompt_tokens"] == len(body["prompt"].encode())
    metrics = server.metrics()
    assert metrics["completed"] >= 4 and metrics["tokens_generated"] >= sum(b["max_tokens"] for b in bodies)


def _stream_request(srv: Server, path: str, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=WAIT)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    return conn, conn.getresponse()


def test_a_short_request_sent_while_a_long_one_decodes_finishes_first(slow, gen):
    long_body = {"prompt": "Once", "max_tokens": LIMIT, "temperature": 0.9, "seed": 3, "stream": True}
    short_body = {"prompt": "Hi", "max_tokens": 4, "temperature": 0.5, "seed": 4}
    conn, resp = _stream_request(slow, "/generate", long_body)
    finished = {}
    try:
        first = json.loads(resp.readline())  # the long request is decoding now
        assert first["tokens"], first

        def long_rest():
            events = [first] + [json.loads(line) for line in resp.read().decode().splitlines()]
            finished["long"] = time.perf_counter()
            return events

        def short():
            out = slow.post("/generate", short_body)
            finished["short"] = time.perf_counter()
            return out

        events, (status, text) = concurrently(long_rest, short)
    finally:
        conn.close()
    assert status == 200, text
    assert finished["short"] < finished["long"], "the short request waited for the long one"
    short_answer, long_answer = json.loads(text), events[-1]
    assert long_answer["done"] and long_answer["completion_tokens"] == LIMIT
    assert short_answer["tokens"] == alone(gen, short_body).tokens
    assert long_answer["tokens"] == alone(gen, long_body).tokens
    assert short_answer["slot"] != long_answer["slot"]


def test_slots_are_reused_and_every_answer_equals_the_engine_alone(slow, gen):
    before = slow.metrics()["replicas"][0]["slot_uses"]
    bodies = [{"prompt": f"request {i}", "max_tokens": 3 + 2 * i, "temperature": 0.8, "seed": 10 + i}
              for i in range(6)]
    results = concurrently(*[lambda b=b: slow.post("/generate", b) for b in bodies])  # 6 requests, 2 slots
    for (status, text), body in zip(results, bodies):
        assert status == 200, text
        assert json.loads(text)["tokens"] == alone(gen, body).tokens, body
    after = slow.metrics()["replicas"][0]
    uses = [a - b for a, b in zip(after["slot_uses"], before)]
    assert sum(uses) == 6 and len(uses) == 2 and min(uses) >= 2, uses  # both slots served several requests
    assert after["active"] == 0 and after["queue_depth"] == 0


def test_a_client_that_disconnects_frees_its_slot(slow):
    before = slow.metrics()
    conn, resp = _stream_request(slow, "/generate", {"prompt": "Once", "max_tokens": LIMIT, "stream": True})
    assert json.loads(resp.readline())["tokens"]
    wait_until(lambda: slow.metrics()["active"] == 1, 30, "the request to be decoding")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    wait_until(lambda: slow.metrics()["cancelled"] == before["cancelled"] + 1, 30, "the cancellation")
    after = slow.metrics()
    assert after["active"] == 0
    assert after["completed"] == before["completed"]  # it was not decoded to the end
    assert after["tokens_generated"] - before["tokens_generated"] < LIMIT


def test_a_non_streaming_client_that_disconnects_is_cancelled_too(slow):
    before = slow.metrics()["cancelled"]
    conn, _ = None, None
    conn = http.client.HTTPConnection("127.0.0.1", slow.port, timeout=WAIT)
    conn.request("POST", "/generate", json.dumps({"prompt": "Once", "max_tokens": LIMIT}))
    wait_until(lambda: slow.metrics()["active"] == 1, 30, "the request to be decoding")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    wait_until(lambda: slow.metrics()["cancelled"] == before + 1 and slow.metrics()["active"] == 0, 30,
               "the cancellation")


def test_a_timed_out_request_gets_a_clear_error_and_the_others_are_unaffected(gen):
    app = create_app(gen, max_batch=2, chunk=2, max_tokens_limit=LIMIT, request_timeout_s=2.0)
    # Compiled before the clock runs: the short request's 2 s must hold its prefill and one decode call, not a
    # compile on a busy machine.
    app.state.scheduler.warmup(prompt_lengths=(len("Hi") + 1, len("Once upon") + 1))
    for replica in app.state.scheduler.replicas:
        replica.gen = _Paced(gen, SlowDecode(gen, 0.25))  # 40 tokens in 20 calls: about 5 s > 2 s
    compiled = gen.compile_s
    srv = Server(app)
    try:
        short_body = {"prompt": "Hi", "max_tokens": 2, "temperature": 0.0}
        (long_status, long_text), (short_status, short_text) = concurrently(
            lambda: srv.post("/generate", {"prompt": "Once upon", "max_tokens": LIMIT}),
            lambda: srv.post("/generate", short_body))
        assert gen.compile_s == compiled, "a request compiled under the clock: warm up its prompt length"
        assert long_status == 504, long_text
        message = json.loads(long_text)["error"]
        assert "did not finish within 2 s" in message and f"of {LIMIT} tokens were generated" in message, message
        assert short_status == 200 and json.loads(short_text)["tokens"] == alone(gen, short_body).tokens
        m = srv.metrics()
        assert m["timeouts"] == 1 and m["completed"] == 1 and m["active"] == 0
    finally:
        srv.close()


# ---------------------------------------------------------------------------------------------------------------------
# Replicas


def test_two_replicas_both_serve_and_answer_as_one_engine(gen):
    meshes = replica_meshes(2, 1)
    gens = [gen.on(m) for m in meshes]
    srv = Server(create_app(gens, max_batch=2, chunk=4, max_tokens_limit=LIMIT))
    try:
        bodies = [{"prompt": f"story {i}", "max_tokens": 6 + i, "temperature": 0.9, "seed": i} for i in range(6)]
        results = concurrently(*[lambda b=b: srv.post("/generate", b) for b in bodies])
        replicas_used = set()
        for (status, text), body in zip(results, bodies):
            assert status == 200, text
            answer = json.loads(text)
            replicas_used.add(answer["replica"])
            assert answer["tokens"] == alone(gen, body).tokens, body  # the single engine's answer
        per = srv.metrics()["replicas"]
        assert replicas_used == {0, 1}
        assert [r["devices"] for r in per] == [["cpu:0"], ["cpu:1"]]
        assert all(r["requests"] >= 2 for r in per) and sum(r["requests"] for r in per) == 6, per
        assert json.loads(srv.get("/health")[2])["replicas"][1]["devices"] == ["cpu:1"]
    finally:
        srv.close()


def test_replica_meshes_split_the_devices_and_refuse_too_many():
    meshes = replica_meshes(2, 4)
    assert [[d.id for d in m.devices.flat] for m in meshes] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert dict(meshes[0].shape) == {"data": 1, "fsdp": 1, "tensor": 4}
    with pytest.raises(ValueError, match=r"3 replica\(s\) of 4 device\(s\) need 12 devices, found 8"):
        replica_meshes(3, 4)
    rows = replica_meshes(1, 2, axis="data")
    assert dict(rows[0].shape) == {"data": 2, "fsdp": 1, "tensor": 1}


def test_a_replica_with_its_rows_split_over_two_devices_answers_as_one_engine(gen):
    rows_gen = gen.on(replica_meshes(1, 2, axis="data")[0])
    assert rows_gen._rows_local()
    srv = Server(create_app([rows_gen], max_batch=4, chunk=4, max_tokens_limit=LIMIT))
    try:
        bodies = [{"prompt": f"tale {i}", "max_tokens": 3 + 2 * i, "temperature": 0.8, "seed": i} for i in range(5)]
        results = concurrently(*[lambda b=b: srv.post("/generate", b) for b in bodies])
        for (status, text), body in zip(results, bodies):
            assert status == 200, text
            assert json.loads(text)["tokens"] == alone(gen, body).tokens, body
        assert srv.metrics()["replicas"][0]["devices"] == ["cpu:0", "cpu:1"]
    finally:
        srv.close()


# ---------------------------------------------------------------------------------------------------------------------
# /v1/completions


def test_v1_completions_match_generate_for_the_same_settings(server):
    settings = {"prompt": "Once upon a time", "max_tokens": 9, "temperature": 0.9, "top_p": 0.95, "top_k": 20,
                "seed": 11}
    status, text = server.post("/generate", settings)
    assert status == 200, text
    native = json.loads(text)
    status, text = server.post("/v1/completions", {"model": "tiny-test", **settings})
    assert status == 200, text
    completion = json.loads(text)
    assert completion["object"] == "text_completion" and completion["model"] == "tiny-test"
    choice = completion["choices"][0]
    assert choice["text"] == native["text"] and choice["finish_reason"] == "length" and choice["index"] == 0
    assert completion["usage"] == {"prompt_tokens": 16, "completion_tokens": 9, "total_tokens": 25}
    # Streaming: server-sent events whose pieces add up to the same text, then [DONE].
    conn, resp = _stream_request(server, "/v1/completions", {**settings, "stream": True,
                                                             "stream_options": {"include_usage": True}})
    try:
        assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
        lines = [line for line in resp.read().decode().split("\n\n") if line]
    finally:
        conn.close()
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == native["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 9
    status, _, models = server.get("/v1/models")
    assert json.loads(models)["data"][0]["id"] == "tiny-test"


def test_v1_stop_strings_end_the_text_before_them(server, gen):
    body = {"prompt": "abc", "max_tokens": 30, "temperature": 0.0, "seed": 0}
    full = json.loads(server.post("/v1/completions", body)[1])["choices"][0]["text"]
    stop = full[5:7]
    got = json.loads(server.post("/v1/completions", {**body, "stop": [stop]})[1])["choices"][0]
    assert got["text"] == full[: full.find(stop)] and got["finish_reason"] == "stop", (full, stop, got)


@pytest.mark.parametrize("body,status,fragment,param", [
    ({"prompt": "hi", "n": 2}, 400, "'n'=2 is not supported", "n"),
    ({"prompt": "hi", "logprobs": 3}, 400, "'logprobs'=3 is not supported", "logprobs"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "the model 'gpt-4' is not served here", "model"),
    ({"prompt": "hi", "max_tokens": 0}, 400, f"'max_tokens'=0 must lie in [1, {LIMIT}]", "max_tokens"),
    ({"prompt": "hi", "temperature": 101}, 400, "'temperature'=101 must lie in [0, 100]", "temperature"),
    ({"prompt": "hi", "top_k": 2**40}, 400, "'top_k'=1099511627776 must lie in [0, 256]", "top_k"),
    ({"prompt": "hi", "seed": -1}, 400, "'seed'=-1 must lie in [0, 4294967295]", "seed"),
    ({"prompt": "hi", "stop": ["a"] * 5}, 400, "'stop' must be a non-empty string or a list of at most 4", "stop"),
    ({"prompt": ["a", "b"]}, 400, "must hold exactly one string", "prompt"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "needs \"stream\": true", "stream_options"),
    ({"prompt": "hi", "frobnicate": 1}, 400, "unknown field(s) ['frobnicate']", "frobnicate"),
])
def test_v1_bad_fields_get_4xx_with_the_reason(server, body, status, fragment, param):
    got, text = server.post("/v1/completions", body)
    assert got == status, text
    err = json.loads(text)["error"]
    assert fragment in err["message"] and err["param"] == param, err
    assert err["type"] == "invalid_request_error"


# ---------------------------------------------------------------------------------------------------------------------
# Bad requests and hardening


@pytest.mark.parametrize("body,status,fragment", [
    ({"max_tokens": 5}, 400, "'prompt' is required"),
    ({"prompt": ""}, 400, "'prompt' is required"),
    ({"prompt": "hi", "temperature": -0.5}, 400, "'temperature'=-0.5 must lie in [0, 100] (0 = greedy)"),
    ({"prompt": "hi", "max_tokens": LIMIT + 1}, 400, f"must lie in [1, {LIMIT}]"),
    ({"prompt": "hi", "max_tokens": 0}, 400, f"must lie in [1, {LIMIT}]"),
    ({"prompt": "hi", "top_p": 0}, 400, "'top_p'=0 must lie in (0, 1]"),
    ({"prompt": "hi", "top_p": 1.5}, 400, "'top_p'=1.5 must lie in (0, 1]"),
    ({"prompt": "hi", "top_k": 2.5}, 400, "'top_k' must be an integer"),
    ({"prompt": "hi", "top_k": 257}, 400, "'top_k'=257 must lie in [0, 256]"),
    ({"prompt": "hi", "seed": 2**32}, 400, "'seed'=4294967296 must lie in [0, 4294967295]"),
    ({"prompt": "hi", "max_tokens": True}, 400, "'max_tokens' must be an integer, got True"),
    ({"prompt": "hi", "stream": "yes"}, 400, "'stream' must be true or false"),
    ({"prompt": "hi", "temprature": 1}, 400, "unknown field(s) ['temprature']"),
    ({"prompt": "x" * MAX_SEQ}, 422, f"the prompt is {MAX_SEQ} tokens"),
    ([1, 2], 400, "must be a JSON object"),
])
def test_bad_requests_get_4xx_with_a_message(server, body, status, fragment):
    got, text = server.post("/generate", body)
    assert got == status, text
    assert fragment in json.loads(text)["error"], text


POISON = {
    "top_k=2**40": (b'{"prompt": "hi", "top_k": 1099511627776}', 400, "'top_k'=1099511627776 must lie in [0, 256]"),
    "invalid utf-8": (b'{"prompt": "caf\xe9"}', 400, "the body is not valid UTF-8 (byte 15, 0xe9"),
    "lone surrogate": (b'{"prompt": "a\\ud800b"}', 400, "'prompt' holds a lone surrogate (U+D800 at character 1)"),
    "NaN literal": (b'{"prompt": "hi", "temperature": NaN}', 400, "the body holds NaN, which is not JSON"),
    "deep nesting": (b"[" * 100_000 + b"]" * 100_000, 413, "this server takes at most 65536"),
    "nested": (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, "nested too deeply"),
    "not json": (b"{not json", 400, "the body is not valid JSON"),
    "empty": (b"", 400, "the body is empty"),
}


@pytest.mark.parametrize("name", list(POISON))
def test_a_poison_request_sent_with_valid_ones_leaves_them_unharmed(server, gen, name):
    raw, status, fragment = POISON[name]
    valid = [{"prompt": f"valid {i}", "max_tokens": 5, "temperature": 0.8, "seed": i} for i in range(3)]
    calls = [lambda: server.post("/generate", raw=raw)] + [lambda b=b: server.post("/generate", b) for b in valid]
    (got, text), *answers = concurrently(*calls)
    assert got == status, text
    assert fragment in json.loads(text)["error"], text
    for (s, t), body in zip(answers, valid):
        assert s == 200 and json.loads(t)["tokens"] == alone(gen, body).tokens, t


def test_an_internal_failure_is_json_500_and_counted(server, gen, monkeypatch):
    original = gen.tokenizer.encode

    def encode(text):
        if text == "boom":
            raise RuntimeError("tokenizer exploded")
        return original(text)

    monkeypatch.setattr(gen.tokenizer, "encode", encode)
    before = server.metrics()
    valid = {"prompt": "fine", "max_tokens": 4, "temperature": 0.0}
    (got, text), (ok, answer) = concurrently(lambda: server.post("/generate", {"prompt": "boom"}),
                                             lambda: server.post("/generate", valid))
    assert got == 500 and json.loads(text)["error"] == "internal error: RuntimeError: tokenizer exploded", text
    assert ok == 200 and json.loads(answer)["text"] == alone(gen, valid).text
    got, text = server.post("/v1/completions", {"prompt": "boom"})
    assert got == 500 and json.loads(text)["error"]["type"] == "server_error"
    assert server.metrics()["http_errors"] == before["http_errors"] + 2


def test_a_failing_insert_fails_only_its_request(slow, gen, monkeypatch):
    real_insert = gen.insert

    def insert(state, prompts, slots, **kw):
        if any(p == list(b"poison") for p in prompts):
            raise RuntimeError("this prompt breaks the prefill")
        return real_insert(state, prompts, slots, **kw)

    monkeypatch.setattr(gen, "insert", insert)
    before = slow.metrics()
    valid = {"prompt": "valid", "max_tokens": 4, "temperature": 0.0}
    (bad, bad_text), (ok, text) = concurrently(lambda: slow.post("/generate", {"prompt": "poison"}),
                                               lambda: slow.post("/generate", valid))
    assert bad == 500 and "generation failed: RuntimeError: this prompt breaks the prefill" in bad_text
    assert ok == 200 and json.loads(text)["tokens"] == alone(gen, valid).tokens
    assert slow.metrics()["failed"] == before["failed"] + 1


def test_a_huge_body_is_refused_without_stalling_health(server):
    result = {}

    def send_huge():
        s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        try:
            s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 20000000\r\n\r\n")
            try:
                s.sendall(b'{"prompt": "' + b"a" * 2_000_000)
            except OSError:
                pass  # the server may answer and close before taking it all
            result["reply"] = s.recv(65536).decode(errors="replace")
        finally:
            s.close()

    sender = threading.Thread(target=send_huge)
    sender.start()
    t0 = time.perf_counter()
    status, _, text = server.get("/health")
    assert status == 200 and json.loads(text)["status"] == "ok" and time.perf_counter() - t0 < 10
    sender.join(timeout=60)
    assert not sender.is_alive()
    reply = result["reply"]
    assert reply.startswith("HTTP/1.1 413"), reply[:200]
    assert "the body is 20000000 bytes; this server takes at most 65536" in reply
    # A chunked body (no Content-Length) is cut off at the cap while it is read.
    status, text = server.post("/generate", raw=iter([b'{"prompt": "' + b"a" * 70_000 + b'"}']))
    assert status == 413 and "over 65536 bytes" in json.loads(text)["error"]


def test_clients_that_leave_mid_body_are_counted_and_logged_in_one_line(gen, caplog):
    srv = Server(create_app(gen, max_batch=2, chunk=4))
    try:
        with caplog.at_level(logging.WARNING):
            for path in ("/generate", "/v1/completions", "/generate"):
                s = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
                s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          f"Content-Length: 100\r\n\r\n{{\"prompt\": ".encode())
                time.sleep(0.2)  # the handler is reading the body when the client goes
                s.close()
            wait_until(lambda: srv.metrics()["client_gone"] == 3, 30, "three clients counted as gone")
        metrics = srv.metrics()
        assert metrics["http_errors"] == 0 and metrics["rejected"] == 0 and metrics["received"] == 0, metrics
        notes = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(notes) == 1 and notes[0].name == "jaxperf.serve", [r.getMessage() for r in notes]
        message = notes[0].getMessage()  # the others come within GONE_NOTE_S of it: counted, not logged
        assert "POST /generate: the client went away after 11 of 100 body bytes; 1 such request(s) so far" in message
        assert "\n" not in message and not notes[0].exc_info
    finally:
        srv.close()


def test_wrong_method_unknown_route_page_and_health_are_json_or_html(server):
    got, text = server.post("/health", {})
    assert got == 405 and json.loads(text)["error"] == "POST is not allowed on /health"
    with pytest.raises(urllib.error.HTTPError) as e:
        server.get("/nowhere")
    assert e.value.code == 404 and "no route /nowhere" in json.loads(e.value.read().decode())["error"]
    status, ctype, page = server.get("/")
    assert status == 200 and ctype.startswith("text/html")
    assert "<textarea" in page and 'fetch("/generate"' in page and "llama model, 2 layers" in page
    status, _, text = server.get("/health")
    health = json.loads(text)
    assert status == 200 and health["status"] == "ok" and health["model"]["max_seq_len"] == MAX_SEQ
    assert health["max_tokens_limit"] == LIMIT and health["batching"] == "continuous"
    assert server.metrics()["rejected"] > 0


@pytest.mark.slow
def test_cli_serve_runs_replicas_and_answers_v1(tmp_path):
    import dataclasses
    import subprocess
    import sys

    from jaxperf.config import get_config, to_dict, validate_model
    from jaxperf.checkpoint import Checkpointer
    from helpers import cli_env, free_port

    cfg = get_config("tiny", ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.max_seq_len=32"])
    cfg = dataclasses.replace(cfg, model=validate_model(cfg.model))
    run = tmp_path / "story"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(to_dict(cfg)))
    with Checkpointer(run / "checkpoints") as ckpt:
        ckpt.save(1, {"params": nnx.to_pure_dict(nnx.state(GPT(cfg.model, rngs=nnx.Rngs(0)), nnx.Param))})
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "jaxperf.cli", "serve", "--checkpoint", str(run), "--port",
                             str(port), "--replicas", "2", "--max-batch", "2", "--quantize", "int8"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=cli_env(tmp_path, devices=2), cwd=tmp_path)
    try:
        lines = []
        deadline = time.time() + 240
        while not any(line.startswith("serving") for line in lines):
            assert time.time() < deadline and proc.poll() is None, "".join(lines)
            lines.append(proc.stdout.readline())
        assert "int8 weights" in lines[-1] and "2 replica(s)" in lines[-1], lines
        srv = Server.__new__(Server)
        srv.url, srv.port = f"http://127.0.0.1:{port}", port

        def listening():
            try:
                return srv.get("/health")[0] == 200
            except OSError:
                return False

        wait_until(listening, 60, "the server to listen")  # the port is held; uvicorn accepts just after "serving"
        status, text = srv.post("/v1/completions", {"model": "story", "prompt": "abc", "max_tokens": 5, "seed": 1})
        assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 5, text
        health = json.loads(srv.get("/health")[2])
        assert [r["devices"] for r in health["replicas"]] == [["cpu:0"], ["cpu:1"]] and health["model"]["int8"]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_cli_serve_refuses_rows_that_do_not_split_over_a_replica(tmp_path, capsys):
    from jaxperf.cli import main

    (tmp_path / "config.json").write_text("{}")
    assert main(["serve", "--checkpoint", str(tmp_path), "--replica-axis", "data", "--devices-per-replica", "2",
                 "--max-batch", "3", "--no-warmup"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("jaxperf serve: --max-batch 3 rows do not split over --devices-per-replica 2 (--replica-axis "
                   "data): give a multiple of 2")


@pytest.mark.parametrize("flags, message", [
    (["--max-batch", "0"], "--max-batch 0 must be at least 1 (rows one replica decodes together)"),
    (["--chunk", "0"], "--chunk 0 must be at least 1"),
    (["--max-len", "1"], "--max-len 1 must be at least 2"),
    (["--prefill-budget", "0"], "--prefill-budget 0 must be at least 1"),
    (["--request-timeout-s", "0"], "--request-timeout-s 0.0 must be a positive number of seconds"),
    (["--port", "70000"], "--port 70000 must be at most 65535"),
])
def test_cli_serve_names_the_flag_before_reading_anything(tmp_path, capsys, monkeypatch, flags, message):
    from jaxperf.cli import main, serve

    monkeypatch.setattr(serve, "load_generator", lambda *a, **k: pytest.fail("the checkpoint was read"))
    (tmp_path / "config.json").write_text("{}")
    assert main(["serve", "--checkpoint", str(tmp_path), "--port", "0", *flags]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("jaxperf serve: ") and message in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_cli_serve_on_a_busy_port_fails_before_reading_or_compiling(tmp_path, capsys, monkeypatch):
    from jaxperf.cli import main, serve

    monkeypatch.setattr(serve, "load_generator", lambda *a, **k: pytest.fail("the checkpoint was read"))
    (tmp_path / "config.json").write_text("{}")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert main(["serve", "--checkpoint", str(tmp_path), "--port", str(port)]) == 2
    out, err = capsys.readouterr()
    assert "serving" not in out and "compiled" not in out, out
    assert err == (f"jaxperf serve: --port {port} on 127.0.0.1 is in use by another process (Address already in use "
                   f"[errno 98]): stop it, or choose another --port (--port 0 picks a free one)\n"), err
