"""Tracking store checks: a dead server fails fast with its URI named; experiments are
tagged so MLflow's UI opens them as model training."""

from __future__ import annotations

import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from trainyard.core.errors import TrackingError
from trainyard.track.lineage import git_state
from trainyard.track.store import (
    EXPERIMENT_KIND_TAG,
    MODEL_TRAINING,
    check_tracking_uri,
    ensure_experiment,
    resolve_tracking_uri,
)

from conftest import REPO, git_env


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again on exit: nothing listens there


@pytest.mark.timeout(30)
def test_unreachable_server_is_named():
    uri = f"http://127.0.0.1:{_dead_port()}"
    with pytest.raises(TrackingError, match=rf"{uri} is not reachable"):
        check_tracking_uri(uri, timeout=3)


def test_sqlite_in_missing_folder(tmp_path):
    with pytest.raises(TrackingError, match="does not exist"):
        check_tracking_uri(f"sqlite:///{tmp_path}/nope/mlflow.db")


def test_a_store_of_another_mlflow_version_says_which_one_to_upgrade(tmp_path):
    """A newer MLflow upgrades an embedded store's tables when it opens them; this one
    then cannot read it. MLflow's own message says `mlflow db upgrade` either way."""
    import sqlite3

    import mlflow.store
    from alembic.script import ScriptDirectory

    made = tmp_path / "made.db"
    check_tracking_uri(f"sqlite:///{made}")  # this MLflow's tables, at its head revision
    head = ScriptDirectory(str(Path(mlflow.store.__file__).parent / "db_migrations"))
    older = head.get_revision(head.get_current_head()).down_revision
    for name, revision in (("a newer", "fedcba987654"), ("an older", older)):
        db = tmp_path / f"{name.split()[-1]}.db"
        shutil.copy(made, db)  # a new URI: MLflow caches a store per URI
        with sqlite3.connect(db) as con:
            con.execute("UPDATE alembic_version SET version_num = ?", (revision,))
        with pytest.raises(TrackingError) as err:
            check_tracking_uri(f"sqlite:///{db}")
        assert f"the MLflow store {db} was written by {name} MLflow" in str(err.value)
        assert f"this environment's ({mlflow.__version__}" in str(err.value)
        if name == "a newer":
            assert "upgrade MLflow here (`pip install -U 'mlflow[auth]'`" in str(err.value)
        else:
            assert f"run `mlflow db upgrade sqlite:///{db}`" in str(err.value)


def test_default_is_embedded_sqlite(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert resolve_tracking_uri(tmp_path) == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://example:5000")
    assert resolve_tracking_uri(tmp_path) == "http://example:5000"


def test_a_run_shorter_than_one_sampling_interval_still_gets_system_metrics(tmp_path):
    # MLflow publishes only after a whole interval; the last partial one is published on
    # exit, so a short fit (or the tail of any fit) is not lost.
    import time

    from mlflow.tracking import MlflowClient

    from trainyard.track.system_metrics import SystemMetrics

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("short"))
    with SystemMetrics(run.info.run_id, uri, interval_s=30.0, enabled=True):
        time.sleep(0.3)
    metrics = client.get_run(run.info.run_id).data.metrics
    assert "system/cpu_utilization_percentage" in metrics, sorted(metrics)


def test_experiments_open_as_model_training_in_the_mlflow_ui(tmp_path):
    """MLflow 3's UI opens an experiment with no ``mlflow.experimentKind`` in its GenAI view
    (traces); trainyard's are tagged as model training, those made before it or by hand
    get the tag the next time trainyard uses them, and a kind chosen in the UI stays."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)

    def kind(name: str) -> str | None:
        return client.get_experiment_by_name(name).tags.get("mlflow.experimentKind")

    made = ensure_experiment(uri, "new")
    assert kind("new") == "custom_model_development"
    assert ensure_experiment(uri, "new") == made  # found again, not made twice
    client.create_experiment("older")  # as plain MLflow (or trainyard before) made it
    assert kind("older") is None
    ensure_experiment(uri, "older")
    assert kind("older") == "custom_model_development"
    chosen = client.create_experiment("chosen")
    client.set_experiment_tag(chosen, "mlflow.experimentKind", "genai_development")
    ensure_experiment(uri, "chosen")
    assert kind("chosen") == "genai_development"


def test_the_experiment_kind_is_the_one_the_installed_mlflow_ui_knows():
    """The tag's key and value as MLflow's own UI bundle spells them: an MLflow release that
    renames either fails here, not silently in the UI."""
    import mlflow

    bundle = Path(mlflow.__file__).parent / "server" / "js" / "build" / "static" / "js"
    text = "".join(p.read_text(errors="ignore") for p in bundle.glob("main.*.js"))
    assert f'"{EXPERIMENT_KIND_TAG}"' in text
    assert f'CUSTOM_MODEL_DEVELOPMENT="{MODEL_TRAINING}"' in text


@pytest.mark.parametrize("below", ["", "ml"], ids=["project at the top", "dvc init --subdir"])
def test_a_run_is_dirty_for_code_and_params_not_for_what_dvc_repro_rewrote(tmp_path, below):
    """`git.dirty` of a run: after `dvc repro` rewrote dvc.lock and the committed small
    outs (reports, train.json, a predict table), a clean checkout stays clean; a changed
    source file, params.yaml or dvc.yaml makes it dirty. The DVC project may sit below the
    git repository's top folder."""
    project = tmp_path / below
    for rel in ("dvc.yaml", "params.yaml", "dvc.lock", "src/trainyard/stages/train.py"):
        (project / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, project / rel)
    outs = ("reports/metrics.json", "models/train.json", "predictions/mine.parquet")
    for rel in outs:
        (project / rel).parent.mkdir(parents=True, exist_ok=True)
        (project / rel).write_text("{}")

    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=tmp_path, check=True, env=git_env(), capture_output=True)

    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "pipeline and its outputs")
    assert git_state(project)["git_dirty"] == "false"
    for rel in outs:
        (project / rel).write_text('{"again": 1}')
    with (project / "dvc.lock").open("a") as f:
        f.write("# rewritten\n")
    git("add", "-A")  # DVC stages its lock file
    state = git_state(project)
    assert state["git_dirty"] == "false" and len(state["git_commit"]) == 40
    for rel in ("src/trainyard/stages/train.py", "params.yaml", "dvc.yaml"):
        before = (project / rel).read_text()
        (project / rel).write_text(before + "\n# changed\n")
        assert git_state(project)["git_dirty"] == "true", rel
        (project / rel).write_text(before)
    assert git_state(project)["git_dirty"] == "false"
