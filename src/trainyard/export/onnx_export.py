"""Export stage: checkpoint -> ONNX (dynamic batch, metadata inside), gated on parity.

The ONNX file carries its own contract (classes, input shape, normalisation, provenance) so
the service reads it from the model and never from a copy.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from trainyard import __version__
from trainyard.core.card import METADATA_KEY, card_from_metadata, normalize_pixels
from trainyard.core.errors import ExportError
from trainyard.core.io import atomic_file, atomic_write_text, sha256_file
from trainyard.model.classifier import Classifier
from trainyard.runtime.sessions import load_onnx

INPUT_NAME = "image"
OUTPUT_NAME = "logits"


def load_checkpoint(path: str | os.PathLike[str]) -> Any:
    """Rebuild the Classifier from a Lightning checkpoint, loading tensors only.

    ``weights_only=True``: the checkpoint is data, never code, even if someone swapped it.
    """

    path = Path(path)
    if not path.is_file():
        raise ExportError(f"{path}: checkpoint not found; run `dvc repro train` first")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # pickle errors come in many types; all mean "not loadable"
        raise ExportError(f"{path}: cannot load as a weights-only checkpoint: {err}") from None
    hparams = dict(ckpt.get("hyper_parameters", {}))
    model = Classifier(**hparams)
    model.load_state_dict(ckpt["state_dict"])
    return model.eval()


def export_onnx(
    model: Any, path: str | os.PathLike[str], opset: int, metadata: dict[str, str]
) -> None:
    """Write ``model`` (a Classifier in eval mode) to ONNX with a dynamic batch dimension."""

    example = torch.zeros(2, *model.card.input_shape)
    with atomic_file(path) as tmp:
        torch.onnx.export(
            model,
            (example,),
            str(tmp),
            dynamo=True,
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=65536)},),
            opset_version=opset,
            external_data=False,
            optimize=True,
            verbose=False,
        )
        proto = onnx.load(str(tmp))
        onnx.checker.check_model(proto, full_check=True)
        del proto.metadata_props[:]
        onnx.helper.set_model_props(proto, metadata)
        proto.doc_string = (
            f"trainyard image classifier ({model.card.source}, {model.card.num_classes} "
            "classes); its dataset card is in metadata_props['dataset_card']"
        )
        onnx.save(proto, str(tmp))


def model_metadata(model: Any, ckpt_sha256: str, run_id: str, data_sha256: str) -> dict[str, str]:
    """The ONNX metadata: the dataset card the checkpoint carries, plus provenance.

    ``dataset_card`` is the contract (classes, C/H/W, normalisation, resize policy) that
    evaluate, the registry and the service read; ``classes``, ``input_shape`` and
    ``normalization`` repeat parts of it for tools that read ONNX metadata generically.
    """
    card = model.card
    return {
        METADATA_KEY: json.dumps(card.contract(), ensure_ascii=False, sort_keys=True),
        "classes": json.dumps(list(card.classes), ensure_ascii=False),
        "input_name": INPUT_NAME,
        "input_shape": json.dumps([-1, *card.input_shape]),  # -1: dynamic batch
        "input_dtype": "float32",
        # x = (pixel / scale - mean[c]) / std[c], pixels 0..255.
        "normalization": json.dumps(
            {"scale": 255.0, "mean": list(card.mean), "std": list(card.std)}
        ),
        "arch": str(model.hparams.arch),
        "trainyard_version": __version__,
        "checkpoint_sha256": ckpt_sha256,
        "mlflow_run_id": run_id,
        "data_sha256": data_sha256,
        # The ImageNet weights the fit started from ({} from scratch): source, sha256, licence.
        "pretrained": json.dumps(getattr(model, "pretrained_info", {}) or {}, sort_keys=True),
    }


def check_parity(
    model: Any, onnx_path: str | os.PathLike[str], images: np.ndarray, max_abs_diff: float
) -> dict[str, Any]:
    """Compare ONNX Runtime (CPU, fp32) with PyTorch on the same normalised images."""

    # numpy normalisation: exactly what evaluate and the service feed ONNX Runtime.
    x = normalize_pixels(images, model.card.mean, model.card.std)
    with torch.inference_mode():
        ref = model(torch.from_numpy(x)).numpy()
    ort_model = load_onnx(onnx_path, device="cpu")
    got = ort_model.predict_logits(x, batch_size=256)
    diff = float(np.abs(ref - got).max())
    agreement = float((ref.argmax(1) == got.argmax(1)).mean())
    report = {
        "samples": int(images.shape[0]),
        "max_abs_diff": diff,
        "argmax_agreement": agreement,
        "threshold_max_abs_diff": max_abs_diff,
        "provider": ort_model.provider,
        "passed": bool(diff <= max_abs_diff and agreement == 1.0),
    }
    return report


def export_and_verify(
    ckpt_path: str | os.PathLike[str],
    onnx_path: str | os.PathLike[str],
    test_images: np.ndarray,
    opset: int,
    max_abs_diff: float,
    run_id: str,
    data_sha256: str,
) -> dict[str, Any]:
    """Export, then fail (deleting the ONNX file) unless it agrees with PyTorch."""
    onnx_path = Path(onnx_path)
    model = load_checkpoint(ckpt_path)
    meta = model_metadata(model, sha256_file(ckpt_path), run_id, data_sha256)
    export_onnx(model, onnx_path, opset, meta)
    report = check_parity(model, onnx_path, test_images, max_abs_diff)
    if not report["passed"]:
        onnx_path.unlink(missing_ok=True)  # a model that disagrees must not reach later stages
        raise ExportError(
            f"ONNX parity gate failed on {report['samples']} test images: max abs diff "
            f"{report['max_abs_diff']:.3g} (limit {max_abs_diff:g}), argmax agreement "
            f"{report['argmax_agreement']:.4%} (need 100%)"
        )
    sha = sha256_file(onnx_path)
    atomic_write_text(onnx_path.with_name(onnx_path.name + ".sha256"), f"{sha}  {onnx_path.name}\n")
    report["onnx_sha256"] = sha
    return report


def normalized_example(onnx_path: str | os.PathLike[str], images: np.ndarray) -> np.ndarray:
    """uint8 images [N,C,H,W] -> the model's float32 input, by the ONNX file's own card."""

    proto = onnx.load(str(onnx_path), load_external_data=False)
    card = card_from_metadata({p.key: p.value for p in proto.metadata_props}, str(onnx_path))
    return normalize_pixels(images, card.mean, card.std)
