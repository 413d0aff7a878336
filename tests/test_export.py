"""ONNX export of a real Lightning checkpoint: metadata, dynamic batch, the parity gate."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from trainyard.core.errors import ExportError
from trainyard.export.onnx_export import export_and_verify, load_checkpoint
from trainyard.runtime.sessions import load_onnx

from conftest import train_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A real Lightning checkpoint after a few CPU steps on random images."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (64, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, 64)
    return train_checkpoint(
        tmp_path_factory.mktemp("ckpt"), images, labels, steps=3, batch_size=16, mean=0.3, std=0.35
    )


@pytest.fixture(scope="module")
def test_images():
    rng = np.random.default_rng(1)
    return rng.integers(0, 256, size=(300, 1, 28, 28), dtype=np.uint8)


def test_lightning_checkpoint_loads_weights_only(checkpoint):
    model = load_checkpoint(checkpoint)
    assert not model.training and model.card.mean == (0.3,)
    assert model.card.classes[0] == "T-shirt/top" and model.card.input_shape == (1, 28, 28)


def test_export_metadata_dynamic_batch_and_parity(checkpoint, test_images, tmp_path):
    out = tmp_path / "model.onnx"
    report = export_and_verify(
        checkpoint,
        out,
        test_images,
        opset=18,
        max_abs_diff=1e-4,
        run_id="run123",
        data_sha256="d" * 64,
    )
    assert report["passed"] and report["argmax_agreement"] == 1.0
    assert report["max_abs_diff"] <= 1e-4 and report["samples"] == 300
    assert (tmp_path / "model.onnx.sha256").read_text().split()[0] == report["onnx_sha256"]

    meta = {p.key: p.value for p in onnx.load(str(out)).metadata_props}
    assert json.loads(meta["classes"])[0] == "T-shirt/top"
    assert json.loads(meta["input_shape"]) == [-1, 1, 28, 28]
    assert json.loads(meta["normalization"]) == {"scale": 255.0, "mean": [0.3], "std": [0.35]}
    # The whole contract travels as the dataset card, equal to the checkpoint's.
    card = json.loads(meta["dataset_card"])
    assert card == load_checkpoint(checkpoint).card.contract()
    assert (card["channels"], card["height"], card["width"], card["resize"]) == (1, 28, 28, "pad")
    assert meta["mlflow_run_id"] == "run123" and len(meta["checkpoint_sha256"]) == 64

    model = load_onnx(out, device="cpu")
    for batch in (1, 7, 300):  # the batch dimension is dynamic
        x = np.random.default_rng(batch).standard_normal((batch, 1, 28, 28), dtype=np.float32)
        assert model.run(x).shape == (batch, 10)


def test_parity_gate_rejects_and_removes_disagreeing_model(checkpoint, test_images, tmp_path):
    out = tmp_path / "model.onnx"
    # A threshold no fp32 kernel pair can meet: the gate must fail and leave no model behind.
    with pytest.raises(ExportError, match="parity gate failed on 300 test images"):
        export_and_verify(
            checkpoint, out, test_images, opset=18, max_abs_diff=1e-12, run_id="r", data_sha256="d"
        )
    assert not out.exists()


def test_non_checkpoint_file_is_refused(tmp_path):
    bad = tmp_path / "evil.ckpt"
    import pickle

    bad.write_bytes(pickle.dumps(ExportError("x")))  # an arbitrary pickled object
    with pytest.raises(ExportError, match="cannot load as a weights-only checkpoint"):
        load_checkpoint(bad)
