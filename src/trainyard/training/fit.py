"""The fit, as a recipe card: the data and the model, the MLflow run around the fit, the
trainer, fit, the outputs (``train``), for a job already resolved at the stage.

What wraps the plain fit lives beside it: the job resolved once before it, every rank
agreeing on the plan (``nodes.agree``), the MLflow run's life with resume and a fit that
finished while the server was away (``tracked_run.tracked_run``), signals and system
metrics (``TrackedRun.watching``)."""

from __future__ import annotations

import logging
import shutil
import time
import warnings
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint

from trainyard.core.card import Card
from trainyard.core.config import TrainParams
from trainyard.core.fit_history import HISTORY_FILE
from trainyard.core.handoffs import TrainRecord
from trainyard.core.io import atomic_file, sha256_file
from trainyard.model.classifier import Classifier, classifier_for
from trainyard.training.builder import LateEarlyStopping, build_trainer, time_limit_min
from trainyard.training.datamodule import ImageDataModule
from trainyard.training.device import Hardware
from trainyard.training.fit_log import EpochTimer
from trainyard.training.gpu_busy import GpuBusyMeter
from trainyard.training.history import History
from trainyard.training.job import RunExtras, TrainJob, Workspace
from trainyard.training.nodes import Agreement, ShareRun
from trainyard.training.perf import InputBoundMeter
from trainyard.training.recipe import Plan, few_steps_warning
from trainyard.training.refit import refit
from trainyard.training.resume import AtomicCheckpointIO, ResumeCallback
from trainyard.training.run_logger import GapEpoch
from trainyard.training.tracked_run import FitResult, TrackedRun, tracked_run

log = logging.getLogger(__name__)

# Lightning's advice for per-sample datasets, not for TensorBatches (already batched, no
# worker processes) nor for a batch hook that deliberately lives on the LightningModule.
warnings.filterwarnings("ignore", message=r".*`IterableDataset` has `__len__` defined.*")
warnings.filterwarnings("ignore", message=r".*overridden `on_after_batch_transfer`.*")

BEST_CKPT = "best.ckpt"
VAL_STEPS = 4  # validation batches: at most this many training batches (val_batch)


def train(team: Agreement, ws: Workspace, extras: RunExtras | None = None) -> TrainRecord | None:
    """Fit the job every rank agreed on (``nodes.agree``: planned, on this hardware and
    data); write ``best.ckpt`` and ``train.json`` (the MLflow run's id) in ``ws.out_dir``.
    ``extras``: what a caller above the stage adds (``trainyard tune``).

    Returns the record written, or None on a DDP rank other than 0 (which writes nothing).
    """
    extras = extras or RunExtras()
    job, plan, hw = team.job, team.plan, team.hw
    dm, model = team.nodes.together(lambda: data_and_model(job, ws.data_dir, ws.card, plan))
    # The MLflow run's life around the fit: opened or reopened (resume), closed when done.
    with tracked_run(team, ws, extras, model.pretrained_info) as tracked:
        limit = time_limit_min(job.train, plan.planned_epochs)
        result = tracked.finished or fit(
            job.train, ws.out_dir, hw, tracked, dm, model, limit, extras.callbacks
        )
        if result is None:
            return None  # another DDP rank: rank 0 writes the outputs
        if not tracked.finished and extras.refit:
            result = refit_shipped(team, ws, dm, tracked, result)
        tracked.complete(result)  # the server away past the wait: the state is kept, raises
        record = write_outputs(ws.out_dir, job.experiment, tracked, result, hw, ws.card)
    log.info("best val/acc %.4f; MLflow run %s at %s", result.best_score, record.run_id, ws.uri)
    return record


def refit_shipped(
    team: Agreement, ws: Workspace, dm: ImageDataModule, tracked: TrackedRun, result: FitResult
) -> FitResult:
    """``train.refit``: the model that ships fitted again on train + val for the epochs
    validation chose (``training.refit``), said in the run's ``refit`` tag (``complete``)."""
    job, plan = team.job, team.plan

    def make_model() -> Classifier:
        L.seed_everything(job.seed, workers=True, verbose=False)
        return classifier_for(job.train, ws.card, job.seed, plan.finetune, plan.frozen_stages)

    folder = tracked.resume.folder
    return refit(job.train, team.hw, dm, make_model, folder, result, plan.finetune)


def fit(
    tp: TrainParams,
    out_dir: Path,
    hw: Hardware,
    tracked: TrackedRun,
    dm: ImageDataModule,
    model: Classifier,
    limit_min: float | None,
    callbacks: tuple[L.Callback, ...] = (),
) -> FitResult | None:
    """The fit (from the last checkpoint when resuming) with system metrics; its result on
    rank 0, None on the other ranks. ``limit_min``: a hard stop (``time_limit_min``);
    ``callbacks``: a caller's own (``RunExtras.callbacks``).

    A SIGTERM/SIGINT ends the run KILLED, keeps the checkpoint and exits 143/130.
    """
    n_train = dm.card.counts["train"]["total"]
    trainer, checkpoint, meter = build_fit(tp, out_dir, hw, tracked, n_train, limit_min, callbacks)
    t0 = time.perf_counter()
    with tracked.watching(trainer):
        trainer.fit(model, datamodule=dm, ckpt_path=tracked.resume.ckpt_path)
    fit_s = time.perf_counter() - t0
    if trainer.global_rank != 0:
        return None
    history = out_dir / HISTORY_FILE
    return FitResult.of(trainer, checkpoint, meter.result, fit_s, dm.placement, history)


def data_and_model(
    job: TrainJob, data_dir: Path, card: Card, recipe: Plan
) -> tuple[ImageDataModule, Classifier]:
    """The data module and the classifier of ``job`` (planned by ``recipe``), seeded."""
    # After the plan: its timing probe draws random numbers, the fit must not see them.
    L.seed_everything(job.seed, workers=True, verbose=False)
    dm = load_data(job, data_dir, card)
    tp = job.train
    # Epochs the recipe planned are the budget's (its own line says so); epochs set by hand
    # that leave a run of a few steps get the keys to change.
    n_train = card.counts["train"]["total"]
    if not recipe.planned_epochs and (
        warning := few_steps_warning(n_train, tp.batch_size, tp.max_epochs)
    ):
        log.warning(warning)
    return dm, classifier_for(tp, card, job.seed, recipe.finetune, recipe.frozen_stages)


def val_batch(eval_batch_size: int, batch_size: int) -> int:
    """Validation's batch: ``evaluate.batch_size`` (1,024), at most ``VAL_STEPS`` training
    batches. A Lite0 val pass of 1,024 images at 160 px peaked at 10.9 GB on a CPU (about
    twice that at 224 px: a fit was killed for memory); a training batch is sized for the
    model and a no-grad pass of four of them holds less than a training step."""
    return max(1, min(eval_batch_size, VAL_STEPS * batch_size))


def load_data(job: TrainJob, data_dir: Path, card: Card) -> ImageDataModule:
    """The prepared splits (described by ``card``) as a data module; says what they hold."""
    tp = job.train
    dm = ImageDataModule(
        data_dir,
        card=card,
        batch_size=tp.batch_size,
        eval_batch_size=val_batch(job.eval_batch_size, tp.batch_size),
        seed=job.seed,
        data_path=tp.data_path,
        device_resident=tp.device_resident,
        memory_budget=tp.memory_budget,
    )
    log.info("data: %s, arch %s", card.summary(), tp.arch)
    return dm


def checkpoint_callbacks(
    tp: TrainParams, tracked: TrackedRun
) -> tuple[ModelCheckpoint, list[L.Callback]]:
    """The best checkpoint's callback, and those that keep a resumable last checkpoint."""
    # Best and last checkpoints live in the resume folder (outside DVC's outs; emptied by a
    # fresh start, so no stale files and no -v1 names); last.ckpt is what a rerun resumes.
    ckpt_dir = tracked.resume.folder
    checkpoint = ModelCheckpoint(
        dirpath=ckpt_dir,
        filename="best",
        monitor="val/acc",
        mode="max",
        save_top_k=1,
        save_last=True,
        enable_version_counter=False,
    )
    resume_callbacks: list[L.Callback] = [ResumeCallback(tracked.resume, tracked.run_id)]
    if tp.checkpoint_every_min > 0:  # long epochs: last.ckpt also every N minutes
        resume_callbacks.append(
            ModelCheckpoint(
                dirpath=ckpt_dir,
                save_top_k=0,
                save_last=True,
                train_time_interval=timedelta(minutes=tp.checkpoint_every_min),
                enable_version_counter=False,
            )
        )
    return checkpoint, resume_callbacks


def build_fit(
    tp: TrainParams,
    out_dir: Path,
    hw: Hardware,
    tracked: TrackedRun,
    train_images: int,
    limit_min: float | None,
    extra_callbacks: tuple[L.Callback, ...] = (),
) -> tuple[L.Trainer, ModelCheckpoint, InputBoundMeter]:
    """The trainer with trainyard's callbacks: checkpoints, early stopping, timing, meter,
    the per-epoch history; ``limit_min``: a hard stop after that many minutes. Returned
    with the callbacks whose results become the stage's outputs."""
    checkpoint, resume_callbacks = checkpoint_callbacks(tp, tracked)
    early = LateEarlyStopping(monitor="val/acc", mode="max", patience=tp.early_stopping_patience)
    # Data wait / host->device copy / compute per step; the input-bound verdict at the end
    # (the data path and placement it names: the trainer's datamodule's).
    meter = InputBoundMeter()
    trainer = build_trainer(
        accelerator=hw.accelerator,
        devices=tp.devices,
        num_nodes=tp.num_nodes,
        precision=hw.precision,
        logger=tracked.logger,
        callbacks=[
            ShareRun(tracked),  # first: the others' setup may need the run's id
            checkpoint,
            early,
            LearningRateMonitor("step"),
            EpochTimer(),
            GapEpoch(),  # the epoch a tracking-server gap opens at, for its line
            GpuBusyMeter(),  # NVML utilisation over the training steps
            History(out_dir / HISTORY_FILE),
            meter,
            *resume_callbacks,
            *extra_callbacks,
        ],
        root=out_dir,
        verbose=True,
        max_epochs=tp.max_epochs,
        # Early stopping judges only the second half (LateEarlyStopping): OneCycle's high-lr
        # first half often plateaus (on a small photo folder for 5+ epochs) before
        # annealing lifts val/acc, and patience alone stopped such runs at chance accuracy.
        min_epochs=-(-tp.max_epochs // 2),
        plugins=[AtomicCheckpointIO()],  # tmp + rename: a kill never leaves half a checkpoint
        deterministic=tp.deterministic,
        # per-step loss at least ~5 times an epoch, even on the small slices tests use
        log_every_n_steps=max(1, min(10, -(-train_images // tp.batch_size) // 5)),
        limit_train_batches=tp.limit_train_batches,
        max_time=None if limit_min is None else timedelta(minutes=limit_min),
    )
    return trainer, checkpoint, meter


def write_outputs(
    out_dir: Path,
    experiment: str,
    tracked: TrackedRun,
    result: FitResult,
    hw: Hardware,
    card: Card,
) -> TrainRecord:
    """``out_dir/best.ckpt`` (the run's ``checkpoints/best.ckpt``) and the record
    ``out_dir/train.json``."""
    logger = tracked.logger
    best_dest = out_dir / BEST_CKPT
    with atomic_file(best_dest) as tmp:
        shutil.copyfile(tracked.resume.folder / result.best_ckpt, tmp)
    record = TrainRecord(
        run_id=logger.run_id,
        experiment_id=logger.experiment_id,
        experiment=experiment,
        best_val_acc=round(result.best_score, 6),
        # the val-chosen epoch; a refitted checkpoint's own is the refit's last
        best_epoch=int((result.refit or {}).get("best_epoch", _ckpt_epoch(best_dest))),
        epochs_run=result.epochs_run,
        device=hw.device,
        precision=hw.precision,
        checkpoint=BEST_CKPT,
        checkpoint_sha256=sha256_file(best_dest),
        data_sha256=card.data_sha256,
        data_version=tracked.dvc_md5 or card.data_sha256,
        data_placement=result.data_placement,
        fit_time_s=round(result.fit_s, 2),
        # perf.py: level, data_wait_fraction, why, fix, ms per step (also MLflow tag perf.verdict)
        input_bound=result.input_bound,
        gpu_busy=result.gpu_busy,  # train.gpu_busy: mean %, or None and why
        stopped_by=result.stopped_by,
        refit=result.refit,
    )
    record.write(TrainRecord.path_in(out_dir))
    return record


def _ckpt_epoch(path: Path) -> int:
    return int(torch.load(path, map_location="cpu", weights_only=True).get("epoch", -1))
