"""A model reference, as MLflow writes one, and what a registry must do with it.

Every place that takes a model (serve.model and serve.shadow, $TRAINYARD_MODEL,
predict.model and ``--model``, ``trainyard drift --reference``) reads it with
``parse_model_ref`` into a ``ModelRef``, one of:

- ``models:/NAME@ALIAS``: the version an alias of a registered model points at (a service
  serving it follows the alias);
- ``models:/NAME/VERSION``: one version, which never moves;
- ``runs:/RUN_ID`` or ``runs:/RUN_ID/PATH``: the version that run registered (its newest);
- a path to an exported ``.onnx`` file, relative to a folder the caller names (the params
  file's, or the working directory for a command-line option).

The URIs follow MLflow's own rules (mlflow.store.artifact.utils.models._parse_model_uri and
RunsArtifactRepository.parse_runs_uri): the name is everything before the last ``@``, a
version is all digits, a run's id is the first segment. MLflow's other forms (``latest``, a
stage, a logged model's id) are refused: trainyard serves only a registered version whose
sha256 the registry recorded, named by the alias its decision moved or by its number.

Resolving a registry reference needs MLflow, which this layer never imports: the entry
points hand a ``ModelRegistry`` (trainyard.track.model_refs.MlflowRegistry) to the code that
needs one, or None where MLflow is absent (a bento, ``python -m trainyard.bulk``).
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Protocol

from trainyard.core.errors import ModelError

MODELS_SCHEME, RUNS_SCHEME = "models", "runs"
ACCEPTED = (
    "models:/NAME@ALIAS (e.g. models:/fashion-mnist-classifier@champion), "
    "models:/NAME/VERSION, runs:/RUN_ID[/PATH], or a path to an exported .onnx file"
)


@dataclass(frozen=True)
class ModelRef:
    """One model reference: a registered version (``name`` with ``alias`` or ``version``),
    a run's (``run_id``, ``artifact_path``) or a local ``path``; ``uri`` as written (a
    path: resolved) and ``field``, the param or option it came from, for messages."""

    uri: str
    field: str
    name: str = ""
    alias: str | None = None
    version: str | None = None
    run_id: str = ""
    artifact_path: str = ""
    path: Path | None = None

    @property
    def from_registry(self) -> bool:
        """Whether resolving it needs the registry (a ``models:/`` or ``runs:/`` URI)."""
        return self.path is None

    @property
    def follows(self) -> bool:
        """Whether it names an alias, which may move to another version."""
        return self.alias is not None

    def with_alias(self, alias: str) -> ModelRef:
        """``models:/NAME@ALIAS`` of this reference's registered model."""
        return registered_alias(self.name, alias, self.field)

    def __str__(self) -> str:
        return self.uri


def registered_version(name: str, version: str | int, field: str) -> ModelRef:
    """``models:/NAME/VERSION``: a version a provenance or a registry answer named."""
    return ModelRef(f"models:/{name}/{version}", field, name, None, str(version))


def registered_alias(name: str, alias: str, field: str) -> ModelRef:
    """``models:/NAME@ALIAS``: the version an alias of ``name`` points at."""
    return ModelRef(f"models:/{name}@{alias}", field, name, alias)


def parse_model_ref(text: str, field: str, base: Path | None = None) -> ModelRef:
    """``text`` (from ``field``: serve.model, --model, ...) as a ModelRef; a relative path
    is taken relative to ``base`` (default: the working directory). A ModelError naming
    ``field`` and the accepted forms when it is none of them."""
    text = text.strip()
    if not text:
        raise _refused(text, field, "it is empty")
    parsed = urllib.parse.urlparse(text, allow_fragments=False)
    if parsed.scheme in (MODELS_SCHEME, RUNS_SCHEME) and parsed.netloc:
        raise _refused(text, field, f"one slash after {parsed.scheme}:, not two")
    if parsed.scheme == MODELS_SCHEME:
        return _registered(text, field, parsed.path)
    if parsed.scheme == RUNS_SCHEME:
        return _run(text, field, parsed.path)
    if parsed.scheme == "file" and not parsed.netloc:
        text = urllib.parse.unquote(parsed.path)
    elif len(parsed.scheme) > 1 and text[len(parsed.scheme) + 1 :].startswith("/"):
        # One letter is a Windows drive (C:/...); any other scheme is a store we do not read.
        raise _refused(text, field, f"trainyard does not read {parsed.scheme}: URIs")
    path = Path(text).expanduser()
    if not path.is_absolute():
        path = (base if base is not None else Path.cwd()) / path
    return ModelRef(str(path), field, path=path)


def _registered(text: str, field: str, path: str) -> ModelRef:
    """``models:/NAME@ALIAS`` or ``models:/NAME/VERSION``, by MLflow's rules."""
    if not path.startswith("/") or len(path) <= 1:
        raise _refused(text, field, "a models:/ URI names a registered model after models:/")
    parts = path.lstrip("/").split("/")
    if len(parts) == 2 and parts[0].strip():
        name, suffix = parts
        if suffix.isdigit():
            return ModelRef(text, field, name, None, suffix)
        why = f"{suffix!r} is not a version number"
        if suffix.strip():  # MLflow would read it as 'latest' or a stage
            why += " (MLflow's 'latest' and stages are not served: name an alias or a version)"
        raise _refused(text, field, why)
    if len(parts) == 1 and "@" in parts[0]:
        name, alias = parts[0].rsplit("@", 1)
        if name.strip() and alias.strip():
            return ModelRef(text, field, name, alias)
        raise _refused(text, field, "both the model's name and the alias are needed")
    if len(parts) == 1 and parts[0].strip():
        why = "it names no alias or version (a logged model's id is not served)"
        raise _refused(text, field, why)
    raise _refused(text, field, "expected one name, then @ALIAS or /VERSION")


def _run(text: str, field: str, path: str) -> ModelRef:
    """``runs:/RUN_ID[/PATH]``, by MLflow's rules (the path inside the run is optional)."""
    run_id, _, artifact_path = path.removeprefix("/").partition("/")
    if not path.startswith("/") or not run_id.strip():
        raise _refused(text, field, "a runs:/ URI names a run's id after runs:/")
    return ModelRef(text, field, run_id=run_id, artifact_path=artifact_path)


def _refused(text: str, field: str, why: str) -> ModelError:
    return ModelError(f"{field}: {text!r} is not a model reference ({why}); expected {ACCEPTED}")


class FetchedModel(NamedTuple):
    """A registry model on disk: the ONNX file, checked against the sha256 the registry
    recorded, and its provenance (model_source, registry_model, registry_version,
    registry_alias, run_id, data_version, onnx_sha256; a followed move adds its reason)."""

    path: Path
    provenance: dict[str, str]


class ModelRegistry(Protocol):
    """What the service, bulk scoring and ``trainyard drift`` need from a model registry.
    Each download lands in ``cache_dir`` and is checked against the sha256 the registry
    recorded; a failure is a TrainyardError naming the reference's field."""

    def fetch(self, ref: ModelRef, cache_dir: Path) -> FetchedModel:
        """The ONNX file of the version a ``models:/`` or ``runs:/`` reference names."""
        ...

    def fetch_int8(self, ref: ModelRef, cache_dir: Path) -> Path | None:
        """The int8 file registered with that version; None when it has none."""
        ...

    def fetch_reference(self, ref: ModelRef, cache_dir: Path) -> Path:
        """That version's drift reference (evaluate's model.reference.npz)."""
        ...

    def fetch_card(self, ref: ModelRef, cache_dir: Path, kind: str) -> Path:
        """That version's model card (evaluate's; ``kind``: md or json), beside its model."""
        ...

    def follow(self, ref: ModelRef, current: str, cache_dir: Path) -> FetchedModel | None:
        """For an alias: None while it still points at version ``current``, else the
        version it points at now, fetched; its provenance says the move's reason."""
        ...
