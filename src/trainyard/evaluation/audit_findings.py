"""What ``trainyard audit`` finds in a labelled folder, from each image's embedding, label,
split and content hash: numpy, scikit-learn and cleanlab, no torch.

The checks (label issues from cross-validated out-of-sample probabilities and cleanlab's
``find_label_issues``; exact and near duplicates, above all across splits; outliers; class
imbalance by prepare's rules), their thresholds and why not cleanlab's ``Datalab``:
docs/audit.md, "What it looks for, and how". The constants here (``SPLITS``, ``NEIGHBOURS``,
``OUTLIER_Z``) are the figures that page gives.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np
from cleanlab.filter import find_label_issues
from cleanlab.rank import get_label_quality_scores
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import StratifiedKFold, cross_val_predict
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from threadpoolctl import threadpool_limits

from trainyard.data.splits import IMBALANCE_RATIO, TINY_CLASS

FOLDS = 5
# The label probe: a weak model (C) is less able to learn the flipped labels it is trained
# with, and averaging a few fold splits steadies the ranking (one split's luck moved the
# recall at precision 0.7 by 0.05). Tuned on emoji, checked on clip art
# (docs/audit.md#how-well-it-finds-them).
C = 0.001
SPLITS = 3
NEIGHBOURS = 5
# A near duplicate is a neighbour in the embedding (cosine at least NEAR_EMBEDDING) whose
# TINY x TINY thumbnail is as close as a resized, re-encoded copy's: mean absolute
# difference at most NEAR_PIXELS of 255. The embedding alone cannot tell a copy from two
# emoji drawn alike (a 1 o'clock and a 2 o'clock face: cosine 0.99; a WebP copy at 80%:
# 0.87-0.96). Tuned on the emoji folder, checked on clip art (docs/audit.md#how-well).
NEAR_EMBEDDING = 0.85
NEAR_PIXELS = 4.0
TINY = 8
TINY_DIM = 3 * TINY * TINY
OUTLIER_Z = 6.0  # robust z of the kNN distance: far out, not merely the class's odd one
BLOCK = 1024  # rows of the similarity matrix at a time: 1024 x N floats


@dataclass
class Suspect:
    """One row of the suspects table."""

    index: int  # the image's row
    reason: str  # label | exact duplicate | near duplicate | outlier
    score: float  # higher is more likely a problem (1 - label quality, similarity, z)
    other: int = -1  # the other image of a duplicate pair
    across_splits: bool = False


@dataclass
class Findings:
    probs: np.ndarray  # out-of-sample class probabilities [N, K]
    suspects: list[Suspect]  # most likely first
    class_counts: dict[str, int]
    imbalanced: list[str] = field(default_factory=list)  # the classes prepare warns about
    cv_accuracy: float = 0.0

    def count(self, reason: str, across: bool | None = None) -> int:
        return sum(
            s.reason == reason and (across is None or s.across_splits == across)
            for s in self.suspects
        )


def out_of_sample_probs(x: np.ndarray, labels: np.ndarray, classes: int, seed: int) -> np.ndarray:
    """Each image's class probabilities from models that never saw it: a standardised
    logistic regression, ``FOLDS``-fold stratified (fewer when a class is smaller), the
    mean over ``SPLITS`` seeded fold splits."""
    smallest = int(np.bincount(labels, minlength=classes).min())
    folds = max(2, min(FOLDS, smallest)) if smallest else FOLDS
    model = make_pipeline(StandardScaler(), LogisticRegression(C=C, max_iter=300))
    probs = np.zeros((len(labels), classes))
    for split in range(SPLITS):
        cv = StratifiedKFold(folds, shuffle=True, random_state=seed + split)
        with warnings.catch_warnings():  # a class smaller than the folds: sklearn says so
            warnings.simplefilter("ignore", UserWarning)
            fold = cross_val_predict(model, x, labels, cv=cv, method="predict_proba")
        # a class absent from the labels given: probability 0
        probs[:, : fold.shape[1]] += fold / SPLITS
    return probs


def label_suspects(labels: np.ndarray, probs: np.ndarray) -> list[Suspect]:
    """Every image whose out-of-sample prediction is not its label (cleanlab's
    ``predicted_neq_given``), least label quality (cleanlab's self-confidence) first.

    Not confident learning's pruning (``prune_by_noise_rate``): it estimates each class's
    noise rate from the images, and with 20 a class it left out a flipped label ranked third
    of 64 (tests/commands/test_audit.py); the ranking, which is what a reviewer reads from
    the top, is the same either way."""
    quality = get_label_quality_scores(labels, probs, method="self_confidence")
    issues = find_label_issues(labels, probs, filter_by="predicted_neq_given")
    order = np.flatnonzero(issues)[np.argsort(quality[issues], kind="stable")]
    return [Suspect(int(i), "label", float(1.0 - quality[i])) for i in order]


def neighbours(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(indices, cosine similarities) of each row's ``k`` nearest other rows, nearest first."""
    unit = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    k = min(k, len(x) - 1)
    idx = np.empty((len(x), k), np.int64)
    sim = np.empty((len(x), k), np.float32)
    for start in range(0, len(x), BLOCK):
        s = unit[start : start + BLOCK] @ unit.T
        rows = np.arange(s.shape[0])
        s[rows, rows + start] = -np.inf  # not its own neighbour
        top = np.argpartition(-s, k - 1, axis=1)[:, :k] if k < s.shape[1] else np.argsort(-s)
        order = np.argsort(-np.take_along_axis(s, top, 1), axis=1, kind="stable")
        idx[start : start + len(s)] = np.take_along_axis(top, order, 1)
        sim[start : start + len(s)] = np.take_along_axis(s, idx[start : start + len(s)], 1)
    return idx, sim


def _split_rank(split: str) -> int:
    return {"train": 0, "val": 1, "test": 2}.get(split, 3)


def tiny_images(pixels: np.ndarray) -> np.ndarray:
    """uint8 ``[N, 3, H, W]`` -> float32 ``[N, TINY_DIM]``: block means on a TINY grid
    (H and W multiples of TINY), what near duplicates are confirmed by."""
    n, c, h, w = pixels.shape
    blocks = np.asarray(pixels, np.float32).reshape(n, c, TINY, h // TINY, TINY, w // TINY)
    return blocks.mean((3, 5)).reshape(n, -1)


def duplicate_suspects(
    hashes: list[str], splits: np.ndarray, idx: np.ndarray, sim: np.ndarray, tiny: np.ndarray
) -> list[Suspect]:
    """Exact duplicates (one row per copy after the first) and near duplicate pairs (once
    each): the copy named is the one in the later split (train < val < test), the one
    leakage says to remove."""
    out: list[Suspect] = []
    first: dict[str, int] = {}
    order = sorted(range(len(hashes)), key=lambda i: (_split_rank(splits[i]), i))
    for i in order:
        j = first.setdefault(hashes[i], i)
        if j != i:
            out.append(Suspect(i, "exact duplicate", 1.0, j, bool(splits[i] != splits[j])))
    seen: set[tuple[int, int]] = set()
    for i, j in zip(*np.nonzero(sim >= NEAR_EMBEDDING), strict=True):
        a, b = sorted((i, int(idx[i, j])), key=lambda t: (_split_rank(splits[t]), t))
        apart = float(np.abs(tiny[a] - tiny[b]).mean())
        if hashes[a] == hashes[b] or (a, b) in seen or apart > NEAR_PIXELS:
            continue
        seen.add((a, b))
        across = bool(splits[a] != splits[b])
        out.append(Suspect(b, "near duplicate", round(1.0 - apart / 255.0, 4), a, across))
    return out


def outlier_suspects(sim: np.ndarray) -> list[Suspect]:
    """Images far from every other: mean cosine distance to the nearest ``NEIGHBOURS`` with
    a robust z-score (median, MAD) over ``OUTLIER_Z``."""
    distance = 1.0 - sim[:, :NEIGHBOURS].mean(1)
    median = float(np.median(distance))
    mad = float(np.median(np.abs(distance - median))) * 1.4826 or 1e-12
    z = (distance - median) / mad
    return [Suspect(int(i), "outlier", float(z[i])) for i in np.flatnonzero(z > OUTLIER_Z)]


def imbalanced_classes(classes: tuple[str, ...], labels: np.ndarray) -> list[str]:
    """The classes prepare warns about: under ``TINY_CLASS`` images, or ``IMBALANCE_RATIO``
    times smaller than the largest."""
    counts = np.bincount(labels, minlength=len(classes))
    big = counts.max()
    return [
        c
        for c, n in zip(classes, counts, strict=True)
        if n < TINY_CLASS or n * IMBALANCE_RATIO < big
    ]


# Most likely first: leakage is certain, a label the model doubts is likely, a same-split
# copy is only wasted, an outlier is for a person to judge.
_PRIORITY = [
    ("exact duplicate", True),
    ("near duplicate", True),
    ("label", False),
    ("exact duplicate", False),
    ("near duplicate", False),
    ("outlier", False),
]


def audit(
    x: np.ndarray,
    tiny: np.ndarray,
    labels: np.ndarray,
    splits: np.ndarray,
    hashes: list[str],
    classes: tuple[str, ...],
    seed: int,
) -> Findings:
    """Every finding for these images (rows of ``x``, their embeddings, and of ``tiny``,
    their ``tiny_images``), the suspects most likely first."""
    # One BLAS thread: the fits are small, and on a busy 2-core machine OpenBLAS's spinning
    # threads made the cross-validation 90x slower (76 s instead of 0.8 s for 128 images).
    with threadpool_limits(1):
        probs = out_of_sample_probs(x, labels, len(classes), seed)
        idx, sim = neighbours(x, NEIGHBOURS)
    found = label_suspects(labels, probs) + duplicate_suspects(hashes, splits, idx, sim, tiny)
    found += outlier_suspects(sim)
    rank = {key: r for r, key in enumerate(_PRIORITY)}
    found.sort(key=lambda s: (rank[(s.reason, s.across_splits)], -s.score))
    counts = np.bincount(labels, minlength=len(classes))
    return Findings(
        probs=probs,
        suspects=found,
        class_counts={c: int(n) for c, n in zip(classes, counts, strict=True)},
        imbalanced=imbalanced_classes(classes, labels),
        cv_accuracy=float((probs.argmax(1) == labels).mean()),
    )
