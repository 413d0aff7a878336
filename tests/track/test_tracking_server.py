"""A real `mlflow server` over HTTP: a short pipeline logs, registers and aliases there."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainyard.core.handoffs import TRAIN_RECORD, TrainRecord

from conftest import (
    dvc,
    free_port,
    set_params,
    small_pipeline_repo,
    sqlite_mlflow_server,
    stage_env,
    train_concurrently,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[str]:
    """`mlflow server` with a sqlite backend and a local artifact store, on a free port."""
    with sqlite_mlflow_server(tmp_path_factory.mktemp("mlflow-server")) as uri:
        yield uri


@pytest.fixture(scope="module")
def repo(server, fashion_dir, tmp_path_factory) -> Path:
    repo = small_pipeline_repo(
        tmp_path_factory.mktemp("server-pipeline") / "trainyard", fashion_dir
    )
    dvc(repo, "repro", MLFLOW_TRACKING_URI=server)
    return repo


def test_run_is_on_the_server_with_system_metrics_and_dataset(server, repo):
    from mlflow.tracking import MlflowClient

    assert not (repo / "mlflow.db").exists()  # nothing went to the embedded store
    info = TrainRecord.read(repo / TRAIN_RECORD)
    client = MlflowClient(tracking_uri=server)
    run = client.get_run(info.run_id)
    assert run.info.status == "FINISHED"
    assert run.info.artifact_uri.startswith("mlflow-artifacts:")  # proxied by the server
    metrics = run.data.metrics
    assert {"val/acc", "test/accuracy", "system/cpu_utilization_percentage"} <= set(metrics)
    assert run.data.params["data.limit"] == "3000"
    assert {d.dataset.name for d in run.inputs.dataset_inputs} == {
        "fashion-mnist-train",
        "fashion-mnist-val",
    }
    names = {a.path for a in client.list_artifacts(run.info.run_id, "checkpoints")}
    assert names == {"checkpoints/best.ckpt"}
    # MLflow's UI opens the experiment on its training runs, not the GenAI view
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"


def test_model_version_and_champion_alias_on_the_server(server, repo):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=server)
    champion = client.get_model_version_by_alias("fashion-mnist-classifier", "champion")
    info = TrainRecord.read(repo / TRAIN_RECORD)
    assert champion.run_id == info.run_id
    assert (
        champion.tags["onnx_sha256"] == (repo / "models/model.onnx.sha256").read_text().split()[0]
    )
    assert champion.tags["data_version"].endswith(".dir")


@pytest.mark.timeout(60)
def test_server_going_away_stops_export_fast_and_registers_nothing(server, repo):
    from mlflow.tracking import MlflowClient

    before = len(
        MlflowClient(tracking_uri=server).search_model_versions("name='fashion-mnist-classifier'")
    )
    dead = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    out = subprocess.run(
        ["python", "-m", "trainyard.stages.evaluate"],
        cwd=repo,
        capture_output=True,
        text=True,
        env=stage_env(MLFLOW_TRACKING_URI=dead),
        timeout=60,
    )
    assert out.returncode == 1
    assert f"MLflow tracking server {dead} is not reachable" in out.stderr
    assert time.monotonic() - start < 30  # generous: it is a few seconds; a hang is minutes
    after = len(
        MlflowClient(tracking_uri=server).search_model_versions("name='fashion-mnist-classifier'")
    )
    assert after == before


def test_two_trainings_at_once_against_the_server_both_complete(server, repo):
    """Two concurrent trainings logging to one `mlflow server` (sqlite backend, separate
    artifact store behind --artifacts-destination): both finish, with their metrics, and
    each run's checkpoint lands in the server's artifact store."""
    from mlflow.tracking import MlflowClient

    # A quarter of the epoch: the two runs still overlap from start to end, in less time.
    params = (repo / "params.yaml").read_text()
    set_params(repo, train={"limit_train_batches": 10})
    try:
        infos = train_concurrently(repo, ["server-run0", "server-run1"], MLFLOW_TRACKING_URI=server)
    finally:
        (repo / "params.yaml").write_text(params)
    client = MlflowClient(tracking_uri=server)
    run_ids = set()
    for path in infos:
        run = client.get_run(TrainRecord.read(path).run_id)
        run_ids.add(run.info.run_id)
        assert run.info.status == "FINISHED"
        assert {"val/acc", "train/loss_epoch", "system/cpu_utilization_percentage"} <= set(
            run.data.metrics
        )
        assert run.info.artifact_uri.startswith("mlflow-artifacts:")
        names = {a.path for a in client.list_artifacts(run.info.run_id, "checkpoints")}
        assert names == {"checkpoints/best.ckpt"}
    assert len(run_ids) == 2
    assert not (repo / "mlflow.db").exists()  # nothing went to an embedded store
