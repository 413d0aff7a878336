"""Export stage: checkpoint -> ONNX (dynamic batch, metadata inside), gated on parity.

The ONNX file carries its own contract (classes, input shape, normalisation, provenance) so
the service reads it from the model and never from a copy. Its outputs are ``logits``
(first, as before), ``embedding``: the input of the classifier head (the net's last
``nn.Linear``), the features drift detection and the prediction log compare, and ``cam``:
a class activation map per class over the last feature maps, [N, K, h, w], made in the
graph (``trainyard.export.cam``; metadata ``explain`` says ``cam`` or ``gradcam``).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from torch import nn

from trainyard import __version__
from trainyard.core.card import METADATA_KEY, card_from_metadata, normalize_pixels
from trainyard.core.errors import ExportError
from trainyard.core.handoffs import SELECTED_VAL_LOGITS
from trainyard.core.io import atomic_file, atomic_write_text, sha256_file
from trainyard.core.pause_points import pause_point
from trainyard.export.calibration import choose_temperature, nll
from trainyard.export.cam import ExplainedNet
from trainyard.model import networks
from trainyard.model.trained import TrainedNet, pixel_logits
from trainyard.runtime.explain import CAM_OUTPUT, EXPLAIN_KEY
from trainyard.runtime.sessions import EMBEDDING_OUTPUT, LOGITS_OUTPUT, OnnxModel, load_onnx

log = logging.getLogger(__name__)

INPUT_NAME = "image"
# Fewer validation images than this: no temperature (one image moves a small split's NLL
# more than a temperature would).
MIN_CALIBRATION_IMAGES = 50
OUTPUT_NAME = LOGITS_OUTPUT  # output 0: what every reader of a one-output model took
EMBEDDING_NAME = EMBEDDING_OUTPUT  # output 1: [N, D] float32
CAM_NAME = CAM_OUTPUT  # output 2: [N, K, h, w] float32
# The parity gate compares the maps on this many of its images: one more PyTorch forward
# of the export view, the maps being K times the logits' size per position.
CAM_PARITY_IMAGES = 64


def load_checkpoint(path: str | os.PathLike[str]) -> Any:
    """Rebuild the trained net from a Lightning checkpoint, loading tensors only (a
    ``TrainedNet``: the Classifier's net, card and provenance, without Lightning).

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
    model = TrainedNet(**hparams)
    model.load_state_dict(ckpt["state_dict"])
    # A model refitted on train + val (train.refit) carries the val-chosen model's val
    # logits: the temperature is fitted on those, never on images the model trained on.
    model.selected_val_logits = ckpt.get(SELECTED_VAL_LOGITS)
    return model.eval()


def classifier_head(model: nn.Module) -> tuple[str, nn.Linear]:
    """(submodule path, module) of ``model``'s classifier head (``model.networks``' rule:
    its last ``nn.Linear``). The parity gate proves the head is the last step (the exported
    logits, computed as head(embedding), must equal the model's own)."""
    found = networks.classifier_head(model)
    if found is None:
        raise ExportError(f"{type(model).__name__} has no nn.Linear head to take an embedding from")
    return found


class LogitsAndEmbedding(ExplainedNet):
    """Export-only view of a classifier: ``forward(x) -> (logits, embedding, cam)``, where
    the embedding is what the head sees, the logits are the head applied to it, and cam
    [N, K, h, w] the class activation maps (``trainyard.export.cam``; ``kind``: ``cam`` or
    ``gradcam``, what the metadata's ``explain`` records).

    The net's own modules, split into trunk (input -> last feature maps), pooling and
    head (the model itself is left as it was): a plain graph with no hooks or side effects,
    which the ONNX exporter traces like any net. The logits and the maps are divided by
    ``temperature`` (``trainyard.export.calibration``; 1: as trained).
    """

    def __init__(self, model: nn.Module, temperature: float = 1.0) -> None:
        classifier_head(model)  # the ExportError for a model without a Linear head
        # A Classifier or a TrainedNet: its ``net``; a bare network: itself.
        net = model.net if isinstance(getattr(model, "net", None), nn.Module) else model
        super().__init__(net, temperature)
        self.train(model.training)  # in the model's mode (eval, to export): no mode warning


def fold_shapes(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The shape arithmetic the tracer records, folded by onnxscript's optimizer (what
    dynamo's ``optimize`` did): half the nodes, ONNX Runtime's speed of the torch.export
    graph. A machine without onnxscript (the bare GPU box of ``make gpu-check``) keeps the
    traced graph: the same answers, a few more nodes."""
    try:
        import onnxscript.optimizer
    except ImportError:
        return proto
    return onnxscript.optimizer.optimize(proto)


def trace_to_onnx(
    view: nn.Module, example: torch.Tensor, path: Path, outputs: list[str], opset: int
) -> str:
    """Write ``view`` to ``path`` as ONNX with a dynamic batch; return the exporter used.

    The TorchScript exporter, not torch.export (dynamo=True): the same graph (the parity
    gate checks every output) in a tenth of the CPU time (Fashion cnn 0.1 s against 2.5 s,
    EfficientNet-Lite0 1.3 s against 9.5 s: tracing the three outputs and building
    torchlib's registry cost more than all of the stage's work besides). PyTorch deprecated
    it in 2.9; a torch without it (or a net it cannot trace) goes through torch.export.
    """
    export = functools.partial(  # what both exporters are given
        torch.onnx.export,
        view,
        (example,),
        str(path),
        input_names=[INPUT_NAME],
        output_names=outputs,
        opset_version=opset,
        verbose=False,
    )
    try:
        with warnings.catch_warnings():
            # Its tracer warns where a size becomes a constant: H and W are the card's,
            # fixed; the batch stays dynamic (dynamic_axes; the gate runs other batches).
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            export(dynamo=False, dynamic_axes={n: {0: "batch"} for n in [INPUT_NAME, *outputs]})
        return "torchscript"
    except (RuntimeError, TypeError, NotImplementedError, AttributeError) as exc:
        log.warning("the TorchScript exporter failed (%s); exporting with torch.export", exc)
    export(
        dynamo=True,
        dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=65536)},),
        external_data=False,
        optimize=True,  # folded here: fold_shapes is for the TorchScript exporter's graph
    )
    return "dynamo"


def export_onnx(
    model: Any,
    path: str | os.PathLike[str],
    opset: int,
    metadata: dict[str, str],
    temperature: float = 1.0,
) -> str:
    """Write ``model`` (a Classifier or TrainedNet in eval mode) to ONNX with a dynamic
    batch dimension and three outputs: ``logits`` [N, classes] (divided by
    ``temperature``), ``embedding`` [N, D] (the head's input), then ``cam`` [N, classes,
    h, w] (divided likewise); the metadata gains ``explain`` (``cam`` or ``gradcam``: how
    the maps are made). Returns the exporter used (``trace_to_onnx``)."""

    example = torch.zeros(2, *model.card.input_shape)
    view = LogitsAndEmbedding(model, temperature)
    metadata = metadata | {EXPLAIN_KEY: view.kind}
    outputs = [OUTPUT_NAME, EMBEDDING_NAME, CAM_NAME]
    with atomic_file(path) as tmp:
        exporter = trace_to_onnx(view, example, tmp, outputs, opset)
        proto = onnx.load(str(tmp))
        if exporter == "torchscript":  # torch.export's graph comes folded (optimize=True)
            proto = fold_shapes(proto)
        onnx.checker.check_model(proto, full_check=True)
        del proto.metadata_props[:]
        onnx.helper.set_model_props(proto, metadata)
        proto.doc_string = (
            f"trainyard image classifier ({model.card.source}, {model.card.num_classes} "
            "classes); its dataset card is in metadata_props['dataset_card']"
        )
        onnx.save(proto, str(tmp))
        pause_point("export.onnx_written")  # the temp file whole, not yet renamed
    return exporter


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
        # The second output: the classifier head's input, [N, embedding_dim] float32.
        "embedding_output": EMBEDDING_NAME,
        "embedding_dim": str(classifier_head(model)[1].in_features),
    }


def check_parity(
    model: Any,
    onnx_path: str | os.PathLike[str],
    images: np.ndarray,
    max_abs_diff: float,
    temperature: float = 1.0,
) -> dict[str, Any]:
    """Compare ONNX Runtime (CPU, fp32) with PyTorch on the same normalised images: the
    logits (max abs diff <= ``max_abs_diff``, 100% argmax agreement), the embedding, and
    the class activation maps on the first ``CAM_PARITY_IMAGES``.

    The embedding's limit is relative to its scale, ``max_abs_diff * max(1, max|ref|)``:
    features are not normalised like logits (post-ReLU activations can reach tens), and
    fp32 rounding grows with the magnitude; at a scale <= 1 it is the logits' own limit.
    The maps' limit is relative the same way. The PyTorch embedding comes from a forward
    hook on the head, not from the exported view, so a wrong tap in the export fails here;
    the PyTorch maps come from the export view (``LogitsAndEmbedding``) run by PyTorch,
    which the tests hold equal to autograd's Grad-CAM and to CAM from a hook on the last
    feature maps (a per-export autograd pass would cost K backward passes a batch).
    ``parity_failures`` says what failed.
    """

    # numpy normalisation: exactly what evaluate and the service feed ONNX Runtime.
    x = normalize_pixels(images, model.card.mean, model.card.std)
    ref, ref_embedding = _torch_outputs(model, x)
    ref = ref / np.float32(temperature)  # the calibrated logits the graph was exported with
    ort_model = load_onnx(onnx_path, device="cpu")
    got, embedding = _ort_outputs(ort_model, x, batch_size=256)
    diff = float(np.abs(ref - got).max())
    agreement = float((ref.argmax(1) == got.argmax(1)).mean())
    emb_limit = max_abs_diff * max(1.0, float(np.abs(ref_embedding).max()))
    emb_diff = None
    if embedding is not None and embedding.shape == ref_embedding.shape:
        emb_diff = float(np.abs(ref_embedding - embedding).max())
    cam_diff, cam_limit = _cam_parity(model, ort_model, x[:CAM_PARITY_IMAGES], temperature)
    report = {
        "samples": int(images.shape[0]),
        "max_abs_diff": diff,
        "argmax_agreement": agreement,
        "threshold_max_abs_diff": max_abs_diff,
        "embedding_max_abs_diff": emb_diff,  # None: no embedding output of the right shape
        "threshold_embedding_max_abs_diff": emb_limit,
        "cam_max_abs_diff": cam_diff,  # None: no cam output of the view's shape
        "threshold_cam_max_abs_diff": max_abs_diff * max(1.0, cam_limit),
        "provider": ort_model.provider,
    }
    report["passed"] = not parity_failures(report)
    return report


def parity_failures(report: dict[str, Any]) -> list[str]:
    """What a ``check_parity`` report fails on, one phrase per failure naming the output
    (``logits: ...``, ``embedding: ...``); empty when it passes."""
    failures = []
    if not report["max_abs_diff"] <= report["threshold_max_abs_diff"]:  # NaN fails too
        failures.append(
            f"logits: max abs diff {report['max_abs_diff']:.3g} "
            f"(limit {report['threshold_max_abs_diff']:g})"
        )
    if report["argmax_agreement"] != 1.0:
        failures.append(f"logits: argmax agreement {report['argmax_agreement']:.4%} (need 100%)")
    failures += _relative_failures(report, "embedding", "the head's input shape")
    failures += _relative_failures(report, CAM_NAME, "the class maps' shape")
    return failures


def _relative_failures(report: dict[str, Any], output: str, shape: str) -> list[str]:
    """The failure of ``output`` (``embedding`` or ``cam``) in a parity report, whose limit
    is relative to its scale; empty when it passes."""
    diff, limit = report[f"{output}_max_abs_diff"], report[f"threshold_{output}_max_abs_diff"]
    if diff is None:
        return [f"{output}: no '{output}' output of {shape}"]
    if not diff <= limit:
        return [
            f"{output}: max abs diff {diff:.3g} (limit {limit:.3g}: "
            f"{report['threshold_max_abs_diff']:g} x max(1, max |{output}|))"
        ]
    return []


def _cam_parity(
    model: nn.Module, ort_model: OnnxModel, x: np.ndarray, temperature: float
) -> tuple[float | None, float]:
    """(max abs diff of ONNX Runtime's ``cam`` from PyTorch's, or None when the model has
    no such output of that shape; max |PyTorch's cam|, the scale its limit is relative to)."""
    with torch.inference_mode():
        ref = LogitsAndEmbedding(model, temperature)(torch.from_numpy(x))[2].numpy()
    scale = float(np.abs(ref).max()) if ref.size else 0.0
    if CAM_NAME not in [o.name for o in ort_model.session.get_outputs()]:
        return None, scale
    got = ort_model.session.run([CAM_NAME], {ort_model.input_name: x})[0]
    if got.shape != ref.shape:
        return None, scale
    return float(np.abs(ref - got).max()), scale


def _torch_outputs(model: nn.Module, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(logits, the head's input) from ``model`` itself, the input caught by a hook."""
    seen: list[torch.Tensor] = []
    hook = classifier_head(model)[1].register_forward_hook(
        lambda _module, args, _out: seen.append(args[0])
    )
    try:
        with torch.inference_mode():
            logits = model(torch.from_numpy(x))
    finally:
        hook.remove()
    return logits.numpy(), seen[-1].numpy()


def _ort_outputs(
    model: OnnxModel, x: np.ndarray, batch_size: int
) -> tuple[np.ndarray, np.ndarray | None]:
    """(logits, embedding or None) from ONNX Runtime, ``batch_size`` images a run."""
    parts = [model.run_with_embedding(x[i : i + batch_size]) for i in range(0, len(x), batch_size)]
    logits = np.concatenate([p[0] for p in parts])
    if any(p[1] is None for p in parts):
        return logits, None
    return logits, np.concatenate([p[1] for p in parts])


def export_and_verify(
    ckpt_path: str | os.PathLike[str],
    onnx_path: str | os.PathLike[str],
    test_images: np.ndarray,
    opset: int,
    max_abs_diff: float,
    run_id: str,
    data_sha256: str,
    calibration: tuple[np.ndarray, np.ndarray] | None = None,
) -> dict[str, Any]:
    """Export, then fail (deleting the ONNX file) unless it agrees with PyTorch.

    ``calibration``: (uint8 images, labels) of the validation split, on which a temperature
    is fitted and baked into the graph (``trainyard.export.calibration``); None: none (1).
    """
    onnx_path = Path(onnx_path)
    model = load_checkpoint(ckpt_path)
    meta = model_metadata(model, sha256_file(ckpt_path), run_id, data_sha256)
    scaling: dict[str, Any] = {"temperature": 1.0}
    if calibration is not None:
        scaling = calibrate(model, *calibration, checkpoint=str(ckpt_path))
    meta["temperature"] = repr(scaling["temperature"])
    export_onnx(model, onnx_path, opset, meta, scaling["temperature"])
    report = check_parity(model, onnx_path, test_images, max_abs_diff, scaling["temperature"])
    report["calibration"] = scaling
    if not report["passed"]:
        onnx_path.unlink(missing_ok=True)  # a model that disagrees must not reach later stages
        raise ExportError(
            f"ONNX parity gate failed on {report['samples']} test images: "
            + "; ".join(parity_failures(report))
        )
    sha = sha256_file(onnx_path)
    atomic_write_text(onnx_path.with_name(onnx_path.name + ".sha256"), f"{sha}  {onnx_path.name}\n")
    report["onnx_sha256"] = sha
    return report


def calibrate(
    model: Any, images: np.ndarray, labels: np.ndarray, checkpoint: str = "the checkpoint"
) -> dict[str, Any]:
    """The temperature fitted on ``images`` (the validation split) by the model's own
    logits (``choose_temperature``: 1 unless it lowers the split's ECE), with the split's
    NLL and ECE before and after: what the export record keeps. 1 (and
    ``samples`` 0) when the split is too small to fit one, or the model is never wrong
    on it. ``checkpoint``: where ``model`` came from, for the error a refitted model's
    stored val logits raise when they do not match ``labels``."""
    if len(labels) < MIN_CALIBRATION_IMAGES:
        return {"temperature": 1.0, "samples": 0}
    selected = getattr(model, "selected_val_logits", None)  # a refitted model's (load_checkpoint)
    refitted = selected is not None
    if refitted and len(selected) != len(labels):
        # The refitted model trained on these images: its own logits would fit a
        # temperature to answers it learnt. No silent fallback to them.
        raise ExportError(
            f"{checkpoint}: refitted on train + val, it carries the val-chosen model's logits "
            f"({SELECTED_VAL_LOGITS}) for {len(selected)} images, but the val split has "
            f"{len(labels)}: the data changed since training; run `dvc repro train`"
        )
    logits = (selected.float() if refitted else pixel_logits(model, model.card, images)).numpy()
    if (logits.argmax(axis=1) == labels).all():
        # Never wrong on these images: the NLL falls as T shrinks to its bound, which would
        # make every answer near-certain on images the model has not seen. Left as trained.
        return {"temperature": 1.0, "samples": 0}
    chosen = choose_temperature(logits, labels)  # 1 when the fit would not lower the ECE
    return (
        chosen
        | {
            "samples": len(labels),
            "val_nll_before": round(nll(logits, labels), 6),
            "val_nll_after": round(nll(logits, labels, chosen["temperature"]), 6),
        }
        | ({"fitted_on": "the val-chosen model, before refit"} if refitted else {})
    )


def normalized_example(onnx_path: str | os.PathLike[str], images: np.ndarray) -> np.ndarray:
    """uint8 images [N,C,H,W] -> the model's float32 input, by the ONNX file's own card."""

    proto = onnx.load(str(onnx_path), load_external_data=False)
    card = card_from_metadata({p.key: p.value for p in proto.metadata_props}, str(onnx_path))
    return normalize_pixels(images, card.mean, card.std)
