"""The fit's one per-batch clock: when the train epoch began, its steps and images so far,
when the last one ended. The callbacks that time a fit read it instead of each keeping
their own: the epoch line and the progress lines (fit_log), the history's epoch time
(history) and the input-bound meter, whose finer split of each step (data wait, copy,
compute: ``perf.StepClock``) the clock marks at the same hooks (``split``).

``build_trainer`` puts one first among a trainer's callbacks, so that it has counted a
batch before any other callback's ``on_train_batch_end`` reads it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import lightning as L
import torch

if TYPE_CHECKING:
    from trainyard.training.perf import StepClock


def batch_len(batch: Any) -> int:
    """Images in a batch: the first dimension of its first tensor (images, labels)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    if isinstance(batch, list | tuple) and batch:
        return batch_len(batch[0])
    if isinstance(batch, dict) and batch:
        return batch_len(next(iter(batch.values())))
    return 0


class BatchClock(L.Callback):
    """Per train epoch: ``t0`` (its start, or the resume point for an epoch a fit resumes
    within), ``steps`` and ``images`` so far, ``batch_images`` of the last step and
    ``t_batch_end`` (when it ended: throughput counts training steps, not validation).
    Readings are ``time.perf_counter()``; nothing here waits for a GPU."""

    def __init__(self) -> None:
        self.split: StepClock | None = None  # perf's step split, while a meter asks for it
        self._start()

    @classmethod
    def of(cls, trainer: L.Trainer) -> BatchClock:
        """The clock among ``trainer``'s callbacks (build_trainer adds one)."""
        for callback in trainer.callbacks:
            if isinstance(callback, cls):
                return callback
        raise RuntimeError("no BatchClock among the trainer's callbacks (build_trainer adds it)")

    def _start(self) -> None:
        self.t0 = self.t_batch_end = time.perf_counter()
        self.steps = self.images = self.batch_images = 0

    def elapsed(self) -> float:
        """Seconds since the epoch began."""
        return time.perf_counter() - self.t0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A fit resumed within an epoch (a timed checkpoint) skips on_train_epoch_start.
        self._start()

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start()
        if self.split is not None:
            self.split.epoch_start(trainer.num_training_batches)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.split is not None:
            self.split.step_start()

    def on_train_batch_end(self, trainer: L.Trainer, *step: Any) -> None:
        # Lightning passes (pl_module, outputs, batch, batch_idx) after the trainer.
        batch = step[2]
        if self.split is not None:
            self.split.step_end()
        self.steps += 1
        self.batch_images = batch_len(batch)
        self.images += self.batch_images
        self.t_batch_end = time.perf_counter()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.split is not None and not trainer.sanity_checking:
            self.split.restart_wait()
