"""What ``trainyard predict`` scores: a source -> an ordered list of images (and labels).

A source is a folder (the training walk's rules), a CSV or TSV in the csv source's format,
a text file of paths (``.txt``/``.lst``/``.list``) or a quoted glob: docs/predict.md, "What
it reads". The order is the table's row order, and the same on every machine, so ``--shard
K/N`` slices the same rows everywhere. Labels come from the CSV's label column, or from a
folder whose subfolders are the model's classes (``photos/<class>/...`` or
``photos/test/<class>/...``): then the summary scores the model on them.
"""

from __future__ import annotations

import contextlib
import glob
import math
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from trainyard.core.card import SPLITS
from trainyard.core.errors import DataError
from trainyard.data.fingerprint import is_url, stat_fingerprint
from trainyard.data.sources.list_files import Wanted, raise_problems, read_csv, read_paths
from trainyard.data.walk import UNREADABLE_IMAGES, extension, is_image, rel_path, walk_files

CSV_SUFFIXES = (".csv", ".tsv")
LIST_SUFFIXES = (".txt", ".lst", ".list")
GLOB_MAGIC = frozenset("*?[")
KEY = "predict source"  # what leads the errors about a CSV or list source


@dataclass
class Inputs:
    """The images of one source, in the table's row order."""

    kind: str  # folder | csv | list | glob
    where: Path  # the folder, the CSV or list file, or the glob's fixed prefix
    names: list[str]  # the table's `path` column: relative to ``base``, absolute, or a URL
    base: Path  # where relative names live
    labels: list[str] | None = None  # per row ("" = none), from a CSV's label column
    label_from: str = ""  # what the labels are ("column 'label'", "subfolder names")
    problems: dict[int, str] = field(default_factory=dict)  # row -> reason known before decode
    ignored: int = 0  # files passed over: not images
    _fingerprint: str = field(default="", repr=False)
    _ahead: threading.Thread | None = field(default=None, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.names)

    def location(self, i: int) -> str:
        """What the decode worker reads for row ``i``: an absolute path or a URL."""
        name = self.names[i]
        # A folder's names are paths under it: no URL to look for (a million rows: seconds).
        if self.kind != "folder" and (is_url(name) or os.path.isabs(name)):
            return name
        return os.path.join(self.base, name)

    def fingerprint(self) -> str:
        """The source's stat fingerprint (``trainyard.data.fingerprint``): a resumed run
        refuses to continue over files that changed, and MLflow records it. Computed once
        (a stat per file: seconds for a million), in the thread ``fingerprint_ahead``
        started when there is one."""
        if self._ahead is not None:
            self._ahead.join()
            self._ahead = None
        if not self._fingerprint:
            self._fingerprint = self._stats()
        return self._fingerprint

    def fingerprint_ahead(self) -> None:
        """Start the fingerprint in a thread: the stats overlap the model's loading and
        probing (ONNX Runtime releases the GIL), a fifth of a second of start-up for 20,000
        files. ``fingerprint`` waits for it; an error there is computed again and raised."""
        if self._fingerprint or self._ahead is not None:
            return
        self._ahead = threading.Thread(target=self._fingerprint_quietly, daemon=True)
        self._ahead.start()

    def _fingerprint_quietly(self) -> None:
        with contextlib.suppress(Exception):  # fingerprint() computes it again, and raises
            self._fingerprint = self._stats()

    def _stats(self) -> str:
        return stat_fingerprint((self.location(i) for i in range(len(self))), self.base)


def parse_shard(text: str) -> tuple[int, int]:
    """``K/N`` (0 <= K < N, 0-based like a Kubernetes Indexed Job's completion index)."""
    try:
        k, n = (int(part) for part in text.split("/"))
    except ValueError:
        k = n = -1
    if not (n >= 1 and 0 <= k < n):
        raise DataError(
            f"--shard {text!r}: expected K/N with 0 <= K < N (0-based, as a Kubernetes "
            "Indexed Job's JOB_COMPLETION_INDEX): --shard 0/4 ... --shard 3/4"
        )
    return k, n


def shard_range(total: int, k: int, n: int) -> tuple[int, int]:
    """Rows [start, stop) of shard ``k`` of ``n``: contiguous, so the shards' tables,
    concatenated in shard order, are the table of one run over the whole source."""
    return total * k // n, total * (k + 1) // n


def list_inputs(source: str, *, image_column: str = "image", label_column: str = "label") -> Inputs:
    """The images ``source`` names (a folder, CSV, text file of paths or glob); DataError
    naming the source when it is none of these or holds no image."""
    path = Path(source).expanduser()
    if path.is_dir():
        found = _folder(path.resolve())
    elif GLOB_MAGIC & set(source):
        found = _glob(source)
    elif path.suffix.lower() in CSV_SUFFIXES and path.is_file():
        found = _csv(path.resolve(), image_column, label_column)
    elif path.suffix.lower() in LIST_SUFFIXES and path.is_file():
        found = _list(path.resolve())
    elif not path.exists():
        raise DataError(f"predict source {source}: no such folder or file")
    else:
        raise DataError(
            f"predict source {source}: not a folder, a CSV (.csv/.tsv), a text file of paths "
            f"({'/'.join(LIST_SUFFIXES)}) or a glob ('photos/**/*.jpg')"
        )
    if not found.names:
        raise DataError(f"predict source {source}: no image found (formats: see docs/predict.md)")
    return found


def _folder(root: Path) -> Inputs:
    bad: list[tuple[str, str]] = []
    names, ignored = [], 0
    problems: dict[str, str] = {}
    prefix = os.path.join(root, "")
    for path in walk_files(root, root, bad):
        ext = extension(path)
        # The walk's paths are under the root: their names by slicing, not Path.relative_to.
        text = str(path)
        rel = text[len(prefix) :] if text.startswith(prefix) else rel_path(path, root)
        if is_image(path):
            names.append(rel)
        elif ext in UNREADABLE_IMAGES:  # an image all the same: a row that says why
            names.append(rel)
            problems[rel] = f"{ext} images are not a format trainyard reads"
        else:
            ignored += 1
    for rel, reason in bad:  # unreadable folders, broken symlinks: rows with their reason
        names.append(rel)
        problems[rel] = reason
    names.sort()
    index = {name: i for i, name in enumerate(names)}
    rows = {index[rel]: reason for rel, reason in problems.items()}
    return Inputs("folder", root, names, root, problems=rows, ignored=ignored)


def folder_labels(inputs: Inputs, classes: list[str]) -> None:
    """Label a folder's rows by their subfolder, when every image sits under a folder named
    after one of the model's classes (``<class>/`` or ``<split>/<class>/``; a class name
    with a slash, Fashion-MNIST's ``T-shirt/top``, is its nested folders)."""
    if inputs.kind != "folder":
        return
    by_length = sorted(classes, key=len, reverse=True)  # "T-shirt/top" before "T-shirt"
    labels = []
    for name in inputs.names:
        head, _, rest = name.partition("/")
        within = rest if head in SPLITS else name
        found = next((c for c in by_length if within.startswith(c + "/")), None)
        if found is None:
            found = next((c for c in by_length if name.startswith(c + "/")), None)
        if found is None:
            return
        labels.append(found)
    inputs.labels, inputs.label_from = labels, "subfolder names"


def _glob(pattern: str) -> Inputs:
    expanded = os.path.expanduser(pattern)
    fixed = Path(expanded.split("*")[0].split("?")[0].split("[")[0])
    base = (fixed if expanded.endswith(os.sep) or fixed.is_dir() else fixed.parent).resolve()
    paths = sorted(
        os.path.realpath(p) if os.path.islink(p) else os.path.abspath(p)
        for p in glob.glob(expanded, recursive=True)
        if os.path.isfile(p) and is_image(Path(p))
    )
    names = [rel_path(Path(p), base) for p in paths]
    return Inputs("glob", base, names, base)


def _list(path: Path) -> Inputs:
    return Inputs("list", path, read_paths(path, KEY), path.parent)


def _csv(path: Path, image_column: str, label_column: str) -> Inputs:
    wanted = [
        Wanted(image_column, "data.csv_image_column", "image"),
        Wanted(label_column, "data.csv_label_column", "label", required=False),
    ]
    listed = read_csv(path, KEY, wanted)
    raise_problems(KEY, path, listed.problems)
    names = [cells["image"] for _, cells in listed.rows]
    labels = [cells.get("label", "") for _, cells in listed.rows]
    given = "label" in listed.found and any(labels)
    return Inputs(
        "csv",
        path,
        names,
        path.parent,
        labels=labels if given else None,
        label_from=f"column {label_column!r}" if given else "",
    )


def chunk_count(rows: int, chunk_rows: int) -> int:
    """Chunks of ``chunk_rows`` rows (the last one shorter) covering ``rows`` rows."""
    return max(1, math.ceil(rows / chunk_rows))
