"""One model reference (trainyard.core.model_ref): every form the parser takes, read as
MLflow reads it, every form it refuses naming the field; and MLflow's registry behind it
(trainyard.track.model_refs.MlflowRegistry) on a real sqlite store."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from trainyard.core.errors import ModelError, TrackingError, TrainyardError
from trainyard.core.io import sha256_file
from trainyard.core.model_ref import ACCEPTED, FetchedModel, ModelRef, parse_model_ref

from conftest import fashion_card, write_tiny_onnx

# ---------------------------------------------------------------------------- the parser


@pytest.mark.parametrize(
    ("text", "name", "alias", "version"),
    [
        ("models:/clf@champion", "clf", "champion", None),
        ("models:/fashion-mnist-classifier/12", "fashion-mnist-classifier", None, "12"),
        ("models:/team@clf@challenger", "team@clf", "challenger", None),  # the last @
        ("models:/My Photos classifier@champion", "My Photos classifier", "champion", None),
    ],
)
def test_a_registered_version_is_read_as_mlflow_reads_it(text, name, alias, version):
    from mlflow.store.artifact.utils.models import _parse_model_uri

    ref = parse_model_ref(text, "serve.model")
    assert (ref.name, ref.alias, ref.version, ref.uri) == (name, alias, version, text)
    assert ref.from_registry and ref.path is None and ref.follows == (alias is not None)
    mlflow_reads = _parse_model_uri(text)
    assert (mlflow_reads.name, mlflow_reads.alias, mlflow_reads.version) == (name, alias, version)


@pytest.mark.parametrize(
    ("text", "run_id", "artifact_path"),
    [
        ("runs:/0123abcd", "0123abcd", ""),
        ("runs:/0123abcd/model", "0123abcd", "model"),
        ("runs:/0123abcd/int8/model.int8.onnx", "0123abcd", "int8/model.int8.onnx"),
    ],
)
def test_a_run_is_read_as_mlflow_reads_it(text, run_id, artifact_path):
    from mlflow.store.artifact.runs_artifact_repo import RunsArtifactRepository

    ref = parse_model_ref(text, "--model")
    assert (ref.run_id, ref.artifact_path, ref.name) == (run_id, artifact_path, "")
    assert ref.from_registry and not ref.follows and str(ref) == text
    assert RunsArtifactRepository.parse_runs_uri(text) == (run_id, artifact_path or None)


def test_a_path_is_relative_to_the_folder_given_else_the_working_directory(tmp_path):
    ref = parse_model_ref("models/model.onnx", "serve.model", tmp_path)
    assert ref.path == tmp_path / "models" / "model.onnx" and not ref.from_registry
    assert ref.uri == str(ref.path) and not ref.follows
    assert parse_model_ref("m.onnx", "--model").path == Path.cwd() / "m.onnx"
    assert parse_model_ref("/abs/m.onnx", "serve.model", tmp_path).path == Path("/abs/m.onnx")
    assert parse_model_ref("~/m.onnx", "--model").path == Path.home() / "m.onnx"
    assert parse_model_ref("file:///abs/my%20m.onnx", "--model").path == Path("/abs/my m.onnx")
    # A colon elsewhere is a file name's, and one letter before it a Windows drive.
    assert parse_model_ref("v1:best.onnx", "--model", tmp_path).path == tmp_path / "v1:best.onnx"


def test_a_reference_names_its_versions_and_aliases():
    ref = parse_model_ref("models:/clf@champion", "serve.model")
    assert ref.with_alias("challenger").uri == "models:/clf@challenger"
    want = ModelRef("models:/clf/4", "serve.model", "clf", None, "4")
    assert parse_model_ref("models:/clf/4", "serve.model") == want


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "it is empty"),
        ("models:/", "names a registered model after models:/"),
        ("models:clf@champion", "names a registered model after models:/"),
        ("models://clf@champion", "one slash after models:"),
        ("models:/clf", "names no alias or version"),
        ("models:/clf/latest", "'latest' is not a version number"),
        ("models:/clf/Production", "stages are not served"),
        ("models:/clf/", "'' is not a version number"),
        ("models:/clf/3/model", "expected one name, then @ALIAS or /VERSION"),
        ("models:/@champion", "both the model's name and the alias"),
        ("models:/clf@", "both the model's name and the alias"),
        ("models:/ /3", "expected one name"),
        ("runs:/", "names a run's id after runs:/"),
        ("runs:abc", "names a run's id after runs:/"),
        ("runs://abc/model", "one slash after runs:"),
        ("s3://bucket/model.onnx", "does not read s3: URIs"),
        ("https://example.com/model.onnx", "does not read https: URIs"),
    ],
)
@pytest.mark.parametrize("field", ["serve.model", "--model", "$TRAINYARD_MODEL"])
def test_a_bad_reference_names_its_field_and_the_forms_accepted(text, why, field):
    with pytest.raises(ModelError) as caught:
        parse_model_ref(text, field)
    message = str(caught.value)
    assert message.startswith(f"{field}: {text.strip()!r} is not a model reference")
    assert why in message and message.endswith(ACCEPTED)


def test_what_mlflow_itself_refuses_is_refused_too():
    """MLflow's rules are the floor: every URI it cannot parse, the parser refuses."""
    from mlflow.exceptions import MlflowException
    from mlflow.store.artifact.utils.models import _parse_model_uri

    for text in ("models:/", "models:clf", "models:/clf/3/x", "models:/clf@", "models:/ /3"):
        with pytest.raises(MlflowException):
            _parse_model_uri(text)
        with pytest.raises(ModelError):
            parse_model_ref(text, "serve.model")


# ---------------------------------------------------------------------------- MLflow's registry


@pytest.fixture(scope="module")
def registered(mlflow_db, tmp_path_factory):
    """Two versions of "refs" registered as evaluate registers them (v1 champion with its
    drift reference, v2 challenger without one), and a version registered by hand without
    the sha256 tag: (tracking URI, {version: sha256}, run ids)."""
    import mlflow

    from trainyard.track.registry import log_onnx_model, register_and_promote, tag_reference
    from trainyard.track.versions import REFERENCE_ARTIFACT

    uri, experiment = mlflow_db
    tmp = tmp_path_factory.mktemp("refs")
    client = mlflow.MlflowClient(uri)
    shas, runs = {}, []
    for version, acc in ((1, 0.9), (2, 0.8)):
        path, _ = write_tiny_onnx(tmp / f"m{version}", fashion_card(), seed=version)
        with mlflow.start_run(experiment_id=experiment) as run:
            model_uri = log_onnx_model(path, np.zeros((1, 1, 28, 28), np.float32))
            if version == 1:
                reference = tmp / "model.reference.npz"
                np.savez(reference, x=np.zeros(3))
                mlflow.log_artifact(str(reference), str(Path(REFERENCE_ARTIFACT).parent))
        sha = sha256_file(path)
        args = (client, "refs", model_uri, run.info.run_id, acc, f"data-{version}", sha, 0.0)
        register_and_promote(*args)
        shas[version] = sha
        runs.append(run.info.run_id)
    tag_reference(client, "refs", 1, sha256_file(tmp / "model.reference.npz"))
    client.create_model_version("refs", model_uri, runs[1])  # v3: by hand, no sha256 tag
    client.set_registered_model_alias("refs", "unchecked", "3")
    return uri, shas, runs


@pytest.fixture
def registry(registered, monkeypatch):
    from trainyard.track.model_refs import MlflowRegistry

    monkeypatch.setenv("MLFLOW_TRACKING_URI", registered[0])
    return MlflowRegistry()


def ref(text: str, field: str = "serve.model") -> ModelRef:
    return parse_model_ref(text, field)


def test_a_version_is_fetched_by_alias_number_or_run_and_checked(registered, registry, tmp_path):
    _, shas, runs = registered
    path, provenance = registry.fetch(ref("models:/refs@champion"), tmp_path)
    assert path == tmp_path / "refs" / "1" / "model.onnx" and sha256_file(path) == shas[1]
    assert path.with_name("model.onnx.sha256").read_text().split()[0] == shas[1]
    assert provenance == {
        "model_source": "models:/refs@champion",
        "registry_model": "refs",
        "registry_version": "1",
        "registry_alias": "champion",
        "run_id": runs[0],
        "data_version": "data-1",
        "onnx_sha256": shas[1],
    }
    path, provenance = registry.fetch(ref("models:/refs/2"), tmp_path)
    assert sha256_file(path) == shas[2] and provenance["registry_alias"] == ""
    # A run: the newest version it registered (v2 here; v3 by hand has no sha256 tag).
    path, provenance = registry.fetch(ref(f"runs:/{runs[0]}/model", "--model"), tmp_path)
    assert sha256_file(path) == shas[1]
    assert (provenance["model_source"], provenance["registry_version"]) == (
        f"runs:/{runs[0]}/model",
        "1",
    )


def test_what_the_registry_cannot_answer_is_an_error_naming_the_field(registry, tmp_path):
    with pytest.raises(TrackingError, match=r"^serve\.model: models:/refs@nope: not found"):
        registry.fetch(ref("models:/refs@nope"), tmp_path)
    with pytest.raises(TrackingError, match=r"^--model: models:/nothing/1: not found"):
        registry.fetch(ref("models:/nothing/1", "--model"), tmp_path)
    with pytest.raises(TrackingError, match="no registered model version comes from run"):
        registry.fetch(ref("runs:/0000ffff", "--model"), tmp_path)
    with pytest.raises(TrackingError, match="has no onnx_sha256 tag; refusing"):
        registry.fetch(ref("models:/refs@unchecked"), tmp_path)
    assert not (tmp_path / "refs" / "3").exists()


def test_a_doctored_download_is_refused(registered, registry, tmp_path):
    """The cached copy does not match: downloaded again; the registry's copy is not the
    one its tag records: refused, and nothing is left in the cache."""
    import mlflow

    path, _ = registry.fetch(ref("models:/refs/1"), tmp_path)
    path.write_bytes(b"altered")
    assert sha256_file(registry.fetch(ref("models:/refs/1"), tmp_path).path) == registered[1][1]
    client = mlflow.MlflowClient(registered[0])
    v1 = client.get_model_version("refs", "1")
    other = client.create_model_version("refs", v1.source, None, {"onnx_sha256": "0" * 64})
    with pytest.raises(TrackingError, match=r"downloaded model\.onnx has sha256 .*refusing it"):
        registry.fetch(ref(f"models:/refs/{other.version}"), tmp_path)
    assert list((tmp_path / "refs" / str(other.version)).iterdir()) == []


def test_the_int8_file_and_the_drift_reference_of_a_version(registered, registry, tmp_path):
    assert registry.fetch_int8(ref("models:/refs@champion"), tmp_path) is None  # none made
    got = registry.fetch_reference(ref("models:/refs@champion", "--reference"), tmp_path)
    assert got == tmp_path / "refs" / "1" / "model.reference.npz" and got.is_file()
    with pytest.raises(TrackingError, match=r"^--reference: models:/refs/2 \(v2\) has no ref"):
        registry.fetch_reference(ref("models:/refs/2", "--reference"), tmp_path)
    # The same check as the model file's: a reference its tag does not match is refused.
    import mlflow

    client = mlflow.MlflowClient(registered[0])
    good = client.get_model_version("refs", "1").tags["reference_sha256"]
    client.set_model_version_tag("refs", "1", "reference_sha256", "0" * 64)
    try:
        with pytest.raises(TrackingError, match=r"downloaded model\.reference\.npz has sha256"):
            registry.fetch_reference(ref("models:/refs/1", "--reference"), tmp_path / "again")
    finally:
        client.set_model_version_tag("refs", "1", "reference_sha256", good)
    assert not (tmp_path / "again" / "refs" / "1" / "model.reference.npz").exists()


def test_following_an_alias_fetches_the_version_it_moved_to(registered, registry, tmp_path):
    import mlflow

    uri, shas, _ = registered
    client = mlflow.MlflowClient(uri)
    followed = ref("models:/refs@moving")
    client.set_registered_model_alias("refs", "moving", "1")
    assert registry.follow(followed, "1", tmp_path) is None  # not moved: nothing fetched
    assert not tmp_path.joinpath("refs").exists()
    assert registry.follow(ref("models:/refs/1"), "7", tmp_path) is None  # a version: never
    client.set_model_version_tag("refs", "2", "promote.reason", "better on night photos")
    client.set_registered_model_alias("refs", "moving", "2")
    path, provenance = registry.follow(followed, "1", tmp_path)
    assert sha256_file(path) == shas[2]
    assert (provenance["registry_version"], provenance["registry_alias"]) == ("2", "moving")
    assert provenance["reason"] == "better on night photos"
    assert provenance["model_source"] == "models:/refs@moving"
    client.delete_registered_model_alias("refs", "moving")
    with pytest.raises(TrainyardError, match="the alias no longer exists"):
        registry.follow(followed, "2", tmp_path)


# ---------------------------------------------------------------------------- the entry points


class Recording:
    """A ModelRegistry that records what it was asked for and answers ``answer``."""

    def __init__(self, answer: Path) -> None:
        self.answer, self.asked = answer, []

    def fetch(self, ref: ModelRef, cache_dir: Path) -> FetchedModel:
        self.asked.append(("fetch", ref, cache_dir))
        return FetchedModel(self.answer, {"model_source": ref.uri, "registry_version": "1"})

    def fetch_reference(self, ref: ModelRef, cache_dir: Path) -> Path:
        self.asked.append(("fetch_reference", ref, cache_dir))
        return self.answer


def test_bulk_scoring_reads_its_model_as_a_reference(tmp_path):
    from trainyard.bulk.predict_job import resolve_model

    params = tmp_path / "params.yaml"
    local = resolve_model("models/m.onnx", "predict.model", params, None)
    assert local == (tmp_path / "models" / "m.onnx", {"model_source": str(local.path)})
    assert resolve_model("m.onnx", "--model", params, None, Path("/w")).path == Path("/w/m.onnx")
    with pytest.raises(ModelError, match=r"^--model: models:/clf@champion: a registry model"):
        resolve_model("models:/clf@champion", "--model", params, None)
    with pytest.raises(ModelError, match=r"^predict\.model: 'models:/clf' is not a model ref"):
        resolve_model("models:/clf", "predict.model", params, None)
    registry = Recording(tmp_path / "got.onnx")
    got = resolve_model("runs:/abc/model", "--model", params, registry)  # type: ignore[arg-type]
    assert got.path == tmp_path / "got.onnx"
    assert registry.asked == [
        ("fetch", parse_model_ref("runs:/abc/model", "--model"), tmp_path / ".cache" / "registry")
    ]


def test_drift_reads_its_reference_as_a_model_reference(tmp_path):
    from trainyard.commands.drift_check import reference_of

    params = tmp_path / "params.yaml"
    with pytest.raises(ModelError, match=r"^--reference: 'models:/clf' is not a model ref"):
        reference_of("models:/clf", params, None)
    with pytest.raises(TrainyardError, match=r"^--reference models:/clf/2: a registry model"):
        reference_of("models:/clf/2", params, None)
    registry = Recording(tmp_path / "missing.npz")
    with pytest.raises(TrainyardError, match=r"missing\.npz"):  # what the registry handed back
        reference_of("models:/clf@champion", params, registry)  # type: ignore[arg-type]
    assert registry.asked == [
        (
            "fetch_reference",
            parse_model_ref("models:/clf@champion", "--reference"),
            tmp_path / ".cache" / "registry",
        )
    ]


def test_mlflow_registry_is_the_protocol_method_for_method():
    """No type checker runs in the suite: the implementation's methods are compared with
    the protocol's, name, parameters and annotations."""
    import inspect

    from trainyard.core.model_ref import ModelRegistry
    from trainyard.track.model_refs import MlflowRegistry

    wanted = {n for n, f in vars(ModelRegistry).items() if inspect.isfunction(f) and n[0] != "_"}
    assert wanted == {"fetch", "fetch_int8", "fetch_reference", "fetch_card", "follow"}
    for name in wanted:
        protocol = inspect.signature(getattr(ModelRegistry, name))
        assert inspect.signature(getattr(MlflowRegistry, name)) == protocol, name
