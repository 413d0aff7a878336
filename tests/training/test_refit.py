"""train.refit: when the shipped model is fitted again on train + val (the rule, priced in
the plan's epochs), and what the refit leaves: a checkpoint trained on both splits that
export loads, carrying the val-chosen model's val logits for the temperature."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainyard.core.config import TrainParams
from trainyard.core.handoffs import SELECTED_VAL_LOGITS
from trainyard.export.onnx_export import load_checkpoint
from trainyard.model.classifier import Classifier
from trainyard.training.datamodule import ImageDataModule
from trainyard.training.device import Hardware
from trainyard.training.refit import REFIT_CKPT, refit, refit_epochs
from trainyard.training.tracked_run import FitResult

from conftest import fashion_card, train_checkpoint


def result(epochs_run: int = 15, max_epochs: int = 29, ckpt: str = "best.ckpt") -> FitResult:
    return FitResult(
        ckpt, 0.7, epochs_run, max_epochs, "early stopping", 10.0, None, None, "ram", ""
    )


def test_auto_refits_an_early_stopped_fine_tune_for_the_chosen_epochs():
    # clip art: stopped at 15 of 29, best at epoch 10 (index 9); 751 train + 251 val
    epochs, why = refit_epochs("auto", True, 1, result(), 9, (751, 251))
    assert epochs == 10
    assert "10 epochs validation chose" in why and "1,002 train + val" in why


def test_auto_does_not_refit_past_its_share_of_the_plan():
    # stopped at 18 of 20, best at 15: 16 x 1.25 = 20 train epochs, 12 left of 1.5 x 20
    epochs, why = refit_epochs("auto", True, 1, result(18, 20), 15, (800, 200))
    assert epochs == 0 and "not refitted" in why
    assert refit_epochs(True, True, 1, result(18, 20), 15, (800, 200))[0] == 16


@pytest.mark.parametrize(
    ("setting", "finetune", "world", "val", "said"),
    [
        ("auto", False, 1, 200, "from scratch"),  # Fashion-MNIST, digits: as before
        (False, True, 1, 200, "train.refit: false"),
        ("auto", True, 2, 200, "one device"),
        (True, True, 1, 0, "no val images"),
    ],
)
def test_no_refit(setting, finetune, world, val, said):
    epochs, why = refit_epochs(setting, finetune, world, result(), 9, (800, val))
    assert epochs == 0 and said in why


def test_the_refit_trains_on_train_and_val_and_keeps_the_chosen_models_val_logits(tmp_path):
    rng = np.random.default_rng(0)
    card = fashion_card(0.3, 0.35)
    x = rng.integers(0, 256, (60, 1, 28, 28), dtype=np.uint8)
    y = rng.integers(0, 10, 60).astype(np.int64)
    chosen = train_checkpoint(tmp_path, x[:40], y[:40], steps=2, batch_size=16, mean=0.3, std=0.35)
    saved = torch.load(chosen, weights_only=True)
    saved["epoch"] = 1  # best val/acc after the second epoch: the refit runs two
    torch.save(saved, chosen)
    dm = ImageDataModule(
        arrays={"train": (x[:40], y[:40]), "val": (x[40:], y[40:])}, card=card, batch_size=16
    )
    tp = TrainParams(refit=True, arch="cnn", lr=1e-3, batch_size=16)

    def make_model() -> Classifier:
        torch.manual_seed(0)
        return Classifier(card=card.contract(), arch="cnn")

    got = refit(tp, Hardware("cpu", "32-true", "cpu"), dm, make_model, tmp_path, result(), False)
    assert got.best_ckpt == REFIT_CKPT and got.refit is not None
    assert got.refit["trained_on"] == "train + val" and got.refit["images"] == 60
    assert got.refit["epochs"] == 2 and got.refit["best_epoch"] == 1
    ckpt = torch.load(tmp_path / REFIT_CKPT, weights_only=True)
    assert ckpt["epoch"] == 2 and ckpt["global_step"] == 2 * 4  # 60 images, batch 16
    model = make_model()
    model.load_state_dict(saved["state_dict"])
    x_val = (x[40:] / 255.0 - 0.3) / 0.35
    expected = model.eval()(torch.from_numpy(x_val.astype(np.float32))).detach()
    torch.testing.assert_close(ckpt[SELECTED_VAL_LOGITS], expected)
    exported = load_checkpoint(tmp_path / REFIT_CKPT)
    assert exported.selected_val_logits.shape == (20, 10)
    state = ckpt["state_dict"]
    assert any(not torch.equal(state[k], v) for k, v in saved["state_dict"].items())


def test_a_refit_not_chosen_ships_the_val_chosen_checkpoint(tmp_path):
    x = np.zeros((20, 1, 28, 28), np.uint8)
    y = np.arange(20) % 10
    chosen = train_checkpoint(tmp_path, x, y, steps=1, batch_size=10, mean=0.3, std=0.35)
    dm = ImageDataModule(
        arrays={"train": (x, y), "val": (x, y)}, card=fashion_card(), batch_size=10
    )
    tp = TrainParams(refit="auto")
    got = refit(tp, Hardware("cpu", "32-true", "cpu"), dm, None, tmp_path, result(), False)
    assert got.best_ckpt == chosen.name and got.refit["trained_on"] == "train"
    assert got.refit["images"] == 20 and got.refit["epochs"] == 0
