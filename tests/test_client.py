"""trainyard.client: the Python client, against a real `bentoml serve` and, for the shapes of
requests and answers only, against httpx.MockTransport."""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import time

import httpx
import numpy as np
import pytest
import requests
import test_serving
from PIL import Image
from test_serving import API_KEY, free_port, png

from trainyard.client import (
    Classification,
    Client,
    ConnectionFailed,
    ModelCard,
    Prediction,
    ServiceError,
    TimedOut,
    UnexpectedResponse,
    encode_image,
    sniff,
)
from trainyard.core.io import sha256_file

# test_serving's module-scoped fixtures, used here by name (one model, two servers).
model_dir, test_set, offline = test_serving.model_dir, test_serving.test_set, test_serving.offline
server, keyed_server = test_serving.server, test_serving.keyed_server

ANSWER = {
    "label": "Bag",
    "class_id": 1,
    "probabilities": [0.25, 0.75],
    "top_k": [
        {"label": "Bag", "class_id": 1, "probability": 0.75},
        {"label": "Coat", "class_id": 0, "probability": 0.25},
    ],
    "model_version": "0123456789ab",
}
METADATA = {
    "model": {
        "path": "/models/model.onnx",
        "sha256": "0123456789ab" + "0" * 52,
        "version": "0123456789ab",
        "arch": "simple_cnn",
        "trainyard_version": "0.1.0",
        "mlflow_run_id": "run-1",
        "data_sha256": "d" * 64,
        "checkpoint_sha256": None,
    },
    "classes": ["Coat", "Bag"],
    "input": {"shape": [-1, 1, 28, 28], "max_batch_images": 64, "top_k": 5},
    "source": {"params": "params.yaml"},
    "provider": "CPUExecutionProvider",
}


def mock_client(
    status: int = 200, body: object = ANSWER, headers: dict | None = None, **kw
) -> tuple[Client, list[httpx.Request]]:
    """A Client whose every request gets this answer; the requests it sent, for checks."""
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        request.read()
        seen.append(request)
        if isinstance(body, (bytes, str)):
            return httpx.Response(status, content=body, headers=headers)
        return httpx.Response(status, json=body, headers=headers)

    return Client("http://svc.test:3000/", transport=httpx.MockTransport(handle), **kw), seen


def image_bytes(fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.new("L", (8, 8), 200).save(buf, format=fmt)
    return buf.getvalue()


# ---------------------------------------------------------------------------- unit: shapes


def test_classify_sends_one_multipart_image_and_parses_the_answer():
    client, seen = mock_client(api_key="k3y")
    got = client.classify(image_bytes(), top_k=2)
    (req,) = seen
    assert req.method == "POST" and req.url.path == "/classify"
    assert req.url.params["top_k"] == "2"
    assert req.headers["authorization"] == "Bearer k3y"
    assert req.headers["content-type"].startswith("multipart/form-data; boundary=")
    assert b'name="image"; filename="image.png"' in req.content
    assert b"Content-Type: image/png" in req.content and b"invert" not in req.content
    assert got == Classification(
        label="Bag",
        class_id=1,
        probabilities=(0.25, 0.75),
        top_k=(Prediction("Bag", 1, 0.75), Prediction("Coat", 0, 0.25)),
        model_version="0123456789ab",
    )
    assert got.probability == 0.75
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.label = "Coat"  # type: ignore[misc]
    client.classify(image_bytes(), invert=True)
    assert "top_k" not in seen[1].url.params and b'name="invert"\r\n\r\ntrue' in seen[1].content


def test_image_kinds_are_encoded_with_a_name_and_a_type(tmp_path):
    data = image_bytes()
    (tmp_path / "photo.jpeg").write_bytes(data)  # the bytes say PNG: the bytes win
    (tmp_path / "notes.txt").write_text("not an image\n")
    assert encode_image(tmp_path / "photo.jpeg") == ("photo.jpeg", data, "image/png")
    assert encode_image(str(tmp_path / "notes.txt"))[::2] == ("notes.txt", "text/plain")
    assert encode_image(bytearray(data)) == ("image.png", data, "image/png")
    assert encode_image(b"???") == ("image", b"???", "application/octet-stream")
    pil = Image.open(io.BytesIO(data))
    name, encoded, ctype = encode_image(pil, "image-3")
    assert (name, ctype) == ("image-3.png", "image/png")
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(encoded))), np.asarray(pil))

    class DuckImage:  # not a PIL image: anything with .save(fp, format=...)
        def save(self, fp, format=None):
            fp.write(b"\x89PNG\r\n\x1a\n" + format.encode())

    assert encode_image(DuckImage())[1:] == (b"\x89PNG\r\n\x1a\nPNG", "image/png")
    with pytest.raises(TypeError, match=r"file path, image bytes or a PIL\.Image"):
        encode_image(42)  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError):
        encode_image(tmp_path / "missing.png")


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "BMP", "TIFF", "WEBP"])
def test_sniff_knows_every_format_the_service_decodes(fmt):
    ctype, ext = sniff(image_bytes(fmt))
    assert ctype == f"image/{fmt.lower()}" and ext in {f".{fmt.lower()}", ".jpg", ".tif"}


def test_sniff_knows_the_phone_formats():
    from trainyard.core.imaging import ensure_format

    assert ensure_format("HEIF")  # registers pillow-heif's HEIF writer

    heic = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 10, 10)).save(heic, format="HEIF")
    assert sniff(heic.getvalue()) == ("image/heic", ".heic")
    assert sniff(image_bytes("AVIF")) == ("image/avif", ".avif")
    assert sniff(b"\x00\x00\x00\x18ftypisom" + b"\x00" * 16) is None  # an MP4, not an image


def test_batch_sends_repeated_images_fields_and_keeps_the_order(tmp_path):
    client, seen = mock_client(body=[ANSWER, {**ANSWER, "class_id": 0, "label": "Coat"}])
    path = tmp_path / "a.png"
    path.write_bytes(image_bytes())
    got = client.classify_batch([path, image_bytes("JPEG")], top_k=1)
    (req,) = seen
    assert req.url.path == "/classify_batch" and req.url.params["top_k"] == "1"
    assert req.content.count(b'name="images"') == 2
    assert b'filename="a.png"' in req.content and b'filename="image-1.jpg"' in req.content
    assert [c.label for c in got] == ["Bag", "Coat"]
    assert client.classify_batch([]) == [] and len(seen) == 1  # no request for nothing
    with pytest.raises(UnexpectedResponse, match="expected 1 answers, got 2 answers"):
        client.classify_batch([image_bytes()])


def test_error_answers_raise_service_error_with_the_servers_message():
    msg = "top_k: expected a whole number from 1 to 10, got '0'"
    client, _ = mock_client(400, {"error": msg, "field": "top_k"})
    with pytest.raises(ServiceError) as err:
        client.classify(image_bytes(), top_k=0)
    assert str(err.value) == msg and err.value.message == msg
    assert (err.value.status, err.value.field, err.value.retry_after) == (400, "top_k", None)

    client, _ = mock_client(429, {"error": "too many", "field": None}, {"retry-after": "1"})
    with pytest.raises(ServiceError) as err:
        client.metadata()
    assert (err.value.status, err.value.field, err.value.retry_after) == (429, None, 1.0)

    past = {"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}  # an HTTP date: seconds from now
    client, _ = mock_client(503, {"error": "overloaded", "field": None}, past)
    with pytest.raises(ServiceError, match=r"^overloaded$") as err:
        client.classify(image_bytes())
    assert err.value.retry_after == 0.0

    client, _ = mock_client(502, b"<html>bad gateway</html>")
    with pytest.raises(ServiceError, match=r"^HTTP 502 Bad Gateway: <html>bad gateway"):
        client.classify(image_bytes())


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b"<html>ok</html>", "not JSON"),
        ({"label": "Bag"}, "missing 'probabilities'"),
        ({**ANSWER, "class_id": 7}, "outside the 2 classes"),
        ({**ANSWER, "probabilities": ["x", 1]}, "list of numbers"),
        ([ANSWER], "expected a JSON object"),
    ],
)
def test_an_unexpected_success_body_is_an_unexpected_response(body, match):
    client, _ = mock_client(200, body)
    with pytest.raises(UnexpectedResponse, match=match):
        client.classify(image_bytes())


def test_metadata_is_a_model_card():
    client, seen = mock_client(body=METADATA)
    card = client.metadata()
    assert seen[0].method == "GET" and seen[0].url.path == "/metadata"
    assert card.classes == ("Coat", "Bag") and card.version == "0123456789ab"
    assert (card.mlflow_run_id, card.data_sha256, card.arch) == ("run-1", "d" * 64, "simple_cnn")
    assert card.provider == "CPUExecutionProvider"
    assert card.input["max_batch_images"] == 64 and card.raw["source"] == METADATA["source"]
    with pytest.raises(TypeError):
        card.input["top_k"] = 1  # type: ignore[index]
    assert hash(card) == hash(ModelCard.from_json(json.loads(json.dumps(METADATA))))


def test_context_manager_closes_and_bad_urls_are_refused():
    with mock_client()[0] as client:
        assert client.url == "http://svc.test:3000"
    assert client._http.is_closed
    with pytest.raises(ValueError, match="http://host:port"):
        Client("localhost:3000")


def test_a_timeout_is_a_timed_out_connection_failure():
    def handle(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=request)

    client = Client("http://svc.test", timeout=1, transport=httpx.MockTransport(handle))
    with pytest.raises(TimedOut, match=r"POST http://svc.test/classify: no answer") as err:
        client.classify(image_bytes())
    assert isinstance(err.value, ConnectionFailed) and isinstance(err.value, TimeoutError)


def test_a_dead_url_fails_fast_and_names_the_url():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    start = time.perf_counter()
    with Client(url) as client:
        with pytest.raises(ConnectionFailed) as err:
            client.classify(image_bytes())
        assert time.perf_counter() - start < 2.0
        assert not client.ready()
    assert f"cannot reach the trainyard service at {url}" in str(err.value)
    assert err.value.url == url and isinstance(err.value, ConnectionError)


# ---------------------------------------------------------------------------- real server


@pytest.mark.slow
def test_path_bytes_and_pil_agree_with_offline_onnx_runtime(
    server, test_set, offline, model_dir, tmp_path
):
    images, _ = test_set
    version = sha256_file(model_dir / "model.onnx")[:12]
    with Client(server.url) as client:
        assert client.ready()
        classes = client.metadata().classes
        for i in range(12):
            data = png(images[i])
            path = tmp_path / f"{i}.png"
            path.write_bytes(data)
            by_path = client.classify(path)
            by_bytes = client.classify(data)
            by_pil = client.classify(Image.fromarray(images[i]))
            assert by_path == by_bytes == by_pil, i
            assert by_path.class_id == int(offline[i].argmax()), i
            assert np.allclose(by_path.probabilities, offline[i], atol=1e-5), i
            assert by_path.label == classes[by_path.class_id]
            assert by_path.model_version == version
            assert by_path.top_k[0] == Prediction(
                by_path.label, by_path.class_id, by_path.probability
            )


@pytest.mark.slow
def test_top_k_is_respected(server, test_set, offline):
    data = png(test_set[0][0])
    with Client(server.url) as client:
        n = len(client.metadata().classes)
        for k in (1, 3, n):
            top = client.classify(data, top_k=k).top_k
            assert len(top) == k
            assert [p.class_id for p in top] == [int(i) for i in np.argsort(-offline[0])[:k]]
            assert all(a.probability >= b.probability for a, b in itertools.pairwise(top))
        assert len(client.classify(data, top_k=n + 5).top_k) == n  # capped at the classes
        with pytest.raises(ServiceError) as err:
            client.classify(data, top_k=0)
    assert (err.value.status, err.value.field) == (400, "top_k")


@pytest.mark.slow
def test_batch_agrees_with_single_calls(server, test_set, tmp_path):
    images, _ = test_set
    path = tmp_path / "first.png"
    path.write_bytes(png(images[0]))
    kinds = [path, *(png(im) for im in images[1:8]), *(Image.fromarray(im) for im in images[8:16])]
    with Client(server.url) as client:
        batch = client.classify_batch(kinds, top_k=2)
        singles = [client.classify(im, top_k=2) for im in kinds]
        assert len(batch) == 16
        for b, s in zip(batch, singles, strict=True):
            assert (b.label, b.class_id, b.model_version) == (s.label, s.class_id, s.model_version)
            assert np.allclose(b.probabilities, s.probabilities, atol=1e-6)
            assert [p.class_id for p in b.top_k] == [p.class_id for p in s.top_k]
        with pytest.raises(ServiceError) as err:  # serve.max_batch_images = 16 here
            client.classify_batch([png(images[0])] * 17)
    assert err.value.status == 413 and "more than the limit of 16" in str(err.value)


@pytest.mark.slow
def test_metadata_names_the_model_and_its_classes(server, model_dir):
    from trainyard.runtime.sessions import load_onnx

    with Client(server.url) as client:
        card = client.metadata()
    assert card.classes == tuple(load_onnx(model_dir / "model.onnx", device="cpu").classes)
    assert len(card.classes) == 10 and card.sha256 == sha256_file(model_dir / "model.onnx")
    assert card.version == card.sha256[:12] and card.path.endswith("model.onnx")
    assert (card.mlflow_run_id, card.data_sha256) == ("run-for-serving-tests", "d" * 64)
    assert card.input["shape"] == [-1, 1, 28, 28] and card.input["max_batch_images"] == 16


@pytest.mark.slow
def test_a_text_file_raises_the_servers_message(server, tmp_path, test_set):
    notes = tmp_path / "notes.txt"
    notes.write_text("hello, I am not an image\n")
    raw = requests.post(
        f"{server.url}/classify", files={"image": ("notes.txt", notes.read_bytes())}, timeout=30
    ).json()
    with Client(server.url) as client:
        with pytest.raises(ServiceError) as err:
            client.classify(notes)
        assert (err.value.status, err.value.field) == (400, "image")
        assert str(err.value) == raw["error"] and "image: not an image" in str(err.value)
        with pytest.raises(ServiceError) as err:
            client.classify_batch([png(test_set[0][0]), notes])
    assert (err.value.status, err.value.field) == (400, "images[1]")


@pytest.mark.slow
def test_the_api_key(keyed_server, test_set, offline):
    data = png(test_set[0][0])
    for key in (None, "wrong"):
        with Client(keyed_server.url, api_key=key) as client:
            for call in (lambda: client.classify(data), client.metadata):
                with pytest.raises(ServiceError) as err:
                    call()
                assert err.value.status == 401 and "Authorization: Bearer" in str(err.value)
    with Client(keyed_server.url, api_key=API_KEY) as client:
        got = client.classify(data)
        assert np.allclose(got.probabilities, offline[0], atol=1e-5)
        assert client.metadata().raw["batching"]["enabled"] is False
        assert client.classify_batch([data, data]) == [got, got]
