"""A teammate gets the trained model: `git clone` + `dvc pull` and nothing needs to run.

The pipeline runs once (small slice, 1 epoch) in a temp copy of the repository, which is
committed and pushed to a real DVC remote (a local folder). A second `git clone` then
pulls, finds the pipeline up to date (`dvc repro` runs no stage, without any MLflow store)
and `make serve` there serves the pulled model with the sha256 the export recorded.
"""

from __future__ import annotations

import csv
import io
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests
import yaml
from PIL import Image
from test_serving import wait_ready

from trainyard.core.handoffs import EXPORT_RECORD, REGISTRY_RECORD, TRAIN_RECORD
from trainyard.core.io import sha256_file
from trainyard.data.idx import read_idx
from trainyard.runtime.model_file import CARD_FILES, CARD_SUFFIXES

from conftest import (
    EVALUATE_REPORTS,
    VENV_BIN,
    copy_reproduced,
    dvc,
    free_port,
    git_env,
    stop_group,
)

pytestmark = pytest.mark.slow
STAGES = ("fetch", "prepare", "train", "export", "evaluate")
# Large binaries: in the DVC cache and the remote, never in git.
CACHED = (
    "data/raw",
    "data/prepared",
    "models/best.ckpt",
    "models/model.onnx",
    "models/model.reference.npz",
    *(f"models/model{suffix}" for suffix in CARD_SUFFIXES.values()),  # the model card
)
# The small `cache: false` outs: committed to git beside dvc.lock.
IN_GIT = (
    str(TRAIN_RECORD),
    "models/history.csv",
    "models/model.onnx.sha256",
    str(EXPORT_RECORD),
    *EVALUATE_REPORTS,
    *(f"reports/{name}" for name in CARD_FILES.values()),
    str(REGISTRY_RECORD),
)


def git(repo: Path, *args: str) -> str:
    proc = subprocess.run(
        ["git", *args], cwd=repo, env=git_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"git {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def ran(output: str) -> set[str]:
    return {s for s in STAGES if f"Running stage '{s}'" in output}


def declared_outs(repo: Path) -> dict[str, bool]:
    """Every out of dvc.yaml: {path: cached?}."""
    stages = yaml.safe_load((repo / "dvc.yaml").read_text())["stages"]
    outs: dict[str, bool] = {}
    for stage in stages.values():
        for out in stage.get("outs", []):
            if isinstance(out, str):
                outs[out] = True
            else:
                (path, opts), *_ = out.items()
                outs[path] = (opts or {}).get("cache", True)
    return outs


@pytest.fixture(scope="module")
def team(reproduced_pipeline, tmp_path_factory) -> SimpleNamespace:
    tmp = tmp_path_factory.mktemp("team")
    origin = copy_reproduced(reproduced_pipeline, tmp / "origin")
    first = (reproduced_pipeline.parent / "first_repro.log").read_text()
    assert ran(first) == set(STAGES), first[-3000:]
    dvc(origin, "remote", "add", "-d", "shared", str(tmp / "remote"))
    git(origin, "add", "-A")
    git(origin, "commit", "-qm", "pipeline outputs and the shared DVC remote")
    dvc(origin, "push")
    clone = tmp / "clone"
    git(tmp, "clone", "-q", str(origin), str(clone))
    before_pull = {p for p in (*CACHED, *IN_GIT) if (clone / p).exists()}
    pulled = dvc(clone, "pull")
    return SimpleNamespace(
        tmp=tmp, origin=origin, clone=clone, before_pull=before_pull, pulled=pulled
    )


def test_git_holds_the_small_outputs_and_the_cache_the_large_ones(team):
    outs = declared_outs(team.origin)
    assert {p for p, cached in outs.items() if not cached} == set(IN_GIT)
    assert {p for p, cached in outs.items() if cached} == set(CACHED)
    tracked = set(git(team.origin, "ls-files").splitlines())
    assert set(IN_GIT) <= tracked
    assert {"dvc.lock", ".dvc/config", "params.yaml"} <= tracked
    big = [f for f in tracked if f in CACHED or f.startswith(("data/", "mlflow.db", "mlruns/"))]
    assert big == [], big
    assert git(team.origin, "status", "--porcelain") == ""  # nothing left out of git
    for rel in IN_GIT:
        path = team.origin / rel
        assert path.stat().st_size < 1_000_000, rel
        if path.suffix != ".png":  # nothing machine-specific: no paths of this checkout
            assert str(team.tmp) not in path.read_text(), rel
    # A fresh clone has the small outputs from git and none of the large ones.
    assert team.before_pull == set(IN_GIT)
    assert "remote = shared" in (team.clone / ".dvc/config").read_text()


def test_clone_after_dvc_pull_is_up_to_date_and_repro_runs_nothing(team):
    clone = team.clone
    for rel in (*CACHED, *IN_GIT):
        assert (clone / rel).exists(), rel
    status = dvc(clone, "status", "dvc.yaml")
    assert "Data and pipelines are up to date." in status.stdout, status.stdout
    # Repository-wide, only the on-demand benchmark (benchmarks/dvc.yaml, never run here and
    # with no lock in git: its outs are one machine's timings) is listed as not run.
    everything = dvc(clone, "status").stdout
    headers = [line for line in everything.splitlines() if line and not line[0].isspace()]
    assert headers == ["benchmarks/dvc.yaml:bench:"], everything
    lock = (clone / "dvc.lock").read_text()
    out = dvc(clone, "repro")
    assert ran(out.stdout) == set(), out.stdout
    for stage in STAGES:
        assert f"Stage '{stage}' didn't change, skipping" in out.stdout, out.stdout
    assert "Data and pipelines are up to date." in out.stdout, out.stdout
    assert (clone / "dvc.lock").read_text() == lock
    assert git(clone, "status", "--porcelain") == ""
    # No MLflow store came with the clone, and none was needed.
    assert not (clone / "mlflow.db").exists() and not (clone / "mlruns").exists()


def test_pulled_model_is_the_exported_one(team):
    recorded = (team.clone / "models/model.onnx.sha256").read_text().split()[0]
    assert sha256_file(team.clone / "models/model.onnx") == recorded
    assert recorded == sha256_file(team.origin / "models/model.onnx")
    assert sha256_file(team.clone / "models/best.ckpt") == sha256_file(
        team.origin / "models/best.ckpt"
    )


def test_make_serve_in_the_clone_serves_the_pulled_model(team, fashion_dir):
    clone, sha = team.clone, sha256_file(team.clone / "models/model.onnx")
    port = free_port()
    venv = VENV_BIN.parent
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINYARD_")}
    env.update(BENTOML_HOME=str(team.tmp / "bentoml-home"), BENTOML_DO_NOT_TRACK="true")
    # `make serve` as the teammate types it, with this venv: -o keeps make from
    # reinstalling it (the clone's pyproject.toml is newer than the venv's stamp).
    cmd = ["make", "-o", f"{venv}/.installed", "serve", f"VENV={venv}", f"SERVE_PORT={port}"]
    log = team.tmp / "serve.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            cmd, cwd=clone, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        tail = lambda: log.read_text()[-4000:]  # noqa: E731 - what make serve said
        assert wait_ready(url, proc, 120, tail), f"not ready:\n{tail()}"
        meta = requests.get(f"{url}/metadata", timeout=10).json()
        assert meta["model"]["sha256"] == sha
        assert Path(meta["model"]["path"]).resolve() == (clone / "models/model.onnx").resolve()
        images = read_idx(fashion_dir / "t10k-images-idx3-ubyte.gz")[:8]
        with open(clone / "reports/predictions.csv", newline="", encoding="utf-8") as fh:
            evaluated = [row["predicted"] for row in csv.DictReader(fh)][:8]
        served = []
        for img in images:
            buf = io.BytesIO()
            Image.fromarray(img).save(buf, format="PNG")
            files = {"image": ("image.png", buf.getvalue(), "image/png")}
            resp = requests.post(f"{url}/classify", files=files, timeout=30)
            assert resp.status_code == 200, resp.text
            assert resp.json()["model_version"] == sha[:12]
            served.append(resp.json()["label"])
        # The served model answers as the evaluate stage recorded in git.
        assert served == evaluated
    finally:
        stop_group(proc)
