"""benchmarks.audit_planted, the pure parts of make bench-audit: the planted faults are what
it says (seeded, the flipped share, copies only of train images and only into val/test),
and the scoring counts a suspects CSV's hits and misses as it should."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
from PIL import Image

from benchmarks.audit_planted import planted_tree, score


def pool(root: Path, classes: int = 3, per_class: int = 20) -> Path:
    rng = np.random.default_rng(0)
    for c in range(classes):
        (root / f"c{c}").mkdir(parents=True)
        for k in range(per_class):
            pixels = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / f"c{c}" / f"{k:02d}.png")
    return root


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_planted_tree_flips_and_copies_what_it_says(tmp_path):
    src = pool(tmp_path / "src")
    tree = planted_tree(src, tmp_path / "t", flip=0.1, dups=2, seed=1)
    again = planted_tree(src, tmp_path / "t2", flip=0.1, dups=2, seed=1)
    assert tree.flipped == again.flipped and tree.exact == again.exact  # seeded
    assert len(tree.flipped) == 6 and tree.images == 60 + 4
    for rel, true in tree.flipped.items():
        assert rel.split("/")[1] != true  # filed under another class
        assert (tmp_path / "t" / rel).resolve().parent.name == true
    for rel in tree.exact + tree.near:
        assert rel.split("/")[0] in ("val", "test")
    originals = {sha(p): p for p in (tmp_path / "t" / "train").rglob("*.png")}
    assert all(sha(tmp_path / "t" / rel) in originals for rel in tree.exact)
    assert all(sha(tmp_path / "t" / rel) not in originals for rel in tree.near)  # re-encoded
    assert all(Image.open(tmp_path / "t" / rel).format == "WEBP" for rel in tree.near)


def test_score_counts_hits_misses_and_other_pairs(tmp_path):
    tree = planted_tree(pool(tmp_path / "src"), tmp_path / "t", flip=0.1, dups=2, seed=1)
    flipped = sorted(tree.flipped)
    row = dict.fromkeys(("file", "reason", "given_label", "suggested_label", "other_file"), "")
    rows = [
        row | {"file": tree.exact[0], "reason": "exact duplicate across splits (train -> val)"},
        row | {"file": "x", "other_file": tree.near[1], "reason": "near duplicate across splits"},
        row | {"file": "y", "other_file": "z", "reason": "near duplicate across splits"},
        *(
            row | {"file": f, "reason": "label", "suggested_label": tree.flipped[f]}
            for f in flipped[:4]
        ),
        row | {"file": "not-flipped", "reason": "label"},
        *(row | {"file": f, "reason": "label"} for f in flipped[4:]),
    ]
    found = score(tree, rows)
    assert found["flipped"] == 6 and found["label_suspects"] == 7
    assert found["precision_at_k"] == found["recall_at_k"] == round(5 / 6, 3)
    assert found["recall_all_suspects"] == 1.0 and found["suggested_right"] == 0.8
    # read from the top: 4/4, then 4/5, 5/6, 6/7 flips, all at least 70%
    assert found["recall_at_precision_70"] == 1.0 and found["suspects_read_at_precision_70"] == 7
    assert (found["exact_found"], found["near_found"]) == (1, 1)
    assert found["other_pairs_across_splits"] == 1
