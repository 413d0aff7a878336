"""``export.quantize: int8``: models/model.onnx -> models/model.int8.onnx, gated on the
fp32 model's answers.

ONNX Runtime's static quantization (QDQ format, int8 weights per output channel, uint8
activations) with activation ranges calibrated on a seeded sample of the train split, fed
exactly as evaluate and the service feed the model (the card's normalisation). The
outputs, ``logits``, ``embedding`` and ``cam``, stay float32 outputs (the quantizer
dequantizes before a graph output; the class maps' own arithmetic, after the last feature
maps, is not quantized at all), and the fp32 model's metadata (dataset card, provenance) is
kept, plus ``precision: int8`` and the sha256 of the model it was made from.

The gate, on the whole test set: its top-1 must equal the fp32 model's on at least
``export.int8_min_agreement`` of the images, and its accuracy may fall at most
``export.int8_max_accuracy_drop`` percentage points. The file is written to a temporary
name and gated there: a model that fails is never at models/model.int8.onnx.

``quant_pre_process`` (symbolic shape inference + ONNX Runtime's optimiser) is not run:
the export already writes an optimised graph with static shapes but the batch, and on the
Fashion CNN it changed neither the agreement nor the speed, for 3 s more.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnxruntime.quantization import (
    CalibrationDataReader,
    CalibrationMethod,
    QuantFormat,
    QuantType,
    quantize_static,
)

from trainyard.core.card import card_from_metadata, normalize_pixels
from trainyard.core.errors import ExportError
from trainyard.core.host import x86_without_vnni
from trainyard.core.io import atomic_file, atomic_write_text, sha256_file
from trainyard.runtime.explain import CAM_OUTPUT
from trainyard.runtime.model_file import PRECISION_KEY, int8_beside
from trainyard.runtime.sessions import load_onnx

CALIBRATION_BATCH = 32  # images per calibration run: bounds the calibrator's memory
GATE_BATCH = 512  # test images per ONNX Runtime run in the gate


class CalibrationImages(CalibrationDataReader):  # type: ignore[misc]
    """The calibration sample as the model's real input: uint8 images [N,C,H,W] normalised
    by the card, ``CALIBRATION_BATCH`` at a time (what the quantizer runs to see ranges)."""

    def __init__(self, images: np.ndarray, mean: Any, std: Any, input_name: str) -> None:
        self.images, self.mean, self.std, self.input_name = images, mean, std, input_name
        self.start = 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self.start >= self.images.shape[0]:
            return None
        batch = self.images[self.start : self.start + CALIBRATION_BATCH]
        self.start += CALIBRATION_BATCH
        return {self.input_name: normalize_pixels(batch, self.mean, self.std)}


def calibration_sample(images: np.ndarray, count: int, seed: int) -> np.ndarray:
    """``count`` train images (all, if fewer), drawn with ``seed`` and read in index order
    (a memory-mapped split reads each page once)."""
    n = images.shape[0]
    rows = np.sort(np.random.default_rng(seed).choice(n, size=min(count, n), replace=False))
    return np.asarray(images[rows])


def explain_only_nodes(graph: onnx.GraphProto) -> list[str]:
    """Names of the nodes that only the ``cam`` output needs (the class maps' arithmetic on
    the last feature maps): left in float. Quantized, their MatMul would share the head's
    weights with its Gemm under another per-channel axis, which the quantizer cannot do."""
    producer = {out: node for node in graph.node for out in node.output}

    def ancestors(outputs: list[str]) -> set[str]:
        seen: set[str] = set()
        todo = [producer[o] for o in outputs if o in producer]
        while todo:
            node = todo.pop()
            if node.name not in seen:
                seen.add(node.name)
                todo += [producer[i] for i in node.input if i in producer]
        return seen

    names = [o.name for o in graph.output]
    if CAM_OUTPUT not in names:
        return []
    answers = ancestors([n for n in names if n != CAM_OUTPUT])
    return sorted(ancestors([CAM_OUTPUT]) - answers)


def quantize_int8(fp32_path: Path, out_path: Path, calibration: np.ndarray) -> None:
    """Write the int8 model of ``fp32_path`` to ``out_path`` (any path: the caller's temp),
    calibrated on ``calibration`` (uint8 [N,C,H,W]), with the fp32 model's metadata plus
    its precision and the fp32 model's sha256."""
    proto = onnx.load(str(fp32_path), load_external_data=False)
    meta = {p.key: p.value for p in proto.metadata_props}
    card = card_from_metadata(meta, str(fp32_path))
    input_name = proto.graph.input[0].name
    keep_float = explain_only_nodes(proto.graph)
    del proto
    seven_bit = x86_without_vnni()
    quantize_static(
        str(fp32_path),
        str(out_path),
        CalibrationImages(calibration, card.mean, card.std, input_name),
        quant_format=QuantFormat.QDQ,
        # Per output channel: one scale per filter. On the Fashion CNN top-1 agreement
        # with fp32 went from 99.33% (per tensor) to 99.61%, at no cost in speed.
        per_channel=True,
        # uint8 activations, int8 weights (U8S8): ONNX Runtime's fast x86 kernels. With
        # int8 activations (S8S8) the resnet18 at 64 px ran no faster than fp32 on this
        # Xeon (AVX-512 VNNI); U8S8 ran 3.7x faster at batch 1, with the same agreement.
        # On x86 without VNNI (AVX2 only) U8S8 saturates (ONNX Runtime's note): 7-bit weights
        # there, ONNX Runtime's remedy (docs/serving.md#int8 has both CPUs' figures).
        reduce_range=seven_bit,
        activation_type=QuantType.QUInt8,
        weight_type=QuantType.QInt8,
        calibrate_method=CalibrationMethod.MinMax,
        nodes_to_exclude=keep_float,
    )
    quantized = onnx.load(str(out_path))
    del quantized.metadata_props[:]  # the fp32 model's, whatever the quantizer kept
    onnx.helper.set_model_props(
        quantized,
        meta
        | {
            PRECISION_KEY: "int8",
            "quantized_from_sha256": sha256_file(fp32_path),
            "quantization": f"onnxruntime static, QDQ, per-channel int8 weights, uint8 "
            f"activations (MinMax on {calibration.shape[0]} train images)"
            + (", 7-bit weights (reduce_range: x86 without VNNI)" if seven_bit else ""),
        },
    )
    onnx.save(quantized, str(out_path))


def _top1_and_outputs(path: Path, images: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """Top-1 class of every image (normalised by the model's own card), and its outputs."""
    model = load_onnx(path, device="cpu", say=False)
    card = card_from_metadata(model.metadata, str(path))
    top1 = [
        model.run(normalize_pixels(images[i : i + GATE_BATCH], card.mean, card.std)).argmax(1)
        for i in range(0, images.shape[0], GATE_BATCH)
    ]
    outputs = [o.name for o in model.session.get_outputs()]
    return np.concatenate(top1), outputs


def int8_gate(
    fp32_path: Path,
    int8_path: Path,
    images: np.ndarray,
    labels: np.ndarray,
    min_agreement: float,
    max_accuracy_drop: float,
) -> dict[str, Any]:
    """The int8 model against the fp32 one on the test set: top-1 agreement, both
    accuracies and the drop in percentage points, the thresholds, ``passed``."""
    fp32, fp32_outputs = _top1_and_outputs(fp32_path, images)
    int8, int8_outputs = _top1_and_outputs(int8_path, images)
    acc_fp32, acc_int8 = float((fp32 == labels).mean()), float((int8 == labels).mean())
    report = {
        "samples": int(images.shape[0]),
        "agreement": float((fp32 == int8).mean()),
        "accuracy_fp32": acc_fp32,
        "accuracy_int8": acc_int8,
        "accuracy_drop": 100 * (acc_fp32 - acc_int8),  # percentage points
        "threshold_min_agreement": min_agreement,
        "threshold_max_accuracy_drop": max_accuracy_drop,
        "outputs": int8_outputs,
    }
    report["passed"] = not int8_failures(report) and int8_outputs == fp32_outputs
    return report


def int8_failures(report: dict[str, Any]) -> list[str]:
    """What an ``int8_gate`` report fails on, one phrase per figure; empty when it passes."""
    failures = []
    if not report["agreement"] >= report["threshold_min_agreement"]:  # NaN fails too
        failures.append(
            f"top-1 agreement with fp32 {report['agreement']:.2%} "
            f"(need >= {report['threshold_min_agreement']:.2%}, export.int8_min_agreement)"
        )
    if not report["accuracy_drop"] <= report["threshold_max_accuracy_drop"]:
        failures.append(
            f"accuracy drop {report['accuracy_drop']:.2f} points ({report['accuracy_fp32']:.2%}"
            f" -> {report['accuracy_int8']:.2%}; limit {report['threshold_max_accuracy_drop']:g}"
            " points, export.int8_max_accuracy_drop)"
        )
    return failures


def remove_int8(fp32_path: Path) -> None:
    """Delete the int8 model (and its .sha256) beside ``fp32_path``: one left from an
    earlier export would sit beside a new model.onnx it was not made from."""
    path = int8_beside(fp32_path)
    for stale in (path, path.with_name(path.name + ".sha256")):
        stale.unlink(missing_ok=True)


def export_int8(
    fp32_path: str | os.PathLike[str],
    calibration: np.ndarray,
    test_images: np.ndarray,
    test_labels: np.ndarray,
    min_agreement: float,
    max_accuracy_drop: float,
) -> dict[str, Any]:
    """Quantize, gate, and only then put ``<stem>.int8.onnx`` and its .sha256 beside
    ``fp32_path``; an ExportError naming both figures when the gate fails (nothing left)."""
    fp32_path = Path(fp32_path)
    out = int8_beside(fp32_path)
    remove_int8(fp32_path)
    with atomic_file(out) as tmp:  # renamed to ``out`` only if the block ends normally
        quantize_int8(fp32_path, tmp, calibration)
        report = int8_gate(
            fp32_path, tmp, test_images, test_labels, min_agreement, max_accuracy_drop
        )
        if not report["passed"]:
            why = "; ".join(int8_failures(report)) or (
                f"its outputs {report['outputs']} are not the fp32 model's"
            )
            raise ExportError(
                f"int8 gate failed on {report['samples']} test images: top-1 agreement with "
                f"fp32 {report['agreement']:.2%} (need >= {min_agreement:.2%}), accuracy drop "
                f"{report['accuracy_drop']:.2f} points (limit {max_accuracy_drop:g}); failed: "
                f"{why}. {out.name} not written (export.quantize: none skips the int8 model)"
            )
    sha = sha256_file(out)
    atomic_write_text(out.with_name(out.name + ".sha256"), f"{sha}  {out.name}\n")
    report["sha256"] = sha
    report["file"] = out.name
    report["calibration_samples"] = int(calibration.shape[0])
    return report
