"""/classify?explain=1 in process: bento/service.py itself (``test_serve_unit.service_client``:
BentoML's ASGI app in Starlette's TestClient) on tiny ONNX models with and without the
``cam`` output, batched and not; and the map's way back onto the upload
(``trainyard.runtime.upload_frame``), by hand.

tests/serve/test_client.py asks a real `bentoml serve` of an exported model the same.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator

import numpy as np
import pytest
from PIL import Image
from starlette.testclient import TestClient
from test_serve_unit import CLASSES, png, refused_count, service_client

from trainyard.core.card import Card
from trainyard.runtime.inputs import decode_image, model_input, softmax
from trainyard.runtime.upload_frame import to_upload

from conftest import make_card, write_tiny_onnx

CARD = make_card(CLASSES, (1, 4, 4), resize="stretch")
SETTINGS = {"max_batch_images": 4, "max_body_bytes": 2**20, "top_k": 5}


@pytest.fixture(scope="module")
def cam_model(tmp_path_factory) -> dict:
    path, weights = write_tiny_onnx(tmp_path_factory.mktemp("cam-model"), CARD, cam=True)
    return {"path": path, "weights": weights}


@pytest.fixture(scope="module")
def old_model(tmp_path_factory) -> dict:
    """A model exported before the class maps: logits only, no ``explain`` metadata."""
    path, weights = write_tiny_onnx(tmp_path_factory.mktemp("old-model"), CARD)
    return {"path": path, "weights": weights}


# One service at a time: the batched route finds its predictor as BentoML's current
# service, the one loaded last.
@pytest.fixture(params=[False, True], ids=["unbatched", "batched"])
def cam_client(request, cam_model) -> Iterator[TestClient]:
    yield from service_client(cam_model["path"], batching=request.param, **SETTINGS)


@pytest.fixture(params=[False, True], ids=["unbatched", "batched"])
def old_client(request, old_model) -> Iterator[TestClient]:
    yield from service_client(old_model["path"], batching=request.param, **SETTINGS)


def heat_of(answer: dict) -> np.ndarray:
    """The answer's heatmap PNG (indexed, colour and opacity per level: RGBA to a browser),
    its opacity the map (0..255)."""
    im = Image.open(io.BytesIO(base64.b64decode(answer["heatmap"])))
    assert im.format == "PNG" and im.mode == "P" and "transparency" in im.info
    return np.asarray(im.convert("RGBA"))[..., 3]


def expected_heat(data: bytes, weights: dict) -> tuple[int, np.ndarray]:
    """(top class, its map as 0..255 opacity) computed here with numpy, for an upload of
    the card's own size (no resize): the positive part of channel mean x class weight,
    divided by its maximum."""
    pixels = decode_image(data, CARD)[None].astype(np.float32)
    x = model_input(pixels, CARD)
    top = int(softmax(x.reshape(1, -1) @ weights["weight"] + weights["bias"])[0].argmax())
    cam = x[0].mean(axis=0) * weights["cam_weight"][0, top, 0, 0]
    pos = np.maximum(cam, 0)
    heat = pos / pos.max() if pos.max() > 0 else pos
    return top, np.rint(heat * 255)


def test_explain_adds_the_top_class_heatmap_and_keeps_the_answer(cam_client, cam_model):
    rng = np.random.default_rng(5)
    for i in range(4):
        data = png(rng.integers(0, 256, (4, 4), dtype=np.uint8))
        plain = cam_client.post("/classify", files={"image": ("p.png", data, "image/png")})
        explained = cam_client.post(
            "/classify?explain=1", content=data, headers={"Content-Type": "image/png"}
        )
        assert plain.status_code == 200 and explained.status_code == 200, explained.text
        assert "heatmap" not in plain.json()  # the plain answer is unchanged
        body = explained.json()
        assert {k: v for k, v in body.items() if k != "heatmap"} == plain.json()
        top, heat = expected_heat(data, cam_model["weights"])
        assert body["class_id"] == top
        assert np.abs(heat_of(body).astype(int) - heat).max() <= 1, i


def test_explaining_and_plain_requests_share_the_batchers_runs(cam_model):
    """Concurrent requests, every other one explaining, through BentoML's batcher: merged
    into shared ONNX Runtime runs, each its own answer (a heatmap only where asked)."""
    import concurrent.futures as cf
    import contextlib

    from prometheus_client import REGISTRY

    def runs() -> tuple[float, float]:
        count = REGISTRY.get_sample_value("trainyard_batch_size_count") or 0.0
        return count, REGISTRY.get_sample_value("trainyard_batch_size_sum") or 0.0

    rng = np.random.default_rng(8)
    uploads = [png(rng.integers(0, 256, (4, 4), dtype=np.uint8)) for _ in range(8)]
    settings = {**SETTINGS, "max_batch_size": 8, "max_latency_ms": 5000}
    with contextlib.contextmanager(service_client)(
        cam_model["path"], batching=True, **settings
    ) as client:
        before = runs()

        def ask(i: int):
            query = "?explain=1" if i % 2 else ""
            return client.post(f"/classify{query}", files={"image": ("p.png", uploads[i % 8])})

        with cf.ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(ask, range(32)))
        count, total = (a - b for a, b in zip(runs(), before, strict=True))
    assert [r.status_code for r in answers] == [200] * 32
    assert total == 32 and 0 < count < 32, (count, total)  # merged runs
    for i, resp in enumerate(answers):
        body = resp.json()
        assert ("heatmap" in body) == bool(i % 2), i
        if i % 2:
            top, heat = expected_heat(uploads[i % 8], cam_model["weights"])
            assert body["class_id"] == top
            assert np.abs(heat_of(body).astype(int) - heat).max() <= 1, i


def test_the_heatmap_is_the_size_of_the_upload_as_shown(cam_client):
    rng = np.random.default_rng(6)
    wide = png(rng.integers(0, 256, (7, 19), dtype=np.uint8))  # 19 wide, 7 high
    resp = cam_client.post("/classify", files={"image": ("w.png", wide)}, data={"explain": "true"})
    assert resp.status_code == 200, resp.text
    assert heat_of(resp.json()).shape == (7, 19)
    # A phone photo stored 30x12 with EXIF orientation 6 is shown 12 wide, 30 high.
    im = Image.fromarray(rng.integers(0, 256, (12, 30, 3), dtype=np.uint8))
    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    im.save(buf, "JPEG", exif=exif)
    resp = cam_client.post("/classify?explain=yes", files={"image": ("turned.jpg", buf.getvalue())})
    assert resp.status_code == 200, resp.text
    assert heat_of(resp.json()).shape == (30, 12)


def test_metadata_says_how_the_model_explains(cam_client):
    assert cam_client.get("/metadata").json()["explain"] == "cam"


def test_metadata_says_an_older_model_cannot_explain(old_client):
    assert old_client.get("/metadata").json()["explain"] is None


def test_a_model_exported_before_the_maps_answers_a_400_naming_explain(old_client):
    data = png(np.arange(16, dtype=np.uint8).reshape(4, 4))
    before = refused_count("cannot_explain")
    for resp in (
        old_client.post("/classify?explain=1", files={"image": ("p.png", data)}),
        old_client.post("/classify", files={"image": ("p.png", data)}, data={"explain": "on"}),
        old_client.post(
            "/classify?explain=true", content=data, headers={"Content-Type": "image/png"}
        ),
    ):
        assert resp.status_code == 400, resp.text
        body = resp.json()
        assert body["field"] == "explain"
        assert "exported without its class activation map output 'cam'" in body["error"]
        assert "dvc repro export" in body["error"]
    assert refused_count("cannot_explain") == before + 3
    plain = old_client.post("/classify?explain=0", files={"image": ("p.png", data)})
    assert plain.status_code == 200 and "heatmap" not in plain.json()


def test_a_bad_explain_value_or_a_batch_that_asks_is_a_400_naming_it(cam_client):
    data = png(np.zeros((4, 4), np.uint8))
    for resp in (
        cam_client.post("/classify?explain=maybe", files={"image": ("p.png", data)}),
        cam_client.post("/classify", files={"image": ("p.png", data)}, data={"explain": "2"}),
        cam_client.post("/classify_batch?explain=1", files={"images": ("p.png", data)}),
        cam_client.post(
            "/classify_batch", files={"images": ("p.png", data)}, data={"explain": "1"}
        ),
    ):
        assert resp.status_code == 400, resp.text
        assert resp.json()["field"] == "explain", resp.text
    ok = cam_client.post("/classify_batch?explain=false", files={"images": ("p.png", data)})
    assert ok.status_code == 200 and "heatmap" not in ok.json()[0]


# ---------------------------------------------------------------------------- back onto the upload


def card(resize: str) -> Card:
    return make_card(("a", "b"), (1, 4, 4), resize=resize)


def test_pad_drops_the_padding():
    """A 8x4 upload (wide) padded to 8x8, then to 4x4: the image is the model's rows 1-2."""
    heat = np.zeros((4, 4), np.float32)
    heat[1:3] = 1.0
    out = to_upload(heat, card("pad"), width=8, height=4)
    assert out.shape == (4, 8)
    assert out.min() > 0.7  # every upload pixel was inside the hot rows' reach
    tall = to_upload(heat.T.copy(), card("pad"), width=4, height=8)
    assert tall.shape == (8, 4) and tall.min() > 0.7


def test_crop_leaves_what_the_model_never_saw_cold():
    """A 8x4 upload cropped: the model saw its columns 2-5 only."""
    heat = np.ones((4, 4), np.float32)
    out = to_upload(heat, card("crop"), width=8, height=4)
    assert out.shape == (4, 8)
    assert out[:, 3:5].min() == pytest.approx(1.0)
    assert out[:, 0].max() == pytest.approx(0.0)
    assert out[:, 7].max() == pytest.approx(0.0)


def test_stretch_and_the_models_own_size():
    heat = np.linspace(0, 1, 16, dtype=np.float32).reshape(4, 4)
    assert np.array_equal(to_upload(heat, card("pad"), 4, 4), heat)
    out = to_upload(heat, card("stretch"), width=12, height=2)
    assert out.shape == (2, 12) and out.min() >= 0.0 and out.max() <= 1.0


@pytest.mark.parametrize("bind", [None, "cpu"], ids=["plain", "bound"])
def test_run_with_cam_gives_the_maps_only_when_asked(cam_model, old_model, bind):
    """The maps come from the run that asks for them (through IO binding too, as on CUDA);
    ``run`` returns the logits alone, and a model without ``cam`` says so."""
    from dataclasses import replace

    from trainyard.runtime.sessions import load_onnx

    model = replace(load_onnx(cam_model["path"], "cpu", say=False), bind_device=bind)
    x = np.random.default_rng(7).normal(size=(3, *CARD.input_shape)).astype(np.float32)
    logits, embedding, cam = model.run_with_cam(x, embedding=True)
    assert embedding is None  # this model has no embedding output
    np.testing.assert_array_equal(logits, model.run(x))
    w = cam_model["weights"]["cam_weight"]
    np.testing.assert_allclose(cam, x.mean(axis=1, keepdims=True) * w, rtol=1e-5, atol=1e-6)
    old = replace(load_onnx(old_model["path"], "cpu", say=False), bind_device=bind)
    assert model.has_cam and not old.has_cam
    with pytest.raises(ValueError, match="no 'cam' output"):
        old.run_with_cam(x)
