"""Large images are training data, not bombs: a user's 150-600 MP poster is prepared within
bounded memory (box-reduced before any conversion), limits are ours (data.max_image_pixels
for prepare, serve.max_image_pixels for the service), never Pillow's own guard."""

from __future__ import annotations

import io
import json
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from trainyard.core.config import DataParams
from trainyard.core.errors import InputError
from trainyard.core.imaging import image_to_pixels, read_header
from trainyard.data.sources import prepare_source as prepare

SIDE = 12288  # 151 MP RGBA: 604 MB decoded; the old float32 conversion needed over 2.4 GB more
DECODED = SIDE * SIDE * 4
# What image_to_pixels may add to the decoded image: strips, the reduced copy, numpy.
HEADROOM = 256 * 2**20


def chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))


def poster_png(side: int = SIDE) -> bytes:
    """A real side x side RGBA PNG, written row by row (cheap): transparent *red* around an
    opaque green square covering the middle half. Red must never show after compositing."""
    clear = np.zeros((side, 4), np.uint8)
    clear[:, 0] = 255
    band = clear.copy()
    band[side // 4 : 3 * side // 4] = (0, 200, 0, 255)
    rows = (b"\0" + clear.tobytes(), b"\0" + band.tobytes())
    z = zlib.compressobj(1)
    idat = [z.compress(rows[side // 4 <= y < 3 * side // 4]) for y in range(side)]
    idat.append(z.flush())
    ihdr = struct.pack(">IIBBBBB", side, side, 8, 6, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", b"".join(idat))
        + chunk(b"IEND", b"")
    )


@pytest.fixture(scope="module")
def poster(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("large") / "poster.png"
    path.write_bytes(poster_png())
    return path


MEASURE = r"""
import json, resource, sys
from trainyard.core.imaging import image_to_pixels
data = open(sys.argv[1], "rb").read()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
out = image_to_pixels(data, channels=3, height=64, width=64, resize=sys.argv[2],
                      max_pixels=10**9, limit_key="data.max_image_pixels")
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"base": base, "peak": peak, "out": out.tolist()}))
"""


@pytest.mark.parametrize("resize", ["crop", "pad"])
def test_a_150_mp_rgba_png_decodes_within_its_decoded_size_plus_headroom(poster, resize):
    # A fresh process: ru_maxrss is its own peak, nothing earlier in pytest counts.
    proc = subprocess.run(
        [sys.executable, "-c", MEASURE, str(poster), resize],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    got = json.loads(proc.stdout)
    grown = got["peak"] - got["base"]
    assert grown <= DECODED + HEADROOM, (
        f"image_to_pixels grew to {grown / 2**20:.0f} MiB for a {DECODED / 2**20:.0f} MiB "
        "decoded image: a full-size conversion is back"
    )
    out = np.asarray(got["out"], dtype=np.uint8)
    assert out.shape == (3, 64, 64)
    assert out[0].max() == 0  # transparent red composited as fill 0: no red bled in
    if resize == "crop":  # the middle half is green, the corners transparent
        assert (out[:, 24:40, 24:40].transpose(1, 2, 0) == (0, 200, 0)).all()
        assert (out[:, :8, :8] == 0).all()


def test_prepare_accepts_a_large_image_of_the_users_own(poster, tmp_path):
    root = tmp_path / "photos"
    for c, colour in enumerate([(200, 30, 30), (30, 30, 200)]):
        (root / f"class{c}").mkdir(parents=True)
        for i in range(5):
            Image.new("RGB", (80, 60), colour).save(root / f"class{c}" / f"{i}.png")
    (root / "class0" / "poster.png").symlink_to(poster)
    params = DataParams(
        source="folder",
        folder=str(root),
        image_size=32,
        val_fraction=0.2,
        test_fraction=0.2,
        workers=1,
        on_bad_file="error",
    )
    card = prepare("unused", tmp_path / "out", params, seed=0)
    assert card.skipped == ()
    assert sum(c["total"] for c in card.counts.values()) == 11
    images = np.concatenate([np.load(tmp_path / "out" / f"{s}_images.npy") for s in card.counts])
    # the poster's row: green centre, fill around it (and no red from its transparent pixels)
    green = [r for r in images if (r[:, 14:18, 14:18].transpose(1, 2, 0) == (0, 200, 0)).all()]
    assert len(green) == 1 and green[0][0].max() == 0


def test_the_limit_named_is_the_one_that_applies():
    data = io.BytesIO()
    Image.new("RGB", (40, 30), (9, 9, 9)).save(data, "PNG")
    with pytest.raises(InputError) as info:
        image_to_pixels(data.getvalue(), channels=3, height=8, width=8, max_pixels=1000)
    assert info.value.status == 413
    assert "(serve.max_image_pixels). Downscale it first" in str(info.value)
    with pytest.raises(InputError) as info:
        read_header(data.getvalue(), max_pixels=1000, limit_key="data.max_image_pixels")
    assert "(data.max_image_pixels)" in str(info.value) and "raise data.max_image_pixels" in str(
        info.value
    )


def png_claiming(width: int, height: int) -> bytes:
    """A real 4x4 PNG whose IHDR says ``width`` x ``height`` (CRC fixed)."""
    data = bytearray(poster_png(4))
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def test_pillows_own_bomb_guard_does_not_pre_empt_our_limit():
    # 900 MP: over Pillow's 2 x 89 MP guard, under a 1 GP data.max_image_pixels.
    claim = png_claiming(30000, 30000)
    header = read_header(claim, max_pixels=10**9, max_aspect_ratio=float("inf"))
    assert (header.width, header.height) == (30000, 30000)
    with pytest.raises(InputError) as info:  # our limit let it through: its data is short
        image_to_pixels(claim, channels=1, height=8, width=8, max_pixels=10**9)
    assert info.value.status == 400 and "truncated" in str(info.value)


# ----------------------------------------------------------------------------- the reduce


def encode(im: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def px(data: bytes, channels: int = 3, height: int = 32, width: int = 32, **kw) -> np.ndarray:
    return image_to_pixels(data, channels=channels, height=height, width=width, **kw)


@pytest.mark.parametrize("fill", [0, 255])
def test_reduced_alpha_is_premultiplied_so_transparent_colour_never_bleeds(fill):
    a = np.zeros((1000, 1000, 4), np.uint8)
    a[..., 0] = 255  # transparent red everywhere ...
    a[::2, ::2] = (0, 255, 0, 255)  # ... under a quarter-coverage opaque green lattice
    out = px(encode(Image.fromarray(a, "RGBA")), fill=fill)
    green = 255 / 4 + fill * 3 / 4
    assert np.abs(out[1].astype(float) - green).max() <= 2
    assert np.abs(out[0].astype(float) - fill * 3 / 4).max() <= 2  # red: only the fill's


def test_reduced_palette_and_la_transparency_composite_on_fill():
    p = Image.fromarray((np.indices((1000, 1000)).sum(0) % 2).astype(np.uint8), "P")
    p.putpalette([255, 0, 0, 0, 255, 0] + [0] * 762)  # index 0 (red) is transparent
    out = px(encode(p, transparency=0))
    assert out[0].max() <= 1 and np.abs(out[1].astype(int) - 128).max() <= 2
    la = np.zeros((1000, 1000, 2), np.uint8)
    la[..., 0] = 255  # transparent white rows between opaque grey ones
    la[::2, :] = (100, 255)
    out = px(encode(Image.fromarray(la, "LA")), channels=1)
    assert np.abs(out.astype(int) - 50).max() <= 1


def test_reduce_then_resize_matches_a_direct_resize():
    y, x = np.mgrid[0:900, 0:1200]
    rgb = np.stack([x * 255 // 1199, y * 255 // 899, (x + y) % 256], axis=2).astype(np.uint8)
    direct = np.asarray(Image.fromarray(rgb).resize((40, 30), Image.Resampling.BILINEAR))
    out = px(encode(Image.fromarray(rgb)), height=30, width=40, resize="stretch")
    assert np.abs(out.transpose(1, 2, 0).astype(int) - direct).mean() < 2.0


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_exif_rotation_of_a_large_image_turns_the_reduced_one(fmt):
    im = Image.new("RGB", (2000, 1000), (128, 128, 128))
    im.paste((255, 0, 0), (0, 0, 400, 400))  # stored top-left
    exif = Image.Exif()
    exif[0x0112] = 6  # shown turned 90 degrees clockwise: the red block at the top right
    out = px(encode(im, fmt, exif=exif), height=64, width=32, resize="stretch")
    assert out.shape == (3, 64, 32)
    assert out[0, :8, -8:].min() > 200 and out[1, :8, -8:].max() < 40
    assert np.abs(out[:, -8:, :8].astype(int) - 128).max() <= 3
