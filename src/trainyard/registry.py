"""MLflow model logging and registry: the ONNX model as an MLflow model, versions, aliases.

`champion` is the version to serve; a new version takes it only if its test accuracy
beats the champion's by more than ``registry.promote_margin``; otherwise it is `challenger`.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

from trainyard.errors import TrackingError

log = logging.getLogger(__name__)

CHAMPION, CHALLENGER = "champion", "challenger"
ACCURACY_TAG, DATA_TAG, SHA_TAG = "test_accuracy", "data_version", "onnx_sha256"


def log_onnx_model(onnx_path: str | os.PathLike[str], example: np.ndarray) -> str:
    """Log ``onnx_path`` to the active run as an MLflow ONNX model; return its model URI.

    The file is stored as is (no external data): its sha256 stays the one export recorded,
    so a registry download can be checked against it.
    """
    import mlflow.onnx
    import onnx
    from mlflow.models import infer_signature

    from trainyard.inference import load_onnx

    logits = load_onnx(onnx_path, device="cpu").run(example)
    info = mlflow.onnx.log_model(
        onnx.load(str(onnx_path)),
        name="model",
        signature=infer_signature(example, logits),  # batch dim inferred as variable (-1)
        input_example=example,
        save_as_external_data=False,
        onnx_execution_providers=["CPUExecutionProvider"],
    )
    return info.model_uri


def current_alias(client: Any, name: str, alias: str) -> Any | None:
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException as err:
        if err.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            return None
        raise


def decide(test_acc: float, champion: Any | None, margin: float) -> tuple[str, str]:
    """(alias, reason) for a new version with ``test_acc`` against the current champion."""
    if champion is None:
        return CHAMPION, "first version with a test accuracy: becomes champion"
    try:
        champ_acc = float(champion.tags[ACCURACY_TAG])
    except (KeyError, ValueError):
        return CHAMPION, (
            f"champion v{champion.version} has no {ACCURACY_TAG} tag to beat: replaced"
        )
    # The tag holds 6 decimals: compare at that precision, or a rerun with the very same
    # accuracy (0.225806... against the tag's 0.225806) would "beat" its own champion.
    if round(test_acc, 6) > round(champ_acc + margin, 6):
        return CHAMPION, (
            f"test accuracy {test_acc:.4f} beats champion v{champion.version} "
            f"({champ_acc:.4f}) by more than the margin {margin:g}"
        )
    return CHALLENGER, (
        f"test accuracy {test_acc:.4f} does not beat champion "
        f"v{champion.version} ({champ_acc:.4f}) by more than the margin "
        f"{margin:g}: champion stays"
    )


def register_and_promote(
    client: Any,
    name: str,
    model_uri: str,
    run_id: str,
    test_acc: float,
    data_version: str,
    onnx_sha256: str,
    margin: float,
    contract: Any | None = None,
) -> dict[str, Any]:
    """Register a new version, then move `champion` or `challenger` to it.

    ``contract`` (the ONNX model's dataset card) puts the input contract on the version:
    source, class count and names, input shape and resize policy, so the registry UI shows
    what a version takes and answers without downloading it.
    If anything fails after the version exists, the version is deleted again: a version
    without its alias and tags would look like a decision that was never made.
    """
    import json

    import mlflow

    tags = {
        ACCURACY_TAG: f"{test_acc:.6f}",
        DATA_TAG: data_version,
        SHA_TAG: onnx_sha256,
        "run_id": run_id,
    }
    if contract is not None:
        classes = json.dumps(list(contract.classes), ensure_ascii=False)
        tags |= {
            "dataset.source": contract.source,
            "dataset.num_classes": str(contract.num_classes),
            # MLflow caps a tag value at 5,000 characters; hundreds of long names exceed it.
            "dataset.classes": classes if len(classes) <= 5000 else classes[:4990] + "...",
            "input_shape": "x".join(str(d) for d in contract.input_shape),
            "resize": contract.resize,
        }
    champion = current_alias(client, name, CHAMPION)
    version = mlflow.register_model(model_uri, name, tags=tags)
    try:
        alias, reason = decide(test_acc, champion, margin)
        client.set_model_version_tag(name, version.version, "decision", alias)
        client.set_model_version_tag(name, version.version, "decision_reason", reason)
        client.set_registered_model_alias(name, alias, version.version)
    except Exception as err:
        try:
            client.delete_model_version(name, version.version)
        except Exception:  # the store is already failing; report the first error
            log.exception("could not remove half-registered version %s", version.version)
        raise TrackingError(f"registering {name} v{version.version} failed: {err}") from err
    return {
        "model_name": name,
        "version": int(version.version),
        "alias": alias,
        "reason": reason,
        "previous_champion": int(champion.version) if champion is not None else None,
        "model_uri": f"models:/{name}@{alias}",
        "source": model_uri,
    }


def parse_model_uri(uri: str) -> tuple[str, str | None, str | None]:
    """``models:/NAME@ALIAS`` or ``models:/NAME/VERSION`` -> (name, alias, version)."""
    rest = uri.removeprefix("models:/")
    if "@" in rest:
        name, alias = rest.split("@", 1)
        if name and alias and "/" not in name:
            return name, alias, None
    elif rest.count("/") == 1:
        name, version = rest.split("/")
        if name and version.isdigit():
            return name, None, version
    raise TrackingError(
        f"model source {uri!r}: expected models:/NAME@ALIAS (e.g. models:/"
        "fashion-mnist-classifier@champion) or models:/NAME/VERSION"
    )


def fetch_registered_onnx(
    uri: str, cache_dir: str | os.PathLike[str]
) -> tuple[Any, dict[str, str]]:
    """Resolve a registry URI, download its ONNX file into ``cache_dir``, verify its sha256.

    Only the ``model.onnx`` file is ever used: nothing from the registry is unpickled or
    imported. The sha256 must match the version's ``onnx_sha256`` tag (set by evaluate);
    a version without the tag, or a file that does not match, is refused.
    Returns (path, provenance).
    """
    import shutil
    import tempfile
    from pathlib import Path

    import mlflow
    from mlflow.exceptions import MlflowException

    from trainyard.io import atomic_write_text, sha256_file
    from trainyard.tracking import check_tracking_uri, resolve_tracking_uri

    name, alias, version = parse_model_uri(uri)
    tracking_uri = resolve_tracking_uri()
    check_tracking_uri(tracking_uri)
    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    try:
        mv = (
            client.get_model_version_by_alias(name, alias)
            if alias
            else client.get_model_version(name, version)
        )
    except MlflowException as err:
        raise TrackingError(
            f"model source {uri}: not found in the registry at {tracking_uri} ({err.message})"
        ) from None
    expected = mv.tags.get(SHA_TAG)
    if not expected:
        raise TrackingError(
            f"{uri} (v{mv.version}) has no {SHA_TAG} tag; refusing to serve a "
            "model whose bytes cannot be checked"
        )
    dest = Path(cache_dir) / name / str(mv.version) / "model.onnx"
    if not (dest.is_file() and sha256_file(dest) == expected):
        dest.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
            folder = Path(
                mlflow.artifacts.download_artifacts(
                    artifact_uri=f"models:/{name}/{mv.version}",
                    dst_path=tmp,
                    tracking_uri=tracking_uri,
                )
            )
            got = folder / "model.onnx"
            if not got.is_file():
                raise TrackingError(
                    f"{uri} (v{mv.version}): the registered model has no model.onnx"
                )
            actual = sha256_file(got)
            if actual != expected:
                raise TrackingError(
                    f"{uri} (v{mv.version}): downloaded model.onnx has sha256 {actual}, the "
                    f"registry records {expected}; refusing it"
                )
            shutil.move(str(got), dest)
    # The same sidecar the export stage writes: one verification path for every model file.
    atomic_write_text(dest.with_name(dest.name + ".sha256"), f"{expected}  {dest.name}\n")
    return dest, {
        "model_source": uri,
        "registry_model": name,
        "registry_version": str(mv.version),
        "registry_alias": alias or "",
        "run_id": mv.run_id or "",
        "data_version": mv.tags.get(DATA_TAG, ""),
        "onnx_sha256": expected,
    }
