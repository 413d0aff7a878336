"""``train.refit``: once validation has chosen the epochs, fit again on train + val.

The fit that early stopping watches never learns from the val split, a fifth of the
labelled images (issue 41); the frozen probe a user could try instead fits on both. So, as
AutoGluon's ``refit_full`` does, the model that ships is fitted a second time, from the
same initial weights and seed, on train + val for the epochs validation chose (the best
val/acc epoch), its OneCycle schedule laid over those epochs; the test split stays
untouched. The refit is priced in the plan's own epochs (nominal, so the same data and
params refit the same way on a busy or a quiet machine): ``auto`` refits a fine-tune of
pretrained weights when the fit and the refit together stay within ``REFIT_SHARE`` times
the planned epochs (an early-stopped fit leaves about half of them unused). A fit from
scratch (Fashion-MNIST, 8x8 scans) keeps its val-chosen checkpoint under ``auto``.

The val split can no longer judge the refitted model, so the temperature export fits must
come from the model validation chose: the refitted checkpoint carries that model's val
logits (``SELECTED_VAL_LOGITS``), and export calibrates on them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from trainyard.core.config import TrainParams
from trainyard.core.handoffs import SELECTED_VAL_LOGITS
from trainyard.model.classifier import Classifier
from trainyard.model.trained import pixel_logits
from trainyard.training.builder import build_trainer
from trainyard.training.datamodule import ImageDataModule
from trainyard.training.device import Hardware
from trainyard.training.fit_log import EpochTimer
from trainyard.training.tracked_run import FitResult

log = logging.getLogger(__name__)

REFIT_CKPT = "refit.ckpt"  # in the resume folder, beside best.ckpt
# The fit and the refit together: at most this many times the planned epochs (counted in
# train-split epochs; a refit epoch reads train + val). 1.5: an early-stopped fit ends at
# about half its plan, so a refit of its chosen epochs fits; whole runs stay under 480 s.
REFIT_SHARE = 1.5


def refit_epochs(
    setting: bool | str,
    finetune: bool,
    world_size: int,
    result: FitResult,
    best_epoch: int,
    counts: tuple[int, int],
) -> tuple[int, str]:
    """(epochs of the refit on train + val, why); 0: the val-chosen checkpoint ships.
    ``best_epoch``: the chosen checkpoint's (0-based); ``counts``: (train, val) images."""
    n_train, n_val = counts
    if setting is False:
        return 0, "train.refit: false"
    if world_size > 1:
        return 0, f"{world_size} processes: the refit runs on one device only"
    if n_val == 0:
        return 0, "no val images to add"
    if setting == "auto" and not finetune:
        return 0, "trained from scratch: auto refits fine-tunes of pretrained weights only"
    epochs = best_epoch + 1
    chosen = f"the {epochs} epochs validation chose (best val/acc at epoch {epochs})"
    if setting is True:
        return epochs, f"train.refit: true: {chosen}, on {n_train + n_val:,} train + val images"
    cost = epochs * (n_train + n_val) / n_train  # in train-split epochs
    left = REFIT_SHARE * result.max_epochs - result.epochs_run
    if cost > left:
        return 0, (
            f"{chosen} on train + val cost {cost:.1f} train epochs; {left:.1f} left of "
            f"{REFIT_SHARE:g}x the {result.max_epochs} planned: not refitted"
        )
    return epochs, (
        f"{chosen}, on {n_train + n_val:,} train + val images: {cost:.1f} train epochs of the "
        f"{left:.1f} left ({result.epochs_run} run of {result.max_epochs} planned, "
        f"{REFIT_SHARE:g}x in all)"
    )


def refit(
    tp: TrainParams,
    hw: Hardware,
    dm: ImageDataModule,
    make_model: Callable[[], Classifier],  # seeded: the fit's initial weights
    folder: Path,
    result: FitResult,
    finetune: bool,
) -> FitResult:
    """``result`` with the refitted checkpoint (``REFIT_CKPT`` in ``folder``, the resume
    folder) as the one that ships, or unchanged when ``refit_epochs`` says no; either way
    ``result.refit`` says which images trained the shipped model."""
    selected = torch.load(folder / result.best_ckpt, map_location="cpu", weights_only=True)
    best_epoch = int(selected.get("epoch", -1))
    counts = (len(dm.split_arrays("train")[1]), len(dm.split_arrays("val")[1]))
    world = dm.trainer.world_size if dm.trainer is not None else 1
    epochs, why = refit_epochs(tp.refit, finetune, world, result, best_epoch, counts)
    info: dict[str, Any] = {"epochs": epochs, "why": why, "best_epoch": best_epoch}
    if epochs == 0:
        log.info("refit: none (%s): the val-chosen checkpoint ships, trained on train", why)
        return replace(result, refit=info | {"trained_on": "train", "images": counts[0]})
    log.info("refit: %s", why)
    model = make_model()
    model.load_state_dict(selected["state_dict"])
    logits = pixel_logits(model, model.card, dm.split_arrays("val")[0])
    model = make_model()  # seeded: the same initial weights as the fit's
    trainer = build_trainer(
        accelerator=hw.accelerator,
        precision=hw.precision,
        callbacks=[EpochTimer()],
        root=folder,
        verbose=True,
        max_epochs=epochs,
        limit_val_batches=0,  # val is in the training data now: nothing to judge by
        num_sanity_val_steps=0,
        deterministic=tp.deterministic,
        log_every_n_steps=10,
        limit_train_batches=tp.limit_train_batches,
    )
    t0 = time.perf_counter()
    dm.train_on("train", "val")
    trainer.fit(model, datamodule=dm)
    refit_s = time.perf_counter() - t0
    path = folder / REFIT_CKPT
    trainer.save_checkpoint(path, weights_only=True)
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    ckpt[SELECTED_VAL_LOGITS] = logits
    torch.save(ckpt, path)
    log.info("refit: %d epochs on %d images in %.1f s", epochs, sum(counts), refit_s)
    info |= {"trained_on": "train + val", "images": sum(counts), "fit_s": round(refit_s, 2)}
    return replace(result, best_ckpt=REFIT_CKPT, fit_s=result.fit_s + refit_s, refit=info)
