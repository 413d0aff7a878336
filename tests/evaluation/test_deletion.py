"""The deletion test and the mistakes' heatmaps, on hand-made ONNX models whose answer
depends on one known region of the image: a map that points at that region passes, one
that points elsewhere fails, and a model without maps is evaluated as before."""

from __future__ import annotations

import json

import numpy as np
import pytest
from matplotlib.figure import Figure
from onnx import TensorProto, helper, numpy_helper

from trainyard.core.card import METADATA_KEY
from trainyard.evaluation.deletion import (
    PASS_RATIO,
    blurred,
    deletion_line,
    deletion_metrics,
    deletion_mlflow,
    deletion_test,
)
from trainyard.evaluation.pictures import draw_mistakes, mistakes_png, worst_mistakes
from trainyard.evaluation.scoring import evaluate_onnx
from trainyard.runtime.explain import overlay
from trainyard.runtime.sessions import load_onnx

from conftest import make_card, save_onnx

CARD = make_card(("plain", "marked"), (1, 8, 8), mean=0.5, std=0.25)
UPPER_LEFT, LOWER_RIGHT = (slice(0, 4), slice(0, 4)), (slice(4, 8), slice(4, 8))


def quadrant(where: tuple[slice, slice], value: float) -> np.ndarray:
    mask = np.zeros((1, 1, 8, 8), np.float32)
    mask[(0, 0, *where)] = value
    return mask


# A one-pixel checkerboard (+1/-1): the detail the "marked" logit reads, which a blur (the
# deleted pixels' fill) takes away.
CHECKER = np.where(np.add.outer(np.arange(8), np.arange(8)) % 2 == 0, 1.0, -1.0).astype(np.float32)


def region_model(tmp_path, map_region: tuple[slice, slice] | None, name: str = "model.onnx"):
    """logit("marked") = 0.2 x the normalised upper-left quadrant's correlation with
    ``CHECKER`` (a detail detector), "plain" its negative; ``cam`` [N, 2, 8, 8]: 0.2 x
    |pixel| over ``map_region``, 0 elsewhere, for "marked" (its negative for "plain"): over
    the upper-left, each pixel's weight in the logit times its size (the true map);
    elsewhere, a map that lies. None: no ``cam`` output, as models were exported before."""
    nodes = [
        helper.make_node("Mul", ["image", "used"], ["contrib"]),
        helper.make_node("ReduceSum", ["contrib", "axes"], ["marked"], keepdims=0),
        helper.make_node("Unsqueeze", ["marked", "one"], ["marked_col"]),
        helper.make_node("Neg", ["marked_col"], ["plain_col"]),
        helper.make_node("Concat", ["plain_col", "marked_col"], ["logits"], axis=1),
        helper.make_node("Identity", ["logits"], ["embedding"]),
    ]
    weights = {
        "used": quadrant(UPPER_LEFT, 0.2) * CHECKER,
        "axes": np.array([1, 2, 3], np.int64),
        "one": np.array([1], np.int64),
    }
    outputs = [
        helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 2]),
        helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["N", 2]),
    ]
    props = {METADATA_KEY: json.dumps(CARD.contract()), "classes": json.dumps(CARD.classes)}
    if map_region is not None:
        weights["shown"] = quadrant(map_region, 0.2)
        nodes += [
            helper.make_node("Abs", ["image"], ["magnitude"]),
            helper.make_node("Mul", ["magnitude", "shown"], ["cam_marked"]),
            helper.make_node("Neg", ["cam_marked"], ["cam_plain"]),
            helper.make_node("Concat", ["cam_plain", "cam_marked"], ["cam"], axis=1),
        ]
        outputs.append(helper.make_tensor_value_info("cam", TensorProto.FLOAT, ["N", 2, 8, 8]))
        props["explain"] = "cam"
    graph = helper.make_graph(
        nodes,
        "region",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 1, 8, 8])],
        outputs,
        initializer=[numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    return save_onnx(graph, tmp_path / name, props)


@pytest.fixture(scope="module")
def marked_images():
    """Grey noise with a fine checkerboard over the upper-left quadrant: every image is
    "marked", confidently."""
    rng = np.random.default_rng(0)
    images = rng.integers(118, 139, (600, 1, 8, 8)).astype(np.int64)
    images[:, :, :4, :4] += (50 * CHECKER[:4, :4]).astype(np.int64)
    return images.astype(np.uint8)


def test_a_map_that_points_at_what_the_model_uses_passes(tmp_path, marked_images):
    model = load_onnx(region_model(tmp_path, UPPER_LEFT), "cpu", say=False)
    result = deletion_test(model, marked_images, CARD, batch_size=128)
    assert result["samples"] == 500 and result["maps"] == "cam" and result["passed"]
    # 12 of the 64 pixels are blurred: all 12 inside the used quadrant, against 3 of them
    # at random (the map is the image's size: a random map ranks single pixels); at least
    # 12 / 3 times the drop (more: the softmax is saturated where the logit is large).
    assert result["drop_top"] > 0.05 and result["ratio"] >= 2 * PASS_RATIO
    assert result["drop_top"] > result["drop_random"] > 0
    block = deletion_metrics(result)
    assert block["passed"] and block["deletion_ratio"] == result["ratio"]
    assert set(deletion_mlflow({"explain": result})) == {
        "test/deletion_drop_top20",
        "test/deletion_drop_random20",
        "test/deletion_ratio",
    }
    assert "passed" in deletion_line(result)


def test_the_batch_size_does_not_change_the_figures(tmp_path, marked_images):
    # evaluate.batch_size is a throughput knob: each image's random maps and tie-breaks
    # come from its own seeded generator, so the drops are the same in any batching (drawn
    # from one stream, a 75-image folder's ratio moved 1.95x-2.08x with it).
    model = load_onnx(region_model(tmp_path, UPPER_LEFT), "cpu", say=False)
    whole = deletion_test(model, marked_images[:60], CARD, batch_size=60)
    pieces = deletion_test(model, marked_images[:60], CARD, batch_size=7)
    assert whole == pieces and whole["drop_random"] > 0


def test_the_fill_is_the_image_blurred_grey_or_colour():
    grey = make_card(("a", "b"), (1, 28, 28), mean=0.5, std=0.25)
    flat = np.full((2, 1, 28, 28), 200, np.uint8)
    np.testing.assert_allclose(blurred(flat, grey), (200 / 255 - 0.5) / 0.25, atol=1e-6)
    checker = (128 + 60 * np.resize(CHECKER, (28, 28))).astype(np.uint8)[None, None]
    soft = blurred(checker, grey) * 0.25 + 0.5  # back to 0..1: sigma 2 px wipes 1-px detail
    assert np.ptp(soft[0, 0, 8:20, 8:20]) < 0.02 < np.ptp(checker / 255)
    rgb = make_card(("a", "b"), (3, 16, 16), mean=0.5, std=0.25)
    colour = np.zeros((1, 3, 16, 16), np.uint8)
    colour[:, 0] = 255  # red stays red: the channels are blurred apart
    out = blurred(colour, rgb) * 0.25 + 0.5
    assert out.shape == (1, 3, 16, 16)
    np.testing.assert_allclose(out[0, :, 8, 8], [1.0, 0.0, 0.0], atol=1e-6)


def test_a_map_that_points_elsewhere_fails_and_says_so(tmp_path, marked_images):
    model = load_onnx(region_model(tmp_path, LOWER_RIGHT), "cpu", say=False)
    result = deletion_test(model, marked_images[:100], CARD, batch_size=64)
    assert result["samples"] == 100 and not result["passed"]
    # The deleted pixels are ones the logit never reads: no drop at all.
    assert result["drop_top"] == pytest.approx(0, abs=1e-6) and result["drop_random"] > 0
    assert result["ratio"] == pytest.approx(0, abs=1e-3)
    assert "FAILED" in deletion_line(result) and "do not show" in deletion_line(result)


def test_evaluate_reports_the_test_and_heatmaps_and_an_old_model_has_neither(
    tmp_path, marked_images
):
    labels = np.ones(len(marked_images), np.int64)
    labels[:30] = 0  # 30 wrong answers: the mistakes picture has 25 to show
    new = evaluate_onnx(region_model(tmp_path, UPPER_LEFT), marked_images, labels, 256, "cpu")
    assert new["metrics"]["explain"]["passed"]
    heatmaps = new["heatmaps"]
    shown = worst_mistakes(labels, new["predictions"], new["confidence"])
    assert len(shown) == 25 and sorted(heatmaps) == sorted(shown.tolist())
    heat = heatmaps[0]
    assert heat.shape == (8, 8) and heat.max() == pytest.approx(1.0)
    assert heat[4:, :].max() == 0 and heat[:4, :4].min() > 0  # the upper-left quadrant
    old = evaluate_onnx(region_model(tmp_path, None, "old.onnx"), marked_images, labels, 256)
    assert "explain" not in old["metrics"] and old["heatmaps"] == {}
    assert deletion_mlflow(old["metrics"]) == {}
    np.testing.assert_array_equal(old["predictions"], new["predictions"])

    # The mistakes picture shows each image with its heatmap over it, as the service draws.
    args = (marked_images, labels, new["predictions"], new["confidence"], CARD.classes)
    cells = draw_mistakes(Figure(), *args, heatmaps=heatmaps)
    for ax, index in zip(cells, shown.tolist(), strict=True):
        want = overlay(marked_images[index], heatmaps[index])
        np.testing.assert_array_equal(ax.images[0].get_array(), want)
    assert mistakes_png(*args, heatmaps=heatmaps).startswith(b"\x89PNG")
