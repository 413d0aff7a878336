"""ONNX export of a real Lightning checkpoint: metadata, dynamic batch, the logits and
embedding outputs, the parity gate."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper

from trainyard.core.card import normalize_pixels
from trainyard.core.errors import ExportError
from trainyard.export.onnx_export import (
    check_parity,
    export_and_verify,
    load_checkpoint,
    parity_failures,
)
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


def export(checkpoint: Path, out: Path, images: np.ndarray, max_abs_diff: float = 1e-4) -> dict:
    """``export_and_verify`` as the export stage calls it (opset 18), without calibration."""
    return export_and_verify(checkpoint, out, images, 18, max_abs_diff, "run123", "d" * 64)


@pytest.fixture(scope="module")
def exported(checkpoint, test_images, tmp_path_factory):
    """(model.onnx, its report): the checkpoint through ``export_and_verify`` once."""
    out = tmp_path_factory.mktemp("export") / "model.onnx"
    return out, export(checkpoint, out, test_images)


def test_export_metadata_dynamic_batch_and_parity(exported, checkpoint):
    out, report = exported
    assert report["passed"] and report["argmax_agreement"] == 1.0
    assert report["max_abs_diff"] <= 1e-4 and report["samples"] == 300
    assert out.with_name("model.onnx.sha256").read_text().split()[0] == report["onnx_sha256"]

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


def test_the_embedding_is_the_heads_input_as_a_second_output(exported, checkpoint, test_images):
    """logits first (every one-output reader's output 0), then the embedding: what the
    classifier head (the cnn's last Linear, 128 -> 10) sees, equal to PyTorch's."""
    out, report = exported
    meta = {p.key: p.value for p in onnx.load(str(out)).metadata_props}
    assert (meta["embedding_output"], meta["embedding_dim"]) == ("embedding", "128")
    model = load_onnx(out, device="cpu")
    outputs = [(o.name, o.shape[1]) for o in model.session.get_outputs()]
    assert outputs == [("logits", 10), ("embedding", 128), ("cam", 10)]

    torch_model = load_checkpoint(checkpoint)
    head = torch_model.net.head[-1]  # the cnn's own layout, named here, not searched for
    seen = []
    head.register_forward_hook(lambda _m, args, _out: seen.append(args[0]))
    x = normalize_pixels(test_images[:37], torch_model.card.mean, torch_model.card.std)
    with torch.inference_mode():
        torch_logits = torch_model(torch.from_numpy(x)).numpy()
    logits, embedding = model.run_with_embedding(x)
    assert embedding is not None and embedding.shape == (37, 128)
    assert embedding.dtype == np.float32 and np.abs(embedding).max() > 0.1
    np.testing.assert_allclose(embedding, seen[0].numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(logits, torch_logits, rtol=1e-4, atol=1e-5)
    # The gate measured it, against a limit scaled to the features' size (>= max_abs_diff).
    assert report["embedding_max_abs_diff"] <= report["threshold_embedding_max_abs_diff"]
    assert report["threshold_embedding_max_abs_diff"] >= 1e-4


def skew_embedding(src, dest, factor: float) -> None:
    """A copy of the model whose embedding output is scaled by ``factor`` (the logits are
    untouched): an export that tapped the wrong tensor."""
    proto = onnx.load(str(src))
    for node in proto.graph.node:
        node.output[:] = ["raw_embedding" if o == "embedding" else o for o in node.output]
        node.input[:] = ["raw_embedding" if i == "embedding" else i for i in node.input]
    proto.graph.initializer.append(numpy_helper.from_array(np.float32(factor), "skew"))
    proto.graph.node.append(helper.make_node("Mul", ["raw_embedding", "skew"], ["embedding"]))
    onnx.save(proto, str(dest))


def test_parity_gate_names_an_embedding_that_disagrees(exported, checkpoint, test_images, tmp_path):
    out, _ = exported
    model = load_checkpoint(checkpoint)
    bad = tmp_path / "skewed.onnx"
    skew_embedding(out, bad, 1.01)
    report = check_parity(model, bad, test_images, 1e-4)
    assert not report["passed"]
    assert report["max_abs_diff"] <= 1e-4 and report["argmax_agreement"] == 1.0  # logits fine
    failures = parity_failures(report)
    assert len(failures) == 1 and failures[0].startswith("embedding: max abs diff")
    # The same edit at no scale at all passes: the comparison itself is sound.
    skew_embedding(out, bad, 1.0)
    assert check_parity(model, bad, test_images, 1e-4)["passed"]


def test_parity_gate_rejects_and_removes_disagreeing_model(checkpoint, test_images, tmp_path):
    out = tmp_path / "model.onnx"
    # A threshold no fp32 kernel pair can meet: the gate must fail and leave no model behind.
    with pytest.raises(ExportError, match="failed on 300 test images: logits: max abs diff"):
        export(checkpoint, out, test_images, max_abs_diff=1e-12)
    assert not out.exists()


def test_non_checkpoint_file_is_refused(tmp_path):
    bad = tmp_path / "evil.ckpt"
    import pickle

    bad.write_bytes(pickle.dumps(ExportError("x")))  # an arbitrary pickled object
    with pytest.raises(ExportError, match="cannot load as a weights-only checkpoint"):
        load_checkpoint(bad)


def test_a_torch_without_the_torchscript_exporter_exports_through_torch_export(
    checkpoint, test_images, tmp_path, monkeypatch, caplog
):
    """PyTorch deprecated the TorchScript exporter (dynamo=False) in 2.9: where a torch
    refuses it, export goes through torch.export and the same parity gate passes."""
    real_export = torch.onnx.export
    calls = []

    def without_torchscript(*args, **kwargs):
        calls.append(kwargs["dynamo"])
        if not kwargs["dynamo"]:
            raise TypeError("the TorchScript-based exporter was removed")
        return real_export(*args, **kwargs)

    monkeypatch.setattr(torch.onnx, "export", without_torchscript)
    report = export(checkpoint, tmp_path / "model.onnx", test_images[:64])
    assert calls == [False, True] and report["passed"]
    assert "exporting with torch.export" in caplog.text
    names = [o.name for o in onnx.load(str(tmp_path / "model.onnx")).graph.output]
    assert names == ["logits", "embedding", "cam"]
