"""``trainyard audit``: on a small folder made here (coloured shapes, three classes, their
own train/val/test splits) with three labels flipped and one train image copied into test,
the suspects CSV ranks the copy first and the three flipped files as its top label
suspects, each with its true class suggested; the MLflow run gets the counts; a second run
takes every embedding from the cache (counted: none computed, no forward pass); bad input
exits 2 naming the folder."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw

from trainyard import cli
from trainyard.commands.audit import _line
from trainyard.evaluation.embedding_cache import EmbeddingCache

from conftest import REPO

CLASSES = {"circle": (220, 40, 40), "square": (40, 170, 60), "triangle": (50, 80, 220)}
PER_CLASS = 20
# (split, drawn as, filed under): a red circle filed as a square, and so on.
FLIPS = [
    ("train", "circle", "square"),
    ("train", "square", "triangle"),
    ("val", "triangle", "circle"),
]


def shape(kind: str, rng: np.random.Generator) -> Image.Image:
    """A ``kind`` in its colour, of a random size and place, on a random light background."""
    bg = tuple(int(v) for v in rng.integers(200, 256, 3))
    im = Image.new("RGB", (96, 96), bg)
    draw = ImageDraw.Draw(im)
    r = int(rng.integers(18, 40))
    cx, cy = (int(v) for v in rng.integers(r, 96 - r, 2))
    colour = tuple(int(np.clip(c + rng.integers(-25, 26), 0, 255)) for c in CLASSES[kind])
    box = (cx - r, cy - r, cx + r, cy + r)
    if kind == "circle":
        draw.ellipse(box, fill=colour)
    elif kind == "square":
        draw.rectangle(box, fill=colour)
    else:
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=colour)
    return im


def make_folder(root: Path) -> tuple[dict[str, str], str, str]:
    """The folder; (flipped file -> its true class, the planted copy, its original)."""
    rng = np.random.default_rng(0)
    for kind in CLASSES:
        for k in range(PER_CLASS):
            split = "train" if k < 14 else ("val" if k < 17 else "test")
            path = root / split / kind / f"{kind}-{k:02d}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            shape(kind, rng).save(path)
    flipped = {}
    for n, (split, drawn, filed) in enumerate(FLIPS):
        rel = f"{split}/{filed}/flipped-{n}.png"
        shape(drawn, rng).save(root / rel)
        flipped[rel] = drawn
    original, copy = "train/circle/circle-03.png", "test/circle/copy-of-circle-03.png"
    shutil.copyfile(root / original, root / copy)
    # A photo cut short by a failed copy: listed as unreadable, never embedded.
    (root / "train/square/cut-short.png").write_bytes((root / original).read_bytes()[:100])
    return flipped, copy, original


@pytest.fixture(scope="module")
def audited(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("audit")
    flipped, copy, original = make_folder(tmp / "shapes")
    mp = pytest.MonkeyPatch()
    mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp}/mlflow.db")
    args = ["audit", str(tmp / "shapes"), "--cache", str(tmp / "cache")]
    args += ["--params", str(REPO / "params.yaml")]
    try:
        first = cli.main([*args, "--out", str(tmp / "out1")])
        second = cli.main([*args, "--out", str(tmp / "out2"), "--no-track"])
    finally:
        mp.undo()
    with open(tmp / "out1" / "suspects.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    return {
        "tmp": tmp,
        "codes": (first, second),
        "rows": rows,
        "flipped": flipped,
        "copy": copy,
        "original": original,
        "summaries": [json.loads((tmp / o / "summary.json").read_text()) for o in ("out1", "out2")],
    }


def test_the_planted_faults_are_the_top_suspects(audited):
    assert audited["codes"] == (0, 0)
    rows = audited["rows"]
    assert rows[0]["file"] == audited["copy"]
    assert rows[0]["other_file"] == audited["original"]
    assert rows[0]["reason"] == "exact duplicate across splits (train -> test)"
    labels = [r for r in rows if r["reason"] == "label"]
    top = labels[: len(audited["flipped"])]
    assert {r["file"] for r in top} == set(audited["flipped"]), labels
    assert all(r["suggested_label"] == audited["flipped"][r["file"]] for r in top)
    assert rows.index(top[-1]) == len(top)  # the copy, then the flips: nothing between


def test_the_report_shows_thumbnails_and_mlflow_has_the_counts(audited):
    import mlflow

    page = (audited["tmp"] / "out1" / "report.html").read_text()
    assert page.count('<img src="data:image/png;base64,') >= 5  # 3 flips, the copy's pair
    summary = audited["summaries"][0]
    assert summary["images"] == 3 * PER_CLASS + len(audited["flipped"]) + 1
    assert summary["exact_duplicates_across_splits"] == 1
    assert summary["unreadable"] == 1
    [cut] = [r for r in audited["rows"] if r["file"] == "train/square/cut-short.png"]
    assert cut["reason"].startswith("unreadable: ")
    assert _line(summary).endswith(", 1 unreadable file(s)")  # the command's last line
    assert "unreadable" not in _line(summary | {"unreadable": 0})
    client = mlflow.MlflowClient(f"sqlite:///{audited['tmp']}/mlflow.db")
    [run] = client.search_runs(
        [e.experiment_id for e in client.search_experiments()], "tags.`trainyard.kind` = 'audit'"
    )
    assert run.data.metrics["audit/label_issues"] == summary["label_issues"] >= 3
    assert run.data.metrics["audit/exact_duplicates_across_splits"] == 1
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "audit")}
    assert {"audit/suspects.csv", "audit/report.html", "audit/summary.json"} <= artifacts


def test_a_second_audit_takes_every_embedding_from_the_cache(audited):
    first, second = audited["summaries"]
    # The copy has its original's bytes: one embedding for both.
    assert first["embedded"] == first["images"] - 1
    assert second["embedded"] == 0
    assert first["forward_passes"] >= 1 and second["forward_passes"] == 0
    with open(audited["tmp"] / "out2" / "suspects.csv", newline="") as fh:
        assert list(csv.DictReader(fh)) == audited["rows"]  # the same, from the cache


def test_the_cache_keeps_rows_by_content_and_ignores_unnamed_rows(tmp_path):
    cache = EmbeddingCache(tmp_path, "m/k", 2)
    cache.add(["a", "b", "a"], np.array([[1, 2], [3, 4], [9, 9]], np.float32))
    cache.save()
    again = EmbeddingCache(tmp_path, "m/k", 2)
    assert "b" in again and "c" not in again
    assert again.get(["b", "a"]).tolist() == [[3, 4], [1, 2]]
    # vectors written, hashes not (an interrupted save): the extra row is never read
    np.save(again.folder / "vectors.npy", np.zeros((5, 2), np.float32))
    assert len(EmbeddingCache(tmp_path, "m/k", 2).rows) == 2
    assert not EmbeddingCache(tmp_path, "other", 2).rows


def test_bad_input_exits_2_naming_the_folder(tmp_path, capsys):
    missing = tmp_path / "nowhere"
    assert cli.main(["audit", str(missing), "--no-track"]) == 2
    assert str(missing) in capsys.readouterr().err
    one = tmp_path / "one" / "only-class"
    one.mkdir(parents=True)
    shape("circle", np.random.default_rng(0)).save(one / "a.png")
    assert cli.main(["audit", str(tmp_path / "one"), "--no-track"]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "one") in err and "class" in err
    params = tmp_path / "params.yaml"
    text = (
        (REPO / "params.yaml").read_text().replace("folder: examples/shapes", f"folder: {missing}")
    )
    params.write_text(text)
    assert cli.main(["audit", "--params", str(params), "--no-track"]) == 2
    assert str(missing) in capsys.readouterr().err
