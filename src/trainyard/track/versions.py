"""What a registered version records (its tags), which version a ``models:/`` reference
names in the tracking store, and the download of a version's file checked against the
sha256 its tag records: what the registry's writers (track.registry, track.promotion) and
its reader (track.model_refs) share."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import mlflow
from mlflow.exceptions import MlflowException

from trainyard.core.errors import TrackingError
from trainyard.core.io import sha256_file
from trainyard.core.model_ref import ModelRef
from trainyard.track.store import check_tracking_uri, resolve_tracking_uri

CHAMPION, CHALLENGER = "champion", "challenger"
ACCURACY_TAG, DATA_TAG, SHA_TAG = "test_accuracy", "data_version", "onnx_sha256"
DECISION_TAG, PENDING = "decision", "pending"
# The model's drift reference (trainyard.watch.reference): logged in the run under
# REFERENCE_ARTIFACT, its sha256 tagged on the version so a download can be checked.
REFERENCE_TAG = "reference_sha256"
REFERENCE_ARTIFACT = "reference/model.reference.npz"
# The model card (trainyard.evaluation.model_card): evaluate logs reports/model_card.{md,json}
# into this folder of the train run; `trainyard card` reads them from there.
CARD_ARTIFACT_DIR = "model_card"
# What a move of `champion` by hand (trainyard promote / rollback, track.promotion) records
# on the version it moves to; read by a following service too, for the reason it logs.
PROMOTE_REASON_TAG = "promote.reason"


def current_alias(client: Any, name: str, alias: str) -> Any | None:
    """The version of ``name`` that ``alias`` points at, or None (no such model or alias)."""

    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException as err:
        if err.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            return None
        raise


def version_of(ref: ModelRef) -> tuple[Any, str]:
    """(the ModelVersion, tracking URI) that ``models:/NAME@ALIAS`` or ``models:/NAME/N``
    names; a TrackingError naming the reference's field when there is none."""
    tracking_uri = resolve_tracking_uri()
    check_tracking_uri(tracking_uri)
    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    if not ref.name:
        raise TrackingError(f"{ref.field}: {ref}: not a registered model's version")
    try:
        mv = (
            client.get_model_version_by_alias(ref.name, ref.alias)
            if ref.alias
            else client.get_model_version(ref.name, ref.version)
        )
    except MlflowException as err:
        raise TrackingError(
            f"{ref.field}: {ref}: not found in the registry at {tracking_uri} ({err.message})"
        ) from None
    return mv, tracking_uri


def download_verified(
    uri: str, dest: Path, expected: str, tracking_uri: str, what: str, member: str = ""
) -> Path:
    """The artifact at ``uri`` (``runs:/...`` or ``models:/...``; ``member``: the file
    within it, when it is a folder) at ``dest``, whole, its sha256 the ``expected`` one the
    version's tag records (a copy already there that matches is kept); a TrackingError
    starting with ``what`` when it cannot be had or differs."""
    if dest.is_file() and sha256_file(dest) == expected:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        try:
            got = Path(
                mlflow.artifacts.download_artifacts(
                    artifact_uri=uri, dst_path=tmp, tracking_uri=tracking_uri
                )
            )
        except MlflowException as err:
            raise TrackingError(f"{what}: {err.message}") from None
        got = got / member if member else got
        if member and not got.is_file():
            raise TrackingError(f"{what}: the registered model has no {member}")
        actual = sha256_file(got)
        if actual != expected:
            raise TrackingError(
                f"{what}: downloaded {got.name} has sha256 {actual}, the registry records "
                f"{expected}; refusing it"
            )
        # A rename within one folder (tmp is in dest's): two workers fetching one version
        # at once (a champion move seen by all of them) each replace the file whole.
        os.replace(got, dest)
    return dest
