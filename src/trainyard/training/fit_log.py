"""What a fit says as it goes, in log lines: the model's size once, a line every
``every_s`` seconds within an epoch when no progress bar draws, and why it stopped early.

The per-epoch summary is EpochTimer's line; ProgressLog fills the time between those lines
(both read the fit's one BatchClock): an epoch of a large folder on a CPU takes many
minutes, and a log (CI, `dvc exp run --queue`, a file) showed nothing until it ended.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import EarlyStopping
from torch.nn.parameter import UninitializedParameter

from trainyard.core.progress import duration
from trainyard.training.clock import BatchClock

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 30.0  # often enough to see a fit moving, rare enough to read the log


def model_line(module: torch.nn.Module) -> str:
    """``model: 458,378 parameters (all trainable), 1.8 MB as fp32``: what Lightning's
    summary table said that matters here, in one line."""
    params = [p for p in module.parameters() if not isinstance(p, UninitializedParameter)]
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    which = "all trainable" if trainable == total else f"{trainable:,} trainable"
    return f"model: {total:,} parameters ({which}), {total * 4 / 1e6:.1f} MB as fp32"


class ProgressLog(L.Callback):
    """The fit's log lines (rank 0 only). ``periodic``: a line every ``every_s`` seconds
    within an epoch, ``epoch 2/10 step 120/215 (56%), loss 0.4321, 1,234 img/s, ETA 45s``
    (off under a progress bar, which shows the same)."""

    def __init__(self, periodic: bool = True, every_s: float = PROGRESS_EVERY_S) -> None:
        self.periodic, self.every_s = periodic, every_s
        self.t_last = time.perf_counter()  # the last line's time: the epoch's is the clock's

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            log.info(model_line(pl_module))

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.t_last = time.perf_counter()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A fit resumed within an epoch (a timed checkpoint) skips on_train_epoch_start.
        self.on_train_epoch_start(trainer, pl_module)

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        now = time.perf_counter()
        if not self.periodic or now - self.t_last < self.every_s or not trainer.is_global_zero:
            return
        self.t_last = now
        log.info(self.line(trainer, outputs, batch_idx + 1, BatchClock.of(trainer)))

    def line(self, trainer: L.Trainer, outputs: Any, step: int, clock: BatchClock) -> str:
        """``epoch e/E step k/n (pct), loss x, r img/s, ETA t`` (ETA: of this epoch)."""
        total = trainer.num_training_batches
        text = f"epoch {trainer.current_epoch + 1}/{trainer.max_epochs} step {step:,}"
        if math.isfinite(total):
            text += f"/{int(total):,} ({100 * step / max(total, 1):.0f}%)"
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            text += f", loss {float(loss):.4f}"  # a sync, but once in every_s seconds
        elapsed = max(clock.t_batch_end - clock.t0, 1e-9)
        # Under DDP every rank trains an equal shard in lockstep: total = world_size x own.
        text += f", {clock.images * trainer.world_size / elapsed:,.0f} img/s"
        if math.isfinite(total) and step < total:
            text += f", ETA {duration((total - step) * elapsed / max(clock.steps, 1))}"
        return text

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Early stopping ends a fit silently (Lightning says so at DEBUG only); reaching
        # max_epochs needs no line: the last epoch line reads "epoch N/N".
        early = trainer.early_stopping_callback
        if not trainer.is_global_zero or not isinstance(early, EarlyStopping):
            return
        if early.stopping_reason_message and trainer.current_epoch < (trainer.max_epochs or 0):
            why = early.stopping_reason_message.removesuffix(" Signaling Trainer to stop.")
            log.info(
                "early stopping after epoch %d/%d: %s",
                trainer.current_epoch,
                trainer.max_epochs,
                why,
            )


class EpochTimer(L.Callback):
    """Logs epoch time and training throughput (img/s): the number that shows a fed GPU.
    Both read the fit's BatchClock (img/s counts training steps, not validation)."""

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        clock = BatchClock.of(trainer)
        dt = clock.elapsed()
        # Under DDP every rank trains an equal shard in lockstep: total = world_size x own.
        rate = clock.images * trainer.world_size / max(clock.t_batch_end - clock.t0, 1e-9)
        pl_module.log("train/epoch_time_s", dt, on_epoch=True, rank_zero_only=True)
        pl_module.log("train/img_per_s", rate, on_epoch=True, rank_zero_only=True)
        if not trainer.is_global_zero:
            return
        m = trainer.callback_metrics
        # One plain line per epoch: readable in `dvc repro` logs, where no progress bar draws.
        log.info(
            "epoch %d/%d train/loss %.4f val/acc %.4f %.1fs %s img/s",
            trainer.current_epoch + 1,
            trainer.max_epochs,
            float(m.get("train/loss_epoch", float("nan"))),
            float(m.get("val/acc", float("nan"))),
            dt,
            f"{rate:,.0f}",
        )
