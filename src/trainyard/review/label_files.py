"""Where a reviewed label lives in a class-per-folder tree, and the files the labelling loop
keeps beside the images: ``.trainyard/`` (hidden, so prepare's walk and the audit pass it
over, and ``dvc add`` versions it with the images) holds the manifest ``labels.jsonl`` and,
while a pull runs, its journal and the served images it is about to add.
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath
from typing import Any

from trainyard.core.card import SPLITS
from trainyard.core.io import atomic_write_text

KEY = "trainyard_sha256"  # a task's image, by its bytes: what makes a push idempotent
STATE = ".trainyard"
MANIFEST = f"{STATE}/labels.jsonl"
JOURNAL = f"{STATE}/label-pull.journal.json"
INCOMING = f"{STATE}/incoming"


def project_title(folder: Path) -> str:
    """The default project title: the folder's name."""
    return f"trainyard: {folder.resolve().name}"


def has_splits(rel: str) -> bool:
    """A path of the ``{train,val,test}/<class>/...`` layout (else ``<class>/...``)."""
    return PurePosixPath(rel).parts[0] in SPLITS


def label_of(rel: str) -> str:
    """The class a file is filed under, from its path relative to the folder."""
    parts = PurePosixPath(rel).parts
    return parts[1] if has_splits(rel) else parts[0]


def refiled(rel: str, label: str) -> str:
    """``rel`` moved to the class ``label``'s folder (same split, same subfolders)."""
    parts = list(PurePosixPath(rel).parts)
    parts[1 if has_splits(rel) else 0] = label
    return PurePosixPath(*parts).as_posix()


def free_name(folder: Path, rel: str, taken: set[str], tag: str) -> str:
    """``rel``, or ``rel`` with ``-tag`` before its extension when that name is in use."""
    if rel not in taken and not (folder / rel).exists():
        return rel
    p = PurePosixPath(rel)
    return p.with_name(f"{p.stem}-{tag}{p.suffix}").as_posix()


def read_manifest(folder: Path) -> list[dict[str, Any]]:
    path = folder / MANIFEST
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def append_manifest(folder: Path, records: list[dict[str, Any]]) -> int:
    """Add the records not already in the manifest (by ``review``); the file is rewritten
    whole and renamed, so a reader sees it before or after, and a rerun adds nothing twice."""
    old = read_manifest(folder)
    known = {r["review"] for r in old}
    new = [r for r in records if r["review"] not in known]
    if new:
        lines = [json.dumps(r, sort_keys=True) for r in old + new]
        atomic_write_text(folder / MANIFEST, "\n".join(lines) + "\n")
    return len(new)
