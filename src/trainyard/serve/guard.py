"""The request guard: pure ASGI middleware in front of every route, BentoML's and ours.

API key, pickle refusal, body size limit, and the trace headers that name the model on
every response. It knows nothing of the model: the service hands it the key, the limit and
the headers (``trace_headers`` in trainyard.serve.settings).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from trainyard.serve.metrics import count_refusal

# Reachable without the API key (probes, metrics, the docs UI); everything else needs it.
OPEN_PATHS = frozenset(
    {"/healthz", "/livez", "/readyz", "/metrics", "/", "/docs.json", "/docs", "/ui"}
)
OPEN_PREFIXES = ("/static_content/", "/assets/", "/ui/")
PICKLE = "application/vnd.bentoml+pickle"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


class RequestGuard:
    """Pure ASGI middleware in front of every route, BentoML's and ours.

    - API key (when set): ``Authorization: Bearer <key>``, constant-time compare, 401 else;
    - ``application/vnd.bentoml+pickle`` -> 415 on every route (never unpickle a request);
    - a POST body over ``max_body_bytes`` -> 413, read no further (Content-Length or
      counted), else handed on whole, so no route ever holds more than the limit;
    - every response carries ``trace_headers`` (the model's version, run, data version).
    """

    def __init__(
        self,
        app: App,
        *,
        api_key: str | None,
        max_body_bytes: int,
        trace_headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.trace_headers = list(trace_headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer a refused request here; hand any other on, its body already read."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        send = _with_headers(send, self.trace_headers)
        headers = Headers(scope=scope)
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
        body = await self._read_body(scope, receive, send, headers)
        if body is None:
            return
        await self.app(scope, _replay(body, receive), send)

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
            if not declared.isdigit():
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


def _with_headers(send: Send, extra: list[tuple[bytes, bytes]]) -> Send:
    """A send() that adds ``extra`` to the response's headers."""

    async def traced(message: Message) -> None:
        if message["type"] == "http.response.start":
            message["headers"] = [*message.get("headers", []), *extra]
        await send(message)

    return traced


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

    async def no_body() -> Message:  # the response never reads the request
        return {"type": "http.disconnect"}

    await response(scope, no_body, send)
