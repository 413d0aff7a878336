"""What prepare tells the user about a folder: image formats it cannot read (a WARNING, by
extension), other files (INFO, by extension), the image size it chose (data.image_size:
auto), class imbalance and tiny classes, and progress through both passes."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from PIL import Image

from trainyard.core.config import DataParams, parse_params
from trainyard.data import image_files
from trainyard.data.image_size import AUTO_SIZE_MAX, AUTO_SIZE_MIN, auto_image_size
from trainyard.data.sources import prepare_source as prepare
from trainyard.data.walk import scan_folder
from trainyard.doctor.dataset import expected_dataset


def tree(root: Path, counts: dict[str, int], size: tuple[int, int] = (48, 40)) -> None:
    """Classes of solid PNGs, ``size`` (W, H), ``counts[class]`` each."""
    for c, (name, n) in enumerate(counts.items()):
        (root / name).mkdir(parents=True)
        for i in range(n):
            Image.new("RGB", size, (40 * c, i, 100)).save(root / name / f"{i}.png")


def run(root: Path, out: Path, caplog, **kw) -> object:
    params = DataParams(
        **({"source": "folder", "folder": str(root), "workers": 1, "image_size": 16} | kw)
    )
    with caplog.at_level(logging.INFO, logger="trainyard"):
        return prepare("unused", out, params, seed=0)


def records(caplog, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level]


def test_image_formats_it_cannot_read_are_a_warning_by_extension(tmp_path, caplog):
    root = tmp_path / "photos"
    tree(root, {"a": 12, "b": 12})
    for rel in ("a/x.psd", "a/y.PSD", "b/logo.svg", "b/IMG_1.CR2", "b/IMG_2.dng"):
        (root / rel).write_bytes(b"not decoded")
    for rel in ("a/notes.txt", "b/labels.txt", "b/meta.json", "b/README"):
        (root / rel).write_text("x")
    card = run(root, tmp_path / "out", caplog)
    assert card.ignored == 9
    assert card.extra["unreadable_images"] == {".cr2": 1, ".dng": 1, ".psd": 2, ".svg": 1}
    warning = next(m for m in records(caplog, logging.WARNING) if "left out" in m)
    assert "5 image file(s) left out" in warning
    assert ".psd 2, .cr2 1, .dng 1, .svg 1" in warning
    assert "convert them to PNG or JPEG" in warning
    info = next(m for m in records(caplog, logging.INFO) if "ignored" in m)
    assert "4 other file(s) ignored (not images): .txt 2, (none) 1, .json 1" in info
    # nothing image-like in an INFO line
    assert not any(".psd" in m for m in records(caplog, logging.INFO))


def test_a_folder_of_only_readable_images_warns_of_nothing_left_out(tmp_path, caplog):
    root = tmp_path / "photos"
    tree(root, {"a": 12, "b": 12})
    card = run(root, tmp_path / "out", caplog)
    assert card.ignored == 0 and "unreadable_images" not in card.extra
    assert records(caplog, logging.WARNING) == []
    assert scan_folder(root).unreadable_images == {}


@pytest.mark.parametrize(
    ("sides", "size"),
    [
        ([8] * 5, AUTO_SIZE_MIN),  # 8x8 digit scans: up to the smallest size
        ([40, 40, 44, 300], 42),  # in range: the median
        ([480, 640, 3000], AUTO_SIZE_MAX),  # photos: down to the largest
    ],
)
def test_auto_image_size_is_the_median_shorter_side_clamped(sides, size):
    got, reason = auto_image_size(sides)
    assert got == size
    assert "median shorter side" in reason


def test_prepare_with_image_size_auto_picks_logs_and_records_it(tmp_path, caplog):
    root = tmp_path / "digits"
    tree(root, {"zero": 12, "one": 12}, size=(8, 8))
    card = run(root, tmp_path / "out", caplog, image_size="auto")
    assert (card.height, card.width) == (AUTO_SIZE_MIN, AUTO_SIZE_MIN)
    assert card.extra["image_size_param"] == "auto"
    assert any(
        m.startswith("data.image_size auto: 32x32 (the median shorter side of 24 images is 8 px")
        for m in records(caplog, logging.INFO)
    )
    root = tmp_path / "portraits"
    tree(root, {"a": 12, "b": 12}, size=(40, 56))  # shorter side 40, in range
    card = run(root, tmp_path / "out2", caplog, image_size="auto")
    assert (card.height, card.width) == (40, 40)


def test_the_doctor_sizes_an_auto_folder_at_its_largest_choice(tmp_path):
    root = tmp_path / "photos"
    tree(root, {"a": 10, "b": 10})
    params = parse_params({"data": {"source": "folder", "folder": str(root)}})
    assert params.data.image_size == "auto"
    facts = expected_dataset(params, tmp_path)
    assert (facts["height"], facts["width"]) == (AUTO_SIZE_MAX, AUTO_SIZE_MAX)
    assert "auto" in facts["note"]


def test_imbalance_and_tiny_classes_are_warnings_naming_them(tmp_path, caplog):
    root = tmp_path / "photos"
    tree(root, {"cats": 140, "dogs": 20, "owls": 6})
    run(root, tmp_path / "out", caplog, val_fraction=0.2, test_fraction=0.2)
    warnings = records(caplog, logging.WARNING)
    # train images: owls 6 - 1 - 1 = 4, dogs 20 - 4 - 4 = 12, cats 140 - 28 - 28 = 84 (21x)
    tiny = next(m for m in warnings if "fewer than 10 train images" in m)
    assert "owls (4)" in tiny and "cats" not in tiny and "dogs" not in tiny
    imbalance = next(m for m in warnings if "class imbalance" in m)
    assert "cats has 84 train images, owls only 4 (21x, over 10x)" in imbalance


def test_balanced_classes_give_no_balance_warning(tmp_path, caplog):
    root = tmp_path / "photos"
    tree(root, {"a": 20, "b": 25})
    run(root, tmp_path / "out", caplog)
    assert not any("imbalance" in m or "fewer than" in m for m in records(caplog, logging.WARNING))


def test_both_passes_report_progress_as_chunks_complete(tmp_path, caplog, monkeypatch):
    root = tmp_path / "photos"
    tree(root, {"a": 12, "b": 12})
    # Small chunks and a line at every update: what a large folder shows every 10 s.
    monkeypatch.setattr(image_files, "CHUNK", 5)
    monkeypatch.setattr(image_files, "PROGRESS_EVERY_S", 0.0)
    run(root, tmp_path / "out", caplog, val_fraction=0.2, test_fraction=0.2)
    lines = [r.getMessage() for r in caplog.records if r.name == "trainyard.progress"]
    headers = [m for m in lines if m.startswith("reading headers: ")]
    decoding = [m for m in lines if m.startswith("decoding: ")]
    assert headers[0].startswith("reading headers: 5/24 files")
    assert headers[-1].startswith("reading headers: 24/24 files (100%)")
    assert len(headers) == 5  # 5, 10, 15, 20 as chunks complete, then the final line
    assert decoding[0].startswith("decoding: 5/24 images")
    assert decoding[-1].startswith("decoding: 24/24 images (100%)")
