"""Array helpers shared by the sources and the pipeline: stratified splits, class counts,
per-channel statistics in bounded blocks, reading images row block by row block, and
loading a prepared split (numpy only: the export and evaluate stages read it too)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from trainyard.core.errors import DataError

LABEL_DTYPE = np.int32  # any class count (uint8 would stop at 256)
_STATS_BYTES = 16 << 20  # bytes of images per block for mean/std: bounded on any dataset


def per_class_quota(labels: np.ndarray, total: int, num_classes: int) -> np.ndarray:
    """How many of ``total`` to take from each class, proportional to class frequency."""
    counts = np.bincount(labels, minlength=num_classes)
    exact = counts / counts.sum() * total
    quota = np.floor(exact).astype(np.int64)
    # Hand out the remainder to the largest fractional parts: sums exactly to ``total``.
    for c in np.argsort(-(exact - quota), kind="stable")[: total - quota.sum()]:
        quota[c] += 1
    return np.minimum(quota, counts)


def stratified_take(
    labels: np.ndarray, total: int, rng: np.random.Generator, num_classes: int | None = None
) -> np.ndarray:
    """Indices of a stratified random sample of ``total`` items (sorted)."""
    k = int(labels.max(initial=0)) + 1 if num_classes is None else num_classes
    quota = per_class_quota(labels, total, k)
    picked = [rng.permutation(np.flatnonzero(labels == c))[: quota[c]] for c in range(k)]
    return np.sort(np.concatenate(picked))


def split_train_val(
    labels: np.ndarray, val_size: int, limit: int | None, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Seeded stratified split of a train pool into (train_idx, val_idx)."""
    rng = np.random.default_rng(seed)
    pool = np.arange(labels.shape[0])
    if limit is not None and limit < labels.shape[0]:
        pool = stratified_take(labels, limit, rng)
    val_local = stratified_take(labels[pool], val_size, rng)
    mask = np.ones(pool.shape[0], dtype=bool)
    mask[val_local] = False
    return pool[mask], pool[val_local]


def class_counts(labels: np.ndarray, classes: tuple[str, ...]) -> dict[str, Any]:
    counts = np.bincount(labels, minlength=len(classes))
    return {
        "total": int(labels.shape[0]),
        "per_class": {name: int(counts[i]) for i, name in enumerate(classes)},
    }


def row_blocks(images: np.ndarray | str | os.PathLike[str]) -> Iterator[np.ndarray]:
    """``images`` ``[N, C, H, W]`` uint8 in blocks of about ``_STATS_BYTES``.

    A path to an ``.npy`` file is read with plain reads into one reused buffer, not memory
    mapped: pages of a mapped file stay in this process's RSS once touched, which made a
    224 px prepare peak at 11 GiB. Reads go through the page cache, which the kernel may
    drop at will and which is not this process's memory.
    """
    if isinstance(images, np.ndarray):
        rows = max(1, _STATS_BYTES // max(1, images[:1].nbytes))
        for start in range(0, images.shape[0], rows):
            yield np.asarray(images[start : start + rows])
        return
    with open(images, "rb") as fh:
        version = np.lib.format.read_magic(fh)
        read_header = (
            np.lib.format.read_array_header_1_0
            if version == (1, 0)
            else np.lib.format.read_array_header_2_0
        )
        shape, fortran, dtype = read_header(fh)
        if dtype != np.uint8 or fortran or len(shape) != 4:
            raise ValueError(f"{images}: expected C-ordered uint8 [N, C, H, W], got {shape}")
        row_bytes = int(np.prod(shape[1:]))
        rows = max(1, _STATS_BYTES // max(1, row_bytes))
        buf = np.empty((rows, *shape[1:]), dtype=np.uint8)
        for start in range(0, shape[0], rows):
            block = buf[: min(rows, shape[0] - start)]
            if fh.readinto(memoryview(block).cast("B")) != block.nbytes:
                raise ValueError(f"{images}: the file is shorter than its header says")
            yield block


def channel_stats(
    images: np.ndarray | str | os.PathLike[str],
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std on the 0..1 scale of uint8 ``[N, C, H, W]``.

    ``images`` is an array or an ``.npy`` file. Sums are exact integers (uint64 per block,
    Python ints across blocks), so the result does not depend on the block size, and the
    only temporary is one block's squares as uint16 (255**2 fits).
    """
    total: list[int] | None = None
    total_sq: list[int] | None = None
    n = 0
    for block in row_blocks(images):
        s = block.sum(axis=(0, 2, 3), dtype=np.uint64)
        sq = np.square(block, dtype=np.uint16).sum(axis=(0, 2, 3), dtype=np.uint64)
        if total is None or total_sq is None:
            total, total_sq = [0] * len(s), [0] * len(s)
        total = [a + int(b) for a, b in zip(total, s, strict=True)]
        total_sq = [a + int(b) for a, b in zip(total_sq, sq, strict=True)]
        n += block.shape[0] * block.shape[2] * block.shape[3]
    if total is None or total_sq is None or n == 0:
        raise ValueError("channel_stats: no images")
    means, stds = [], []
    for s, sq in zip(total, total_sq, strict=True):
        var = (n * sq - s * s) / (n * n)  # exact numerator: no cancellation error
        std = var**0.5 if var > 0 else 255.0  # a constant channel: keep the formula finite
        means.append(round(s / n / 255.0, 6))
        stds.append(round(std / 255.0, 6))
    return tuple(means), tuple(stds)


def load_split(
    data_dir: str | os.PathLike[str], split: str, mmap: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 images [N,C,H,W], integer labels [N]) of a prepared split.

    ``mmap``: the images stay on disk, read on demand (any size); labels are read whole.
    """
    data_dir = Path(data_dir)
    paths = [data_dir / f"{split}_{kind}.npy" for kind in ("images", "labels")]
    for path in paths:
        if not path.is_file():
            raise DataError(f"{path}: missing; run `dvc repro prepare` first")
    images = np.load(paths[0], mmap_mode="r" if mmap else None, allow_pickle=False)
    labels = np.load(paths[1], allow_pickle=False)
    if images.dtype != np.uint8 or images.ndim != 4:
        raise DataError(
            f"{paths[0]}: expected uint8 [N,C,H,W], got {images.dtype} {list(images.shape)}; "
            "rerun `dvc repro prepare`"
        )
    if labels.ndim != 1 or labels.shape[0] != images.shape[0] or labels.dtype.kind not in "iu":
        raise DataError(
            f"{paths[1]}: expected {images.shape[0]} integer labels, got {labels.dtype} "
            f"{list(labels.shape)}; rerun `dvc repro prepare`"
        )
    return images, labels
