"""What the service serves and how: params, environment, the model file and its provenance.

The model source is $TRAINYARD_MODEL or serve.model, a model reference
(trainyard.core.model_ref): a local path (relative to the params file's folder) or a
registry URI, ``models:/NAME@ALIAS`` / ``models:/NAME/N`` / ``runs:/RUN_ID``. A registry
URI needs MLflow, which this layer never imports: the caller passes a ``ModelRegistry``
(bento/service.py does, in the development environment only; a bento has no MLflow and
serves the model file it was built with).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import onnxruntime as ort

from trainyard.core.config import DriftParams, ServeParams, load_params
from trainyard.core.errors import ModelError
from trainyard.core.model_ref import (
    FetchedModel,
    ModelRef,
    ModelRegistry,
    parse_model_ref,
    registered_version,
)
from trainyard.runtime.model_file import ORT_LOAD_ERRORS, int8_beside, open_verified, verify_model
from trainyard.runtime.sessions import OnnxModel

__all__ = ["ORT_LOAD_ERRORS", "verify_model"]  # also read from here by the service

PARAMS_ENV, MODEL_ENV, API_KEY_ENV = "TRAINYARD_PARAMS", "TRAINYARD_MODEL", "TRAINYARD_API_KEY"
SHADOW_ENV = "TRAINYARD_SHADOW"
CACHE_ENV = "TRAINYARD_MODEL_CACHE"


@dataclass(frozen=True)
class Settings:
    """The service's settings as read from params.yaml and the environment."""

    params: ServeParams
    params_file: Path
    model_source: str  # a path as written, or a models:/ or runs:/ URI
    api_key: str | None
    cache_dir: Path  # where registry models are downloaded
    drift: DriftParams = field(default_factory=DriftParams)  # the windowed drift score
    model_field: str = "serve.model"  # where model_source was written, for messages

    @property
    def model_ref(self) -> ModelRef:
        """The model source read as a model reference (a ModelError naming its field)."""
        return parse_model_ref(self.model_source, self.model_field, self.params_file.parent)

    @property
    def from_registry(self) -> bool:
        """Whether the model source is a registry URI rather than a file."""
        return self.model_ref.from_registry


def read_settings(environ: Mapping[str, str] | None = None) -> Settings:
    """Settings from $TRAINYARD_PARAMS (default ./params.yaml) and the other $TRAINYARD_*.

    $TRAINYARD_MODEL_CACHE defaults to ``.cache/registry`` beside the params file.
    """
    env = os.environ if environ is None else environ
    params_file = Path(env.get(PARAMS_ENV) or "params.yaml").resolve()
    loaded = load_params(params_file)
    params = loaded.serve
    return Settings(
        drift=loaded.drift,
        params=params,
        params_file=params_file,
        model_source=env.get(MODEL_ENV) or params.model,
        model_field=f"${MODEL_ENV}" if env.get(MODEL_ENV) else "serve.model",
        api_key=env.get(API_KEY_ENV) or None,
        cache_dir=Path(env.get(CACHE_ENV) or params_file.parent / ".cache" / "registry"),
    )


def resolve_model(settings: Settings, registry: ModelRegistry | None = None) -> FetchedModel:
    """(model path, provenance): a local path as is, a registry URI resolved now, downloaded
    to the cache folder and checked against the version's recorded sha256 by ``registry``.
    Only the .onnx file is used."""
    ref = settings.model_ref
    if ref.path is not None:
        return FetchedModel(ref.path, {"model_source": str(ref.path)})
    if registry is None:
        raise registry_unavailable(ref.uri, "trainyard.track cannot be imported here")
    return registry.fetch(ref, settings.cache_dir)


def at_precision(
    settings: Settings,
    model: Path,
    provenance: dict[str, str],
    registry: ModelRegistry | None = None,
) -> Path:
    """The file to serve at serve.precision: ``model`` itself (fp32), or its int8 model,
    beside it (models/model.int8.onnx) or the registry version's; a ModelError naming
    serve.precision and export.quantize when there is none."""
    if settings.params.precision == "fp32":
        return model
    name, number = provenance.get("registry_model"), provenance.get("registry_version")
    if name and number:
        where = registered_version(name, number, settings.model_field)
        found = None if registry is None else registry.fetch_int8(where, settings.cache_dir)
        missing = f"{where} was registered without an int8 model"
    else:
        found, missing = int8_beside(model), f"there is no {int8_beside(model)}"
    if found is None or not found.is_file():
        raise ModelError(
            f"serve.precision is int8, but {missing}: set export.quantize: int8 and rerun "
            "the export (`dvc repro export`, then evaluate registers it with the model), "
            "or set serve.precision: fp32"
        )
    return found


def shadow_source(settings: Settings, environ: Mapping[str, str] | None = None) -> str | None:
    """$TRAINYARD_SHADOW or serve.shadow as a model source: a models:/ URI or a path as
    written; a bare alias (``challenger``) names an alias of serve.model's registry model."""
    env = os.environ if environ is None else environ
    shadow = env.get(SHADOW_ENV) or settings.params.shadow
    if shadow is None or ":" in shadow or shadow.endswith(".onnx") or "/" in shadow:
        return shadow
    if not settings.model_ref.name:
        raise ModelError(
            f"serve.shadow: {shadow!r} is an alias, which needs serve.model to be a registry "
            f"model (models:/NAME@champion), not {settings.model_source}; or set serve.shadow "
            f"to models:/NAME@{shadow}, models:/NAME/N or an .onnx file"
        )
    return settings.model_ref.with_alias(shadow).uri


def resolve_shadow(
    settings: Settings, registry: ModelRegistry | None = None
) -> FetchedModel | None:
    """(path, provenance) of the shadow model, resolved like the served one; None: none."""
    source = shadow_source(settings)
    if source is None:
        return None
    where = f"${SHADOW_ENV}" if os.environ.get(SHADOW_ENV) else "serve.shadow"
    return resolve_model(replace(settings, model_source=source, model_field=where), registry)


def log_folder(settings: Settings) -> Path | None:
    """Where the prediction log goes (serve.log_dir, relative to the params file); None
    when serve.log_predictions is off."""
    if not settings.params.log_predictions:
        return None
    folder = Path(settings.params.log_dir).expanduser()
    return folder if folder.is_absolute() else settings.params_file.parent / folder


def registry_unavailable(source: str, why: object) -> ModelError:
    """The error for a models:/ URI where MLflow (trainyard.track) cannot be imported."""
    return ModelError(
        f"model source {source}: a registry model needs MLflow, which this environment "
        f"does not have ({why}). A bento serves the model file it was built with: build it "
        "from a local model file (serve.model: models/model.onnx, `make bento`), or serve "
        f"the registry model with `make serve` in the development environment"
    )


def model_provenance(path: Path, provenance: dict[str, str]) -> dict[str, str]:
    """Where the served model came from: registry version (if any), run, data version."""
    # ONNX Runtime reads the metadata itself: the deployed bento needs no `onnx` package.
    options = ort.SessionOptions()
    options.log_severity_level = 3
    try:
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except ORT_LOAD_ERRORS as err:
        raise ModelError(f"{path}: ONNX Runtime cannot load it: {err}") from None
    meta = dict(session.get_modelmeta().custom_metadata_map)
    del session
    return {
        "model_source": provenance.get("model_source", str(path)),
        "registry_model": provenance.get("registry_model", ""),
        "registry_version": provenance.get("registry_version", ""),
        "registry_alias": provenance.get("registry_alias", ""),
        "mlflow_run_id": provenance.get("run_id") or meta.get("mlflow_run_id", ""),
        "data_version": provenance.get("data_version") or meta.get("data_sha256", ""),
    }


def registry_label(provenance: Mapping[str, str]) -> str:
    """``NAME/N`` of a registry model's provenance, ``local`` for a model file: how the
    headers, the prediction log and the shadow's figures name a model's version."""
    name, number = provenance.get("registry_model"), provenance.get("registry_version")
    return f"{name}/{number}" if name and number else "local"


def trace_headers(sha256: str, provenance: dict[str, str]) -> list[tuple[bytes, bytes]]:
    """The headers every response carries, so any prediction traces back to its registry
    version, MLflow run and data version."""
    registry = registry_label(provenance)
    return [
        (b"x-model-version", sha256[:12].encode()),
        (b"x-model-registry-version", registry.encode()),
        (b"x-mlflow-run-id", provenance["mlflow_run_id"].encode()),
        (b"x-data-version", provenance["data_version"].encode()),
    ]


def load_model(path: Path, params: ServeParams) -> tuple[OnnxModel, str]:
    """Verify, then open on the provider params ask for (a 'cuda' that cannot be had is a
    ProviderError, never a quiet CPU run)."""
    return open_verified(path, params.device, params.model_threads())


def service_config(params: ServeParams, quiet_paths: list[str]) -> dict[str, Any]:
    """``@bentoml.service``'s arguments from serve params: processes, traffic limits, the
    access log (not for ``quiet_paths``: probes, metrics) and tracing."""
    config: dict[str, Any] = {
        "name": "trainyard_classifier",
        "workers": params.workers,
        "traffic": {"timeout": params.timeout_s, "max_concurrency": params.max_concurrency},
        "logging": {"access": {"enabled": params.access_log, "skip_paths": quiet_paths}},
    }
    if not params.tracing:
        # BentoML's OpenTelemetry middleware builds four spans a request even at sample
        # rate 0 (about 30% of the event loop's CPU per request); an excluded URL skips it.
        config["tracing"] = {"excluded_urls": [".*"]}
    return config
