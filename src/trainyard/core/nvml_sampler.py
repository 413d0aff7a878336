"""GPU utilisation, as NVML reads it, sampled on a thread (no torch: bulk scoring reads it).

NVML's "GPU utilisation" is the share of its last sample period (1/6 s to 1 s, by GPU) in
which any kernel ran: a GPU waiting on the host between steps (Python launch overhead, a
host read-back, a small batch) reads low even when no data wait shows. ``NvmlSampler``
reads it every ``period`` seconds while its window is open. Training's meter
(``trainyard.training.gpu_busy``), ``trainyard predict`` and the benchmarks all use it.

Where NVML cannot read utilisation (no nvidia-ml-py, no driver, a MIG slice, which has no
utilisation counter), the figure is None with the reason (``unavailable``).
"""

from __future__ import annotations

import contextlib
import statistics
import threading
from typing import Any

# GPU busy below this % with the data keeping up: "GPU underfed" (training and predict).
UNDERFED_PCT = 60.0


class NvmlSampler:
    """GPU utilisation (%) of NVML's GPU ``index``, read every ``period`` s while ``active``.

    ``samples``: the readings so far (a caller may replace the list between windows).
    Raises at construction where NVML cannot read utilisation (no nvidia-ml-py, no driver,
    a MIG slice): the caller reports the reason instead of a figure.
    """

    def __init__(self, period: float = 0.02, index: int = 0) -> None:
        # Imported here, where a GPU is sampled: 60 ms of every CPU run's start-up otherwise
        # (a 28 px `trainyard predict` is done in a few seconds).
        try:  # nvidia-ml-py: a dependency, but a bare GPU image may lack it; the reason says so
            import pynvml
        except ImportError:  # pragma: no cover - installed with trainyard
            raise RuntimeError("nvidia-ml-py is not installed") from None
        self._nvml = pynvml
        pynvml.nvmlInit()
        try:
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(self._handle)
            self.name = name.decode() if isinstance(name, bytes) else str(name)
            pynvml.nvmlDeviceGetUtilizationRates(self._handle)  # MIG: NotSupported, now
        except Exception:
            pynvml.nvmlShutdown()
            raise
        self.period, self.active = period, False
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.active:
                # A transient NVML error: one reading fewer, not a dead thread.
                with contextlib.suppress(Exception):
                    rates = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
                    self.samples.append(int(rates.gpu))
            self._stop.wait(self.period)

    def window(self, on: bool) -> None:
        """Sample while ``on``."""
        self.active = on

    def close(self) -> dict[str, Any]:
        """Stop sampling: the number of samples, their mean and median %."""
        self._stop.set()
        self._thread.join()
        self._nvml.nvmlShutdown()
        return busy_figures(self.samples)


def busy_figures(samples: list[int]) -> dict[str, Any]:
    """``{samples, mean_pct, median_pct}`` of utilisation readings (None where none)."""
    return {
        "samples": len(samples),
        "mean_pct": statistics.fmean(samples) if samples else None,
        "median_pct": statistics.median(samples) if samples else None,
    }


def unavailable(reason: str) -> dict[str, Any]:
    """The figure where there is none, and why (train.json's ``gpu_busy``)."""
    return {"mean_pct": None, "median_pct": None, "samples": 0, "device": None, "reason": reason}
