"""The one clock every benchmark uses: wall time with the device synchronised at both ends.

CUDA kernels run asynchronously to the Python that queues them, so a timer that does not
synchronise measures how fast work is *queued*, not done. On the CPU ``sync`` is free.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import lightning as L


def sync(device: str) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


class Timer:
    """Seconds between ``start()`` and ``stop()``, synchronised; ``seconds`` accumulates
    over several windows (e.g. the training part of each epoch)."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self.seconds = 0.0
        self._t0: float | None = None

    def start(self) -> None:
        """Open a window (after the device's queued work)."""
        sync(self.device)
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        """Close the window: its seconds, also added to ``seconds``."""
        if self._t0 is None:
            raise RuntimeError("Timer.stop() before start()")
        sync(self.device)
        dt = time.perf_counter() - self._t0
        self.seconds += dt
        self._t0 = None
        return dt

    @property
    def running(self) -> bool:
        """Whether a window is open."""
        return self._t0 is not None

    def __enter__(self) -> Timer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class StepWindow(L.Callback):
    """Times training steps ``[warmup, warmup + steps)`` of a Lightning fit.

    ``img_per_s`` afterwards; ``on_window(True/False)`` is called as the window opens and
    closes (e.g. to sample GPU utilisation only while it is open).
    """

    def __init__(
        self,
        device: str,
        warmup: int,
        steps: int,
        batch_size: int,
        on_window: Callable[[bool], None] | None = None,
    ) -> None:
        self.timer = Timer(device)
        self.warmup, self.steps, self.batch_size = warmup, steps, batch_size
        self.on_window = on_window

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self.warmup:
            self.timer.start()
            if self.on_window:
                self.on_window(True)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self.warmup + self.steps and self.timer.running:
            self.timer.stop()
            if self.on_window:
                self.on_window(False)

    @property
    def img_per_s(self) -> float:
        """Images per second over the timed steps; raises if the window never closed."""
        if self.timer.running or self.timer.seconds == 0:
            raise RuntimeError("the timed window did not complete: too few steps in the fit")
        return self.steps * self.batch_size / self.timer.seconds


def median_call_s(
    fn: Callable[[], Any],
    budget_s: float,
    min_calls: int = 5,
    max_calls: int = 2000,
    device: str = "cpu",
) -> float:
    """Median seconds per call of ``fn``, after 3 warm-up calls: at least ``min_calls``,
    then until ``budget_s`` has passed or ``max_calls`` were made."""
    for _ in range(3):
        fn()
    sync(device)
    times: list[float] = []
    start = time.perf_counter()
    timer = Timer(device)
    while len(times) < max_calls and (
        len(times) < min_calls or time.perf_counter() - start < budget_s
    ):
        timer.start()
        fn()
        times.append(timer.stop())
    return statistics.median(times)


def window_trainer(
    device: str,
    steps: int,
    callbacks: list[L.Callback],
    precision: str | None = None,
) -> L.Trainer:
    """A trainer that runs ``steps`` training steps and nothing else (no validation, no
    sanity check): what each timed row fits, its ``StepWindow`` among ``callbacks``."""
    from trainyard.training.builder import build_trainer

    extra: dict[str, Any] = {} if precision is None else {"precision": precision}
    return build_trainer(
        accelerator=device,
        max_steps=steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        **extra,
    )
