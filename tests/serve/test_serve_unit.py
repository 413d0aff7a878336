"""The service in process, without `bentoml serve`: bento/service.py itself, loaded here
with its own params.yaml and a tiny ONNX model built here, as BentoML's own ASGI app
(``Service.to_asgi``: the same api methods, middleware and mounted routes) in Starlette's
TestClient; and the request guard and the parsing, piece by piece.

tests/serve/test_serving.py shows the same behaviour through a real server; these tests pin each
piece down in milliseconds.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import functools
import gc
import importlib.util
import io
import itertools
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import bentoml
import httpx
import numpy as np
import pytest
import yaml
from PIL import Image
from prometheus_client import REGISTRY
from starlette.requests import Request
from starlette.testclient import TestClient

from trainyard.core.card import Card
from trainyard.core.io import sha256_file
from trainyard.runtime.inputs import decode_image, model_input, softmax
from trainyard.serve.guard import RequestGuard
from trainyard.serve.parsing import (
    check_count,
    file_fields,
    json_images,
    json_pixels,
    parse_flag,
    parse_form,
    parse_top_k,
)
from trainyard.serve.predictor import SMALL_UPLOAD_BYTES
from trainyard.serve.refused import Refused

from conftest import REPO, make_card, write_tiny_onnx

CLASSES = ("cat", "dog", "bird")
CARD = make_card(CLASSES, (1, 4, 4), resize="stretch")
RUN_ID, DATA_SHA = "tiny-run", "d" * 64


def refused_count(reason: str) -> float:
    return REGISTRY.get_sample_value("trainyard_requests_refused_total", {"reason": reason}) or 0.0


# ---------------------------------------------------------------------------- a tiny model


def write_tiny_model(folder: Path, card: Card = CARD, seed: int = 0) -> tuple[Path, dict]:
    """conftest's ``write_tiny_onnx`` with this module's card and run."""
    return write_tiny_onnx(folder, card, seed, run_id=RUN_ID, data_sha=DATA_SHA)


def expected_probabilities(images: list[bytes], weights: dict, invert: bool = False) -> np.ndarray:
    """The answer computed here: the shared decode and normalisation, then numpy."""
    pixels = np.stack([decode_image(b, CARD, invert=invert) for b in images]).astype(np.float32)
    x = model_input(pixels, CARD).reshape(len(images), -1)
    return softmax(x @ weights["weight"] + weights["bias"])


def png(pixels: np.ndarray, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()


PHOTOS = [
    png(np.random.default_rng(i).integers(0, 256, (9 + i, 7 + 2 * i), dtype=np.uint8))
    for i in range(4)
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    path, weights = write_tiny_model(tmp_path_factory.mktemp("tiny-model"))
    return {"path": path, "weights": weights}


_LOADED = itertools.count()


def service_client(model: Path, api_key: str | None = None, **serve) -> Iterator[TestClient]:
    """bento/service.py, imported afresh (as a module of its own) with the repository's
    params.yaml changed by ``serve`` and ``model`` as $TRAINYARD_MODEL, the environment
    `bentoml serve` reads; its BentoML app in a TestClient, lifespan and all. The client
    carries the worker's ``predictor``. BentoML's request metrics are off: they would be
    registered twice in this one process (tests/serve/test_serving.py reads them on a server)."""
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["serve"].update({"workers": 1, **serve})
    n = next(_LOADED)
    params = model.parent / f"params-{n}.yaml"
    params.write_text(yaml.safe_dump(raw))
    env = {"TRAINYARD_PARAMS": str(params), "TRAINYARD_MODEL": str(model)}
    env["BENTOML_CONFIG_OPTIONS"] = "services.trainyard_classifier.metrics.enabled=false"
    env["TRAINYARD_API_KEY"] = api_key or ""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        name = f"trainyard_service_{n}"
        spec = importlib.util.spec_from_file_location(name, REPO / "bento/service.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # BentoML reads the api methods' annotations from it
        spec.loader.exec_module(module)
        app = module.ImageClassifier.to_asgi()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    with TestClient(app) as client:
        client.predictor = bentoml.get_current_service().predictor  # type: ignore[attr-defined]
        yield client


def client_for(tiny: dict, **serve) -> Iterator[TestClient]:
    settings = {"max_batch_images": 4, "max_body_bytes": 64 * 1024, "top_k": 5, **serve}
    yield from service_client(tiny["path"], **settings)


@pytest.fixture(scope="module")
def client(tiny) -> Iterator[TestClient]:
    yield from client_for(tiny, batching=False)


@pytest.fixture(scope="module")
def batched_client(tiny) -> Iterator[TestClient]:
    yield from client_for(
        tiny, batching=True, max_batch_size=4, max_latency_ms=5000, max_body_bytes=2**20
    )


# ---------------------------------------------------------------------------- the guard


async def echo(scope, receive, send) -> None:
    """The app behind the guard in these tests: answers with the body length it got."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body", False):
            break
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": str(len(body)).encode()})


TRACE = [(b"x-model-version", b"abc123"), (b"x-data-version", b"data-v1")]


def guarded(api_key: str | None = "k3y", limit: int = 100) -> TestClient:
    return TestClient(
        RequestGuard(echo, api_key=api_key, max_body_bytes=limit, trace_headers=TRACE)
    )


def test_guard_without_the_key_is_a_401_naming_the_header():
    client = guarded()
    before = refused_count("unauthorized")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "k3y"}):
        resp = client.post("/classify", content=b"x", headers=headers)
        assert resp.status_code == 401, headers
        assert resp.json()["field"] == "Authorization"
        assert "Authorization: Bearer" in resp.json()["error"]
        assert resp.headers["www-authenticate"] == 'Bearer realm="trainyard"'
    assert refused_count("unauthorized") - before == 3
    assert client.get("/metadata").status_code == 401
    ok = client.post("/classify", content=b"abc", headers={"Authorization": "Bearer k3y"})
    assert ok.status_code == 200 and ok.text == "3"
    assert client.post("/x", content=b"a", headers={"Authorization": "bearer k3y"}).text == "1"


def test_guard_leaves_probes_and_metrics_open():
    client = guarded()
    for path in ("/healthz", "/livez", "/readyz", "/metrics", "/", "/docs.json"):
        assert client.get(path).status_code == 200, path
    assert client.get("/static_content/app.js").status_code == 200
    assert client.post("/healthz", content=b"x").status_code == 401  # open to GET only


def test_guard_refuses_a_body_over_the_limit_declared_or_counted():
    client = guarded(api_key=None, limit=100)
    assert client.post("/classify", content=b"x" * 100).text == "100"
    before = refused_count("body_too_large")
    resp = client.post("/classify", content=b"x" * 101)
    assert resp.status_code == 413 and resp.json() == {
        "error": "request body over 100 bytes (serve.max_body_bytes)",
        "field": "body",
    }
    chunked = client.post("/classify", content=iter([b"x" * 60, b"x" * 60]))
    assert chunked.status_code == 413 and "request body over 100" in chunked.json()["error"]
    assert refused_count("body_too_large") - before == 2
    assert client.get("/metadata").status_code == 200  # GET bodies are not read


def test_guard_refuses_pickle_and_a_bad_content_length():
    client = guarded(api_key=None)
    resp = client.post(
        "/classify_batch", content=b"\x80\x04.", headers={"Content-Type": "application/x"}
    )
    assert resp.status_code == 200
    pickle = {"Content-Type": "application/vnd.bentoml+pickle; charset=x"}
    resp = client.post("/classify", content=b"\x80\x04K\x01.", headers=pickle)
    assert resp.status_code == 415 and "pickle" in resp.json()["error"]

    guard = RequestGuard(echo, api_key=None, max_body_bytes=100)
    sent: list[dict] = []

    async def send(message) -> None:
        sent.append(message)

    async def receive() -> dict:
        return {"type": "http.request", "body": b"x", "more_body": False}

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/classify",
        "headers": [(b"content-length", b"ten")],
        "query_string": b"",
    }
    asyncio.run(guard(scope, receive, send))
    assert sent[0]["status"] == 400
    assert json.loads(sent[1]["body"])["error"] == "Content-Length is not a number"


def test_every_answer_carries_the_trace_headers_refusals_included():
    client = guarded()
    for resp in (client.get("/healthz"), client.post("/classify", content=b"x")):
        assert resp.headers["x-model-version"] == "abc123"
        assert resp.headers["x-data-version"] == "data-v1"


# ---------------------------------------------------------------------------- parsing


@pytest.mark.parametrize("value", ["0", "-1", "x", "", " ", "1.5", "²"])
def test_top_k_that_is_not_a_whole_number_from_1_is_a_400_naming_it(value):
    with pytest.raises(Refused) as err:
        parse_top_k(value, 10, 5)
    assert (err.value.status, err.value.field, err.value.reason) == (400, "top_k", "bad_field")
    assert str(err.value) == f"top_k: expected a whole number from 1 to 10, got {value!r}"


def test_top_k_defaults_and_caps_at_the_number_of_classes():
    assert parse_top_k(None, 10, 5) == 5
    assert parse_top_k(None, 3, 5) == 3
    assert parse_top_k("2", 10, 5) == 2
    assert parse_top_k(" 7 ", 10, 5) == 7
    assert parse_top_k("400", 10, 5) == 10


def test_flags():
    assert [parse_flag("invert", v) for v in ("true", "1", "Yes", " on ")] == [True] * 4
    assert [parse_flag("invert", v) for v in ("false", "0", "no", "OFF", "", None)] == [False] * 6
    with pytest.raises(Refused, match=r"invert: expected true or false, got 'maybe'") as err:
        parse_flag("invert", "maybe")
    assert err.value.field == "invert"


def multipart(files=None, data=None) -> tuple[Request, bytes]:
    """A Starlette request and the multipart body httpx would send."""
    req = httpx.Request("POST", "http://x/classify", files=files, data=data)
    body = req.read()
    headers = [(k.lower().encode(), v.encode()) for k, v in req.headers.items()]
    return Request({"type": "http", "method": "POST", "headers": headers}), body


def form_refusal(parts=None, data=None, **kw) -> Refused:
    """The Refused that parsing this form (then reading its files) raises."""
    request, body = multipart(parts, data)
    options = {"files": "image", "texts": ("invert", "top_k"), "max_files": 1, "usage": "U"}
    options.update(kw)

    async def parse() -> None:
        form = await parse_form(request, body, **options)
        try:
            await file_fields(form, options["files"], "U")
        finally:
            await form.close()

    with pytest.raises(Refused) as err:
        asyncio.run(parse())
    return err.value


def test_form_fields_are_checked_by_name_and_kind():
    cases = {
        "unknown field": ({"file": ("a.png", b"x")}, None, "file: unknown form field; U"),
        "text as the image": ({"image": (None, "http://x/y.png")}, None, "image: must be a file"),
        "file as a text field": (
            {"image": ("a.png", b"x"), "invert": ("i.txt", b"true")},
            None,
            "invert: must be text, not a file",
        ),
        "three images": (
            [("image", (f"{i}.png", b"x")) for i in range(3)],
            None,
            "image: expected one file field 'image', got more; U",
        ),
        "too many text fields": (
            {"image": ("a.png", b"x")},
            {"invert": ["1", "1", "1"], "top_k": "1"},
            "body: too many text fields",
        ),
    }
    for name, (files, data, text) in cases.items():
        err = form_refusal(files, data)
        assert err.status == 400 and text in str(err), (name, str(err))
        assert err.field == text.split(":")[0], name


def test_too_many_batch_files_is_a_413_and_a_good_form_parses():
    err = form_refusal(
        [("images", (f"{i}.png", b"x")) for i in range(5)],  # 4 parse; check_count refuses
        files="images",
        texts=("invert",),
        max_files=3,
    )
    assert (err.status, err.field, err.reason) == (413, "images", "too_many_images")
    assert str(err).startswith("images: more than the limit of 3 per request")

    request, body = multipart({"image": ("a.png", b"bytes")}, {"top_k": "2"})

    async def parse() -> tuple[list[bytes], str]:
        form = await parse_form(
            request, body, files="image", texts=("invert", "top_k"), max_files=1, usage="U"
        )
        try:
            return await file_fields(form, "image", "U"), form["top_k"]
        finally:
            await form.close()

    assert asyncio.run(parse()) == ([b"bytes"], "2")


def test_malformed_multipart_is_a_400():
    request = Request(
        {"type": "http", "headers": [(b"content-type", b"multipart/form-data; boundary=zz")]}
    )

    async def parse() -> None:
        await parse_form(request, b"garbage", files="image", texts=(), max_files=1, usage="U")

    with pytest.raises(Refused, match="body: malformed multipart/form-data") as err:
        asyncio.run(parse())
    assert (err.value.status, err.value.reason) == (400, "bad_request")


def test_json_batch_errors_name_the_field():
    cases = {
        b"{not json": ("body", "body: Invalid JSON"),
        b"\xff\xfe": ("body", "body: Invalid JSON"),
        b"[1, 2]": ("images", "images: missing"),
        b'{"imgs": []}': ("images", "images: missing"),
        b'{"images": [], "extra": 1}': ("extra", "extra: unknown field"),
    }
    for body, (field, text) in cases.items():
        with pytest.raises(Refused) as err:
            json_images(body)
        assert err.value.status == 400 and err.value.field == field, body
        assert str(err.value).startswith(text), str(err.value)
    assert json_images(b'{"images": [1]}') == [1]


def test_json_pixels_check_the_contract_and_the_limit():
    zero = [[0] * 4 for _ in range(4)]
    ok = json_pixels(json.dumps({"images": [zero, zero]}).encode(), CARD, max_images=2)
    assert ok.shape == (2, 1, 4, 4) and ok.dtype == np.float32
    with pytest.raises(Refused) as err:
        json_pixels(json.dumps({"images": [zero] * 3}).encode(), CARD, max_images=2)
    assert (err.value.status, err.value.reason) == (413, "too_many_images")
    with pytest.raises(Refused) as err:
        json_pixels(json.dumps({"images": [zero[:3]]}).encode(), CARD, max_images=2)
    assert err.value.status == 400 and err.value.field == "images[0]"
    assert "expected 4 rows of 4 numbers, got 3 items" in str(err.value)
    with pytest.raises(Refused, match="images: no image files"):
        check_count(0, 2)
    with pytest.raises(Refused, match="more than the limit of 2") as err:
        check_count(3, 2)
    assert err.value.status == 413


# ---------------------------------------------------------------------------- the predictor


def test_classify_multipart_and_raw_body_give_the_computed_answer(client, tiny):
    expected = expected_probabilities(PHOTOS, tiny["weights"])
    version = sha256_file(tiny["path"])[:12]
    for i, data in enumerate(PHOTOS):
        multi = client.post("/classify", files={"image": ("p.png", data, "image/png")})
        raw = client.post("/classify?top_k=2", content=data, headers={"Content-Type": "image/png"})
        assert multi.status_code == 200 and raw.status_code == 200, (multi.text, raw.text)
        assert multi.json()["probabilities"] == raw.json()["probabilities"]
        pred = multi.json()
        assert np.allclose(pred["probabilities"], expected[i], atol=1e-6)
        best = int(expected[i].argmax())
        assert (pred["class_id"], pred["label"]) == (best, CLASSES[best])
        assert pred["model_version"] == version and multi.headers["x-model-version"] == version
        assert len(pred["top_k"]) == 3  # serve.top_k 5, capped at the 3 classes
        assert [t["class_id"] for t in raw.json()["top_k"]] == list(np.argsort(-expected[i])[:2])


def test_invert_and_top_k_from_the_form(client, tiny):
    resp = client.post(
        "/classify",
        files={"image": ("p.png", PHOTOS[0], "image/png")},
        data={"invert": "true", "top_k": "1"},
    )
    assert resp.status_code == 200, resp.text
    expected = expected_probabilities(PHOTOS[:1], tiny["weights"], invert=True)[0]
    assert np.allclose(resp.json()["probabilities"], expected, atol=1e-6)
    assert len(resp.json()["top_k"]) == 1


def test_batch_by_files_and_by_json_agree(client, tiny):
    expected = expected_probabilities(PHOTOS, tiny["weights"])
    files = [("images", (f"{i}.png", data)) for i, data in enumerate(PHOTOS)]
    by_files = client.post("/classify_batch", files=files)
    assert by_files.status_code == 200, by_files.text
    assert np.allclose([p["probabilities"] for p in by_files.json()], expected, atol=1e-6)
    pixels = [decode_image(data, CARD)[0].tolist() for data in PHOTOS]
    by_json = client.post("/classify_batch?top_k=1", json={"images": pixels})
    assert by_json.status_code == 200, by_json.text
    assert np.allclose([p["probabilities"] for p in by_json.json()], expected, atol=1e-6)
    assert all(len(p["top_k"]) == 1 for p in by_json.json())


def test_bad_requests_get_a_4xx_naming_the_field(client):
    empty_second = [("images", ("a.png", PHOTOS[0])), ("images", ("b.png", b""))]
    cases = [
        (client.post("/classify", content=b""), 400, "body", "empty request body"),
        (client.post("/classify", content=b"x"), 415, "Content-Type", "a body without a Content"),
        (
            client.post("/classify", content=b"x", headers={"Content-Type": "text/plain"}),
            415,
            "Content-Type",
            "/classify does not take 'text/plain'",
        ),
        (
            client.post(
                "/classify?top_k=0", content=PHOTOS[0], headers={"Content-Type": "image/png"}
            ),
            400,
            "top_k",
            "top_k: expected a whole number from 1 to 3, got '0'",
        ),
        (
            client.post("/classify", files={"image": ("a", b"not an image")}),
            400,
            "image",
            "image: not an image",
        ),
        (
            client.post("/classify", files=[("image", ("a", PHOTOS[0]))] * 2),
            400,
            "image",
            "image: expected one file field 'image', got 2",
        ),
        (client.post("/classify_batch", files=empty_second), 400, "images[1]", "images[1]: the"),
        (
            client.post("/classify_batch", files=[("images", ("a", PHOTOS[0]))] * 5),
            413,
            "images",
            "more than the limit of 4",
        ),
        (
            client.post(
                "/classify_batch", content=b"{x", headers={"Content-Type": "application/json"}
            ),
            400,
            "body",
            "Invalid JSON",
        ),
        (client.post("/classify_batch", json={"images": []}), 400, "images", "the list is empty"),
        (client.post("/classify_batch?top_k=x", json={"images": []}), 400, "top_k", "top_k:"),
    ]
    for resp, status, field, text in cases:
        assert resp.status_code == status, resp.text
        assert resp.json()["field"] == field and text in resp.json()["error"], resp.text


def test_image_over_the_pixel_limit_is_a_413(tiny):
    for client in client_for(tiny, max_image_pixels=100):
        before = refused_count("image_too_large")
        resp = client.post(
            "/classify", files={"image": ("big.png", png(np.zeros((20, 20), np.uint8)))}
        )
        assert resp.status_code == 413 and "image too large" in resp.json()["error"], resp.text
        assert refused_count("image_too_large") - before == 1


def test_unknown_routes_and_methods_answer_json(client):
    resp = client.post("/internal/infer", json={})
    assert resp.status_code == 404 and resp.json()["error"].startswith("POST /internal/infer: Not")
    assert "endpoints: POST /classify" in resp.json()["error"]
    for method in ("GET", "PATCH", "PUT"):
        resp = client.request(method, "/classify")
        assert resp.status_code == 405 and "Method Not Allowed" in resp.json()["error"]
    # Batching has no route of its own (it was /probabilities, called in process).
    resp = client.post("/probabilities", json={"pixels": []})
    assert resp.status_code == 404 and resp.json()["field"] is None


def test_metadata_describes_the_model_and_its_contract(client, tiny):
    meta = client.get("/metadata").json()
    assert meta["classes"] == list(CLASSES)
    assert meta["model"]["sha256"] == sha256_file(tiny["path"])
    assert meta["model"]["mlflow_run_id"] == RUN_ID and meta["model"]["arch"] == "tiny"
    assert meta["input"]["shape"] == [-1, 1, 4, 4] and meta["input"]["image"] == "4x4"
    assert meta["input"]["normalization"] == {"scale": 255.0, "mean": [0.5], "std": [0.25]}
    assert meta["source"]["mlflow_run_id"] == RUN_ID
    assert meta["provider"] == "CPUExecutionProvider" and meta["batching"]["enabled"] is False
    assert meta["io_binding"] is False  # binding only on CUDA (tests/runtime/test_io_binding.py)


def test_adaptive_batching_gives_the_same_answers_in_merged_runs(batched_client, tiny):
    """Through BentoML's batcher (the batchable method, over the service's own client):
    each request its own answer, and concurrent requests share ONNX Runtime runs."""

    def runs() -> tuple[float, float]:
        count = REGISTRY.get_sample_value("trainyard_batch_size_count") or 0.0
        return count, REGISTRY.get_sample_value("trainyard_batch_size_sum") or 0.0

    expected = expected_probabilities(PHOTOS, tiny["weights"])
    for i, data in enumerate(PHOTOS):
        resp = batched_client.post("/classify", files={"image": ("p.png", data)})
        assert resp.status_code == 200, resp.text
        assert np.allclose(resp.json()["probabilities"], expected[i], atol=1e-6)
    before = runs()
    sends = [PHOTOS[i % len(PHOTOS)] for i in range(32)]
    with cf.ThreadPoolExecutor(16) as pool:
        answers = list(
            pool.map(lambda d: batched_client.post("/classify", files={"image": ("p", d)}), sends)
        )
    assert [r.status_code for r in answers] == [200] * len(sends)
    for i, resp in enumerate(answers):
        assert np.allclose(resp.json()["probabilities"], expected[i % len(PHOTOS)], atol=1e-6)
    count, total = (a - b for a, b in zip(runs(), before, strict=True))
    assert total == len(sends) and 0 < count < len(sends), (count, total)


def test_an_unbatched_call_runs_where_start_up_chose(client, tiny, monkeypatch):
    """With ``inline_images`` (chosen at start-up: this tiny model's call is far shorter
    than a thread hop) an unbatched /classify decodes and scores on the event loop; with 0
    on a worker thread. The same answer either way."""
    predictor = client.predictor
    assert predictor.inline_images >= 1  # measured when the service was imported
    where: list[bool] = []  # True: the call ran on the event loop's thread
    real = predictor._classify_now

    def spy(*args):
        where.append(asyncio_running())
        return real(*args)

    monkeypatch.setattr(predictor, "_classify_now", spy)
    expected = expected_probabilities(PHOTOS[:1], tiny["weights"])[0]
    chosen = predictor.inline_images
    try:
        for images in (chosen, 0):
            predictor.inline_images = images
            resp = client.post("/classify", files={"image": ("p.png", PHOTOS[0], "image/png")})
            assert resp.status_code == 200, resp.text
            assert np.allclose(resp.json()["probabilities"], expected, atol=1e-6)
    finally:
        predictor.inline_images = chosen
    assert where == [True, False]


def test_the_api_methods_callers_are_built_once_per_worker(client):
    """BentoML looks each api method up per request; the service keeps the caller it
    builds on the instance (trainyard.serve.lifecycle.bind_api_methods), so the look-up
    finds the same one every time, and requests still reach the method through it."""
    service = bentoml.get_current_service()
    for name in ("classify", "classify_batch", "metadata"):
        assert name in vars(service), name
        assert getattr(service, name) is getattr(service, name)
        assert getattr(service, name).local is getattr(service, name).local
    resp = client.post("/classify", files={"image": ("p.png", PHOTOS[0], "image/png")})
    assert resp.status_code == 200, resp.text
    assert client.get("/metadata").status_code == 200


def test_start_up_ends_with_the_heap_frozen_and_the_young_generation_collected_less(client):
    """warm_up is the last start-up hook (BentoML runs them in name order, after it built
    its app), and it ends by freezing what start-up built and raising gen 0's threshold
    (trainyard.serve.lifecycle.SERVING_GC_THRESHOLDS, in place of CPython's 700)."""
    from trainyard.serve.lifecycle import SERVING_GC_THRESHOLDS

    service = bentoml.get_current_service()
    hooks = [
        n
        for n in dir(type(service))
        if getattr(getattr(type(service), n), "__bentoml_startup_hook__", False)
    ]
    assert hooks[-1] == "warm_up", hooks
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    gc.unfreeze()  # the fixture's start-up froze already: the count below is warm_up's own
    try:
        service.warm_up()
        assert gc.get_threshold() == SERVING_GC_THRESHOLDS
        assert gc.get_freeze_count() > 10_000  # BentoML, Starlette, ONNX Runtime, the model
    finally:
        gc.set_threshold(*before)
    resp = client.post("/classify", files={"image": ("p.png", PHOTOS[0], "image/png")})
    assert resp.status_code == 200, resp.text


def test_a_merged_batch_runs_inline_from_two_images_up_to_the_chosen_size(
    batched_client, tiny, monkeypatch
):
    """A merged batch of 2 to ``inline_images`` images is answered on the event loop; a
    batch of one goes to a worker thread (the requests that arrive meanwhile gather into
    the next batch), and so does one over the size. Each request its own answer."""
    from trainyard.serve import batching

    predictor = batched_client.predictor
    where: list[bool] = []
    real = batching._answer_all

    def spy(queued):
        where.append(asyncio_running())
        return real(queued)

    monkeypatch.setattr(batching, "_answer_all", spy)
    expected = expected_probabilities(PHOTOS, tiny["weights"])

    def queued(n: int) -> list:
        return [
            batching.Queued(None, 3, predictor, 0.0, {}, PHOTOS[i % len(PHOTOS)], False)
            for i in range(n)
        ]

    chosen = predictor.inline_images
    try:
        predictor.inline_images = 3
        for n in (1, 2, 3, 4):
            answers = batched_client.portal.call(batching.answer_batch, queued(n))
            for i, answer in enumerate(answers):
                got = json.loads(answer.body)["probabilities"]
                assert np.allclose(got, expected[i % len(PHOTOS)], atol=1e-6)
    finally:
        predictor.inline_images = chosen
    assert where == [False, True, True, False]


def asyncio_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def test_a_bad_image_in_a_merged_batch_is_its_own_requests_4xx(batched_client, tiny):
    """/classify is the batchable method itself: a request that is no image is refused
    alone, with the unbatched route's answer, while the requests merged with it are served.
    Small uploads are decoded with their batch, large ones (over SMALL_UPLOAD_BYTES) as they
    arrive: both ways, good and bad."""

    rng = np.random.default_rng(5)
    big = [png(rng.integers(0, 256, (400, 400, 3), dtype=np.uint8)) for _ in range(2)]
    junk = [b"not an image", rng.bytes(SMALL_UPLOAD_BYTES + 1)]
    assert all(len(x) > SMALL_UPLOAD_BYTES for x in big) and len(junk[0]) < SMALL_UPLOAD_BYTES
    images = [*PHOTOS, *big]
    sends = [junk[i % 2] if i % 5 == 2 else images[i % len(images)] for i in range(30)]
    with cf.ThreadPoolExecutor(10) as pool:
        answers = list(
            pool.map(lambda d: batched_client.post("/classify", files={"image": ("p", d)}), sends)
        )
    expected = expected_probabilities(images, tiny["weights"])
    for i, resp in enumerate(answers):
        if sends[i] in junk:
            assert resp.status_code == 400 and resp.json()["field"] == "image", resp.text
        else:
            assert resp.status_code == 200, resp.text
            want = expected[images.index(sends[i])]
            assert np.allclose(resp.json()["probabilities"], want, atol=1e-6)
    # Refused before the batcher: a request without an image never waits for a batch.
    resp = batched_client.post("/classify", data={"top_k": "2"})
    assert resp.status_code == 415 and resp.json()["field"] == "Content-Type", resp.text


def test_a_request_the_batcher_sheds_gets_the_services_overload_answer(tiny, caplog):
    """BentoML's batcher sheds what it cannot answer within max_latency_ms with a generic
    503 of its own; the guard answers the service's: Retry-After, naming the setting. And
    BentoML's log does not call each shed request an error with a traceback."""
    for client in client_for(tiny, batching=True, max_batch_size=2, max_latency_ms=1):
        before = refused_count("overloaded")
        with cf.ThreadPoolExecutor(16) as pool:
            post = functools.partial(client.post, "/classify")
            answers = list(pool.map(lambda d, p=post: p(files={"image": ("p", d)}), PHOTOS * 12))
        shed = [r for r in answers if r.status_code == 503]
        assert {r.status_code for r in answers} <= {200, 503}
        assert shed, "1 ms of latency allowed and 16 clients: the batcher sheds some"
        for resp in shed:
            assert resp.headers["retry-after"] == "1"
            assert resp.json() == {
                "error": "server overloaded: the request could not be answered within "
                "serve.max_latency_ms (1 ms); retry shortly",
                "field": None,
            }
        assert refused_count("overloaded") - before == len(shed)
        errors = [r for r in caplog.records if "Exception on /classify" in r.getMessage()]
        assert not errors, errors[0].exc_info


def test_predictions_are_counted_by_label(client):
    def count(label: str) -> float:
        return REGISTRY.get_sample_value("trainyard_predictions_total", {"label": label}) or 0.0

    before = sum(count(c) for c in CLASSES)
    assert client.post("/classify", files={"image": ("p.png", PHOTOS[1])}).status_code == 200
    assert sum(count(c) for c in CLASSES) - before == 1


def test_connection_share_names_a_worker_over_its_share(tmp_path):
    """Two workers' slots in one shared file: each writes its own count and reads the
    total; the one over the total's share (rounded up) closes its surplus."""
    from trainyard.serve.balance import ConnectionShare

    a, b = ConnectionShare(tmp_path, 2, 0), ConnectionShare(tmp_path, 2, 1)
    for _ in range(5):
        a.opened()
    b.opened()
    assert a.over_share() and not b.over_share()  # 5 of 6: the share is 3
    a.closed()
    a.closed()
    b.opened()
    assert not a.over_share() and not b.over_share()  # 3 and 2 of 5: the share is 3
    assert list(ConnectionShare(tmp_path, 2, 0).counts) == [0, 2]  # a restart starts at 0
