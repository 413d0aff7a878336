"""The fit's per-epoch history as a CSV (``models/history.csv``): what the learning curves of
the evaluate stage's report, and ``dvc plots``, are drawn from.

One row per epoch, written at the end of that epoch's validation, so the checkpoint saved at
the same validation end (``ModelCheckpoint`` saves in ``on_validation_end``, after this)
already holds the row. Lightning reduces ``train/loss`` to its epoch mean only after
validation, so the callback keeps its own batch-size-weighted mean: the same number as
MLflow's ``train/loss_epoch`` (rank 0's shard under DDP, as there).

Resume: DVC deletes a stage's outs before it runs, so a resumed fit cannot count on finding
the old CSV. The rows travel in the checkpoint (this callback's state); the CSV on disk is the
fallback for a checkpoint without them. Either way only epochs before the one the fit
resumes at are kept: a fit resumed from an older checkpoint redraws the later epochs.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.trainer.states import TrainerFn

from trainyard.core.fit_history import (
    COLUMNS,
    EPOCH,
    EPOCH_TIME,
    LR,
    STEP,
    TRAIN_LOSS,
    VAL_ACC,
    VAL_LOSS,
    Row,
    history_csv,
    read_history,
)
from trainyard.core.io import atomic_write_text
from trainyard.training.clock import BatchClock


def _metric(metrics: dict[str, Any], key: str) -> float | None:
    value = metrics.get(key)
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


class History(L.Callback):
    """Writes ``path`` (rank 0): one row per validated epoch, the whole file rewritten
    atomically each time, so a kill leaves the previous complete version.

    Columns: ``epoch`` (1-based, as the console's ``epoch 3/10``), ``step`` (optimizer steps
    so far), ``train/loss`` (epoch mean), ``val/loss``, ``val/acc``, ``lr`` (of the first
    param group, as the epoch's last training step used it) and ``epoch_time_s`` (train epoch
    start to validation end; from the resume point for an epoch a fit resumes within).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.rows: list[Row] = []
        self._restored: list[Row] | None = None
        self._loss_sum: torch.Tensor | None = None
        self._seen = 0
        self._lr: float | torch.Tensor | None = None

    # -- resume: the rows travel in the checkpoint as plain lists (weights_only loads them)

    def state_dict(self) -> dict[str, Any]:
        return {"columns": list(COLUMNS), "rows": [[r.get(c) for c in COLUMNS] for r in self.rows]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        columns = state_dict.get("columns", [])
        self._restored = [dict(zip(columns, values, strict=True)) for values in state_dict["rows"]]

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start_epoch()
        if not trainer.is_global_zero:
            return
        rows = self._restored
        if rows is None and trainer.current_epoch > 0 and self.path.exists():
            rows = read_history(self.path)  # resumed from a checkpoint written without rows
        # current_epoch is the 0-based epoch the fit (re)starts at: 1-based epochs up to it
        # are done; a fresh fit (0) starts from an empty file.
        self.rows = [r for r in rows or [] if int(r[EPOCH] or 0) <= trainer.current_epoch]
        atomic_write_text(self.path, history_csv(self.rows))

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start_epoch()

    def _start_epoch(self) -> None:
        self._loss_sum, self._seen, self._lr = None, 0, None

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # The lr this step uses. Not read at validation, nor at batch end: Lightning steps the
        # schedulers before on_train_batch_end, so lr would already be the next step's (the
        # next epoch's, for an epoch-interval scheduler).
        if trainer.optimizers and trainer.optimizers[0].param_groups:
            lr = trainer.optimizers[0].param_groups[0]["lr"]
            # A tensor lr (a capturable or compiled optimizer's) is read at the row, once
            # an epoch: float() here would wait for the GPU every step.
            self._lr = lr.detach().clone() if isinstance(lr, torch.Tensor) else float(lr)

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if not isinstance(loss, torch.Tensor):
            return
        n = BatchClock.of(trainer).batch_images
        # A tensor sum on the loss's device: float() here would wait for the GPU every step.
        weighted = loss.detach().float() * n
        self._loss_sum = weighted if self._loss_sum is None else self._loss_sum + weighted
        self._seen += n

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        if not trainer.is_global_zero:
            return
        metrics = trainer.callback_metrics
        train_loss = None
        if self._loss_sum is not None and self._seen:
            train_loss = float(self._loss_sum) / self._seen
        row: Row = {
            EPOCH: trainer.current_epoch + 1,
            STEP: int(trainer.global_step),
            TRAIN_LOSS: train_loss,
            VAL_LOSS: _metric(metrics, "val/loss"),
            VAL_ACC: _metric(metrics, "val/acc"),
            LR: None if self._lr is None else float(self._lr),
            EPOCH_TIME: round(BatchClock.of(trainer).elapsed(), 3),
        }
        # Validation more than once an epoch (val_check_interval < 1): the latest counts.
        self.rows = [r for r in self.rows if r[EPOCH] != row[EPOCH]] + [row]
        atomic_write_text(self.path, history_csv(self.rows))
