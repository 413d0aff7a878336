"""Hostile input, generated: no answer of the real routes (behind the request guard) is a
5xx, every 4xx is JSON with an ``error``, and a good request still works afterwards.

Hypothesis drives images (modes, sizes up to the pixel limit, extreme aspect ratios,
formats, metadata, frames, truncation and corruption) and JSON bodies (depth, size, huge
and odd numbers, non-object tops, duplicate keys, invalid UTF-8) at /classify and
/classify_batch, as multipart and as raw bodies, in process. Derandomized and bounded.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from PIL import Image, PngImagePlugin
from starlette.testclient import TestClient
from test_serve_unit import CARD, client_for, png, write_tiny_model

from trainyard.core.card import Card

from conftest import make_card

MAX_PIXELS = 200_000  # the clients' serve.max_image_pixels: sizes up to it stay fast
FUZZ = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
RGB_PAD = make_card(("a", "b"), (3, 8, 6), resize="pad")


def clients(folder, card: Card, batching: bool) -> Iterator[TestClient]:
    path, weights = write_tiny_model(folder, card)
    yield from client_for(
        {"path": path, "weights": weights},
        max_image_pixels=MAX_PIXELS,
        max_body_bytes=2**20,
        batching=batching,
    )


@pytest.fixture(scope="module")
def gray(tmp_path_factory) -> Iterator[TestClient]:
    """/classify on BentoML's adaptive batcher (the batchable method reads the request)."""
    yield from clients(tmp_path_factory.mktemp("fuzz-gray"), CARD, batching=True)


@pytest.fixture(scope="module")
def rgb(tmp_path_factory) -> Iterator[TestClient]:
    """/classify unbatched."""
    yield from clients(tmp_path_factory.mktemp("fuzz-rgb"), RGB_PAD, batching=False)


GOOD = png(np.arange(16, dtype=np.uint8).reshape(4, 4))


def check(client: TestClient, resp) -> None:
    """The property: no 5xx; a 4xx is JSON naming the problem; the app still answers."""
    assert resp.status_code < 500, resp.text[:300]
    if resp.status_code >= 400:
        body = resp.json()
        assert isinstance(body["error"], str) and body["error"], body
    else:
        assert isinstance(resp.json(), dict | list)
    ok = client.post("/classify", content=GOOD, headers={"content-type": "image/png"})
    assert ok.status_code == 200, ok.text


# ---------------------------------------------------------------------------- images

MODES = ("1", "L", "LA", "P", "RGB", "RGBA", "I;16", "I", "F", "CMYK")
FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF")


@st.composite
def sizes(draw) -> tuple[int, int]:
    kind = draw(st.sampled_from(["small", "strip", "large"]))
    if kind == "small":
        return draw(st.integers(1, 64)), draw(st.integers(1, 64))
    if kind == "strip":  # extreme aspect ratios, 1 x 20000 and the like
        long = draw(st.sampled_from([100, 1000, 20_000, MAX_PIXELS]) | st.integers(100, MAX_PIXELS))
        return (1, long) if draw(st.booleans()) else (long, 1)
    w = draw(st.integers(100, 1000))
    return w, draw(st.integers(100, MAX_PIXELS // w + 50))  # around the pixel limit


def make_image(mode: str, size: tuple[int, int], seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    base = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    if mode in ("I;16", "I", "F"):
        return base.convert("L").convert(mode if mode != "I;16" else "I").convert(mode)
    return base.convert(mode)


def encode(im: Image.Image, fmt: str, kw: dict) -> bytes:
    """``im`` as ``fmt``; as RGB, or as PNG, where the format cannot hold its mode or size
    (WebP: 16383 px a side)."""
    rgb = im.convert("RGB")
    for image, form, extra in ((im, fmt, kw), (rgb, fmt, {}), (im, "PNG", {}), (rgb, "PNG", {})):
        buf = io.BytesIO()
        try:
            image.save(buf, form, **extra)
            return buf.getvalue()
        except Exception:
            continue
    raise AssertionError("PNG takes RGB")


@st.composite
def image_files(draw) -> bytes:
    mode, fmt = draw(st.sampled_from(MODES)), draw(st.sampled_from(FORMATS))
    im = make_image(mode, draw(sizes()), draw(st.integers(0, 2**16)))
    kw: dict = {}
    if fmt == "PNG" and draw(st.booleans()):
        info = PngImagePlugin.PngInfo()
        info.add_text("t", draw(st.text(max_size=50)))
        info.add_text("z", "x" * draw(st.integers(0, 5000)), zip=True)
        info.add_itxt("i", draw(st.text(max_size=50)), lang="en")
        kw["pnginfo"] = info
    if fmt in ("JPEG", "PNG", "WEBP", "TIFF") and draw(st.booleans()):
        exif = Image.Exif()
        exif[0x0112] = draw(st.sampled_from([0, 1, 3, 5, 6, 8, 9, 255, 65535]))
        kw["exif"] = exif
    frames = draw(st.integers(1, 4)) if fmt in ("GIF", "WEBP") else 1
    if frames > 1:
        kw.update(save_all=True, append_images=[im.copy() for _ in range(frames - 1)])
    data = encode(im, fmt, kw)
    damage = draw(st.sampled_from(["none", "truncate", "flip", "junk"]))
    if damage == "truncate":
        return data[: draw(st.integers(0, len(data)))]
    if damage == "flip" and data:
        out = bytearray(data)
        for _ in range(draw(st.integers(1, 8))):
            out[draw(st.integers(0, len(out) - 1))] = draw(st.integers(0, 255))
        return bytes(out)
    if damage == "junk":
        return data + draw(st.binary(max_size=64))
    return data


def send_image(client: TestClient, data: bytes, how: str):
    if how == "raw":
        return client.post("/classify", content=data, headers={"content-type": "image/png"})
    if how == "multipart":
        return client.post("/classify", files={"image": ("x", data, "image/png")})
    if how == "batch":
        return client.post("/classify_batch", files=[("images", ("x", data)), ("images", GOOD)])
    return client.post("/classify_batch", content=data, headers={"content-type": "image/png"})


HOW = st.sampled_from(["raw", "multipart", "batch", "batch-raw"])


@FUZZ
@given(data=image_files(), how=HOW)
def test_no_image_gets_a_5xx(gray, data, how):
    check(gray, send_image(gray, data, how))


def strip_png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("L", (width, height)).save(buf, "PNG")
    return buf.getvalue()


# Were 500s: padded square, these strips asked numpy for 84 GiB (MemoryError).
@settings(FUZZ, max_examples=100)
@example(data=strip_png(1, MAX_PIXELS), how="raw")
@example(data=strip_png(MAX_PIXELS, 1), how="batch")
@given(data=image_files(), how=HOW)
def test_no_image_gets_a_5xx_on_an_rgb_pad_model(rgb, data, how):
    check(rgb, send_image(rgb, data, how))


# ---------------------------------------------------------------------------- JSON

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(10**30), 10**30)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([0, 255, -0.0, 256, 1e309, 10**400])
    | st.text(max_size=8)
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=60,
)
PIXEL = st.one_of(st.integers(0, 255), st.floats(0, 255), SCALARS)
IMAGES = st.lists(
    st.lists(st.lists(PIXEL, min_size=3, max_size=5), min_size=3, max_size=5), max_size=6
)

RAW_TEXT = st.sampled_from(
    [
        b"[" * 100_000,
        b'{"images": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        b'{"images": [[[' + b"9" * 5000 + b"]]]}",
        b'{"images": [[[1e309, NaN, Infinity, -Infinity]]]}',
        b'{"images": 1, "images": [[[0]]]}',
        b'{"images": [[[0,0,0,0],[0,0,0,0],[0,0,0,0],[0,0,0,0]]], "images": null}',
        b'{"images": "\xff\xfe"}',
        b"\xff\xfe{\x00}\x00",
        b"\xef\xbb\xbf{}",
        b'"' + b'\\"' * 100_000,
        b"1" * 100_000,
        b"-" + b"0" * 5000,
        b"1e" + b"9" * 5000,
        b"0." + b"1" * 100_000,
        b"[" + b"0," * 300_000 + b"0]",
        b"null",
        b"",
    ]
)


@st.composite
def json_bodies(draw) -> bytes:
    kind = draw(st.sampled_from(["value", "images", "raw", "mangled"]))
    if kind == "raw":
        return draw(RAW_TEXT)
    doc = draw(VALUES) if kind == "value" else {"images": draw(st.one_of(IMAGES, VALUES))}
    text = json.dumps(doc).encode()
    if kind == "mangled" and text:
        at = draw(st.integers(0, len(text)))
        return text[:at] + draw(st.binary(min_size=1, max_size=4)) + text[at:]
    return text


@settings(FUZZ, max_examples=400)
@given(body=json_bodies())
def test_no_json_body_gets_a_5xx(gray, body):
    check(
        gray,
        gray.post("/classify_batch", content=body, headers={"content-type": "application/json"}),
    )
