"""A real folder with known faults planted, and how many of them an audit's CSV finds.

``planted_tree`` lays a class-per-folder pool out as ``train/val/test/<class>/`` (symlinks
to the files, per class and seeded: 70/15/15), then plants, all seeded:

- **flipped labels**: ``flip`` of the images filed under a random other class;
- **exact duplicates across splits**: ``dups`` train images copied (same bytes, a symlink
  to the same file) into val or test;
- **near duplicates across splits**: ``dups`` other train images resized to 80% and
  re-encoded as lossy WebP (alpha kept) into val or test.

``score`` reads the audit's suspects.csv: precision and recall of its first k label
suspects at k = the number flipped, and which planted copies it names.
"""

from __future__ import annotations

import csv
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from trainyard.data.walk import scan_folder

SPLIT_SHARES = (("train", 0.7), ("val", 0.15), ("test", 0.15))


@dataclass
class Planted:
    root: Path
    images: int
    flipped: dict[str, str] = field(default_factory=dict)  # rel path -> its true class
    exact: list[str] = field(default_factory=list)  # rel paths of the planted copies
    near: list[str] = field(default_factory=list)


def _near_copy(src: Path, dest: Path) -> None:
    with Image.open(src) as im:
        im = im.convert("RGBA")
        small = im.resize((max(8, im.width * 4 // 5), max(8, im.height * 4 // 5)), Image.LANCZOS)
        small.save(dest, format="WEBP", quality=80)


def _split_of(n: int, rng: np.random.Generator) -> list[str]:
    """70/15/15 of ``n`` items (at least one train), in a seeded order."""
    cuts = [0]
    for _, share in SPLIT_SHARES[:-1]:
        cuts.append(cuts[-1] + max(1 if not cuts[-1] else 0, round(n * share)))
    out = ["test"] * n
    for (name, _), lo, hi in zip(SPLIT_SHARES, cuts, cuts[1:], strict=False):
        for k in range(lo, min(hi, n)):
            out[k] = name
    return [out[k] for k in rng.permutation(n)]


def planted_tree(
    source: Path, out: Path, flip: float, dups: int, seed: int = 0, per_class: int = 0
) -> Planted:
    """``source``'s pool laid out in splits under ``out`` with the faults planted."""
    scan = scan_folder(source)
    rng = np.random.default_rng(seed)
    if out.exists():
        shutil.rmtree(out)
    files: list[tuple[Path, int, str]] = []  # (file, class, split)
    for c in range(len(scan.classes)):
        members = sorted((e.path for e in scan.entries if e.label == c), key=str)
        if per_class:
            members = [members[k] for k in sorted(rng.permutation(len(members))[:per_class])]
        files += zip(members, [c] * len(members), _split_of(len(members), rng), strict=True)
    n = len(files)
    order = rng.permutation(n)
    train = [i for i in order if files[i][2] == "train"]
    sources = train[: 2 * dups]
    flips = [i for i in order if i not in set(sources)][: round(flip * n)]
    planted = Planted(out, n)
    k = len(scan.classes)
    for i, (path, c, split) in enumerate(files):
        given = (c + int(rng.integers(1, k))) % k if i in set(flips) else c
        rel = f"{split}/{scan.classes[given]}/{i:05d}-{path.name}"
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(path.resolve(), out / rel)
        if given != c:
            planted.flipped[rel] = scan.classes[c]
    for j, i in enumerate(sources):
        path, c, _ = files[i]
        split = ("val", "test")[j % 2]
        folder = out / split / scan.classes[c]
        folder.mkdir(parents=True, exist_ok=True)
        if j < dups:
            rel = f"{split}/{scan.classes[c]}/exact-{i:05d}-{path.name}"
            os.symlink(path.resolve(), out / rel)
            planted.exact.append(rel)
        else:
            rel = f"{split}/{scan.classes[c]}/near-{i:05d}-{path.stem}.webp"
            _near_copy(path, out / rel)
            planted.near.append(rel)
    planted.images += len(sources)
    return planted


def read_suspects(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def score(planted: Planted, rows: list[dict[str, str]]) -> dict[str, Any]:
    """What the audit found of what was planted."""
    labels = [r for r in rows if r["reason"] == "label"]
    k = len(planted.flipped)
    top = labels[:k]
    hits = sum(r["file"] in planted.flipped for r in top)
    named = {
        (r["reason"].split(" across")[0], r["file"]) for r in rows if "across splits" in r["reason"]
    }
    named |= {
        (r["reason"].split(" across")[0], r["other_file"])
        for r in rows
        if "across splits" in r["reason"]
    }
    across = [r for r in rows if "across splits" in r["reason"]]
    extra = [
        r
        for r in across
        if r["file"] not in planted.exact + planted.near
        and r["other_file"] not in planted.exact + planted.near
    ]
    suggested = sum(planted.flipped.get(r["file"]) == r["suggested_label"] for r in top)
    # The target reads the list from the top: the most flips found while at least
    # 70% of the suspects read so far are flips.
    hit = np.cumsum([r["file"] in planted.flipped for r in labels])
    keep = [m for m in range(len(labels)) if hit[m] >= 0.7 * (m + 1)]
    at_70 = int(hit[keep[-1]]) if keep else 0
    return {
        "images": planted.images,
        "flipped": k,
        "label_suspects": len(labels),
        "precision_at_k": round(hits / max(1, len(top)), 3),
        "recall_at_k": round(hits / max(1, k), 3),
        "recall_all_suspects": round(
            sum(r["file"] in planted.flipped for r in labels) / max(1, k), 3
        ),
        "suggested_right": round(suggested / max(1, hits), 3),
        "recall_at_precision_70": round(at_70 / max(1, k), 3),
        "suspects_read_at_precision_70": keep[-1] + 1 if keep else 0,
        "exact_planted": len(planted.exact),
        "exact_found": sum(("exact duplicate", f) in named for f in planted.exact),
        "near_planted": len(planted.near),
        "near_found": sum(("near duplicate", f) in named for f in planted.near),
        "other_pairs_across_splits": len(extra),
    }
