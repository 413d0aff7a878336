"""Fashion-MNIST source: its files, checksums and classes, and its prepare step.

The only module (with ``fashion_fetch``) that knows anything about Fashion-MNIST: it turns
the four IDX files into the prepared format and a dataset card; nothing downstream reads
these constants.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from trainyard.core.card import SPLITS, Card
from trainyard.data.arrays import split_train_val
from trainyard.data.idx import check_images, check_labels, read_idx
from trainyard.data.prepared_writer import Expected, open_prepared

if TYPE_CHECKING:
    from trainyard.core.config import DataParams

CLASS_NAMES: tuple[str, ...] = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
NUM_CLASSES = len(CLASS_NAMES)
IMAGE_SIZE = 28
SOURCE = "fashion-mnist"


@dataclass(frozen=True)
class RawFile:
    """One IDX .gz file of the dataset.

    ``content_sha256`` is the hash of the *decompressed* IDX bytes. Debian's
    dataset-fashion-mnist repacks the .gz files (no name, new mtime in the gzip header), so
    their .gz bytes differ from upstream's while the content is identical; hashing the
    content accepts both and still catches any changed or truncated byte.
    ``upstream_gz_md5`` is the MD5 published upstream for the .gz as downloaded.
    """

    name: str
    split: str  # "train" or "test"
    kind: str  # "images" or "labels"
    count: int
    content_sha256: str
    content_size: int
    upstream_gz_md5: str


RAW_FILES: tuple[RawFile, ...] = (
    RawFile(
        "train-images-idx3-ubyte.gz",
        "train",
        "images",
        60_000,
        "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
        47_040_016,
        "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
    ),
    RawFile(
        "train-labels-idx1-ubyte.gz",
        "train",
        "labels",
        60_000,
        "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
        60_008,
        "25c81989df183df01b3e8a0aad5dffbe",
    ),
    RawFile(
        "t10k-images-idx3-ubyte.gz",
        "test",
        "images",
        10_000,
        "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
        7_840_016,
        "bef4ecab320f06d8554ea6380940ec79",
    ),
    RawFile(
        "t10k-labels-idx1-ubyte.gz",
        "test",
        "labels",
        10_000,
        "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",
        10_008,
        "bb300cfdad3c16e7a12a480ee83cd310",
    ),
)
RAW_BY_NAME = {f.name: f for f in RAW_FILES}


def fashion_card(mean: float = 0.0, std: float = 1.0, extra: dict[str, Any] | None = None) -> Card:
    """Fashion-MNIST's card (prepare fills in the statistics and counts)."""
    return Card(
        source=SOURCE,
        classes=CLASS_NAMES,
        channels=1,
        height=IMAGE_SIZE,
        width=IMAGE_SIZE,
        mean=(mean,),
        std=(std,),
        # Uploads of any size are padded to square with black (the dataset's background)
        # and resized, so a garment keeps its proportions, as in the dataset.
        resize="pad",
        fill=0,
        extra=extra or {},
    )


def load_raw(raw_dir: str | os.PathLike[str]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Read and validate the raw IDX files: {'train': (images, labels), 'test': (...)}."""
    raw_dir = Path(raw_dir)
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for split, prefix in (("train", "train"), ("test", "t10k")):
        img_name, lbl_name = f"{prefix}-images-idx3-ubyte.gz", f"{prefix}-labels-idx1-ubyte.gz"
        images = read_idx(raw_dir / img_name)
        labels = read_idx(raw_dir / lbl_name)
        check_images(images, str(raw_dir / img_name), RAW_BY_NAME[img_name].count, IMAGE_SIZE)
        check_labels(labels, str(raw_dir / lbl_name), NUM_CLASSES, RAW_BY_NAME[lbl_name].count)
        out[split] = (images, labels)
    return out


def prepare_fashion_mnist(
    raw_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], params: DataParams, seed: int
) -> Card:
    """The four IDX files -> prepared splits (validation held out of the train file,
    stratified and seeded; ``data.limit`` takes a stratified slice) + the card."""

    raw = load_raw(raw_dir)
    train_images, train_labels = raw["train"]
    train_idx, val_idx = split_train_val(train_labels, params.val_size, params.limit, seed)
    arrays = {
        "train": (train_images[train_idx], train_labels[train_idx]),
        "val": (train_images[val_idx], train_labels[val_idx]),
        "test": raw["test"],
    }
    card = fashion_card(extra={"seed": seed, "limit": params.limit, "val_size": params.val_size})
    with open_prepared(out_dir) as writer:
        for split in SPLITS:
            images, labels = arrays[split]
            writer.write_images(split, images[:, None, :, :])  # [N,H,W] -> [N,1,H,W]
            writer.write_labels(split, labels)
        return writer.finish(card)


def describe_fashion_mnist(params: DataParams, _root: Path) -> Expected:
    """Fashion-MNIST's size before prepare: the 60,000-image train file (or data.limit)
    less data.val_size for train, data.val_size for val, the 10,000-image test file."""
    pool = params.limit or RAW_BY_NAME["train-images-idx3-ubyte.gz"].count
    test = RAW_BY_NAME["t10k-images-idx3-ubyte.gz"].count
    val = params.val_size
    note = (
        f"expected: {pool:,} train-file images ({pool - val:,} train + {val:,} val, "
        f"data.val_size) and {test:,} test, 1x{IMAGE_SIZE}x{IMAGE_SIZE}; nothing prepared yet"
    )
    return Expected(
        counts={"train": pool - val, "val": val, "test": test},
        shape=(1, IMAGE_SIZE, IMAGE_SIZE),
        note=note,
        counts_known=True,
        channels_known=True,
        size_known=True,
    )
