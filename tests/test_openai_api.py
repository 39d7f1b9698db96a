"""OpenAI-compatible HTTP front end against a scripted fake backend, driven by the official openai client."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from engine.request import TokenLogprobs
from engine.tiny_model import make_tiny_model
from engine.tokenizer import Tokenizer
from router.backend import GenerationError, GenerationRequest, SpeculativeParams, TokenEvent
from router.detokenizer import IncrementalDetokenizer, token_bytes
from router.openai_api import HttpMetrics, build_app, run_http
from router.openai_protocol import InvalidRequest, parse_chat, parse_completion

MODEL = "tiny-test"
MAX_LEN = 64
TEXT = " The quick brown fox jumps over the lazy dog."


class FakeBackend:
    """Streams ``script`` (capped at max_tokens); can fail at a token index or hang after some tokens."""

    def __init__(self) -> None:
        self.script: list[int] = []
        self.finish_reason = "stop"
        self.error_at: int | None = None
        self.error_code = 503
        self.hang_after: int | None = None
        self.requests: list[GenerationRequest] = []
        self.cancelled = threading.Event()  # aclose() (GeneratorExit) or task cancellation reached us
        self.completed = threading.Event()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        self.requests.append(request)
        k = request.params.logprobs
        n = min(len(self.script), request.params.max_tokens)
        try:
            for i, t in enumerate(self.script[:n]):
                if self.error_at == i:
                    raise GenerationError("decode worker died", self.error_code)
                if self.hang_after == i:
                    await asyncio.sleep(3600)
                await asyncio.sleep(0)
                lps = (
                    []
                    if k is None
                    else [TokenLogprobs(t, -0.25, tuple(((t + j) % 400 + 4, -1.0 - j) for j in range(k)))]
                )
                last = i == n - 1
                reason = (self.finish_reason if n == len(self.script) else "length") if last else None
                yield TokenEvent([t], lps, finished=last, finish_reason=reason)
            self.completed.set()
        except (GeneratorExit, asyncio.CancelledError):
            self.cancelled.set()
            raise


class Server:
    """The app on a free localhost port, in its own event loop thread (the tests use blocking clients)."""

    def __init__(self, backend: FakeBackend, tok: Tokenizer, metrics: HttpMetrics | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        app = build_app(backend, tok, MODEL, MAX_LEN, metrics)
        self.runner = self._call(run_http(app, "127.0.0.1", 0, shutdown_timeout=1.0))
        self.port: int = self.runner.addresses[0][1]

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def close(self) -> None:
        self._call(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer(make_tiny_model(Path(tmp_path_factory.mktemp("oai")), arch="qwen3"))


@pytest.fixture
def fake(tok: Tokenizer) -> FakeBackend:
    b = FakeBackend()
    b.script = tok.encode(TEXT)
    return b


@pytest.fixture
def server(fake: FakeBackend, tok: Tokenizer) -> Iterator[Server]:
    s = Server(fake, tok)
    yield s
    s.close()


@pytest.fixture
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0, timeout=10)


def raw(port: int, path: str, body: Any = None, method: str = "POST") -> tuple[int, str, dict[str, str]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = resp.status, resp.read().decode(), dict(resp.getheaders())
    conn.close()
    return out


def assert_error_shape(text: str) -> dict[str, Any]:
    err = json.loads(text)["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)
    return err


# ---- detokenizer ----


def test_detokenizer_never_emits_broken_utf8(tok: Tokenizer) -> None:
    text = "héllo 世界 🙂 ok"
    ids = [*tok.encode(text), 2]  # trailing special token (<|im_end|>) is skipped
    det = IncrementalDetokenizer(tok)
    deltas = [det.add([i]) for i in ids]
    deltas.append(det.finish())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text == tok.decode(ids)
    assert any(d == "" for d in deltas[:-1])  # partial characters were held back
    assert b"".join(token_bytes(tok, i) for i in ids[:-1]) == text.encode()


@pytest.mark.parametrize("stop", [["brown"], ["own f"], ["zzz", " fox"], ["dog."]])
def test_detokenizer_stop_strings(tok: Tokenizer, stop: list[str]) -> None:
    det = IncrementalDetokenizer(tok, stop)
    out = []
    for i in tok.encode(TEXT):
        out.append(det.add([i]))
        if det.stopped:
            break
    out.append(det.finish())
    cut = min(TEXT.find(s) for s in stop if s in TEXT)
    assert det.stopped and "".join(out) == TEXT[:cut]


# ---- protocol parsing ----


def test_parse_defaults_and_extensions(tok: Tokenizer) -> None:
    p = parse_completion({"model": MODEL, "prompt": [[5, 6, 7]], "top_k": -1, "stop": "x"}, tok, MODEL, MAX_LEN)
    assert p.gen.prompt_token_ids == [5, 6, 7] and p.gen.params.max_tokens == MAX_LEN - 3
    assert p.gen.request_id.startswith("cmpl-") and p.stop == ("x",) and p.gen.speculative is None
    body = {"model": MODEL, "prompt": ["hi"], "num_speculative_tokens": 3, "seed": 7, "user": "u", "extra": 1}
    p = parse_completion(body, tok, MODEL, MAX_LEN)
    assert p.gen.speculative == SpeculativeParams(3) and p.gen.params.seed == 7
    msgs = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    c = parse_chat({"model": MODEL, "messages": msgs, "logprobs": True, "max_completion_tokens": 5}, tok, MODEL, 64)
    assert c.gen.request_id.startswith("chatcmpl-") and c.logprobs == 0 and c.gen.params.max_tokens == 5
    with pytest.raises(InvalidRequest, match="at most 4"):
        parse_completion({"model": MODEL, "prompt": "a", "stop": list("abcde")}, tok, MODEL, MAX_LEN)


# ---- end to end with the openai client ----


def test_completion(client: openai.OpenAI, fake: FakeBackend, tok: Tokenizer) -> None:
    r = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=40, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == MODEL
    assert r.choices[0].text == tok.decode(fake.script) and r.choices[0].finish_reason == "stop"
    n_prompt = len(tok.encode("Hello there"))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, len(fake.script))
    assert r.usage.total_tokens == n_prompt + len(fake.script)
    assert fake.requests[0].params.temperature == 0.0 and fake.completed.is_set()
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, echo=True)
    assert r.choices[0].text == "Hi" + tok.decode(fake.script[:3]) and r.choices[0].finish_reason == "length"


def test_completion_stream(client: openai.OpenAI, fake: FakeBackend, tok: Tokenizer) -> None:
    chunks = list(
        client.completions.create(model=MODEL, prompt="Hi", stream=True, stream_options={"include_usage": True})
    )
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == tok.decode(fake.script)
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(fake.script)


def test_chat(client: openai.OpenAI, fake: FakeBackend, tok: Tokenizer) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, extra_body={"num_speculative_tokens": 2})
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == tok.decode(fake.script)
    want = tok.encode(tok.apply_chat_template(msgs), add_special_tokens=False)
    req = fake.requests[0]
    assert req.prompt_token_ids == want and r.usage.prompt_tokens == len(want)
    assert req.speculative == SpeculativeParams(2) and req.params.max_tokens == MAX_LEN - len(want)


def test_chat_stream(client: openai.OpenAI, fake: FakeBackend, tok: Tokenizer) -> None:
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], stream=True)
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == tok.decode(fake.script)
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].usage is None


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_truncates_and_cancels(client: openai.OpenAI, fake: FakeBackend, stream: bool) -> None:
    r = client.completions.create(model=MODEL, prompt="Hi", stop=["brown", "zebra"], stream=stream)
    chunks = list(r) if stream else [r]
    assert "".join(c.choices[0].text for c in chunks) == " The quick "
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert fake.cancelled.wait(1.0) and not fake.completed.is_set()


def test_logprobs_shapes(client: openai.OpenAI, fake: FakeBackend, tok: Tokenizer) -> None:
    r = client.completions.create(model=MODEL, prompt="Hi", logprobs=2)
    lp = r.choices[0].logprobs
    n = len(fake.script)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens) == r.choices[0].text and lp.token_logprobs == [-0.25] * n
    assert all(len(t) == 2 for t in lp.top_logprobs) and lp.text_offset == sorted(lp.text_offset)
    assert fake.requests[0].params.logprobs == 2
    msgs = [{"role": "user", "content": "Hi"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == n and all(c.logprob == -0.25 and len(c.top_logprobs) == 3 for c in content)
    assert bytes(b for c in content for b in c.bytes).decode() == tok.decode(fake.script)
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, logprobs=True, stream=True))
    assert sum(len(c.choices[0].logprobs.content) for c in chunks if c.choices[0].logprobs) == n


def test_models_and_health(client: openai.OpenAI, server: Server) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL] and models[0].owned_by == "tandem" and models[0].object == "model"
    status, text, _ = raw(server.port, "/v1/models", method="GET")
    assert status == 200 and json.loads(text)["data"][0]["max_model_len"] == MAX_LEN
    assert raw(server.port, "/health", method="GET")[:2] == (200, '{"status": "ok"}')


# ---- errors ----

_BAD: list[tuple[str, Any, int, str]] = [
    ("/v1/completions", b"{not json", 400, "JSON"),
    ("/v1/completions", b"[1, 2]", 400, "object"),
    ("/v1/completions", {"prompt": "hi"}, 400, "'model'"),
    ("/v1/completions", {"model": MODEL}, 400, "'prompt'"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "'messages'"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 10**9}, 400, f"{MAX_LEN}"),
    ("/v1/completions", {"model": MODEL, "prompt": [5] * 10, "max_tokens": 60}, 400, "(10 in the prompt, 60"),
    ("/v1/completions", {"model": MODEL, "prompt": [5] * MAX_LEN}, 400, f"prompt has {MAX_LEN} tokens"),
    ("/v1/completions", {"model": "nope", "prompt": "hi"}, 404, "nope"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 2}, 400, "n=1"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, 400, "Batched"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "empty"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 99999]}, 400, "token ids"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "num_speculative_tokens": -1}, 400, "num_speculative"),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "text",
    ),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("/v1/nope", {}, 404, "Unknown route"),
]


@pytest.mark.parametrize(("path", "body", "status", "needle"), _BAD)
def test_bad_requests(server: Server, client: openai.OpenAI, path: str, body: Any, status: int, needle: str) -> None:
    got, text, _ = raw(server.port, path, body)
    assert got == status, text
    err = assert_error_shape(text)
    assert needle in err["message"] and err["type"] == "invalid_request_error"
    if status == 404 and "nope" in err["message"] and path == "/v1/completions":
        assert err["code"] == "model_not_found"
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].finish_reason == "length"


def test_wrong_method(server: Server) -> None:
    status, text, headers = raw(server.port, "/v1/completions", method="GET")
    assert status == 405 and "POST" in headers.get("Allow", "")
    assert_error_shape(text)


@pytest.mark.parametrize("stream", [False, True])
def test_backend_error_before_first_token(server: Server, fake: FakeBackend, stream: bool) -> None:
    fake.error_at, fake.error_code = 0, 503
    status, text, _ = raw(server.port, "/v1/completions", {"model": MODEL, "prompt": "Hi", "stream": stream})
    assert status == 503 and assert_error_shape(text)["type"] == "server_error"
    assert "worker died" in assert_error_shape(text)["message"]


def test_backend_error_mid_stream(server: Server, client: openai.OpenAI, fake: FakeBackend) -> None:
    fake.error_at = 2
    status, text, headers = raw(server.port, "/v1/completions", {"model": MODEL, "prompt": "Hi", "stream": True})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    assert events[-1] == "[DONE]" and "worker died" in json.loads(events[-2])["error"]["message"]
    assert json.loads(events[0])["choices"][0]["text"]  # a token came first
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True)
    got = []
    with pytest.raises(openai.APIError, match="worker died"):
        got.extend(stream)
    assert got and got[0].choices[0].delta.role == "assistant"


def test_client_disconnect_cancels_backend(server: Server, client: openai.OpenAI, fake: FakeBackend) -> None:
    fake.hang_after = 2  # the stream stalls after 2 tokens
    body = json.dumps({"model": MODEL, "prompt": "Hi", "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    buf = b""
    while b"data: " not in buf:
        buf += s.recv(4096)
    # A stalled stream does not hold up other requests (2 tokens never reach the stall).
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens == 2
    assert not fake.cancelled.is_set()
    t0 = time.monotonic()
    s.close()
    assert fake.cancelled.wait(1.0), "backend stream not closed after client disconnect"
    assert time.monotonic() - t0 < 1.0


def test_metrics(fake: FakeBackend, tok: Tokenizer) -> None:
    s = Server(fake, tok, HttpMetrics())
    try:
        assert raw(s.port, "/v1/completions", {"model": MODEL, "prompt": "Hi"})[0] == 200
        status, text, _ = raw(s.port, "/metrics", method="GET")
        assert status == 200 and 'tandem_http_requests_total{route="/v1/completions",status="200"} 1.0' in text
        assert f"tandem_http_generation_tokens_total {float(len(fake.script))}" in text
    finally:
        s.close()
