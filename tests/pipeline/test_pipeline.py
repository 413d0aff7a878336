"""A real `dvc repro` in a temp copy of the repository, on a small slice, 1 epoch."""

from __future__ import annotations

import csv
import hashlib
import json
import shutil
import socket
from pathlib import Path

import pytest
import yaml

from trainyard.core.handoffs import REGISTRY_RECORD, TRAIN_RECORD, RegistryRecord, TrainRecord

from conftest import STAGES, VENV_BIN, copy_reproduced, dvc, run_ok, set_params, train_concurrently

pytestmark = pytest.mark.slow


def ran(output: str) -> set[str]:
    return {s for s in STAGES if f"Running stage '{s}'" in output}


@pytest.fixture(scope="module")
def repo(reproduced_pipeline, tmp_path_factory) -> Path:
    repo = copy_reproduced(reproduced_pipeline, tmp_path_factory.mktemp("pipeline") / "trainyard")
    first = (reproduced_pipeline.parent / "first_repro.log").read_text()
    (repo.parent / "first_repro.log").write_text(first)
    return repo


def test_first_repro_runs_every_stage_and_writes_outputs(repo):
    log = (repo.parent / "first_repro.log").read_text()
    assert ran(log) == set(STAGES)
    assert "[train] training on cpu" in log
    assert len(list((repo / "data/raw").iterdir())) == 4
    card = json.loads((repo / "data/prepared/card.json").read_text())
    assert card["counts"]["train"]["total"] == 2500 and card["counts"]["test"]["total"] == 10_000
    assert (card["source"], card["channels"], card["height"], card["width"]) == (
        "fashion-mnist",
        1,
        28,
        28,
    )
    assert card["classes"][0] == "T-shirt/top" and len(card["classes"]) == 10
    for out in ("models/best.ckpt", "models/model.onnx", "reports/confusion_matrix.png"):
        assert (repo / out).stat().st_size > 0, out
    with open(repo / "reports/predictions.csv", newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 10_000 and set(rows[0]) == {"actual", "predicted"}


def test_metrics_file_has_test_and_export_parity(repo):
    metrics = json.loads((repo / "reports/metrics.json").read_text())
    # One epoch on 2,500 images is far from converged but well above chance (0.10).
    assert 0.3 < metrics["test"]["accuracy"] <= 1.0
    assert metrics["export"]["max_abs_diff"] <= 1e-4
    assert metrics["export"]["argmax_agreement"] == 1.0
    assert metrics["export"]["samples"] == 1000
    shown = dvc(repo, "metrics", "show", "--json").stdout
    assert "test" in shown and "max_abs_diff" in shown
    # The deletion test of the model's heatmaps (its verdict on a one-epoch model is open).
    explain = metrics["explain"]
    assert explain["deletion_drop_top20"] > 0 and isinstance(explain["passed"], bool)
    assert explain["deletion_ratio"] is None or explain["deletion_ratio"] > 0
    # The occlusion ceiling beside it: the cnn's 7x7 map, 50 runs an image, 64 images.
    assert explain["occlusion_grid"] == "7x7" and explain["occlusion_samples"] == 64
    assert explain["occlusion_ceiling_drop_top20"] > 0


def test_mlflow_run_holds_params_metrics_artifacts(repo):
    from mlflow.tracking import MlflowClient

    info = TrainRecord.read(repo / TRAIN_RECORD)
    client = MlflowClient(tracking_uri=f"sqlite:///{repo}/mlflow.db")
    run = client.get_run(info.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["train.max_epochs"] == "1"
    assert run.data.params["data.limit"] == "3000"
    metrics = run.data.metrics
    test_acc = json.loads((repo / "reports/metrics.json").read_text())["test"]["accuracy"]
    assert metrics["test/accuracy"] == pytest.approx(test_acc)
    assert metrics["test/deletion_drop_top20"] > 0 and "test/deletion_drop_random20" in metrics
    assert metrics["test/occlusion_ceiling_drop_top20"] > 0
    for key in ("val/acc", "val/loss", "train/loss_step", "export/max_abs_diff", "lr-AdamW"):
        assert key in metrics, key
    assert len(client.get_metric_history(run.info.run_id, "train/loss_step")) >= 2
    assert run.data.tags["data.sha256"] == info.data_sha256
    assert run.data.tags["device"] == "cpu"
    assert run.data.tags["git.commit"] == run.data.tags["mlflow.source.git.commit"] != "unknown"
    assert run.data.tags["data.dvc_md5"].endswith(".dir")  # DVC's hash of data/prepared
    assert "system/cpu_utilization_percentage" in metrics  # MLflow's system metrics
    # The input-bound verdict (perf.py): per-epoch split of the step, one verdict, a tag.
    verdict = info.input_bound
    assert verdict.level in ("input-bound", "moderately input-bound", "not input-bound")
    assert 0 <= verdict.data_wait_fraction <= 1 and verdict.fix and verdict.steps >= 1
    assert (verdict.data_path, verdict.placement) == ("fast", "ram")
    for key in ("perf/data_wait_fraction", "perf/step_ms", "perf/compute_ms", "perf/h2d_ms"):
        assert key in metrics, key
    assert run.data.tags["perf.verdict"] == verdict.level
    assert "[train] input-bound verdict: " in (repo.parent / "first_repro.log").read_text()
    inputs = {d.dataset.name: d for d in run.inputs.dataset_inputs}
    assert set(inputs) == {"fashion-mnist-train", "fashion-mnist-val"}
    assert inputs["fashion-mnist-train"].dataset.digest.startswith(info.data_sha256[:16])
    assert len(run.outputs.model_outputs) == 1  # the ONNX model, logged as an MLflow model
    artifacts = {
        a.path
        for d in ("checkpoints", "config", "evaluation", "report")
        for a in client.list_artifacts(run.info.run_id, d)
    }
    assert {
        "checkpoints/best.ckpt",
        "config/params.yaml",
        "report/confusion_matrix.png",
    } <= artifacts


def test_second_repro_is_a_no_op(repo):
    before = (repo / "dvc.lock").read_text()
    out = dvc(repo, "repro")
    assert ran(out.stdout) == set(), out.stdout
    assert (repo / "dvc.lock").read_text() == before


def test_first_version_is_champion_and_its_file_is_the_exported_one(repo):
    import mlflow
    from mlflow.tracking import MlflowClient

    registry = RegistryRecord.read(repo / REGISTRY_RECORD).registration
    assert (registry.version, registry.alias) == (1, "champion")
    uri = f"sqlite:///{repo}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    version = client.get_model_version_by_alias("fashion-mnist-classifier", "champion")
    sha = (repo / "models/model.onnx.sha256").read_text().split()[0]
    assert version.tags["onnx_sha256"] == sha
    assert version.tags["test_accuracy"].startswith("0.")
    mlflow.set_tracking_uri(uri)
    folder = mlflow.artifacts.download_artifacts(
        "models:/fashion-mnist-classifier@champion", dst_path=str(repo / "dl")
    )
    assert hashlib.sha256((Path(folder) / "model.onnx").read_bytes()).hexdigest() == sha


def test_evaluate_writes_the_model_card_logs_it_and_describes_the_version(repo):
    """The card of the real model: in reports/ and beside it, in the run, as the version's
    description, and what `trainyard card models:/NAME@champion` prints."""
    from mlflow.tracking import MlflowClient

    markdown = (repo / "reports/model_card.md").read_text()
    card = json.loads((repo / "reports/model_card.json").read_text())
    assert (repo / "models/model.card.md").read_text() == markdown
    assert json.loads((repo / "models/model.card.json").read_text()) == card
    assert markdown.startswith("# Model card: fashion-mnist-classifier\n")
    sha = (repo / "models/model.onnx.sha256").read_text().split()[0]
    assert card["model"]["onnx_sha256"] == sha and card["registry"]["version"] == 1
    metrics = json.loads((repo / "reports/metrics.json").read_text())
    assert card["quality"]["test"] == metrics["test"]
    assert card["data"]["data_version"].endswith(".dir")  # DVC's hash of data/prepared
    assert card["model"]["recipe"]  # the train run's recipe.<key> tags
    client = MlflowClient(tracking_uri=f"sqlite:///{repo}/mlflow.db")
    version = client.get_model_version("fashion-mnist-classifier", "1")
    assert version.description == markdown
    logged = {a.path for a in client.list_artifacts(version.run_id, "model_card")}
    assert logged == {"model_card/model_card.md", "model_card/model_card.json"}
    ref = "models:/fashion-mnist-classifier@champion"
    uri = f"sqlite:///{repo}/mlflow.db"
    out = run_ok([str(VENV_BIN / "trainyard"), "card", ref], repo, MLFLOW_TRACKING_URI=uri)
    assert out.stdout == markdown


def test_worse_train_params_rerun_train_export_evaluate_only_and_become_challenger(repo):
    # One optimizer step: far worse than the first run, so champion must stay where it is.
    set_params(repo, train={"lr": 0.002, "limit_train_batches": 1})
    out = dvc(repo, "repro")
    assert ran(out.stdout) == {"train", "export", "evaluate"}
    registry = RegistryRecord.read(repo / REGISTRY_RECORD).registration
    assert (registry.version, registry.alias) == (2, "challenger")
    assert "does not beat champion v1" in registry.reason
    # DVC's lines are on stdout, the stages' log on stderr.
    assert "[evaluate] registered fashion-mnist-classifier v2 as challenger" in out.stderr
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{repo}/mlflow.db")
    assert (
        int(client.get_model_version_by_alias("fashion-mnist-classifier", "champion").version) == 1
    )


def test_two_trainings_at_once_on_the_embedded_store(repo):
    """Concurrent runs against one sqlite file: both finish and log fully (no lock errors)."""
    from mlflow.tracking import MlflowClient

    infos = train_concurrently(repo, ["concurrent0", "concurrent1"])
    client = MlflowClient(tracking_uri=f"sqlite:///{repo}/mlflow.db")
    for path in infos:
        run = client.get_run(TrainRecord.read(path).run_id)
        assert run.info.status == "FINISHED"
        assert {"val/acc", "train/loss_epoch", "train/img_per_s"} <= set(run.data.metrics)
        assert run.data.params["train.lr"] == "0.002"


def test_ddp_on_two_cpu_processes_logs_one_run(repo, tmp_path):
    """Lightning DDP (gloo, 2 CPU ranks): both data paths shard by rank, rank 0 alone
    owns the MLflow run, outputs and per-epoch lines."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{repo}/mlflow.db")
    exp = client.get_experiment_by_name("fashion-mnist")
    before = len(client.search_runs([exp.experiment_id]))
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["train"].update(accelerator="cpu", devices=2, max_epochs=2, limit_train_batches=None)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    out = run_ok(
        [
            *("python", "-m", "trainyard.stages.train", "--params", str(tmp_path / "params.yaml")),
            *("--data", "data/prepared", "--out", str(tmp_path / "ddp")),
        ],
        repo,
    )
    assert "MEMBER: 2/2" in out.stdout + out.stderr
    # rank 0 logs the epoch's line, rank 1 does not
    assert out.stderr.count("[train] epoch 2/2 train/loss ") == 1, out.stderr[-3000:]
    info = TrainRecord.read(TrainRecord.path_in(tmp_path / "ddp"))
    assert len(client.search_runs([exp.experiment_id])) == before + 1
    run = client.get_run(info.run_id)
    assert run.data.params["train.devices"] == "2"
    # Two epochs on 2,500 images: well above chance (0.10), whichever rank computed it.
    assert run.data.metrics["val/acc"] > 0.5


def test_bad_param_fails_naming_the_key_and_changes_nothing(repo):
    lock = (repo / "dvc.lock").read_text()
    set_params(repo, train={"batch_sise": 64})
    try:
        out = dvc(repo, "repro", check=False)
    finally:
        params = yaml.safe_load((repo / "params.yaml").read_text())
        del params["train"]["batch_sise"]
        (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    assert out.returncode != 0
    assert "train.batch_sise: unknown key" in out.stdout + out.stderr
    assert (repo / "dvc.lock").read_text() == lock


@pytest.mark.timeout(120)
def test_unreachable_tracking_server_fails_fast_naming_the_uri(repo):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uri = f"http://127.0.0.1:{port}"
    lock = (repo / "dvc.lock").read_text()
    out = dvc(
        repo, "repro", "--force", "--single-item", "train", check=False, MLFLOW_TRACKING_URI=uri
    )
    assert out.returncode != 0
    assert f"MLflow tracking server {uri} is not reachable" in out.stdout + out.stderr
    assert (repo / "dvc.lock").read_text() == lock  # nothing recorded as done
    assert not list((repo / "models").glob(".*.tmp")) and not list((repo / "models").glob(".best*"))


def test_dvc_repro_predict_scores_a_folder_with_its_lineage_and_run(reproduced_pipeline, tmp_path):
    """predict.sources -> a predict@NAME stage: `dvc repro predict` scores a folder of
    Fashion-MNIST test images (PNGs, one broken file) exactly as evaluate scored them, with
    the folder and the model in dvc.lock and a run in the model's MLflow experiment; then
    `trainyard predict` takes the registry's champion (and the run) through a real server."""
    import mlflow
    import numpy as np
    import pyarrow.parquet as pq
    from PIL import Image

    from conftest import VENV_BIN, sqlite_mlflow_server

    repo = copy_reproduced(reproduced_pipeline, tmp_path / "trainyard")
    images = np.load(repo / "data/prepared/test_images.npy")[:60]
    classes = json.loads((repo / "data/prepared/card.json").read_text())["classes"]
    with open(repo / "reports/predictions.csv") as fh:
        evaluated = [row["predicted"] for row in csv.DictReader(fh)][:60]
    actual = np.load(repo / "data/prepared/test_labels.npy")[:60]
    folder = tmp_path / "new"
    expected = {}
    for i, (image, label) in enumerate(zip(images, actual, strict=True)):
        rel = f"{classes[label]}/{i:03d}.png"
        (folder / classes[label]).mkdir(parents=True, exist_ok=True)
        Image.fromarray(image[0]).save(folder / rel)
        expected[rel] = evaluated[i]
    (folder / classes[0] / "broken.png").write_bytes(b"\x89PNG not really")
    set_params(repo, predict={"sources": {"new": str(folder)}})
    out = dvc(repo, "repro", "predict")
    assert "Running stage 'predict@new'" in out.stdout and ran(out.stdout) == set()
    table = {r["path"]: r for r in pq.read_table(repo / "predictions/new.parquet").to_pylist()}
    assert {rel: table[rel]["label"] for rel in expected} == expected  # evaluate's answers
    assert table[f"{classes[0]}/broken.png"]["error"]
    summary = json.loads((repo / "predictions/new.summary.json").read_text())
    assert summary["bad_files"] == 1 and summary["labels"]["labelled"] == 60
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]["predict@new"]
    deps = {d["path"] for d in lock["deps"]}
    assert {str(folder), "models/model.onnx"} <= deps
    assert "Stage 'predict@new' didn't change" in dvc(repo, "repro", "predict").stdout

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{repo}/mlflow.db")
    train_run = json.loads((repo / "models/train.json").read_text())["run_id"]
    experiment = client.get_run(train_run).info.experiment_id
    runs = client.search_runs([experiment], "tags.`trainyard.kind` = 'predict'")
    assert len(runs) == 1 and runs[0].info.run_name == "predict@new"
    assert runs[0].data.tags["model.run_id"] == train_run
    assert runs[0].data.tags["source.fingerprint"] == summary["source"]["fingerprint"]
    assert runs[0].data.metrics["predict/accuracy"] == summary["labels"]["accuracy"]

    server = tmp_path / "server"
    server.mkdir()
    shutil.copy(repo / "mlflow.db", server / "mlflow.db")
    with sqlite_mlflow_server(server) as uri:
        for model in ("models:/fashion-mnist-classifier@champion", f"runs:/{train_run}"):
            run_ok(
                [
                    *(str(VENV_BIN / "trainyard"), "predict", str(folder), "--model", model),
                    *("--out", str(tmp_path / "reg.parquet"), "--no-track"),
                ],
                repo,
                timeout=300,
                MLFLOW_TRACKING_URI=uri,
            )
            rows = pq.read_table(tmp_path / "reg.parquet").to_pylist()
            assert {r["model_version"] for r in rows} == {"fashion-mnist-classifier/1"}
            assert {r["path"]: r["label"] for r in rows if r["path"] in expected} == expected


def test_exp_run_quantize_int8_writes_gates_and_registers_the_int8_model(
    reproduced_pipeline, tmp_path
):
    """`dvc exp run -S export.quantize=int8`: export writes model.int8.onnx (not a DVC out)
    with its gate's figures in export.json, metrics.json and the train run; evaluate
    registers the version (the same fp32 model: v1 reused) with the int8 file's sha256."""
    from mlflow.tracking import MlflowClient

    repo = copy_reproduced(reproduced_pipeline, tmp_path / "trainyard")
    out = dvc(repo, "exp", "run", "-S", "export.quantize=int8")
    assert ran(out.stdout) == {"export", "evaluate"}, out.stdout + out.stderr
    assert "[export] int8 ok: top-1 agreement with fp32" in out.stderr
    int8 = repo / "models/model.int8.onnx"
    sha = (repo / "models/model.int8.onnx.sha256").read_text().split()[0]
    assert hashlib.sha256(int8.read_bytes()).hexdigest() == sha
    record = json.loads((repo / "reports/export.json").read_text())["int8"]
    assert record["passed"] and record["sha256"] == sha and record["agreement"] >= 0.99
    metrics_json = json.loads((repo / "reports/metrics.json").read_text())
    assert metrics_json["int8"]["agreement"] == record["agreement"]
    client = MlflowClient(tracking_uri=f"sqlite:///{repo}/mlflow.db")
    registration = RegistryRecord.read(repo / REGISTRY_RECORD).registration
    version = client.get_model_version(registration.model_name, str(registration.version))
    assert version.tags["int8_sha256"] == sha
    metrics = client.get_run(TrainRecord.read(repo / TRAIN_RECORD).run_id).data.metrics
    assert metrics["export/int8_agreement"] == record["agreement"]
    assert metrics["export/int8_accuracy_drop"] == record["accuracy_drop"]
