"""Train stage: Lightning fit with checkpoints, early stopping, seeds and MLflow tracking."""

from __future__ import annotations

import logging
import os
import shutil
import time
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint

from trainyard.core.card import Card, load_card
from trainyard.core.config import MlflowParams, Params, TrainParams
from trainyard.core.handoffs import TrainRecord
from trainyard.core.io import atomic_file, sha256_file
from trainyard.model.classifier import Classifier, classifier_for
from trainyard.track.lineage import dvc_data_version, dvc_experiment_tags, run_tags
from trainyard.track.store import DVC_EXP_NAME, check_tracking_uri, resolve_tracking_uri
from trainyard.training.builder import build_trainer, time_limit_min
from trainyard.training.datamodule import ImageDataModule
from trainyard.training.device import resolve_device
from trainyard.training.fit_log import EpochTimer
from trainyard.training.gpu_busy import GpuBusyMeter
from trainyard.training.history import HISTORY_FILE, History
from trainyard.training.nodes import Nodes, ShareRun, join_nodes, what_trains
from trainyard.training.perf import InputBoundMeter
from trainyard.training.recipe import Plan, describe, few_steps_warning, load_plan, plan
from trainyard.training.resume import RESUME_ROOT, AtomicCheckpointIO, ResumeCallback, resume_key
from trainyard.training.run_logger import GapEpoch
from trainyard.training.tracked_run import RECIPE_FILE, FitResult, TrackedRun, join_run

log = logging.getLogger(__name__)

# Lightning's advice for per-sample datasets, not for TensorBatches (already batched, no
# worker processes) nor for a batch hook that deliberately lives on the LightningModule.
warnings.filterwarnings("ignore", message=r".*`IterableDataset` has `__len__` defined.*")
warnings.filterwarnings("ignore", message=r".*overridden `on_after_batch_transfer`.*")

BEST_CKPT = "best.ckpt"


@dataclass(frozen=True)
class Hardware:
    """Where and how the fit runs: Lightning's accelerator, the precision, the torch device."""

    accelerator: str
    precision: str
    device: str


@dataclass(frozen=True)
class RunExtras:
    """What a caller above the train stage adds to a fit: ``trainyard tune`` names a trial's
    run, tags it as a child of the study's run, and prunes it with Optuna's callback."""

    run_name: str | None = None
    tags: dict[str, str] = field(default_factory=dict)
    callbacks: tuple[L.Callback, ...] = ()


@dataclass
class FitSetup:
    """The trainer, and the callbacks whose results become the stage's outputs."""

    trainer: L.Trainer
    checkpoint: ModelCheckpoint
    meter: InputBoundMeter


def fit_and_track(
    params: Params,
    data_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    root: str | os.PathLike[str] = ".",
    params_file: str | os.PathLike[str] | None = None,
    extras: RunExtras | None = None,
) -> TrainRecord | None:
    """Fit the model; write ``out_dir/best.ckpt`` and ``out_dir/train.json`` (run id).

    Returns the record written, or None on a DDP rank other than 0 (which writes nothing).
    """
    out_dir = Path(out_dir)
    uri = resolve_tracking_uri(root)
    hw = resolve_hardware(params.train)
    # The launcher against train.num_nodes; across nodes the ranks join here, and rank 0
    # checks the store and plans for all (agree_on_plan).
    nodes = join_nodes(params.train, hw.accelerator)
    if not nodes.joined:
        check_tracking_uri(uri)  # before any work: a dead server fails in seconds
    card = load_card(data_dir)
    # From params as written (auto keys, not the plan): a rerun after a kill finds its run.
    key = resume_key(params, card.data_sha256, uri, out_dir)
    folder = Path(root) / RESUME_ROOT / key
    recipe = agree_on_plan(nodes, params, card, data_dir, hw, uri, folder)
    run_params = recipe.apply(params)  # every auto train key resolved
    dm, model = nodes.together(lambda: data_and_model(run_params, data_dir, card, recipe))
    extras = extras or RunExtras()

    def start(resume_mode: str | None = None) -> TrackedRun:
        dvc_md5 = dvc_data_version(root)
        tags = lineage_tags(root, card, model, hw, dvc_md5) | extras.tags
        name = extras.run_name or run_name(run_params, key)
        tracked = TrackedRun.open(run_params, key, root, uri, tags, name, dvc_md5, resume_mode)
        tracked.begin(recipe, dm, data_dir, params_file)
        return tracked

    tracked = join_run(nodes, start, folder, uri) if nodes.joined else start()
    # Finished while the server was away (TrackedRun.complete): nothing left to train.
    result = None if nodes.joined else tracked.finished_fit(out_dir)
    if result is None:
        setup = build_fit(
            run_params.train,
            hw,
            tracked,
            dm.card.counts["train"]["total"],
            out_dir,
            time_limit_min(params.train, recipe.planned_epochs),
            extras.callbacks,
        )
        fit_s = run_fit(setup, model, dm, tracked, params.mlflow)
        if setup.trainer.global_rank != 0:
            return None
        trainer, meter, history = setup.trainer, setup.meter, out_dir / HISTORY_FILE
        result = FitResult.of(trainer, setup.checkpoint, meter.result, fit_s, dm.placement, history)
    tracked.complete(result)  # the server away past the wait: the state is kept, raises
    record = write_outputs(run_params, out_dir, tracked, result, hw, dm)
    tracked.close()  # done: a forced rerun of the same params trains anew
    log.info(
        "best val/acc %.4f; MLflow run %s at %s",
        result.best_score,
        record.run_id,
        uri,
    )
    return record


def data_and_model(
    params: Params, data_dir: str | os.PathLike[str], card: Card, recipe: Plan
) -> tuple[ImageDataModule, Classifier]:
    """The data module and the classifier of ``params`` (resolved by ``recipe``), seeded."""
    # After the plan: its timing probe draws random numbers, the fit must not see them.
    L.seed_everything(params.seed, workers=True, verbose=False)
    dm = load_data(params, data_dir, card)
    tp = params.train
    # Epochs the recipe planned are the budget's (its own line says so); epochs set by hand
    # that leave a run of a few steps get the keys to change.
    n_train = dm.card.counts["train"]["total"]
    if not recipe.planned_epochs and (
        warning := few_steps_warning(n_train, tp.batch_size, tp.max_epochs)
    ):
        log.warning(warning)
    return dm, classifier_for(
        params.train, dm.card, params.seed, recipe.finetune, recipe.frozen_stages
    )


def agree_on_plan(
    nodes: Nodes,
    params: Params,
    card: Card,
    data_dir: str | os.PathLike[str],
    hw: Hardware,
    uri: str,
    folder: Path,
) -> Plan:
    """The recipe's plan (plan_training). Across nodes rank 0 alone plans (after checking
    the tracking store) and every rank trains its plan: ranks timing their own probes
    planned different epochs, and DDP hangs when one rank stops before the others."""
    if not nodes.joined:
        return plan_training(params, card, data_dir, hw, folder)

    def decide() -> Plan:
        check_tracking_uri(uri)
        return plan_training(params, card, data_dir, hw, folder)

    recipe = nodes.from_lead(decide, what_trains(params, card, hw.accelerator, hw.precision))
    if not nodes.lead:
        for line in describe(recipe):  # what this rank trains: rank 0's choices
            log.info("%s", line)
    return recipe


def plan_training(
    params: Params,
    card: Card,
    data_dir: str | os.PathLike[str],
    hw: Hardware,
    resume_folder: Path,
) -> Plan:
    """The recipe's plan for this data and hardware (trainyard.training.recipe), said once per
    choice; an interrupted run of the same params (its ``resume_folder``) resumes with the
    plan it made."""
    recipe = load_plan(resume_folder / RECIPE_FILE, params) or plan(
        params, card, data_dir, hw.accelerator, hw.precision, hw.device
    )
    for line in describe(recipe):
        log.info(line)
    return recipe


def resolve_hardware(tp: TrainParams) -> Hardware:
    """The accelerator, precision and device ``train.*`` come to on this machine, said once."""
    accelerator, precision, device = resolve_device(tp)
    log.info("training on %s (accelerator=%s, precision=%s)", device, accelerator, precision)
    return Hardware(accelerator, precision, device)


def load_data(
    params: Params, data_dir: str | os.PathLike[str], card: Card | None = None
) -> ImageDataModule:
    """The prepared splits (described by ``card``, read from ``data_dir`` when not given)
    as a data module; says what they hold."""
    tp = params.train
    dm = ImageDataModule(
        data_dir,
        card=card,
        batch_size=tp.batch_size,
        eval_batch_size=params.evaluate.batch_size,
        seed=params.seed,
        data_path=tp.data_path,
        device_resident=tp.device_resident,
        memory_budget=tp.memory_budget,
    )
    card = dm.card
    log.info(
        "%s data, %d classes, %dx%dx%d, arch %s",
        card.source,
        card.num_classes,
        card.channels,
        card.height,
        card.width,
        tp.arch,
    )
    return dm


def lineage_tags(
    root: str | os.PathLike[str], card: Card, model: Classifier, hw: Hardware, dvc_md5: str
) -> dict[str, str]:
    """The run's tags: code, data, host, device, and the pretrained weights if any."""
    tags = run_tags(root, card.data_sha256, hw.device)
    tags["data.dvc_md5"] = dvc_md5 or "not in dvc.lock"
    tags["precision"] = hw.precision
    tags["data.source"] = card.source
    tags["data.classes"] = str(card.num_classes)
    tags["data.input_shape"] = "x".join(str(d) for d in card.input_shape)
    tags["data.skipped_files"] = str(len(card.skipped))
    # Which weights the backbone started from, their exact bytes and their licence.
    for key, value in model.pretrained_info.items():
        tags[f"pretrained.{key}"] = value
    return tags | dvc_experiment_tags(root)


def run_name(params: Params, key: str) -> str:
    """A name a person can tell apart in the MLflow UI: the DVC experiment's name when DVC
    runs one, else dataset, architecture and the first characters of the resume key (the
    hash of params, data and code). MLflow's own random names were all the same: the seed
    is set before the run is created."""
    exp = os.environ.get(DVC_EXP_NAME, "").strip()
    return exp or f"{params.dataset_name()}-{params.train.arch}-{key[:6]}"


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
    hw: Hardware,
    tracked: TrackedRun,
    train_images: int,
    out_dir: Path,
    limit_min: float | None = None,
    extra_callbacks: tuple[L.Callback, ...] = (),
) -> FitSetup:
    """The trainer with trainyard's callbacks: checkpoints, early stopping, timing, meter,
    the per-epoch history; ``limit_min``: a hard stop after that many minutes
    (``time_limit_min``)."""
    checkpoint, resume_callbacks = checkpoint_callbacks(tp, tracked)
    early = EarlyStopping(monitor="val/acc", mode="max", patience=tp.early_stopping_patience)
    # Data wait / host->device copy / compute per step; the input-bound verdict at the end.
    meter = InputBoundMeter(data_path=tp.data_path, device_resident=tp.device_resident)
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
        # Early stopping judges only the second half: OneCycle's high-lr first half often
        # plateaus (on a small photo folder for 5+ epochs) before annealing lifts val/acc,
        # and patience alone stopped such runs at chance accuracy.
        min_epochs=-(-tp.max_epochs // 2),
        plugins=[AtomicCheckpointIO()],  # tmp + rename: a kill never leaves half a checkpoint
        deterministic=tp.deterministic,
        # per-step loss at least ~5 times an epoch, even on the small slices tests use
        log_every_n_steps=max(1, min(10, -(-train_images // tp.batch_size) // 5)),
        limit_train_batches=tp.limit_train_batches,
        max_time=None if limit_min is None else timedelta(minutes=limit_min),
    )
    return FitSetup(trainer, checkpoint, meter)


def run_fit(
    setup: FitSetup,
    model: Classifier,
    dm: ImageDataModule,
    tracked: TrackedRun,
    mp: MlflowParams,
) -> float:
    """Fit (from the last checkpoint when resuming) with system metrics; its seconds.

    A SIGTERM/SIGINT ends the run KILLED, keeps the checkpoint and exits 143/130.
    """
    t0 = time.perf_counter()
    with tracked.watching(setup.trainer, mp):
        setup.trainer.fit(model, datamodule=dm, ckpt_path=tracked.resume.ckpt_path)
    return time.perf_counter() - t0


def write_outputs(
    params: Params,
    out_dir: Path,
    tracked: TrackedRun,
    result: FitResult,
    hw: Hardware,
    dm: ImageDataModule,
) -> TrainRecord:
    """``out_dir/best.ckpt`` (the run's ``checkpoints/best.ckpt``) and the record
    ``out_dir/train.json``."""
    logger = tracked.logger
    best_dest = out_dir / BEST_CKPT
    with atomic_file(best_dest) as tmp:
        shutil.copyfile(tracked.resume.folder / result.best_ckpt, tmp)
    card = dm.card
    record = TrainRecord(
        run_id=logger.run_id,
        experiment_id=logger.experiment_id,
        experiment=params.experiment_name(),
        best_val_acc=round(result.best_score, 6),
        best_epoch=int(_ckpt_epoch(best_dest)),
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
    )
    record.write(TrainRecord.path_in(out_dir))
    return record


def _ckpt_epoch(path: Path) -> int:
    return int(torch.load(path, map_location="cpu", weights_only=True).get("epoch", -1))
