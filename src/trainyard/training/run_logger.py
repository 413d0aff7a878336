"""The fit's MLflow logger: Lightning's ``MLFlowLogger``, whose metrics and tags go through
the run's ``ServerGap`` (track.outage), so a tracking server that goes away mid-fit costs
no metric and stops no training.

Light on purpose (Lightning only): perf and gpu_busy tag the run through ``tag_run``, and
the benchmarks import those modules on machines where MLflow is not wanted.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Protocol

import lightning as L
from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.utilities import rank_zero_only

# What MLflow accepts in a metric's name (Lightning's own rule in MLFlowLogger.log_metrics).
_NOT_IN_NAME = re.compile(r"[^a-zA-Z0-9_/. -]+")


class Gap(Protocol):
    """What the logger needs of track.outage's ServerGap."""

    epoch: int

    @property
    def away(self) -> bool: ...

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...

    def set_tags(self, tags: Mapping[str, str]) -> None: ...

    def attempt(self, calls: Any) -> bool: ...


class RunLogger(MLFlowLogger):
    """``MLFlowLogger`` with ``gap`` (set once the run exists): metrics and tags are kept
    while the server is away; the run is ended once its outputs are logged and everything
    kept is sent (``tracked_run.TrackedRun.complete``), not at the end of ``trainer.fit``."""

    gap: Gap | None = None

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        if self.gap is None:
            return super().log_metrics(metrics, step)
        clean = {_NOT_IN_NAME.sub("", k): v for k, v in metrics.items() if not isinstance(v, str)}
        self.gap.log_metrics(clean, step or 0)
        return None

    @rank_zero_only
    def log_hyperparams(self, params: Any) -> None:
        if self.gap is None:
            return super().log_hyperparams(params)
        # Lightning's at the fit's start (the module's hparams; the run has its params from
        # its creation): skipped, not fatal, while the server is away
        log_params = super().log_hyperparams
        self.gap.attempt(lambda: log_params(params))
        return None

    @rank_zero_only
    def finalize(self, status: str = "success") -> None:
        if self.gap is None:
            return super().finalize(status)
        if status == "success" or self.gap.away:
            # success: the run ends FINISHED after its outputs; away: nothing reaches the
            # server, and the resume state keeps the run for the next start
            return None
        end = super().finalize  # a failed fit: FAILED, unless the server is found gone
        self.gap.attempt(lambda: end(status))
        return None


class GapEpoch(L.Callback):
    """Tells the run logger's gap which epoch the fit is in (1-based), for the line that
    opens a gap: Lightning's ``epoch`` metric comes only with the epoch-end values."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.on_train_epoch_start(trainer, pl_module)  # a fit resumed within an epoch

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for logger in trainer.loggers:
            if isinstance(logger, RunLogger) and logger.gap is not None:
                logger.gap.epoch = trainer.current_epoch + 1


def tag_run(trainer: L.Trainer, tags: dict[str, str]) -> None:
    """Set ``tags`` on the fit's MLflow run (through its gap when it has one)."""
    for logger in trainer.loggers:
        if isinstance(logger, RunLogger) and logger.gap is not None:
            logger.gap.set_tags(tags)
        elif isinstance(logger, MLFlowLogger) and logger.run_id is not None:
            for key, value in tags.items():
                logger.experiment.set_tag(logger.run_id, key, value)
