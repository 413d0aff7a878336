"""The one Trainer builder: the settings the pipeline, the benchmarks and the tests share."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from trainyard.training.builder import (
    LateEarlyStopping,
    accelerator_for,
    build_trainer,
    stop_reason,
)
from trainyard.training.fit_log import ProgressLog


def test_torch_device_names_map_to_lightning_accelerators():
    assert accelerator_for("cuda") == "gpu"
    assert accelerator_for("cpu") == "cpu"
    assert accelerator_for("gpu") == "gpu"


def test_quiet_by_default_and_never_a_distributed_sampler(tmp_path):
    trainer = build_trainer(max_steps=3, root=tmp_path)
    assert trainer.logger is None
    assert trainer.checkpoint_callback is None
    assert not trainer.progress_bar_callback
    # trainyard's data paths shard by rank themselves: Lightning must not shard again
    assert trainer._accelerator_connector.use_distributed_sampler is False
    assert trainer.max_steps == 3 and trainer.default_root_dir == str(tmp_path)


def test_checkpointing_follows_a_modelcheckpoint_callback(tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path)
    trainer = build_trainer(callbacks=[ckpt, Callback()], root=tmp_path, verbose=True)
    assert trainer.checkpoint_callback is ckpt
    # Not a terminal under pytest: the periodic progress line instead of a bar (test_logs).
    assert trainer.progress_bar_callback is None
    assert any(isinstance(c, ProgressLog) for c in trainer.callbacks)


def test_lightning_options_pass_through_and_bad_ones_fail():
    assert build_trainer(max_epochs=7, deterministic=True).max_epochs == 7
    with pytest.raises(TypeError):
        build_trainer(no_such_option=1)


class Scripted(L.LightningModule):
    """val/acc of each epoch as given: what early stopping sees, nothing learnt."""

    def __init__(self, val_acc: list[float]) -> None:
        super().__init__()
        self.net = torch.nn.Linear(2, 2)
        self.val_acc = val_acc

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).sum()

    def validation_step(self, batch, batch_idx):
        self.log("val/acc", self.val_acc[self.current_epoch])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def stopped_after(early: EarlyStopping, val_acc: list[float], min_epochs: int) -> tuple:
    data = DataLoader(TensorDataset(torch.zeros(4, 2)), batch_size=4)
    trainer = build_trainer(
        callbacks=[early], max_epochs=len(val_acc), min_epochs=min_epochs, num_sanity_val_steps=0
    )
    trainer.fit(Scripted(val_acc), data, data)
    return trainer.current_epoch, stop_reason(trainer)


# Patience 2 runs out after epoch 4; from epoch 6 (min_epochs) val/acc rises to epoch 8,
# then stays flat.
PLATEAU_THEN_RISE = [0.5, 0.6, 0.6, 0.6, 0.6, 0.7, 0.8, 0.9, 0.9, 0.9, 0.9, 0.9]


def test_early_stopping_judges_from_min_epochs_on_and_sees_a_late_rise():
    def early(cls: type) -> EarlyStopping:
        return cls(monitor="val/acc", mode="max", patience=2)

    # Lightning keeps the verdict of epoch 4 and stops at min_epochs, val/acc rising or not.
    assert stopped_after(early(EarlyStopping), PLATEAU_THEN_RISE, 6)[0] == 6
    # trainyard's: judged again at every epoch; stops two epochs after the best (epoch 8).
    assert stopped_after(early(LateEarlyStopping), PLATEAU_THEN_RISE, 6) == (
        10,
        "early stopping after epoch 10",
    )
    # A verdict withdrawn is not reported: a run that never stops again ran its max_epochs.
    rising = [0.5, 0.5, 0.5, 0.5, 0.6, 0.7, 0.8, 0.9]
    assert stopped_after(early(LateEarlyStopping), rising, 5) == (8, "max_epochs")
    # No min_epochs: the same as Lightning's.
    flat = [0.5] * 8
    assert stopped_after(early(LateEarlyStopping), flat, 0)[0] == 3
