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
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning_utilities.core import rank_zero

from trainyard.train.progress import ProgressLog

# Where train.resume keeps each training's resumable checkpoints (defined here, not there:
# the benchmarks build trainers on machines without MLflow, which train.resume imports).
RESUME_ROOT = Path(".cache") / "train-resume"

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
