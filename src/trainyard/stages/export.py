"""DVC stage `export`: models/best.ckpt -> models/model.onnx, gated on ONNX/PyTorch parity."""

import argparse

import mlflow

from trainyard.core.config import Params
from trainyard.core.io import atomic_write_json
from trainyard.data.datamodule import load_split
from trainyard.export.onnx_export import export_and_verify, normalized_example
from trainyard.stages.common import stage_main
from trainyard.track.registry import log_onnx_model
from trainyard.track.runs import logging_into, open_run, read_run_file


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", default="data/prepared")
    p.add_argument("--models", default="models")
    p.add_argument("--report", default="reports/export.json")


def run(params: Params, args: argparse.Namespace) -> None:
    info = read_run_file(f"{args.models}/train.json")
    run_id = open_run(info)
    images, _ = load_split(args.data, "test")
    n = min(params.export.parity_samples, images.shape[0])
    report = export_and_verify(
        f"{args.models}/{info['checkpoint']}",
        f"{args.models}/model.onnx",
        images[:n],
        params.export.opset,
        params.export.max_abs_diff,
        run_id,
        info["data_sha256"],
    )
    print(
        f"export: parity ok on {report['samples']} images, max abs diff "
        f"{report['max_abs_diff']:.2e}, agreement {report['argmax_agreement']:.2%}"
    )
    example = normalized_example(f"{args.models}/model.onnx", images[:1])
    with logging_into(run_id, "export"):
        # Logging the model takes seconds: say so, and where it goes.
        print(f"export: logging the ONNX model to MLflow run {run_id}")
        mlflow.log_metrics(
            {
                "export/max_abs_diff": report["max_abs_diff"],
                "export/argmax_agreement": report["argmax_agreement"],
            }
        )
        mlflow.set_tag("onnx.sha256", report["onnx_sha256"])
        report["mlflow_model_uri"] = log_onnx_model(f"{args.models}/model.onnx", example)
    atomic_write_json(args.report, report)


if __name__ == "__main__":
    stage_main("export", run, add_args)
