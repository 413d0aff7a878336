"""The one place a Lightning ``Trainer`` is built: the pipeline's training, the benchmarks and
the tests all get trainyard's settings from here, so a measurement runs what training runs."""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning as L
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint, Timer
from lightning_utilities.core import rank_zero

from trainyard.training.clock import BatchClock
from trainyard.training.fit_log import ProgressLog

if TYPE_CHECKING:
    from trainyard.core.config import TrainParams

log = logging.getLogger(__name__)

# Where train.resume keeps each training's resumable checkpoints (defined here, not there:
# the benchmarks build trainers on machines without MLflow, which train.resume imports).
RESUME_ROOT = Path(".cache") / "train-resume"
HARD_STOP = 1.25  # a timed plan's run stops at this multiple of train.time_budget_min

# Lightning's INFO lines that advertise, or say what trainyard's own lines already say:
# dropped where they are logged, by their text (a new Lightning line still shows).
LIGHTNING_CHATTER = re.compile(
    "|".join(
        (
            r"💡 Tip: ",  # litlogger / litmodels adverts, on every Trainer without a LitLogger
            # the device and precision: train.fit's "training on <device> (accelerator=...,
            # precision=...)"; the GPU that is used: the device name there
            r"GPU available: ",
            r"TPU available: ",
            r"Using (16bit|bfloat16) Automatic Mixed Precision",
            r"LOCAL_RANK: \d+ - CUDA_VISIBLE_DEVICES",
            # float32 matmul advice: trainyard trains mixed precision on any bf16 GPU, and
            # has no key for it
            r"You are using a CUDA device .* that has Tensor Cores",
            r"Loading `train_dataloader` to estimate number of stepping batches",
            r"`Trainer.fit` stopped: `max_epochs=",  # the last epoch line reads "epoch N/N"
            # a resumed fit: train.resume's "resuming from epoch ..., (<checkpoint>)"
            r"Restoring states from the checkpoint path at ",
            r"Restored all states from the checkpoint at ",
            r"`weights_only` was not set",
            # Ctrl-C: train.resume says "interrupted by SIGINT; the next `dvc repro` resumes..."
            r"\s*Detected KeyboardInterrupt, attempting graceful shutdown",
            # MLFlowLogger's first use of a new store: not a warning, and not news
            r"Experiment with name .* not found\. Creating it\.",
        )
    )
)

# Where those lines are logged: rank_zero_info's logger, the CUDA accelerator's, the
# checkpoint connector's and the MLflow logger's.
LIGHTNING_LOGGERS = (
    "lightning.pytorch.utilities.rank_zero",
    "lightning.fabric.utilities.rank_zero",
    "lightning.pytorch.accelerators.cuda",
    "lightning.pytorch.trainer.connectors.checkpoint_connector",
    "lightning.pytorch.loggers.mlflow",
)


def _not_chatter(record: logging.LogRecord) -> bool:
    return LIGHTNING_CHATTER.match(record.getMessage()) is None


def quiet_lightning() -> None:
    """Drop Lightning's adverts and repeats (LIGHTNING_CHATTER) and two warnings that are
    no news to a trainyard user; idempotent. Lightning's other lines and warnings stay."""
    for name in {*LIGHTNING_LOGGERS, rank_zero.log.name}:
        logger = logging.getLogger(name)
        if _not_chatter not in logger.filters:
            logger.addFilter(_not_chatter)
    # train.fit keeps best/last checkpoints in its resume folder, which holds the resume
    # state before the first checkpoint and last.ckpt on a resume: not empty by design.
    warnings.filterwarnings(
        "ignore",
        message=rf"Checkpoint directory .*{re.escape(str(RESUME_ROOT))}.* exists and is not empty",
        category=UserWarning,
    )
    # Under DDP the train/* and perf/* epoch metrics are rank 0's on purpose (the loss of
    # its shard, as train.history says; throughput already times the world size), while
    # val/* is synced: Lightning's advice to sync every epoch metric is no news.
    warnings.filterwarnings(
        "ignore",
        message=r"It is recommended to use `self\.log\('(train|perf)/.*sync_dist=True",
        category=UserWarning,
    )
    # Lightning's own use of a torch API that torch deprecated: nothing a user can change.
    warnings.filterwarnings(
        "ignore",
        message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        category=FutureWarning,
        module=r"lightning\.pytorch\.utilities\._pytree",
    )


# At import: MLFlowLogger's line comes before any Trainer is built. Warning filters are
# also set again by each build_trainer (pytest restores the filters after each test).
quiet_lightning()


def accelerator_for(device: str) -> str:
    """Lightning's accelerator name for a torch device type (``"cuda"`` -> ``"gpu"``)."""
    return "gpu" if device == "cuda" else device


def build_trainer(
    *,
    accelerator: str = "cpu",
    devices: int | str = 1,
    num_nodes: int = 1,
    precision: str = "32-true",
    callbacks: Sequence[Callback] = (),
    logger: Any = False,
    root: str | os.PathLike[str] | None = None,
    verbose: bool = False,
    **options: Any,
) -> L.Trainer:
    """A ``Trainer`` with trainyard's settings; ``options`` go to Lightning unchanged
    (``max_epochs``, ``max_steps``, ``deterministic``, ...).

    - ``accelerator`` takes Lightning's names or a torch device type (``"cuda"``).
    - ``num_nodes`` (``train.num_nodes``): machines training together. Above 1 Lightning
      picks DDP (gloo on CPU, NCCL on GPU) even at one device a node, and takes ranks and
      the main address from torchrun, SLURM or MASTER_ADDR/NODE_RANK (train.nodes).
    - ``use_distributed_sampler=False``: trainyard's data paths shard by rank themselves
      (``datamodule.epoch_order``); Lightning's DistributedSampler would shard them twice.
    - The fit's one per-batch clock (``clock.BatchClock``), first among the callbacks:
      what the epoch and progress lines, the history and the input-bound meter read.
    - Checkpointing is on exactly when a ``ModelCheckpoint`` is among ``callbacks`` (Lightning
      refuses one with ``enable_checkpointing=False``, and adds its own default otherwise).
    - ``verbose``: for the pipeline's own run, the model's size in one line (Lightning's
      summary table is a dozen lines) and progress: Lightning's bar when stderr is a
      terminal, else a log line every ~30 s within an epoch (train.progress.ProgressLog): a
      bar redrawn in a file or CI log is noise, and its last frame a block of leftovers.
      Benchmarks and tests stay quiet (and ``logger=False`` writes no lightning_logs/).
    """
    quiet_lightning()
    callbacks = list(callbacks)
    if not any(isinstance(c, BatchClock) for c in callbacks):
        # first: a batch is counted before any other callback reads the clock
        callbacks.insert(0, BatchClock())
    bar = False
    if verbose:
        bar = _stderr_is_terminal()
        callbacks.append(ProgressLog(periodic=not bar))
    return L.Trainer(
        accelerator=accelerator_for(accelerator),
        devices=devices,
        num_nodes=num_nodes,
        precision=precision,
        callbacks=callbacks,
        logger=logger,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=bar,
        enable_model_summary=False,
        use_distributed_sampler=False,
        default_root_dir=None if root is None else str(root),
        **options,
    )


def _stderr_is_terminal() -> bool:
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


class LateEarlyStopping(EarlyStopping):
    """Lightning's ``EarlyStopping`` whose verdict stands only from the trainer's
    ``min_epochs`` on. Patience counts from the first epoch, but a stop decided earlier is
    withdrawn and judged again at the next epoch: Lightning keeps it, and stopped the run
    at ``min_epochs`` exactly even where val/acc had risen in the epochs before (a clip art
    fit: best 0.929 at epoch 6, 0.938 at epoch 15, stopped at 16 of 32)."""

    def _run_early_stopping_check(self, trainer: L.Trainer) -> None:
        stopping = trainer.should_stop  # already asked by another (a time limit, a signal)
        super()._run_early_stopping_check(trainer)
        # fit_loop stops after an epoch only once it has processed min_epochs
        if not stopping and trainer.current_epoch + 1 < (trainer.fit_loop.min_epochs or 0):
            trainer.should_stop = False
            self.stopped_epoch = 0
            self.stopping_reason_message = None
            if hasattr(self, "stopping_reason"):  # Lightning 2.5.3+: an enum
                self.stopping_reason = type(self.stopping_reason).NOT_STOPPED


def time_limit_min(tp: TrainParams, planned_epochs: bool) -> float | None:
    """Minutes after which the fit stops, whatever epoch it is in (``train.time_limit_min``):
    ``auto`` is HARD_STOP x the budget when the recipe timed this machine to plan the epochs
    (a slower machine must not run far past it), and none under ``train.plan: fixed``,
    whose epochs must not depend on how fast the machine is; a number; null = none."""
    if tp.time_limit_min != "auto":
        return tp.time_limit_min
    if tp.plan == "timed" and planned_epochs and tp.time_budget_min is not None:
        return tp.time_budget_min * HARD_STOP
    return None


def stop_reason(trainer: L.Trainer) -> str:
    """Why the fit ended: ``time limit ...`` (train.time_limit_min cut it short: said
    loudly, the model is not the one the plan promised), ``early stopping`` or
    ``max_epochs``."""
    timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)
    left = timer.time_remaining("train") if timer is not None else None
    if left is not None and left <= 0 and trainer.current_epoch < (trainer.max_epochs or 0):
        limit = (timer.time_elapsed("train") + left) / 60  # the Timer's duration
        why = (
            f"time limit: train.time_limit_min ({limit:.3g} min) stopped the fit after epoch "
            f"{trainer.current_epoch} of the {trainer.max_epochs} planned"
        )
        log.warning("%s; this model is not the plan's: raise or unset train.time_limit_min", why)
        return why
    early = trainer.early_stopping_callback
    if isinstance(early, EarlyStopping) and early.stopped_epoch > 0:
        return f"early stopping after epoch {trainer.current_epoch}"
    return "max_epochs"
