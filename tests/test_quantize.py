"""export.quantize int8: a real model (a short fit on real Fashion-MNIST, the real export)
quantized by ONNX Runtime, its gate passing, and failing with both figures named."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from trainyard.core.config import Params, ParamsError, load_params
from trainyard.core.errors import ExportError
from trainyard.core.io import sha256_file
from trainyard.data.idx import read_idx
from trainyard.export.onnx_export import export_and_verify
from trainyard.export.quantize import calibration_sample, export_int8
from trainyard.runtime.model_file import int8_beside, verify_model
from trainyard.runtime.sessions import load_onnx

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
    report = export_int8(fp32_model, calibration_sample(train, 256, 42), test, test_labels, 0.99, 0.5)
    path = int8_beside(fp32_model)
    assert path.name == "model.int8.onnx" and report["passed"]
    assert report["agreement"] >= 0.99 and report["accuracy_drop"] <= 0.5
    assert report["samples"] == 1000 and report["calibration_samples"] == 256
    assert verify_model(path) == report["sha256"] == sha256_file(path)
    fp32, int8 = load_onnx(fp32_model, "cpu"), load_onnx(path, "cpu")
    assert report["outputs"] == ["logits", "embedding"] and int8.has_embedding
    assert int8.metadata["precision"] == "int8" and "precision" not in fp32.metadata
    assert int8.metadata["quantized_from_sha256"] == sha256_file(fp32_model)
    for key in ("dataset_card", "classes", "normalization", "mlflow_run_id", "embedding_dim"):
        assert int8.metadata[key] == fp32.metadata[key], key
    # Really quantized: int8 weights, and the file is smaller.
    ops = {n.op_type for n in onnx.load(str(path)).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    assert path.stat().st_size < fp32_model.stat().st_size / 2


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
