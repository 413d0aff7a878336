"""Is training input-bound? Each step split into data wait, host->device copy and compute.

``InputBoundMeter`` (a Lightning callback) has four marks put on every training step, by the
fit's one per-batch clock (``clock.BatchClock``, which marks its ``StepClock``) and by the
meter's wrap of the batch's copy:

* the end of the previous step (``on_train_batch_end``, or the epoch start),
* just before and just after ``transfer_batch_to_device`` (the host->device copy),
* the end of this step (``on_train_batch_end``: forward, backward, optimizer done).

``data wait`` is previous end -> copy start (fetching the batch: ``__getitem__``, decode,
collate, gather), ``h2d`` is the copy, ``compute`` is copy end -> step end (on-device
normalise/augment, forward, backward, optimizer). On a GPU the marks are CUDA events
recorded on the current stream, never synchronised in the loop: they are resolved once
per epoch, so measuring does not serialise the GPU, and the gaps are GPU time (a wait
the GPU never sees, because the host fetched while the GPU was still busy, counts 0).
On a CPU they are ``time.perf_counter()`` readings.

The first few steps of the fit (warm-up: allocator, cudnn autotuning, worker start-up)
are left out of the verdict. Per epoch the meter logs ``perf/data_wait_fraction``,
``perf/data_wait_ms``, ``perf/h2d_ms``, ``perf/compute_ms`` and ``perf/step_ms`` (means
per step); at the end of training it gives one verdict (``perf_verdict.verdict``: input-bound,
moderately, not, or GPU underfed, and the fix in trainyard's own knobs).
"""

from __future__ import annotations

import functools
import logging
import math
import time
from dataclasses import dataclass, replace
from typing import Any

import lightning as L
import torch

from trainyard.training.clock import BatchClock
from trainyard.training.gpu_busy import meter_of
from trainyard.training.perf_verdict import verdict
from trainyard.training.run_logger import tag_run

log = logging.getLogger(__name__)

WARMUP_STEPS = 3  # first steps of the fit left out of the verdict


@dataclass
class StepTotals:
    """Summed milliseconds of some steps."""

    steps: int = 0
    wait_ms: float = 0.0
    h2d_ms: float = 0.0
    compute_ms: float = 0.0

    def add(self, wait: float, h2d: float, compute: float) -> None:
        """Count one step of these milliseconds."""
        self.steps += 1
        self.wait_ms += wait
        self.h2d_ms += h2d
        self.compute_ms += compute

    def merge(self, other: StepTotals) -> None:
        """Add ``other``'s steps to these."""
        self.steps += other.steps
        self.wait_ms += other.wait_ms
        self.h2d_ms += other.h2d_ms
        self.compute_ms += other.compute_ms

    @property
    def step_ms(self) -> float:
        """Summed milliseconds of the whole steps: wait + copy + compute."""
        return self.wait_ms + self.h2d_ms + self.compute_ms

    def fraction(self, part: float) -> float:
        """``part`` (milliseconds) as a fraction of the summed step time."""
        return part / self.step_ms if self.step_ms > 0 else 0.0

    def since(self, before: StepTotals) -> StepTotals:
        """The steps added after ``before`` (an earlier copy of these totals)."""
        return StepTotals(
            self.steps - before.steps,
            self.wait_ms - before.wait_ms,
            self.h2d_ms - before.h2d_ms,
            self.compute_ms - before.compute_ms,
        )

    def means(self) -> dict[str, float]:
        """The data-wait fraction and the mean milliseconds per step of each part."""
        n = max(self.steps, 1)
        return {
            "data_wait_fraction": self.fraction(self.wait_ms),
            "data_wait_ms": self.wait_ms / n,
            "h2d_ms": self.h2d_ms / n,
            "compute_ms": self.compute_ms / n,
            "step_ms": self.step_ms / n,
        }


class StepClock:
    """Four marks per training step, turned into data wait / h2d / compute milliseconds.

    On a GPU the marks are CUDA events on the current stream, resolved in bulk (one wait at
    the epoch's end, or every 4096 steps), never in the loop; on a CPU, perf_counter
    readings. The first ``warmup_steps`` steps of the fit are summed in ``warmup``, apart
    from the ``measured`` rest.
    """

    def __init__(self, cuda: bool = False, warmup_steps: int = WARMUP_STEPS) -> None:
        self.cuda, self.warmup_steps = cuda, warmup_steps
        self.measured, self.warmup = StepTotals(), StepTotals()
        self._pending: list[tuple[Any, Any, Any, Any]] = []
        self._prev_end: Any = None
        self._t0: Any = None
        self._t1: Any = None
        self._seen = 0
        self._warmup_n = warmup_steps

    def mark(self) -> Any:
        """A point in time: a recorded CUDA event, or a perf_counter reading."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()  # on the current stream: ordered with the copy and the kernels
            return event
        return time.perf_counter()

    def gap(self, a: Any, b: Any) -> float:
        """Milliseconds from mark ``a`` to mark ``b`` (both resolved)."""
        if self.cuda:
            return float(a.elapsed_time(b))
        return (b - a) * 1000.0

    def epoch_start(self, batches: Any) -> None:
        """A train epoch of ``batches`` steps begins: its first wait counts from now."""
        if self._seen == 0:
            # Warm-up: at most half the first epoch, so short runs keep measured steps.
            n = batches
            if isinstance(n, (int, float)) and math.isfinite(n) and n > 0:
                self._warmup_n = min(self.warmup_steps, int(n) // 2)
        self._pending = []
        self._prev_end = self.mark()
        self._t0 = self._t1 = None

    def copy_start(self) -> None:
        """The host->device copy of the step's batch begins."""
        self._t0 = self.mark()

    def copy_end(self) -> None:
        """The copy is issued (on a GPU: recorded after it on the stream)."""
        self._t1 = self.mark()

    def step_start(self) -> None:
        """A step begins; without a timed copy (e.g. a dataloader_iter step) it has none."""
        if self._t0 is None:
            self._t0 = self._t1 = self.mark()

    def step_end(self) -> None:
        """A step ends (forward, backward, optimizer done); the next wait counts from now."""
        end = self.mark()
        if self._prev_end is not None and self._t0 is not None:
            self._pending.append((self._prev_end, self._t0, self._t1, end))
        self._prev_end, self._t0, self._t1 = end, None, None
        if self.cuda and len(self._pending) > 4096:
            self.resolve(keep=256)  # bounded memory on long epochs; the old events are done

    def restart_wait(self) -> None:
        """Time outside the step (validation) is not data wait: the next counts from now."""
        self._prev_end = self.mark()

    def resolve(self, keep: int = 0) -> StepTotals:
        """Turn pending marks into milliseconds (one wait on a CUDA event, not per step);
        returns the measured (not warm-up) ones among them."""
        done, self._pending = (
            (self._pending[:-keep], self._pending[-keep:]) if keep else (self._pending, [])
        )
        epoch = StepTotals()
        if not done:
            return epoch
        if self.cuda:
            done[-1][3].synchronize()
        for prev_end, t0, t1, end in done:
            wait, h2d, compute = self.gap(prev_end, t0), self.gap(t0, t1), self.gap(t1, end)
            target = self.warmup if self._seen < self._warmup_n else self.measured
            self._seen += 1
            target.add(max(wait, 0.0), max(h2d, 0.0), max(compute, 0.0))
            if target is self.measured:
                epoch.add(max(wait, 0.0), max(h2d, 0.0), max(compute, 0.0))
        return epoch

    def epoch_end(self) -> StepTotals:
        """The epoch's measured steps (its warm-up ones when it had no other), resolved."""
        warm_before, before = replace(self.warmup), replace(self.measured)
        self.resolve()
        epoch = self.measured.since(before)
        if epoch.steps == 0:  # all warm-up (a very short epoch): report those, not nothing
            epoch = self.warmup.since(warm_before)
        return epoch

    def totals(self) -> tuple[StepTotals, bool]:
        """(the measured steps, False), or (the warm-up ones, True) when none was measured."""
        if self.measured.steps == 0:
            return self.warmup, True
        return self.measured, False


class InputBoundMeter(L.Callback):
    """Per-step data wait / host->device copy / compute; per-epoch ``perf/*`` metrics; one
    verdict at the end of training (``self.result``), printed, and set as the MLflow tags
    ``perf.verdict`` and ``perf.fix`` when the trainer logs to MLflow. Only rank 0 logs,
    prints and tags. The timing itself is a ``StepClock`` (``self.clock``), marked by the
    fit's ``BatchClock`` at the step's hooks and by this meter around the batch's copy.

    ``data_path`` / ``device_resident``: trainyard's settings, for the fix; by default
    read from the trainer's datamodule (None for a plain DataLoader: a custom loader).
    """

    def __init__(
        self,
        data_path: str | None = None,
        device_resident: bool | None = None,
        warmup_steps: int = WARMUP_STEPS,
        verbose: bool = True,
    ) -> None:
        self.data_path, self.device_resident = data_path, device_resident
        self.warmup_steps, self.verbose = warmup_steps, verbose
        self.result: dict[str, Any] | None = None
        self.epochs: list[dict[str, float]] = []
        self.clock = StepClock(warmup_steps=warmup_steps)
        self._wrapped: list[Any] = []

    def _wrap_transfer(self, trainer: L.Trainer, owner: Any) -> None:
        original = owner.transfer_batch_to_device

        # functools.wraps: Lightning's is_overridden still sees the original method.
        @functools.wraps(original)
        def timed_transfer(*args: Any, **kwargs: Any) -> Any:
            if not trainer.training or trainer.sanity_checking:
                return original(*args, **kwargs)
            self.clock.copy_start()
            out = original(*args, **kwargs)
            self.clock.copy_end()
            return out

        owner.transfer_batch_to_device = timed_transfer
        self._wrapped.append(owner)

    # ------------------------------------------------------------------ hooks

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.clock = StepClock(pl_module.device.type == "cuda", self.warmup_steps)
        BatchClock.of(trainer).split = self.clock  # the fit's clock marks the steps
        self.result, self.epochs, self._wrapped = None, [], []
        owners = [pl_module]
        if trainer.datamodule is not None:
            owners.append(trainer.datamodule)
        for owner in owners:
            self._wrap_transfer(trainer, owner)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        for owner in self._wrapped:
            if "transfer_batch_to_device" in vars(owner):
                delattr(owner, "transfer_batch_to_device")
        self._wrapped = []
        clock = BatchClock.of(trainer)
        if clock.split is self.clock:
            clock.split = None

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        epoch = self.clock.epoch_end()
        if epoch.steps == 0:
            return
        means = epoch.means()
        self.epochs.append({"epoch": trainer.current_epoch, "steps": epoch.steps, **means})
        for key, value in means.items():
            pl_module.log(f"perf/{key}", value, on_epoch=True, rank_zero_only=True)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.clock.resolve()  # steps of an epoch cut short
        self.result = self.summary(trainer, pl_module)
        if not trainer.is_global_zero or self.result is None:
            return
        r = self.result
        if self.verbose:
            log.info("input-bound verdict: %s: %s; fix: %s", r["level"], r["why"], r["fix"])
        self._tag(trainer, r)

    # ------------------------------------------------------------------ verdict

    def summary(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any] | None:
        """The verdict over the measured steps (the warm-up ones only when nothing else)."""
        totals, warmup_only = self.clock.totals()
        if totals.steps == 0:
            return None
        dm = trainer.datamodule
        data_path = self.data_path or getattr(dm, "data_path", None)
        resident = self.device_resident
        if resident is None:
            resident = getattr(dm, "device_resident", None)
        placement = getattr(dm, "placement", None)
        workers = getattr(trainer.train_dataloader, "num_workers", None)
        device = pl_module.device.type
        means = totals.means()
        busy = meter_of(trainer)
        result = verdict(
            means["data_wait_fraction"],
            h2d_fraction=totals.fraction(totals.h2d_ms),
            data_path=data_path,
            device=device,
            placement=placement,
            device_resident=resident,
            workers=workers,
            step_ms=means["step_ms"],
            steps=totals.steps,
            gpu_busy_pct=None if busy is None else busy.figures()["mean_pct"],
            precision=str(trainer.precision),
        )
        result.update(
            data_wait_ms=round(means["data_wait_ms"], 3),
            h2d_ms=round(means["h2d_ms"], 3),
            compute_ms=round(means["compute_ms"], 3),
            step_ms=round(means["step_ms"], 3),
            steps=totals.steps,
            warmup_steps_excluded=0 if warmup_only else self.clock.warmup.steps,
            timer="cuda events" if self.clock.cuda else "perf_counter",
            data_path=data_path,
            placement=placement,
            device=device,
        )
        return result

    @staticmethod
    def _tag(trainer: L.Trainer, result: dict[str, Any]) -> None:
        # through the run's gap: kept, not lost, while the tracking server is away
        tags = {"perf.verdict": result["level"], "perf.fix": result["fix"]}
        tag_run(trainer, tags | {"perf.why": result["why"]})
