"""DVC stage `export`: models/best.ckpt -> models/model.onnx, gated on ONNX/PyTorch parity;
with ``export.quantize: int8`` also models/model.int8.onnx, gated on the fp32 model's answers.

models/model.int8.onnx is not a DVC out (DVC fails a stage whose declared out is missing,
and under ``quantize: none`` there is none): it is written only when asked, deleted here
otherwise (an int8 file from an earlier export must not sit beside a new model.onnx), and
recorded by sha256 in reports/export.json; it travels with the model through MLflow.
"""

import argparse
import logging
from pathlib import Path
from typing import Any

from trainyard.core.config import Params
from trainyard.core.handoffs import EXPORT_RECORD, ExportRecord, Int8Export, TrainRecord
from trainyard.core.pause_points import pause_point
from trainyard.data.arrays import load_split
from trainyard.export.onnx_export import export_and_verify, normalized_example
from trainyard.export.quantize import calibration_sample, export_int8, remove_int8
from trainyard.stages.runner import stage_main
from trainyard.track.continued_runs import log_to_open_run, logging_into, open_run
from trainyard.track.quantized import INT8_ARTIFACT, INT8_FOLDER
from trainyard.track.registry import log_onnx_model

# By name: run as `python -m`, __name__ is "__main__", outside the trainyard logger whose
# INFO lines the stage shows (stages.common.configure_logging).
log = logging.getLogger("trainyard.stages.export")


def add_args(p: argparse.ArgumentParser) -> None:
    """Where the export stage reads and writes (dvc.yaml passes the same)."""
    p.add_argument("--data", default="data/prepared")
    p.add_argument("--models", default="models")
    p.add_argument("--report", default=str(EXPORT_RECORD))


def run(params: Params, args: argparse.Namespace) -> None:
    """Export, check parity, quantize if asked, log the model(s) to the train run, write
    reports/export.json."""
    info = TrainRecord.read(TrainRecord.path_in(args.models))
    run_id = open_run(info.run_id)
    onnx_path = Path(args.models, "model.onnx")
    remove_int8(onnx_path)  # first: a failed export must not leave an older int8 model
    images, labels = load_split(args.data, "test")
    n = min(params.export.parity_samples, images.shape[0])
    calibration = load_split(args.data, "val") if params.export.calibrate else None
    report = export_and_verify(
        Path(args.models, info.checkpoint),
        onnx_path,
        images[:n],
        params.export.opset,
        params.export.max_abs_diff,
        run_id,
        info.data_sha256,
        calibration,
    )
    scaling = report.pop("calibration")
    say_checks(report, scaling)
    int8 = quantize(params, args, onnx_path, images, labels)
    example = normalized_example(onnx_path, images[:1])
    with logging_into(run_id, "export"):
        # Logging the model takes seconds: say so, and where it goes.
        log.info("logging the ONNX model to MLflow run %s", run_id)
        pause_point("export.logging")
        log_to_open_run(
            metrics=export_metrics(report, scaling),
            tags={"onnx.sha256": report["onnx_sha256"]},
        )
        model_uri = log_onnx_model(onnx_path, example)
        if int8 is not None:
            log_to_open_run(
                metrics={
                    "export/int8_agreement": int8.agreement,
                    "export/int8_accuracy_drop": int8.accuracy_drop,
                },
                tags={"onnx.int8_sha256": int8.sha256},
                artifacts={onnx_path.with_name(int8.file): INT8_FOLDER},
            )
    record = ExportRecord(**report, mlflow_model_uri=model_uri, int8=int8, calibration=scaling)
    record.write(args.report)


def say_checks(report: dict[str, Any], scaling: dict[str, Any]) -> None:
    """The log lines of what export checked: the temperature (and why it is not applied,
    when the guard refused it) and the parity gate."""
    if scaling.get("samples"):
        log.info(
            "calibrated on %d val images: temperature %.3f (val NLL %.4f -> %.4f)",
            scaling["samples"],
            scaling["temperature"],
            scaling["val_nll_before"],
            scaling["val_nll_after"],
        )
        if not scaling["applied"]:
            log.warning(
                "the fitted temperature %.3f is not applied: it lowers the val ECE "
                "(%.4f -> %.4f) in only %.0f%% of bootstrap resamples (95%% needed); the "
                "graph keeps the model's own confidences (T = 1)",
                scaling["fitted_temperature"],
                scaling["val_ece_before"],
                scaling["val_ece_after"],
                100 * scaling["val_ece_improved_share"],
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


def export_metrics(report: dict[str, Any], scaling: dict[str, Any]) -> dict[str, float]:
    """The run's export/* metrics: the parity gate and the temperature, with the guard's
    evidence (none when too few val images to fit a temperature)."""
    return {
        "export/max_abs_diff": report["max_abs_diff"],
        "export/argmax_agreement": report["argmax_agreement"],
        "export/embedding_max_abs_diff": report["embedding_max_abs_diff"],
        "export/temperature": scaling["temperature"],
    } | {
        f"export/{key}": float(scaling[key])
        for key in (
            "fitted_temperature",
            "val_ece_before",
            "val_ece_after",
            "val_ece_improved_share",
        )
        if key in scaling
    }


def quantize(
    params: Params, args: argparse.Namespace, onnx_path: Path, images: Any, labels: Any
) -> Int8Export | None:
    """``export.quantize: int8``: the int8 model beside ``onnx_path``, calibrated on a
    seeded sample of the train split and gated on the whole test set; None under none."""
    p = params.export
    if p.quantize == "none":
        return None
    train, _ = load_split(args.data, "train")
    calibration = calibration_sample(train, p.calibration_samples, params.seed)
    log.info(
        "quantizing to int8 (calibrated on %d train images), gating on %d test images",
        calibration.shape[0],
        images.shape[0],
    )
    gate = export_int8(
        onnx_path, calibration, images, labels, p.int8_min_agreement, p.int8_max_accuracy_drop
    )
    log.info(
        "int8 ok: top-1 agreement with fp32 %.2f%% (need >= %.2f%%), accuracy %.2f%% -> "
        "%.2f%% (drop %.2f points, limit %g)",
        100 * gate["agreement"],
        100 * p.int8_min_agreement,
        100 * gate["accuracy_fp32"],
        100 * gate["accuracy_int8"],
        gate["accuracy_drop"],
        p.int8_max_accuracy_drop,
    )
    return Int8Export(**gate, artifact=INT8_ARTIFACT)


if __name__ == "__main__":
    stage_main("export", run, add_args)
