"""``trainyard label push|pull`` against a real Label Studio server (``.venv-labelstudio``,
which ``make test`` creates), started once for the module on a free loopback port.

A made-here folder with labels flipped on purpose and a prediction log with served images
is pushed (twice: nothing doubles), a scripted reviewer answers every task through the API
with the true label, and the pull moves the flipped files home, adds the served images and
writes the manifest. A pull killed between two renames (a test-only pause, never a race)
leaves every file in its old place or its new one, and the next pull finishes it. Bad
input: an answer that is not a class refuses the whole pull, naming the task; a server
that is not there is named by its URL.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import signal
import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from trainyard.review.label_files import JOURNAL, MANIFEST
from trainyard.track import label_studio_server as server
from trainyard.track.label_studio import LabelStudio
from trainyard.watch.log import SCHEMA

from conftest import REPO, VENV_BIN, free_port, pause_env, stage_env, stop_group, wait_paused

pytestmark = pytest.mark.slow
VENV = Path(os.environ.get("TRAINYARD_LABEL_STUDIO_VENV", REPO / ".venv-labelstudio"))
TOKEN = "trainyard-test-token-4242"
CLASSES = ("circle", "square", "stripe")
FLIPPED = {"circle/c3.png": "square", "square/s1.png": "stripe", "stripe/t0.png": "circle"}


@pytest.fixture(scope="module")
def label_studio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabelStudio]:
    if not (VENV / "bin" / "label-studio").exists():
        pytest.fail(f"no {VENV}: `make label-studio-venv` (make test creates it)")
    root = tmp_path_factory.mktemp("label-studio")
    port = free_port()
    proc = server.start(VENV, port, root / "data", TOKEN, log=root / "server.log")
    url = f"http://127.0.0.1:{port}"
    try:
        server.wait_up(url, proc, timeout=400)
        yield LabelStudio(url, TOKEN)
    finally:
        stop_group(proc, timeout=20)


def _png(seed: int, shape: str) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 60, (24, 24, 3), dtype=np.uint8)
    if shape == "square":
        pixels[6:18, 6:18] = 230
    elif shape == "stripe":
        pixels[:, 10:14] = 230
    else:
        yy, xx = np.mgrid[:24, :24]
        pixels[(yy - 12) ** 2 + (xx - 12) ** 2 < 36] = 230
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def make_folder(root: Path, seed: int) -> dict[str, str]:
    """Four images a class, three of them filed under the wrong class; sha256 -> truth.
    Also the audit's CSV (its columns) naming the three and two correct ones, and a
    prediction log with three served images (two unsure or disputed, one sure)."""
    truth = {}
    for k, name in enumerate(CLASSES):
        for i in range(4):
            rel = f"{name}/{name[0] if name != 'stripe' else 't'}{i}.png"
            data = _png(seed * 100 + k * 10 + i, name)
            filed = FLIPPED.get(rel, name)
            path = root / "photos" / filed / Path(rel).name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            truth[hashlib.sha256(data).hexdigest()] = name
    rows = [(f"{FLIPPED[r]}/{Path(r).name}", FLIPPED[r], r.split("/")[0]) for r in FLIPPED]
    rows += [("circle/c0.png", "circle", "square"), ("square/s0.png", "square", "circle")]
    with (root / "suspects.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["file", "reason", "given_label", "suggested_label", "score", "split"])
        for i, (rel, given, suggested) in enumerate(rows):
            w.writerow([rel, "label", given, suggested, f"{0.9 - i / 10:.2f}", "train"])
        w.writerow(["circle/c1.png", "outlier", "circle", "", "7.0", "train"])  # not sent
    served = [
        ("square", 0.41, None, 77),
        ("circle", 0.97, "stripe", 78),
        ("stripe", 0.99, None, 79),
    ]
    log_rows = []
    for label, p, shadow, seed_i in served:
        true = shadow or label
        data = _png(seed * 100 + seed_i, true)
        truth[hashlib.sha256(data).hexdigest()] = true
        log_rows.append(
            {"time": datetime.now(UTC), "label": label, "probability": p, "image": data}
            | {"shadow_label": shadow, "format": "PNG", "model_version": "abc123"}
        )
    (root / "log").mkdir()
    pq.write_table(
        pa.Table.from_pylist(log_rows, schema=SCHEMA), root / "log" / "predictions-1.parquet"
    )
    return truth


def label(root: Path, action: str, url: str, *extra: str, env: dict | None = None, **kw):
    cmd = [str(VENV_BIN / "trainyard"), "label", action, str(root / "photos"), "--url", url]
    cmd += ["--params", str(REPO / "params.yaml"), *extra]
    if action == "push":
        cmd += ["--suspects", str(root / "suspects.csv"), "--log", str(root / "log")]
    run_env = env or stage_env(LABEL_STUDIO_USER_TOKEN=TOKEN)
    return subprocess.run(cmd, env=run_env, capture_output=True, text=True, timeout=300, **kw)


def project_tasks(client: LabelStudio, title: str) -> list[dict]:
    project = client.project(title)
    assert project is not None, title
    return list(client.tasks(project["id"]))


def review(client: LabelStudio, title: str, truth: dict[str, str], wrong: dict | None = None):
    """The scripted reviewer: every task answered with its image's true label."""
    for task in project_tasks(client, title):
        answer = (wrong or {}).get(task["data"]["file"]) or truth[task["data"]["trainyard_sha256"]]
        client.annotate(task["id"], answer)


def images(folder: Path) -> dict[str, str]:
    """rel path -> sha256 of every image in the folder (the manifest's folder passed over)."""
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in folder.rglob("*.png")
        if ".trainyard" not in p.parts
    }


def test_push_review_pull_moves_the_flipped_files_and_adds_served_ones(label_studio, tmp_path):
    truth = make_folder(tmp_path, seed=1)
    url, title = label_studio.url, "trainyard: photos"
    first = label(tmp_path, "push", url)
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["added"] == 7  # 5 label suspects + 2 served
    again = label(tmp_path, "push", url)
    assert (json.loads(again.stdout)["added"], json.loads(again.stdout)["already_there"]) == (0, 7)
    tasks = project_tasks(label_studio, title)
    assert len(tasks) == 7
    preset = {t["data"]["file"]: t["predictions"][0]["result"][0]["value"] for t in tasks}
    assert preset["square/c3.png"] == {"choices": ["circle"]}  # the audit's suggestion
    assert sorted(t["data"]["why"] for t in tasks if t["data"]["source"] == "served") == [
        "served: p=0.41",
        "served: shadow said stripe",
    ]

    review(label_studio, title, truth)
    pulled = label(tmp_path, "pull", url)
    assert pulled.returncode == 0, pulled.stderr
    assert "dvc add" in pulled.stdout
    folder = tmp_path / "photos"
    for rel, sha in images(folder).items():  # every file under its true class
        assert truth[sha] == rel.split("/")[0], rel
    assert len(images(folder)) == 14
    lines = [json.loads(x) for x in (folder / MANIFEST).read_text().splitlines()]
    assert sorted(r["action"] for r in lines) == ["added"] * 2 + ["kept"] * 2 + ["moved"] * 3
    moved = {r["file"]: (r["old_label"], r["new_label"], r["to"]) for r in lines if r["file"]}
    assert moved["square/c3.png"] == ("square", "circle", "circle/c3.png")
    assert {r["reviewer"] for r in lines} == {server.DEFAULT_USER}
    assert all(r["task"] and r["reviewed_at"] and r["why"] for r in lines)

    rerun = label(tmp_path, "pull", url)  # nothing new: nothing moves, nothing doubles
    assert json.JSONDecoder().raw_decode(rerun.stdout)[0]["moved"] == 0
    assert len((folder / MANIFEST).read_text().splitlines()) == 7


def test_a_pull_killed_between_renames_is_finished_by_the_next(label_studio, tmp_path):
    truth = make_folder(tmp_path, seed=2)
    url, title = label_studio.url, "interrupted"
    assert label(tmp_path, "push", url, "--project", title).returncode == 0
    review(label_studio, title, truth)
    folder = tmp_path / "photos"
    before = images(folder)
    announce = tmp_path / "paused"
    env = pause_env("label.pull.apply:3", announce, LABEL_STUDIO_USER_TOKEN=TOKEN)
    cmd = [str(VENV_BIN / "trainyard"), "label", "pull", str(folder), "--url", url]
    cmd += ["--project", title, "--params", str(REPO / "params.yaml")]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    pid = wait_paused(announce, proc, lambda: proc.stdout.read().decode())
    os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=30)

    journal = json.loads((folder / JOURNAL).read_text())
    assert len(journal["ops"]) == 5  # 3 moves, 2 served images
    now = images(folder)
    done = [op for op in journal["ops"] if op["to"] in now]
    assert len(done) == 2  # two renames made, three to go: every file in one place or other
    for op in journal["ops"]:
        assert (op["from"] in now or (folder / op["from"]).exists()) != (op["to"] in now)
    assert set(before.values()) <= set(now.values())
    assert not (folder / MANIFEST).exists()

    rerun = label(tmp_path, "pull", url, "--project", title)
    assert rerun.returncode == 0, rerun.stderr
    assert not (folder / JOURNAL).exists()
    final = images(folder)
    assert len(final) == 14 and all(op["to"] in final for op in journal["ops"])
    assert len((folder / MANIFEST).read_text().splitlines()) == 7


def test_an_answer_that_is_not_a_class_refuses_the_pull_naming_the_task(label_studio, tmp_path):
    truth = make_folder(tmp_path, seed=3)
    url, title = label_studio.url, "bad answer"
    assert label(tmp_path, "push", url, "--project", title).returncode == 0
    review(label_studio, title, truth, wrong={"circle/c0.png": "zebra"})
    bad = next(
        t for t in project_tasks(label_studio, title) if t["data"]["file"] == "circle/c0.png"
    )
    before = images(tmp_path / "photos")
    pulled = label(tmp_path, "pull", url, "--project", title)
    assert pulled.returncode == 2
    assert (
        f"task {bad['id']}: the answer 'zebra' is not one of the folder's classes" in pulled.stderr
    )
    assert images(tmp_path / "photos") == before
    assert not (tmp_path / "photos" / ".trainyard" / "labels.jsonl").exists()


def test_a_server_that_is_not_there_is_named(tmp_path):
    make_folder(tmp_path, seed=4)
    url = f"http://127.0.0.1:{free_port()}"
    for action in ("push", "pull"):
        done = label(tmp_path, action, url)
        assert done.returncode == 1
        assert f"Label Studio at {url} is not reachable" in done.stderr
