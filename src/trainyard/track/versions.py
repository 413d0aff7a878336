"""Which registry version a ``models:/`` URI names: ``models:/NAME@ALIAS`` or
``models:/NAME/N``, resolved against the tracking store (the registry's readers: the
served model, its drift reference and its int8 file), and the download of a version's
file checked against the sha256 its tag records."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import mlflow
from mlflow.exceptions import MlflowException

from trainyard.core.errors import TrackingError
from trainyard.core.io import sha256_file
from trainyard.track.store import check_tracking_uri, resolve_tracking_uri


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


def version_of(uri: str, what: str) -> tuple[str, Any, str]:
    """(model name, the ModelVersion, tracking URI) that ``models:/NAME@ALIAS`` or
    ``models:/NAME/N`` names; a TrackingError starting with ``what`` when there is none."""
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
            f"{what} {uri}: not found in the registry at {tracking_uri} ({err.message})"
        ) from None
    return name, mv, tracking_uri


def download_verified(
    mv: Any, artifact: str, dest: Path, expected: str, tracking_uri: str, what: str
) -> Path:
    """The run artifact ``artifact`` of version ``mv`` at ``dest``, whole, its sha256 the
    ``expected`` one the version's tag records (a copy already there that matches is
    kept); a TrackingError starting with ``what`` when it cannot be had or differs."""
    if dest.is_file() and sha256_file(dest) == expected:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        try:
            got = Path(
                mlflow.artifacts.download_artifacts(
                    artifact_uri=f"runs:/{mv.run_id}/{artifact}",
                    dst_path=tmp,
                    tracking_uri=tracking_uri,
                )
            )
        except MlflowException as err:
            raise TrackingError(f"{what}: {err.message}") from None
        actual = sha256_file(got)
        if actual != expected:
            raise TrackingError(
                f"{what}: the download has sha256 {actual}, the registry records {expected}; "
                "refusing it"
            )
        os.replace(got, dest)  # whole or not at all (tmp is in dest's folder)
    return dest
