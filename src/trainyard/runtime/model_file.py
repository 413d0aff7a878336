"""A model file the pipeline exported: checked against its recorded sha256, then opened.

The export stage writes ``model.onnx.sha256`` beside the model (and a registry download
writes the same sidecar): the service and ``trainyard predict`` serve or score only a file
whose bytes are the ones recorded, and say which (its sha256 is their model version).
"""

from __future__ import annotations

from pathlib import Path

from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

from trainyard.core.errors import ModelError
from trainyard.core.io import sha256_file
from trainyard.runtime.sessions import Device, OnnxModel, load_onnx

# What ONNX Runtime raises for a file it cannot load: its own classes derive from Exception
# only, not RuntimeError.
ORT_LOAD_ERRORS: tuple[type[Exception], ...] = (
    OSError,
    RuntimeError,
    ort_state.Fail,
    ort_state.InvalidArgument,
    ort_state.InvalidGraph,
    ort_state.InvalidProtobuf,
    ort_state.NoModel,
    ort_state.NoSuchFile,
    ort_state.NotImplemented,
    ort_state.RuntimeException,
)


# export.quantize: int8 writes the int8 model beside the fp32 one (models/model.onnx ->
# models/model.int8.onnx), with its own .sha256; its metadata says its precision.
INT8_SUFFIX = ".int8.onnx"
PRECISION_KEY = "precision"


def int8_beside(model: Path) -> Path:
    """Where the export writes the int8 model of ``model``: beside it, ``<stem>.int8.onnx``."""
    return model.with_name(model.stem + INT8_SUFFIX)


# evaluate writes the model card beside the fp32 model (models/model.onnx ->
# models/model.card.json and .card.md), which the bento ships and GET /card serves, and as
# reports/model_card.{json,md}, which it logs to the train run under model_card/.
CARD_SUFFIXES = {"json": ".card.json", "md": ".card.md"}
CARD_FILES = {"json": "model_card.json", "md": "model_card.md"}


def card_beside(model: Path, kind: str) -> Path:
    """Where evaluate writes ``model``'s card as ``kind`` (json or md); an int8 model's is
    its fp32 model's (``model.int8.onnx`` -> ``model.card.json``)."""
    stem = model.name.removesuffix(INT8_SUFFIX) if model.name.endswith(INT8_SUFFIX) else model.stem
    return model.with_name(stem + CARD_SUFFIXES[kind])


def precision_of(metadata: dict[str, str]) -> str:
    """``int8`` or ``fp32`` from a model's ONNX metadata (models without the key: fp32)."""
    return metadata.get(PRECISION_KEY) or "fp32"


def verify_model(path: Path) -> str:
    """sha256 of ``path`` after checking it against the ``<path>.sha256`` the export wrote."""
    sums = path.with_name(path.name + ".sha256")
    if not path.is_file():
        raise ModelError(
            f"{path}: model not found; run `make run` (or `dvc repro export`), "
            f"or point serve.model (or $TRAINYARD_MODEL), or --model, at an exported model"
        )
    try:
        recorded = sums.read_text().split()[0].lower()
    except FileNotFoundError:
        raise ModelError(
            f"{sums}: checksum file missing; the export stage writes it beside the model, "
            "and the service only serves a model whose sha256 was recorded"
        ) from None
    except (OSError, UnicodeDecodeError, IndexError) as err:
        raise ModelError(f"{sums}: unreadable checksum file ({err!r})") from None
    try:
        actual = sha256_file(path)
    except OSError as err:
        raise ModelError(f"{path}: cannot read the model ({err})") from None
    if actual != recorded:
        raise ModelError(
            f"{path}: sha256 {actual} does not match {recorded} recorded in {sums.name}; "
            "the file changed after export. Re-export it (`dvc repro export`) rather than "
            "serve an unverified model"
        )
    return actual


def open_verified(
    path: Path, device: Device = "auto", intra_op_threads: int = 0
) -> tuple[OnnxModel, str]:
    """(session, sha256): ``path`` verified, then opened on the provider ``device`` allows
    (a 'cuda' that cannot be had is a ProviderError, never a quiet CPU run)."""
    sha = verify_model(path)
    try:
        model = load_onnx(path, device=device, intra_op_threads=intra_op_threads)
    except ORT_LOAD_ERRORS as err:
        raise ModelError(f"{path}: ONNX Runtime cannot load it: {err}") from None
    return model, sha
