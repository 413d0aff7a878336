"""The request guard: pure ASGI middleware in front of every route, BentoML's and ours.

API key, pickle refusal, body size limit, and the trace headers that name the model on
every response. It knows nothing of the model: the service hands it the key, the limit and
the headers (``trace_headers`` in trainyard.serve.settings).
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from trainyard.core.config import ServeParams
from trainyard.serve.balance import PROTOCOLS, surplus_connection
from trainyard.serve.metrics import count_refusal

# Reachable without the API key (probes, metrics, the docs UI); everything else needs it.
OPEN_PATHS = frozenset(
    {"/healthz", "/livez", "/readyz", "/metrics", "/", "/docs.json", "/docs", "/ui"}
)
OPEN_PREFIXES = ("/static_content/", "/assets/", "/ui/")
PICKLE = "application/vnd.bentoml+pickle"
# ServeParams' defaults (serve.max_header_bytes, body_timeout_s, header_timeout_s).
_DEFAULTS = ServeParams()
MAX_HEADER_BYTES, BODY_TIMEOUT_S = _DEFAULTS.max_header_bytes, _DEFAULTS.body_timeout_s
HEADER_TIMEOUT_S = _DEFAULTS.header_timeout_s

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]
HeaderList = Sequence[tuple[bytes, bytes]]


class RequestGuard:
    """Pure ASGI middleware in front of every route, BentoML's and ours.

    - API key (when set): ``Authorization: Bearer <key>``, constant-time compare, 401 else;
    - ``application/vnd.bentoml+pickle`` -> 415 on every route (never unpickle a request);
    - request line and headers over ``max_header_bytes`` -> 431 (httptools has no limit);
    - a POST body over ``max_body_bytes`` -> 413, read no further (Content-Length or
      counted), else handed on whole, so no route ever holds more than the limit;
    - a body not received whole within ``body_timeout_s`` -> 408 (a slow client);
    - a connection that sends no whole request head within ``header_timeout_s`` is closed
      (uvicorn has no such timer: ``bound_header_time``).
    - every response carries ``trace_headers`` (the model's version, run, data version;
      a callable: those of the model answering when the response starts);
    - ``shed_paths`` (routes on BentoML's adaptive batcher): the 503 BentoML answers for
      a request its batcher shed (a generic body, no Retry-After) becomes ``shed()``, the
      service's own overload answer.
    """

    def __init__(
        self,
        app: App,
        *,
        api_key: str | None,
        max_body_bytes: int,
        trace_headers: HeaderList | Callable[[], HeaderList] = (),
        max_header_bytes: int = MAX_HEADER_BYTES,
        body_timeout_s: float = BODY_TIMEOUT_S,
        header_timeout_s: float | None = HEADER_TIMEOUT_S,
        shed_paths: frozenset[str] = frozenset(),
        shed: Callable[[], JSONResponse] | None = None,
    ) -> None:
        self.app = app
        self.shed_paths, self.shed = shed_paths, shed
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        # A callable: the headers of the model answering when each response starts (a
        # service following its registry alias swaps models while it runs).
        if callable(trace_headers):
            self.trace_headers = trace_headers
        else:
            fixed = list(trace_headers)
            self.trace_headers = lambda: fixed
        self.max_header_bytes, self.body_timeout_s = max_header_bytes, body_timeout_s
        if header_timeout_s is not None:
            bound_header_time(header_timeout_s)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer a refused request here; hand any other on, its body already read."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        send = _with_headers(send, self.trace_headers)
        headers = Headers(scope=scope)
        if await self._refused_head(send, scope, headers):
            return
        if scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        if headers.get("content-type", "").split(";")[0].strip().lower() == PICKLE:
            await _error(
                send,
                scope,
                415,
                "pickle request bodies are refused; send JSON, multipart or an image",
                field="Content-Type",
                reason="unsupported_media_type",
            )
            return
        # asyncio's own timer, not anyio.move_on_after: the same deadline for half the
        # CPU (the cancel scope's task-state lookup was ~2% of a small model's request).
        try:
            async with asyncio.timeout(self.body_timeout_s):
                body = await self._read_body(scope, receive, send, headers)
        except TimeoutError:
            await _error(
                send,
                scope,
                408,
                f"request body not received whole within {self.body_timeout_s:g} s "
                "(serve.body_timeout_s); send it faster or smaller",
                field="body",
                reason="body_timeout",
            )
            return
        if body is None:
            return
        if self.shed is not None and scope["path"] in self.shed_paths:
            send = _answer_shed(send, scope, self.shed)
        await self.app(scope, _replay(body, receive), send)

    async def _refused_head(self, send: Send, scope: Scope, headers: Headers) -> bool:
        """Answer 431 (headers too large) or 401 (no or wrong key) here: True if it did."""
        head = _head_bytes(scope)
        if head > self.max_header_bytes:
            await _error(
                send,
                scope,
                431,
                f"request line and headers of {head:,} bytes, over the limit of "
                f"{self.max_header_bytes:,} (serve.max_header_bytes); send fewer, shorter headers",
                field="headers",
                reason="headers_too_large",
            )
            return True
        if not self._allowed(scope, headers):
            await _error(
                send,
                scope,
                401,
                "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                field="Authorization",
                reason="unauthorized",
                extra_headers={"www-authenticate": 'Bearer realm="trainyard"'},
            )
            return True
        return False

    def _allowed(self, scope: Scope, headers: Headers) -> bool:
        """No key set, an open path (probes, metrics, docs), or the right key."""
        if self.api_key is None:
            return True
        path = scope["path"]
        if scope["method"] in ("GET", "HEAD") and (
            path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)
        ):
            return True
        return _authorized(headers, self.api_key)

    async def _read_body(
        self, scope: Scope, receive: Receive, send: Send, headers: Headers
    ) -> bytes | None:
        """The whole body, or None after answering 413/400 (over the limit, bad length)."""
        limit = self.max_body_bytes
        too_big = f"request body over {limit:,} bytes (serve.max_body_bytes)"
        declared = headers.get("content-length")
        if declared is not None:
            # ASCII digits only: '²' is a digit int() refuses, 4301 digits an int() refuses.
            if not (declared.isascii() and declared.isdigit() and len(declared) <= 18):
                await _error(
                    send,
                    scope,
                    400,
                    "Content-Length is not a number",
                    field="body",
                    reason="bad_request",
                )
                return None
            if int(declared) > limit:
                await _error(send, scope, 413, too_big, field="body", reason="body_too_large")
                return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:  # chunked upload that never declared its length
                await _error(send, scope, 413, too_big, field="body", reason="body_too_large")
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _head_bytes(scope: Scope) -> int:
    """The request line and headers as they came, roughly: method, path, query, each
    header's name and value with its separators."""
    line = len(scope.get("raw_path") or scope["path"]) + len(scope.get("query_string", b""))
    return line + len(scope["method"]) + sum(len(k) + len(v) + 4 for k, v in scope["headers"])


def bound_header_time(seconds: float) -> None:
    """Close any uvicorn connection that has not sent a whole request head within
    ``seconds`` of connecting or of its last response (slowloris). uvicorn's keep-alive
    timer stops at a connection's first byte, so a trickled head held it open forever.
    Patches both HTTP protocol classes, once per process; later calls set the time."""
    for cls in PROTOCOLS:
        if not hasattr(cls, "_trainyard_head_s"):
            _patch_protocol(cls)
        cls._trainyard_head_s = seconds  # type: ignore[attr-defined]


def _patch_protocol(cls: Any) -> None:
    made, complete, lost = cls.connection_made, cls.on_response_complete, cls.connection_lost

    def arm(self: Any) -> None:
        timer = getattr(self, "_trainyard_head_timer", None)
        if timer is not None:
            timer.cancel()
        self._trainyard_head_timer = asyncio.get_running_loop().call_later(
            cls._trainyard_head_s, expire, self
        )

    def expire(self: Any) -> None:
        waiting = self.cycle is None or self.cycle.response_complete  # no request under way
        if waiting and not self.transport.is_closing():
            self.transport.close()

    def connection_made(self: Any, transport: Any) -> None:
        made(self, transport)
        arm(self)

    def on_response_complete(self: Any) -> None:
        complete(self)
        if not self.transport.is_closing():
            arm(self)

    def connection_lost(self: Any, exc: Exception | None) -> None:
        timer = getattr(self, "_trainyard_head_timer", None)
        if timer is not None:
            timer.cancel()
        lost(self, exc)

    cls.connection_made, cls.on_response_complete = connection_made, on_response_complete
    cls.connection_lost = connection_lost


def _with_headers(send: Send, extra: Callable[[], HeaderList]) -> Send:
    """A send() that adds ``extra()`` to the response's headers, and closes the connection
    after it when this worker holds more than its share (trainyard.serve.balance)."""

    async def traced(message: Message) -> None:
        if message["type"] == "http.response.start":
            message["headers"] = [*message.get("headers", []), *extra()]
            if surplus_connection():
                message["headers"].append((b"connection", b"close"))
        await send(message)

    return traced


def _answer_shed(send: Send, scope: Scope, shed: Callable[[], JSONResponse]) -> Send:
    """A send() that answers ``shed()`` in place of BentoML's 503 for a request its batcher
    shed. BentoML raises that 503 (ServiceUnavailable) inside its endpoint, where no method
    of the service can catch it; ours carry Retry-After, its does not."""
    replaced = False

    async def answered(message: Message) -> None:
        nonlocal replaced
        if message["type"] == "http.response.start" and _bentoml_shed(message):
            replaced = True
            await shed()(scope, _disconnected, send)
            return
        if replaced:  # BentoML's body: already answered
            return
        await send(message)

    return answered


def _bentoml_shed(start: Message) -> bool:
    """BentoML's 503: the service's own 503s (Refused) all carry Retry-After."""
    named = {name.lower() for name, _ in start.get("headers", [])}
    return bool(start["status"] == 503 and b"retry-after" not in named)


async def _disconnected() -> Message:  # a response that never reads the request
    return {"type": "http.disconnect"}


def _authorized(headers: Headers, key: bytes) -> bool:
    scheme, _, credential = headers.get("authorization", "").partition(" ")
    given = credential.strip().encode("latin-1")  # Headers decoded latin-1: the exact bytes
    # compare_digest even when the scheme is wrong: the time taken says nothing.
    return hmac.compare_digest(given, key) and scheme.lower() == "bearer"


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive() that hands the app the body already read, then the real stream's end."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _error(
    send: Send,
    scope: Scope,
    status: int,
    message: str,
    *,
    field: str | None,
    reason: str,
    extra_headers: dict[str, str] | None = None,
) -> None:
    count_refusal(reason)
    response = JSONResponse({"error": message, "field": field}, status, extra_headers)
    await response(scope, _disconnected, send)
