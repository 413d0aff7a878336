"""One fingerprint per data source (``source_fingerprint``): the stat fingerprint of its
input files, which prepare logs and ``trainyard tune`` keys its prepared-data cache on
(``data_key``). Small Pillow images, no training."""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
from pathlib import Path

import pytest
from PIL import Image

from trainyard.core.card import CARD_FILE
from trainyard.core.config import DataParams, parse_params
from trainyard.data.fingerprint import files_fingerprint, stat_fingerprint
from trainyard.data.sources import fingerprint_source, source_fingerprint
from trainyard.data.sources.fashion_mnist import RAW_FILES
from trainyard.experiments.trials import data_key
from trainyard.stages import prepare as prepare_stage

COLOURS = {"cat": (200, 40, 40), "dog": (40, 200, 40)}


def image(path: Path, colour: tuple[int, int, int], k: int) -> Path:
    """A small PNG of ``colour`` with a per-image mark (no two files are equal)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    im = Image.new("RGB", (12, 10), colour)
    im.putpixel((k % 12, 0), (k * 37 % 256, 255, 0))
    im.save(path, format="PNG")
    return path


def redraw(path: Path) -> None:
    """New bytes (another size, so another file size) and a later mtime, as an edit."""
    before = path.stat()
    Image.new("RGB", (14, 9), (1, 2, 3)).save(path, format="PNG")
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 5_000_000_000))


def touch(path: Path) -> None:
    """The same bytes, a later mtime."""
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))


def photos(root: Path) -> Path:
    """``root/photos/<class>/<k>.png``, 3 per class, plus a hidden file and OS litter."""
    folder = root / "photos"
    for name, colour in COLOURS.items():
        for k in range(3):
            image(folder / name / f"{k}.png", colour, k)
    (folder / "cat" / ".DS_Store").write_bytes(b"finder")
    (folder / "Thumbs.db").write_bytes(b"windows")
    return folder


def listed(root: Path, outside: Path | None = None) -> Path:
    """``root/ds/labels.csv`` over ``root/ds/images/<class>/<k>.png`` (relative rows), one
    absolute row (``outside``) and one URL."""
    rows = []
    for name, colour in COLOURS.items():
        for k in range(3):
            rel = f"images/{name}/{k}.png"
            image(root / "ds" / rel, colour, k)
            rows.append([rel, name])
    if outside is not None:
        rows.append([str(image(outside, (9, 9, 9), 9)), "dog"])
    rows.append(["https://example.org/owl.png", "cat"])
    path = root / "ds" / "labels.csv"
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(["image", "label"])
        writer.writerows(rows)
    return path


def folder_params(folder: str) -> DataParams:
    return DataParams(source="folder", folder=folder)


def csv_params(path: str) -> DataParams:
    return DataParams(source="csv", csv=path)


# ----------------------------------------------------------------------------- stat level


def test_stat_fingerprint_counts_names_sizes_and_times_not_order(tmp_path):
    a, b = image(tmp_path / "a.png", (1, 1, 1), 0), image(tmp_path / "b.png", (2, 2, 2), 1)
    first = stat_fingerprint([str(a), str(b)], tmp_path)
    assert len(first) == 64 and int(first, 16) >= 0
    # order, repeats and absolute-or-relative spelling do not matter
    assert stat_fingerprint([str(b), "a.png", str(a)], tmp_path) == first
    # named relative to the root: the same files under another root fingerprint alike
    other = tmp_path / "copy"
    other.mkdir()
    for p in (a, b):
        (other / p.name).write_bytes(p.read_bytes())
        os.utime(other / p.name, ns=(p.stat().st_atime_ns, p.stat().st_mtime_ns))
    assert stat_fingerprint(["a.png", "b.png"], other) == first
    # without a root, files are named by their absolute paths
    assert stat_fingerprint([str(a), str(b)], None) != first
    redraw(a)
    assert stat_fingerprint([str(a), str(b)], tmp_path) != first


def test_a_missing_file_counts_by_name_and_error_and_a_url_by_its_string(tmp_path):
    present = image(tmp_path / "a.png", (1, 1, 1), 0)
    missing = stat_fingerprint([str(present), "gone.png"], tmp_path)
    assert missing != stat_fingerprint([str(present)], tmp_path)
    assert missing != stat_fingerprint([str(present), "other.png"], tmp_path)
    image(tmp_path / "gone.png", (1, 1, 1), 1)  # it appears
    assert stat_fingerprint([str(present), "gone.png"], tmp_path) != missing
    url = "https://example.org/x.jpg"
    with_url = stat_fingerprint([str(present), url], tmp_path)
    assert with_url == stat_fingerprint([url, "a.png"], tmp_path)
    assert with_url != stat_fingerprint([str(present), url + "?v=2"], tmp_path)
    # the low-level form: (name, path to stat or None for a URL)
    assert files_fingerprint([(url, None), ("a.png", present)]) == with_url


# ----------------------------------------------------------------------------- folder


def test_folder_fingerprint_and_data_key_follow_an_edited_image(tmp_path):
    folder = photos(tmp_path / "repo")
    root = tmp_path / "repo"
    data = folder_params("photos")  # relative: to the repository root
    params = parse_params({"data": data.model_dump(mode="json")})
    found = fingerprint_source(data, root)
    assert found.files == 6  # hidden files and litter do not count
    key = data_key(params, root)
    assert source_fingerprint(folder_params(str(folder)), tmp_path / "elsewhere") == found.digest

    # an unrelated file outside the folder, a hidden file and litter inside it: no change
    (tmp_path / "notes.txt").write_text("hello")
    (root / "params.yaml").write_text("seed: 1\n")
    touch(folder / "cat" / ".DS_Store")
    (folder / "Thumbs.db").write_bytes(b"other")
    (folder / "dog" / ".hidden.png").write_bytes(b"x")
    assert source_fingerprint(data, root) == found.digest
    assert data_key(params, root) == key

    redraw(folder / "dog" / "1.png")
    assert source_fingerprint(data, root) != found.digest
    assert data_key(params, root) != key


def test_folder_fingerprint_sees_added_removed_and_other_files(tmp_path):
    folder = photos(tmp_path)
    data = folder_params(str(folder))
    seen = {source_fingerprint(data, tmp_path)}
    image(folder / "cat" / "new.png", (3, 3, 3), 5)
    seen.add(source_fingerprint(data, tmp_path))
    (folder / "cat" / "new.png").unlink()
    assert source_fingerprint(data, tmp_path) in seen  # back to the first
    (folder / "dog" / "notes.txt").write_text("not an image, still a file of the folder")
    seen.add(source_fingerprint(data, tmp_path))
    assert len(seen) == 3
    # a missing folder fingerprints (prepare says what is wrong), differently
    assert source_fingerprint(folder_params(str(tmp_path / "nope")), tmp_path) not in seen


# ----------------------------------------------------------------------------- csv


def test_a_csv_whose_listed_image_changed_gets_a_new_data_key(tmp_path):
    """The issue: tune keyed only a folder's files, so a CSV's edited image reused stale
    prepared arrays (data_key was the same before and after)."""
    root = tmp_path / "repo"
    outside = tmp_path / "shared" / "extra.png"
    listed(root, outside)
    params = parse_params({"data": {"source": "csv", "csv": "ds/labels.csv"}})
    key = data_key(params, root)
    found = fingerprint_source(params.data, root)
    assert found.files == 1 + 6 + 1 + 1  # the CSV, its images, the absolute row, the URL

    redraw(root / "ds" / "images" / "cat" / "2.png")
    assert data_key(params, root) != key
    assert source_fingerprint(params.data, root) != found.digest

    key = data_key(params, root)
    redraw(outside)  # a listed image outside the CSV's folder counts too
    assert data_key(params, root) != key


def test_csv_fingerprint_ignores_files_it_does_not_list_and_follows_the_csv(tmp_path):
    path = listed(tmp_path)
    data = csv_params("ds/labels.csv")
    first = source_fingerprint(data, tmp_path)
    assert source_fingerprint(csv_params(str(path)), tmp_path / "elsewhere") == first
    # an image beside the listed ones that the CSV does not name, a file outside: no change
    image(tmp_path / "ds" / "images" / "cat" / "unlisted.png", (5, 5, 5), 3)
    (tmp_path / "other.txt").write_text("x")
    assert source_fingerprint(data, tmp_path) == first

    # the CSV's own bytes count (its mtime alone does not)
    touch(path)
    assert source_fingerprint(data, tmp_path) == first
    path.write_text(path.read_text().replace("images/dog/2.png,dog", "images/dog/2.png,cat"))
    changed = source_fingerprint(data, tmp_path)
    assert changed != first
    # a broken CSV or a missing one still fingerprints (prepare says what is wrong)
    path.write_text("image,label\nimages/cat/0.png,\n")
    broken = source_fingerprint(data, tmp_path)
    path.unlink()
    assert len({first, changed, broken, source_fingerprint(data, tmp_path)}) == 4


# ----------------------------------------------------------------------------- fashion-mnist


def test_fashion_mnist_fingerprints_its_local_files_or_its_mirrors(tmp_path):
    src = tmp_path / "fm"
    src.mkdir()
    for spec in RAW_FILES:
        (src / spec.name).write_bytes(spec.name.encode())
    local = DataParams(source="fashion-mnist", source_dir="fm")
    found = fingerprint_source(local, tmp_path)
    assert found.files == 4
    touch(src / RAW_FILES[0].name)
    assert source_fingerprint(local, tmp_path) != found.digest

    nothing = DataParams(source="fashion-mnist", debian_dir=str(tmp_path / "empty"))
    remote = fingerprint_source(nothing, tmp_path)
    assert remote.files == 0
    other = nothing.model_copy(update={"mirrors": ["https://mirror.example.org/fm/"]})
    assert source_fingerprint(other, tmp_path) != remote.digest


# ----------------------------------------------------------------------------- prepare


def test_prepare_logs_the_fingerprint_and_keeps_it_out_of_the_card(tmp_path, monkeypatch, caplog):
    listed(tmp_path, None)
    (tmp_path / "ds" / "labels.csv").write_text(
        "\n".join(
            line
            for line in (tmp_path / "ds" / "labels.csv").read_text().splitlines()
            if "https://" not in line  # no download in a unit test
        )
        + "\n"
    )
    params = parse_params(
        {"data": {"source": "csv", "csv": "ds/labels.csv", "image_size": 8, "workers": 1}}
    )
    monkeypatch.chdir(tmp_path)
    expected = source_fingerprint(params.data, tmp_path)[:12]

    def prepare(out: str) -> dict:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="trainyard.stages.prepare"):
            prepare_stage.run(params, argparse.Namespace(raw="raw", out=out))
        return json.loads((tmp_path / out / CARD_FILE).read_text())

    card = prepare("prep")
    lines = [r.getMessage() for r in caplog.records if "source fingerprint" in r.getMessage()]
    assert lines == [f"source fingerprint {expected} (7 files)"]
    assert expected not in json.dumps(card)

    # every file gets a new mtime (a clone on another machine): the same card
    for path in (tmp_path / "ds").rglob("*"):
        if path.is_file():
            touch(path)
    assert source_fingerprint(params.data, tmp_path)[:12] != expected
    assert prepare("prep2") == card


@pytest.mark.parametrize("source", ["fashion-mnist", "folder", "csv"])
def test_every_source_says_how_many_files_it_covers(tmp_path, source):
    photos(tmp_path)
    listed(tmp_path)
    data = DataParams(
        source=source,
        folder="photos",
        csv="ds/labels.csv",
        debian_dir=str(tmp_path / "nothing"),
    )
    found = fingerprint_source(data, tmp_path)
    assert found.files == {"fashion-mnist": 0, "folder": 6, "csv": 8}[source]
    assert found.digest == source_fingerprint(data, tmp_path)
