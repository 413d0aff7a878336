"""Temperature scaling: the fit finds the temperature that generated the labels, the
baked graph's logits are the model's divided by it with the same answers, and the
evaluate side's expected calibration error is what its definition says."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from trainyard.core.errors import ExportError
from trainyard.core.handoffs import SELECTED_VAL_LOGITS
from trainyard.core.reliability import reliability
from trainyard.export.calibration import (
    MIN_IMPROVED_SHARE,
    T_MAX,
    T_MIN,
    choose_temperature,
    ece,
    fit_temperature,
    nll,
)
from trainyard.export.onnx_export import (
    MIN_CALIBRATION_IMAGES,
    _torch_outputs,
    calibrate,
    export_and_verify,
    load_checkpoint,
)
from trainyard.runtime.sessions import load_onnx

from conftest import train_checkpoint


@pytest.mark.parametrize("true_t", [0.5, 1.0, 2.5])
def test_the_fit_recovers_the_temperature_labels_were_drawn_at(true_t):
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (20_000, 6)).astype(np.float32)
    p = np.exp(logits / true_t)
    p /= p.sum(axis=1, keepdims=True)
    labels = (p.cumsum(axis=1) > rng.random((len(p), 1))).argmax(axis=1)
    t = fit_temperature(logits, labels)
    assert t == pytest.approx(true_t, rel=0.05)
    assert nll(logits, labels, t) <= min(nll(logits, labels, true_t * f) for f in (0.8, 1.25))


def test_the_fit_stays_in_its_interval_and_an_empty_split_is_one():
    logits = np.array([[5.0, 0.0], [0.0, 5.0]])
    # Always right: sharper is better until the NLL is 0 in float64 (below T ~ 0.14 here).
    sharp = fit_temperature(logits, np.array([0, 1]))
    assert T_MIN <= sharp < 0.2 and nll(logits, np.array([0, 1]), sharp) < 1e-12
    assert fit_temperature(logits, np.array([1, 0])) == pytest.approx(T_MAX, rel=1e-3)
    assert fit_temperature(logits[:0], np.array([], dtype=int)) == 1.0


def test_ece_is_the_weighted_gap_between_confidence_and_accuracy():
    confidence = np.array([0.95, 0.95, 0.95, 0.95, 0.55, 0.55])
    correct = np.array([1, 1, 0, 0, 1, 1], bool)
    r = reliability(confidence, correct, bins=10)
    # bin 9: confidence .95, accuracy .5 (4 of 6 images); bin 5: .55 vs 1.0 (2 of 6)
    assert r["ece"] == pytest.approx(4 / 6 * 0.45 + 2 / 6 * 0.45)
    assert r["count"][9] == 4 and r["count"][5] == 2 and sum(r["count"]) == 6
    assert r["accuracy"][9] == pytest.approx(0.5) and r["confidence"][5] == pytest.approx(0.55)
    assert reliability(np.ones(3), np.ones(3, bool))["ece"] == 0.0  # 1.0 lands in the last bin


def _two_groups() -> tuple[np.ndarray, np.ndarray]:
    """Two-class logits where the NLL and the ECE disagree: 50 answers at confidence 0.7,
    35 of them right (calibrated), and 50 at 0.999, 45 right (over-confident). The five
    confident mistakes dominate the NLL, whose optimum (T ~ 2.9) softens the calibrated
    group to ~0.57 too: the ECE rises from 0.0495 to ~0.072."""
    calibrated, confident = np.log(0.7 / 0.3), np.log(0.999 / 0.001)
    logits = np.array([[calibrated, 0.0]] * 50 + [[confident, 0.0]] * 50)
    labels = np.array([0] * 35 + [1] * 15 + [0] * 45 + [1] * 5)
    return logits, labels


def test_a_temperature_that_would_raise_the_ece_is_not_applied():
    logits, labels = _two_groups()
    fitted = fit_temperature(logits, labels)
    assert fitted > 2 and nll(logits, labels, fitted) < nll(logits, labels)  # the NLL wants it
    assert ece(logits, labels, fitted) > ece(logits, labels)  # ... and it is worse calibrated
    chosen = choose_temperature(logits, labels)
    assert chosen["temperature"] == 1.0 and chosen["applied"] is False
    assert chosen["fitted_temperature"] == fitted and chosen["val_ece_improved_share"] == 0
    assert chosen["val_ece_before"] == pytest.approx(0.0495)
    assert chosen["val_ece_after"] == pytest.approx(ece(logits, labels, fitted), abs=1e-6)


def test_a_temperature_that_lowers_the_ece_by_noise_alone_is_not_applied():
    # 150 answers drawn at T = 1 (calibrated): the fit lands near 1 and, on this draw,
    # lowers the split's ECE from 0.0837 to 0.0744 by chance; most resamples do not agree.
    rng = np.random.default_rng(6)
    logits = rng.normal(0, 2, (150, 5))
    p = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    labels = (p.cumsum(axis=1) > rng.random((150, 1))).argmax(axis=1)
    fitted = fit_temperature(logits, labels)
    assert fitted != 1.0 and ece(logits, labels, fitted) < ece(logits, labels)  # has teeth
    chosen = choose_temperature(logits, labels)
    assert chosen["applied"] is False and chosen["temperature"] == 1.0
    assert 0.0 < chosen["val_ece_improved_share"] < MIN_IMPROVED_SHARE


def test_a_temperature_that_lowers_the_ece_is_applied():
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 3, (5_000, 6))
    p = np.exp(logits / 2.5)
    p /= p.sum(axis=1, keepdims=True)
    labels = (p.cumsum(axis=1) > rng.random((len(p), 1))).argmax(axis=1)
    chosen = choose_temperature(logits, labels)  # drawn at T 2.5: over-confident at T 1
    assert chosen["applied"] is True and chosen["temperature"] == chosen["fitted_temperature"]
    assert chosen["temperature"] == pytest.approx(2.5, rel=0.05)
    assert chosen["val_ece_after"] < chosen["val_ece_before"] / 3
    assert chosen["val_ece_improved_share"] == 1.0


def test_ece_on_logits_is_evaluates_reliability():
    logits, labels = _two_groups()
    rng = np.random.default_rng(2)
    many = rng.normal(0, 2, (3_000, 10))
    many_labels = rng.integers(0, 10, 3_000)
    for z, y, t in ((logits, labels, 1.0), (logits, labels, 2.9), (many, many_labels, 0.7)):
        p = np.exp(z / t - (z / t).max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        expected = reliability(p.max(axis=1), p.argmax(axis=1) == y)["ece"]
        assert ece(z, y, t) == pytest.approx(expected, abs=1e-6)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[np.ndarray, np.ndarray, Path]:
    """(images, labels, a checkpoint 3 steps into fitting them): random, read only (a test
    that changes the checkpoint changes a copy, ``refitted``)."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (96, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, 96)
    root = tmp_path_factory.mktemp("calibration")
    ckpt = train_checkpoint(root, images, labels, steps=3, batch_size=16, mean=0.3, std=0.35)
    return images, labels, ckpt


def refitted(ckpt: Path, selected: np.ndarray, folder: Path) -> Path:
    """A copy of ``ckpt`` in ``folder`` carrying ``selected`` as the val-chosen model's val
    logits, as the refit leaves its checkpoint."""
    saved = torch.load(ckpt, weights_only=True)
    saved[SELECTED_VAL_LOGITS] = torch.from_numpy(selected)
    torch.save(saved, folder / "refit.ckpt")
    return folder / "refit.ckpt"


def test_the_exported_graph_carries_the_fitted_temperature(trained, tmp_path):
    images, _, ckpt = trained
    # Validation labels the barely trained model mostly gets right (its own answers, 8 of
    # 64 changed): right 7 times in 8 at a confidence near 1/10, an under-confidence the
    # guard is sure a temperature fixes.
    x_val = ((images[:64, None] / 255.0 - 0.3) / 0.35).astype(np.float32)
    val_labels = _torch_outputs(load_checkpoint(ckpt), x_val)[0].argmax(1)
    val_labels[:8] = (val_labels[:8] + 1) % 10
    val = (images[:64, None], val_labels)
    out = tmp_path / "model.onnx"
    report = export_and_verify(ckpt, out, images[64:, None], 18, 1e-4, "r", "d" * 64, val)
    scaling = report["calibration"]
    t = scaling["temperature"]
    assert report["passed"] and t != 1.0 and scaling["samples"] == 64
    assert scaling["applied"] is True and t == scaling["fitted_temperature"]
    assert scaling["val_ece_after"] < scaling["val_ece_before"]
    assert scaling["val_nll_after"] <= scaling["val_nll_before"]
    model = load_checkpoint(ckpt)
    x = ((images[64:, None] / 255.0 - 0.3) / 0.35).astype(np.float32)
    torch_logits = _torch_outputs(model, x)[0]
    onnx_model = load_onnx(out, device="cpu")
    graph_logits = onnx_model.run(x)
    assert onnx_model.metadata["temperature"] == repr(t)
    np.testing.assert_allclose(graph_logits, torch_logits / t, atol=1e-4)
    assert (graph_logits.argmax(1) == torch_logits.argmax(1)).all()  # the same answers


def test_a_small_or_never_wrong_validation_split_leaves_the_model_as_trained(trained):
    images, labels, ckpt = trained
    model = load_checkpoint(ckpt)
    few = MIN_CALIBRATION_IMAGES - 1
    assert calibrate(model, images[:few, None], labels[:few]) == {"temperature": 1.0, "samples": 0}
    x = ((images[:64, None] / 255.0 - 0.3) / 0.35).astype(np.float32)
    own = _torch_outputs(model, x)[0].argmax(1)  # labels the model always gets right
    assert calibrate(model, images[:64, None], own) == {"temperature": 1.0, "samples": 0}
    assert calibrate(model, images[:64, None], labels[:64])["samples"] == 64


def test_a_refitted_checkpoint_is_calibrated_on_the_val_chosen_models_logits(trained, tmp_path):
    """train.refit: the shipped model trained on val, so the temperature comes from the
    logits its checkpoint carries (the val-chosen model's), never from its own."""
    images, labels, ckpt = trained
    own = calibrate(load_checkpoint(ckpt), images[:64, None], labels[:64])
    # Over-confident logits, right 3 times in 4: a temperature above 1 fixes them.
    rng = np.random.default_rng(1)
    chosen = rng.normal(0, 1, (64, 10)).astype(np.float32)
    right = rng.random(64) < 0.75
    chosen[np.arange(64), np.where(right, labels[:64], (labels[:64] + 1) % 10)] += 8
    got = calibrate(
        load_checkpoint(refitted(ckpt, chosen, tmp_path)), images[:64, None], labels[:64]
    )
    assert "fitted_on" not in own and got["fitted_on"].startswith("the val-chosen model")
    assert got["fitted_temperature"] > 1.0 and got != own
    assert got["val_nll_before"] == pytest.approx(nll(chosen, labels[:64]), abs=1e-5)


def test_stored_val_logits_that_do_not_match_the_val_split_stop_the_export(trained, tmp_path):
    """A refitted model trained on val: with the stored logits unusable, export fails
    naming both lengths and the checkpoint, never falling back to the model's own logits."""
    images, labels, ckpt = trained
    ckpt = refitted(ckpt, np.zeros((63, 10), np.float32), tmp_path)
    out = tmp_path / "model.onnx"
    val = (images[:64, None], labels[:64])
    with pytest.raises(ExportError, match="logits") as err:
        export_and_verify(ckpt, out, images[64:, None], 18, 1e-4, "r", "d" * 64, val)
    assert "63 images" in str(err.value) and "has 64" in str(err.value)
    assert str(ckpt) in str(err.value) and not out.exists()
