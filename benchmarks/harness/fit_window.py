"""The timed window of a Lightning fit: training steps ``[warmup, warmup + steps)`` on the
harness clock, and a trainer that runs those steps and nothing else. Imports lightning:
only the training benchmarks use it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import lightning as L

from benchmarks.harness.stopwatch import Timer


class Steps(NamedTuple):
    """A timed training row's shape: ``steps`` timed steps of ``batch_size`` images on
    ``device``, after ``warmup`` untimed ones."""

    device: str
    batch_size: int
    steps: int
    warmup: int


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
