"""Phone formats: HEIC/HEIF (the iPhone's default, via pillow-heif) and AVIF (Pillow's own)
are images to prepare and to the service, through the one image_to_pixels."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from image_bytes import encode
from PIL import Image, features
from test_serve_unit import CARD, client_for, write_tiny_model

from trainyard.core.config import DataParams
from trainyard.core.errors import DataError, InputError
from trainyard.core.image_formats import IMAGE_EXTENSIONS, IMAGE_FORMATS
from trainyard.core.imaging import (
    image_to_pixels,
    read_header,
)
from trainyard.data.sources import prepare_source as prepare
from trainyard.runtime.inputs import decode_image, model_input, softmax

PHONE = {".heic": "HEIF", ".heif": "HEIF", ".hif": "HEIF", ".avif": "AVIF"}


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


def folder_params(root: Path) -> DataParams:
    return DataParams(source="folder", folder=str(root), image_size=32, workers=1)


def prepare_refused(root: Path, out: Path) -> str:
    """The DataError prepare raises on the folder ``root`` (its bad files), as text."""
    with pytest.raises(DataError) as info:
        prepare("unused", out, folder_params(root), seed=0)
    return str(info.value)


def test_a_heic_that_is_not_an_image_is_a_bad_file_named_with_why(tmp_path):
    root = tmp_path / "photos"
    phone_folder(root)
    (root / "cats" / "notes.heic").write_text("shopping list, not a photo\n")
    (root / "dogs" / "half.avif").write_bytes((root / "dogs" / "img_1.avif").read_bytes()[:300])
    message = prepare_refused(root, tmp_path / "out")
    assert "2 bad file(s)" in message
    assert "cats/notes.heic: not an image" in message
    assert "dogs/half.avif: " in message and ("truncated" in message or "not an image" in message)


def test_a_fresh_process_registers_pillow_heif_at_its_first_heic(tmp_path):
    (tmp_path / "photo.heic").write_bytes(encode(Image.fromarray(scene(48, 40)), "HEIF"))
    code = (
        "import sys\n"
        "from trainyard.core.imaging import image_to_pixels\n"
        "assert 'pillow_heif' not in sys.modules  # not imported by imaging itself\n"
        "data = open(sys.argv[1], 'rb').read()\n"
        "print(image_to_pixels(data, channels=3, height=40, width=48).shape)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "photo.heic")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "(3, 40, 48)"


# ----------------------------------------------------------------------------- plugin missing


@pytest.fixture
def without_phone_readers(monkeypatch) -> dict[str, bytes]:
    """This process as where pillow-heif is not installed and Pillow has no AVIF (a bare
    GPU machine's image): a HEIC and an AVIF file, written before the readers go."""
    photos = {
        "HEIF": encode(Image.fromarray(scene(48, 40)), "HEIF", quality=90),
        "AVIF": encode(Image.fromarray(scene(48, 40)), "AVIF", quality=90),
    }
    monkeypatch.setitem(sys.modules, "pillow_heif", None)  # its import now fails
    for fmt in photos:
        monkeypatch.delitem(Image.OPEN, fmt)
    return photos


def test_a_phone_format_without_its_reader_is_a_415_naming_the_package(without_phone_readers):
    want = {"HEIF": "pillow-heif package", "AVIF": "Pillow >= 11.3 built with AVIF"}
    for fmt, data in without_phone_readers.items():
        with pytest.raises(InputError) as info:
            image_to_pixels(data, channels=3, height=40, width=48, field="photo.heic")
        assert info.value.status == 415
        assert str(info.value).startswith("photo.heic: ") and want[fmt] in str(info.value)
        assert "pip install" in str(info.value)
    # every other format still reads
    png = encode(Image.fromarray(scene(48, 40)), "PNG")
    assert image_to_pixels(png, channels=3, height=40, width=48).shape == (3, 40, 48)


def test_prepare_names_the_missing_package_per_file(tmp_path, without_phone_readers):
    root = tmp_path / "photos"
    for c, name in enumerate(("cats", "dogs")):
        (root / name).mkdir(parents=True)
        for i in range(4):
            img = Image.fromarray(scene(48, 40, shift=40 * c + i))
            (root / name / f"img_{i}.png").write_bytes(encode(img, "PNG"))
    (root / "cats" / "IMG_0001.HEIC").write_bytes(without_phone_readers["HEIF"])
    message = prepare_refused(root, tmp_path / "out")
    assert "1 bad file(s)" in message
    assert "cats/IMG_0001.HEIC: HEIC/HEIF images need the pillow-heif package" in message
    # data.on_bad_file: skip leaves it out and prepares the rest
    skip = folder_params(root).model_copy(update={"on_bad_file": "skip"})
    card = prepare("unused", tmp_path / "out", skip, seed=0)
    assert sum(c["total"] for c in card.counts.values()) == 8


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
            x = model_input(pixels, CARD).reshape(1, -1)
            want = softmax(x @ tiny["weights"]["weight"] + tiny["weights"]["bias"])[0]
            resp = client.post("/classify", content=data, headers={"content-type": ctype})
            assert resp.status_code == 200, resp.text
            np.testing.assert_allclose(resp.json()["probabilities"], want, atol=1e-5)
        # and as a multipart file, whatever its declared type
        files = {"image": ("IMG_0001.HEIC", photos["image/heic"], "application/octet-stream")}
        assert client.post("/classify", files=files).status_code == 200


def test_the_service_answers_415_for_heic_without_pillow_heif(tiny, without_phone_readers):
    for client in client_for(tiny, batching=False):
        resp = client.post(
            "/classify",
            content=without_phone_readers["HEIF"],
            headers={"content-type": "image/heic"},
        )
        assert resp.status_code == 415, resp.text
        assert "pillow-heif" in resp.json()["error"] and resp.json()["field"] == "image"
