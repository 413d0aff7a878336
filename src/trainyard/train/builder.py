"""The one place a Lightning ``Trainer`` is built: the pipeline's training, the benchmarks and
the tests all get trainyard's settings from here, so a measurement runs what training runs."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint


def accelerator_for(device: str) -> str:
    """Lightning's accelerator name for a torch device type (``"cuda"`` -> ``"gpu"``)."""
    return "gpu" if device == "cuda" else device


def build_trainer(
    *,
    accelerator: str = "cpu",
    devices: int | str = 1,
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
    - ``use_distributed_sampler=False``: trainyard's data paths shard by rank themselves
      (``datamodule.epoch_order``); Lightning's DistributedSampler would shard them twice.
    - Checkpointing is on exactly when a ``ModelCheckpoint`` is among ``callbacks`` (Lightning
      refuses one with ``enable_checkpointing=False``, and adds its own default otherwise).
    - ``verbose``: progress bar and model summary, for the pipeline's own run; benchmarks and
      tests stay quiet (and ``logger=False`` writes no lightning_logs/).
    """
    callbacks = list(callbacks)
    return L.Trainer(
        accelerator=accelerator_for(accelerator),
        devices=devices,
        precision=precision,
        callbacks=callbacks,
        logger=logger,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=verbose,
        enable_model_summary=verbose,
        use_distributed_sampler=False,
        default_root_dir=None if root is None else str(root),
        **options,
    )
