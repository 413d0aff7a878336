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
    ceiling_verdict,
    cell_drops,
    deletion_line,
    deletion_metrics,
    deletion_mlflow,
    deletion_note,
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


def region_model(
    tmp_path,
    map_region: tuple[slice, slice] | None,
    name: str = "model.onnx",
    used: np.ndarray | None = None,
    block: int = 1,
):
    """logit("marked") = 0.2 x the normalised upper-left quadrant's correlation with
    ``CHECKER`` (a detail detector; or sum(``used`` x the image), [8, 8] weights), "plain"
    its negative; ``cam`` [N, 2, 8, 8]: 0.2 x |pixel| over ``map_region``, 0 elsewhere, for
    "marked" (its negative for "plain"): over the upper-left, each pixel's weight in the
    logit times its size (the true map); elsewhere, a map that lies. ``block`` 4: a 2x2 map
    as coarse as a real net's, each cell its 4x4 pixels' mean |pixel| (``map_region`` then
    in cells). None: no ``cam`` output, as models were exported before."""
    nodes = [
        helper.make_node("Mul", ["image", "used"], ["contrib"]),
        helper.make_node("ReduceSum", ["contrib", "axes"], ["marked"], keepdims=0),
        helper.make_node("Unsqueeze", ["marked", "one"], ["marked_col"]),
        helper.make_node("Neg", ["marked_col"], ["plain_col"]),
        helper.make_node("Concat", ["plain_col", "marked_col"], ["logits"], axis=1),
        helper.make_node("Identity", ["logits"], ["embedding"]),
    ]
    weights = {
        "used": quadrant(UPPER_LEFT, 0.2) * CHECKER if used is None else used.reshape(1, 1, 8, 8),
        "axes": np.array([1, 2, 3], np.int64),
        "one": np.array([1], np.int64),
    }
    outputs = [
        helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 2]),
        helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["N", 2]),
    ]
    props = {METADATA_KEY: json.dumps(CARD.contract()), "classes": json.dumps(CARD.classes)}
    if map_region is not None:
        cells = 8 // block
        weights["shown"] = np.zeros((1, 1, cells, cells), np.float32)
        weights["shown"][(0, 0, *map_region)] = 0.2
        pool = [block, block]
        nodes += [
            helper.make_node("Abs", ["image"], ["magnitude"]),
            helper.make_node(
                "AveragePool", ["magnitude"], ["cells"], kernel_shape=pool, strides=pool
            ),
            helper.make_node("Mul", ["cells", "shown"], ["cam_marked"]),
            helper.make_node("Neg", ["cam_marked"], ["cam_plain"]),
            helper.make_node("Concat", ["cam_plain", "cam_marked"], ["cam"], axis=1),
        ]
        cam = helper.make_tensor_value_info("cam", TensorProto.FLOAT, ["N", 2, cells, cells])
        outputs.append(cam)
        props["explain"] = "cam"
    graph = helper.make_graph(
        nodes,
        "region",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 1, 8, 8])],
        outputs,
        initializer=[numpy_helper.from_array(np.asarray(v), k) for k, v in weights.items()],
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
        "test/occlusion_ceiling_ratio",
        "test/occlusion_ceiling_drop_top20",
        "test/occlusion_map_ratio",
    }
    # The ceiling, at the map's grid (here the image's): 65 runs an image, so 3200 // 65
    # of the 500 images (seeded); at 2x2 (5 runs) 128 (below).
    assert block["occlusion_samples"] == 49 and block["occlusion_grid"] == "8x8"
    wide = deletion_test(
        grid_model(tmp_path, CORNER_DETAIL, UPPER_LEFT_CELL, "2x2.onnx"), marked_images, CARD, 128
    )
    assert wide["ceiling"]["samples"] == 128 and wide["samples"] == 500
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


def grid_model(tmp_path, used: np.ndarray, shown: tuple[slice, slice], name: str):
    """``region_model`` with a 2x2 map: logit("marked") = sum(``used`` x the image)."""
    path = region_model(tmp_path, shown, name, used=used.astype(np.float32), block=4)
    return load_onnx(path, "cpu", say=False)


UPPER_LEFT_CELL, LOWER_RIGHT_CELL = (slice(0, 1), slice(0, 1)), (slice(1, 2), slice(1, 2))
CORNER_DETAIL = quadrant(UPPER_LEFT, 0.2)[0, 0] * CHECKER  # the logit reads one cell


def test_the_occlusion_ceiling_by_hand(tmp_path, marked_images):
    # Each cell's drop, by hand: the logit is linear, so blurring a cell changes it by the
    # weights times what the blur changed there; the softmax of (-l, l) is sigmoid(2l).
    model = grid_model(tmp_path, CORNER_DETAIL, UPPER_LEFT_CELL, "true.onnx")
    images = marked_images[:100]
    x = (images / 255 - 0.5) / 0.25
    fill = blurred(images, CARD)
    logit = (CORNER_DETAIL * x[:, 0]).sum((1, 2))
    blurred_corner = np.where(quadrant(UPPER_LEFT, 1)[0] > 0, fill, x)
    corner = (CORNER_DETAIL * blurred_corner[:, 0]).sum((1, 2))

    def sigmoid(z):
        return 1 / (1 + np.exp(-z))

    want = np.zeros((100, 2, 2))
    want[:, 0, 0] = sigmoid(2 * logit) - sigmoid(2 * corner)
    before = sigmoid(2 * logit).astype(np.float32)
    got = cell_drops(model, x.astype(np.float32), fill, np.ones(100, np.int64), before, (2, 2))
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert (got[:, 0, 0] > 0.05).all()  # the other three cells cost nothing

    # The map ranks the cells as their occlusion does: the ceiling's deletion is the map's
    # (same pixels, same tie-breaks), so the ceiling is the map's ratio, and >= it.
    result = deletion_test(model, images, CARD, batch_size=32)
    ceiling = result["ceiling"]
    assert ceiling["samples"] == 100 and ceiling["grid"] == "2x2"
    assert ceiling["drop_top"] == pytest.approx(result["drop_top"], abs=1e-6)
    assert ceiling["ratio"] >= ceiling["map_ratio"] == result["ratio"] >= PASS_RATIO
    assert ceiling["ratio"] == pytest.approx(result["ratio"], rel=1e-4)
    verdict = ceiling_verdict(deletion_metrics(result))
    assert verdict.startswith(f"the map reaches {result['ratio']:.2f}x of the ceiling's ")
    assert "2x2 cells" in deletion_note(result) and "occlusion ceiling" in deletion_line(result)


def test_the_ceiling_tells_a_poor_map_from_a_grid_no_map_can_pass(tmp_path, marked_images):
    images = marked_images[:100]
    true = deletion_test(
        grid_model(tmp_path, CORNER_DETAIL, UPPER_LEFT_CELL, "t.onnx"), images, CARD, 32
    )
    # A map that points at the wrong cell fails; the ceiling does not depend on the map.
    lying = grid_model(tmp_path, CORNER_DETAIL, LOWER_RIGHT_CELL, "lying.onnx")
    wrong = deletion_test(lying, images, CARD, batch_size=32)
    assert not wrong["passed"] and wrong["ceiling"]["ratio"] == true["ceiling"]["ratio"]
    verdict = ceiling_verdict(deletion_metrics(wrong))
    assert verdict.startswith("the map fails, and a better map could pass: ranking its 2x2")
    assert f"reaches {true['ceiling']['ratio']:.2f}x" in verdict
    # Evidence spread evenly over the image (detail in every cell): any 20% of it costs
    # about the same, so no ranking of the cells gets to 2x a random one (1.67x here).
    spread = np.where(np.add.outer(np.arange(8), np.arange(8)) % 2 == 0, 0.02, -0.02)
    even = (128 + 50 * CHECKER).astype(np.int64) + (images.astype(np.int64) - 128)
    even = np.clip(even, 0, 255).astype(np.uint8)
    flat = deletion_test(grid_model(tmp_path, spread, UPPER_LEFT_CELL, "s.onnx"), even, CARD, 32)
    block = deletion_metrics(flat)
    assert not flat["passed"] and block["occlusion_ceiling_ratio"] < PASS_RATIO
    assert ceiling_verdict(block) == (
        f"no map at this 2x2 grid can reach 2x on this data: the map reaches "
        f"{block['occlusion_map_ratio']:.2f}x of the ceiling's "
        f"{block['occlusion_ceiling_ratio']:.2f}x (ranking its 2x2 cells by their own "
        "occlusion drop, on the same 100 images)"
    )
    # metrics.json written before the ceiling: no verdict, no error.
    assert ceiling_verdict({k: v for k, v in block.items() if "occlusion" not in k}) is None
