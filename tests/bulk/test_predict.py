"""trainyard predict (``trainyard.bulk``): bulk scoring as a user runs it.

A real ONNX model with a dataset card, real image files of many formats made here, and
the command run the way users run it (a process, killed for real); the answers are held
to the service's own for the same files, through its ASGI app.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from trainyard.bulk import command_line
from trainyard.bulk import predict_job as command
from trainyard.bulk.listing import list_inputs, parse_shard, shard_range
from trainyard.core.errors import DataError

from conftest import (
    REPO,
    make_card,
    make_photo_folder,
    pause_env,
    stage_env,
    wait_paused,
    write_tiny_onnx,
)

CLASSES = ("circle", "square", "triangle")
CARD = make_card(CLASSES, (3, 12, 12), (0.5, 0.4, 0.3), (0.25, 0.2, 0.3), resize="crop")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path, _weights = write_tiny_onnx(tmp_path_factory.mktemp("model"), CARD)
    return path


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("photos") / "photos"
    made = make_photo_folder(root, per_class=10, bad=True)
    return root, made


def job(source: Path | str, out: Path, model: Path, *extra: str) -> command.PredictOptions:
    parser = command_line.add_predict_arguments(argparse.ArgumentParser())
    args = [str(source), "--out", str(out), "--model", str(model), "--workers", "2"]
    parsed = parser.parse_args([*args, "--params", str(REPO / "params.yaml"), *extra])
    return command_line.predict_options(parsed)


def rows(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist()


def run_cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainyard.bulk", *args],
        capture_output=True,
        text=True,
        env=stage_env(),
        timeout=300,
        **kw,
    )


# ------------------------------------------------------------------ answers


def test_a_folder_is_scored_exactly_as_the_service_answers(model, photos, tmp_path):
    """Every probability of every row equals the service's /classify answer for the same
    file (to 1e-6), bad files are rows with their reason, labels come from subfolders."""
    import contextlib

    from test_serve_unit import service_client

    root, made = photos
    out = tmp_path / "scores.parquet"
    summary = command.predict(job(root, out, model, "--top-k", "3"))
    table = {r["path"]: r for r in rows(out)}
    assert sorted(table) == sorted(made["good"] + made["bad"])
    with contextlib.contextmanager(service_client)(model, top_k=3) as client:
        for rel in made["good"]:
            data = (root / rel).read_bytes()
            answer = client.post("/classify", files={"image": (rel, data)}).json()
            row = table[rel]
            assert row["error"] is None and row["label"] == answer["label"]
            served = {t["label"]: t["probability"] for t in answer["top_k"]}
            assert row["top_labels"] == [t["label"] for t in answer["top_k"]]
            bulk = dict(zip(row["top_labels"], row["top_probabilities"], strict=True))
            assert max(abs(bulk[k] - served[k]) for k in served) <= 1e-6, rel
            assert row["true_label"] == rel.split("/")[0]
    for rel in made["bad"]:
        assert table[rel]["label"] is None and table[rel]["error"], rel
    assert summary["bad_files"] == len(made["bad"]) == 3
    assert {b["path"] for b in summary["bad"]} == set(made["bad"])
    assert sum(summary["predicted"].values()) == summary["scored"] == len(made["good"])
    labels = summary["labels"]
    assert labels["from"] == "subfolder names" and labels["labelled"] == len(made["good"])
    right = sum(r["label"] == r["true_label"] for r in table.values() if r["error"] is None)
    assert labels["accuracy"] == pytest.approx(right / len(made["good"]))
    assert np.sum(labels["confusion"]["matrix"]) == len(made["good"])
    low = sum(r["probability"] < 0.5 for r in table.values() if r["error"] is None)
    assert summary["low_confidence"] == low
    assert {r["model_sha256"] for r in table.values()} == {summary["model"]["sha256"]}


def test_strict_stops_at_the_first_bad_file(model, photos, tmp_path):
    root, made = photos
    with pytest.raises(DataError, match="--strict stops at the first bad file") as err:
        command.predict(job(root, tmp_path / "s.parquet", model, "--strict"))
    assert any(bad in str(err.value) for bad in made["bad"])
    assert not (tmp_path / "s.parquet").exists()


def test_csv_list_and_glob_sources_and_a_csv_table(model, photos, tmp_path):
    root, made = photos
    good = made["good"]
    listing = tmp_path / "list.csv"
    lines = ["image,label"] + [f"{root / rel},{rel.split('/')[0]}" for rel in good[:8]]
    lines.append(f"{root / good[8]},giraffe")  # a label the model does not know
    listing.write_text("\n".join(lines) + "\n")
    summary = command.predict(job(listing, tmp_path / "c.csv", model))
    assert summary["source"]["kind"] == "csv" and summary["rows"] == 9
    labels = summary["labels"]
    assert labels["labelled"] == 8 and labels["not_model_classes"] == {"giraffe": 1}
    import csv

    with open(tmp_path / "c.csv", newline="") as fh:
        table = list(csv.DictReader(fh))
    assert [r["path"] for r in table] == [str(root / rel) for rel in good[:9]]
    assert len(json.loads(table[0]["top_labels"])) == 3  # top_k 5 of 3 classes

    paths = tmp_path / "paths.txt"
    paths.write_text("# a comment\n" + "\n".join(good[:5]) + "\n\nmissing.png\n")
    (root / "paths.txt").write_text(paths.read_text())
    listed = command.predict(job(root / "paths.txt", tmp_path / "l.parquet", model))
    assert listed["rows"] == 6 and listed["bad_files"] == 1
    assert "unreadable" in listed["bad"][0]["reason"] and listed["bad"][0]["path"] == "missing.png"
    (root / "paths.txt").unlink()

    globbed = list_inputs(f"{root}/circle/*.png")
    assert globbed.kind == "glob" and globbed.names == sorted(globbed.names)
    assert globbed.names and all(n.endswith(".png") for n in globbed.names)


def test_bad_sources_and_options_are_named(model, photos, tmp_path):
    root, _made = photos
    with pytest.raises(DataError, match="no such folder or file"):
        list_inputs(str(tmp_path / "nope"))
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(DataError, match="not a folder, a CSV"):
        list_inputs(str(tmp_path / "x.json"))
    (tmp_path / "no-image.csv").write_text("file,label\na.png,cat\n")
    with pytest.raises(DataError, match="no column 'image'"):
        list_inputs(str(tmp_path / "no-image.csv"))
    for bad in ("2/2", "a/b", "-1/3", "1"):
        with pytest.raises(DataError, match="0 <= K < N"):
            parse_shard(bad)
    with pytest.raises(DataError, match=r"write \.parquet"):
        command.predict(job(root, tmp_path / "s.xlsx", model))
    with pytest.raises(DataError, match="top_k"):
        command.predict(job(root, tmp_path / "s.parquet", model, "--top-k", "0"))
    model_copy = tmp_path / "m" / "model.onnx"
    model_copy.parent.mkdir()
    model_copy.write_bytes(model.read_bytes() + b"\0")
    model_copy.with_name("model.onnx.sha256").write_text(
        model.with_name("model.onnx.sha256").read_text()
    )
    from trainyard.core.errors import ModelError

    with pytest.raises(ModelError, match="does not match"):
        command.predict(job(root, tmp_path / "s.parquet", model_copy))


def test_shards_are_contiguous_and_cover_every_row():
    for total in (0, 1, 7, 100, 101):
        for n in (1, 2, 3, 8):
            ranges = [shard_range(total, k, n) for k in range(n)]
            assert ranges[0][0] == 0 and ranges[-1][1] == total
            assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))


def test_the_fingerprint_taken_ahead_is_the_fingerprint(tmp_path):
    """Taken in a thread while the model loads, the fingerprint is the one computed in
    place, and a file changed afterwards is not hidden by it (a new listing sees it)."""
    from trainyard.data.fingerprint import stat_fingerprint

    for i in range(30):
        Image.new("L", (8, 8), i).save(tmp_path / f"{i:02d}.png")
    ahead = list_inputs(str(tmp_path))
    ahead.fingerprint_ahead()
    ahead.fingerprint_ahead()  # a second call starts nothing more
    files = sorted(str(p) for p in tmp_path.glob("*.png"))
    assert ahead.fingerprint() == stat_fingerprint(files, tmp_path)
    assert ahead.fingerprint() == list_inputs(str(tmp_path)).fingerprint()
    (tmp_path / "07.png").write_bytes((tmp_path / "08.png").read_bytes() + b"changed")
    assert list_inputs(str(tmp_path)).fingerprint() != ahead.fingerprint()


# ------------------------------------------------------------------ many files, processes


@pytest.fixture(scope="module")
def many(tmp_path_factory) -> Path:
    """600 photo-sized JPEGs (and some PNGs) in class folders: a run lasts long enough to
    be killed in its middle."""
    root = tmp_path_factory.mktemp("many") / "many"
    rng = np.random.default_rng(1)
    base = rng.integers(0, 256, (240, 320, 3), dtype=np.uint8)
    for i in range(600):
        cls = CLASSES[i % 3]
        (root / cls).mkdir(parents=True, exist_ok=True)
        img = Image.fromarray(np.roll(base, i, axis=1))
        img.save(root / cls / f"{i:04d}.{'png' if i % 10 == 0 else 'jpg'}")
    return root


def test_a_killed_run_continues_and_ends_with_the_same_file(model, many, tmp_path):
    """SIGKILL mid-run, then the same command: the same bytes as an uninterrupted run; a
    Ctrl-C keeps the chunks too and says so. Each signal lands once the run has written
    its third chunk (announced at the pause point ``predict.chunk_written``)."""
    common = ["--model", str(model), "--chunk-rows", "20", "--workers", "1", "--batch-size", "4"]
    whole = run_cli(str(many), "--out", str(tmp_path / "whole.parquet"), *common)
    assert whole.returncode == 0, whole.stderr

    out = tmp_path / "killed.parquet"
    parts = tmp_path / ".killed.parquet.parts"
    for sig in (signal.SIGKILL, signal.SIGINT):
        announce = tmp_path / f"{sig.name}.paused"
        proc = subprocess.Popen(
            [sys.executable, "-m", "trainyard.bulk", str(many), "--out", str(out), *common],
            env=pause_env("predict.chunk_written:3", announce),
            stderr=subprocess.PIPE,
            text=True,
        )
        wait_paused(announce, proc, lambda p=proc: p.communicate()[1])
        os.kill(proc.pid, sig)
        _, err = proc.communicate(timeout=60)
        assert not out.exists()
        if sig == signal.SIGINT:
            assert proc.returncode == 130, err
            assert "continuing an interrupted run: 3 of 30 chunk(s)" in err
            assert "rerun the same command to continue" in err
    kept = len(list(parts.glob("chunk-*.parquet")))
    assert kept == 6  # three chunks from each interrupted run
    rerun = run_cli(str(many), "--out", str(out), *common)
    assert rerun.returncode == 0, rerun.stderr
    assert f"continuing an interrupted run: {kept} of 30 chunk(s)" in rerun.stderr
    assert out.read_bytes() == (tmp_path / "whole.parquet").read_bytes()
    assert not parts.exists()
    summary = json.loads((tmp_path / "killed.summary.json").read_text())
    assert summary["resumed_rows"] == 20 * kept and summary["rows"] == 600


def test_a_changed_source_is_not_continued(model, many, tmp_path):
    out = tmp_path / "s.parquet"
    store = command.engine.ChunkStore(out, {"source_fingerprint": "old"})
    store.open()
    store.write(0, pq.read_table(_one_chunk(model, many, tmp_path)))
    summary = command.predict(job(many, out, model, "--chunk-rows", "20"))
    assert summary["resumed_rows"] == 0 and summary["rows"] == 600


def _one_chunk(model, many, tmp_path) -> Path:
    out = tmp_path / "one.parquet"
    command.predict(job(many, out, model, "--chunk-rows", "20"))
    return out


def test_two_shards_as_two_processes_merge_into_the_single_run(model, many, tmp_path):
    common = ["--model", str(model), "--chunk-rows", "64", "--workers", "1"]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "trainyard.bulk",
                str(many),
                "--shard",
                f"{k}/2",
                "--out",
                str(tmp_path / f"part-{k}.parquet"),
                *common,
            ],
            env=stage_env(),
            stderr=subprocess.PIPE,
            text=True,
        )
        for k in range(2)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
    single = run_cli(str(many), "--out", str(tmp_path / "single.parquet"), *common)
    assert single.returncode == 0, single.stderr
    # any order on the command line
    merge = run_cli("merge", str(tmp_path / "part-1.parquet"), str(tmp_path / "part-0.parquet"))
    assert merge.returncode == 2  # --out is required
    merge = run_cli(
        "merge",
        str(tmp_path / "part-1.parquet"),
        str(tmp_path / "part-0.parquet"),
        "--out",
        str(tmp_path / "merged.parquet"),
    )
    assert merge.returncode == 0, merge.stderr
    assert pq.read_table(tmp_path / "merged.parquet").equals(
        pq.read_table(tmp_path / "single.parquet")
    )
    merged = json.loads((tmp_path / "merged.summary.json").read_text())
    alone = json.loads((tmp_path / "single.summary.json").read_text())
    for key in ("rows", "scored", "predicted", "low_confidence", "labels"):
        assert merged[key] == alone[key], key
    one_missing = run_cli(
        "merge", str(tmp_path / "part-1.parquet"), "--out", str(tmp_path / "m.parquet")
    )
    assert one_missing.returncode == 1 and "missing [0]" in one_missing.stderr


def test_phone_formats_and_urls_are_scored_like_files(model, tmp_path):
    """HEIC and AVIF files in a folder, and the same images as URLs in a CSV (a real HTTP
    server on loopback; one URL missing): the same answers as from the files."""
    import http.server
    import threading

    from test_phone_formats import encode, scene

    folder = tmp_path / "phone" / "circle"
    folder.mkdir(parents=True)
    for i, fmt in enumerate(("HEIF", "AVIF", "JPEG")):
        ext = {"HEIF": "heic", "AVIF": "avif", "JPEG": "jpg"}[fmt]
        (folder / f"p{i}.{ext}").write_bytes(encode(Image.fromarray(scene(64, 48, i)), fmt))
    files = command.predict(job(folder.parent, tmp_path / "f.parquet", model))
    assert files["scored"] == 3 and files["bad_files"] == 0

    handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=str(folder))  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_port}"
        names = sorted(p.name for p in folder.iterdir())
        listing = tmp_path / "urls.csv"
        lines = [f"{base}/{n},circle" for n in names] + [f"{base}/gone.jpg,circle"]
        listing.write_text("image,label\n" + "\n".join(lines) + "\n")
        urls = command.predict(job(listing, tmp_path / "u.parquet", model))
    finally:
        server.shutdown()
    by_file = {r["path"]: r["top_probabilities"] for r in rows(tmp_path / "f.parquet")}
    by_url = {r["path"]: r for r in rows(tmp_path / "u.parquet")}
    for name in names:
        assert by_url[f"{base}/{name}"]["top_probabilities"] == by_file[f"circle/{name}"]
    assert "HTTP 404" in by_url[f"{base}/gone.jpg"]["error"]
    assert urls["bad_files"] == 1 and urls["labels"]["accuracy"] is not None


def test_a_worker_that_dies_is_an_error_that_says_how_to_continue(model, many, tmp_path):
    """A decode worker killed mid-run (the OOM killer, an operator): one line naming it,
    exit 1, the chunks kept; the rerun continues."""
    out = tmp_path / "w.parquet"
    args = [str(many), "--out", str(out), "--model", str(model), "--chunk-rows", "20"]
    announce = tmp_path / "w.paused"
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainyard.bulk", *args, "--workers", "1"],
        env=pause_env("predict.chunk_written:2", announce),
        stderr=subprocess.PIPE,
        text=True,
    )
    # Paused once its second chunk is written, its workers busy with the next ones.
    wait_paused(announce, proc, lambda: proc.communicate()[1])
    servers = children_of(proc.pid)  # the forkserver (and resource tracker)
    workers = [pid for server in servers for pid in children_of(server)]
    assert workers, "no decode worker found"
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    announce.unlink()  # the run goes on, and finds its workers gone
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    assert "a decode worker died" in err and "rerun the same command to continue" in err
    assert "Traceback" not in err
    rerun = run_cli(*args)
    assert rerun.returncode == 0 and "continuing an interrupted run" in rerun.stderr


def children_of(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found
