"""runtime.explain: a class map becomes a 0..1 heatmap the image's size, a PNG of it alone
and pixels of it over the image, with numpy and Pillow only."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from trainyard.runtime.explain import (
    JET,
    colorize,
    explain_kind,
    heatmap,
    heatmap_png,
    overlay,
)


def test_heatmap_is_the_positive_part_scaled_to_one_at_the_images_size():
    cam = np.full((7, 7), -2.0, dtype=np.float32)
    cam[5, 1] = 3.0  # the one hot cell, bottom left
    cam[0, 6] = 1.5
    heat = heatmap(cam, (56, 40))
    assert heat.shape == (56, 40) and heat.dtype == np.float32
    assert heat.min() == 0.0 and heat.max() == pytest.approx(1.0, abs=0.02)
    row, col = np.unravel_index(heat.argmax(), heat.shape)
    assert 5 * 8 <= row < 6 * 8 and 40 // 7 * 1 <= col < 40 // 7 * 2 + 1
    # The second cell is half as hot; a negative region is 0 (it speaks against the class).
    assert heat[4, 38] == pytest.approx(0.5, abs=0.1) and heat[30, 20] == 0.0


@pytest.mark.parametrize("fill", [-1.0, 0.0, np.nan])
def test_a_map_with_nothing_positive_is_all_zero(fill):
    heat = heatmap(np.full((5, 5), fill, dtype=np.float32), (20, 30))
    assert heat.shape == (20, 30) and not heat.any()


def test_colorize_runs_from_dark_blue_to_dark_red():
    rgb = colorize(np.array([[0.0, 0.5, 1.0]]))
    assert rgb.dtype == np.uint8 and rgb.shape == (1, 3, 3)
    assert rgb[0, 0].tolist() == JET[0].tolist() and rgb[0, 2].tolist() == JET[-1].tolist()
    assert rgb[0, 1, 1] > 200  # the middle is green-ish (between cyan and yellow)


@pytest.mark.parametrize("layout", ["hw", "chw", "hwc", "pil"])
def test_overlay_is_rgb_the_uploads_size(layout):
    grey = np.random.default_rng(0).integers(0, 256, (30, 20), dtype=np.uint8)
    image = {
        "hw": grey,
        "chw": grey[None],
        "hwc": np.stack([grey] * 3, -1),
        "pil": Image.fromarray(grey),
    }[layout]
    heat = np.zeros((30, 20), np.float32)
    heat[:10] = 1.0
    pixels = overlay(image, heat)
    assert pixels.dtype == np.uint8 and pixels.shape == (30, 20, 3)
    # Where the map is 0 the image shows as it was; where it is 1, 45% of the colour.
    assert (pixels[10:] == grey[10:, :, None]).all()
    want = np.rint(grey[:10, :, None] * 0.55 + JET[-1] * 0.45)
    assert np.abs(pixels[:10].astype(float) - want).max() <= 1


def test_overlay_refuses_a_map_of_another_size():
    with pytest.raises(ValueError, match="not the image's size"):
        overlay(np.zeros((10, 10), np.uint8), np.zeros((5, 5), np.float32))


def test_heatmap_png_is_rgba_with_the_map_as_opacity():
    heat = np.linspace(0, 1, 12, dtype=np.float32).reshape(3, 4)
    png = Image.open(io.BytesIO(heatmap_png(heat)))
    # Indexed, each level's colour and opacity in the palette: RGBA to a browser.
    assert png.mode == "P" and "transparency" in png.info and png.size == (4, 3)
    rgba = np.asarray(png.convert("RGBA"))
    assert np.array_equal(rgba[..., :3], colorize(np.rint(heat * 255) / 255))
    alpha = rgba[..., 3]
    assert alpha[0, 0] == 0 and alpha[-1, -1] == 255 and (np.diff(alpha.ravel()) > 0).all()


def test_explain_kind_reads_the_metadata():
    assert explain_kind({"explain": "cam"}) == "cam"
    assert explain_kind({"explain": "gradcam"}) == "gradcam"
    assert explain_kind({"explain": "hirescam"}) == "hirescam"
    assert explain_kind({}) is None and explain_kind({"explain": "shap"}) is None
