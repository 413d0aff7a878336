"""The prepared format on disk: uint8 ``[N, C, H, W]`` arrays per split + the dataset card,
memory-mapped and filled in place (peak memory does not grow with the dataset), one hash of
everything written, all inside a temp folder that replaces ``out_dir`` only when complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainyard.core.card import CARD_FILE, SPLITS, Card
from trainyard.core.io import atomic_dir, atomic_write_text
from trainyard.data.arrays import LABEL_DTYPE, channel_stats, class_counts, row_blocks


@dataclass(frozen=True)
class Expected:
    """What a source's prepare will write, told before it runs (``trainyard doctor`` sizes
    the dataset from it): images per split, their (C, H, W), and which figures prepare will
    match exactly (a prepared card that differs there is stale)."""

    counts: dict[str, int]  # images per split
    shape: tuple[int, int, int]  # (C, H, W); where prepare decides, the larger case
    note: str  # how the figures were found, for the doctor's line
    counts_known: bool = False  # exactly what prepare writes (else an estimate)
    channels_known: bool = False
    size_known: bool = False


class PreparedWriter:
    """The prepared folder being written: split arrays as memory maps in a temp folder.

    Use ``open_prepared(out_dir)``; only a writer whose block ends without an exception
    replaces ``out_dir``.
    """

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp

    def images_path(self, split: str) -> Path:
        return self.tmp / f"{split}_images.npy"

    def allocate(self, split: str, n: int, shape: tuple[int, int, int]) -> np.ndarray:
        """A writable uint8 memory map ``[n, C, H, W]`` for ``split`` (zero-filled)."""
        return np.lib.format.open_memmap(
            self.images_path(split), mode="w+", dtype=np.uint8, shape=(n, *shape)
        )

    def keep_rows(self, split: str, keep: list[bool]) -> None:
        """Rewrite ``split``'s images with only the rows ``keep`` marks (an image source
        drops the rows of files that failed to decode). Streamed: plain reads in blocks,
        appends, so memory stays bounded."""
        path = self.images_path(split)
        mask = np.asarray(keep, dtype=bool)
        tmp = self.tmp / f".{split}_images.compact.npy"
        first = np.load(path, mmap_mode="r")
        shape = (int(mask.sum()), *first.shape[1:])
        del first
        with open(tmp, "wb") as out:
            np.lib.format.write_array_header_1_0(
                out,
                {
                    "descr": np.lib.format.dtype_to_descr(np.dtype(np.uint8)),
                    "fortran_order": False,
                    "shape": shape,
                },
            )
            start = 0
            for block in row_blocks(path):
                out.write(np.ascontiguousarray(block[mask[start : start + len(block)]]).data)
                start += len(block)
        os.replace(tmp, path)

    def write_images(self, split: str, images: np.ndarray) -> None:
        np.save(self.images_path(split), np.ascontiguousarray(images, dtype=np.uint8))

    def write_labels(self, split: str, labels: np.ndarray) -> None:
        np.save(self.tmp / f"{split}_labels.npy", np.asarray(labels, dtype=LABEL_DTYPE))

    def images(self, split: str) -> np.ndarray:
        return np.load(self.images_path(split), mmap_mode="r")

    def labels(self, split: str) -> np.ndarray:
        return np.load(self.tmp / f"{split}_labels.npy")

    def digest(self) -> str:
        """sha256 over every array file, in split order: the prepared data's identity."""
        h = hashlib.sha256()
        for split in SPLITS:
            for kind in ("images", "labels"):
                with open(self.tmp / f"{split}_{kind}.npy", "rb") as fh:
                    while block := fh.read(1 << 22):
                        h.update(block)
        return h.hexdigest()

    def finish(self, card: Card) -> Card:
        """Counts, statistics and hash from what was written, then the card itself."""
        counts = {s: class_counts(self.labels(s), card.classes) for s in SPLITS}
        mean, std = channel_stats(self.images_path("train"))
        facts = {"counts": counts, "mean": mean, "std": std, "data_sha256": self.digest()}
        done = Card.from_dict(card.to_dict() | facts)
        atomic_write_text(self.tmp / CARD_FILE, done.to_json())
        return done


@contextlib.contextmanager
def open_prepared(out_dir: str | os.PathLike[str]) -> Iterator[PreparedWriter]:
    with atomic_dir(out_dir) as tmp:
        yield PreparedWriter(tmp)
