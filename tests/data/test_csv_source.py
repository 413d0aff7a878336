"""The CSV source (``data.source: csv``): a CSV of image paths or URLs and labels, through
prepare, the doctor, the card, the prepare stage and the service's model loading."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from trainyard import cli
from trainyard.bulk.listing import list_inputs
from trainyard.core.card import SPLITS, card_from_metadata, load_card
from trainyard.core.config import DataParams, ExportParams, ServeParams, parse_params
from trainyard.core.errors import DataError
from trainyard.core.imaging import image_to_pixels
from trainyard.data.sources import prepare_source
from trainyard.data.sources.csv_list import read_listing
from trainyard.doctor.dataset import collect_dataset
from trainyard.export.onnx_export import export_and_verify
from trainyard.runtime.inputs import decode_image, model_input
from trainyard.serve.settings import load_model

from conftest import REPO, run_ok, stage_env, train_checkpoint

COLOURS = {"cat": (200, 40, 40), "dog": (40, 200, 40), "owl": (40, 40, 200)}


# ----------------------------------------------------------------------------- helpers


def image(path: Path, colour: tuple[int, int, int], k: int, fmt: str = "PNG") -> Path:
    """A small image of ``colour`` with a per-image mark (no two files are equal)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    im = Image.new("RGB", (20, 16), colour)
    im.putpixel((k % 20, k // 20), (k * 7 % 256, 255, 0))
    im.save(path, format=fmt)
    return path


def write_csv(path: Path, header: list[str], rows: list[list[str]], delimiter: str = ",") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh, delimiter=delimiter)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def read_rows(path: Path) -> list[list[str]]:
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.reader(fh))


def dataset(root: Path, per_class: int, splits: bool = True) -> Path:
    """``root/labels.csv`` over ``root/images/<class>/<k>.png`` (one a JPEG): with a split
    column, per class the last image is test, the one before it val."""
    rows = []
    for name, colour in COLOURS.items():
        for k in range(per_class):
            fmt = "JPEG" if k == 0 else "PNG"
            rel = f"images/{name}/{k}.{fmt.lower()}"
            image(root / rel, colour, k, fmt)
            split = "test" if k == per_class - 1 else "val" if k == per_class - 2 else "train"
            rows.append([rel, name] + ([split] if splits else []))
    header = ["image", "label"] + (["split"] if splits else [])
    return write_csv(root / "labels.csv", header, rows)


def params(csv_path: Path, **kw) -> DataParams:
    base = {"source": "csv", "csv": str(csv_path), "image_size": 16, "workers": 1}
    return DataParams(**(base | kw))


def counts(card) -> dict[str, int]:
    return {s: card.counts[s]["total"] for s in SPLITS}


# ----------------------------------------------------------------------------- prepare


def test_prepare_keeps_the_csvs_splits_labels_and_pixels(tmp_path):
    csv_path = dataset(tmp_path / "ds", per_class=6)
    rows = read_rows(csv_path)
    rows[1][0] = str(tmp_path / "ds" / rows[1][0])  # an absolute path is read as it is
    rows[2][2] = " Validation "  # spelled as some datasets do
    write_csv(csv_path, rows[0], rows[1:])
    out = tmp_path / "prepared"
    card = prepare_source("unused", out, params(csv_path), seed=0)

    assert card.source == "csv" and card.classes == ("cat", "dog", "owl")
    assert counts(card) == {"train": 11, "val": 4, "test": 3}  # 4+1+1 a class, one moved
    assert card.counts["test"]["per_class"] == {"cat": 1, "dog": 1, "owl": 1}
    assert (card.channels, card.height, card.width) == (3, 16, 16)
    assert card.extra["csv"] == "labels.csv" and card.extra["rows"] == 18
    assert card.extra["columns"] == {"image": "image", "label": "label", "split": "split"}
    # The card is part of the data version: no absolute path of this machine in it.
    assert str(tmp_path) not in (out / "card.json").read_text()
    assert load_card(out) == card
    # Each image sits under its own label: its colour says which.
    for split in SPLITS:
        images, labels = np.load(out / f"{split}_images.npy"), np.load(out / f"{split}_labels.npy")
        for px, label in zip(images, labels, strict=True):
            assert card.classes[int(np.argmax(px.mean(axis=(1, 2))))] == card.classes[label]


def test_the_bundled_sample_csv_prepares(tmp_path):
    """params.yaml's default data.csv (examples/shapes.csv, the shapes folder as a CSV)."""
    default = parse_params({"data": {"source": "csv", "workers": 1, "image_size": 16}}).data
    card = prepare_source(
        "unused",
        tmp_path / "p",
        default.model_copy(update={"csv": str(REPO / default.csv)}),
        seed=0,
    )
    assert card.classes == ("circle", "square", "triangle")
    assert counts(card) == {"train": 96, "val": 12, "test": 12}


def test_no_split_column_numeric_labels_other_names_and_the_doctor(tmp_path):
    root = tmp_path / "ds"
    rows = []
    for label, colour in (("10", (250, 0, 0)), ("2", (0, 250, 0)), ("1", (0, 0, 250))):
        for k in range(10):
            rows.append([label, f"img/{label}_{k}.png"])
            image(root / rows[-1][1], colour, k)
    tsv = write_csv(root / "meta.tsv", ["class", "filepath"], rows, delimiter="\t")
    data = params(
        tsv,
        csv_image_column="filepath",
        csv_label_column="class",
        val_fraction=0.2,
        test_fraction=0.2,
    )
    full = parse_params({"data": data.model_dump()})
    before = collect_dataset(full, tmp_path, tmp_path / "prepared")
    assert before["from"] == "expected" and before["source"] == "csv"
    assert "30 rows of" in before["note"] and "no split column" in before["note"]
    expected = {s: v["images"] for s, v in before["splits"].items()}

    card = prepare_source("unused", tmp_path / "prepared", data, seed=0)
    assert card.classes == ("1", "2", "10")  # integers sorted as numbers
    assert counts(card) == expected == {"train": 18, "val": 6, "test": 6}
    assert card.extra["columns"]["split"] is None
    after = collect_dataset(full, tmp_path, tmp_path / "prepared")
    assert after["from"] == "card" and after["source"] == "csv"
    resized = parse_params({"data": data.model_dump() | {"image_size": 24}})
    stale = collect_dataset(resized, tmp_path, tmp_path / "prepared")
    assert stale["stale_card"] is True and "data.image_size" in stale["note"]


# ----------------------------------------------------------------------------- bad input


def test_every_row_problem_is_listed_with_its_row_and_column(tmp_path):
    rows = [
        ["a.png", "cat", "train"],
        ["", "cat", "train"],  # row 3
        ["b.png", " ", "train"],  # row 4
        ["c.png", "dog", "training2"],  # row 5
        ["d.png", "dog"],  # row 6: a field short
        ["s3://bucket/e.png", "dog", "test"],  # row 7
    ]
    path = write_csv(tmp_path / "bad.csv", ["image", "label", "split"], rows)
    with pytest.raises(DataError) as info:
        prepare_source("unused", tmp_path / "out", params(path), seed=0)
    message = str(info.value)
    assert message.startswith(f"data.csv: 5 problem(s) in {path}")
    assert "row 3, column 'image': empty image" in message
    assert "row 4, column 'label': empty label" in message
    assert "row 5, column 'split': 'training2' is not a split" in message
    assert "row 6: 2 field(s), the header has 3" in message
    assert "row 7, column 'image': 's3://bucket/e.png' is neither a file path nor" in message
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("header", "rows", "message"),
    [
        (
            ["path", "label"],
            [["a.png", "x"]],
            r"no column 'image' \(data\.csv_image_column\); "
            r"its columns are 'path', 'label'",
        ),
        (["image", "label"], [["a.png", "x"], ["b.png", "x"]], r"has only the class 'x'"),
        (["image", "label"], [], r"has no image rows"),
        (
            ["image", "label", "split"],
            [["a.png", "x", "train"], ["b.png", "y", "test"]],
            r"class\(es\) 'y' have no train rows",
        ),
        (None, None, r"labels\.csv does not exist"),
    ],
)
def test_unusable_csvs_are_data_errors_naming_the_file(tmp_path, header, rows, message):
    path = tmp_path / "labels.csv"
    if header is not None:
        write_csv(path, header, rows)
    with pytest.raises(DataError, match=rf"^data\.csv: .*{message}"):
        prepare_source("unused", tmp_path / "out", params(path), seed=0)


def test_the_csv_source_and_predict_read_a_listing_alike(tmp_path):
    """One reader (``data.sources.list_files``) for the csv source and ``trainyard predict``'s
    CSV and path-list sources: every bad row named with the file and its line, at once;
    BOM, blank lines, TSV and comments read the same by both."""
    rows = [["a.png", "cat"], ["", "cat"], ["b.png"], ["c.png", "dog", "x"], ["d.png", ""]]
    bad = write_csv(tmp_path / "bad.csv", ["image", "label"], rows)
    width = "field(s), the header has 2 (an unquoted comma in a value? quote it)"
    problems = [
        "  row 3, column 'image': empty image",
        f"  row 4: 1 {width}",
        f"  row 5: 3 {width}",
        "  row 6, column 'label': empty label",  # the csv source's label is required
    ]
    with pytest.raises(DataError) as info:
        prepare_source("unused", tmp_path / "out", params(bad), seed=0)
    assert str(info.value).splitlines() == [f"data.csv: 4 problem(s) in {bad}:", *problems]
    with pytest.raises(DataError) as info:
        list_inputs(str(bad))  # predict reads a label when the row has one
    head = f"predict source: 3 problem(s) in {bad}:"
    assert str(info.value).splitlines() == [head, *problems[:3]]

    tsv = tmp_path / "ok.tsv"
    tsv.write_text("\ufeffimage\tlabel\n\nx/1.png\tcat\n  \t \nhttps://e.org/2.png\tdog\n")
    listed = list_inputs(str(tsv))
    assert listed.names == ["x/1.png", "https://e.org/2.png"]
    assert listed.labels == ["cat", "dog"]
    assert [r.line for r in read_listing(params(tsv)).rows] == [3, 5]
    paths = tmp_path / "paths.txt"
    paths.write_text("# photos\n\na.png\n  /abs/b.png  \n")
    assert list_inputs(str(paths)).names == ["a.png", "/abs/b.png"]
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9.png\n")
    with pytest.raises(DataError, match=r"^predict source: .*latin1\.txt is not UTF-8 text"):
        list_inputs(str(tmp_path / "latin1.txt"))


def test_missing_and_broken_images_follow_on_bad_file(tmp_path):
    csv_path = dataset(tmp_path / "ds", per_class=5)
    rows = read_rows(csv_path)
    (tmp_path / "ds" / "notes.png").write_text("not an image")
    (tmp_path / "ds" / "images" / "folder.png").mkdir()
    rows += [
        ["images/gone.png", "cat", "train"],  # row 17
        ["notes.png", "dog", "train"],  # row 18
        ["images/folder.png", "owl", "train"],  # row 19
    ]
    write_csv(csv_path, rows[0], rows[1:])
    with pytest.raises(DataError) as info:
        prepare_source("unused", tmp_path / "out", params(csv_path), seed=0)
    message = str(info.value)
    assert f"data.csv: 3 bad file(s) in {csv_path}" in message
    assert "row 17: images/gone.png: missing file" in message
    assert "row 18: notes.png: " in message and "not an image" in message
    assert "row 19: images/folder.png: a folder, not an image" in message
    assert "data.on_bad_file: skip" in message

    card = prepare_source("unused", tmp_path / "out", params(csv_path, on_bad_file="skip"), 0)
    assert [s["file"] for s in card.skipped] == [
        "row 17: images/gone.png",
        "row 18: notes.png",
        "row 19: images/folder.png",
    ]
    assert counts(card) == {"train": 9, "val": 3, "test": 3}


def test_a_class_too_small_to_split_is_named(tmp_path):
    root = tmp_path / "ds"
    rows = [[f"{c}{k}.png", c] for c, n in (("big", 10), ("small", 2)) for k in range(n)]
    for k, (rel, _) in enumerate(rows):
        image(root / rel, (k, k, k), k)
    path = write_csv(root / "labels.csv", ["image", "label"], rows)
    with pytest.raises(DataError, match=r"^data\.csv: class 'small' has 2 image\(s\)"):
        prepare_source("unused", tmp_path / "out", params(path), seed=0)


# ----------------------------------------------------------------------------- URLs


class _Handler(SimpleHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/slow.png":
            time.sleep(2)  # past the test's 0.5 s timeout
        super().do_GET()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def http_root(tmp_path, monkeypatch) -> Iterator[tuple[str, Path]]:
    """A real HTTP server on loopback serving a folder: (base URL, the folder)."""
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    served = tmp_path / "www"
    served.mkdir()
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_Handler, directory=str(served)))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", served
    server.shutdown()
    server.server_close()


def test_urls_are_downloaded_and_failures_name_row_and_url(tmp_path, http_root):
    base, www = http_root
    csv_path = dataset(tmp_path / "ds", per_class=5)
    rows = read_rows(csv_path)
    good = image(www / "owl.png", COLOURS["owl"], 99)
    noise = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    Image.fromarray(noise).save(www / "huge.png")  # ~12 kB of noise: over a 4 kB cap
    image(www / "slow.png", COLOURS["dog"], 98)
    rows += [
        [f"{base}/owl.png", "owl", "train"],  # row 17
        [f"{base}/missing.png", "cat", "train"],  # row 18
        [f"{base}/huge.png", "dog", "train"],  # row 19
        [f"{base}/slow.png", "dog", "train"],  # row 20
    ]
    write_csv(csv_path, rows[0], rows[1:])
    data = params(csv_path, csv_max_download_bytes=4096, download_timeout_s=0.5)
    with pytest.raises(DataError) as info:
        prepare_source("unused", tmp_path / "out", data, seed=0)
    message = str(info.value)
    assert "3 bad file(s)" in message
    assert f"row 18: {base}/missing.png: download failed: HTTP 404" in message
    assert f"row 19: {base}/huge.png: download" in message
    assert "over data.csv_max_download_bytes (4096" in message
    assert f"row 20: {base}/slow.png: download timed out after 0.5 s (data.download_timeout_s)" in (
        message
    )

    before = set(Path(tempfile.gettempdir()).glob("trainyard-csv-*"))
    skip = data.model_copy(update={"on_bad_file": "skip"})
    card = prepare_source("unused", tmp_path / "out", skip, seed=0)
    assert len(card.skipped) == 3 and card.extra["urls"] == 4
    assert counts(card)["train"] == 3 * 3 + 1
    # The downloaded image is in train, pixel for pixel what its bytes decode to.
    want = image_to_pixels(good.read_bytes(), channels=3, height=16, width=16, resize="crop")
    train = np.load(tmp_path / "out" / "train_images.npy")
    assert any(np.array_equal(px, want) for px in train)
    assert set(Path(tempfile.gettempdir()).glob("trainyard-csv-*")) == before  # removed


# ----------------------------------------------------------------------------- end to end


def test_prepare_stage_doctor_and_served_model_on_a_csv(tmp_path, capsys):
    """The prepare stage as DVC runs it, `trainyard doctor` on its output, and a model
    trained on it that the service opens with the CSV's classes: the card is all it reads."""
    csv_path = dataset(tmp_path / "ds", per_class=6)
    params_file = tmp_path / "params.yaml"
    params_file.write_text(
        yaml.safe_dump({"data": {"source": "csv", "csv": "ds/labels.csv", "image_size": 16}})
    )
    stage = [sys.executable, "-m", "trainyard.stages.prepare", "--raw", "raw", "--out", "prep"]
    assert "csv, 3 classes, 3x16x16" in run_ok(stage, tmp_path).stderr

    assert cli.main(
        ["doctor", "--params", str(params_file), "--data", str(tmp_path / "prep"), "--json"]
    ) in (0, 1)
    doc = json.loads(capsys.readouterr().out)
    assert doc["dataset"]["source"] == "csv" and doc["dataset"]["from"] == "card"
    assert doc["dataset"]["splits"]["train"]["images"] == 12

    card = load_card(tmp_path / "prep")
    images, labels = (
        np.load(tmp_path / "prep" / "train_images.npy"),
        np.load(tmp_path / "prep" / "train_labels.npy"),
    )
    ckpt = train_checkpoint(tmp_path / "m", images, labels, 2, 4, 0.0, 1.0, card=card)
    onnx_path = tmp_path / "m" / "model.onnx"
    export_and_verify(ckpt, onnx_path, images, 18, ExportParams().max_abs_diff, "run", "data")
    model, _sha = load_model(onnx_path, ServeParams())
    served = card_from_metadata(model.metadata, str(onnx_path))
    assert model.classes == ["cat", "dog", "owl"] and served.contract() == card.contract()
    upload = (tmp_path / "ds" / "images" / "owl" / "3.png").read_bytes()
    logits = model.run(model_input(decode_image(upload, served)[None], served))
    assert logits.shape == (1, 3)

    # A broken CSV stops the stage with exit 1 and the row in its message.
    (tmp_path / "ds" / "labels.csv").write_text(csv_path.read_text() + "images/x.png,,train\n")
    proc = subprocess.run(stage, cwd=tmp_path, env=stage_env(), capture_output=True, text=True)
    assert proc.returncode == 1 and "row 20, column 'label': empty label" in proc.stderr
