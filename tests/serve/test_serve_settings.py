"""The service's settings in process: params and environment, the model source (local file or
registry URI), the model's recorded sha256, its provenance and trace headers; and
bento/service.py imported in a subprocess, with and without MLflow."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_serve_unit import DATA_SHA, RUN_ID, write_tiny_model

from trainyard.core.config import ServeParams
from trainyard.core.errors import ModelError
from trainyard.core.io import sha256_file
from trainyard.core.model_ref import FetchedModel, ModelRef
from trainyard.serve.settings import (
    load_model,
    model_provenance,
    read_settings,
    resolve_model,
    trace_headers,
    verify_model,
)

from conftest import REPO

REGISTRY_HINT = "build it from a local model file"


def params_file(folder: Path, **serve) -> Path:
    """The repository's params.yaml, some `serve` keys changed, in ``folder``."""
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["serve"].update(serve)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_a_relative_model_path_is_relative_to_the_params_file(tmp_path):
    params = params_file(tmp_path / "conf", model="models/m.onnx", top_k=3)
    settings = read_settings({"TRAINYARD_PARAMS": str(params)})
    assert settings.params.top_k == 3 and settings.params_file == params
    assert settings.api_key is None and not settings.from_registry
    assert settings.cache_dir == tmp_path / "conf" / ".cache" / "registry"
    model, provenance = resolve_model(settings)
    assert model == tmp_path / "conf" / "models" / "m.onnx"
    assert provenance == {"model_source": str(model)}


def test_the_environment_overrides_params(tmp_path):
    params = params_file(tmp_path)
    env = {
        "TRAINYARD_PARAMS": str(params),
        "TRAINYARD_MODEL": "/abs/model.onnx",
        "TRAINYARD_API_KEY": "k",
        "TRAINYARD_MODEL_CACHE": str(tmp_path / "cache"),
    }
    settings = read_settings(env)
    assert (settings.model_source, settings.api_key) == ("/abs/model.onnx", "k")
    assert settings.cache_dir == tmp_path / "cache"
    assert resolve_model(settings)[0] == Path("/abs/model.onnx")


def test_a_registry_uri_goes_to_the_fetcher_given_and_only_then(tmp_path):
    params = params_file(tmp_path, model="models:/clf@champion")
    settings = read_settings({"TRAINYARD_PARAMS": str(params)})
    assert settings.from_registry
    with pytest.raises(ModelError, match=REGISTRY_HINT):
        resolve_model(settings)
    calls = []

    class Registry:
        def fetch(self, ref: ModelRef, cache: Path) -> FetchedModel:
            calls.append((str(ref), ref.field, cache))
            return FetchedModel(tmp_path / "got.onnx", {"registry_model": "clf"})

    got = resolve_model(settings, Registry())  # type: ignore[arg-type]  # fetch alone is used
    assert got == (tmp_path / "got.onnx", {"registry_model": "clf"})
    assert calls == [("models:/clf@champion", "serve.model", tmp_path / ".cache" / "registry")]
    local = read_settings({"TRAINYARD_PARAMS": str(params), "TRAINYARD_MODEL": "m.onnx"})
    resolve_model(local, Registry())  # type: ignore[arg-type]
    assert len(calls) == 1


def test_the_model_must_match_its_recorded_sha256(tmp_path):
    model, _ = write_tiny_model(tmp_path)
    assert verify_model(model) == sha256_file(model)
    with pytest.raises(ModelError, match="model not found"):
        verify_model(tmp_path / "nope.onnx")
    sums = model.with_name("model.onnx.sha256")
    sums.write_text(f"{'0' * 64}  model.onnx\n")
    with pytest.raises(ModelError, match=r"does not match .* Re-export it"):
        verify_model(model)
    sums.write_text("")
    with pytest.raises(ModelError, match="unreadable checksum file"):
        verify_model(model)
    sums.unlink()
    with pytest.raises(ModelError, match="checksum file missing"):
        verify_model(model)


def test_load_model_opens_a_verified_model_or_says_why_not(tmp_path):
    model, _ = write_tiny_model(tmp_path / "ok")
    session, sha = load_model(model, ServeParams(device="cpu"))
    assert sha == sha256_file(model) and session.provider == "CPUExecutionProvider"
    broken = tmp_path / "broken" / "model.onnx"
    broken.parent.mkdir()
    broken.write_bytes(b"not onnx")
    broken.with_name("model.onnx.sha256").write_text(sha256_file(broken) + "\n")
    with pytest.raises(ModelError, match="ONNX Runtime cannot load it"):
        load_model(broken, ServeParams(device="cpu"))
    with pytest.raises(ModelError, match="ONNX Runtime cannot load it"):
        model_provenance(broken, {})


def test_provenance_and_trace_headers_name_the_run_and_data(tmp_path):
    model, _ = write_tiny_model(tmp_path)
    local = model_provenance(model, {"model_source": str(model)})
    assert local == {
        "model_source": str(model),
        "registry_model": "",
        "registry_version": "",
        "registry_alias": "",
        "mlflow_run_id": RUN_ID,
        "data_version": DATA_SHA,
    }
    assert dict(trace_headers("a" * 64, local)) == {
        b"x-model-version": b"a" * 12,
        b"x-model-registry-version": b"local",
        b"x-mlflow-run-id": RUN_ID.encode(),
        b"x-data-version": DATA_SHA.encode(),
    }
    registered = model_provenance(
        model,
        {"registry_model": "clf", "registry_version": "3", "run_id": "r", "data_version": "v"},
    )
    assert registered["mlflow_run_id"] == "r" and registered["data_version"] == "v"
    headers = dict(trace_headers("b" * 64, registered))
    assert headers[b"x-model-registry-version"] == b"clf/3"


# ---------------------------------------------------------------------------- the service


def import_service(tmp_path: Path, model: str, blocked: str = "") -> subprocess.CompletedProcess:
    """``import bento.service`` in a fresh interpreter (``blocked``: a module made
    unimportable, as in a bento); prints the heavy modules it loaded."""
    code = (
        "import sys\n"
        f"if {blocked!r}: sys.modules[{blocked!r}] = None\n"
        "import bento.service\n"
        "heavy = ('torch', 'lightning', 'mlflow', 'dvc', 'onnx', 'trainyard.track')\n"
        "print('loaded:', *[m for m in heavy if m in sys.modules])\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINYARD_")}
    env.update(
        TRAINYARD_PARAMS=str(params_file(tmp_path)),
        TRAINYARD_MODEL=model,
        BENTOML_HOME=str(tmp_path / "bentoml-home"),
        BENTOML_DO_NOT_TRACK="true",
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_service_on_a_local_model_imports_no_training_stack(tmp_path):
    model, _ = write_tiny_model(tmp_path / "model")
    done = import_service(tmp_path, str(model))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "loaded:", done.stdout


@pytest.mark.parametrize("blocked", ["mlflow", "trainyard.track"])
def test_a_registry_uri_without_mlflow_says_to_build_from_a_local_file(tmp_path, blocked):
    done = import_service(tmp_path, "models:/clf@champion", blocked=blocked)
    assert done.returncode != 0
    assert "ModelError" in done.stderr and REGISTRY_HINT in done.stderr, done.stderr[-3000:]
    assert "model source models:/clf@champion: a registry model needs MLflow" in done.stderr


def test_the_path_is_decided_by_the_models_call_against_a_busy_thread_hop(tmp_path, monkeypatch):
    """At start-up the model's one-image call is timed on the CPU, against what a thread hop
    costs with the event loop busy (HOP_MS): this tiny model's call is far shorter, so
    /classify calls it inline (as many images per batch as fit in a hop) and auto batches;
    over MAX_CALL_MS (a limit no model meets) every call hops to a thread and auto does not
    batch; a bool in params is kept as set."""
    from trainyard.serve import batch_choice

    monkeypatch.delenv(batch_choice.CHOICE_ENV, raising=False)
    model, _ = write_tiny_model(tmp_path)
    path = batch_choice.choose_path(ServeParams(), model)
    assert path.params.batching is True and path.inline_images >= 1, path.why
    assert path.why.startswith("a call of one image takes ")
    assert "a thread hop about 35 ms with the event loop busy (a set figure)" in path.why
    assert f"a batch of 2 to {path.inline_images} images inline on the event loop" in (
        path.describe()
    )
    monkeypatch.setattr(batch_choice, "MAX_CALL_MS", 0.0)
    for asked, batched in (("auto", False), (True, True), (False, False)):
        monkeypatch.delenv(batch_choice.CHOICE_ENV, raising=False)
        path = batch_choice.choose_path(ServeParams(batching=asked), model)
        assert path.params.batching is batched and path.inline_images == 0, path.why
        assert "over 0 ms" in path.why and path.describe().endswith("on a worker thread")


def test_the_call_is_timed_as_its_quickest_so_other_work_does_not_move_the_choice(
    tmp_path, monkeypatch
):
    """Other work on the cores only adds to a timed call: the quickest of the timings is
    the call's cost, and with it the inline batch size (hop / call)."""
    from trainyard.serve import batch_choice

    monkeypatch.delenv(batch_choice.CHOICE_ENV, raising=False)
    model, _ = write_tiny_model(tmp_path)
    timings = iter([0.9, 0.5, 3.0, 0.25, 0.7])
    monkeypatch.setattr(batch_choice, "_timed", lambda call: next(timings))
    monkeypatch.setattr(batch_choice, "HOP_MS", 5.0)
    path = batch_choice.choose_path(ServeParams(), model)
    assert path.why.startswith("a call of one image takes 0.25 ms"), path.why
    assert path.inline_images == 20


def test_the_serve_process_hands_its_choice_to_its_workers(tmp_path, monkeypatch):
    """The choice is measured once, in the process that imports the service first
    (`bentoml serve`), and read from the environment by its workers for the same model
    and settings; other settings measure again."""
    from trainyard.serve import batch_choice

    monkeypatch.delenv(batch_choice.CHOICE_ENV, raising=False)
    model, _ = write_tiny_model(tmp_path)
    first = batch_choice.choose_path(ServeParams(), model, "sha")
    assert batch_choice.CHOICE_ENV in os.environ
    monkeypatch.setattr(batch_choice, "_measure", lambda *a: pytest.fail("measured twice"))
    again = batch_choice.choose_path(ServeParams(), model, "sha")
    assert again.inline_images == first.inline_images and again.params == first.params
    assert again.why == f"{first.why}; the call timed once, by the serve process"
    with pytest.raises(pytest.fail.Exception, match="measured twice"):
        batch_choice.choose_path(ServeParams(batching=False), model, "sha")
