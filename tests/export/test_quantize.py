"""export.quantize int8: a real model (a short fit on real Fashion-MNIST, the real export)
quantized by ONNX Runtime, its gate passing, and failing with both figures named."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
import yaml

from trainyard.core.card import normalize_pixels
from trainyard.core.config import Params, ParamsError, ServeParams, load_params
from trainyard.core.errors import ExportError, ModelError
from trainyard.core.host import x86_without_vnni
from trainyard.core.io import sha256_file
from trainyard.data.idx import read_idx
from trainyard.export.onnx_export import export_and_verify
from trainyard.export.quantize import calibration_sample, export_int8
from trainyard.runtime.model_file import int8_beside, verify_model
from trainyard.runtime.sessions import load_onnx
from trainyard.serve.settings import Settings, at_precision

from conftest import REPO, train_checkpoint


@pytest.fixture(scope="module")
def fashion(fashion_dir):
    """Real images: 1,024 train (fit and calibration), 1,000 test (the gate)."""
    train = read_idx(fashion_dir / "train-images-idx3-ubyte.gz")[:1024, None]
    train_labels = read_idx(fashion_dir / "train-labels-idx1-ubyte.gz")[:1024]
    test = read_idx(fashion_dir / "t10k-images-idx3-ubyte.gz")[:1000, None]
    test_labels = read_idx(fashion_dir / "t10k-labels-idx1-ubyte.gz")[:1000]
    return train, train_labels, test, test_labels


@pytest.fixture(scope="module")
def fp32_model(tmp_path_factory, fashion):
    """models/model.onnx from the real export, after a short fit."""
    train, train_labels, test, _ = fashion
    root = tmp_path_factory.mktemp("int8")
    train_checkpoint(root, train, train_labels, steps=30, batch_size=64, mean=0.286, std=0.353)
    export_and_verify(root / "best.ckpt", root / "model.onnx", test[:200], 18, 1e-4, "r", "d" * 64)
    return root / "model.onnx"


def test_int8_model_passes_the_gate_and_keeps_outputs_and_card(fp32_model, fashion):
    train, _, test, test_labels = fashion
    calibration = calibration_sample(train, 256, 42)
    report = export_int8(fp32_model, calibration, test, test_labels, 0.99, 0.5)
    path = int8_beside(fp32_model)
    assert path.name == "model.int8.onnx" and report["passed"]
    assert report["agreement"] >= 0.99 and report["accuracy_drop"] <= 0.5
    assert report["samples"] == 1000 and report["calibration_samples"] == 256
    assert verify_model(path) == report["sha256"] == sha256_file(path)
    fp32, int8 = load_onnx(fp32_model, "cpu"), load_onnx(path, "cpu")
    assert report["outputs"] == ["logits", "embedding", "cam"] and int8.has_embedding
    assert int8.metadata["precision"] == "int8" and "precision" not in fp32.metadata
    assert int8.metadata["quantized_from_sha256"] == sha256_file(fp32_model)
    for key in ("dataset_card", "classes", "normalization", "mlflow_run_id", "embedding_dim"):
        assert int8.metadata[key] == fp32.metadata[key], key
    # Really quantized: int8 weights, and the file is smaller. On an x86 CPU without VNNI
    # (where U8S8 saturates) the weights are 7-bit, and the metadata says so.
    graph = onnx.load(str(path)).graph
    assert {"QuantizeLinear", "DequantizeLinear"} <= {n.op_type for n in graph.node}
    weights = [
        onnx.numpy_helper.to_array(t)
        for t in graph.initializer
        if t.data_type == onnx.TensorProto.INT8
    ]
    seven_bit = x86_without_vnni()
    assert weights and (max(int(np.abs(w).max()) for w in weights) <= 64) == seven_bit
    assert ("7-bit weights" in int8.metadata["quantization"]) == seven_bit
    assert path.stat().st_size < fp32_model.stat().st_size / 2
    # The class maps come from the int8 trunk's feature maps by float arithmetic: the top
    # class's map is the fp32 model's, up to the trunk's rounding.
    x = normalize_pixels(test[:100], (0.286,), (0.353,))
    top = fp32.run(x).argmax(1)
    maps = [m.session.run(["cam"], {"image": x})[0][np.arange(100), top] for m in (fp32, int8)]
    r = [np.corrcoef(a.ravel(), b.ravel())[0, 1] for a, b in zip(*maps, strict=True)]
    assert np.mean(r) > 0.95 and int8.metadata["explain"] == "hirescam"


def test_a_miscalibrated_int8_model_fails_the_gate_naming_both_figures(fp32_model, fashion):
    _, _, test, test_labels = fashion
    path = int8_beside(fp32_model)
    path.write_bytes(b"an int8 model of an earlier export")  # must not survive a failure
    # Black images only: every activation range is the one of a blank image, so the
    # scales clip what real images produce.
    black = np.zeros((64, 1, 28, 28), dtype=np.uint8)
    with pytest.raises(ExportError) as err:
        export_int8(fp32_model, black, test, test_labels, 0.99, 0.5)
    text = str(err.value)
    assert "int8 gate failed on 1000 test images" in text
    assert "top-1 agreement with fp32" in text and "accuracy drop" in text
    assert "export.int8_min_agreement" in text or "export.int8_max_accuracy_drop" in text
    assert not path.exists() and not path.with_name(path.name + ".sha256").exists()
    assert [p.name for p in fp32_model.parent.iterdir() if p.name.startswith(".")] == []


def test_an_unreachable_threshold_fails_a_good_model(fp32_model, fashion):
    train, _, test, test_labels = fashion
    calibration = calibration_sample(train, 256, 42)
    report = export_int8(fp32_model, calibration, test, test_labels, 0.0, 100.0)
    # One point above what it reached: the same model now fails, and says the figure.
    need = min(1.0, report["agreement"] + 0.01)
    if report["agreement"] == 1.0:
        pytest.skip("int8 agrees on every image: no agreement threshold above it")
    with pytest.raises(ExportError, match=rf"top-1 agreement with fp32 {report['agreement']:.2%}"):
        export_int8(fp32_model, calibration, test, test_labels, need, 0.5)
    assert not int8_beside(fp32_model).exists()


def test_calibration_sample_is_seeded_and_bounded():
    images = (np.arange(1000) % 256).astype(np.uint8).reshape(1000, 1, 1, 1)
    a, b = calibration_sample(images, 100, 7), calibration_sample(images, 100, 7)
    assert a.shape == (100, 1, 1, 1) and np.array_equal(a, b)
    assert not np.array_equal(a, calibration_sample(images, 100, 8))
    assert calibration_sample(images[:10], 100, 7).shape[0] == 10


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("export", "quantize", "int4"),
        ("export", "int8_min_agreement", 1.5),
        ("export", "int8_max_accuracy_drop", -1),
        ("export", "calibration_samples", 0),
        ("serve", "precision", "fp16"),
    ],
)
def test_bad_int8_params_name_their_key(tmp_path, section, key, value):
    raw = json.loads(Params().model_dump_json())
    raw[section][key] = value
    path = tmp_path / "params.yaml"
    path.write_text(json.dumps(raw))
    with pytest.raises(ParamsError, match=rf"{section}\.{key}"):
        load_params(path)


def test_shipped_params_default_to_fp32_and_no_int8():
    params = load_params(REPO / "params.yaml")
    assert params.export.quantize == "none" and params.serve.precision == "fp32"
    assert (params.export.int8_min_agreement, params.export.int8_max_accuracy_drop) == (0.99, 0.5)


# ------------------------------------------------------------------ serving it


@pytest.fixture(scope="module")
def int8_dir(tmp_path_factory, fp32_model, fashion):
    """A folder of its own with model.onnx and model.int8.onnx (+ .sha256 each), as the
    export stage leaves them under export.quantize: int8."""
    train, _, test, test_labels = fashion
    root = tmp_path_factory.mktemp("int8-served")
    for name in ("model.onnx", "model.onnx.sha256"):
        shutil.copy(fp32_model.parent / name, root / name)
    calibration = calibration_sample(train, 256, 42)
    export_int8(root / "model.onnx", calibration, test, test_labels, 0.99, 0.5)
    return root


def int8_probabilities(path, pixels: np.ndarray) -> np.ndarray:
    model = load_onnx(path, "cpu")
    x = normalize_pixels(pixels, (0.286,), (0.353,))
    logits = model.run(x).astype(np.float64)
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


@pytest.mark.slow
def test_a_served_int8_model_answers_classify_and_says_int8(tmp_path, int8_dir, fashion):
    from test_serving import Server, classify, png, server_env, server_metadata, write_params

    test = fashion[2]
    params = write_params(tmp_path / "params.yaml", precision="int8", batching=False)
    srv = Server(server_env(params, int8_dir / "model.onnx"), tmp_path / "serve.log")
    try:
        srv.wait_ready()
        expected = int8_probabilities(int8_dir / "model.int8.onnx", test[:4])
        for i in range(4):
            r = classify(srv.url, png(test[i, 0]))
            assert r.status_code == 200, r.text
            assert np.allclose(r.json()["probabilities"], expected[i], atol=1e-5)
        meta = server_metadata(srv.url)["model"]
        assert meta["precision"] == "int8" and meta["path"].endswith("model.int8.onnx")
        assert meta["sha256"] == sha256_file(int8_dir / "model.int8.onnx")
        assert r.headers["x-model-version"] == meta["sha256"][:12]
    finally:
        srv.stop()
    assert "model.int8.onnx (int8, sha256" in srv.tail(20_000)


def serve_settings(tmp_path, model: str, precision: str = "int8") -> Settings:
    return Settings(
        params=ServeParams(precision=precision),
        params_file=tmp_path / "params.yaml",
        model_source=model,
        api_key=None,
        cache_dir=tmp_path / "cache",
    )


def test_int8_asked_without_an_int8_file_is_a_start_up_error(tmp_path, int8_dir):
    shutil.copy(int8_dir / "model.onnx", tmp_path / "model.onnx")
    settings = serve_settings(tmp_path, str(tmp_path / "model.onnx"))
    with pytest.raises(ModelError, match=r"serve\.precision is int8.*export\.quantize: int8"):
        at_precision(settings, tmp_path / "model.onnx", {})
    fp32 = serve_settings(tmp_path, str(tmp_path / "model.onnx"), "fp32")
    assert at_precision(fp32, tmp_path / "model.onnx", {}) == tmp_path / "model.onnx"
    got = at_precision(settings, int8_dir / "model.onnx", {})
    assert got == int8_dir / "model.int8.onnx"


def test_a_registry_version_carries_its_int8_file_to_the_service(
    tmp_path, int8_dir, monkeypatch, request
):
    """Logged and registered as export and evaluate do; the service's start-up (in
    process) with serve.precision int8 on models:/NAME@champion serves the version's
    int8 file, checked against its tag; a version registered without one is refused."""
    import mlflow

    from trainyard.core.handoffs import ExportRecord
    from trainyard.export.onnx_export import normalized_example
    from trainyard.serve.startup import start
    from trainyard.track import registry
    from trainyard.track.model_refs import MlflowRegistry
    from trainyard.track.quantized import INT8_ARTIFACT, INT8_FOLDER, int8_tags

    int8 = int8_dir / "model.int8.onnx"
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    # The global URI too, for the whole test: MLflow's registry store looks a logged model
    # up through it when a version is created (an earlier test may have set another).
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    request.addfinalizer(lambda: mlflow.set_tracking_uri(previous))
    # As export does: the fp32 model, and the int8 file beside it in the run.
    exp = mlflow.create_experiment("int8", artifact_location=(tmp_path / "art").as_uri())
    with mlflow.start_run(experiment_id=exp) as run:
        pixels = np.zeros((1, 1, 28, 28), np.uint8)
        example = normalized_example(int8_dir / "model.onnx", pixels)
        model_uri = registry.log_onnx_model(int8_dir / "model.onnx", example)
        mlflow.log_artifact(str(int8), INT8_FOLDER)
    client = mlflow.MlflowClient(uri)
    gate = {"agreement": 0.995, "accuracy_drop": 0.1, "accuracy_int8": 0.7}
    record = ExportRecord.model_validate(
        json.loads(json.dumps(_export_record(int8, gate, model_uri)))
    )
    assert record.int8 is not None and record.int8.artifact == INT8_ARTIFACT
    sha = sha256_file(int8_dir / "model.onnx")
    args = (client, "int8-model", model_uri, run.info.run_id, 0.7, "data-v1", sha, 0.0)
    v1 = registry.register_and_promote(*args, extra_tags=int8_tags(record.int8))
    assert client.get_model_version("int8-model", "1").tags["int8.agreement"] == "0.995000"
    params = tmp_path / "params.yaml"
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["serve"].update(precision="int8", workers=1)
    params.write_text(yaml.safe_dump(raw))
    monkeypatch.setenv("TRAINYARD_PARAMS", str(params))
    monkeypatch.setenv("TRAINYARD_MODEL", f"models:/int8-model@{v1['alias']}")
    monkeypatch.setenv("TRAINYARD_MODEL_CACHE", str(tmp_path / "cache"))
    begun = start(MlflowRegistry)
    assert begun.model_path == tmp_path / "cache" / "int8-model" / "1" / "model.int8.onnx"
    assert sha256_file(begun.model_path) == sha256_file(int8)
    described = begun.predictor().describe()
    assert described["model"]["precision"] == "int8"
    assert described["source"]["registry_version"] == "1"
    # The same model registered without the int8 file: start-up says what to set.
    client.create_model_version("int8-model", model_uri, run.info.run_id, tags={"onnx_sha256": sha})
    client.set_registered_model_alias("int8-model", "plain", "2")
    monkeypatch.setenv("TRAINYARD_MODEL", "models:/int8-model@plain")
    with pytest.raises(ModelError, match=r"registered without an int8.*export\.quantize: int8"):
        start(MlflowRegistry)


def _export_record(int8, gate: dict, model_uri: str) -> dict:
    """reports/export.json as the export stage writes it with export.quantize int8."""
    return {
        "samples": 200,
        "max_abs_diff": 1e-6,
        "argmax_agreement": 1.0,
        "threshold_max_abs_diff": 1e-4,
        "provider": "CPUExecutionProvider",
        "passed": True,
        "onnx_sha256": "0" * 64,
        "mlflow_model_uri": model_uri,
        "int8": {
            "file": int8.name,
            "sha256": sha256_file(int8),
            "artifact": "int8/model.int8.onnx",
            "samples": 1000,
            "accuracy_fp32": 0.701,
            "threshold_min_agreement": 0.99,
            "threshold_max_accuracy_drop": 0.5,
            "calibration_samples": 256,
            "outputs": ["logits", "embedding"],
            "passed": True,
            **gate,
        },
    }


def test_int8_warning_names_x86_cpus_without_vnni(monkeypatch):
    """The service warns at start-up where U8S8 kernels may saturate: x86 without any of
    AVX-VNNI, AVX512-VNNI or AMX-INT8; not on ARM, nor where cpuinfo cannot be read."""
    from trainyard.core import host

    cases = [
        ("x86_64", {"avx2", "fma"}, True),
        ("x86_64", {"avx2", "avx512_vnni"}, False),
        ("x86_64", {"avx2", "avx_vnni"}, False),
        ("aarch64", {"asimddp"}, False),
        ("x86_64", set(), False),
    ]
    for machine, flags, warned in cases:
        monkeypatch.setattr(host.platform, "machine", lambda m=machine: m)
        monkeypatch.setattr(host, "_cpu_flags", lambda f=flags: f)
        assert host.x86_without_vnni() is warned, (machine, flags)
