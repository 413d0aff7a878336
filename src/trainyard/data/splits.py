"""How an image-file source's files fall into splits: the source's own where it gives them,
else a seeded stratified draw (``assign_splits``); duplicates across splits, which leak
(``find_duplicates``, ``data.dedupe``); the class-balance warnings; and the doctor's
estimate of each split's size before prepare runs (``estimated_counts``)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from trainyard.core.card import SPLITS
from trainyard.core.errors import DataError

if TYPE_CHECKING:
    from trainyard.core.config import DataParams
    from trainyard.data.image_files import ImageFile

log = logging.getLogger(__name__)

# Class balance warnings (train split): largest/smallest above this ratio, or fewer images.
IMBALANCE_RATIO = 10
TINY_CLASS = 10


def assign_splits(
    labels: np.ndarray,
    given: list[str | None],
    classes: tuple[str, ...],
    val_fraction: float,
    test_fraction: float,
    seed: int,
    *,
    key: str = "data",
) -> np.ndarray:
    """Split name per item: the source's own where given, else a seeded stratified draw.

    Items without a given split, and train items when the source gives no val or test, are
    split per class: ``round(n * fraction)`` (at least 1) to val and test each, the rest to
    train. A class too small for that is a DataError naming it (and ``key``).
    """
    out = np.array([g or "train" for g in given], dtype=object)
    has = set(given)
    carve = [s for s, f in (("val", val_fraction), ("test", test_fraction)) if s not in has and f]
    if not carve:
        return out
    rng = np.random.default_rng(seed)
    pool = np.flatnonzero(out == "train")
    fractions = {"val": val_fraction, "test": test_fraction}
    for c, name in enumerate(classes):
        members = pool[labels[pool] == c]
        n = members.shape[0]
        take = {s: max(1, round(n * fractions[s])) for s in carve}
        if n - sum(take.values()) < 1:
            need = sum(take.values()) + 1
            raise DataError(
                f"{key}: class {name!r} has {n} image(s), too few for the stratified "
                f"split (val_fraction {val_fraction}, test_fraction {test_fraction} need at "
                f"least {need}: one per split); add images to it or give your own "
                "train/val/test splits"
            )
        order = rng.permutation(members)
        start = 0
        for s in carve:
            out[order[start : start + take[s]]] = s
            start += take[s]
    return out


def find_duplicates(hashes: list[str], splits: np.ndarray) -> dict[str, list[int]]:
    """Exact duplicates (same file bytes) across splits: leakage from train into val/test,
    and from val into test. Returns {"val": [idx...], "test": [idx...]} of the copies."""
    train = {h for h, s in zip(hashes, splits, strict=True) if s == "train"}
    val = {h for h, s in zip(hashes, splits, strict=True) if s == "val"}
    out: dict[str, list[int]] = {"val": [], "test": []}
    for i, (h, s) in enumerate(zip(hashes, splits, strict=True)):
        if s == "val" and h in train:
            out["val"].append(i)
        elif s == "test" and (h in train or h in val):
            out["test"].append(i)
    return out


def split_files(
    files: list[ImageFile],
    hashes: list[str],
    classes: tuple[str, ...],
    params: DataParams,
    seed: int,
    key: str,
) -> tuple[np.ndarray, np.ndarray, dict[str, list[int]]]:
    """Labels, the split of each file (``dropped`` for removed duplicates) and the
    duplicates across splits, which are logged as leakage."""
    labels = np.array([f.label for f in files], dtype=np.int64)
    splits = assign_splits(
        labels,
        [f.split for f in files],
        classes,
        params.val_fraction,
        params.test_fraction,
        seed,
        key=key,
    )
    dups = find_duplicates(hashes, splits)
    n_dups = len(dups["val"]) + len(dups["test"])
    if n_dups:
        log.warning(
            "%d exact duplicate image(s) across splits (%d in val, %d in test, copies of "
            "train or val images): leakage%s",
            n_dups,
            len(dups["val"]),
            len(dups["test"]),
            "; removed (data.dedupe)" if params.dedupe else "; set data.dedupe: true to drop them",
        )
    if params.dedupe and n_dups:
        drop = set(dups["val"]) | set(dups["test"])
        splits[sorted(drop)] = "dropped"
    return labels, splits, dups


def check_balance(classes: tuple[str, ...], labels: np.ndarray, splits: np.ndarray) -> None:
    """WARNING for classes with few train images and for a large imbalance between
    classes: both make accuracy misleading, and the user can fix them by adding images."""
    counts = np.bincount(labels[splits == "train"], minlength=len(classes))
    tiny = [f"{classes[c]} ({counts[c]})" for c in np.flatnonzero(counts < TINY_CLASS)]
    if tiny:
        log.warning(
            "%d class(es) with fewer than %d train images: %s; the model can hardly learn "
            "them (and their val/test accuracy is noise); add images to them",
            len(tiny),
            TINY_CLASS,
            ", ".join(tiny[:20]) + (f" ... and {len(tiny) - 20} more" if len(tiny) > 20 else ""),
        )
    big, small = int(counts.argmax()), int(counts.argmin())
    if counts[small] and counts[big] > IMBALANCE_RATIO * counts[small]:
        log.warning(
            "class imbalance: %s has %d train images, %s only %d (%.0fx, over %dx); "
            "accuracy favours the large classes: add images to the small ones or remove "
            "some from the large",
            classes[big],
            counts[big],
            classes[small],
            counts[small],
            counts[big] / counts[small],
            IMBALANCE_RATIO,
        )


def estimated_counts(given: Mapping[str | None, int], params: DataParams) -> dict[str, int]:
    """Images per split before prepare runs (the doctor's estimate): ``given`` counts the
    images by the source's own split (None: none given). As ``assign_splits`` does, a val
    or test split the source does not give is carved out of the train pool by its fraction."""
    counts = {s: int(given.get(s, 0)) for s in SPLITS}
    pool = counts["train"] + int(given.get(None, 0))
    carved = {
        s: round(pool * f)
        for s, f in (("val", params.val_fraction), ("test", params.test_fraction))
        if s not in given
    }
    return counts | carved | {"train": pool - sum(carved.values())}
