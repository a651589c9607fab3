"""OpenAI-compatible HTTP API over an :class:`~deltafleet.serve.engine.Engine` (docs/architecture.md, "Serving").

Endpoints: ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (both with SSE streaming ending ``data: [DONE]`` and
``stream_options.include_usage``), ``GET /health``, ``GET /metrics`` (Prometheus, vLLM-style names
under a ``deltafleet:`` prefix, one registry per app). Errors are OpenAI error objects
``{"error": {"message", "type", "param", "code"}}``: 400 bad request (FastAPI's 422 included),
404 unknown model, 408 a body that did not arrive in ``request_timeout_s``, 413 a body over
``max_request_bytes`` (refused before it is parsed), 429 overloaded (with ``Retry-After``), 503
variant unavailable, the server shutting down (``shutting_down``: ``app.state.drain``) or its engine
failed (``engine_failed``), 500 a failed generation (``generation_failed``) or anything unexpected (a
generic message; the details go to the server log) — none stops the server but a failed engine (a
tensor-parallel rank died or stopped answering), and ``/openapi.json`` lists each route's. OpenAI
parameters this server does not implement (``suffix``, ``logit_bias``, chat's ``echo``, completions'
``tools``, ...) are a 400 unless their value asks for nothing. Request bodies are bounded before any work (serve/protocol.py).

An error reaches every request it affects and only those: one request's failed generation ends it
alone, never its batch. A stream's status line waits for its first token, so that an error until
then is a status code; an error after it is an in-band error event before ``data: [DONE]``. A
non-streaming request that fails is an error, never a 200 with cut text.

Each request is fed from the engine's continuous batch (serve/scheduler.py: requests for the base
and any variants decode together) through an asyncio queue: the scheduler hands a step's items to
the event loop at once (``Outbox``), so the loop wakes once per step, not once per token, and keeps
serving ``/health``, ``/metrics`` and new requests meanwhile. A client that hangs up
cancels its generation (between two tokens), streaming or not, which frees its KV blocks and
its hold on the variant. Hot load/unload of variants (as vLLM's LoRA adapters: an unloaded variant is
not served until it is loaded again): ``POST /v1/load_variant``, ``POST /v1/unload_variant``,
``GET /v1/delta_cache``; an optional API key guards ``/v1/*``.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import hmac
import json
import logging
import sys
import threading
import time
import uuid
from typing import AsyncIterator, Callable

import anyio
import anyio.to_thread
import h11
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from deltafleet.serve import tools
from deltafleet.serve.detokenize import token_chars
from deltafleet.serve.engine import Engine
from deltafleet.serve.request import (
    EngineFailedError,
    GenerationError,
    InvalidRequestError,
    ModelNotFoundError,
    SamplingParams,
    ServerShuttingDownError,
    Step,
    VariantInUseError,
    VariantUnavailableError,
)
from deltafleet.serve.scheduler import END, Group, Outbox
from deltafleet.serve.protocol import (
    _OWN_ERRORS,
    _UNION_TAGS,
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    DeltaCacheState,
    Detokenized,
    DetokenizeRequest,
    ErrorResponse,
    Health,
    LoadedVariant,
    LoadLoraAdapterRequest,
    LoadVariantRequest,
    MAX_REQUEST_ID,
    ModelInfo,
    ModelList,
    NamedToolChoice,
    Tokenized,
    TokenizeRequest,
    UnloadedVariant,
    Version,
    UnloadLoraAdapterRequest,
    UnloadVariantRequest,
)

PREFIX = "deltafleet:"
PROBES = ("/health", "/ping", "/metrics")  # without the API key, and not counted in http_requests_total
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5)
DISCONNECT_POLL_S = 0.1  # how often a non-streaming request checks that its client is still there
MAX_REQUEST_BYTES = 2 * 2**20  # request bodies larger than this are refused (413) unread
MAX_PENDING_BODY_BYTES = 64 * 2**20  # bodies being received at once, all requests: past it, 503
RETRY_AFTER_S = 1  # the Retry-After of a 429
MAX_CHOICES = 2048  # prompts × n of one request
MAX_PREPARING = 1024  # without max_waiting: requests waiting for their variant's deltas at once (the rest queue)
log = logging.getLogger(__name__)
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0)

# ------------------------------------------------------------------------------------ errors


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        # ASCII-escaped JSON: a message that quotes the request (a model id) may hold a lone surrogate.
        return Response(json.dumps(self.body()), status_code=self.status, media_type="application/json",
                        headers=self.headers)


def _api_error(e: Exception) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, ModelNotFoundError):
        return APIError(404, str(e), "invalid_request_error", "model", "model_not_found")
    if isinstance(e, VariantUnavailableError):
        return APIError(503, str(e), "service_unavailable_error", "model", "variant_unavailable",
                        {"Retry-After": str(RETRY_AFTER_S)} if e.transient else None)
    if isinstance(e, InvalidRequestError):
        return APIError(400, str(e), "invalid_request_error", e.param, e.code)
    if isinstance(e, EngineFailedError):
        return APIError(503, str(e), "service_unavailable_error", None, "engine_failed")
    if isinstance(e, GenerationError):  # logged where it happened (serve/scheduler.py, serve/tp.py)
        return APIError(500, f"Generation failed: {e}.", "server_error", None, "generation_failed")
    if isinstance(e, ServerShuttingDownError):
        return APIError(503, str(e), "service_unavailable_error", None, "shutting_down")
    if isinstance(e, VariantInUseError):
        return APIError(409, f"{e}; retry when they have finished", "invalid_request_error", "variant",
                        "variant_in_use")
    log.error("internal error", exc_info=e)
    return APIError(500, "The server had an error while processing your request (see the server log).",
                    "server_error", None, "internal_error")


def request_id(http: Request, body) -> str:
    """The id a completion's answer is named by (after its ``cmpl-``), as vLLM picks it: the client's
    ``X-Request-Id`` header, else the body's ``request_id``, else a random one.

    Raises:
        APIError: 400, a header longer than ``MAX_REQUEST_ID`` characters."""
    given = http.headers.get("x-request-id")
    if given:
        with contextlib.suppress(UnicodeError):  # Starlette decodes a header as Latin-1; clients send UTF-8
            given = given.encode("latin-1").decode("utf-8")
        if len(given) > MAX_REQUEST_ID:
            raise APIError(400, f"The X-Request-Id header is {len(given)} characters long; at most {MAX_REQUEST_ID} "
                           "are taken.", "invalid_request_error", "X-Request-Id", "invalid_value")
        return given
    return body.request_id or uuid.uuid4().hex


def _is_json_media(content_type: str | None) -> bool:
    """Whether FastAPI parses a body of this Content-Type as JSON: ``application/json`` or
    ``application/*+json`` (with none given, FastAPI with its strict_content_type, the default, does not)."""
    if not content_type:
        return False
    media = content_type.split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _validation_error(exc: RequestValidationError, content_type: str | None = None) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {}

    def where(e) -> list[str]:
        # a union's members are named by their tag, or by pydantic after their type (``literal['a','b']``,
        # a model's class name): not parts of the client's field path
        return [str(x) for x in e.get("loc", ()) if x != "body" and x not in _UNION_TAGS
                and not str(x).startswith("literal[") and not str(x)[:1].isupper()]

    loc = where(first)
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return APIError(400, "The request body is not valid JSON.", code="invalid_json")
    if param is None and not _is_json_media(content_type):  # read as bytes, never parsed
        given = f"this request's is `{content_type[:100]}`" if content_type else "this request has none"
        return APIError(400, f"The request body must be JSON, sent with `Content-Type: application/json` "
                        f"({given}).", code="invalid_content_type")
    if param is None:  # the body itself: empty, or JSON but not an object
        return APIError(400, "The request body is missing or is not a JSON object.", code="invalid_body")
    if first.get("type") in _OWN_ERRORS:
        return APIError(400, first["msg"], param=loc[0], code=first["type"])
    if first.get("type") == "missing":
        return APIError(400, f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    msgs = "; ".join(f"{'.'.join(where(e)) or 'body'}: {e.get('msg')}"
                     for e in errors[:5])
    return APIError(400, f"Invalid request: {msgs}", param=param, code="invalid_value")


def _is_utf8_json_text(body: bytes) -> bool:
    """Whether ``body`` is UTF-8 text that could be JSON: strict UTF-8 (no encoded surrogates) and no
    NUL byte (JSON text never holds one raw; UTF-16 does)."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return b"\x00" not in body


class Stopping:
    """A flag set once, from any thread (the drain's), that the event loop can also await: the
    server's shutdown, for :class:`BodyLimit`'s bodies still arriving."""

    def __init__(self):
        self._set = False
        self._event: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def event(self) -> asyncio.Event:
        """The flag as an ``asyncio.Event`` of the running loop (the server's one loop)."""
        if self._event is None:
            self._event = asyncio.Event()
            self._loop = asyncio.get_running_loop()  # after the event: set() reads the loop, then the event
            if self._set:
                self._event.set()
        return self._event

    def set(self) -> None:
        self._set = True
        loop = self._loop
        if loop is not None and self._event is not None:
            loop.call_soon_threadsafe(self._event.set)


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes (None: no limit) is answered 413
    (``request_too_large``) before the app parses any of it — at once by its Content-Length, or as
    soon as a chunked body passes the limit (uvicorn discards the rest). A body within the limit is
    read whole here and handed on as one message, unless it is not UTF-8 text (400 ``invalid_json``):
    the JSON parser would otherwise guess UTF-16 from NUL bytes and let encoded surrogates through.
    A body that has not arrived whole ``timeout_s`` seconds after its head (None: no limit) is
    answered 408 (``request_timeout``), and one that would take the bytes of all bodies being received
    at once past ``pending_limit`` (None: no limit) 503 (``server_busy``); either closes the connection.
    A body larger than ``pending_limit`` alone is too large (413) whatever ``limit`` is.
    Once ``stopping`` (None: never) is set, a body still arriving is answered 503 (``shutting_down``)
    at once, and the connection closed: the server's shutdown does not wait for a slow upload.
    Parsing a body holds the event loop (about 0.25 s per MiB of deeply nested JSON): the limits bound
    that, and the memory slow clients can hold."""

    def __init__(self, app: ASGIApp, limit: int | None, timeout_s: float | None = None,
                 pending_limit: int | None = None, stopping: Stopping | None = None):
        self.app, self.timeout_s, self.pending_limit = app, timeout_s, pending_limit
        # one body past pending_limit could never be received, however long its client waits: 413, not 503
        limits = [n for n in (limit, pending_limit) if n is not None]
        self.limit = min(limits) if limits else None
        self.stopping = stopping
        self.pending = 0  # bytes of the bodies being received now (one event loop: no lock)

    async def _receive(self, receive: Receive, timeout_s: float | None):
        """The next message, or None where ``stopping`` was set first; TimeoutError after ``timeout_s``."""
        if self.stopping is None:
            return await asyncio.wait_for(receive(), timeout_s)
        stop = self.stopping.event()
        if stop.is_set():
            return None
        message, waiter = asyncio.ensure_future(receive()), asyncio.ensure_future(stop.wait())
        try:
            done, _ = await asyncio.wait((message, waiter), timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if message in done:
            return message.result()
        message.cancel()
        if waiter in done:
            return None
        raise TimeoutError

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):  # no body read by the app
            return await self.app(scope, receive, send)
        length = Headers(scope=scope).get("content-length", "")
        if self.limit is not None and length.isdigit() and int(length) > self.limit:
            return await self._refuse(scope, receive, send)
        chunks, size = [], 0
        loop = asyncio.get_running_loop()
        deadline = None if self.timeout_s is None else loop.time() + self.timeout_s
        try:
            while True:
                try:
                    message = await self._receive(receive, None if deadline is None else deadline - loop.time())
                except TimeoutError:
                    error = APIError(408, f"The request body did not arrive within {self.timeout_s:g} s.",
                                     "invalid_request_error", None, "request_timeout", headers={"Connection": "close"})
                    return await error.response()(scope, receive, send)
                if message is None:
                    error = APIError(503, "The server is shutting down; send the request to another server, or "
                                     "again once this one is back.", "service_unavailable_error", None,
                                     "shutting_down", headers={"Connection": "close"})
                    return await error.response()(scope, receive, send)
                if message["type"] != "http.request":  # the client left: the app sees it
                    break
                chunks.append(message.get("body", b""))
                size += len(chunks[-1])
                self.pending += len(chunks[-1])
                if self.limit is not None and size > self.limit:
                    return await self._refuse(scope, receive, send)
                if self.pending_limit is not None and self.pending > self.pending_limit:
                    error = APIError(503, "The server is receiving too many request bodies at once; retry later.",
                                     "service_unavailable_error", None, "server_busy",
                                     headers={"Retry-After": str(RETRY_AFTER_S), "Connection": "close"})
                    return await error.response()(scope, receive, send)
                if not message.get("more_body", False):
                    message = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                    if not _is_utf8_json_text(message["body"]):
                        error = APIError(400, "The request body is not valid JSON: it is not UTF-8 text.",
                                         "invalid_request_error", None, "invalid_json")
                        return await error.response()(scope, receive, send)
                    break
        finally:
            self.pending -= size
            chunks.clear()
        first = message

        async def replay():
            nonlocal first
            if first is None:  # the whole body was handed on: what comes next is a disconnect
                return await receive()
            out, first = first, None
            return out

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(413, f"The request body is larger than this server's limit of {self.limit} bytes.",
                         "invalid_request_error", None, "request_too_large")
        await error.response()(scope, receive, send)


MAX_HEAD_BYTES = 16384  # a request head (request line and headers) at most: h11's own limit


def http_protocol(head_timeout_s: float | None, parser: str = "auto") -> type:
    """uvicorn's HTTP/1.1 protocol class (``uvicorn.run(..., http=...)``) for ``parser`` — ``h11``
    (pure Python), ``httptools`` (C), or ``auto``: httptools where it is installed, as uvicorn picks —
    closing a connection whose client has not sent a whole request head ``head_timeout_s`` seconds
    after connecting or after the previous response (None: uvicorn's own, which waits for ever). Slow
    or silent clients then cannot hold connections open; uvicorn's ``timeout_keep_alive`` still
    closes idle keep-alive connections sooner. httptools writes each streamed chunk with less of the
    event loop's time (the GIL the model thread also needs).

    A head longer than :data:`MAX_HEAD_BYTES` is refused with 400 and the connection closed, by
    either parser: h11 has the limit, and here httptools gets it (uvicorn's has none, and
    assembles a header in time quadratic in its length, on the event loop).

    Raises:
        ValueError: ``parser`` is not one of those, or is ``httptools`` without httptools installed.
    """
    if parser not in ("auto", "h11", "httptools"):
        raise ValueError(f"http_parser must be auto, h11 or httptools, got {parser!r}")
    if parser != "h11":
        try:
            from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
        except ImportError:
            if parser == "httptools":
                raise ValueError("http_parser=httptools needs the httptools package (pip install httptools)") \
                    from None
            parser = "h11"
    if parser == "h11" and head_timeout_s is None:
        return H11Protocol

    class HeadTimeout(H11Protocol if parser == "h11" else HttpToolsProtocol):
        """The head timer (without ``head_timeout_s``, never armed): armed when the connection opens
        and after each response that leaves no request waiting, disarmed by a whole head (a pipelined
        request's came while the previous ran)."""

        _head_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            if head_timeout_s is not None:
                self._head_timer = self.loop.call_later(head_timeout_s, self._head_timeout)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _waiting_for_head(self) -> bool:  # when the timer fires: a whole head disarms it
            return True

        def _head_timeout(self) -> None:
            self._head_timer = None
            if self._waiting_for_head() and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    if parser == "h11":
        class HeadTimeoutH11(HeadTimeout):
            def _waiting_for_head(self) -> bool:
                return self.conn.their_state is h11.IDLE

            def handle_events(self) -> None:
                super().handle_events()
                if self.conn.their_state is not h11.IDLE:  # a whole head came
                    self._disarm()

            def on_response_complete(self) -> None:
                self._arm()  # before: the next request's head may be handled within
                super().on_response_complete()

        return HeadTimeoutH11

    class HeadLimitHttpTools(HeadTimeout):
        """httptools with the head timer and the head size limit. The bytes of a head are counted
        per read, before the parser assembles them: a read in which the parser neither finished a
        head nor a message, having started it waiting for a head, was all head. A head that came
        within one read is counted as it is parsed (its request target and headers)."""

        _awaiting_head = True  # from the connection's start or a message's end to the next whole head
        _head_bytes = 0
        _events = 0  # heads and messages finished

        def data_received(self, data: bytes) -> None:
            awaiting, events = self._awaiting_head, self._events
            super().data_received(data)
            if awaiting and self._events == events:  # (the state changes only with an event)
                self._head_bytes += len(data)
                if self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
                    self.send_400_response(f"Invalid HTTP request received: the request head is longer than "
                                           f"{MAX_HEAD_BYTES} bytes.")

        def on_message_begin(self) -> None:
            self._hosts = self._parsed = 0
            super().on_message_begin()

        def _count(self, n: int) -> None:
            """The parsed head's bytes: a head that came whole within one read is held to the limit here
            (the parser's error: uvicorn's 400)."""
            self._parsed += n
            if self._parsed > MAX_HEAD_BYTES:
                raise ValueError(f"the request head is longer than {MAX_HEAD_BYTES} bytes")

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value) + 4)  # ": " and the line's end
            if name.lower() == b"host":  # RFC 9112 §3.2: a request with two is a 400 (h11 refuses it)
                self._hosts += 1
                if self._hosts > 1:
                    raise ValueError("more than one Host header")  # the parser's error: uvicorn's 400
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._disarm()
            self._awaiting_head, self._events = False, self._events + 1
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._awaiting_head, self._head_bytes, self._events = True, 0, self._events + 1
            super().on_message_complete()

        def on_response_complete(self) -> None:
            if not self.pipeline:  # else the next request's head is in already
                self._arm()
            super().on_response_complete()

    return HeadLimitHttpTools


# ------------------------------------------------------------------------------------ metrics


class APIKeyCheck:
    """ASGI middleware: every path but :data:`PROBES` (the API and its docs) needs
    ``Authorization: Bearer <key>``, else 401 ``invalid_api_key``. Pure ASGI, not Starlette's
    ``BaseHTTPMiddleware`` (``@app.middleware("http")``), which hands the app a receive of its own: an
    endpoint behind that never saw its client hang up, so an abandoned non-streaming request ran to
    its end."""

    def __init__(self, app: ASGIApp, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in PROBES:
            scheme, _, sent = (Headers(scope=scope).get("authorization") or "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(sent.strip().encode(), self.key):
                response = APIError(401, "Incorrect API key provided. Send it as `Authorization: Bearer <key>`.",
                                    "invalid_request_error", None, "invalid_api_key").response()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"})


class StatusCount:
    """ASGI middleware, the outermost: counts every HTTP answer by route, method and status code in
    ``counter`` (``http_requests_total``, the labels of prometheus-fastapi-instrumentator, which vLLM
    serves, with each code whole rather than grouped as ``4xx``), refusals by the layers inside it
    (413, 408, 503 ``server_busy``, 401) and 429s included. ``handler`` is the route's path template,
    ``none`` for a path no route matches (a client's own paths would make series without end), and
    ``method`` the request's for HTTP's own methods (RFC 9110), ``other`` for any other token.
    ``/metrics`` and ``/health`` are not counted: scrapes and probes would outnumber the API's calls."""

    def __init__(self, app: ASGIApp, counter: Counter, routes: Callable[[], list]):
        self.app, self.counter, self.routes = app, counter, routes

    def handler(self, scope: Scope) -> str:
        for route in self.routes():
            if route.matches(scope)[0] != Match.NONE:  # PARTIAL: the path with another method (405)
                return getattr(route, "path", "none")
        return "none"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PROBES:
            return await self.app(scope, receive, send)
        status = 500  # no answer began: Starlette's ServerErrorMiddleware, outside this, sends a 500

        async def counted(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counted)
        finally:
            method = scope["method"] if scope["method"] in HTTP_METHODS else "other"
            self.counter.labels(self.handler(scope), method, str(status)).inc()


class _EngineCollector:
    """The scheduler's own state, read at each scrape: the KV cache's use and the preemptions so far
    (vLLM's ``kv_cache_usage_perc`` and ``num_preemptions``), and the seconds it waited to plan late."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        sch = self.engine.scheduler
        yield GaugeMetricFamily(PREFIX + "kv_cache_usage_perc", "Fraction of the paged KV cache's blocks in use "
                                "(1 = full).", value=sch.kv_usage())
        yield CounterMetricFamily(PREFIX + "num_preemptions", "Sequences preempted (their KV blocks freed, to be "
                                  "recomputed) because the KV cache was full.", value=sch.preemptions)
        yield CounterMetricFamily(PREFIX + "late_planning_wait_seconds", "Seconds the scheduler waited before "
                                  "planning a step, for the step in flight to near its end (late_planning).",
                                  value=sch.late_planning_wait_s)


class _VllmCollector:
    """vLLM's own server-wide series, read at each scrape. The Kubernetes Gateway API Inference
    Extension's endpoint picker reads them (its Model Server Protocol) to route by load, KV use and
    adapter affinity:

    - ``vllm:num_requests_running`` and ``vllm:num_requests_waiting``: every model's, summed (one
      series, ``model_name`` the family);
    - ``vllm:kv_cache_usage_perc`` and its older name ``vllm:gpu_cache_usage_perc``;
    - ``vllm:lora_requests_info``: the variants (model ids) with requests running and waiting, each
      list comma-separated, and ``max_lora`` the device delta slots; the value is the scrape time,
      as vLLM's (the picker keeps the newest sample)."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        family = self.engine.family
        running, waiting = self.engine.load()
        for name, counts, text in (("num_requests_running", running, "Requests generating now, all models."),
                                   ("num_requests_waiting", waiting, "Requests waiting, all models.")):
            g = GaugeMetricFamily("vllm:" + name, text, labels=["model_name"])
            g.add_metric([family], sum(counts.values()))
            yield g
        usage = self.engine.scheduler.kv_usage()
        for name in ("kv_cache_usage_perc", "gpu_cache_usage_perc"):
            g = GaugeMetricFamily("vllm:" + name, "Fraction of the paged KV cache's blocks in use (1 = full).",
                                  labels=["model_name"])
            g.add_metric([family], usage)
            yield g

        def variants(counts):
            return ",".join(sorted(m for m, n in counts.items() if n > 0 and m != family))

        info = GaugeMetricFamily("vllm:lora_requests_info", "Variants with requests running and waiting, and the "
                                 "device delta slots (value: the scrape time).",
                                 labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
        info.add_metric([variants(running), variants(waiting), str(self.engine.slots.n_slots)], time.time())
        yield info


class Metrics:
    """Prometheus metrics of one app, in their own registry (vLLM's names under ``deltafleet:``). The
    delta cache's series are the variants' alone: ``family``, the base, has no delta."""

    def __init__(self, model_ids: list[str], family: str | None = None, load: Callable[[], tuple] | None = None):
        """``load``: the engine's ``(running, waiting)`` per model id (``Engine.load``), which the
        running and waiting gauges read at each scrape; None: they stay 0."""
        self.family, self.load = family, load
        r = self.registry = CollectorRegistry()
        L = ["model_name"]
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time from request arrival to the first token.",
                              L, buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between consecutive output tokens.",
                             L, buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Time from request arrival to its last token.",
                             L, buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram(PREFIX + "request_queue_time_seconds", "Time a request waited for the model.",
                               L, buckets=LATENCY_BUCKETS, registry=r)
        self.running = Gauge(PREFIX + "num_requests_running", "Requests in the model's batch now.", L, registry=r)
        self.waiting = Gauge(PREFIX + "num_requests_waiting", "Requests waiting for the model's batch, preempted "
                             "ones included, or for their variant's deltas on the device.", L, registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens processed.", L, registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.", L, registry=r)
        self.requests = Counter(PREFIX + "request_success", "Finished requests.", L + ["finished_reason"], registry=r)
        self.hits = Counter(PREFIX + "delta_cache_hits", "Variant requests whose delta was resident.", L, registry=r)
        self.misses = Counter(PREFIX + "delta_cache_misses", "Variant requests that had to wait for a delta load.",
                              L, registry=r)
        self.loads = Counter(PREFIX + "delta_cache_loads", "Delta artifacts loaded.", L, registry=r)
        self.load_failures = Counter(PREFIX + "delta_cache_load_failures", "Delta artifact loads that failed.",
                                     L, registry=r)
        self.evictions = Counter(PREFIX + "delta_cache_evictions", "Deltas evicted from a cache tier "
                                 "(tier: device or host).", L + ["tier"], registry=r)
        self.unloads = Counter(PREFIX + "delta_cache_unloads", "Deltas dropped from a cache tier by an unload "
                               "(/v1/unload_variant, or a load replacing the variant from another folder), "
                               "which is no eviction (tier: device or host).", L + ["tier"], registry=r)
        self.load_seconds = Histogram(PREFIX + "delta_load_seconds", "Time to bring a delta onto the device, by "
                                      "the tier it came from (host: a copy; disk: read and checked).",
                                      L + ["tier"], buckets=LATENCY_BUCKETS, registry=r)
        # the engine's steps (every model's tokens together): vLLM's iteration_tokens_total, and where a
        # step's time goes (kind: decode rows only, or with prefill chunks)
        self.iteration_tokens = Histogram(PREFIX + "iteration_tokens_total", "Tokens fed to the model per engine "
                                          "step.", buckets=TOKEN_BUCKETS, registry=r)
        self.step_seconds = Histogram(PREFIX + "engine_step_seconds", "One engine step on the model thread, from "
                                      "its plan (or the previous step's tokens, when later: asynchronous "
                                      "scheduling) to its sampled tokens on the host.", ["kind"],
                                      buckets=STEP_BUCKETS, registry=r)
        self.launch_seconds = Histogram(PREFIX + "engine_step_launch_seconds", "The host's part of a step: "
                                        "preparing and launching its forward (ModelRunner.execute).", ["kind"],
                                        buckets=STEP_BUCKETS, registry=r)
        self.http_requests = Counter("http_requests_total", "HTTP answers by route (handler), method and "
                                     "status code; not /metrics or /health.", ["handler", "method", "status"],
                                     registry=r)
        for kind in ("decode", "prefill"):
            self.step_seconds.labels(kind)
            self.launch_seconds.labels(kind)
        # a model's series: every model's; a variant's delta cache; those by tier
        self._model_series = (self.ttft, self.itl, self.e2e, self.queue, self.running, self.waiting,
                              self.prompt_tokens, self.generation_tokens)
        self._delta_series = (self.hits, self.misses, self.loads, self.load_failures)
        self._tier_series = ((self.evictions, ("device", "host")), (self.unloads, ("device", "host")),
                             (self.load_seconds, ("host", "disk")))
        self._models: set[str] = set()
        for mid in model_ids:
            self.add_model(mid)

    def on_step(self, kind: str, seconds: float, launch: float, tokens: int) -> None:
        self.iteration_tokens.observe(tokens)
        self.step_seconds.labels(kind).observe(seconds)
        self.launch_seconds.labels(kind).observe(launch)

    def add_model(self, model_id: str) -> None:
        """Create every series of a model at zero (once), so it shows in /metrics before its first request."""
        if model_id in self._models:
            return
        self._models.add(model_id)
        for m in self._model_series:
            m.labels(model_id)
        if self.load is not None:
            self.running.labels(model_id).set_function(lambda: self.load()[0].get(model_id, 0))
            self.waiting.labels(model_id).set_function(lambda: self.load()[1].get(model_id, 0))
        if model_id == self.family:
            return
        for m in self._delta_series:
            m.labels(model_id)
        for m, tiers in self._tier_series:
            for tier in tiers:
                m.labels(model_id, tier)

    def has_model(self, model_id: str) -> bool:
        """Whether the model's series exist (:meth:`add_model`): it is served, or was in this process."""
        return model_id in self._models

    def remove_model(self, model_id: str) -> None:
        """Drop every series of a model (a name never served whose hot load failed: a client cannot
        grow the series without end). Never one served before: its counters only go up."""
        self._models.discard(model_id)
        for m in (*self._model_series, *self._delta_series):
            with contextlib.suppress(KeyError):
                m.remove(model_id)
        for m, tiers in self._tier_series:
            for tier in tiers:
                with contextlib.suppress(KeyError):
                    m.remove(model_id, tier)

    def on_delta_event(self, event: str, model_id: str, seconds: float, tier: str | None = None) -> None:
        if event == "miss" and not self.has_model(model_id):  # a variant found since: its series while it loads
            self.add_model(model_id)
        if event == "hit":
            self.hits.labels(model_id).inc()
        elif event == "miss":
            self.misses.labels(model_id).inc()
        elif event == "load":
            self.loads.labels(model_id).inc()
            self.load_seconds.labels(model_id, tier or "disk").observe(seconds)
        elif event == "load_failed":
            self.load_failures.labels(model_id).inc()
        elif event == "evict":
            self.evictions.labels(model_id, tier or "device").inc()
        elif event == "unload":
            self.unloads.labels(model_id, tier or "device").inc()


# ------------------------------------------------------------------------------------ app


def completion_logprobs(steps: list, offset: int = 0) -> dict | None:
    """OpenAI's completions ``logprobs`` of ``steps`` (None if they carry none); ``offset``: the
    characters of the tokens before the first step's. A token's offset is the length of the tokens
    before it, each decoded alone (as vLLM counts; a piece of a UTF-8 character, named ``bytes:\\xNN…``,
    counts as its bytes decode alone: ``detokenize.token_chars``)."""
    steps = [s for s in steps if s.logprob is not None]
    if not steps:
        return None
    offsets = []
    for s in steps:
        offsets.append(offset)
        offset += token_chars(s.token_str)
    return {"tokens": [s.token_str for s in steps], "token_logprobs": [s.logprob for s in steps],
            "top_logprobs": [_top_dict(s.top_logprobs + [(s.token_str, s.logprob)]) for s in steps],  # the token too
            "text_offset": offsets}


def _top_dict(pairs) -> dict[str, float]:
    """``{token: log-probability}``, the highest where a token comes twice (the one sampled is added to
    the likeliest, among which it may be)."""
    out: dict[str, float] = {}
    for t, v in pairs:
        if t not in out or v > out[t]:
            out[t] = v
    return out


def echo_logprobs(first: str, steps: list, keep: int) -> dict:
    """Completions ``logprobs`` with ``echo``: the prompt's tokens (``first``, decoded, then those the
    first Step's ``prompt_logprobs`` carry), then the first ``keep`` generated steps'."""
    prompt = steps[0].prompt_logprobs or []
    tokens = [first] + [t for t, _, _ in prompt]
    out = {"tokens": tokens, "token_logprobs": [None] + [v for _, v, _ in prompt],
           "top_logprobs": [None] + [_top_dict(top + [(t, v)]) for t, v, top in prompt],
           "text_offset": [sum(token_chars(t) for t in tokens[:i]) for i in range(len(tokens))]}
    generated = completion_logprobs(steps[:keep], sum(token_chars(t) for t in tokens))
    for key in out if generated else ():
        out[key] = out[key] + generated[key]
    return out


def chat_logprobs(steps: list) -> dict | None:
    """OpenAI's chat ``logprobs`` (``{"content": [...]}``) of ``steps``, None if they carry none."""
    steps = [s for s in steps if s.logprob is not None]
    if not steps:
        return None
    entry = lambda t, v, b: {"token": t, "logprob": v, "bytes": list(b)}  # its own bytes: a piece of a character too
    return {"content": [entry(s.token_str, s.logprob, s.token_bytes[0])
                        | {"top_logprobs": [entry(t, v, b) for (t, v), b in zip(s.top_logprobs, s.token_bytes[1:])]}
                        for s in steps]}


def stop_reason(steps: list, finish_reason: str | None) -> int | str | None:
    """vLLM's ``stop_reason`` of a choice (or chunk) that ends with ``steps`` and ``finish_reason``:
    the stop string or ``stop_token_ids`` id that ended it; None for any other end (the model's eos,
    a grammar's, length, tool calls) and before the end."""
    return steps[-1].stop_reason if steps and finish_reason == "stop" else None


async def json_off_loop(build: Callable[[], dict]) -> Response:
    """``build()``'s answer as JSON, made and encoded in a worker thread (as FastAPI's JSONResponse
    encodes it): a large answer (``n`` choices with logprobs: megabytes) must not hold up the event
    loop, which serves every other request and health check meanwhile."""
    def encode() -> bytes:
        return json.dumps(build(), ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")

    return Response(await run_in_threadpool(encode), media_type="application/json")


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def _chain(head: list, rest: AsyncIterator) -> AsyncIterator:
    for item in head:
        yield item
    async for item in rest:
        yield item


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


# Every status but 200 is an OpenAI error object (ErrorResponse); what each means, for /openapi.json.
STATUS = {
    400: "Invalid request: a body that is not JSON, a parameter out of range or not supported, a prompt "
         "over the context.",
    401: "No or a wrong API key (`Authorization: Bearer <key>`).",
    404: "No model (or variant) is served under this id (an artifact exported against another base is not "
         "served; the message says so).",
    408: "The request body did not arrive within the server's request timeout; the connection is closed.",
    409: "The variant has requests in flight: retry when they have finished.",
    413: "The request body is larger than the server's max_request_bytes.",
    429: "Overloaded: too many requests are waiting already. Retry after `Retry-After` seconds.",
    500: "An unexpected error, or the generation failed (the request's logits were not finite; a tensor-parallel "
         "rank died or stopped answering under it).",
    503: "The variant exists but cannot be served now: its artifact cannot be read, or no device slot came "
         "free in time (Retry-After); the server is receiving too many request bodies at once (Retry-After); "
         "the server is shutting down; the engine cannot generate any more (a tensor-parallel rank died or "
         "stopped answering: engine_failed, as /health answers then).",
}


def _responses(*statuses: int, ok: type | None = None, ok_media: dict | None = None) -> dict:
    out: dict = {s: {"model": ErrorResponse, "description": STATUS[s]} for s in sorted(statuses)}
    for status in {429, 503} & set(out):
        out[status]["headers"] = {"Retry-After": {"description": "seconds (429; 503 when no device slot came free "
                                                                 "or when busy receiving bodies)",
                                                  "schema": {"type": "integer"}}}
    if ok is not None or ok_media:
        out[200] = ({"model": ok} if ok else {}) | ({"content": ok_media} if ok_media else {})
    return out


def create_app(engine: Engine, *, max_waiting: int | None = None, api_key: str | None = None,
               max_request_bytes: int | None = MAX_REQUEST_BYTES, request_timeout_s: float | None = None,
               max_pending_body_bytes: int | None = MAX_PENDING_BODY_BYTES, cors: dict | None = None) -> FastAPI:
    """The FastAPI app serving ``engine``'s base and variants (see the module docstring).

    Args:
        engine: the loaded engine.
        max_waiting: with this many requests already waiting for the model, a new one is
            refused with 429 (OpenAI ``rate_limit_error``) instead of queueing; None: no limit.
        api_key: if set (not None or ""), every request but :data:`PROBES` (``/health``, ``/ping``,
            ``/metrics``) must send ``Authorization: Bearer <api_key>`` (else 401, OpenAI's
            ``invalid_api_key``).
        max_request_bytes: a request body larger than this is refused with 413 before it is read
            whole or parsed (:class:`BodyLimit`); None: no limit.
        request_timeout_s: a request body that has not arrived whole this many seconds after its
            head is refused with 408 (:class:`BodyLimit`); None: no limit. The head's own limit is
            the HTTP server's (:func:`http_protocol`).
        max_pending_body_bytes: a request body that would take the bytes of all bodies being
            received at once past this is refused with 503 (:class:`BodyLimit`); None: no limit.
        cors: Starlette's ``CORSMiddleware`` options (``allow_origins``, ``allow_methods``,
            ``allow_headers``, ``allow_credentials``), outside every other check, so a browser's
            preflight is answered without the API key; None: no CORS headers.
    """
    app = FastAPI(title="deltafleet", version="0.1.0",
                  description="OpenAI-compatible API over one base model and its BitDelta variants")
    # inside the API key check, added next
    stopping = Stopping()  # set by drain(): bodies still arriving are refused at once
    app.add_middleware(BodyLimit, limit=None if max_request_bytes is None else int(max_request_bytes),
                       timeout_s=request_timeout_s, pending_limit=max_pending_body_bytes, stopping=stopping)
    with_key = api_key is not None and str(api_key) != ""
    guarded = (500, 401) if with_key else (500,)  # the statuses of every /v1 route
    posted = guarded + (400, 408, 413, 503)  # and of every one with a body

    if with_key:
        app.add_middleware(APIKeyCheck, key=str(api_key))

    if cors is not None:  # outside the key check: a preflight is answered without the key
        app.add_middleware(CORSMiddleware, **cors)

    queued = {"n": 0}  # requests admitted but not yet started
    queued_lock = threading.Lock()
    metrics = Metrics([m.id for m in engine.models()], engine.family, engine.load)
    app.add_middleware(StatusCount, counter=metrics.http_requests, routes=lambda: app.routes)  # the outermost
    metrics.registry.register(_EngineCollector(engine))
    metrics.registry.register(_VllmCollector(engine))
    engine.add_listener(metrics.on_delta_event)
    engine.scheduler.step_observers.append(metrics.on_step)
    app.state.engine, app.state.metrics = engine, metrics
    def drain(timeout_s: float | None) -> None:
        """Begin a graceful shutdown (serve/run.py calls it on the first SIGTERM or Ctrl-C): ``/health``
        answers 503, requests that have not started, and every later one, are refused with 503
        ``shutting_down`` (``engine_failed`` once the engine failed, which shuts the server down
        too), and those running get ``timeout_s`` seconds (None: no limit) to finish, then are cut
        off with the same error (in-band for a stream that has begun)."""
        if engine.draining:
            return
        stopping.set()
        engine.drain(engine.failure() or ServerShuttingDownError("The server is shutting down; send the request "
                                                                 "to another server, or again once this one is back."))
        if timeout_s is not None:
            cut = ServerShuttingDownError(f"The server shut down: this request did not finish within its "
                                          f"{timeout_s:g} s of grace (timeout_graceful_shutdown_s).")
            timer = threading.Timer(timeout_s, engine.scheduler.abort, (cut, True))
            timer.daemon = True
            timer.start()

    app.state.drain = drain

    @app.exception_handler(APIError)
    async def _on_api_error(request: Request, exc: APIError):
        return exc.response()

    async def _on_engine_error(request: Request, exc: Exception):
        return _api_error(exc).response()

    for error in (InvalidRequestError, ModelNotFoundError, VariantUnavailableError, VariantInUseError, GenerationError,
                  ServerShuttingDownError, EngineFailedError):
        app.add_exception_handler(error, _on_engine_error)  # answered, not re-raised as the last handler's are

    @app.exception_handler(RequestValidationError)
    async def _on_validation_error(request: Request, exc: RequestValidationError):
        return _validation_error(exc, request.headers.get("content-type")).response()

    @app.exception_handler(StarletteHTTPException)
    async def _on_http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 400 and exc.__cause__ is not None:  # FastAPI could not parse the body
            why = {UnicodeDecodeError: ": it is not UTF-8 text", RecursionError: ": it is nested too deeply"}
            message = f"The request body is not valid JSON{why.get(type(exc.__cause__), '')}."
            if isinstance(exc.__cause__, ValueError) and "integer string conversion" in str(exc.__cause__):
                message = (f"The request body cannot be read: a number in it has more than "
                           f"{sys.get_int_max_str_digits()} digits.")  # valid JSON, past the parser's limit
            return APIError(400, message, code="invalid_json").response()
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), "invalid_request_error", None, code,
                        headers=exc.headers).response()  # a 405's Allow

    def openapi() -> dict:
        """FastAPI's document without its 422 (this server answers 400 for what FastAPI calls 422),
        every other status an OpenAI error object in JSON, and this engine's vocabulary size and
        model ids (as examples: variants come and go)."""
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
            for ops in doc["paths"].values():
                for op in ops.values():
                    op["responses"].pop("422", None)
                    for status, response in op["responses"].items():
                        if status != "200":  # also where the route's own answers are not JSON (/metrics)
                            response["content"] = error
            schemas = doc["components"]["schemas"]
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            for kind in schemas["CompletionRequest"]["properties"]["prompt"]["oneOf"]:  # this model's token ids
                items = kind.get("items", {})
                items = items.get("items", {}) if items.get("type") == "array" else items
                if items.get("type") == "integer":
                    items["maximum"] = engine.model.args.vocab_size - 1
            for name in ("CompletionRequest", "ChatCompletionRequest"):
                schemas[name]["properties"]["model"]["examples"] = [m.id for m in engine.models()]
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi

    @app.exception_handler(Exception)
    async def _on_error(request: Request, exc: Exception):
        return _api_error(exc).response()

    # ---------------------------------------------------------------- plain endpoints

    @app.get("/health", responses=_responses(500, 503, ok=Health))
    @app.get("/ping", responses=_responses(500, 503, ok=Health))  # vLLM's (SageMaker's) name for it
    async def health():
        failure = engine.failure()
        if failure is not None:  # a tensor-parallel rank died or stopped answering: the server stops
            return _api_error(failure).response()
        if engine.draining:
            return APIError(503, "the server is shutting down", "service_unavailable_error", None,
                            "shutting_down").response()
        return {"status": "ok"}

    @app.get("/version", responses=_responses(*guarded, ok=Version))
    async def version():
        """This server's version (vLLM's route)."""
        from deltafleet import __version__

        return {"version": __version__}

    @app.post("/tokenize", responses=_responses(*posted, 404, ok=Tokenized))
    async def tokenize(body: TokenizeRequest):
        """Token ids of a prompt or chat, as generation encodes them (vLLM's route)."""
        body.check()
        engine.card(body.model or engine.family)  # 404 for a model this server does not serve
        try:
            if body.messages is not None:
                messages = [m.as_dict() for m in body.messages]
                ids = await run_in_threadpool(functools.partial(
                    engine.encode_chat, messages, body.chat_template_kwargs, body.tool_dicts(), False,
                    add_generation_prompt=body.add_generation_prompt,
                    continue_final_message=body.continue_final_message))
            else:
                ids = await run_in_threadpool(engine.encode_prompt, body.prompt, body.add_special_tokens, False)
        except InvalidRequestError as e:
            raise _api_error(e) from None
        strs = await run_in_threadpool(engine.token_strs, ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize", responses=_responses(*posted, 404, ok=Detokenized))
    async def detokenize(body: DetokenizeRequest):
        """Text of token ids (vLLM's route)."""
        engine.card(body.model or engine.family)
        try:
            return {"prompt": await run_in_threadpool(engine.decode, body.tokens)}
        except InvalidRequestError as e:
            raise _api_error(e) from None

    @app.get("/metrics", response_class=PlainTextResponse, responses=_responses(500))
    async def prometheus():
        """Prometheus text format."""
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    created = int(time.time())

    def model_card(card) -> dict:
        return {"id": card.id, "object": "model", "created": created, "owned_by": "deltafleet",
                "parent": card.parent, "root": engine.family, "max_model_len": engine.max_model_len}

    @app.get("/v1/models", responses=_responses(*guarded, ok=ModelList))
    async def list_models():
        cards = await run_in_threadpool(engine.discover)
        for c in cards:
            metrics.add_model(c.id)
        return {"object": "list", "data": [model_card(c) for c in cards]}

    @app.get("/v1/models/{model_id}", responses=_responses(*guarded, 404, ok=ModelInfo))
    async def get_model(model_id: str):
        try:
            return model_card(await run_in_threadpool(engine.card, model_id))
        except ModelNotFoundError as e:
            raise _api_error(e) from None

    # ---------------------------------------------------------------- variants, hot

    @app.post("/v1/load_variant", responses=_responses(*posted, 404, 409, ok=LoadedVariant))
    async def load_variant(body: LoadVariantRequest):
        """Serve an artifact folder under the artifact root as ``<family>-<variant>`` and bring its
        deltas onto the device now (also a variant unloaded before). 400: the base, a path outside the
        root or without an artifact, an artifact of another base or one that cannot be used."""
        if body.variant == engine.family:
            raise APIError(400, f"`{engine.family}` is the base model, which is always loaded: it cannot be loaded "
                           "as a variant", param="variant", code="base_model")
        t0 = time.perf_counter()
        name = body.variant.removeprefix(f"{engine.family}-")  # a model id works too
        events, loader = [], []

        def note(ev, m, s, tier):  # this load's own loads: a request's on another thread are not its tier
            if m == f"{engine.family}-{name}" and ev == "load" and threading.get_ident() in loader:
                events.append(tier)  # (none: it was on the device, or another request's load brought it)

        def add():
            loader.append(threading.get_ident())
            return engine.add_variant(name, body.path)

        counted = metrics.has_model(f"{engine.family}-{name}")  # served before (or now): its counters stay
        engine.add_listener(note)
        try:
            card = await run_in_threadpool(add)
        except Exception as e:
            if not counted:  # its load's events made series of its own: gone with the name
                metrics.remove_model(f"{engine.family}-{name}")
            error = _api_error(e)
            if error.param == "model":  # no room for it in time: the variant this route was given
                error.param = "variant"
            raise error from None
        finally:
            engine.cache.remove_listener(note)
        metrics.add_model(card.id)
        return model_card(card) | {"loaded_from": events[-1] if events else "device",
                                   "load_seconds": round(time.perf_counter() - t0, 6)}

    @app.post("/v1/unload_variant", responses=_responses(*posted, 404, 409, ok=UnloadedVariant))
    async def unload_variant(body: UnloadVariantRequest):
        """Stop serving a variant (vLLM's ``/v1/unload_lora_adapter``): its deltas leave the device
        and host tiers, and it is neither listed nor served (404) until ``/v1/load_variant`` loads it
        again. 400: the base; 404: not served (unloaded already); 409: requests in flight on it."""
        v = body.variant
        mid = v if v == engine.family or v.startswith(f"{engine.family}-") else f"{engine.family}-{v}"
        try:
            await run_in_threadpool(engine.remove_variant, mid)
        except ModelNotFoundError as e:
            raise APIError(404, str(e), "invalid_request_error", "variant", "model_not_found") from None
        except Exception as e:
            raise _api_error(e) from None
        return {"id": mid, "object": "model", "unloaded": True}

    adapters_loading: collections.Counter[str] = collections.Counter()  # model ids /v1/load_lora_adapter is loading

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=_responses(*posted, 404, 409))
    async def load_lora_adapter(body: LoadLoraAdapterRequest):
        """vLLM's route, as the Gateway API Inference Extension's adapter sync calls it: ``lora_name``
        is the model id to serve (``<family>-<variant>``, or the variant's name), ``lora_path`` its
        artifact folder; the same as ``/v1/load_variant``, answered as vLLM does (plain text). As vLLM,
        a name already served is refused (400) unless ``load_inplace`` asks to replace it."""
        mid = f"{engine.family}-{body.lora_name.removeprefix(f'{engine.family}-')}"
        # (one being loaded counts: a second load of a new name while the first runs is refused too)
        if not body.load_inplace and (mid in adapters_loading or mid in {m.id for m in engine.models()}):
            raise APIError(400, f"The lora adapter '{body.lora_name}' has already been loaded.",
                           param="lora_name", code="already_loaded")
        adapters_loading[mid] += 1
        try:
            await load_variant(LoadVariantRequest(variant=body.lora_name, path=body.lora_path))
        except APIError as e:  # its parameters by vLLM's names
            e.param = {"variant": "lora_name", "path": "lora_path"}.get(e.param, e.param)
            raise
        finally:
            adapters_loading[mid] -= 1
            if not adapters_loading[mid]:
                del adapters_loading[mid]
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=_responses(*posted, 404, 409))
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest):
        """vLLM's route: ``/v1/unload_variant`` of ``lora_name``, answered as vLLM does (plain text)."""
        try:
            await unload_variant(UnloadVariantRequest(variant=body.lora_name))
        except APIError as e:
            e.param = {"variant": "lora_name"}.get(e.param, e.param)
            raise
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.get("/v1/delta_cache", responses=_responses(*guarded, ok=DeltaCacheState))
    async def delta_cache():
        """Where each variant's deltas are (device, host, disk), with bytes, requests in flight and
        the decayed request count that eviction ranks by."""
        c = engine.cache
        return {"object": "delta_cache", "device_bytes": c.device_bytes, "device_budget_bytes": c.device_budget,
                "host_bytes": c.host_bytes, "host_budget_bytes": c.host_budget, "variants": c.snapshot()}

    # ---------------------------------------------------------------- generation

    # Engine.prepare waits for a variant's deltas (a load, or room on the device, up to wait_timeout_s),
    # under a thread limit of its own: requests waiting so never take the threads that every other
    # request's tokenizing and answering need (anyio's default limit, 40). Each waits under its
    # admission (max_waiting), so no more than max_waiting wait at once and none queues for the limit.
    preparing: dict[asyncio.AbstractEventLoop, anyio.CapacityLimiter] = {}

    async def prepare(model: str, prompt_ids: list[int], params: SamplingParams, param: str, held=None):
        loop = asyncio.get_running_loop()
        if loop not in preparing:
            preparing[loop] = anyio.CapacityLimiter(max_waiting or MAX_PREPARING)
        job = asyncio.ensure_future(anyio.to_thread.run_sync(
            functools.partial(engine.prepare, model, prompt_ids, params, param, held), limiter=preparing[loop]))
        try:
            req = await asyncio.shield(job)
        except asyncio.CancelledError:  # its thread goes on: the hold on the variant it takes is given back
            job.add_done_callback(lambda j: j.cancelled() or j.exception() or engine.release(j.result()))
            raise
        except Exception as e:
            raise _api_error(e) from None
        metrics.add_model(req.model_id)  # the canonical id (a bare variant name would start series of its own)
        return req

    def admit() -> None:
        """Count one more HTTP request waiting (429 past ``max_waiting``), from before its variant's
        deltas are acquired until its first choice starts or ends (:func:`start`)."""
        with queued_lock:
            if max_waiting is not None and queued["n"] >= max_waiting:
                raise APIError(429, f"The server is overloaded: {queued['n']} requests are waiting already. "
                               "Retry later.", "rate_limit_error", None, "overloaded",
                               headers={"Retry-After": str(RETRY_AFTER_S)})
            queued["n"] += 1

    def unadmit() -> None:
        with queued_lock:
            queued["n"] -= 1

    async def prepare_all(model: str, prompts: list[list[int]], params: SamplingParams, n: int,
                          param: str) -> list:
        """One request per prompt and choice (prompt i's choice j at ``i·n + j``; with a seed, choice j
        samples with seed + j); all checked before any starts, none kept if one fails. The HTTP request
        is admitted first (:func:`admit`): a request waiting for its variant's deltas waits under it."""
        if len(prompts) * n > MAX_CHOICES:
            raise APIError(400, f"{len(prompts)} prompts × n = {n} is {len(prompts) * n} choices; at most "
                           f"{MAX_CHOICES} per request", "invalid_request_error", "n", "invalid_value")
        admit()
        reqs = []
        try:
            for ids in prompts:
                for j in range(n):
                    p = params if params.seed is None or j == 0 else dataclasses.replace(params, seed=params.seed + j)
                    # the later choices take the deltas the first holds
                    reqs.append(await prepare(model, ids, p, param, reqs[0].delta if reqs else None))
        except BaseException:
            for r in reqs:
                engine.release(r)
            unadmit()
            raise
        return reqs

    def start_all(reqs, arrival: float) -> list[tuple[asyncio.Queue, threading.Event]]:
        """:func:`start` the requests of one HTTP request (its prompts and choices), admitted together:
        ``max_waiting`` counts the HTTP request once, so that ``n`` above it is not always refused."""
        jobs, group = [], Group()  # a shutdown lets the request run once one of its choices has started
        try:
            for i, r in enumerate(reqs):
                jobs.append(start(r, arrival, first=i == 0, group=group))
        except BaseException:
            for _, cancel in jobs:
                cancel.set()
            for r in reqs[len(jobs):]:
                engine.release(r)
            if not jobs:  # else the first choice's end gives the admission back
                unadmit()
            raise
        return jobs

    outboxes: dict[asyncio.AbstractEventLoop, Outbox] = {}

    def outbox() -> Outbox:
        """This event loop's :class:`~deltafleet.serve.scheduler.Outbox` (made, and registered with the
        scheduler, on first use)."""
        loop = asyncio.get_running_loop()
        box = outboxes.get(loop)
        if box is None:
            box = outboxes[loop] = Outbox(loop)
            engine.scheduler.add_step_listener(box.flush)
        return box

    def start(req, arrival: float, first: bool = True,
              group: Group | None = None) -> tuple[asyncio.Queue, threading.Event]:
        """Submit ``req`` to the scheduler, its steps coming to an asyncio queue through this loop's
        outbox (one hand-over per engine step). ``first``: the first choice of its HTTP request,
        whose start (or end, if it never starts) gives back the request's admission (:func:`admit`).

        The counters are kept right when the request ends (its last item, in the loop),
        so a response that is never consumed leaks nothing; setting the returned event ends the
        request after its current step.
        """
        queue: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()
        mid = req.model_id
        state = {"started": False}

        def on_start() -> None:  # in the scheduler's thread
            state["started"] = True
            if first:  # the HTTP request waits (counts against max_waiting) until its first choice starts
                unadmit()
            metrics.queue.labels(mid).observe(time.perf_counter() - arrival)

        def on_end() -> None:  # in the loop, before the queue's last item
            engine.release(req)  # the variant may be evicted again
            if not state["started"] and first:
                unadmit()

        metrics.prompt_tokens.labels(mid).inc(len(req.prompt_ids))
        engine.scheduler.submit(req, cancel, on_start, out=outbox().sink(queue, on_end), group=group)
        return queue, cancel

    async def steps(req, arrival: float, job: tuple[asyncio.Queue, threading.Event],
                    counted: bool = True) -> AsyncIterator[list[Step]]:
        """The steps of a started job as they come, recording the latency metrics: each time, every
        step waiting in the queue (one, unless this event loop fell behind the model; then the
        stream catches up in fewer, larger chunks, as vLLM merges the outputs a slow consumer has
        not taken yet). ``counted`` False: its tokens are not the answer's (``max_tokens: 0``), and
        ``generation_tokens_total`` leaves them out, as ``usage`` does."""
        queue, cancel = job
        mid, last = req.model_id, None
        itl, tokens = metrics.itl.labels(mid), metrics.generation_tokens.labels(mid)  # once, not per token
        item, ended = None, False
        try:
            # To the end, even once cancelled: the scheduler ends the request after its current step
            # and sends the last item then.
            while (item := item or await queue.get()) is not END:
                batch = []
                while isinstance(item, Step):
                    batch.append(item)
                    item = queue.get_nowait() if not queue.empty() else None
                if batch:
                    now = time.perf_counter()
                    if last is None:
                        metrics.ttft.labels(mid).observe(now - arrival)
                    else:
                        itl.observe(now - last)
                    for _ in batch[1:]:
                        itl.observe(0.0)  # delivered with the one before
                    last = now
                    if counted:
                        tokens.inc(len(batch))
                    if batch[-1].finish_reason is not None:
                        if cancel.is_set():  # ended early for its client's hang-up (a whole answer's too)
                            metrics.requests.labels(mid, "abort").inc()
                        else:
                            metrics.e2e.labels(mid).observe(now - arrival)
                            metrics.requests.labels(mid, batch[-1].finish_reason).inc()
                        ended = True
                    yield batch
                if isinstance(item, BaseException):
                    metrics.requests.labels(mid, "error").inc()
                    ended = True
                    raise item
        finally:
            if not ended:  # cancelled: its client hung up (vLLM's finished_reason "abort")
                metrics.requests.labels(mid, "abort").inc()
            cancel.set()  # the client went away (or we are done): stop the worker after its step

    async def run(reqs, arrival: float, http: Request, counted: bool = True) -> list[tuple[str, str, int, list]]:
        """Run ``reqs`` together; ``(text, finish reason, tokens, steps)`` of each, in order
        (``counted``: as :func:`steps`)."""
        jobs = start_all(reqs, arrival)
        watch = asyncio.create_task(cancel_on_disconnect(http, [c for _, c in jobs]))

        async def one(req, job) -> tuple[str, str, int, list]:
            parts, reason, all_steps = [], "length", []
            async for batch in steps(req, arrival, job, counted):
                for s in batch:
                    parts.append(s.text)
                    reason = s.finish_reason or reason
                    all_steps.append(s)
            return "".join(parts), reason, len(all_steps), all_steps

        try:
            done = await asyncio.gather(*(one(r, j) for r, j in zip(reqs, jobs)))
            if await http.is_disconnected():  # an answer no one reads: nginx's 499 in http_requests_total
                raise APIError(499, "The client closed the request before its answer.", "invalid_request_error",
                               None, "client_closed_request")
            return done
        except Exception as e:
            for _, cancel in jobs:  # one failed: the others are not answered either
                cancel.set()
            raise _api_error(e) from None
        finally:
            watch.cancel()

    async def cancel_on_disconnect(http: Request, cancels: list[threading.Event]) -> None:
        """Set every event of ``cancels`` (a request's choices) once its client hangs up (Starlette
        cancels a streaming response by itself), so that an abandoned generation does not hold the
        model. One watcher per HTTP request, however many choices it has."""
        while not all(c.is_set() for c in cancels):
            if await http.is_disconnected():
                for c in cancels:
                    c.set()
            await asyncio.sleep(DISCONNECT_POLL_S)

    ending: set[asyncio.Future] = set()  # choices of a failed stream read to their ends (held from the GC)

    async def read_out(items: AsyncIterator) -> None:
        with contextlib.suppress(Exception):  # counted by steps() as it ends
            async for _ in items:
                pass

    async def stream(reqs, arrival: float, http: Request, chunk, include_usage: bool,
                     prompt_tokens: int, choice_prompt_tokens: list[int] | None = None) -> StreamingResponse:
        """SSE: ``chunk(text, finish_reason, first, index)`` per step of choice ``index`` (of ``reqs``)
        with text or a finish (unless it returns None; a list is sent chunk by chunk), the choices'
        steps interleaved as they come; then usage; then [DONE]. ``choice_prompt_tokens`` (vLLM's
        ``continuous_usage_stats``; None: off): each chunk's usage is its choice's so far, that many
        prompt tokens (its prompt's) and its tokens up to this chunk.

        The status line waits for the first choice's first token (the choices are admitted together,
        so a 429 is raised before), so that an error of its prefill or first step is still a status
        code, but not for the other choices': with ``n`` above ``max_batch`` the last ones start only
        as the first ones end. An error after it is an in-band error event, then [DONE].
        """
        jobs = start_all(reqs, arrival)
        items = [steps(r, arrival, j) for r, j in zip(reqs, jobs)]
        watch = asyncio.create_task(cancel_on_disconnect(http, [c for _, c in jobs]))
        heads: list[list] = [[] for _ in items]
        try:
            try:
                heads[0].append(await anext(items[0]))
            except StopAsyncIteration:  # cancelled before its first token: the client is gone
                pass
        except Exception as e:
            for _, cancel in jobs:
                cancel.set()
            for rest in items[1:]:  # read to their ends, cut off, so each choice is counted (as run's are)
                ending.add(task := asyncio.ensure_future(read_out(rest)))
                task.add_done_callback(ending.discard)
            raise _api_error(e) from None
        finally:
            watch.cancel()

        async def merged():
            """``(choice, steps)`` as the choices' steps come, ``(choice, None)`` at a choice's end and
            ``(choice, exception)`` if it fails: one choice read directly, several through a queue
            that a task per choice feeds."""
            if len(items) == 1:
                try:
                    async for s in _chain(heads[0], items[0]):
                        yield 0, s
                    yield 0, None
                except Exception as e:
                    yield 0, e
                return
            queue: asyncio.Queue = asyncio.Queue()

            async def feed(i: int):
                try:
                    async for s in _chain(heads[i], items[i]):
                        await queue.put((i, s))
                    await queue.put((i, None))
                except Exception as e:
                    await queue.put((i, e))

            feeders = [asyncio.create_task(feed(i)) for i in range(len(items))]
            try:
                while True:
                    yield await queue.get()
            finally:
                for f in feeders:
                    f.cancel()

        async def events():
            sent = [0] * len(items)  # characters of each choice's tokens so far (completions' text_offset)
            made = [0] * len(items)  # each choice's tokens so far (continuous usage)
            n, first, live = 0, [True] * len(items), len(items)
            source = merged()
            try:
                while live:
                    i, s = await anext(source)
                    if s is None:
                        live -= 1
                    elif isinstance(s, Exception):  # the status line is sent already: in-band, as vLLM does
                        yield _sse(_api_error(s).body())
                        break
                    else:  # the steps of choice i that came together: one chunk
                        n += len(s)
                        made[i] += len(s)
                        text, reason = "".join(x.text for x in s), s[-1].finish_reason
                        if text or reason or any(x.logprob is not None for x in s):
                            c = chunk(text, reason, first[i], i, s, sent[i])
                            # None: the steps add nothing yet (text a tool call holds); a list: chunks in turn
                            out = [] if c is None else c if isinstance(c, list) else [c]
                            for c in out:
                                if include_usage:  # as OpenAI's: null but on the last chunk; vLLM's continuous
                                    role_only = "role" in c["choices"][0].get("delta", {})  # a chat choice's first
                                    c = c | {"usage": None if choice_prompt_tokens is None else _usage(
                                        choice_prompt_tokens[i], 0 if role_only else made[i])}
                                yield _sse(c)
                                first[i] = False
                        sent[i] += sum(token_chars(x.token_str or "") for x in s)
                else:
                    if include_usage:
                        yield _sse(chunk(None, None, False, 0, [], 0) | {"choices": [], "usage": _usage(prompt_tokens, n)})
            finally:
                await source.aclose()
                for _, cancel in jobs:  # a client that hung up: stop the generations after their step
                    cancel.set()
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    generating = posted + (404, 429)
    sse = {"text/event-stream": {"schema": {  # one event (OpenAPI 3.1 reads a stream's schema so)
        "type": "object", "required": ["data"], "properties": {"data": {"type": "string", "description":
            "a chunk (JSON), `[DONE]` last; an error after the first token is an in-band error object "
            "(JSON) before `[DONE]`"}}}}}

    @app.post("/v1/completions", responses=_responses(*generating, ok=Completion, ok_media=sse))
    async def completions(body: CompletionRequest, http: Request):
        arrival = time.perf_counter()
        body.check()
        rid = f"cmpl-{request_id(http, body)}"
        try:
            prompts = [await run_in_threadpool(engine.encode_prompt, p) for p in body.prompts()]
        except InvalidRequestError as e:
            raise _api_error(e) from None
        reqs = await prepare_all(body.model, prompts, body.sampling(body.max_tokens), body.n, "prompt")
        created_at = int(time.time())
        model_id = reqs[0].model_id  # the canonical id, as /v1/models lists it, for a bare variant name too
        prompt_tokens = sum(len(ids) for ids in prompts)  # once per prompt, whatever n
        # echo streamed: each choice's first chunk starts with its prompt (and its tokens' logprobs), and
        # its later chunks' text_offset count the prompt's tokens' characters
        echoed = [p if isinstance(p, str) else engine.decode(p) for p in body.prompts()] if body.echo else None
        firsts = engine.token_texts([ids[0] for ids in prompts]) if body.echo and body.logprobs is not None else None
        prompt_chars: dict[int, int] = {}

        def chunk(text, finish_reason, first, index, steps=(), offset=0):
            echoing = body.stream and echoed is not None and first
            if echoing and firsts is not None and steps:
                logprobs = echo_logprobs(firsts[index // body.n], steps, len(steps))
                prompt_chars[index] = token_chars(firsts[index // body.n]) + sum(
                    token_chars(t) for t, _, _ in steps[0].prompt_logprobs or [])
            else:
                logprobs = completion_logprobs(steps, offset + prompt_chars.get(index, 0))
            if echoing:
                text = echoed[index // body.n] + (text or "")
            return {"id": rid, "object": "text_completion", "created": created_at, "model": model_id,
                    "choices": [{"index": index, "text": text or "", "logprobs": logprobs,
                                 "finish_reason": finish_reason, "stop_reason": stop_reason(steps, finish_reason)}]}

        if body.stream:
            opts = body.stream_options
            usage, continuous = opts.usage() if opts else (False, False)
            return await stream(reqs, arrival, http, chunk, usage, prompt_tokens,
                                [len(prompts[j // body.n]) for j in range(len(reqs))] if continuous else None)
        dropped = body.echo and body.max_tokens == 0  # the one token generated is not the answer's
        done = await run(reqs, arrival, http, counted=not dropped)

        def answer() -> dict:
            out = chunk("", None, True, 0)
            if body.echo:  # the prompt before each choice's text
                out["choices"] = [{"index": i, "text": echoed[i // body.n] + ("" if dropped else text),
                                   "finish_reason": "length" if dropped else reason,
                                   "stop_reason": None if dropped else stop_reason(st, reason),
                                   "logprobs": None if body.logprobs is None else
                                   echo_logprobs(firsts[i // body.n], st, 0 if dropped else len(st))}
                                  for i, (text, reason, _, st) in enumerate(done)]
            else:
                out["choices"] = [{"index": i, "text": text, "logprobs": completion_logprobs(st),
                                   "finish_reason": reason, "stop_reason": stop_reason(st, reason)}
                                  for i, (text, reason, _, st) in enumerate(done)]
            out["usage"] = _usage(prompt_tokens, 0 if dropped else sum(n for _, _, n, _ in done))
            return out
        return await json_off_loop(answer)

    @app.post("/v1/chat/completions", responses=_responses(*generating, ok=ChatCompletion, ok_media=sse))
    async def chat_completions(body: ChatCompletionRequest, http: Request):
        arrival = time.perf_counter()
        body.check()
        rid = f"chatcmpl-{request_id(http, body)}"
        try:
            messages = [m.as_dict() for m in body.messages]
            ids = await run_in_threadpool(functools.partial(
                engine.encode_chat, messages, body.chat_template_kwargs, body.tool_dicts(),
                add_generation_prompt=body.add_generation_prompt, continue_final_message=body.continue_final_message))
        except InvalidRequestError as e:
            raise _api_error(e) from None
        max_tokens = body.max_completion_tokens or body.max_tokens  # None: the rest of the context
        reqs = await prepare_all(body.model, [ids], body.sampling(max_tokens), body.n, "messages")
        model_id = reqs[0].model_id  # the canonical id, as /v1/models lists it, for a bare variant name too
        created_at = int(time.time())
        calls_tools = body.calls_tools()
        # a function named by tool_choice ends "stop", as OpenAI's and vLLM's do; a call the model chose, "tool_calls"
        call_reason = "stop" if isinstance(body.tool_choice, NamedToolChoice) else "tool_calls"
        max_calls = 1 if body.parallel_tool_calls is False else None
        tool_streams: dict[int, tools.ToolStream] = {}  # per choice: its text split into content and calls

        def chunk(text, finish_reason, first, index, steps=(), offset=0):
            calls = []
            if calls_tools:
                ts = tool_streams.setdefault(index, tools.ToolStream(max_calls))
                text, calls = ts.feed(text or "")
                if finish_reason is not None:
                    rest, more = ts.finish()
                    text, calls = text + rest, calls + more
                    finish_reason = call_reason if ts.calls and finish_reason == "stop" else finish_reason
            delta = {"content": text} if text else {}
            if calls:
                delta["tool_calls"] = calls
            lp = chat_logprobs(steps)

            def one(delta, lp, finish_reason):
                return {"id": rid, "object": "chat.completion.chunk", "created": created_at, "model": model_id,
                        "choices": [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason,
                                     "stop_reason": stop_reason(steps, finish_reason)}]}

            # a choice's first chunk is its role alone, as OpenAI's and vLLM's are; its content null, not
            # "", when tools are on (as the non-streamed answer has it when the reply is calls alone)
            role = {"role": "assistant", "content": None if calls_tools else ""}
            if steps and not delta and finish_reason is None and lp is None:
                return one(role, None, None) if first else None  # text the tool-call scanner holds back
            rest = one(delta, lp, finish_reason)
            return [one(role, None, None), rest] if first else rest

        def message(text: str, reason: str) -> tuple[dict, str]:
            """The answer's message and finish reason, its tool-call blocks parsed when tools are on."""
            if calls_tools:
                content, calls = tools.parse(text, max_calls)
                if calls:
                    return ({"role": "assistant", "content": content,
                             "tool_calls": [tools.as_tool_call(c) for c in calls]},
                            call_reason if reason == "stop" else reason)
            return {"role": "assistant", "content": text}, reason

        if body.stream:
            opts = body.stream_options
            usage, continuous = opts.usage() if opts else (False, False)
            return await stream(reqs, arrival, http, chunk, usage, len(ids),
                                [len(ids)] * len(reqs) if continuous else None)
        done = await run(reqs, arrival, http)

        def answer() -> dict:
            choices = []
            for i, (text, reason, _, st) in enumerate(done):
                msg, reason = message(text, reason)
                choices.append({"index": i, "message": msg, "logprobs": chat_logprobs(st), "finish_reason": reason,
                                "stop_reason": stop_reason(st, reason)})
            return {"id": rid, "object": "chat.completion", "created": created_at, "model": model_id,
                    "choices": choices, "usage": _usage(len(ids), sum(n for _, _, n, _ in done))}
        return await json_off_loop(answer)

    return app
