"""DVC stage `export`: models/best.ckpt -> models/model.onnx, gated on ONNX/PyTorch parity."""

import argparse
import logging
from pathlib import Path

from trainyard.core.config import Params
from trainyard.core.records import EXPORT_RECORD, ExportRecord, TrainRecord
from trainyard.data.datamodule import load_split
from trainyard.export.onnx_export import export_and_verify, normalized_example
from trainyard.stages.runner import stage_main
from trainyard.track.registry import log_onnx_model
from trainyard.track.runs import log_to_open_run, logging_into, open_run

# By name: run as `python -m`, __name__ is "__main__", outside the trainyard logger whose
# INFO lines the stage shows (stages.common.configure_logging).
log = logging.getLogger("trainyard.stages.export")


def add_args(p: argparse.ArgumentParser) -> None:
    """Where the export stage reads and writes (dvc.yaml passes the same)."""
    p.add_argument("--data", default="data/prepared")
    p.add_argument("--models", default="models")
    p.add_argument("--report", default=str(EXPORT_RECORD))


def run(params: Params, args: argparse.Namespace) -> None:
    """Export, check parity, log the model to the train run, write reports/export.json."""
    info = TrainRecord.read(TrainRecord.path_in(args.models))
    run_id = open_run(info.run_id)
    onnx_path = Path(args.models, "model.onnx")
    images, _ = load_split(args.data, "test")
    n = min(params.export.parity_samples, images.shape[0])
    report = export_and_verify(
        Path(args.models, info.checkpoint),
        onnx_path,
        images[:n],
        params.export.opset,
        params.export.max_abs_diff,
        run_id,
        info.data_sha256,
    )
    log.info(
        "parity ok on %d images, max abs diff %.2e, agreement %.2f%%, embedding max abs "
        "diff %.2e (limit %.2e)",
        report["samples"],
        report["max_abs_diff"],
        100 * report["argmax_agreement"],
        report["embedding_max_abs_diff"],
        report["threshold_embedding_max_abs_diff"],
    )
    example = normalized_example(onnx_path, images[:1])
    with logging_into(run_id, "export"):
        # Logging the model takes seconds: say so, and where it goes.
        log.info("logging the ONNX model to MLflow run %s", run_id)
        log_to_open_run(
            metrics={
                "export/max_abs_diff": report["max_abs_diff"],
                "export/argmax_agreement": report["argmax_agreement"],
                "export/embedding_max_abs_diff": report["embedding_max_abs_diff"],
            },
            tags={"onnx.sha256": report["onnx_sha256"]},
        )
        model_uri = log_onnx_model(onnx_path, example)
    ExportRecord(**report, mlflow_model_uri=model_uri).write(args.report)


if __name__ == "__main__":
    stage_main("export", run, add_args)
