"""The one Trainer builder: the settings the pipeline, the benchmarks and the tests share."""

from __future__ import annotations

import pytest
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from trainyard.training.builder import accelerator_for, build_trainer
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
