"""OpenAI-compatible HTTP front end (aiohttp): /v1/completions, /v1/chat/completions, /v1/models, /health.

Cancellation: a request is cancelled by closing its backend iterator (``aclose()``). Every handler closes it
in a ``finally``; when the client disconnects, aiohttp cancels the handler task, but only if the server
runs with ``handler_cancellation=True`` -- run_http() sets it; other launchers must too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

from engine.request import TokenLogprobs
from engine.tokenizer import Tokenizer
from router.backend import GenerationBackend, GenerationError, TokenEvent
from router.detokenizer import IncrementalDetokenizer
from router.openai_protocol import (
    InvalidRequest,
    ParsedRequest,
    chat_logprobs,
    chunk,
    completion_logprobs,
    error_body,
    full_response,
    parse_chat,
    parse_completion,
    usage_chunk,
)

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 << 20  # token-id prompts are large JSON
_OFFLOAD_PARSE_BYTES = 64 << 10  # tokenize big prompts off the event loop so other requests keep flowing
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"})
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class HttpMetrics:
    """Prometheus metrics of the HTTP front end, in their own registry unless one is given."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "tandem_http_requests", "HTTP requests by route and status", ["route", "status"], registry=r
        )
        self.latency = Histogram("tandem_http_request_duration_seconds", "Request latency", ["route"], registry=r)
        self.ttft = Histogram("tandem_http_time_to_first_token_seconds", "Time to first token", registry=r)
        self.prompt_tokens = Counter("tandem_http_prompt_tokens", "Prompt tokens of accepted requests", registry=r)
        self.generation_tokens = Counter("tandem_http_generation_tokens", "Generated tokens", registry=r)

    async def handle(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


def error_response(message: str, status: int, param: str | None = None, error_code: str | None = None) -> web.Response:
    return web.json_response(error_body(message, status, param, error_code), status=status)


def _status(code: int) -> int:
    return code if 400 <= code <= 599 else 500


def _sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


async def _aclose(it: AsyncIterator[TokenEvent]) -> None:
    """Close the backend stream: this is what cancels the request upstream."""
    aclose = getattr(it, "aclose", None)
    if aclose is None:
        return
    try:
        await aclose()
    except Exception:
        log.exception("closing a backend stream failed")


async def _read_json(request: web.Request) -> tuple[Any, int]:
    raw = await request.read()
    try:
        return json.loads(raw), len(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise InvalidRequest(f"Invalid JSON body: {e}") from None


class _Output:
    """Turns backend events into text deltas, logprobs and the finish reason of one request."""

    def __init__(self, p: ParsedRequest, tokenizer: Tokenizer) -> None:
        self.p = p
        self.det = IncrementalDetokenizer(tokenizer, p.stop)
        self.echo = p.echo_text or ""
        self.completion_tokens = 0
        self.finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def stop_hit(self) -> bool:
        """We decided to stop (stop string): the caller stops iterating and closing the stream cancels."""
        return self.det.stopped

    def add(self, ev: TokenEvent) -> tuple[str, list[TokenLogprobs], list[int]]:
        """One event -> (text delta, its tokens' logprobs, their character offsets in the output)."""
        if self.finished:
            return "", [], []  # nothing counts after the finish (the stream should be ending anyway)
        offset = len(self.echo) + len(self.det.text)  # per event: tokens and text need not align
        self.completion_tokens += len(ev.token_ids)
        delta = self.det.add(ev.token_ids)
        lps = list(ev.logprobs) if self.p.logprobs is not None else []
        if self.det.stopped:
            self.finish_reason = "stop"
        elif ev.finished:
            self.finish_reason = ev.finish_reason or "stop"
            delta += self.det.finish()
        return delta, lps, [offset] * len(lps)

    def end(self) -> str:
        """The stream ended without a finished event: flush held-back text, infer the finish reason."""
        if self.finished:
            return ""
        self.finish_reason = "length" if self.completion_tokens >= self.p.gen.params.max_tokens else "stop"
        return self.det.finish()


class _OpenAIServer:
    def __init__(
        self,
        backend: GenerationBackend,
        tokenizer: Tokenizer,
        model_name: str,
        max_model_len: int,
        metrics: HttpMetrics | None,
    ) -> None:
        self.backend = backend
        self.tok = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.metrics = metrics
        self.created = int(time.time())

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "tandem",
            "max_model_len": self.max_model_len,
        }

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name != self.model_name:
            return error_response(f"The model `{name}` does not exist", 404, "model", "model_not_found")
        return web.json_response(self._model_card())

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, parse_completion)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, parse_chat)

    async def _handle(self, request: web.Request, parse: Callable[..., ParsedRequest]) -> web.StreamResponse:
        body, size = await _read_json(request)
        args = (body, self.tok, self.model_name, self.max_model_len)
        p = await asyncio.to_thread(parse, *args) if size > _OFFLOAD_PARSE_BYTES else parse(*args)
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(p.prompt_tokens)
        out = _Output(p, self.tok)
        it: AsyncIterator[TokenEvent] | None = None
        resp: web.StreamResponse | None = None
        t0 = time.monotonic()
        try:
            it = self.backend.generate(p.gen)
            if not p.stream:
                return web.json_response(await self._collect(p, out, it, t0))
            # Wait for the first event before sending headers: an early failure still gets a real status.
            ev = await anext(it, None)
            self._observe_ttft(t0)
            resp = web.StreamResponse(headers=_SSE_HEADERS)
            await resp.prepare(request)
            if p.kind == "chat":
                await resp.write(_sse(chunk(p, "", role=True)))
            elif out.echo:
                await resp.write(_sse(chunk(p, out.echo)))
            while ev is not None:
                delta, lps, offsets = out.add(ev)
                if delta or lps:
                    await resp.write(_sse(chunk(p, delta, logprobs=self._logprobs(p, lps, offsets))))
                # After a finished event keep pulling so the backend stream ends normally (not cancelled).
                if out.stop_hit or _client_gone(request):
                    break
                ev = await anext(it, None)
            if tail := out.end():
                await resp.write(_sse(chunk(p, tail)))
            await resp.write(_sse(chunk(p, None, finish_reason=out.finish_reason)))
            if p.include_usage:
                await resp.write(_sse(usage_chunk(p, out.completion_tokens)))
            await resp.write(b"data: [DONE]\n\n")
            return resp
        except GenerationError as e:
            if resp is None:
                return error_response(str(e), _status(e.code))
            await _stream_error(resp, str(e), _status(e.code))
            return resp
        except ConnectionResetError:  # client went away mid-write; the finally cancels the request
            log.info("client of %s disconnected", p.request_id)
            return resp if resp is not None else web.Response(status=499)
        except Exception:
            if resp is None:
                raise  # the middleware answers 500
            log.exception("request %s failed mid-stream", p.request_id)
            await _stream_error(resp, "internal server error", 500)
            return resp
        finally:
            if it is not None:
                await _aclose(it)
            if self.metrics is not None:
                self.metrics.generation_tokens.inc(out.completion_tokens)

    async def _collect(
        self, p: ParsedRequest, out: _Output, it: AsyncIterator[TokenEvent], t0: float
    ) -> dict[str, Any]:
        parts = [out.echo]
        all_lps: list[TokenLogprobs] = []
        all_offsets: list[int] = []
        async for ev in it:
            if out.completion_tokens == 0:
                self._observe_ttft(t0)
            delta, lps, offsets = out.add(ev)
            parts.append(delta)
            all_lps += lps
            all_offsets += offsets
            if out.stop_hit:
                break
        parts.append(out.end())
        logprobs = self._logprobs(p, all_lps, all_offsets)
        return full_response(p, "".join(parts), out.finish_reason, logprobs, out.completion_tokens)

    def _logprobs(self, p: ParsedRequest, lps: list[TokenLogprobs], offsets: list[int]) -> dict[str, Any] | None:
        if p.logprobs is None:
            return None
        return completion_logprobs(self.tok, lps, offsets) if p.kind == "completion" else chat_logprobs(self.tok, lps)

    def _observe_ttft(self, t0: float) -> None:
        if self.metrics is not None:
            self.metrics.ttft.observe(time.monotonic() - t0)


def _client_gone(request: web.Request) -> bool:
    # Backstop for servers run without handler_cancellation: notice the disconnect at the next event.
    transport = request.transport
    return transport is None or transport.is_closing()


async def _stream_error(resp: web.StreamResponse, message: str, status: int) -> None:
    """Headers are sent already: report the error as an SSE event, then end the stream."""
    with contextlib.suppress(ConnectionResetError):
        await resp.write(_sse(error_body(message, status)))
        await resp.write(b"data: [DONE]\n\n")


def _error_middleware(metrics: HttpMetrics | None) -> Any:
    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        t0 = time.monotonic()
        resp = await _dispatch(request, handler)
        if metrics is not None:
            route = request.path if request.path in _ROUTES else "other"
            metrics.requests.labels(route, str(resp.status)).inc()
            metrics.latency.labels(route).observe(time.monotonic() - t0)
        return resp

    return middleware


async def _dispatch(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves in OpenAI's shape, whatever raised it."""
    try:
        return await handler(request)
    except InvalidRequest as e:
        return error_response(e.message, e.code, e.param, e.error_code)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        if e.status == 404:
            message = f"Unknown route: {request.method} {request.path}"
        elif e.status == 405:
            message = f"Method {request.method} is not allowed for {request.path}"
        else:  # e.g. 413: aiohttp's text names the size limit
            message = e.text if e.text and not e.text.startswith(f"{e.status}:") else e.reason
        resp = error_response(message, e.status)
        if "Allow" in e.headers:
            resp.headers["Allow"] = e.headers["Allow"]
        return resp
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response("internal server error", 500)


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def build_app(
    backend: GenerationBackend,
    tokenizer: Tokenizer,
    model_name: str,
    max_model_len: int,
    metrics: HttpMetrics | None = None,
) -> web.Application:
    """The OpenAI-compatible app. Serve it with run_http() (or handler_cancellation=True, see module doc)."""
    server = _OpenAIServer(backend, tokenizer, model_name, max_model_len, metrics)
    app = web.Application(middlewares=[_error_middleware(metrics)], client_max_size=MAX_BODY_BYTES)
    app.router.add_post("/v1/completions", server.completions)
    app.router.add_post("/v1/chat/completions", server.chat)
    app.router.add_get("/v1/models", server.models)
    app.router.add_get("/v1/models/{model}", server.model)
    app.router.add_get("/health", _health)
    if metrics is not None:
        app.router.add_get("/metrics", metrics.handle)
    return app


async def run_http(app: web.Application, host: str, port: int, shutdown_timeout: float = 10.0) -> web.AppRunner:
    """Start serving ``app``; returns the runner (``await runner.cleanup()`` stops it). Port 0 picks a free
    port: read it from ``runner.addresses``."""
    # handler_cancellation: a client disconnect cancels its handler, whose finally closes the backend stream.
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
