"""The training loop makes no host synchronisation per step (issue 25).

On a GPU, reading a value back (``loss.item()``, ``float(t)``, ``bool(t)``, a Python branch
on a tensor) makes the host wait for every kernel queued so far: the GPU then idles while
Python launches the next step. The H200 measured trainyard's loop at 0.46x a plain loop at
batch 256 with such syncs. A CPU has no queue, but the same read-backs go through the same
aten ops (``_local_scalar_dense``, ``is_nonzero``, ``equal``), so counting those ops during
the training steps of a real trainyard fit, on the CPU, finds every one the GPU would wait
on. The count over an epoch must not grow with the epoch's steps: rare, bounded reads (the
progress line every 30 s, epoch end) are allowed, one per step or per log interval is not.
"""

from __future__ import annotations

import csv
import math
import traceback
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils._python_dispatch import TorchDispatchMode

from trainyard.core.card import Card
from trainyard.model.augment import augment_batch, normalize_on_device
from trainyard.model.classifier import Classifier
from trainyard.training import builder
from trainyard.training.builder import build_trainer
from trainyard.training.datamodule import ImageDataModule, TensorBatches, epoch_order
from trainyard.training.fit_log import EpochTimer, ProgressLog
from trainyard.training.gpu_busy import GpuBusyMeter
from trainyard.training.history import History
from trainyard.training.perf import InputBoundMeter

from conftest import make_card

aten = torch.ops.aten
# What .item(), float(t), int(t), bool(t), `if t:` and torch.equal dispatch to: each one
# copies a value to the host, which on a GPU waits for the queue to drain.
SYNC_OPS = {aten._local_scalar_dense, aten.is_nonzero, aten.equal}
# Reads of tensors that live on the host on every device, so wait for nothing on a GPU:
# AdamW's step counts (torch keeps them on the CPU unless capturable or fused) and the
# DataLoader's seed, drawn from a CPU generator when its iterator starts.
HOST_SIDE = ("/torch/optim/", "/torch/utils/data/dataloader.py")
BATCH = 8
LOG_EVERY = 3  # several log intervals per epoch: a per-interval read shows up


class HostSyncs(TorchDispatchMode):
    """Counts the ops that read a tensor's value back to the host, and where they came from."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.where: Counter[str] = Counter()
        self.host_side = 0  # reads of host-side tensors (HOST_SIDE), not counted

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket in SYNC_OPS:
            stack = traceback.extract_stack()[:-1]
            if any(part in f.filename for f in stack for part in HOST_SIDE):
                self.host_side += 1
            else:
                self.count += 1
                self.where[_caller(stack)] += 1
        return func(*args, **(kwargs or {}))


def _caller(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frame outside torch and this file: who asked for the value."""
    for frame in reversed(stack):
        if "/torch/" not in frame.filename and not frame.filename.endswith("test_host_syncs.py"):
            return f"{Path(frame.filename).name}:{frame.lineno} {frame.name}"
    return "?"


class CountSyncs(L.Callback):
    """Counts host syncs over each epoch's training steps: from the epoch's start (first in
    the callback list, so the other callbacks' epoch-start hooks count too) to the start of
    its validation, which covers every step, every batch fetch and Lightning's logging
    between steps. Epoch end and validation are outside: once an epoch is allowed."""

    def __init__(self) -> None:
        self.epochs: list[HostSyncs] = []
        self._mode: HostSyncs | None = None

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._mode = HostSyncs()
        self._mode.__enter__()

    def _stop(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self.epochs.append(self._mode)
            self._mode = None

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stop()

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stop()


def _card() -> Card:
    return make_card(4, (1, 16, 16), 0.3, 0.35, source="test")


def _arrays(n_train: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)

    def split(n: int) -> tuple[np.ndarray, np.ndarray]:
        return rng.integers(0, 256, (n, 1, 16, 16), dtype=np.uint8), rng.integers(0, 4, n)

    return {"train": split(n_train), "val": split(16), "test": split(16)}


def fit_and_count(tmp_path: Path, steps: int, epochs: int = 2) -> list[HostSyncs]:
    """A real trainyard fit (build_trainer, its callbacks, a logger) of ``steps`` steps an
    epoch; the host syncs of each epoch's training steps."""
    L.seed_everything(0, verbose=False)
    dm = ImageDataModule(
        arrays=_arrays(steps * BATCH), card=_card(), batch_size=BATCH, eval_batch_size=16
    )
    counter = CountSyncs()
    root = tmp_path / f"steps{steps}"
    trainer = build_trainer(
        callbacks=[
            counter,
            ModelCheckpoint(dirpath=root / "ckpt", monitor="val/acc", mode="max", save_last=True),
            EarlyStopping(monitor="val/acc", mode="max", patience=10),
            LearningRateMonitor("step"),
            EpochTimer(),
            History(root / "history.csv"),
            InputBoundMeter(verbose=False),
            GpuBusyMeter(),
        ],
        logger=CSVLogger(root),
        root=root,
        verbose=True,  # the pipeline's own: ProgressLog, or Lightning's bar on a terminal
        max_epochs=epochs,
        num_sanity_val_steps=0,
        log_every_n_steps=LOG_EVERY,
    )
    trainer.fit(Classifier(card=_card().contract(), arch="cnn", augment="flip"), datamodule=dm)
    assert len(counter.epochs) == epochs
    return counter.epochs


@pytest.mark.parametrize("bar", [False, True], ids=["log-lines", "progress-bar"])
def test_host_syncs_per_epoch_do_not_grow_with_its_steps(tmp_path, monkeypatch, bar):
    # The pipeline's run on a terminal draws Lightning's progress bar, which reads the
    # progress-bar metrics at every refresh; elsewhere ProgressLog writes lines.
    monkeypatch.setattr(builder, "_stderr_is_terminal", lambda: bar)
    # ProgressLog's line every 30 s reads the loss (one sync, by design): on a loaded machine
    # an epoch of the longer fit can pass 30 s and count it. Never within these fits.
    monkeypatch.setattr(builder, "ProgressLog", partial(ProgressLog, every_s=math.inf))
    short = fit_and_count(tmp_path, 12)
    long = fit_and_count(tmp_path, 24)
    report = {n: [dict(e.where) for e in epochs] for n, epochs in ((12, short), (24, long))}
    # Twice the steps, the same syncs: none is per step or per log interval.
    for a, b in zip(short, long, strict=True):
        assert a.count == b.count, report
    # And few at all: the epoch's first fetch may read a value or two, no more.
    assert all(e.count <= 2 for e in short + long), report
    # The per-step loss is still logged at every log interval (read back once an epoch).
    (metrics,) = (tmp_path / "steps12").rglob("metrics.csv")
    rows = list(csv.DictReader(metrics.open()))
    logged = [int(r["step"]) for r in rows if r.get("train/loss_step")]
    assert logged == [s for s in range(24) if (s + 1) % LOG_EVERY == 0]
    assert sum(bool(r.get("train/loss_epoch")) for r in rows) == 2


def test_the_counter_sees_a_per_step_read(tmp_path):
    """The check can fail: a callback reading the loss every step is counted every step."""

    class ReadsLoss(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            float(outputs["loss"])

    L.seed_everything(0, verbose=False)
    dm = ImageDataModule(arrays=_arrays(6 * BATCH), card=_card(), batch_size=BATCH)
    counter = CountSyncs()
    trainer = build_trainer(
        callbacks=[counter, ReadsLoss()],
        root=tmp_path,
        max_epochs=1,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        log_every_n_steps=LOG_EVERY,
    )
    trainer.fit(Classifier(card=_card().contract(), arch="cnn"), datamodule=dm)
    (epoch,) = counter.epochs
    assert epoch.count == 6, dict(epoch.where)  # one a step: the callback's, nothing else


@pytest.mark.parametrize("arch", ["cnn", "resnet"])
def test_the_classifier_compiles_into_one_graph(arch):
    """train.compile compiles the net (``configure_model``): one graph, no break (a break
    runs Python between two graphs every step, and can hide a read-back)."""
    model = Classifier(card=_card().contract(), arch=arch, compile=True)
    explained = torch._dynamo.explain(model.net)(torch.randn(8, 1, 16, 16))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


# ------------------------------------------------------------------ the data's device


class DeviceCopies(TorchDispatchMode):
    """Records every copy from the host to another device (``_to_copy``/``copy_``)."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (aten._to_copy, aten.copy_):
            src = args[1] if func.overloadpacket is aten.copy_ else args[0]
            dst = args[0] if func.overloadpacket is aten.copy_ else out
            if isinstance(src, torch.Tensor) and src.device.type == "cpu" != dst.device.type:
                self.copies.append((str(src.device), str(dst.device)))
        return out


def test_batches_of_device_data_are_gathered_on_the_device_with_one_copy_an_epoch():
    """A split on the GPU (here: the 'meta' device, which stands for any non-CPU device):
    every batch is gathered with an index already on that device. The epoch's order goes
    there once per epoch, not once per batch (a per-batch copy from pageable memory waits
    for the GPU)."""
    n, bs = 100, 8
    images = torch.empty(n, 1, 16, 16, dtype=torch.uint8, device="meta")
    labels = torch.empty(n, dtype=torch.int64, device="meta")
    ds = TensorBatches(images, labels, bs, shuffle=True, seed=3)
    for _epoch in range(2):
        with DeviceCopies() as copies:
            batches = list(ds)
        assert len(batches) == len(ds) == 13
        for x, y in batches:
            assert x.device.type == "meta" and y.device.type == "meta"
        assert copies.copies == [("cpu", "meta")], copies.copies


def test_the_epoch_order_is_the_same_on_every_device():
    """The order is drawn on the host (so the naive path, and a CPU run, see the same
    samples in the same order) and lands on the data's device."""
    on_meta = epoch_order(50, True, seed=5, epoch=2, device="meta")
    assert on_meta.device.type == "meta" and on_meta.shape == (50,)
    assert torch.equal(epoch_order(50, True, 5, 2), epoch_order(50, True, 5, 2, device="cpu"))


# ------------------------------------------------------------------ on a GPU


class CudaSyncsRaise(L.Callback):
    """CUDA's own detector over each epoch's training steps from ``from_epoch`` on: any op
    that makes the host wait for the GPU (``.item()``, a blocking copy, ``nonzero``...)
    raises there. (A compiled net's first epoch compiles and autotunes, which waits.)"""

    def __init__(self, from_epoch: int = 0) -> None:
        self.from_epoch = from_epoch

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch >= self.from_epoch:
            torch.cuda.set_sync_debug_mode("error")

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        torch.cuda.set_sync_debug_mode("default")

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        torch.cuda.set_sync_debug_mode("default")

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, err: Any) -> None:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
def test_device_batches_never_wait_for_the_gpu():
    images = torch.randint(0, 256, (4096, 1, 28, 28), dtype=torch.uint8, device="cuda")
    labels = torch.randint(0, 10, (4096,), device="cuda")
    ds = TensorBatches(images, labels, 256, shuffle=True)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _epoch in range(2):  # the epoch's order crosses pinned, without a wait
            batches = list(ds)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(batches) == 16 and batches[0][0].is_cuda


@pytest.mark.gpu
def test_normalising_with_the_cards_lists_never_waits_for_the_gpu():
    """A plain loop (the benchmark's, the recipe's probe) passes the card's mean and std as
    lists: made on the device, not copied from the host at every step."""
    images = torch.randint(0, 256, (64, 3, 28, 28), dtype=torch.uint8, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        x = augment_batch(normalize_on_device(images, [0.2, 0.3, 0.4], [0.3, 0.3, 0.3]))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert x.is_cuda and x.shape == images.shape


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("precision", "compile"), [("32-true", False), ("bf16-mixed", False), ("bf16-mixed", True)]
)
def test_no_training_step_waits_for_the_gpu(tmp_path, precision, compile):
    """The whole pipeline's loop on a GPU (data on the device, trainyard's callbacks, a
    logger, log intervals inside the epoch) under CUDA's sync detector."""
    steps = 40
    L.seed_everything(0, verbose=False)
    dm = ImageDataModule(
        arrays=_arrays(steps * 64), card=_card(), batch_size=64, eval_batch_size=16
    )
    trainer = build_trainer(
        accelerator="cuda",
        precision=precision,
        callbacks=[
            CudaSyncsRaise(from_epoch=1 if compile else 0),
            ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="val/acc", mode="max"),
            EarlyStopping(monitor="val/acc", mode="max", patience=10),
            LearningRateMonitor("step"),
            EpochTimer(),
            GpuBusyMeter(),
            History(tmp_path / "history.csv"),
            InputBoundMeter(verbose=False),
        ],
        logger=CSVLogger(tmp_path),
        root=tmp_path,
        verbose=True,
        max_epochs=2,
        num_sanity_val_steps=0,
        log_every_n_steps=LOG_EVERY,
    )
    model = Classifier(
        card=_card().contract(), arch="cnn", augment="flip", channels_last=True, compile=compile
    )
    trainer.fit(model, datamodule=dm)
    assert dm.placement == "device" and trainer.global_step == 2 * steps
    history = (Path(trainer.logger.log_dir) / "metrics.csv").read_text()
    assert "train/loss_step" in history and "train/loss_epoch" in history
