"""Each explicit limit on hostile input answers a 4xx that names it (serve.max_* params),
in process; and, slow-marked, what a real `bentoml serve` does with slow clients.

The real-server test prints how long a stalled request head and a stalled body are held
(pytest -s shows the figures); tests/serve/test_fuzz.py drives random input at the same routes.
"""

from __future__ import annotations

import asyncio
import io
import json
import socket
import time
from collections.abc import Iterator

import pytest
from PIL import Image
from starlette.testclient import TestClient
from test_serve_unit import CARD, client_for, guarded, png
from test_serving import server  # noqa: F401  (a fixture; model_dir, test_set: conftest)

from trainyard.core.config import ServeParams
from trainyard.core.errors import InputError
from trainyard.core.imaging import image_to_pixels, read_header
from trainyard.serve import guard
from trainyard.serve.guard import RequestGuard

JSON = {"content-type": "application/json"}
PNG = {"content-type": "image/png"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    from test_serve_unit import write_tiny_model

    path, weights = write_tiny_model(tmp_path_factory.mktemp("limits-model"))
    return {"path": path, "weights": weights}


@pytest.fixture(scope="module")
def client(tiny) -> Iterator[TestClient]:
    yield from client_for(tiny, max_json_depth=6, max_json_values=100, max_json_int_digits=5)


def strip(w: int, h: int) -> bytes:
    buf = io.BytesIO()
    Image.new("L", (w, h), 255).save(buf, "PNG")
    return buf.getvalue()


def assert_refused(resp, status: int, *words: str) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    for word in words:
        assert word in body["error"], body
    return body


def test_guard_defaults_are_the_params_defaults():
    p = ServeParams()
    assert p.max_header_bytes == guard.MAX_HEADER_BYTES
    assert p.body_timeout_s == guard.BODY_TIMEOUT_S
    assert p.header_timeout_s == guard.HEADER_TIMEOUT_S


def test_json_nesting_deeper_than_max_json_depth_is_a_400(client):
    body = b'{"images": ' + b"[" * 7 + b"]" * 7 + b"}"
    out = assert_refused(
        client.post("/classify_batch", content=body, headers=JSON), 400, "serve.max_json_depth"
    )
    assert out["field"] == "body"
    deep = b"[" * 60_000  # past json's recursion limit: was a 500
    assert_refused(client.post("/classify_batch", content=deep, headers=JSON), 400, "60000 levels")
    # Brackets inside strings do not count.
    ok = json.dumps({"images": [CARD_PIXELS], "x[[[[[[[[[": 1}).encode()
    assert_refused(client.post("/classify_batch", content=ok, headers=JSON), 400, "unknown field")


CARD_PIXELS = [[0] * CARD.width for _ in range(CARD.height)]


def test_json_with_more_than_max_json_values_is_a_413(client):
    body = json.dumps({"images": [CARD_PIXELS] * 7}).encode()  # 112 numbers
    assert_refused(
        client.post("/classify_batch", content=body, headers=JSON), 413, "serve.max_json_values"
    )


def test_json_integer_longer_than_max_json_int_digits_is_a_400(client):
    for digits in (6, 400, 5000):  # 5000: past Python's int() limit, was a 500
        body = b'{"images": [[[1' + b"0" * (digits - 1) + b"]]]}"
        assert_refused(
            client.post("/classify_batch", content=body, headers=JSON),
            400,
            f"{digits:,} digits",
            "serve.max_json_int_digits",
        )


def test_image_more_elongated_than_max_aspect_ratio_is_a_400(client):
    out = assert_refused(
        client.post("/classify", content=strip(1, 20_000), headers=PNG),
        400,
        "1x20000",
        "serve.max_aspect_ratio",
    )
    assert out["field"] == "image"
    assert client.post("/classify", content=strip(1, 100), headers=PNG).status_code == 200
    with pytest.raises(InputError, match="max_aspect_ratio"):
        read_header(strip(3, 1), max_aspect_ratio=2)


def test_pad_canvas_over_four_times_max_image_pixels_is_a_413():
    # 10x1000 = 10k pixels, under the limit, but padded square it is 1M (a 600x600 target
    # is too large for the strip to be reduced first).
    with pytest.raises(InputError, match="pad to 1000x1000") as err:
        image_to_pixels(strip(10, 1000), channels=1, height=600, width=600, max_pixels=100_000)
    assert err.value.status == 413
    out = image_to_pixels(strip(10, 1000), channels=1, height=600, width=600, max_pixels=250_000)
    assert out.shape == (1, 600, 600)
    # For a small target the strip is box-reduced (to 1x17) before padding: a tiny canvas.
    out = image_to_pixels(strip(10, 1000), channels=1, height=8, width=8, max_pixels=100_000)
    assert out.shape == (1, 8, 8)


def test_headers_over_max_header_bytes_are_a_431():
    client = guarded(api_key=None)
    big = {"x-junk": "a" * 20_000}
    out = assert_refused(client.post("/classify", content=b"x", headers=big), 431, "16,384")
    assert out["field"] == "headers" and "serve.max_header_bytes" in out["error"]
    assert client.post("/classify", content=b"x", headers={"x-junk": "a" * 8000}).text == "1"


def test_odd_content_length_and_top_k_digits_are_400s(client):
    for length in ("²", "9" * 5000):  # int() refuses both: were 500s
        scope_headers = [(b"content-type", b"image/png"), (b"content-length", length.encode())]
        status, body = asyncio.run(
            call(RequestGuard(echo_app, api_key=None, max_body_bytes=99), scope_headers, [b"x"])
        )
        assert status == 400 and b"Content-Length" in body
    resp = client.post("/classify?top_k=" + "1" * 5000, content=png(CARD_IMAGE), headers=PNG)
    assert_refused(resp, 400, "top_k")


CARD_IMAGE = __import__("numpy").zeros((4, 4), dtype="uint8")


async def echo_app(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


async def call(app, headers, chunks, delay: float = 0.0) -> tuple[int, bytes]:
    """One POST through ``app`` whose body arrives in ``chunks``, ``delay`` s apart."""
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/classify",
        "raw_path": b"/classify",
        "query_string": b"",
        "headers": headers,
    }
    pending = list(chunks)
    out: dict = {"body": b""}

    async def receive():
        await asyncio.sleep(delay)
        chunk = pending.pop(0) if pending else b""
        return {"type": "http.request", "body": chunk, "more_body": bool(pending)}

    async def send(message):
        if message["type"] == "http.response.start":
            out["status"] = message["status"]
        else:
            out["body"] += message.get("body", b"")

    await app(scope, receive, send)
    return out["status"], out["body"]


def test_body_slower_than_body_timeout_s_is_a_408():
    app = RequestGuard(
        echo_app, api_key=None, max_body_bytes=999, body_timeout_s=0.3, header_timeout_s=None
    )
    headers = [(b"content-type", b"image/png")]
    start = time.monotonic()
    status, body = asyncio.run(call(app, headers, [b"a"] * 100, delay=0.05))
    assert status == 408 and b"serve.body_timeout_s" in body
    assert time.monotonic() - start < 1.5
    assert asyncio.run(call(app, headers, [b"a"] * 3, delay=0.01))[0] == 200


# ---------------------------------------------------------------------------- real server


def stalled(port: int, first: bytes, trickle: bytes, every_s: float, limit_s: float) -> tuple:
    """Send ``first``, then ``trickle`` every ``every_s`` until the server answers or closes;
    (seconds until then, what it sent)."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=every_s) as sock:
        sock.sendall(first)
        got = b""
        while time.monotonic() - start < limit_s:
            try:
                data = sock.recv(65536)
                if not data:
                    break
                got += data
                if b"\r\n\r\n" in got:
                    break
            except TimeoutError:
                try:
                    sock.sendall(trickle)
                except OSError:
                    break
            except OSError:
                break
        return round(time.monotonic() - start, 1), got.split(b"\r\n", 1)[0]


@pytest.mark.slow
def test_a_real_server_bounds_slow_heads_and_slow_bodies(server):  # noqa: F811
    """Slowloris (a head trickled byte by byte), an idle connection and a stalled body each
    end within their timeout (serve.header_timeout_s 10 s, serve.body_timeout_s 8 s)."""
    port = server.port
    head, took_head = b"POST /classify HTTP/1.1\r\nHost: x\r\n", {}
    took_head["trickled head"] = stalled(port, head, b"X", 1.0, 60)
    took_head["idle connection"] = stalled(port, b"", b"", 1.0, 60)
    body = head + b"Content-Type: image/png\r\nContent-Length: 1000\r\n\r\nabc"
    took_head["stalled body"] = stalled(port, body, b"a", 1.0, 60)
    print("\nslow clients against bentoml serve:", took_head)
    for name, (seconds, _) in took_head.items():
        assert seconds < 15, (name, seconds)
    assert b"408" in took_head["stalled body"][1]
    assert server.proc.poll() is None
