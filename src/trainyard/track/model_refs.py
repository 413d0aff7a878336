"""The model registry as the service, bulk scoring and ``trainyard drift`` use it: MLflow's,
behind trainyard.core.model_ref's ``ModelRegistry``.

Only files are ever used: a version's ``model.onnx`` (its int8 file, its drift reference),
each checked against the sha256 its tag records; nothing from the registry is unpickled or
imported. A version without the tag, or a file that does not match, is refused. The entry
points build one ``MlflowRegistry`` and hand it down (trainyard.core.model_ref).
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from pathlib import Path
from typing import Any

import mlflow
from mlflow.exceptions import MlflowException

from trainyard.core.errors import TrackingError
from trainyard.core.io import atomic_write_text
from trainyard.core.model_ref import FetchedModel, ModelRef
from trainyard.runtime.model_file import CARD_FILES, INT8_SUFFIX, card_beside
from trainyard.track.quantized import INT8_ARTIFACT_TAG, INT8_SHA_TAG
from trainyard.track.store import check_tracking_uri, resolve_tracking_uri
from trainyard.track.versions import (
    CARD_ARTIFACT_DIR,
    DATA_TAG,
    PROMOTE_REASON_TAG,
    REFERENCE_ARTIFACT,
    REFERENCE_TAG,
    SHA_TAG,
    current_alias,
    download_verified,
    version_of,
)


class MlflowRegistry:
    """trainyard.core.model_ref.ModelRegistry on the tracking store stages use
    ($MLFLOW_TRACKING_URI, else the repository's)."""

    def fetch(self, ref: ModelRef, cache_dir: Path) -> FetchedModel:
        """The version ``models:/...`` names, or for ``runs:/RUN_ID`` the version that run
        registered (its newest, when it registered more than one): the registry's sha256
        check applies to both."""
        if not ref.run_id:
            return fetch_registered(ref, cache_dir)
        return fetch_registered(ref, cache_dir, version_of_run(ref))

    def fetch_int8(self, ref: ModelRef, cache_dir: Path) -> Path | None:
        """The int8 model of the version ``ref`` names, downloaded beside the fp32 file's
        and checked against its ``int8_sha256`` tag, with the .sha256 sidecar the service
        verifies; None for a version registered without one (export.quantize none)."""
        mv, tracking_uri = _version(ref)
        expected, artifact = mv.tags.get(INT8_SHA_TAG), mv.tags.get(INT8_ARTIFACT_TAG)
        if not expected or not artifact or not mv.run_id:
            return None
        dest = Path(cache_dir) / mv.name / str(mv.version) / f"model{INT8_SUFFIX}"
        what = f"{ref.field}: {ref} (v{mv.version}) int8 model"
        download_verified(f"runs:/{mv.run_id}/{artifact}", dest, expected, tracking_uri, what)
        atomic_write_text(dest.with_name(dest.name + ".sha256"), f"{expected}  {dest.name}\n")
        return dest

    def fetch_reference(self, ref: ModelRef, cache_dir: Path) -> Path:
        """The drift reference (``REFERENCE_ARTIFACT``) of the version ``ref`` names,
        checked against its ``reference_sha256`` tag."""
        mv, tracking_uri = _version(ref)
        what = f"{ref.field}: {ref} (v{mv.version})"
        expected = mv.tags.get(REFERENCE_TAG)
        if not expected or not mv.run_id:
            raise TrackingError(
                f"{what} has no {REFERENCE_TAG} tag: it was registered before evaluate "
                "stored a reference; rerun `dvc repro evaluate` for that model"
            )
        dest = Path(cache_dir) / mv.name / str(mv.version) / "model.reference.npz"
        uri = f"runs:/{mv.run_id}/{REFERENCE_ARTIFACT}"
        return download_verified(uri, dest, expected, tracking_uri, what)

    def fetch_card(self, ref: ModelRef, cache_dir: Path, kind: str) -> Path:
        """The model card (``kind``: md or json) evaluate logged in the run of the version
        ``ref`` names, beside that version's model.onnx in ``cache_dir`` (where GET /card
        looks); a TrackingError when the run has none (evaluated before cards existed)."""
        mv, tracking_uri = _version(ref)
        dest = card_beside(Path(cache_dir) / mv.name / str(mv.version) / "model.onnx", kind)
        artifact = f"{CARD_ARTIFACT_DIR}/{CARD_FILES[kind]}"
        dest.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
            try:  # quietly: MLflow's progress bar for a few KB would be most of the output
                with contextlib.redirect_stderr(io.StringIO()):
                    got = mlflow.artifacts.download_artifacts(
                        artifact_uri=f"runs:/{mv.run_id}/{artifact}",
                        dst_path=tmp,
                        tracking_uri=tracking_uri,
                    )
            except (MlflowException, OSError) as err:
                raise TrackingError(
                    f"{ref.field}: {ref} (v{mv.version}) has no model card: its run "
                    f"{mv.run_id} has no {artifact} (evaluated before evaluate wrote cards? "
                    f"rerun `dvc repro evaluate` for that model): {err}"
                ) from None
            os.replace(got, dest)
        return dest

    def follow(self, ref: ModelRef, current: str, cache_dir: Path) -> FetchedModel | None:
        """None while ``ref``'s alias still points at version ``current`` (one registry
        read), else the version it points at now, fetched and checked, with its provenance
        naming the alias and the reason recorded for the move (``reason``). A reference
        naming a version never moves."""
        if ref.alias is None:
            return None
        client = mlflow.MlflowClient(tracking_uri=resolve_tracking_uri())
        mv = current_alias(client, ref.name, ref.alias)
        if mv is None:
            raise TrackingError(f"{ref.field}: {ref}: the alias no longer exists in the registry")
        if str(mv.version) == str(current):
            return None
        path, provenance = fetch_registered(ref, cache_dir, mv)
        # A move by hand says its own reason (maybe none); evaluate's decision, the one it made.
        reason = mv.tags.get(PROMOTE_REASON_TAG, mv.tags.get("decision_reason", ""))
        return FetchedModel(path, provenance | {"reason": reason})


def _version(ref: ModelRef) -> tuple[Any, str]:
    """(the ModelVersion, tracking URI) a ``models:/`` or ``runs:/`` reference names."""
    if ref.run_id:
        return version_of_run(ref), resolve_tracking_uri()
    return version_of(ref)


def version_of_run(ref: ModelRef) -> Any:
    """The newest model version that ``runs:/RUN_ID`` registered."""
    tracking_uri = resolve_tracking_uri()
    check_tracking_uri(tracking_uri)
    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    try:
        # The run id goes into the filter: MLflow's own ids are hex, anything else finds none.
        versions = client.search_model_versions(f"run_id = '{ref.run_id}'")
    except MlflowException as err:
        raise TrackingError(f"{ref.field}: {ref}: {err.message}") from None
    if not versions:
        raise TrackingError(
            f"{ref.field}: {ref}: no registered model version comes from run "
            f"{ref.run_id!r} in {tracking_uri} (evaluate registers the run's model: "
            "registry.enabled)"
        )
    return max(versions, key=lambda v: int(v.version))


def fetch_registered(ref: ModelRef, cache_dir: Path, mv: Any | None = None) -> FetchedModel:
    """Download the ONNX file of the version ``ref`` names (``mv``, when already read) into
    ``cache_dir`` and verify its sha256 against the version's ``onnx_sha256`` tag."""
    if mv is None:
        mv, tracking_uri = version_of(ref)
    else:
        tracking_uri = resolve_tracking_uri()
    expected = mv.tags.get(SHA_TAG)
    if not expected:
        raise TrackingError(
            f"{ref.field}: {ref} (v{mv.version}) has no {SHA_TAG} tag; refusing to serve a "
            "model whose bytes cannot be checked"
        )
    dest = Path(cache_dir) / mv.name / str(mv.version) / "model.onnx"
    uri, what = f"models:/{mv.name}/{mv.version}", f"{ref.field}: {ref} (v{mv.version})"
    download_verified(uri, dest, expected, tracking_uri, what, member="model.onnx")
    # The same sidecar the export stage writes: one verification path for every model file.
    atomic_write_text(dest.with_name(dest.name + ".sha256"), f"{expected}  {dest.name}\n")
    return FetchedModel(
        dest,
        {
            "model_source": ref.uri,
            "registry_model": mv.name,
            "registry_version": str(mv.version),
            "registry_alias": ref.alias or "",
            "run_id": mv.run_id or "",
            "data_version": mv.tags.get(DATA_TAG, ""),
            "onnx_sha256": expected,
        },
    )
