"""trainyard.core.imaging: the one image -> pixels conversion (prepare and the service share it)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from image_bytes import encode, png_claiming
from PIL import Image

from trainyard.core.errors import InputError
from trainyard.core.image_formats import IMAGE_EXTENSIONS, IMAGE_FORMATS
from trainyard.core.imaging import (
    DEFAULT_MAX_IMAGE_PIXELS,
    image_to_pixels,
    read_header,
)

RED, GREEN, BLUE = (255, 0, 0), (0, 255, 0), (0, 0, 255)


def gradient(width: int, height: int) -> np.ndarray:
    """A smooth RGB [H, W, 3] image: lossy codecs keep it close to the original."""
    y, x = np.mgrid[0:height, 0:width]
    r = x * 255 // max(1, width - 1)
    g = y * 255 // max(1, height - 1)
    b = np.full_like(r, 96)
    return np.stack([r, g, b], axis=2).astype(np.uint8)


def px(data: bytes, channels: int = 3, height: int = 32, width: int = 32, **kw) -> np.ndarray:
    return image_to_pixels(data, channels=channels, height=height, width=width, **kw)


def luma(rgb: np.ndarray) -> np.ndarray:
    """What Pillow's RGB -> L gives (ITU-R 601-2)."""
    return np.asarray(Image.fromarray(rgb, "RGB").convert("L"))


# ----------------------------------------------------------------------------- formats

# extension -> (Pillow format to write it with, save options, max mean abs error vs source)
EXTENSIONS = {
    ".png": ("PNG", {}, 0.0),
    ".jpg": ("JPEG", {"quality": 95}, 4.0),
    ".jpeg": ("JPEG", {"quality": 95}, 4.0),
    ".jfif": ("JPEG", {"quality": 95}, 4.0),
    ".mpo": ("MPO", {"quality": 95}, 4.0),
    ".bmp": ("BMP", {}, 0.0),
    ".gif": ("GIF", {}, 12.0),  # quantised to a 256-colour palette
    ".webp": ("WEBP", {"lossless": True}, 0.0),
    ".tif": ("TIFF", {}, 0.0),
    ".tiff": ("TIFF", {"compression": "tiff_lzw"}, 0.0),
    # phone formats: HEIC is the iPhone's default (pillow-heif), AVIF is Pillow's own
    ".heic": ("HEIF", {"quality": 95}, 6.0),
    ".heif": ("HEIF", {"quality": 95}, 6.0),
    ".hif": ("HEIF", {"quality": 95}, 6.0),
    ".avif": ("AVIF", {"quality": 95}, 6.0),
}


def test_every_claimed_extension_is_covered_here():
    # A newly claimed extension must get a decoding test below.
    assert set(EXTENSIONS) == set(IMAGE_EXTENSIONS)
    assert {fmt for fmt, _, _ in EXTENSIONS.values()} - {"MPO"} == set(IMAGE_FORMATS)


@pytest.mark.parametrize("ext", sorted(EXTENSIONS))
@pytest.mark.parametrize("channels", [1, 3])
def test_every_format_decodes_to_chw_uint8(ext, channels):
    fmt, options, tolerance = EXTENSIONS[ext]
    src = gradient(40, 24)  # W 40, H 24: not square, so a transposed result would show
    data = encode(Image.fromarray(src, "RGB"), fmt, **options)
    out = px(data, channels=channels, height=24, width=40)
    assert out.dtype == np.uint8
    assert out.shape == (channels, 24, 40)
    assert out.flags.c_contiguous
    want = src.transpose(2, 0, 1) if channels == 3 else luma(src)[None]
    err = np.abs(out.astype(np.int16) - want.astype(np.int16)).mean()
    assert err <= tolerance, f"{ext}: mean abs error {err:.2f} > {tolerance}"
    # and resized to another size, still [C, H, W]
    assert px(data, channels=channels, height=16, width=8).shape == (channels, 16, 8)


@pytest.mark.parametrize("ext", sorted(EXTENSIONS))
def test_read_header_reads_every_format_without_decoding(ext):
    fmt, options, _ = EXTENSIONS[ext]
    data = encode(Image.fromarray(gradient(40, 24), "RGB"), fmt, **options)
    header = read_header(data)
    assert (header.width, header.height) == (40, 24)
    assert header.format == ("JPEG" if fmt == "MPO" else fmt)


# ----------------------------------------------------------------------------- EXIF


def marked_jpeg(orientation: int | None) -> bytes:
    """60x30 (W x H) grey JPEG with a red block in its stored top-left corner."""
    im = Image.new("RGB", (60, 30), (128, 128, 128))
    im.paste(RED, (0, 0, 12, 12))
    if orientation is None:
        return encode(im, "JPEG", quality=95)
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(im, "JPEG", quality=95, exif=exif)


def is_red(block: np.ndarray) -> bool:
    r, g, b = (float(block[c].mean()) for c in range(3))
    return r > 200 and g < 60 and b < 60


@pytest.mark.parametrize(
    ("orientation", "corner"),
    [
        (None, "top_left"),
        (1, "top_left"),
        (6, "top_right"),  # stored image is shown rotated 90 degrees clockwise
        (8, "bottom_left"),  # ... 90 degrees counter-clockwise
        (3, "bottom_right"),  # ... 180 degrees
    ],
)
def test_exif_orientation_is_applied(orientation, corner):
    data = marked_jpeg(orientation)
    turned = orientation in (6, 8)
    h, w = (60, 30) if turned else (30, 60)
    out = px(data, height=h, width=w)  # the displayed size: no resampling
    assert out.shape == (3, h, w)
    blocks = {
        "top_left": out[:, 1:10, 1:10],
        "top_right": out[:, 1:10, -10:-1],
        "bottom_left": out[:, -10:-1, 1:10],
        "bottom_right": out[:, -10:-1, -10:-1],
    }
    for name, block in blocks.items():
        assert is_red(block) == (name == corner), f"{name} with orientation {orientation}"


@pytest.mark.parametrize("orientation", [6, 8])
def test_exif_rotation_changes_the_aspect_seen_by_pad(orientation):
    # Shown as a 30x60 portrait: padding to a square adds bands left and right, not
    # above and below as the stored 60x30 landscape would.
    out = px(marked_jpeg(orientation), height=32, width=32, resize="pad", fill=0)
    assert out[:, :, :6].max() <= 10  # left band (fill)
    assert out[:, :, -6:].max() <= 10  # right band
    # top and bottom rows are image (grey or the red marker: red >= 100), not bands
    assert out[0, :6, 10:22].min() >= 100
    assert out[0, -6:, 10:22].min() >= 100


# ----------------------------------------------------------------------------- resize


def three_bands(width: int = 64, height: int = 32) -> bytes:
    """Red left quarter, green middle half, blue right quarter (lossless PNG)."""
    a = np.zeros((height, width, 3), np.uint8)
    q = width // 4
    a[:, :q] = RED
    a[:, q : width - q] = GREEN
    a[:, width - q :] = BLUE
    return encode(Image.fromarray(a, "RGB"), "PNG")


def test_crop_keeps_the_centre_and_fills_the_target():
    out = px(three_bands(64, 32), resize="crop")  # scale 1: the middle 32 columns, exactly
    assert out.shape == (3, 32, 32)
    assert (out.transpose(1, 2, 0) == GREEN).all()
    # downscaled first (128x64 -> 64x32), then the centre: green away from the edges
    out = px(three_bands(128, 64), resize="crop", fill=77)
    assert (out[:, :, 1:-1].transpose(1, 2, 0) == GREEN).all()
    assert not (out == 77).all(axis=0).any()  # no fill anywhere


@pytest.mark.parametrize("fill", [0, 255])
def test_pad_keeps_everything_and_pads_with_fill(fill):
    out = px(three_bands(64, 32), resize="pad", fill=fill)
    assert out.shape == (3, 32, 32)
    # 64x32 -> padded to 64x64 (16 rows above and below) -> 32x32: bands of 8 rows
    assert (out[:, :7] == fill).all()
    assert (out[:, -7:] == fill).all()
    middle = out[:, 9:23]
    assert not (middle == fill).all(axis=0).any()  # the image, no fill inside
    # every part of the image survives: red on the left, green centre, blue on the right
    assert (middle[:, :, :6].transpose(1, 2, 0) == RED).all()
    assert (middle[:, :, 10:22].transpose(1, 2, 0) == GREEN).all()
    assert (middle[:, :, -6:].transpose(1, 2, 0) == BLUE).all()


def test_pad_portrait_bands_left_and_right():
    data = encode(Image.new("RGB", (20, 40), GREEN), "PNG")
    out = px(data, resize="pad", fill=0)
    assert (out[:, :, :7] == 0).all() and (out[:, :, -7:] == 0).all()
    assert (out[:, :, 9:23].transpose(1, 2, 0) == GREEN).all()


def test_stretch_fills_the_target_and_keeps_both_ends():
    out = px(three_bands(64, 32), resize="stretch", fill=200)
    assert out.shape == (3, 32, 32)
    assert (out[:, :, :6].transpose(1, 2, 0) == RED).all()  # every row, top to bottom
    assert (out[:, :, 10:22].transpose(1, 2, 0) == GREEN).all()
    assert (out[:, :, -6:].transpose(1, 2, 0) == BLUE).all()
    assert not (out == 200).all(axis=0).any()


@pytest.mark.parametrize("resize", ["crop", "pad", "stretch"])
@pytest.mark.parametrize("interpolation", ["bilinear", "lanczos"])
def test_target_size_passes_through_bit_exactly(resize, interpolation):
    rng = np.random.default_rng(1)
    noise = rng.integers(0, 256, (24, 40, 3), dtype=np.uint8)  # any resampling would show
    data = encode(Image.fromarray(noise, "RGB"), "PNG")
    out = px(data, height=24, width=40, resize=resize, interpolation=interpolation)
    np.testing.assert_array_equal(out, noise.transpose(2, 0, 1))
    gray = rng.integers(0, 256, (28, 28), dtype=np.uint8)
    out = px(encode(Image.fromarray(gray, "L"), "PNG"), 1, 28, 28, resize=resize)
    np.testing.assert_array_equal(out[0], gray)


def test_unknown_resize_policy_is_a_value_error():
    with pytest.raises(ValueError, match="resize policy"):
        px(three_bands(), resize="zoom")


def test_channels_other_than_1_or_3_are_refused():
    with pytest.raises(ValueError, match="channels"):
        px(three_bands(), channels=4)


# ----------------------------------------------------------------------------- channels


def test_grayscale_to_3_channels_replicates_the_plane():
    gray = np.random.default_rng(2).integers(0, 256, (24, 24), dtype=np.uint8)
    out = px(encode(Image.fromarray(gray, "L"), "PNG"), 3, 24, 24)
    for c in range(3):
        np.testing.assert_array_equal(out[c], gray)


def test_rgb_to_1_channel_is_luma():
    for colour, want in ((RED, 76), (GREEN, 150), (BLUE, 29), ((255, 255, 255), 255)):
        out = px(encode(Image.new("RGB", (8, 8), colour), "PNG"), 1, 8, 8)
        assert (out == want).all(), colour
    rgb = np.random.default_rng(3).integers(0, 256, (16, 16, 3), dtype=np.uint8)
    out = px(encode(Image.fromarray(rgb, "RGB"), "PNG"), 1, 16, 16)
    np.testing.assert_array_equal(out[0], luma(rgb))


@pytest.mark.parametrize("fill", [0, 255])
@pytest.mark.parametrize("channels", [1, 3])
def test_rgba_composites_on_fill(fill, channels):
    colour = np.array([200, 100, 50])
    a = np.zeros((3, 4, 4), np.uint8)
    a[..., :3] = colour
    a[0, :, 3] = 0  # fully transparent row
    a[1, :, 3] = 255  # opaque row
    a[2, :, 3] = 128  # half
    out = px(encode(Image.fromarray(a, "RGBA"), "PNG"), channels, 3, 4, fill=fill)
    half = np.rint(colour * 128 / 255 + fill * 127 / 255).astype(np.uint8)
    rows = np.stack([np.full(3, fill, np.uint8), colour.astype(np.uint8), half])[:, None]
    want = rows.transpose(2, 0, 1) if channels == 3 else luma(rows)[None]
    np.testing.assert_array_equal(out, np.broadcast_to(want, (channels, 3, 4)))
    assert (out[:, 0] == fill).all()


@pytest.mark.parametrize("fill", [0, 255])
def test_la_composites_on_fill(fill):
    a = np.zeros((4, 4, 2), np.uint8)
    a[..., 0] = 180
    a[:2, :, 1] = 0  # transparent
    a[2:, :, 1] = 255
    out = px(encode(Image.fromarray(a, "LA"), "PNG"), 1, 4, 4, fill=fill)
    assert (out[0, :2] == fill).all()
    assert (out[0, 2:] == 180).all()
    out3 = px(encode(Image.fromarray(a, "LA"), "PNG"), 3, 4, 4, fill=fill)
    assert (out3[:, :2] == fill).all() and (out3[:, 2:] == 180).all()


@pytest.mark.parametrize("fmt", ["PNG", "GIF"])
@pytest.mark.parametrize("fill", [0, 255])
def test_palette_transparency_composites_on_fill(fmt, fill):
    p = Image.new("P", (6, 6), 0)
    p.putpalette([10, 20, 30, *GREEN] + [0] * (256 * 3 - 6))
    for x in range(6):
        for y in range(3, 6):
            p.putpixel((x, y), 1)
    data = encode(p, fmt, transparency=0)
    out = px(data, 3, 6, 6, fill=fill)
    assert (out[:, :3] == fill).all()  # index 0 is transparent: fill, not (10, 20, 30)
    assert (out[:, 3:].transpose(1, 2, 0) == GREEN).all()


def test_16_bit_grayscale_png_maps_to_8_bit():
    levels = np.arange(256, dtype=np.uint16) * 257  # k * 257 is 8-bit level k
    im = Image.fromarray(levels.reshape(16, 16))
    assert im.mode == "I;16"
    data = encode(im, "PNG")
    assert read_header(data).mode == "I;16"
    out = px(data, 1, 16, 16)
    np.testing.assert_array_equal(out[0].ravel(), np.arange(256))
    out3 = px(data, 3, 16, 16)
    assert (out3 == out).all()  # [1,H,W] broadcasts against all three planes
    # 65535 is white, 0 is black, whatever lies between rounds to the nearest level
    mixed = np.array([[0, 65535, 128, 32896]], dtype=np.uint16)
    out = px(encode(Image.fromarray(mixed), "PNG"), 1, 1, 4)
    np.testing.assert_array_equal(out[0, 0], [0, 255, 0, 128])


def gray_palette_png() -> bytes:
    g = Image.fromarray(np.arange(64, dtype=np.uint8).reshape(8, 8) * 4, "L").convert("P")
    return encode(g, "PNG")


def colour_palette_png() -> bytes:
    p = Image.new("P", (8, 8), 0)
    p.putpalette([*RED, *GREEN] + [0] * (256 * 3 - 6))
    return encode(p, "PNG")


@pytest.mark.parametrize(
    ("make", "mode", "grayscale"),
    [
        (lambda: encode(Image.new("L", (8, 8), 9), "PNG"), "L", True),
        (lambda: encode(Image.new("LA", (8, 8), (9, 99)), "PNG"), "LA", True),
        (lambda: encode(Image.fromarray(np.full((8, 8), 999, np.uint16)), "PNG"), "I;16", True),
        (lambda: encode(Image.new("L", (8, 8), 9), "JPEG"), "L", True),
        (gray_palette_png, "P", True),
        (lambda: encode(Image.new("RGB", (8, 8), (9, 9, 9)), "PNG"), "RGB", False),
        (lambda: encode(Image.new("RGBA", (8, 8), (9, 99, 9, 9)), "PNG"), "RGBA", False),
        (colour_palette_png, "P", False),
    ],
)
def test_read_header_grayscale(make, mode, grayscale):
    header = read_header(make())
    assert header.mode == mode
    assert header.grayscale is grayscale
    assert (header.width, header.height) == (8, 8)


# ----------------------------------------------------------------------------- bombs


@pytest.mark.parametrize("size", [30000, 6000])  # Pillow's own guard fires / only ours does
def test_decompression_bomb_is_refused_before_decoding(size):
    bomb = png_claiming(size, size)
    if size == 6000:  # the patched header is a valid one
        assert Image.open(io.BytesIO(bomb)).size == (6000, 6000)
    for call in (lambda: px(bomb), lambda: read_header(bomb)):
        with pytest.raises(InputError) as info:
            call()
        err = info.value
        # 413, not a 400 "truncated": refused from the header, before decoding the 4x4 IDAT
        assert err.status == 413
        assert f"{DEFAULT_MAX_IMAGE_PIXELS:,}" in str(err)
        assert "too large" in str(err)
    if size == 6000:
        assert "6000x6000" in str(err)


def test_max_pixels_below_a_real_image_is_413():
    data = encode(Image.fromarray(gradient(40, 30), "RGB"), "PNG")
    assert px(data, max_pixels=1200).shape == (3, 32, 32)  # exactly at the limit: fine
    with pytest.raises(InputError, match=r"40x30 pixels.*limit is 1,199 pixels") as info:
        px(data, max_pixels=1199)
    assert info.value.status == 413
    assert info.value.field == "image"
    with pytest.raises(InputError) as info:
        read_header(data, max_pixels=100, field="upload")
    assert info.value.status == 413 and info.value.field == "upload"


# ----------------------------------------------------------------------------- bad bytes


def truncated(data: bytes) -> bytes:
    return data[: len(data) // 2]


def noise(fmt: str) -> bytes:
    """A 96x64 noise image: its pixel data, not its header, is most of the file."""
    rgb = np.random.default_rng(4).integers(0, 256, (64, 96, 3), dtype=np.uint8)
    return encode(Image.fromarray(rgb, "RGB"), fmt)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: b"", r"empty \(0 bytes\)"),
        (lambda: b"this is plain text, not a picture\n" * 4, "not an image"),
        (lambda: b"\x89PNG\r\n\x1a\n", "not an image"),  # a signature and nothing else
        (
            lambda: truncated(noise("PNG")),
            "PNG image is truncated or corrupt",
        ),
        (
            lambda: truncated(noise("JPEG")),
            "JPEG image is truncated or corrupt",
        ),
        (
            lambda: truncated(noise("GIF")),
            "GIF image is truncated or corrupt",
        ),
    ],
)
def test_unreadable_bytes_are_input_error_400(make, message):
    with pytest.raises(InputError, match=message) as info:
        px(make(), field="images[2]")
    assert info.value.status == 400
    assert info.value.field == "images[2]"
    assert str(info.value).startswith("images[2]: ")
