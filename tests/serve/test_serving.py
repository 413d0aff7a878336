"""The BentoML service as users meet it: a real `bentoml serve` process, real HTTP clients.

The model is made here (a few Lightning steps on real Fashion-MNIST images, then the real
export with its parity gate), so these tests never depend on `make run` having happened.
"""

from __future__ import annotations

import concurrent.futures as cf
import io
import itertools
import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import requests
import yaml
from PIL import Image

from trainyard.core.io import sha256_file
from trainyard.runtime.sessions import load_onnx
from trainyard.watch.log import read_log

from conftest import REPO, VENV_BIN, free_port, has_cuda, make_card, stop_group, train_checkpoint

pytestmark = pytest.mark.slow

API_KEY = "s3cret-test-key"


# ---------------------------------------------------------------------------- fixtures


# model_dir and test_set: conftest's, one trained and exported model per test run.


@pytest.fixture(scope="module")
def offline(model_dir, test_set):
    """What ONNX Runtime says about the test images, without HTTP: the reference."""
    from trainyard.runtime.sessions import load_onnx

    model = load_onnx(model_dir / "model.onnx", device="cpu")
    norm = json.loads(model.metadata["normalization"])  # written out here, independently
    mean, std = norm["mean"][0], norm["std"][0]  # one channel
    x = ((test_set[0].astype(np.float32) / norm["scale"] - mean) / std)[:, None]
    logits = model.predict_logits(x).astype(np.float64)
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def write_params(path: Path, **serve) -> Path:
    """The repository's params.yaml with some `serve` keys changed."""
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    # One worker unless a test asks: start-up stays quick and the limits stay per-process.
    raw["serve"].update({"workers": 1, **serve})
    path.write_text(yaml.safe_dump(raw))
    return path


def server_env(params: Path, model: Path | str, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("TRAINYARD_API_KEY", None)
    env.update(
        TRAINYARD_PARAMS=str(params),
        TRAINYARD_MODEL=str(model),
        BENTOML_DO_NOT_TRACK="true",  # no usage reports from test runs
        BENTOML_HOME=str(params.parent / "bentoml-home"),
        PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
    )
    env.update(extra)
    return env


def wait_ready(
    url: str, proc: subprocess.Popen, deadline_s: float, said: Callable[[], str]
) -> bool:
    """Poll ``url``/readyz until it answers 200 (True) or ``deadline_s`` passes (False); a
    server that exits first fails the test with what it ``said`` (its log's tail)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            pytest.fail(f"{os.path.basename(proc.args[0])} exited {proc.returncode}:\n{said()}")
        try:
            if requests.get(f"{url}/readyz", timeout=1).status_code == 200:
                return True
        except requests.RequestException:
            pass
        time.sleep(0.25)
    return False


class Server:
    """`bentoml serve` in its own process group, killed as a group on stop()."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [
            str(VENV_BIN / "bentoml"),
            "serve",
            "bento.service:ImageClassifier",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                cmd,
                cwd=REPO,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_ready(self, deadline_s: float = 90) -> None:
        if not wait_ready(self.url, self.proc, deadline_s, self.tail):
            self.stop()
            pytest.fail(f"bentoml serve not ready within {deadline_s} s:\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def stop(self) -> None:
        stop_group(self.proc)


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir):
    """Batching on, no API key, small limits so the limit tests stay small."""
    tmp = tmp_path_factory.mktemp("server")
    params = write_params(
        tmp / "params.yaml",
        batching=True,
        max_batch_size=16,
        max_batch_images=16,
        max_body_bytes=1024 * 1024,
    )
    srv = Server(server_env(params, model_dir / "model.onnx"), tmp / "serve.log")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory, model_dir):
    """Batching off, an API key, and room for only 2 requests in flight; the prediction log
    on, with the same model as its shadow (so they must agree on every request); BentoML's
    tracing on."""
    tmp = tmp_path_factory.mktemp("keyed-server")
    params = write_params(
        tmp / "params.yaml",
        batching=False,
        max_concurrency=2,
        log_predictions=True,
        log_dir=str(tmp / "log"),
        log_rotate_s=0.3,
        shadow=str(model_dir / "model.onnx"),
        tracing=True,
    )
    env = server_env(params, model_dir / "model.onnx", TRAINYARD_API_KEY=API_KEY)
    srv = Server(env, tmp / "serve.log")
    srv.log_dir = tmp / "log"
    srv.embedding_dim = load_onnx(model_dir / "model.onnx", "cpu").metadata["embedding_dim"]
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def png(pixels: np.ndarray | Image.Image, fmt: str = "PNG", **kw) -> bytes:
    im = pixels if isinstance(pixels, Image.Image) else Image.fromarray(pixels)
    buf = io.BytesIO()
    im.save(buf, format=fmt, **kw)
    return buf.getvalue()


def classify(
    url: str,
    data: bytes,
    headers: dict | None = None,
    session: requests.Session | None = None,
    **form,
) -> requests.Response:
    files = {"image": ("image.png", data, "image/png")}
    post = (session or requests).post
    return post(f"{url}/classify", files=files, data=form, headers=headers, timeout=30)


# ---------------------------------------------------------------------------- predictions


def test_http_predictions_equal_offline_onnx_runtime(server, test_set, offline, model_dir):
    images, _ = test_set
    # 8 clients at once: adaptive batching merges them, and each must get its own answer.
    with cf.ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda img: classify(server.url, png(img)), images))
    assert [r.status_code for r in responses] == [200] * len(images)
    got = [r.json() for r in responses]
    version = sha256_file(model_dir / "model.onnx")[:12]
    for i, pred in enumerate(got):
        assert pred["class_id"] == int(offline[i].argmax()), f"image {i}"
        assert np.allclose(pred["probabilities"], offline[i], atol=1e-5), f"image {i}"
        assert abs(sum(pred["probabilities"]) - 1.0) < 1e-5
        assert pred["model_version"] == version
    labels = server_metadata(server.url)["classes"]
    assert all(p["label"] == labels[p["class_id"]] for p in got)
    # The batcher really merged requests: fewer ONNX Runtime runs than images.
    before = metric_values(server.url)
    with cf.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda img: classify(server.url, png(img)), images))
    after = metric_values(server.url)
    runs = after.get("trainyard_batch_size_count", 0) - before.get("trainyard_batch_size_count", 0)
    summed = after.get("trainyard_batch_size_sum", 0) - before.get("trainyard_batch_size_sum", 0)
    assert summed == len(images) and 0 < runs < len(images), (runs, summed)


def metric_values(url: str, headers: dict | None = None) -> dict[str, float]:
    """/metrics as {series with labels: value}, summed over workers."""
    text = requests.get(f"{url}/metrics", headers=headers, timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = out.get(name, 0.0) + float(value)
    return out


def server_metadata(url: str, headers: dict | None = None) -> dict:
    resp = requests.get(f"{url}/metadata", headers=headers, timeout=10)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_batch_endpoint_agrees_with_single_images(server, test_set, offline):
    images, _ = test_set
    got = []
    for start in range(0, len(images), 16):  # serve.max_batch_images = 16 here
        body = {"images": images[start : start + 16].tolist()}
        resp = requests.post(f"{server.url}/classify_batch", json=body, timeout=30)
        assert resp.status_code == 200, resp.text
        got += resp.json()
    assert len(got) == len(images)
    assert [p["class_id"] for p in got] == [int(i) for i in offline.argmax(axis=1)]
    assert np.allclose([p["probabilities"] for p in got], offline, atol=1e-5)


def test_raw_body_and_multipart_give_the_same_answer_with_top_k(server, test_set, offline):
    data = png(test_set[0][3])
    raw = requests.post(
        f"{server.url}/classify?top_k=3",
        data=data,
        headers={"Content-Type": "image/png"},
        timeout=30,
    )
    assert raw.status_code == 200, raw.text
    multi = classify(server.url, data).json()
    assert raw.json()["probabilities"] == multi["probabilities"]
    assert np.allclose(multi["probabilities"], offline[3], atol=1e-5)
    top = raw.json()["top_k"]
    assert [t["class_id"] for t in top] == [int(i) for i in np.argsort(-offline[3])[:3]]
    assert top[0]["label"] == raw.json()["label"]
    assert len(multi["top_k"]) == 5  # serve.top_k's default
    assert all(a["probability"] >= b["probability"] for a, b in itertools.pairwise(top))


def test_metadata_names_the_model_and_the_provider(server, model_dir):
    import onnxruntime as ort

    meta = server_metadata(server.url)
    assert meta["model"]["sha256"] == sha256_file(model_dir / "model.onnx")
    assert meta["model"]["mlflow_run_id"] == "run-for-serving-tests"
    assert meta["classes"][0] == "T-shirt/top" and len(meta["classes"]) == 10
    assert meta["input"]["shape"] == [-1, 1, 28, 28]
    assert meta["input"]["normalization"] == {"scale": 255.0, "mean": [0.286], "std": [0.353]}
    assert meta["input"]["image"] == "28x28" and meta["input"]["resize"] == "pad"
    assert meta["dataset_card"]["classes"] == meta["classes"]
    expected = (
        "CUDAExecutionProvider"
        if has_cuda() and "CUDAExecutionProvider" in ort.get_available_providers()
        else "CPUExecutionProvider"
    )
    assert meta["provider"] == expected and meta["device"] == "auto"


def test_any_image_mode_and_size_is_converted_the_same_way(server, test_set):
    img = test_set[0][7]
    reference = np.array(classify(server.url, png(img)).json()["probabilities"])
    lossless = {  # decode to exactly the original pixels: exactly the same answer
        "RGB": png(Image.fromarray(img).convert("RGB")),
        "RGBA": png(Image.fromarray(img).convert("RGBA")),
        "palette": png(Image.fromarray(img).convert("P")),
        "16-bit": png(Image.fromarray(img.astype(np.uint16) * 257)),
    }
    for name, data in lossless.items():
        resp = classify(server.url, data)
        assert resp.status_code == 200, f"{name}: {resp.text}"
        assert np.allclose(resp.json()["probabilities"], reference, atol=1e-6), name
    # A 30x larger JPEG photo comes back to (nearly) the same 28x28 input.
    big = Image.fromarray(img).resize((840, 840), Image.Resampling.BICUBIC).convert("RGB")
    resp = classify(server.url, png(big, "JPEG", quality=95))
    assert resp.status_code == 200, resp.text
    assert np.abs(np.array(resp.json()["probabilities"]) - reference).max() < 0.05
    # A dark garment on white, with invert=true, is the original image again.
    inverted = classify(server.url, png(255 - img), invert="true").json()
    assert np.allclose(inverted["probabilities"], reference, atol=1e-6)


def test_one_pixel_image_is_valid(server):
    resp = classify(server.url, png(np.full((1, 1), 200, np.uint8)))
    assert resp.status_code == 200 and len(resp.json()["probabilities"]) == 10


# ---------------------------------------------------------------------------- any contract

RGB_CLASSES = ("red car", "Straße/β", "ünïcode ✓")


@pytest.fixture(scope="module")
def rgb_model(tmp_path_factory):
    """An RGB 3x40x48 model, centre-crop policy, class names with spaces, '/' and
    non-ASCII letters: trained a few steps by the real code and exported with its card."""
    from trainyard.export.onnx_export import export_and_verify

    from conftest import draw_shape

    root = tmp_path_factory.mktemp("rgb-model")
    rng = np.random.default_rng(3)
    card = make_card(RGB_CLASSES, (3, 40, 48), (0.5, 0.45, 0.4), (0.25, 0.26, 0.27), resize="crop")
    kinds = ("circle", "square", "triangle")
    images = np.stack(
        [
            np.asarray(draw_shape(kinds[i % 3], (48, 40), rng, "RGB")).transpose(2, 0, 1)
            for i in range(96)
        ]
    )
    labels = np.arange(96) % 3
    train_checkpoint(root, images, labels, steps=6, batch_size=32, mean=0, std=1, card=card)
    export_and_verify(
        root / "best.ckpt",
        root / "model.onnx",
        images[:32],
        opset=18,
        max_abs_diff=1e-4,
        run_id="rgb-run",
        data_sha256="e" * 64,
    )
    return root / "model.onnx"


@pytest.fixture(scope="module")
def rgb_server(tmp_path_factory, rgb_model):
    tmp = tmp_path_factory.mktemp("rgb-server")
    params = write_params(tmp / "params.yaml", batching=True, max_batch_images=4, top_k=2)
    srv = Server(server_env(params, rgb_model), tmp / "serve.log")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def rgb_photos(n: int) -> list[bytes]:
    """RGB photos of mixed sizes and formats, none at the model's 48x40."""
    from conftest import draw_shape

    rng = np.random.default_rng(11)
    out = []
    for i in range(n):
        size = (int(rng.integers(60, 400)), int(rng.integers(60, 400)))
        im = draw_shape(("circle", "square", "triangle")[i % 3], size, rng, "RGB")
        out.append(png(im, ("PNG", "JPEG", "WEBP")[i % 3]))
    return out


def test_an_rgb_model_serves_photos_with_its_own_contract(rgb_server, rgb_model):
    from trainyard.core.card import card_from_metadata
    from trainyard.runtime.inputs import decode_image, model_input, softmax
    from trainyard.runtime.sessions import load_onnx

    model = load_onnx(rgb_model, device="cpu")
    card = card_from_metadata(model.metadata)
    photos = rgb_photos(6)
    # offline: the same bytes through the same imaging function, then ONNX Runtime
    offline = softmax(
        model.run(model_input(np.stack([decode_image(p, card) for p in photos]), card))
    )

    meta = server_metadata(rgb_server.url)
    assert meta["classes"] == list(RGB_CLASSES)
    assert meta["input"]["shape"] == [-1, 3, 40, 48] and meta["input"]["image"] == "3x40x48"
    assert meta["input"]["resize"] == "crop" and meta["dataset_card"]["resize"] == "crop"
    assert meta["input"]["normalization"]["mean"] == [0.5, 0.45, 0.4]

    before = metric_values(rgb_server.url)
    for i, data in enumerate(photos):
        multi = classify(rgb_server.url, data)
        raw = requests.post(
            f"{rgb_server.url}/classify",
            data=data,
            headers={"Content-Type": ("image/png", "image/jpeg", "image/webp")[i % 3]},
            timeout=30,
        )
        for resp in (multi, raw):
            assert resp.status_code == 200, resp.text
            pred = resp.json()
            assert np.allclose(pred["probabilities"], offline[i], atol=1e-5), i
            assert pred["label"] == RGB_CLASSES[int(offline[i].argmax())]
            assert len(pred["top_k"]) == 2  # serve.top_k: 2
    files = [("images", (f"p{i}", data)) for i, data in enumerate(photos[:4])]
    resp = requests.post(f"{rgb_server.url}/classify_batch", files=files, timeout=30)
    assert resp.status_code == 200, resp.text
    assert np.allclose([p["probabilities"] for p in resp.json()], offline[:4], atol=1e-5)

    # The monitoring series moved: predictions per class, confidence, input sizes.
    after = metric_values(rgb_server.url)
    served = 2 * len(photos) + 4
    predicted = sum(
        after.get(f'trainyard_predictions_total{{label="{c}"}}', 0)
        - before.get(f'trainyard_predictions_total{{label="{c}"}}', 0)
        for c in RGB_CLASSES
    )
    assert predicted == served
    for series in ("trainyard_top1_confidence_count", "trainyard_input_image_pixels_count"):
        assert after[series] - before.get(series, 0) == served, series
    label_of_first = RGB_CLASSES[int(offline[0].argmax())]
    assert f'trainyard_predictions_total{{label="{label_of_first}"}}' in after


def test_an_rgb_model_refuses_what_does_not_fit_its_contract(rgb_server):
    url = rgb_server.url
    plane = [[0] * 48 for _ in range(40)]
    cases = {
        "one channel for an RGB model": (
            {"images": [plane]},
            "images[0]: expected 3 channel planes of 40 rows of 48 numbers, got 40 items",
        ),
        "wrong height": (
            {"images": [[plane[:39]] * 3]},
            "images[0][0]: expected 40 rows of 48 numbers, got 39 items",
        ),
        "wrong width": (
            {"images": [[[row[:47] for row in plane]] * 3]},
            "images[0][0][0]: expected 48 numbers, got 47 items",
        ),
    }
    for name, (body, text) in cases.items():
        resp = requests.post(f"{url}/classify_batch", json=body, timeout=30)
        assert resp.status_code == 400 and text in resp.json()["error"], (name, resp.text)
    good = rgb_photos(1)[0]
    resp = requests.post(
        f"{url}/classify_batch",
        files=[("images", ("ok.png", good)), ("images", ("x.png", b"")), ("images", ("y", good))],
        timeout=30,
    )
    assert resp.status_code == 400 and resp.json()["field"] == "images[1]", resp.text
    assert requests.get(f"{url}/healthz", timeout=5).status_code == 200
    assert "status=500" not in rgb_server.tail(10_000_000)


# ---------------------------------------------------------------------------- bad input


JSON_TYPE, PICKLE_TYPE = "application/json", "application/vnd.bentoml+pickle"


def post_raw(endpoint: str, body: str | bytes | Iterator[bytes], ctype: str) -> requests.Response:
    """``body`` as it is, with ``ctype`` as its Content-Type."""
    return requests.post(endpoint, data=body, headers={"Content-Type": ctype}, timeout=30)


def bomb_png() -> bytes:
    return png(Image.new("1", (30_000, 30_000)))  # 900 megapixels in ~110 kB


def truncated_png(test_set) -> bytes:
    noisy = np.random.default_rng(0).integers(0, 256, (200, 200), dtype=np.uint8)
    data = png(noisy)
    return data[: len(data) // 2]


def batch(images) -> dict:
    return {"images": images}


ZERO = [[0] * 28 for _ in range(28)]


def bad_requests(url: str, test_set) -> dict[str, tuple]:
    """name -> (thunk sending the request, expected status, text the error must contain)."""
    post = requests.post
    good = png(test_set[0][0])
    # Made before the clock starts: encoding 900 megapixels takes seconds on a busy machine.
    bomb = bomb_png()
    nan_image = json.dumps(ZERO).replace("0", "NaN", 1)
    return {
        "empty body": (
            lambda: post_raw(f"{url}/classify", b"", "multipart/form-data; boundary=x"),
            400,
            "empty request body",
        ),
        "no content type": (
            lambda: post_raw(f"{url}/classify", b"x", ""),
            415,
            "a body without a Content-Type",
        ),
        "no body at all": (lambda: post(f"{url}/classify", timeout=30), 400, "empty request body"),
        "wrong field name": (
            lambda: post(f"{url}/classify", files={"file": ("a.png", good)}, timeout=30),
            400,
            "file: unknown form field",
        ),
        "text instead of a file": (
            lambda: post(f"{url}/classify", files={"image": (None, "http://x/y.png")}, timeout=30),
            400,
            "image: must be a file upload",
        ),
        "raw body that is not an image type": (
            lambda: post(f"{url}/classify", data=good, headers={"Content-Type": "text/plain"}),
            415,
            "does not take 'text/plain'",
        ),
        "raw image body that is empty": (
            lambda: post(f"{url}/classify", data=b"", headers={"Content-Type": "image/png"}),
            400,
            "empty request body",
        ),
        "raw image body that is not an image": (
            lambda: post(f"{url}/classify", data=b"GIF89a?", headers={"Content-Type": "image/gif"}),
            400,
            "image: ",
        ),
        "two image fields": (
            lambda: post(
                f"{url}/classify",
                files=[("image", ("a.png", good)), ("image", ("b.png", good))],
                timeout=30,
            ),
            400,
            "expected one file field 'image'",
        ),
        "top_k not a number": (
            lambda: post(f"{url}/classify?top_k=all", files={"image": ("a.png", good)}),
            400,
            "top_k: expected a whole number",
        ),
        "batch with one corrupt file": (
            lambda: post(
                f"{url}/classify_batch",
                files=[("images", ("a.png", good)), ("images", ("b.png", b"\x89PNG broken"))],
                timeout=30,
            ),
            400,
            "images[1]: ",
        ),
        "batch with more files than the limit": (
            lambda: post(
                f"{url}/classify_batch",
                files=[("images", (f"{i}.png", good)) for i in range(17)],
                timeout=30,
            ),
            413,
            "more than the limit of 16",
        ),
        "batch in another content type": (
            lambda: post(f"{url}/classify_batch", data=good, headers={"Content-Type": "image/png"}),
            415,
            "repeated multipart fields 'images'",
        ),
        "malformed multipart": (
            lambda: post_raw(f"{url}/classify", b"garbage", "multipart/form-data"),
            400,
            "malformed multipart",
        ),
        "text file named .png": (
            lambda: classify(url, b"hello, I am not an image\n"),
            400,
            "image: not an image",
        ),
        "truncated PNG": (lambda: classify(url, truncated_png(test_set)), 400, "truncated"),
        "decompression bomb": (lambda: classify(url, bomb), 413, "image too large"),
        "invert not a boolean": (lambda: classify(url, good, invert="maybe"), 400, "invert"),
        "JSON wrong shape": (
            lambda: post(f"{url}/classify_batch", json=batch([ZERO[:27]]), timeout=30),
            400,
            "images[0]: expected 28 rows of 28 numbers, got 27 items",
        ),
        "JSON non-number": (
            lambda: post(f"{url}/classify_batch", json=batch([[["a"] * 28] * 28]), timeout=30),
            400,
            'images[0][0][0]: expected a number 0–255, got a string "a"',
        ),
        "JSON NaN": (
            lambda: post_raw(f"{url}/classify_batch", '{"images": [' + nan_image + "]}", JSON_TYPE),
            400,
            "NaN",
        ),
        "JSON out of range": (
            lambda: post(f"{url}/classify_batch", json=batch([[[300] * 28] * 28]), timeout=30),
            400,
            "images[0][0][0]: pixel value 300 is outside 0–255",
        ),
        "JSON empty list": (
            lambda: post(f"{url}/classify_batch", json=batch([]), timeout=30),
            400,
            "images: the list is empty",
        ),
        "JSON too many images": (
            lambda: post(f"{url}/classify_batch", json=batch([ZERO] * 17), timeout=30),
            413,
            "17 images, more than the limit of 16",
        ),
        "JSON missing field": (
            lambda: post(f"{url}/classify_batch", json={"imgs": []}, timeout=30),
            400,
            "images",
        ),
        "not JSON": (
            lambda: post_raw(f"{url}/classify_batch", b"{not json", JSON_TYPE),
            400,
            "Invalid JSON",
        ),
        "oversized body": (
            lambda: classify(url, b"\0" * (1024 * 1024 + 1)),
            413,
            "request body over 1,048,576 bytes",
        ),
        "oversized chunked body": (
            # a generator: sent chunked, no length
            lambda: post_raw(f"{url}/classify_batch", iter([b"[" * 65536] * 17), JSON_TYPE),
            413,
            "request body over",
        ),
        "pickle to /classify": (
            lambda: post_raw(f"{url}/classify", b"\x80\x04K\x01.", PICKLE_TYPE),
            415,
            "pickle",
        ),
        "pickle to /classify_batch": (
            lambda: post_raw(f"{url}/classify_batch", b"\x80\x04K\x01.", PICKLE_TYPE),
            415,
            "pickle",
        ),
        "unknown route": (
            lambda: post(f"{url}/internal/infer", json={"pixels": [ZERO]}, timeout=30),
            404,
            "Not Found",
        ),
    }


def strings_in(obj: object) -> str:
    """Every string in a JSON answer, joined: error texts without JSON escaping."""
    if isinstance(obj, str):
        return obj
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, list):
        return "\n".join(strings_in(v) for v in obj)
    return ""


def test_bad_input_gets_a_4xx_naming_the_problem_and_the_server_stays_up(server, test_set):
    failures = []
    before = metric_values(server.url)
    for name, (send, status, text) in bad_requests(server.url, test_set).items():
        start = time.perf_counter()
        resp = send()
        took = time.perf_counter() - start
        if not resp.headers.get("content-type", "").startswith("application/json"):
            failures.append(f"{name}: {resp.status_code}, not JSON: {resp.text[:200]}")
        elif resp.status_code != status or text not in strings_in(resp.json()):
            failures.append(f"{name}: got {resp.status_code} {resp.text[:300]}")
        elif took > 5:
            failures.append(f"{name}: took {took:.1f} s")
    assert not failures, "\n".join(failures)
    assert requests.get(f"{server.url}/healthz", timeout=5).status_code == 200
    assert classify(server.url, png(test_set[0][0])).status_code == 200
    # BentoML's access log: no request of this module's server was answered by a crash.
    assert "status=500" not in server.tail(10_000_000)
    # Every refusal is counted on /metrics by reason, beside BentoML's own series.
    after = metric_values(server.url)

    def moved(reason: str) -> float:
        key = f'trainyard_requests_refused_total{{reason="{reason}"}}'
        return after.get(key, 0.0) - before.get(key, 0.0)

    for reason in (
        "unsupported_media_type",
        "bad_request",
        "bad_field",
        "bad_image",
        "image_too_large",
        "too_many_images",
        "body_too_large",
        "not_found",
    ):
        assert moved(reason) >= 1, reason
    assert any(k.startswith("bentoml_service_request_total") for k in after)


# ---------------------------------------------------------------------------- API key


def test_api_key_guards_predictions_and_leaves_probes_open(keyed_server, test_set, offline):
    url, good = keyed_server.url, png(test_set[0][0])
    for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        resp = classify(url, good, headers=headers)
        assert resp.status_code == 401 and "Authorization: Bearer" in resp.json()["error"]
        assert resp.headers["www-authenticate"].startswith("Bearer")
    resp = requests.post(f"{url}/classify_batch", json=batch([ZERO]), timeout=10)
    assert resp.status_code == 401
    assert requests.get(f"{url}/metadata", timeout=10).status_code == 401
    for probe in ("/healthz", "/livez", "/readyz", "/metrics"):
        assert requests.get(f"{url}{probe}", timeout=10).status_code == 200, probe

    key = {"Authorization": f"Bearer {API_KEY}"}
    resp = classify(url, good, headers=key)
    assert resp.status_code == 200  # and the unbatched path gives the offline answer too
    assert np.allclose(resp.json()["probabilities"], offline[0], atol=1e-5)
    assert server_metadata(url, headers=key)["batching"]["enabled"] is False

    resp = requests.post(f"{url}/classify_batch", json=batch([ZERO]), headers=key, timeout=10)
    assert resp.status_code == 200 and resp.json()[0]["label"]
    assert metric_values(url)['trainyard_requests_refused_total{reason="unauthorized"}'] >= 5


def test_the_log_and_the_shadow_see_every_answer_off_its_path(keyed_server, test_set, offline):
    """A real `bentoml serve` with serve.log_predictions and serve.shadow: each answer
    becomes one log row carrying the shadow's answer (here the same model: they agree);
    /metrics counts the rows and the agreement."""
    url, key = keyed_server.url, {"Authorization": f"Bearer {API_KEY}"}
    images = test_set[0][:8]
    answers = [classify(url, png(img), headers=key).json() for img in images]
    assert [a["class_id"] for a in answers] == [int(np.argmax(p)) for p in offline[:8]]
    deadline, rows = time.monotonic() + 20, []
    while len(rows) < len(images) and time.monotonic() < deadline:
        time.sleep(0.3)
        rows = [r for r in read_log(keyed_server.log_dir).to_pylist() if r["route"] == "/classify"]
    assert len(rows) >= len(images), rows
    assert {a["label"] for a in answers} <= {r["label"] for r in rows}
    for row in rows:
        assert (row["shadow_label"], row["shadow_model_version"]) == (
            row["label"],
            row["model_version"],
        )
        assert (row["width"], row["height"], row["format"]) == (28, 28, "PNG")
        assert len(row["embedding"]) == int(keyed_server.embedding_dim)
    series = metric_values(url)
    assert series['trainyard_shadow_predictions_total{agreement="true"}'] >= len(images)
    assert series.get('trainyard_shadow_predictions_total{agreement="false"}', 0) == 0
    assert series['trainyard_prediction_log_rows_total{outcome="written"}'] >= len(images)
    assert series['trainyard_model_seconds_count{role="shadow"}'] >= len(images)


def test_over_concurrency_gets_a_fast_429_not_a_hang(keyed_server, test_set):
    # Photos big enough that each request holds its slot for a while (max_concurrency = 2).
    photo = Image.fromarray(test_set[0][1]).resize((2400, 2400)).convert("RGB")
    data = png(photo, "JPEG", quality=90)
    key = {"Authorization": f"Bearer {API_KEY}"}
    gate = threading.Barrier(24)

    def send(_: int) -> tuple[int, float]:
        gate.wait()
        start = time.perf_counter()
        resp = classify(keyed_server.url, data, headers=key)
        return resp.status_code, time.perf_counter() - start

    with cf.ThreadPoolExecutor(24) as pool:
        results = list(pool.map(send, range(24)))
    codes = [c for c, _ in results]
    assert set(codes) <= {200, 429} and codes.count(429) > 0 and codes.count(200) >= 2
    assert max(t for c, t in results if c == 429) < 2.0
    assert requests.get(f"{keyed_server.url}/healthz", timeout=5).status_code == 200


# ---------------------------------------------------------------------------- start-up


def start_and_expect_failure(
    tmp: Path, model: Path | str, env_extra: dict[str, str] | None = None, **serve
) -> str:
    """Run `bentoml serve` expecting it to stop by itself; return what it printed."""
    params = write_params(tmp / "params.yaml", **serve)
    env = server_env(params, model, **(env_extra or {}))
    cmd = [str(VENV_BIN / "bentoml"), "serve", "bento.service:ImageClassifier"]
    cmd += ["--host", "127.0.0.1", "--port", str(free_port())]
    try:
        done = subprocess.run(
            cmd,
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            start_new_session=True,
        )
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"bentoml serve kept running instead of failing: {err.stdout}{err.stderr}")
    assert done.returncode != 0
    return done.stdout + done.stderr


def test_altered_model_stops_start_up_with_a_clear_message(tmp_path, model_dir):
    model = tmp_path / "model.onnx"
    shutil.copy(model_dir / "model.onnx", model)
    (tmp_path / "model.onnx.sha256").write_text(f"{'0' * 64}  model.onnx\n")
    out = start_and_expect_failure(tmp_path, model)
    assert "does not match" in out and "Re-export it" in out

    (tmp_path / "model.onnx.sha256").unlink()
    assert "checksum file missing" in start_and_expect_failure(tmp_path, model)
    assert "model not found" in start_and_expect_failure(tmp_path, tmp_path / "nope.onnx")


@pytest.mark.skipif(has_cuda(), reason="checks the no-GPU path")
def test_asking_for_cuda_without_a_gpu_is_a_clear_error_not_a_crash(tmp_path, model_dir):
    out = start_and_expect_failure(tmp_path, model_dir / "model.onnx", device="cuda")
    assert "device 'cuda' asked for, but" in out and "use 'auto' or 'cpu'" in out


@pytest.mark.gpu
def test_gpu_serving_reports_cuda(tmp_path, model_dir, test_set, offline):
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime without the CUDA provider")
    params = write_params(tmp_path / "params.yaml", device="cuda")
    srv = Server(server_env(params, model_dir / "model.onnx"), tmp_path / "serve.log")
    try:
        srv.wait_ready()
        assert server_metadata(srv.url)["provider"] == "CUDAExecutionProvider"
        pred = classify(srv.url, png(test_set[0][0])).json()
        assert np.allclose(pred["probabilities"], offline[0], atol=1e-4)
    finally:
        srv.stop()


# ---------------------------------------------------------------------------- registry

REGISTERED = "fashion-mnist-classifier"


@pytest.fixture(scope="module")
def registry(tmp_path_factory, model_dir, test_set):
    """A real MLflow registry (sqlite store) where model_dir's ONNX file is champion v1, as
    the evaluate stage leaves it; v2 is the same file with a wrong sha256 tag."""
    import mlflow

    from trainyard.export.onnx_export import normalized_example
    from trainyard.track.registry import log_onnx_model, register_and_promote

    root = tmp_path_factory.mktemp("registry")
    uri = f"sqlite:///{root}/mlflow.db"
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    try:
        exp = mlflow.create_experiment("serving", artifact_location=(root / "art").as_uri())
        with mlflow.start_run(experiment_id=exp) as run:
            example = normalized_example(model_dir / "model.onnx", test_set[0][:1, None])
            model_uri = log_onnx_model(model_dir / "model.onnx", example)
        client = mlflow.MlflowClient(uri)
        sha = sha256_file(model_dir / "model.onnx")
        v1 = register_and_promote(
            client, REGISTERED, model_uri, run.info.run_id, 0.5, "data-v1", sha, 0.0
        )
        assert (v1["version"], v1["alias"]) == (1, "champion")
        v2 = client.create_model_version(
            REGISTERED, model_uri, run.info.run_id, tags={"onnx_sha256": "0" * 64}
        )
        client.set_registered_model_alias(REGISTERED, "tampered", v2.version)
    finally:
        mlflow.set_tracking_uri(previous)
    return {"uri": uri, "run_id": run.info.run_id, "root": root}


def test_serves_the_registry_champion_and_every_answer_names_it(
    tmp_path, registry, model_dir, test_set, offline
):
    params = write_params(tmp_path / "params.yaml", batching=False)
    env = server_env(
        params,
        f"models:/{REGISTERED}@champion",
        MLFLOW_TRACKING_URI=registry["uri"],
        TRAINYARD_MODEL_CACHE=str(tmp_path / "cache"),
    )
    srv = Server(env, tmp_path / "serve.log")
    try:
        srv.wait_ready()
        for i in range(5):  # the same answers as the local file
            r = classify(srv.url, png(test_set[0][i]))
            assert r.status_code == 200, r.text
            assert np.allclose(r.json()["probabilities"], offline[i], atol=1e-5)
        assert r.headers["x-model-registry-version"] == f"{REGISTERED}/1"
        assert r.headers["x-mlflow-run-id"] == registry["run_id"]
        assert r.headers["x-data-version"] == "data-v1"
        assert r.headers["x-model-version"] == sha256_file(model_dir / "model.onnx")[:12]
        source = server_metadata(srv.url)["source"]
        assert (source["registry_model"], source["registry_version"]) == (REGISTERED, "1")
        assert source["registry_alias"] == "champion"
    finally:
        srv.stop()
    cached = tmp_path / "cache" / REGISTERED / "1" / "model.onnx"
    assert sha256_file(cached) == sha256_file(model_dir / "model.onnx")


def test_local_model_answers_carry_its_run_and_data_version(server):
    r = requests.get(f"{server.url}/healthz", timeout=5)
    assert r.headers["x-model-registry-version"] == "local"
    assert r.headers["x-mlflow-run-id"] == "run-for-serving-tests"
    assert r.headers["x-data-version"] == "d" * 64


def test_unknown_alias_or_model_stops_start_up(tmp_path, registry):
    env = {"MLFLOW_TRACKING_URI": registry["uri"]}
    out = start_and_expect_failure(tmp_path, f"models:/{REGISTERED}@nope", env)
    assert f"models:/{REGISTERED}@nope: not found in the registry" in out
    out = start_and_expect_failure(tmp_path, "models:/no-such-model@champion", env)
    assert "not found in the registry" in out
    assert "expected models:/NAME@ALIAS" in start_and_expect_failure(tmp_path, "models:/x", env)


def test_registry_model_whose_sha256_does_not_match_is_refused(tmp_path, registry):
    env = {"MLFLOW_TRACKING_URI": registry["uri"], "TRAINYARD_MODEL_CACHE": str(tmp_path / "cache")}
    out = start_and_expect_failure(tmp_path, f"models:/{REGISTERED}@tampered", env)
    assert "downloaded model.onnx has sha256" in out and "refusing it" in out
    assert not (tmp_path / "cache" / REGISTERED / "2" / "model.onnx").exists()


def worker_connections(server: Server) -> list[int]:
    """Established connections to the server's port, per worker process (a worker with
    none is left out)."""
    import psutil

    counts = []
    for proc in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            conns = proc.net_connections("tcp")
        except psutil.Error:
            continue
        n = sum(1 for c in conns if c.status == "ESTABLISHED" and c.laddr.port == server.port)
        if n:
            counts.append(n)
    return sorted(counts)


def test_keep_alive_connections_are_shared_evenly_by_the_workers(tmp_path, model_dir, test_set):
    """16 keep-alive clients opened at once on 2 workers: a worker holding more than its
    share closes its surplus after an answer (Connection: close), the clients reconnect,
    and each worker ends up with 8, every answer a 200 (uvloop's accept alone left all 16
    on one worker in one start of four)."""
    params = write_params(tmp_path / "params.yaml", workers=2, batching=False)
    srv = Server(server_env(params, model_dir / "model.onnx"), tmp_path / "serve.log")
    images, _ = test_set
    body = png(images[0])
    try:
        srv.wait_ready()
        barrier = threading.Barrier(16)
        sessions = [requests.Session() for _ in range(16)]

        def client(session: requests.Session) -> list[int]:
            barrier.wait()  # every client connects at the same moment
            return [classify(srv.url, body, session=session).status_code for _ in range(30)]

        with cf.ThreadPoolExecutor(16) as pool:
            statuses = [s for got in pool.map(client, sessions) for s in got]
        assert statuses == [200] * len(statuses)
        assert worker_connections(srv) == [8, 8], srv.tail()
    finally:
        srv.stop()


def test_tracing_is_off_unless_asked(server, keyed_server, test_set):
    """serve.tracing false (the default): BentoML's OpenTelemetry middleware is skipped, so
    no span and no request id; true: each answer carries its span's id."""
    body = png(test_set[0][0])
    quiet = classify(server.url, body)
    assert quiet.status_code == 200 and "x-bentoml-request-id" not in quiet.headers
    traced = classify(keyed_server.url, body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert traced.status_code == 200 and traced.headers["x-bentoml-request-id"]
