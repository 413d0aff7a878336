"""The service's image -> model-input conversion and array validation, without a server."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from image_bytes import encode
from PIL import Image

from trainyard.core.card import METADATA_KEY, Card, card_from_metadata
from trainyard.core.errors import InputError, ModelError
from trainyard.runtime.inputs import decode_image, model_input, pixel_arrays, softmax

from conftest import make_card

CONTRACT = make_card(10, (1, 28, 28), 0.3, 0.35, source="test", resize="pad")
RGB = make_card(
    ("a", "b"), (3, 8, 6), (0.1, 0.2, 0.3), (0.5, 0.25, 0.2), source="test", resize="crop"
)


def decode1(data: bytes, card: Card, **kw) -> np.ndarray:
    """decode_image for a grayscale card: [1,H,W] -> [H,W]."""
    out = decode_image(data, card, **kw)
    assert out.shape == (1, card.height, card.width) and out.dtype == np.uint8
    return out[0]


@pytest.fixture(scope="module")
def garment() -> np.ndarray:
    """A light blob on black, like a Fashion-MNIST image."""
    yy, xx = np.mgrid[:28, :28]
    return np.clip(255 - 12 * np.hypot(yy - 14, xx - 12), 0, 255).astype(np.uint8)


def test_card_is_read_from_model_metadata():
    meta = {METADATA_KEY: json.dumps(RGB.contract())}
    assert card_from_metadata(meta) == Card.from_dict(RGB.contract())
    with pytest.raises(ModelError, match="no dataset_card"):
        card_from_metadata({"input_shape": "[-1, 1, 28, 28]"})
    broken = {**RGB.contract(), "std": [0.5, 0.0, 0.2]}
    with pytest.raises(ModelError, match="std must be positive"):
        card_from_metadata({METADATA_KEY: json.dumps(broken)})


def test_model_sized_grayscale_png_passes_through_exactly(garment):
    assert np.array_equal(decode1(encode(Image.fromarray(garment)), CONTRACT), garment)


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "P", "LA", "I;16"])
def test_every_png_mode_gives_the_same_pixels(garment, mode):
    if mode == "I;16":
        im = Image.fromarray(garment.astype(np.uint16) * 257)  # 16-bit grayscale
    else:
        im = Image.fromarray(garment).convert(mode)
    assert np.abs(decode1(encode(im), CONTRACT).astype(int) - garment).max() <= 1


def test_transparency_is_composited_on_black(garment):
    rgba = np.zeros((28, 28, 4), np.uint8)
    rgba[..., :3] = 255  # white everywhere; only the alpha channel draws the garment
    rgba[..., 3] = garment
    out = decode1(encode(Image.fromarray(rgba, "RGBA")), CONTRACT)
    assert np.abs(out.astype(int) - garment).max() <= 1


def test_invert_turns_a_dark_on_light_photo_into_the_dataset_look(garment):
    photo = Image.fromarray(255 - garment).resize((280, 280)).convert("RGB")
    plain = decode1(encode(photo, "JPEG", quality=95), CONTRACT)
    inverted = decode1(encode(photo, "JPEG", quality=95), CONTRACT, invert=True)
    assert plain.mean() > 128 > inverted.mean()  # background white vs black
    assert np.abs(inverted.astype(int) - garment).mean() < 8


def test_non_square_image_is_padded_not_stretched():
    tall = np.zeros((100, 50), np.uint8)
    tall[:, :] = 255  # a white 1:2 rectangle
    out = decode1(encode(Image.fromarray(tall)), CONTRACT)
    assert out[:, :5].max() < 30 and out[:, -5:].max() < 30  # black bars left and right
    assert out[:, 10:18].min() > 200


def test_one_pixel_image_is_valid():
    out = decode1(encode(Image.new("L", (1, 1), 200)), CONTRACT)
    assert out.shape == (28, 28) and np.all(out == 200)


def test_decompression_bomb_is_refused_before_decoding():
    bomb = encode(Image.new("1", (30_000, 30_000)))  # 900 MP that compresses to ~110 kB
    assert len(bomb) < 200_000
    start = time.perf_counter()
    with pytest.raises(InputError, match="image too large") as err:
        decode1(bomb, CONTRACT)
    assert err.value.status == 413 and time.perf_counter() - start < 1.0
    medium = encode(Image.new("1", (6000, 6000)))  # 36 MP: under Pillow's guard, over ours
    with pytest.raises(InputError, match=r"6000x6000 pixels.*25,000,000") as err:
        decode1(medium, CONTRACT, max_pixels=25_000_000)
    assert err.value.status == 413


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "the file is empty"),
        (b"just some text, not a picture", "not an image"),
        (b"GIF89a" + bytes(100), "(not an image|the GIF image is truncated or corrupt)"),
    ],
)
def test_unreadable_bytes_are_a_400_naming_the_field(data, message):
    with pytest.raises(InputError, match=f"image: {message}") as err:
        decode1(data, CONTRACT)
    assert err.value.status == 400 and err.value.field == "image"


def test_truncated_png_is_a_400(garment):
    noisy = np.random.default_rng(0).integers(0, 256, (200, 200), dtype=np.uint8)
    data = encode(Image.fromarray(noisy))
    with pytest.raises(InputError, match="truncated or corrupt") as err:
        decode1(data[: len(data) // 2], CONTRACT)
    assert err.value.status == 400


def test_normalize_matches_the_evaluate_stage(garment):
    x = model_input(garment[None, None], CONTRACT)
    expected = (garment.astype(np.float32) / 255.0 - 0.3) / 0.35
    assert x.shape == (1, 1, 28, 28) and x.dtype == np.float32
    assert np.array_equal(x[0, 0], expected)


def test_softmax_rows_sum_to_one():
    p = softmax(np.array([[1000.0, 0.0, -1000.0], [0.1, 0.2, 0.3]], np.float32))
    assert np.allclose(p.sum(axis=1), 1.0, atol=1e-6) and p[0].argmax() == 0


def test_pixel_arrays_accepts_ints_and_floats(garment):
    imgs = [garment.tolist(), (garment / 2).tolist()]
    out = pixel_arrays(imgs, CONTRACT, max_images=4)
    assert out.shape == (2, 1, 28, 28) and out.dtype == np.float32
    assert np.array_equal(out[0, 0], garment.astype(np.float32))


def test_colour_arrays_are_channel_first_planes():
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (3, 8, 6))
    out = pixel_arrays([img.tolist()], RGB, max_images=2)
    assert out.shape == (1, 3, 8, 6) and np.array_equal(out[0], img.astype(np.float32))
    x = model_input(out, RGB)
    expected = (img / 255.0 - np.array([0.1, 0.2, 0.3])[:, None, None]) / np.array(
        [0.5, 0.25, 0.2]
    )[:, None, None]
    assert np.allclose(x[0], expected, atol=1e-6)


@pytest.mark.parametrize(
    ("images", "field", "message"),
    [
        ([[[[0] * 6] * 8] * 2], "images[0]", "expected 3 channel planes of 8 rows of 6 numbers"),
        ([[[0] * 6] * 8], "images[0]", "expected 3 channel planes of 8 rows of 6 numbers, got 8"),
        ([[[[0] * 6] * 7] * 3], "images[0][0]", "expected 8 rows of 6 numbers, got 7 items"),
        ([[[[0] * 6] * 8] * 2 + [[[0] * 5] * 8]], "images[0][2][0]", "expected 6 numbers"),
    ],
)
def test_colour_arrays_with_the_wrong_shape_name_the_field(images, field, message):
    with pytest.raises(InputError) as err:
        pixel_arrays(images, RGB, max_images=2)
    assert err.value.field == field and message in str(err.value)


def image_with(value, row: int = 3, col: int = 7) -> list:
    img = [[0] * 28 for _ in range(28)]
    img[row][col] = value
    return img


@pytest.mark.parametrize(
    ("images", "field", "message", "status"),
    [
        ({"a": 1}, "images", "expected a list of 28x28 arrays, got an object", 400),
        ([], "images", "the list is empty", 400),
        ([image_with(0)] * 5, "images", "5 images, more than the limit of 4", 413),
        (["x"], "images[0]", "expected 28 rows of 28 numbers, got a string", 400),
        ([[[0] * 28] * 27], "images[0]", "expected 28 rows of 28 numbers, got 27 items", 400),
        ([[[0] * 28] * 27 + [[0] * 3]], "images[0][27]", "expected 28 numbers, got 3", 400),
        ([image_with(0), image_with(float("nan"))], "images[1][3][7]", "NaN and Infinity", 400),
        ([image_with(float("inf"))], "images[0][3][7]", "NaN and Infinity", 400),
        ([image_with(256)], "images[0][3][7]", "pixel value 256 is outside 0–255", 400),
        ([image_with(-0.5)], "images[0][3][7]", "pixel value -0.5 is outside 0–255", 400),
        ([image_with("12")], "images[0][3][7]", 'got a string "12"', 400),
        ([image_with(True)], "images[0][3][7]", "got true", 400),
        ([image_with(None)], "images[0][3][7]", "got null", 400),
        ([image_with([1])], "images[0][3][7]", "got a list", 400),
    ],
)
def test_bad_arrays_name_the_field_and_index(images, field, message, status):
    with pytest.raises(InputError) as err:
        pixel_arrays(images, CONTRACT, max_images=4)
    assert err.value.field == field and err.value.status == status
    assert str(err.value).startswith(f"{field}: ") and message in str(err.value)


def test_a_huge_bad_batch_costs_one_message():
    bad = [[["x"] * 28] * 28] * 4
    with pytest.raises(InputError) as err:
        pixel_arrays(bad, CONTRACT, max_images=4)
    assert len(str(err.value)) < 200
