"""The service watching itself: the prediction log and the shadow challenger, through the
real service (bento/service.py's BentoML app, in process, lifespan and all), on tiny
ONNX models whose answers the test computes itself. The real `bentoml serve` runs of the
same settings are in tests/serve/test_serving.py."""

from __future__ import annotations

import io
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from test_serve_unit import service_client

from trainyard.core.card import Card
from trainyard.core.config import ServeParams
from trainyard.core.errors import ModelError
from trainyard.runtime.inputs import decode_image
from trainyard.serve.settings import Settings, shadow_source
from trainyard.watch.log import PredictionLog, keep_under, log_files, read_log

from conftest import make_card, write_tiny_onnx

PNG = {"Content-Type": "image/png"}
CARD = make_card(("circle", "square", "triangle"), (3, 8, 8), resize="stretch")
# The challenger asks for another input (grayscale, 6x6): it decodes the upload itself.
OTHER = make_card(CARD.classes, (1, 6, 6), resize="stretch")


def model_input(card: Card, image: Image.Image) -> np.ndarray:
    """The flat, normalised input the pipeline's own decode gives for ``card``."""
    pixels = decode_image(png(image), card)
    x = (pixels / 255.0 - np.array(card.mean)[:, None, None]) / np.array(card.std)[:, None, None]
    return x.reshape(-1).astype(np.float32)


def answer_of(weights: dict, card: Card, image: Image.Image) -> tuple[str, float]:
    """The tiny model's top-1 for ``image``, computed here: x @ W + b."""
    logits = model_input(card, image) @ weights["weight"] + weights["bias"]
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    best = int(probs.argmax())
    return card.classes[best], float(probs[best])


def photos(n: int, seed: int = 0) -> list[Image.Image]:
    """Random RGB images, each of its own size (a log row names its image by its size)."""
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (8 + i, 17, 3), dtype=np.uint8)) for i in range(n)]


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("observe")
    # The served model has the embedding output (the log keeps it); the shadows do not.
    served, served_w = write_tiny_onnx(root / "served", CARD, seed=1, embedding=True)
    twin, twin_w = write_tiny_onnx(root / "twin", CARD, seed=2)
    other, other_w = write_tiny_onnx(root / "other", OTHER, seed=3)
    return {
        "served": (served, served_w),
        "twin": (twin, twin_w),
        "other": (other, other_w),
        "root": root,
    }


def serve_and_log(
    models: dict, shadow: str | None, images: list[Image.Image], **serve
) -> list[dict]:
    """POST each image to /classify (and the first three to /classify_batch) with the
    prediction log (and ``shadow``) on; the answers. The client's exit is the worker's
    shutdown, which scores what the shadow holds and writes the log's last rows."""
    settings = {"log_predictions": True, "log_rotate_s": 0.2, "shadow": shadow, **serve}
    answers = []
    for client in service_client(models["served"][0], **settings):
        for image in images:
            resp = client.post("/classify", files={"image": ("x.png", png(image), "image/png")})
            assert resp.status_code == 200, resp.text
            answers.append(resp.json())
        files = [("images", (f"{i}.png", png(im), "image/png")) for i, im in enumerate(images[:3])]
        resp = client.post("/classify_batch", files=files)
        assert resp.status_code == 200, resp.text
        answers += resp.json()
    return answers


@pytest.mark.parametrize("shadow_name", ["twin", "other"])
def test_every_answer_is_logged_once_with_the_shadows_own_answer(models, shadow_name, tmp_path):
    images = photos(12)
    shadow, shadow_w = models[shadow_name]
    card = CARD if shadow_name == "twin" else OTHER
    answers = serve_and_log(models, str(shadow), images, log_dir=str(tmp_path / "log"))
    table = read_log(tmp_path / "log").to_pylist()
    assert len(table) == len(images) + 3  # each answer once: 12 singles, a batch of 3
    assert [r["route"] for r in table].count("/classify_batch") == 3
    sent = images + images[:3]
    by_answer = sorted(zip(answers, sent, strict=True), key=lambda a: a[0]["label"])
    assert sorted(r["label"] for r in table) == [a["label"] for a, _ in by_answer]
    served_w = models["served"][1]
    for row in table:
        # The row's image, found by its size; the answer and the shadow's, computed here.
        image = next(im for im in sent if (im.width, im.height) == (row["width"], row["height"]))
        assert (row["label"], row["format"]) == (answer_of(served_w, CARD, image)[0], "PNG")
        label, prob = answer_of(shadow_w, card, image)
        assert row["shadow_label"] == label
        assert row["shadow_probability"] == pytest.approx(prob, abs=1e-5)
        assert row["shadow_registry_version"] == row["registry_version"] == "local"
        assert row["shadow_model_version"] != row["model_version"]
        assert row["latency_ms"] > 0 and row["shadow_latency_ms"] > 0
        embedding = model_input(CARD, image) @ served_w["embedding_weight"]
        assert np.allclose(row["embedding"], embedding, atol=1e-4)
        assert row["image"] is None  # serve.log_images is off


def test_answers_do_not_change_with_the_log_and_shadow_on(models, tmp_path):
    images = photos(6, seed=4)
    plain = []
    for client in service_client(models["served"][0]):
        for image in images:
            plain.append(
                client.post(
                    "/classify", content=png(image), headers={"Content-Type": "image/png"}
                ).json()
            )
    watched = serve_and_log(
        models, str(models["twin"][0]), images, log_dir=str(tmp_path / "log"), log_images=True
    )
    assert watched[: len(images)] == plain
    rows = read_log(tmp_path / "log").to_pylist()
    assert all(r["image"] and Image.open(io.BytesIO(r["image"])).format == "PNG" for r in rows)


def test_a_writer_that_cannot_keep_up_drops_rows_and_counts_them(tmp_path):
    """A queue of 4 rows and a file per row: most rows cannot wait. ``offer`` never
    blocks; every row is either written or counted as dropped; none is lost silently."""
    told = {"written": 0, "dropped": 0}

    def listen(outcome: str, rows: int) -> None:
        told[outcome] += rows

    plog = PredictionLog(tmp_path, rotate_rows=1, queue_rows=4, listener=listen).start()
    offered = 3000
    accepted = sum(plog.offer({"label": "a", "probability": 0.5}) for _ in range(offered))
    plog.close()
    assert plog.counts.dropped > 0 and accepted < offered
    assert plog.counts.written == accepted == len(read_log(tmp_path))
    assert plog.counts.written + plog.counts.dropped == offered
    assert told == {"written": plog.counts.written, "dropped": plog.counts.dropped}


def test_the_log_folder_stays_under_its_bound_oldest_first(tmp_path):
    plog = PredictionLog(tmp_path, rotate_rows=1, max_bytes=2**20).start()
    for i in range(5):
        plog.offer({"label": str(i), "probability": 0.5})
        time.sleep(0.05)
    plog.close()
    files = log_files(tmp_path)
    assert len(files) == 5
    keep = sum(f.stat().st_size for f in files[-2:])
    assert keep_under(tmp_path, keep) == 3
    assert [r["label"] for r in read_log(tmp_path).to_pylist()] == ["3", "4"]


def test_a_row_the_schema_cannot_hold_is_dropped_and_the_writer_goes_on(tmp_path):
    plog = PredictionLog(tmp_path, rotate_rows=1).start()
    plog.offer({"label": "a", "probability": "not a number"})
    plog.offer({"label": "b", "probability": 0.25})
    plog.close()
    assert plog.counts.dropped == 1 and "not a number" in plog.counts.last_error
    assert [r["label"] for r in read_log(tmp_path).to_pylist()] == ["b"]


def settings(model: str, shadow: str | None) -> Settings:
    params = ServeParams(model=model, shadow=shadow)
    return Settings(params, Path("/srv/params.yaml"), model, None, Path("/tmp"))


def test_shadow_sources_an_alias_of_the_served_registry_model_or_a_named_one():
    assert shadow_source(settings("models:/shapes@champion", None), {}) is None
    got = shadow_source(settings("models:/shapes@champion", "challenger"), {})
    assert got == "models:/shapes@challenger"
    assert (
        shadow_source(settings("models:/shapes/3", "candidate"), {}) == "models:/shapes@candidate"
    )
    assert shadow_source(settings("m.onnx", "models:/x/2"), {}) == "models:/x/2"
    assert shadow_source(settings("m.onnx", None), {"TRAINYARD_SHADOW": "b.onnx"}) == "b.onnx"
    with pytest.raises(ModelError, match=r"serve\.shadow: 'challenger' is an alias"):
        shadow_source(settings("models/model.onnx", "challenger"), {})


def test_a_missing_shadow_model_stops_start_up_naming_it(models, tmp_path):
    with pytest.raises(Exception, match=r"nowhere\.onnx"):
        for _ in service_client(models["served"][0], shadow=str(tmp_path / "nowhere.onnx")):
            pass


def test_log_files_appear_whole(tmp_path):
    plog = PredictionLog(tmp_path, rotate_rows=2).start()
    for i in range(4):
        plog.offer({"label": str(i)})
    plog.close()
    assert all(not p.name.startswith(".") for p in tmp_path.iterdir())
    assert len(log_files(tmp_path)) == 2


def scored(path: Path, images: list[Image.Image]) -> tuple[np.ndarray, np.ndarray]:
    """(probabilities, embeddings) of the model at ``path`` for ``images``, by the runtime
    the service uses: what its reference holds."""
    from trainyard.runtime.inputs import model_input as to_input
    from trainyard.runtime.inputs import softmax
    from trainyard.runtime.sessions import load_onnx

    model = load_onnx(path, "cpu", say=False)
    pixels = np.stack([decode_image(png(im), CARD) for im in images]).astype(np.float32)
    logits, embeddings = model.run_with_embedding(to_input(pixels, CARD))
    return softmax(logits), embeddings


def noise(n: int, seed: int, low: int = 0, high: int = 256) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(low, high, (8, 8, 3), dtype=np.uint8)) for _ in range(n)]


def test_the_drift_score_flags_shifted_answers_and_not_the_reference_distribution(models, tmp_path):
    """serve.drift_window: the service's last answers against the reference beside the
    model (evaluate's model.reference.npz). Answers like the reference's: no drift; dark
    images (another input distribution): drift, the measures named."""
    import shutil

    from trainyard.serve.drift_watch import reference_beside
    from trainyard.watch.reference import build_reference, save_reference

    folder = tmp_path / "model"
    shutil.copytree(models["served"][0].parent, folder)
    model = folder / "model.onnx"
    probs, embeddings = scored(model, noise(600, seed=10))
    sha = model.with_name("model.onnx.sha256").read_text().split()[0]
    save_reference(
        build_reference(CARD.classes, probs, embeddings, model_sha256=sha), reference_beside(model)
    )
    settings = {"drift_window": 150, "drift_every_s": 3600}  # checked by the test, not a timer
    for client in service_client(model, **settings):
        watch = client.predictor.observer.drift
        for image in noise(150, seed=11):
            assert client.post("/classify", content=png(image), headers=PNG).status_code == 200
        same = watch.check()
        for image in noise(150, seed=12, high=60):
            assert client.post("/classify", content=png(image), headers=PNG).status_code == 200
        dark = watch.check()
    assert same is not None and not same.drifted, same.summary
    assert dark is not None and dark.drifted, dark.summary
    assert "embedding" in dark.drifted_measures, dark.summary
    assert {m.name for m in same.measures} == {"class_mix", "confidence", "embedding"}


def test_no_reference_beside_the_model_means_no_drift_score_said_once(models, caplog):
    with caplog.at_level("INFO"):
        for client in service_client(models["served"][0], drift_window=100):
            assert client.predictor.observer is None  # nothing else is on either
    assert "no reference at" in caplog.text and "no drift score" in caplog.text


def test_a_reference_of_another_model_gives_no_drift_score_and_says_why(models, tmp_path, caplog):
    import shutil

    from trainyard.serve.drift_watch import reference_beside
    from trainyard.watch.reference import build_reference, save_reference

    folder = tmp_path / "model"
    shutil.copytree(models["served"][0].parent, folder)
    probs, embeddings = scored(folder / "model.onnx", noise(100, seed=1))
    stale = build_reference(CARD.classes, probs, embeddings, model_sha256="f" * 64)
    save_reference(stale, reference_beside(folder / "model.onnx"))
    with caplog.at_level("INFO"):
        for client in service_client(folder / "model.onnx", drift_window=100):
            assert client.predictor.observer is None
    assert "is the reference of model ffffffffffff" in caplog.text
    assert "dvc repro evaluate" in caplog.text
