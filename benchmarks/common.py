"""What the training benchmarks share: the Fashion-MNIST arrays and trainyard's model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainyard.core.card import Card

DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
# What load_data returns: {"arrays": {split: (images, labels)}, "card": Card}.
Data = dict[str, Any]


def load_data(raw_dir: Path, limit: int | None, seed: int = 42) -> Data:
    """Train/val/test uint8 [N,1,28,28] splits + card straight from the raw IDX files
    (no DVC needed)."""
    from trainyard.data.arrays import channel_stats, split_train_val
    from trainyard.data.sources.fashion_mnist import fashion_card, load_raw

    raw = load_raw(raw_dir)
    images, labels = raw["train"]
    images = images[:, None]
    val_size = 5000 if limit is None else max(10, limit // 10)
    train_idx, val_idx = split_train_val(labels, val_size, limit, seed)
    train_x = images[train_idx]
    (mean,), (std,) = channel_stats(train_x)
    card = fashion_card(mean, std)
    return {
        "arrays": {
            "train": (train_x, labels[train_idx]),
            "val": (images[val_idx], labels[val_idx]),
            "test": (raw["test"][0][:, None], raw["test"][1]),
        },
        "card": card,
    }


def find_raw_dir(given: str | None) -> Path:
    """The first folder with the Fashion-MNIST IDX files: ``given``, data/raw, Debian's."""
    for candidate in (given, "data/raw", str(DEBIAN_DIR)):
        if candidate and (Path(candidate) / "train-images-idx3-ubyte.gz").is_file():
            return Path(candidate)
    raise SystemExit(
        "bench: no Fashion-MNIST files found (tried --raw, data/raw, "
        f"{DEBIAN_DIR}); run `make run` first or pass --raw DIR"
    )


def classifier(arch: str, card: Card, **kw: Any) -> Any:
    """trainyard's LightningModule for ``card`` (what the train stage fits)."""
    from trainyard.model.classifier import Classifier

    return Classifier(card=card.contract(), arch=arch, **kw)
