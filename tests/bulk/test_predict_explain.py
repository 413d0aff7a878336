"""trainyard predict --explain: a heatmap PNG per scored row beside the table, each the
service's own heatmap for the same file (/classify?explain=1, through its ASGI app), the
same whether the decode workers or this process score, after a kill and a rerun, and
split over shards. A model exported before the maps is refused, naming --explain.
"""

from __future__ import annotations

import base64
import contextlib
import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image, ImageOps
from test_predict import CARD, CLASSES, job, rows, run_cli

from trainyard.bulk import command_line
from trainyard.bulk import predict_job as command
from trainyard.bulk.where_to_score import Place

from conftest import make_photo_folder, pause_env, wait_paused, write_tiny_onnx


@pytest.fixture(scope="module")
def cam_model(tmp_path_factory) -> Path:
    path, _ = write_tiny_onnx(tmp_path_factory.mktemp("cam-model"), CARD, cam=True)
    return path


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("photos") / "photos"
    made = make_photo_folder(root, per_class=4, bad=True)
    # A phone photo stored 30 wide, 50 high, shown turned (EXIF orientation 6): 50 x 30.
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.new("RGB", (30, 50), (200, 10, 10)).save(root / CLASSES[0] / "turned.jpg", exif=exif)
    made["good"].append(f"{CLASSES[0]}/turned.jpg")
    return root, made


@pytest.fixture(scope="module")
def few(tmp_path_factory) -> Path:
    """60 small photos in class folders: a run of several chunks."""
    root = tmp_path_factory.mktemp("few") / "few"
    rng = np.random.default_rng(2)
    for i in range(60):
        (root / CLASSES[i % 3]).mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 256, (30 + i % 7, 40 + i % 5, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / CLASSES[i % 3] / f"{i:03d}.png")
    return root


def heatmap_files(out: Path) -> dict[str, bytes]:
    folder = out.with_name(out.stem + ".heatmaps")
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.png"))}


@pytest.mark.parametrize("where", ["workers", "inline"])
def test_every_scored_row_gets_the_services_heatmap(
    cam_model, photos, tmp_path, where, monkeypatch
):
    from test_serve_unit import service_client

    if where == "inline":  # decoded by a thread here, scored here (as on a GPU)
        monkeypatch.setattr(command, "where_to_score", lambda *a: Place(True, "a test"))
    root, made = photos
    out = tmp_path / "scores.parquet"
    summary = command.predict(job(root, out, cam_model, "--explain", "--chunk-rows", "16"))
    table = {r["path"]: r for r in rows(out)}
    assert ("a test" if where == "inline" else "worker") in summary["speed"]["place"]
    files = heatmap_files(out)
    assert len(files) == len(made["good"]) == summary["scored"]
    with contextlib.contextmanager(service_client)(cam_model) as client:
        for rel in made["good"]:
            row = table[rel]
            assert row["heatmap"].startswith("scores.heatmaps/"), row
            written = (out.parent / row["heatmap"]).read_bytes()
            data = (root / rel).read_bytes()
            answer = client.post("/classify?explain=1", files={"image": (rel, data)}).json()
            assert answer["label"] == row["label"]
            assert written == base64.b64decode(answer["heatmap"]), rel  # the same PNG
            with Image.open(io.BytesIO(data)) as shown:
                size = ImageOps.exif_transpose(shown).size
            assert Image.open(io.BytesIO(written)).size == size, rel
    assert Image.open(out.parent / table[f"{CLASSES[0]}/turned.jpg"]["heatmap"]).size == (50, 30)
    for rel in made["bad"]:
        assert table[rel]["heatmap"] is None and table[rel]["error"], rel


def test_without_explain_there_is_no_heatmap(cam_model, photos, tmp_path):
    root, _ = photos
    out = tmp_path / "plain.parquet"
    command.predict(job(root, out, cam_model))
    assert "heatmap" not in pq.read_schema(out).names
    assert not out.with_name("plain.heatmaps").exists()


def test_a_model_without_maps_is_refused_naming_explain(photos, tmp_path, capsys):
    root, _ = photos
    old, _ = write_tiny_onnx(tmp_path / "old", CARD)
    out = tmp_path / "scores.parquet"
    assert command_line.run_predict(job(root, out, old, "--explain")) == 1
    err = capsys.readouterr().err
    assert "--explain:" in err and "without its class activation map output 'cam'" in err
    assert not out.exists()


def test_a_killed_explaining_run_continues_with_every_heatmap(cam_model, few, tmp_path):
    common = ["--model", str(cam_model), "--chunk-rows", "16", "--workers", "1", "--explain"]
    whole = run_cli(str(few), "--out", str(tmp_path / "whole.parquet"), *common)
    assert whole.returncode == 0, whole.stderr
    out = tmp_path / "killed.parquet"
    announce = tmp_path / "paused"
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainyard.bulk", str(few), "--out", str(out), *common],
        env=pause_env("predict.chunk_written:2", announce),
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_paused(announce, proc, lambda: proc.communicate()[1])
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert len(heatmap_files(out)) >= 32  # two chunks' heatmaps, maybe some of the third
    rerun = run_cli(str(few), "--out", str(out), *common)
    assert rerun.returncode == 0, rerun.stderr
    assert "continuing an interrupted run: 2 of 4 chunk(s)" in rerun.stderr
    assert [r["heatmap"].replace("killed", "whole") for r in rows(out)] == [
        r["heatmap"] for r in rows(tmp_path / "whole.parquet")
    ]
    assert heatmap_files(out) == heatmap_files(tmp_path / "whole.parquet")
    assert len(heatmap_files(out)) == 60
    # Without --explain the same command is another job: it starts over, no heatmaps.
    plain = run_cli(str(few), "--out", str(out), *common[:-1])
    assert plain.returncode == 0 and "continuing" not in plain.stderr


def test_shards_name_heatmaps_by_the_sources_row(cam_model, few, tmp_path):
    for k in range(2):
        out = tmp_path / f"part-{k}.parquet"
        command.predict(job(few, out, cam_model, "--explain", "--shard", f"{k}/2"))
    single = tmp_path / "single.parquet"
    command.predict(job(few, single, cam_model, "--explain"))
    parts = {
        **heatmap_files(tmp_path / "part-0.parquet"),
        **heatmap_files(tmp_path / "part-1.parquet"),
    }
    assert parts == heatmap_files(single)
    assert sorted(heatmap_files(tmp_path / "part-1.parquet"))[0] == "0000030.png"
    names = [
        r["heatmap"].split("/")[1] for k in range(2) for r in rows(tmp_path / f"part-{k}.parquet")
    ]
    assert names == [r["heatmap"].split("/")[1] for r in rows(single)]
