"""Evaluate: the ONNX model's own card drives normalisation, batches and reports at any scale."""

from __future__ import annotations

import csv
import io
import json
import re
import warnings
from pathlib import Path

import numpy as np
import pytest

from trainyard.core.card import METADATA_KEY, Card, normalize_pixels
from trainyard.core.errors import DataError, ModelError
from trainyard.evaluation import scoring as evaluation
from trainyard.evaluation.pictures import MAX_FIGURE_PIXELS, confusion_png, tick_label
from trainyard.evaluation.scoring import (
    REPORT_FILES,
    classification_metrics,
    evaluate_onnx,
    metric_key,
    predictions_csv,
    write_reports,
)
from trainyard.runtime.inputs import softmax

from conftest import save_onnx

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# Every awkward thing a folder name can hold: spaces, '/', CSV and TeX specials, accents,
# CJK (no glyphs in DejaVu), a newline, a lone carriage return, and names that differ only
# in characters a metric key cannot hold.
AWKWARD = [
    "T-shirt/top",
    "crème brûlée",
    "日本",
    'say "cheese", please',
    "line\nbreak",
    "carriage\rreturn",
    "price $\\bogus$ tag",
    "a,b",
    "a/b",
    "a_b",
    "x" * 300,
]


def make_card(classes: list[str], shape: tuple[int, int, int] = (3, 8, 6)) -> Card:
    c, h, w = shape
    # Distinct per-channel statistics: a wrong channel order or a missing normalisation
    # changes the predictions.
    mean = (0.2, 0.5, 0.7)[:c]
    std = (0.1, 0.3, 0.25)[:c]
    return Card("folder", tuple(classes), c, h, w, mean, std)


def make_model(path: Path, card: Card, outputs: int | None = None, seed: int = 0) -> np.ndarray:
    """An ONNX model: logits = flatten(x) @ W (W returned), the card in its metadata."""
    from onnx import TensorProto, helper, numpy_helper

    k = card.num_classes if outputs is None else outputs
    features = card.channels * card.height * card.width
    weight = np.random.default_rng(seed).standard_normal((features, k)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Flatten", ["x"], ["flat"], axis=1),
            helper.make_node("MatMul", ["flat", "W"], ["logits"]),
        ],
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", *card.input_shape])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", k])],
        initializer=[numpy_helper.from_array(weight, "W")],
    )
    save_onnx(graph, path, {METADATA_KEY: json.dumps(card.contract())})
    return weight


def readonly_memmap(path: Path, array: np.ndarray) -> np.ndarray:
    out = np.lib.format.open_memmap(path, mode="w+", dtype=array.dtype, shape=array.shape)
    out[:] = array
    out.flush()
    del out
    return np.load(path, mmap_mode="r")


def run_whole(onnx_path: Path, x: np.ndarray) -> np.ndarray:
    """Argmax of the model on all of ``x`` in one ONNX Runtime call."""
    return logits_whole(onnx_path, x).argmax(1)


def logits_whole(onnx_path: Path, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def reference_predictions(onnx_path: Path, images: np.ndarray, card: Card) -> np.ndarray:
    """The whole set normalised at once and run in one call."""
    return run_whole(onnx_path, normalize_pixels(np.asarray(images), card.mean, card.std))


def reference_confidence(onnx_path: Path, images: np.ndarray, card: Card) -> np.ndarray:
    """The softmax probability of each image's top class, the whole set in one call."""
    x = normalize_pixels(np.asarray(images), card.mean, card.std)
    return softmax(logits_whole(onnx_path, x)).max(axis=1)


@pytest.fixture
def tiny(tmp_path: Path) -> dict:
    classes = [f"class {i}" for i in range(7)]
    card = make_card(classes)
    onnx_path = tmp_path / "model.onnx"
    make_model(onnx_path, card)
    rng = np.random.default_rng(1)
    n = 103  # prime: no batch size below it divides it
    pixels = rng.integers(0, 256, size=(n, *card.input_shape), dtype=np.uint8)
    images = readonly_memmap(tmp_path / "test_images.npy", pixels)
    labels = rng.integers(0, len(classes), size=n).astype(np.int32)
    return {"card": card, "onnx": onnx_path, "images": images, "labels": labels}


# ---------------------------------------------------------------------------- evaluate_onnx


@pytest.mark.parametrize("batch_size", [1, 10, 64, 103, 500])
def test_batched_memmap_predictions_equal_whole_set_at_once(tiny, batch_size, monkeypatch):
    images, labels, card = tiny["images"], tiny["labels"], tiny["card"]
    assert isinstance(images, np.memmap) and not images.flags.writeable
    expected = reference_predictions(tiny["onnx"], images, card)
    # The check discriminates: pixels scaled to 0..1 but not standardised per channel give
    # other predictions, and the predictions span several classes.
    unnormalised = run_whole(tiny["onnx"], np.asarray(images, dtype=np.float32) / 255)
    assert (unnormalised != expected).mean() > 0.2
    assert len(set(expected.tolist())) >= 3

    seen: list[int] = []

    def spy(pixels, mean, std):
        seen.append(pixels.shape[0])
        return normalize_pixels(pixels, mean, std)

    monkeypatch.setattr(evaluation, "normalize_pixels", spy)
    result = evaluate_onnx(tiny["onnx"], images, labels, batch_size, device="cpu")

    assert result["predictions"].dtype == np.int64
    np.testing.assert_array_equal(result["predictions"], expected)
    assert result["confidence"].dtype == np.float32
    np.testing.assert_allclose(
        result["confidence"], reference_confidence(tiny["onnx"], images, card), rtol=1e-6
    )
    assert result["confidence"].min() > 1 / 7  # a top-1 probability of 7 classes
    # Only one batch is ever float: never more rows than the batch size per call.
    assert max(seen) <= batch_size and sum(seen) == len(labels)
    assert len(seen) == -(-len(labels) // batch_size)
    assert result["classes"] == list(card.classes)
    m = result["metrics"]
    assert m["samples"] == 103 and m["provider"] == "CPUExecutionProvider"
    assert m["io_binding"] is False  # binding only on CUDA (tests/runtime/test_io_binding.py)
    assert m["accuracy"] == pytest.approx(float((expected == labels).mean()), abs=1e-6)
    assert np.asarray(m["confusion_matrix"]).sum() == 103


def test_wrong_image_shape_names_both_shapes(tiny):
    swapped = np.zeros((4, 3, 6, 8), dtype=np.uint8)  # H and W swapped
    with pytest.raises(DataError, match=re.escape("(3, 6, 8)")) as err:
        evaluate_onnx(tiny["onnx"], swapped, tiny["labels"][:4], 8, device="cpu")
    assert "(3, 8, 6)" in str(err.value)
    gray = np.zeros((4, 8, 6), dtype=np.uint8)  # the old [N, H, W] layout
    with pytest.raises(DataError, match=re.escape("(3, 8, 6)")):
        evaluate_onnx(tiny["onnx"], gray, tiny["labels"][:4], 8, device="cpu")


def test_labels_out_of_range_and_float_images_are_refused(tiny):
    images = np.asarray(tiny["images"][:5])
    for bad in ([0, 1, 2, 3, 7], [0, 1, -1, 3, 4]):
        with pytest.raises(DataError, match="model has 7 classes"):
            evaluate_onnx(tiny["onnx"], images, np.array(bad, np.int32), 8, device="cpu")
    with pytest.raises(DataError, match="5 test images but 4 labels"):
        evaluate_onnx(tiny["onnx"], images, tiny["labels"][:4], 8, device="cpu")
    with pytest.raises(DataError, match="uint8"):
        evaluate_onnx(tiny["onnx"], images.astype(np.float32), tiny["labels"][:5], 8, "cpu")


def test_model_whose_outputs_disagree_with_its_card_is_refused(tmp_path, tiny):
    path = tmp_path / "liar.onnx"
    make_model(path, tiny["card"], outputs=5)
    with pytest.raises(ModelError, match=r"names 7 classes"):
        evaluate_onnx(path, tiny["images"], tiny["labels"], 50, device="cpu")


# ---------------------------------------------------------------------------- 100 classes


def hundred_classes() -> list[str]:
    return AWKWARD + [f"class {i:03d} with spaces" for i in range(100 - len(AWKWARD))]


def test_hundred_awkward_classes_end_to_end_reports(tmp_path):
    classes = hundred_classes()
    card = make_card(classes, shape=(3, 4, 4))
    onnx_path = tmp_path / "model.onnx"
    make_model(onnx_path, card, seed=3)
    rng = np.random.default_rng(2)
    n = 1000
    images = readonly_memmap(
        tmp_path / "imgs.npy", rng.integers(0, 256, (n, 3, 4, 4), dtype=np.uint8)
    )
    labels = rng.integers(0, 100, n).astype(np.int32)

    result = evaluate_onnx(onnx_path, images, labels, 96, device="cpu")
    np.testing.assert_array_equal(
        result["predictions"], reference_predictions(onnx_path, images, card)
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        paths = write_reports(result, images, labels, tmp_path / "reports", history=None)
    glyphs = [w for w in caught if "Glyph" in str(w.message)]
    assert not glyphs, glyphs[0].message

    # predictions.csv: every row round-trips through csv.DictReader, names intact.
    with open(paths["predictions"], newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        assert reader.fieldnames == ["actual", "predicted"]
        rows = list(reader)
    assert rows == [
        {"actual": classes[a], "predicted": classes[p]}
        for a, p in zip(labels, result["predictions"], strict=True)
    ]

    assert set(paths) == set(REPORT_FILES)
    png = paths["confusion_png"].read_bytes()
    assert_valid_png(png, min_side=2000)
    assert_valid_png(paths["confusion_normalized_png"].read_bytes(), min_side=2000)
    assert_valid_png(paths["per_class_png"].read_bytes(), min_side=800)  # 100 bars, 30 in
    assert_valid_png(paths["mistakes_png"].read_bytes(), min_side=600)
    assert_valid_png(paths["curves_png"].read_bytes(), min_side=600)  # "no history" text

    report = json.loads(paths["classification"].read_text(encoding="utf-8"))
    assert list(report["per_class"]) == classes
    assert "crème brûlée" in paths["classification"].read_text(encoding="utf-8")


def assert_valid_png(png: bytes, min_side: int) -> tuple[int, int]:
    from PIL import Image

    assert png[:8] == PNG_SIGNATURE
    assert len(png) < 5_000_000
    with Image.open(io.BytesIO(png)) as im:
        im.verify()
    with Image.open(io.BytesIO(png)) as im:
        im.load()
        size = im.size
    assert min_side <= min(size) and max(size) <= MAX_FIGURE_PIXELS
    return size


def test_confusion_png_grows_with_the_class_count_and_survives_tex_and_cjk():
    rng = np.random.default_rng(0)
    sizes = {}
    for k in (3, 100):
        names = AWKWARD[:k] if k <= len(AWKWARD) else hundred_classes()
        cm = rng.integers(0, 20, (k, k))
        cm[np.diag_indices(k)] += 200
        cm[1] = 0  # a class with no test images: no division by zero
        sizes[k] = assert_valid_png(confusion_png(cm.tolist(), names, "t — $x$"), min_side=500)
    assert sizes[100][0] > 2 * sizes[3][0]
    with pytest.raises(ValueError, match=r"expected \(3, 3\)"):
        confusion_png([[1, 2], [3, 4]], ["a", "b", "c"], "t")


def test_tick_labels_are_one_short_line():
    assert tick_label("T-shirt/top") == "T-shirt/top"
    long = tick_label("a_very_long_class_name_that_goes_on_and_on")
    assert long == "a_very_long_class_name_…"
    assert tick_label("line\nbreak\tand\rmore") == "line break and more"


def test_predictions_csv_quotes_what_needs_quoting():
    classes = ["a,b", 'say "hi"', "two\nlines", "cr\rhere", "日本"]
    y = np.arange(5)
    text = predictions_csv(y, y[::-1], classes)
    rows = list(csv.DictReader(io.StringIO(text, newline="")))
    assert [(r["actual"], r["predicted"]) for r in rows] == list(
        zip(classes, classes[::-1], strict=True)
    )
    # Plain names stay unquoted: the file dvc plots has always read.
    assert predictions_csv(np.array([0]), np.array([1]), ["Bag", "Coat"]) == (
        "actual,predicted\nBag,Coat\n"
    )


# ---------------------------------------------------------------------------- metric keys


def test_metric_key_examples():
    assert metric_key("test/f1", 7, "T-shirt/top", 100) == "test/f1/007_T-shirt_top"
    assert metric_key("test/f1/", 0, "Bag", 10) == "test/f1/00_Bag"
    assert metric_key("test/f1", 3, "crème brûlée", 10) == "test/f1/03_creme brulee"
    assert metric_key("test/recall", 2, "日本", 3) == "test/recall/2___"
    with pytest.raises(ValueError):
        metric_key("test/f1", 10, "x", 10)


def test_metric_keys_are_unique_short_flat_and_valid_for_mlflow():
    validation = pytest.importorskip("mlflow.utils.validation")
    classes = hundred_classes()
    keys = [metric_key("test/f1", i, c, len(classes)) for i, c in enumerate(classes)]
    assert len(set(keys)) == len(keys)  # "a,b", "a/b" and "a_b" all sanitise to "a_b"
    assert keys[7:10] == ["test/f1/007_a_b", "test/f1/008_a_b", "test/f1/009_a_b"]
    for key in keys:
        assert len(key) <= validation.MAX_ENTITY_KEY_LENGTH
        assert key.count("/") == 2, key  # no hierarchy from a class name
        assert re.fullmatch(r"[A-Za-z0-9_.\- /]+", key), key
        validation._validate_metric_name(key)  # raises MlflowException if MLflow refuses
    assert len(keys[10]) == 250  # the 300-character name, cut to MLflow's limit


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_classification_metrics_agree_with_torchmetrics(seed):
    """The evaluate stage counts in numpy (no torch in its process); its numbers are
    torchmetrics' multiclass ones, absent classes and never-predicted ones included."""
    import torch
    from torchmetrics.functional.classification import (
        multiclass_accuracy,
        multiclass_confusion_matrix,
        multiclass_f1_score,
        multiclass_precision,
        multiclass_recall,
    )

    rng = np.random.default_rng(seed)
    k = 7
    y_true = rng.integers(0, k - 1, 300)  # class 6 never in the labels
    y_pred = np.where(rng.random(300) < 0.6, y_true, rng.integers(0, k, 300))
    y_pred[y_pred == 3] = 4  # class 3 never predicted
    if seed == 2:  # class 5 in neither: torchmetrics leaves it out of the macro F1
        y_true[y_true == 5], y_pred[y_pred == 5] = 0, 0
    got = classification_metrics(y_true, y_pred, [f"c{i}" for i in range(k)])
    t, p = torch.from_numpy(y_true), torch.from_numpy(y_pred)
    assert got["accuracy"] == pytest.approx(float(multiclass_accuracy(p, t, k, average="micro")))
    assert got["macro_f1"] == pytest.approx(float(multiclass_f1_score(p, t, k, average="macro")))
    assert got["confusion_matrix"] == multiclass_confusion_matrix(p, t, k).tolist()
    for name, fn in [
        ("precision", multiclass_precision),
        ("recall", multiclass_recall),
        ("f1", multiclass_f1_score),
    ]:
        want = fn(p, t, k, average=None).tolist()
        assert [got["per_class"][f"c{i}"][name] for i in range(k)] == pytest.approx(want, abs=1e-6)
    assert [got["per_class"][f"c{i}"]["support"] for i in range(k)] == np.bincount(
        y_true, minlength=k
    ).tolist()
