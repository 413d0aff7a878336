"""Phone formats: HEIC/HEIF (the iPhone's default, via pillow-heif) and AVIF (Pillow's own)
are images to prepare and to the service, through the one image_to_pixels."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, features
from test_serve_unit import CARD, client_for, write_tiny_model

from trainyard.core.config import DataParams
from trainyard.core.errors import DataError
from trainyard.core.imaging import IMAGE_EXTENSIONS, IMAGE_FORMATS, image_to_pixels, read_header
from trainyard.data.sources import prepare_source as prepare
from trainyard.runtime.inputs import decode_image, normalize, softmax
from trainyard.serve.openapi import IMAGE_TYPES

PHONE = {".heic": "HEIF", ".heif": "HEIF", ".hif": "HEIF", ".avif": "AVIF"}


def encode(im: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def scene(width: int, height: int, shift: int = 0) -> np.ndarray:
    """A smooth RGB picture (lossy phone codecs keep it close): gradients and a block."""
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack(
        [x * 255 // (width - 1), y * 255 // (height - 1), np.full_like(x, 60 + shift)], axis=2
    ).astype(np.uint8)
    rgb[height // 4 : height // 2, width // 4 : width // 2] = (240, 240, 30)
    return rgb


def test_phone_formats_are_claimed_and_pillow_decodes_avif_natively():
    assert features.check("avif"), "Pillow >= 11.3 with AVIF (pyproject's floor)"
    assert {"HEIF", "AVIF"} <= set(IMAGE_FORMATS)
    assert set(PHONE) <= IMAGE_EXTENSIONS
    assert {"image/heic", "image/heif", "image/avif"} <= set(IMAGE_TYPES)


@pytest.mark.parametrize("fmt", ["HEIF", "AVIF"])
@pytest.mark.parametrize("mode", ["RGB", "RGBA"])
def test_heic_and_avif_decode_like_the_picture(fmt, mode):
    src = scene(96, 64)
    im = Image.fromarray(src, "RGB")
    if mode == "RGBA":
        alpha = np.full((64, 96), 255, np.uint8)
        alpha[:, :48] = 0  # left half transparent: it composites to the fill
        im = Image.fromarray(np.dstack([src, alpha]), "RGBA")
    data = encode(im, fmt, quality=95)
    header = read_header(data)
    assert (header.format, header.width, header.height) == (fmt, 96, 64)
    out = image_to_pixels(data, channels=3, height=64, width=96, fill=0)
    want = src.transpose(2, 0, 1).astype(np.int16)
    if mode == "RGBA":
        assert out[:, :, :40].max() <= 12  # transparent: fill 0 (lossy edges allowed)
        out, want = out[:, :, 56:], want[:, :, 56:]
    assert np.abs(out.astype(np.int16) - want).mean() < 6.0


def test_an_avif_with_exif_orientation_is_shown_upright():
    # Pillow reports an AVIF's rotation as its EXIF orientation (pillow-heif applies a
    # HEIC's itself and reports 1): the result must be the displayed image, turned once.
    im = Image.fromarray(scene(60, 30), "RGB")
    exif = Image.Exif()
    exif[0x0112] = 6
    data = encode(im, "AVIF", quality=95, exif=exif)
    out = image_to_pixels(data, channels=3, height=60, width=30)
    assert out.shape == (3, 60, 30)
    # the stored top-left (red 0, green 0) shows at the top right after a 90-degree turn
    assert out[0, :4, -4:].mean() < 30 and out[1, :4, -4:].mean() < 30


# ----------------------------------------------------------------------------- prepare


def phone_folder(root: Path, per_class: int = 6) -> dict[str, np.ndarray]:
    """Two classes of HEIC, HEIF, AVIF (and upper-case) photos; returns {rel: pixels}."""
    pictures = {}
    exts = [".heic", ".avif", ".HEIC", ".hif", ".heif", ".AVIF"]
    for c, name in enumerate(("cats", "dogs")):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            ext = exts[i % len(exts)]
            src = scene(48, 40, shift=40 * c + i)
            rel = f"{name}/img_{i}{ext}"
            (root / rel).write_bytes(encode(Image.fromarray(src), PHONE[ext.lower()], quality=95))
            pictures[rel] = src
    return pictures


def test_prepare_reads_heic_and_avif_and_ignores_none(tmp_path, caplog):
    root = tmp_path / "photos"
    phone_folder(root)
    params = DataParams(
        source="folder",
        folder=str(root),
        image_size=(40, 48),
        val_fraction=0.2,
        test_fraction=0.2,
        workers=1,
    )
    with caplog.at_level(logging.INFO, logger="trainyard"):
        card = prepare("unused", tmp_path / "out", params, seed=0)
    assert sum(c["total"] for c in card.counts.values()) == 12
    assert card.ignored == 0 and card.skipped == ()
    assert "ignored" not in caplog.text and "left out" not in caplog.text
    images = np.concatenate([np.load(tmp_path / "out" / f"{s}_images.npy") for s in card.counts])
    assert images.shape == (12, 3, 40, 48)
    # every row is a decoded picture at its own size: close to some source, not zeros
    sources = [scene(48, 40, shift=40 * c + i).transpose(2, 0, 1) for c in (0, 1) for i in range(6)]
    for row in images:
        best = min(np.abs(row.astype(np.int16) - s).mean() for s in sources)
        assert best < 6.0


def test_a_heic_that_is_not_an_image_is_a_bad_file_named_with_why(tmp_path):
    root = tmp_path / "photos"
    phone_folder(root)
    (root / "cats" / "notes.heic").write_text("shopping list, not a photo\n")
    (root / "dogs" / "half.avif").write_bytes((root / "dogs" / "img_1.avif").read_bytes()[:300])
    params = DataParams(source="folder", folder=str(root), image_size=32, workers=1)
    with pytest.raises(DataError) as info:
        prepare("unused", tmp_path / "out", params, seed=0)
    message = str(info.value)
    assert "2 bad file(s)" in message
    assert "cats/notes.heic: not an image" in message
    assert "dogs/half.avif: " in message and ("truncated" in message or "not an image" in message)


# ----------------------------------------------------------------------------- the service


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    path, weights = write_tiny_model(tmp_path_factory.mktemp("tiny-model"))
    return {"path": path, "weights": weights}


def test_the_service_decodes_heic_and_avif_like_prepare(tiny):
    photos = {
        "image/heic": encode(Image.fromarray(scene(40, 30)), "HEIF", quality=90),
        "image/avif": encode(Image.fromarray(scene(30, 40, 100)), "AVIF", quality=90),
    }
    for client in client_for(tiny, batching=False):
        for ctype, data in photos.items():
            pixels = decode_image(data, CARD)[None].astype(np.float32)
            x = normalize(pixels, CARD).reshape(1, -1)
            want = softmax(x @ tiny["weights"]["weight"] + tiny["weights"]["bias"])[0]
            resp = client.post("/classify", content=data, headers={"content-type": ctype})
            assert resp.status_code == 200, resp.text
            np.testing.assert_allclose(resp.json()["probabilities"], want, atol=1e-5)
        # and as a multipart file, whatever its declared type
        files = {"image": ("IMG_0001.HEIC", photos["image/heic"], "application/octet-stream")}
        assert client.post("/classify", files=files).status_code == 200
