"""How busy the GPU was while it trained: NVML utilisation (``trainyard.core.nvml_sampler``).

``GpuBusyMeter`` (a Lightning
callback) opens the window over the training steps only (validation, checkpoints and epoch
ends are left out) and gives the fit's mean to train.json, the MLflow run and the
input-bound verdict. The benchmarks time their windows with the same sampler.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
import torch

from trainyard.core.nvml_sampler import NvmlSampler as _NvmlSampler
from trainyard.core.nvml_sampler import busy_figures, unavailable
from trainyard.training.run_logger import tag_run

__all__ = ["GpuBusyMeter", "NvmlSampler", "busy_figures", "unavailable"]

log = logging.getLogger(__name__)

TRAIN_PERIOD_S = 0.05  # 20 reads a second: enough for a mean, nothing against the loop
NO_CUDA = "no CUDA device"


def nvml_index(device: torch.device | int | None) -> int:
    """NVML's index of a torch CUDA device: NVML ignores CUDA_VISIBLE_DEVICES, torch's
    ``cuda:0`` may be NVML's third GPU."""
    index = 0 if device is None else device if isinstance(device, int) else device.index or 0
    try:
        return int(torch.cuda._get_nvml_device_index(index))
    except Exception:  # a private helper: without it, the visible order is NVML's
        return index


class NvmlSampler(_NvmlSampler):
    """``trainyard.core.nvml_sampler.NvmlSampler`` of a torch device (NVML's own numbering)."""

    def __init__(self, period: float = 0.02, device: torch.device | int | None = None) -> None:
        super().__init__(period, nvml_index(device))


class GpuBusyMeter(L.Callback):
    """NVML utilisation over the training steps: ``perf/gpu_busy_pct`` per epoch (the mean
    of its steps' readings) and over the fit, and ``self.result`` for train.json:
    ``{mean_pct, median_pct, samples, device, reason}`` (``reason`` set when no figure).

    The window opens at each training batch and closes at validation and at the epoch's
    end: the figure is how busy the training steps kept the GPU. Each rank samples its own
    GPU; rank 0 logs. Costs the loop nothing: the reads run on their own thread, and no
    tensor is read back.
    """

    def __init__(self, period_s: float = TRAIN_PERIOD_S) -> None:
        self.period_s = period_s
        self.sampler: NvmlSampler | None = None
        self.result: dict[str, Any] = unavailable("not run")
        self.epochs: list[dict[str, Any]] = []
        self._epoch_from = 0

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.epochs, self.sampler = [], None
        device = pl_module.device
        if device.type != "cuda":
            self.result = unavailable(NO_CUDA)
            return
        try:
            self.sampler = NvmlSampler(self.period_s, device)
        except Exception as err:  # no NVML here: the fit goes on, the record says why
            self.result = unavailable(f"NVML unavailable: {err}")
            log.info("GPU busy: not measured (%s)", self.result["reason"])
            return
        self.result = unavailable("no training step ran") | {"device": self.sampler.name}

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.sampler is not None:
            self._epoch_from = len(self.sampler.samples)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.sampler is not None and not self.sampler.active:
            self.sampler.window(True)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.sampler is not None:
            self.sampler.window(False)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.sampler is None:
            return
        self.sampler.window(False)
        epoch = busy_figures(self.sampler.samples[self._epoch_from :])
        if epoch["mean_pct"] is None:
            return
        self.epochs.append({"epoch": trainer.current_epoch, **epoch})
        pl_module.log("perf/gpu_busy_pct", epoch["mean_pct"], on_epoch=True, rank_zero_only=True)

    def figures(self) -> dict[str, Any]:
        """The fit's figure so far: ``self.result``'s keys (the input-bound verdict reads
        it at the end of training, whichever callback ends first)."""
        if self.sampler is None:
            return dict(self.result)
        figures = busy_figures(self.sampler.samples)
        if figures["mean_pct"] is None:
            return dict(self.result)
        return {
            "mean_pct": round(figures["mean_pct"], 1),
            "median_pct": round(figures["median_pct"], 1),
            "samples": figures["samples"],
            "device": self.sampler.name,
            "reason": None,
        }

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.sampler is not None:
            self.result = self.figures()
            self._close()
        if not trainer.is_global_zero:
            return
        pct = self.result["mean_pct"]
        if pct is None:
            self._tag(trainer, self.result["reason"])
            return
        log.info(
            "GPU busy %.0f%% of the training steps (%s, %d NVML samples)",
            pct,
            self.result["device"],
            self.result["samples"],
        )
        for logger in trainer.loggers:  # the fit's figure, after the epochs' own
            logger.log_metrics({"perf/gpu_busy_pct": pct}, step=trainer.global_step)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._close()  # a fit that raised: the thread still stops

    def _close(self) -> None:
        if self.sampler is not None:
            self.sampler.close()
            self.sampler = None

    @staticmethod
    def _tag(trainer: L.Trainer, reason: str) -> None:
        tag_run(trainer, {"perf.gpu_busy": reason})  # kept while the server is away


def meter_of(trainer: L.Trainer) -> GpuBusyMeter | None:
    """A trainer's ``GpuBusyMeter``, or None when it has none."""
    return next((c for c in trainer.callbacks if isinstance(c, GpuBusyMeter)), None)


def gpu_busy_of(trainer: L.Trainer) -> dict[str, Any] | None:
    """The ``GpuBusyMeter`` result of a trainer's fit; None when it had no such meter."""
    meter = meter_of(trainer)
    return None if meter is None else dict(meter.result)
