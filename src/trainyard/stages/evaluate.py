"""DVC stage `evaluate`: the ONNX model on the full test set -> reports/ + the MLflow run."""

import argparse
import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from trainyard.core.card import load_card
from trainyard.core.config import Params
from trainyard.core.fit_history import HISTORY_FILE, read_history
from trainyard.core.handoffs import ExportRecord, Registration, RegistryRecord, TrainRecord
from trainyard.core.io import atomic_write_json, sha256_file
from trainyard.core.pause_points import pause_point
from trainyard.data.arrays import load_split
from trainyard.evaluation import model_card
from trainyard.evaluation.deletion import deletion_line, deletion_metrics, deletion_mlflow
from trainyard.evaluation.scoring import evaluate_onnx, metric_key, write_reports
from trainyard.stages.runner import stage_main
from trainyard.track.continued_runs import log_to_open_run, logging_into, open_run
from trainyard.track.lineage import git_state
from trainyard.track.quantized import int8_tags
from trainyard.track.registry import register_and_promote, tag_reference
from trainyard.track.store import DVC_EXP_NAME, in_temp_workspace, tracking_client
from trainyard.track.version_card import describe_version
from trainyard.track.versions import CARD_ARTIFACT_DIR, REFERENCE_ARTIFACT
from trainyard.watch.reference import reference_from_predictions, sample_rows, save_reference

# By name: run as `python -m`, __name__ is "__main__", outside the trainyard logger whose
# INFO lines the stage shows (stages.common.configure_logging).
log = logging.getLogger("trainyard.stages.evaluate")
# MLflow artifact folders of the train run: the data files, and the pictures to look at.
EVALUATION_ARTIFACTS = "evaluation"
REPORT_ARTIFACTS = "report"
REFERENCE_FILE = "model.reference.npz"  # beside model.onnx: what `trainyard drift` reads


def add_args(p: argparse.ArgumentParser) -> None:
    """Where the evaluate stage reads and writes (dvc.yaml passes the same)."""
    p.add_argument("--data", default="data/prepared")
    p.add_argument("--models", default="models")
    p.add_argument("--reports", default="reports")


def run(params: Params, args: argparse.Namespace) -> None:
    """Evaluate the ONNX model, write the reports and the model's drift reference, log them,
    register the model (its version tagged with the reference's sha256)."""
    info = TrainRecord.read(TrainRecord.path_in(args.models))
    run_id = open_run(info.run_id)
    exported = ExportRecord.read(ExportRecord.path_in(args.reports))
    images, labels = load_split(args.data, "test")
    rows = sample_rows(labels.shape[0], params.drift.reference_sample, params.drift.seed)
    result = evaluate_onnx(
        Path(args.models, "model.onnx"),
        images,
        labels,
        params.evaluate.batch_size,
        params.evaluate.device,
        embedding_rows=rows,
    )
    history = training_history(Path(args.models, HISTORY_FILE))
    paths = write_metrics(result, images, labels, args.reports, info, exported, history)
    reference = write_reference(params, result, exported, Path(args.models, REFERENCE_FILE))
    log_evaluation(run_id, result, paths, reference)
    enabled = params.registry.enabled
    registration = register(params, run_id, result, info, exported) if enabled else None
    if registration is not None:
        tag_reference(
            tracking_client(), registration.model_name, registration.version, sha256_file(reference)
        )
    write_model_card(params, args, result, info, exported, registration)
    record = RegistryRecord(enabled=enabled, registration=registration)
    record.write(RegistryRecord.path_in(args.reports))


def write_model_card(
    params: Params,
    args: argparse.Namespace,
    result: dict[str, Any],
    info: TrainRecord,
    exported: ExportRecord,
    registration: Registration | None,
) -> None:
    """The model card (trainyard.evaluation.model_card) from metrics.json as written, the
    dataset card and the train run's recipe and lineage: into reports/ and beside the model,
    the train run's ``model_card/`` artifacts and the registry version's description."""
    client = tracking_client()
    tags = client.get_run(info.run_id).data.tags
    git = git_state()  # the train run's tags name the commit that trained; older runs: now
    card = model_card.build_card(
        name=params.registry_model_name(),
        metadata=result["metadata"],
        dataset=load_card(args.data),
        scores=result["metrics"],
        metrics=json.loads(Path(args.reports, "metrics.json").read_text(encoding="utf-8")),
        train=info.to_json(),
        onnx_sha256=exported.onnx_sha256,
        lineage={
            "git_commit": tags.get("git.commit", git["git_commit"]),
            "git_dirty": tags.get("git.dirty", git["git_dirty"]),
            "dvc_experiment": tags.get("dvc.exp_name", ""),
            "data_version": info.data_version,
        },
        recipe=model_card.recipe_choices(tags),
        params=model_card.changed_params(params.flat(), Params().flat()),
    )
    if registration is not None:
        card = model_card.with_registration(card, registration.model_dump())
    paths = model_card.write_card(card, args.reports, Path(args.models, "model.onnx"))
    with logging_into(info.run_id, "evaluate"):
        log_to_open_run(artifacts={path: CARD_ARTIFACT_DIR for path in paths.values()})
    if registration is not None:
        markdown = paths["md"].read_text(encoding="utf-8")
        describe_version(client, registration.model_name, registration.version, markdown)


def stage_metrics(
    metrics: dict[str, Any], info: TrainRecord, exported: ExportRecord
) -> dict[str, Any]:
    """``reports/metrics.json`` (what `dvc metrics` shows): test, export and train numbers,
    and the int8 model's gate figures when export made one."""
    out = {
        "test": {k: metrics[k] for k in ("accuracy", "macro_f1", "samples", "provider")},
        "export": {
            "max_abs_diff": exported.max_abs_diff,
            "argmax_agreement": exported.argmax_agreement,
            "samples": exported.samples,
        },
        "train": {"best_val_acc": info.best_val_acc, "fit_time_s": info.fit_time_s},
        "calibration": {
            "temperature": metrics["calibration"]["temperature"],
            "ece": metrics["calibration"]["calibrated"]["ece"],
            "ece_uncalibrated": metrics["calibration"]["uncalibrated"]["ece"],
        },
    }
    cal = exported.calibration
    if cal is not None and cal.applied is not None:  # the guard's decision and its evidence
        out["calibration"] |= {
            "applied": cal.applied,
            "fitted_temperature": cal.fitted_temperature,
            "val_ece_before": cal.val_ece_before,
            "val_ece_after": cal.val_ece_after,
            "val_ece_improved_share": cal.val_ece_improved_share,
        }
    if "explain" in metrics:  # the deletion test of the model's heatmaps
        out["explain"] = deletion_metrics(metrics["explain"])
    if exported.int8 is not None:
        keys = ("agreement", "accuracy_drop", "accuracy_int8", "samples")
        out["int8"] = {k: getattr(exported.int8, k) for k in keys}
    return out


def training_history(path: Path) -> list[dict[str, Any]] | None:
    """The fit's per-epoch rows, or None (with a warning) for a model trained before the fit
    wrote them: the report then says so instead of failing the evaluation."""
    if not path.exists():
        log.warning("no %s: the report's learning curves will say so", path)
        return None
    return read_history(path)


def write_metrics(
    result: dict[str, Any],
    images: np.ndarray,
    labels: np.ndarray,
    reports: str,
    info: TrainRecord,
    exported: ExportRecord,
    history: list[dict[str, Any]] | None,
) -> dict[str, Path]:
    """The reports into ``reports``; returns those logged to MLflow (not metrics.json)."""
    paths = write_reports(result, images, labels, reports, history)
    metrics = stage_metrics(result["metrics"], info, exported)
    atomic_write_json(Path(reports, "metrics.json"), metrics)
    return paths


def write_reference(
    params: Params, result: dict[str, Any], exported: ExportRecord, path: Path
) -> Path:
    """The model's drift reference (trainyard.watch.reference) from the test split's
    predictions, confidences and sampled embeddings."""
    reference = reference_from_predictions(
        result["classes"],
        result["predictions"],
        result["confidence"],
        result["embeddings"],
        model_sha256=exported.onnx_sha256,
        sample=params.drift.reference_sample,
        seed=params.drift.seed,
    )
    if reference.embeddings is None:
        log.info("the model has no embedding output: its drift reference has none")
    return save_reference(reference, path)


def log_evaluation(
    run_id: str, result: dict[str, Any], paths: dict[str, Path], reference: Path
) -> None:
    """Test accuracy, macro and per-class F1, the calibration error with and without the
    graph's temperature, the reports and the drift reference, into the train run."""
    m = result["metrics"]
    with logging_into(run_id, "evaluate"):
        log.info(
            "test accuracy %.4f on %d images (%s); logging it to MLflow run %s",
            m["accuracy"],
            m["samples"],
            m["provider"],
            run_id,
        )
        pause_point("evaluate.logging")
        say_deletion(m)
        cal = m["calibration"]
        log_to_open_run(
            metrics={
                "test/accuracy": m["accuracy"],
                "test/macro_f1": m["macro_f1"],
                "test/ece": cal["calibrated"]["ece"],
                "test/ece_uncalibrated": cal["uncalibrated"]["ece"],
            }
            | deletion_mlflow(m)
        )
        # Class names may hold '/', spaces or any letter: keys are index + a safe spelling.
        classes = result["classes"]
        log_to_open_run(
            metrics={
                metric_key("test/f1", i, c, len(classes)): m["per_class"][c]["f1"]
                for i, c in enumerate(classes)
            },
            artifacts={
                path: REPORT_ARTIFACTS if path.suffix == ".png" else EVALUATION_ARTIFACTS
                for path in paths.values()
            }
            | {reference: str(Path(REFERENCE_ARTIFACT).parent)},
        )


def say_deletion(metrics: dict[str, Any]) -> None:
    """The deletion test's line: a warning when the heatmaps fail it, a note without maps."""
    if "explain" not in metrics:
        log.info("the model has no class maps (exported before them): no deletion test")
        return
    passed = metrics["explain"]["passed"]
    log.log(logging.INFO if passed else logging.WARNING, deletion_line(metrics["explain"]))


def register(
    params: Params,
    run_id: str,
    result: dict[str, Any],
    info: TrainRecord,
    exported: ExportRecord,
) -> Registration:
    """A new registry version of the exported model, `champion` or `challenger`; its record
    is also tagged on the run and said on the console."""
    name = params.registry_model_name()
    # Registration is a handful of registry writes that must all land or none: name the
    # step, so a failure or a Ctrl-C here is not taken for one in the metrics above.
    log.info("registering the model in %s", name)
    reg = Registration(
        **register_and_promote(
            tracking_client(),  # the store open_run pointed MLflow at
            name,
            exported.mlflow_model_uri,
            run_id,
            result["metrics"]["accuracy"],
            info.data_version,
            exported.onnx_sha256,
            params.registry.promote_margin,
            contract=result["card"],
            sweep=os.environ.get(DVC_EXP_NAME) if in_temp_workspace() else None,
            # export.quantize int8: the version names its int8 file and the gate's figures
            extra_tags=None if exported.int8 is None else int8_tags(exported.int8),
        )
    )
    with logging_into(run_id, "evaluate"):
        log_to_open_run(
            tags={
                "registry.model": reg.model_name,
                "registry.version": str(reg.version),
                "registry.alias": reg.alias,
                "registry.reason": reg.reason,
            }
        )
    if reg.already_registered:
        log.info(
            "this model is already %s v%s (%s), not registered again: %s",
            reg.model_name,
            reg.version,
            reg.alias,
            reg.reason,
        )
    else:
        log.info("registered %s v%s as %s: %s", reg.model_name, reg.version, reg.alias, reg.reason)
    return reg


if __name__ == "__main__":
    stage_main("evaluate", run, add_args)
