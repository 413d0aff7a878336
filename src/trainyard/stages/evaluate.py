"""DVC stage `evaluate`: the ONNX model on the full test set -> reports/ + the MLflow run."""

import argparse
import json
from pathlib import Path

import mlflow

from trainyard.core.config import Params
from trainyard.core.io import atomic_write_json
from trainyard.data.datamodule import load_split
from trainyard.export.evaluation import evaluate_onnx, metric_key, write_reports
from trainyard.stages.common import stage_main
from trainyard.track.registry import register_and_promote
from trainyard.track.runs import logging_into, open_run, read_run_file


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", default="data/prepared")
    p.add_argument("--models", default="models")
    p.add_argument("--reports", default="reports")


def run(params: Params, args: argparse.Namespace) -> None:
    info = read_run_file(f"{args.models}/train.json")
    run_id = open_run(info)
    export_report = json.loads(Path(args.reports, "export.json").read_text())
    images, labels = load_split(args.data, "test")
    result = evaluate_onnx(
        f"{args.models}/model.onnx",
        images,
        labels,
        params.evaluate.batch_size,
        params.evaluate.device,
    )
    m = result["metrics"]
    paths = write_reports(result, labels, args.reports)
    metrics = {
        "test": {
            "accuracy": m["accuracy"],
            "macro_f1": m["macro_f1"],
            "samples": m["samples"],
            "provider": m["provider"],
        },
        "export": {k: export_report[k] for k in ("max_abs_diff", "argmax_agreement", "samples")},
        "train": {"best_val_acc": info["best_val_acc"], "fit_time_s": info["fit_time_s"]},
    }
    atomic_write_json(Path(args.reports, "metrics.json"), metrics)
    with logging_into(run_id, "evaluate"):
        print(
            f"evaluate: test accuracy {m['accuracy']:.4f} on {m['samples']} images "
            f"({m['provider']}); logging it to MLflow run {run_id}"
        )
        mlflow.log_metrics({"test/accuracy": m["accuracy"], "test/macro_f1": m["macro_f1"]})
        # Class names may hold '/', spaces or any letter: keys are index + a safe spelling.
        classes = result["classes"]
        mlflow.log_metrics(
            {
                metric_key("test/f1", i, c, len(classes)): m["per_class"][c]["f1"]
                for i, c in enumerate(classes)
            }
        )
        for path in paths.values():
            mlflow.log_artifact(str(path), "evaluation")
    registry: dict = {"enabled": params.registry.enabled}
    if params.registry.enabled:
        name = params.registry_model_name()
        # Registration is a handful of registry writes that must all land or none: name the
        # step, so a failure or a Ctrl-C here is not taken for one in the metrics above.
        print(f"evaluate: registering the model in {name}")
        registry |= register_and_promote(
            mlflow.MlflowClient(),
            name,
            export_report["mlflow_model_uri"],
            run_id,
            m["accuracy"],
            info["data_version"],
            export_report["onnx_sha256"],
            params.registry.promote_margin,
            contract=result["card"],
        )
        with logging_into(run_id, "evaluate"):
            mlflow.set_tags(
                {
                    "registry.model": registry["model_name"],
                    "registry.version": str(registry["version"]),
                    "registry.alias": registry["alias"],
                    "registry.reason": registry["reason"],
                }
            )
        if registry["already_registered"]:
            print(
                f"evaluate: this model is already {registry['model_name']} "
                f"v{registry['version']} ({registry['alias']}), not registered again: "
                f"{registry['reason']}"
            )
        else:
            print(
                f"evaluate: registered {registry['model_name']} v{registry['version']} as "
                f"{registry['alias']}: {registry['reason']}"
            )
    atomic_write_json(Path(args.reports, "registry.json"), registry)


if __name__ == "__main__":
    stage_main("evaluate", run, add_args)
