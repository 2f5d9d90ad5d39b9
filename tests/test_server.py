"""`jaxperf serve`: the real server on localhost answers concurrent requests correctly and in one batch, streams,
rejects bad requests with 4xx, serves its page and health."""

from __future__ import annotations

import json
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
from jaxperf.generate.server import create_app  # noqa: E402
from jaxperf.models import GPT  # noqa: E402

MAX_SEQ = 48


@pytest.fixture(scope="module")
def server():
    cfg = ModelConfig(style="llama", d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=MAX_SEQ,
                      vocab_size=256, attention_impl="xla", init_std=0.3)
    gen = Generator(GPT(cfg, rngs=nnx.Rngs(0)), ByteTokenizer())
    # A long batching window so that requests sent together are certainly decoded together.
    app = create_app(gen, max_batch=4, batch_window_s=1.0, chunk=4, max_tokens_limit=20)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not srv.started:
        assert time.time() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", gen, app
    srv.should_exit = True
    thread.join(timeout=30)


def _post(url: str, body, *, raw: bytes | None = None):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url + "/generate", data=data, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _get(url: str, path: str):
    with urllib.request.urlopen(url + path, timeout=60) as resp:
        return resp.status, resp.headers.get("content-type", ""), resp.read().decode()


def test_concurrent_requests_are_batched_and_each_gets_its_own_answer(server):
    url, gen, app = server
    bodies = [
        {"prompt": "Once upon", "max_tokens": 12, "temperature": 0.0},
        {"prompt": "a", "max_tokens": 7, "temperature": 0.9, "top_p": 0.9, "seed": 5},
        {"prompt": "The dragon slept", "max_tokens": 10, "temperature": 1.2, "top_k": 8, "seed": 6},
        {"prompt": "xyz", "max_tokens": 5, "temperature": 0.7, "seed": 7, "stream": True},
    ]
    results: list = [None] * len(bodies)

    def call(i):
        results[i] = _post(url, bodies[i])

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    answers = []
    for (status, text), body in zip(results, bodies):
        assert status == 200, text
        if body.get("stream"):
            events = [json.loads(line) for line in text.splitlines()]
            final = events[-1]
            assert final["done"] and all("text" in e for e in events[:-1])
            assert "".join(e["text"] for e in events[:-1]) == final["text"]  # the pieces add up to the answer
            answers.append(final)
        else:
            answers.append(json.loads(text))
    for answer, body in zip(answers, bodies):
        # The same request run alone through the engine (its own seed, its own settings) gives the same tokens.
        alone = gen.generate([body["prompt"]], body["max_tokens"], temperature=body["temperature"],
                             top_k=body.get("top_k", 0), top_p=body.get("top_p", 1.0), seed=[body.get("seed", 0)])
        assert answer["tokens"] == alone[0].tokens, body
        assert answer["text"] == alone[0].text
        assert answer["completion_tokens"] == body["max_tokens"] and answer["finish_reason"] == "length"
        assert answer["prompt_tokens"] == len(body["prompt"].encode())
        assert answer["batch_size"] == 4, answer  # all four went into one decode batch
    status, _, text = _get(url, "/metrics")
    metrics = json.loads(text)
    assert status == 200 and metrics["max_batch_size"] == 4 and metrics["requests"] >= 4, metrics
    assert metrics["tokens_generated"] >= sum(b["max_tokens"] for b in bodies)


@pytest.mark.parametrize("body,status,fragment", [
    ({"max_tokens": 5}, 400, "'prompt' is required"),
    ({"prompt": ""}, 400, "'prompt' is required"),
    ({"prompt": "hi", "temperature": -0.5}, 400, "'temperature'=-0.5 must be >= 0"),
    ({"prompt": "hi", "max_tokens": 21}, 400, "must lie in [1, 20]"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "must lie in [1, 20]"),
    ({"prompt": "hi", "top_p": 0}, 400, "'top_p'=0.0 must lie in (0, 1]"),
    ({"prompt": "hi", "top_k": 2.5}, 400, "'top_k' must be an integer"),
    ({"prompt": "hi", "temprature": 1}, 400, "unknown field(s) ['temprature']"),
    ({"prompt": "x" * MAX_SEQ}, 422, f"the prompt is {MAX_SEQ} tokens"),
    ([1, 2], 400, "must be a JSON object"),
])
def test_bad_requests_get_4xx_with_a_message(server, body, status, fragment):
    url, _, _ = server
    got, text = _post(url, body)
    assert got == status, text
    assert fragment in json.loads(text)["error"], text


def test_invalid_json_and_wrong_method(server):
    url, _, _ = server
    got, text = _post(url, None, raw=b"{not json")
    assert got == 400 and "not valid JSON" in json.loads(text)["error"]
    with pytest.raises(urllib.error.HTTPError) as e:
        _get(url, "/generate")
    assert e.value.code == 405


def test_page_and_health_are_served(server):
    url, _, _ = server
    status, ctype, page = _get(url, "/")
    assert status == 200 and ctype.startswith("text/html")
    assert "<textarea" in page and 'fetch("/generate"' in page and "llama model, 2 layers" in page
    status, _, text = _get(url, "/health")
    health = json.loads(text)
    assert status == 200 and health["status"] == "ok" and health["model"]["max_seq_len"] == MAX_SEQ
    assert health["max_tokens_limit"] == 20
