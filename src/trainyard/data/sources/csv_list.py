"""CSV source: a CSV file listing images and their labels -> the prepared format.

One row per image (``image,label,split``: a path relative to the CSV's folder, an absolute
path or an http(s) URL; the class; train/val/test or blank); the columns' params, the
split's aliases, ``.tsv`` and what counts as a bad file are docs/own-images.md's CSV
section. Every problem with the table itself is listed with its row and column, all at
once; the rest (inspect, split, decode, write, card) is every image-file source's
(``trainyard.data.image_files``).
"""

from __future__ import annotations

import logging
import tempfile
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainyard import __version__
from trainyard.core.errors import DataError
from trainyard.core.io import sha256_file
from trainyard.core.progress import Progress
from trainyard.data.fingerprint import error_kind, is_url, stat_fingerprint
from trainyard.data.image_files import (
    PROGRESS_EVERY_S,
    ImageFile,
    ImageSet,
    expected_image_set,
)
from trainyard.data.prepared_writer import Expected
from trainyard.data.sources.list_files import Wanted, raise_problems, read_csv
from trainyard.data.splits import estimated_counts

if TYPE_CHECKING:
    from trainyard.core.config import DataParams

log = logging.getLogger(__name__)

SOURCE = "csv"
KEY = "data.csv"
# A split cell, lower-cased -> the split (the names public datasets use).
SPLIT_NAMES = {
    "train": "train",
    "training": "train",
    "val": "val",
    "valid": "val",
    "validation": "val",
    "test": "test",
    "testing": "test",
}
DOWNLOAD_THREADS = 8  # downloads wait on the network, not the CPU
_BLOCK = 1 << 16


@dataclass(frozen=True)
class Row:
    """One image row of the CSV."""

    line: int  # the CSV's line number (the header is line 1): what errors name
    image: str  # as written: a path or a URL
    label: str
    split: str | None  # train | val | test, or None: prepare splits

    @property
    def rel(self) -> str:
        """How the card and errors name this image."""
        return f"row {self.line}: {self.image}"

    @property
    def is_url(self) -> bool:
        return is_url(self.image)


@dataclass(frozen=True)
class Listing:
    """A validated CSV: its rows and their classes."""

    path: Path
    rows: list[Row]
    classes: tuple[str, ...]
    split_column: str | None  # the split column read, None when the CSV has none


def csv_path(params: DataParams, root: Path | None = None) -> Path:
    """``data.csv`` as a path; a relative one is relative to ``root`` (default: cwd)."""
    path = Path(params.csv).expanduser()
    if not path.is_absolute():
        path = (root or Path.cwd()) / path
    return path.resolve()


def _wanted(params: DataParams) -> list[Wanted]:
    """The columns this source reads: image and label, and split when one is named."""
    wanted = [
        Wanted(params.csv_image_column, "data.csv_image_column", "image"),
        Wanted(params.csv_label_column, "data.csv_label_column", "label"),
    ]
    if params.csv_split_column is not None:
        wanted.append(Wanted(params.csv_split_column, "data.csv_split_column", "split", False))
    return wanted


def _row(
    line: int, cells: dict[str, str], params: DataParams, problems: list[tuple[int, str]]
) -> Row | None:
    """One data row, or None (its problems go to ``problems``, naming row and column)."""
    image, label, given = cells["image"], cells["label"], cells.get("split", "")
    found = []
    if "://" in image and not is_url(image):
        found.append(
            f"column {params.csv_image_column!r}: {image!r} is neither a file path nor an "
            "http(s) URL"
        )
    if given and given.lower() not in SPLIT_NAMES:
        found.append(
            f"column {params.csv_split_column!r}: {given!r} is not a split (train, val or "
            "test; blank leaves the row to data.val_fraction / data.test_fraction)"
        )
    problems += [(line, f"row {line}, {problem}") for problem in found]
    return None if found else Row(line, image, label, SPLIT_NAMES[given.lower()] if given else None)


def _sorted_classes(labels: set[str]) -> tuple[str, ...]:
    """Class names sorted, as numbers when every one is an integer (2 before 10)."""
    try:
        return tuple(sorted(labels, key=int))
    except ValueError:
        return tuple(sorted(labels))


def read_listing(params: DataParams, root: Path | None = None) -> Listing:
    """Read and validate ``data.csv`` (no image is opened): DataError listing every row
    problem at once, each with its row and column."""
    path = csv_path(params, root)
    if not path.is_file():
        raise DataError(
            f"{KEY}: {path} {'is a folder' if path.is_dir() else 'does not exist'}; set "
            "data.csv to a CSV file of image paths or URLs and labels (image,label[,split])"
        )
    listed = read_csv(path, KEY, _wanted(params))
    problems = list(listed.problems)
    rows = [r for line, cells in listed.rows if (r := _row(line, cells, params, problems))]
    raise_problems(KEY, path, problems)
    classes = _sorted_classes({r.label for r in rows})
    if len(classes) < 2:
        found = f"only the class {classes[0]!r}" if classes else "no image rows"
        raise DataError(f"{KEY}: {path} has {found}; a classifier needs at least 2 classes")
    _check_given_splits(path, rows, classes)
    split = params.csv_split_column if "split" in listed.found else None
    return Listing(path, rows, classes, split)


def _check_given_splits(path: Path, rows: list[Row], classes: tuple[str, ...]) -> None:
    """Every class needs a train image: a class whose rows all say val or test cannot be
    learnt (rows without a split are train's pool)."""
    train = {r.label for r in rows if r.split in (None, "train")}
    lacking = [c for c in classes if c not in train]
    if lacking:
        raise DataError(
            f"{KEY}: in {path}, class(es) {', '.join(repr(c) for c in lacking[:10])} have no "
            "train rows (all of them say val or test); give them train images"
        )


def download(url: str, dest: Path, timeout: float, max_bytes: int) -> str | None:
    """Fetch ``url`` into ``dest``; None, or why it failed (a bad file's reason)."""
    request = urllib.request.Request(url, headers={"User-Agent": f"trainyard/{__version__}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            size = response.headers.get("Content-Length")
            if size is not None and size.isdigit() and int(size) > max_bytes:
                return f"download of {size} bytes is over data.csv_max_download_bytes ({max_bytes})"
            got = 0
            with open(dest, "wb") as out:
                while block := response.read(_BLOCK):
                    got += len(block)
                    if got > max_bytes:
                        return f"download is over data.csv_max_download_bytes ({max_bytes} bytes)"
                    out.write(block)
    except urllib.error.HTTPError as err:
        return f"download failed: HTTP {err.code} {err.reason}"
    except urllib.error.URLError as err:
        if isinstance(err.reason, TimeoutError):
            return f"download timed out after {timeout:g} s (data.download_timeout_s)"
        return f"download failed: {err.reason}"
    except TimeoutError:
        return f"download timed out after {timeout:g} s (data.download_timeout_s)"
    except OSError as err:  # a reset connection, a full disk
        return f"download failed: {err}"
    return None


def _fetch_urls(
    rows: list[Row], folder: Path, params: DataParams, bad: list[tuple[str, str]]
) -> dict[str, Path]:
    """Download every URL the rows name (each once) into ``folder``: URL -> local file.
    Failures go to ``bad`` (every row naming that URL) and are left out of the result."""
    urls = sorted({r.image for r in rows if r.is_url})
    if not urls:
        return {}
    dests = {url: folder / f"{i:07d}" for i, url in enumerate(urls)}
    timeout, cap = params.download_timeout_s, params.csv_max_download_bytes
    log.info("downloading %d image URL(s) listed in %s", len(urls), KEY)
    failed: dict[str, str] = {}
    pool = ThreadPoolExecutor(min(DOWNLOAD_THREADS, len(urls)))
    try:
        with Progress(len(urls), "downloading", "images", PROGRESS_EVERY_S) as progress:
            futures = {url: pool.submit(download, url, dests[url], timeout, cap) for url in urls}
            for url, future in futures.items():
                problem = future.result()
                if problem is not None:
                    failed[url] = problem
                progress.update(1)
    finally:
        # Ctrl-C or SIGTERM: the queued downloads are dropped, not all run first.
        pool.shutdown(wait=True, cancel_futures=True)
    for r in rows:
        if r.image in failed:
            bad.append((r.rel, failed[r.image]))
    return {url: dest for url, dest in dests.items() if url not in failed}


def _image_files(
    listing: Listing, local: dict[str, Path], bad: list[tuple[str, str]]
) -> list[ImageFile]:
    """The rows as image files to read; a row whose file is missing (or whose download
    failed) goes to ``bad`` instead."""
    index = {name: i for i, name in enumerate(listing.classes)}
    files = []
    for r in listing.rows:
        if r.is_url:
            if r.image not in local:
                continue  # already in bad: its download failed
            path = local[r.image]
        else:
            path = Path(r.image).expanduser()
            path = path if path.is_absolute() else listing.path.parent / path
            if not path.is_file():
                what = "a folder, not an image" if path.is_dir() else "missing file"
                bad.append((r.rel, f"{what} ({path})"))
                continue
        files.append(ImageFile(path, r.rel, index[r.label], r.split))
    return files


@contextmanager
def csv_images(params: DataParams) -> Iterator[ImageSet]:
    """The images ``params.csv`` lists, for ``prepare_image_set``: URLs are downloaded into
    a temporary folder, removed when the block ends."""
    listing = read_listing(params)
    rows = listing.rows
    n_urls = len({r.image for r in rows if r.is_url})
    log.info(
        "csv %s: %d rows in %d classes (%s)",
        listing.path,
        len(rows),
        len(listing.classes),
        f"split column {listing.split_column!r}" if listing.split_column else "no split column",
    )
    with tempfile.TemporaryDirectory(prefix="trainyard-csv-") as tmp:
        bad: list[tuple[str, str]] = []
        local = _fetch_urls(rows, Path(tmp), params, bad)
        yield ImageSet(
            source=SOURCE,
            key=KEY,
            where=listing.path,
            classes=listing.classes,
            files=_image_files(listing, local, bad),
            bad=bad,
            # The file's name, not its path: the card changes only with the data.
            extra={
                "csv": listing.path.name,
                "rows": len(rows),
                "urls": n_urls,
                "columns": {
                    "image": params.csv_image_column,
                    "label": params.csv_label_column,
                    "split": listing.split_column,
                },
            },
        )


def describe_csv(params: DataParams, root: Path) -> Expected:
    """What prepare will make of ``params.csv`` (relative to ``root``), before it runs: its
    rows counted (no image opened, no URL fetched), times C*H*W of data.image_size (channels
    ``auto`` counted as 3, image_size ``auto`` as its largest choice)."""
    listing = read_listing(params, root)
    counts = estimated_counts(Counter(r.split for r in listing.rows), params)
    urls = sum(r.is_url for r in listing.rows)
    split = listing.split_column
    what = (
        f"{len(listing.rows):,} rows of {listing.path} "
        + (f"(split column {split!r}" if split else "(no split column")
        + (f", {urls:,} URLs to download)" if urls else ")")
        + f" in {len(listing.classes)} classes"
    )
    return expected_image_set(counts, params, what)


def fingerprint_csv(params: DataParams, root: Path) -> dict[str, Any]:
    """What ``data.csv`` (relative to ``root``) lists, for ``source_fingerprint``: the CSV
    file's own sha256 and the stat fingerprint of every image it lists (a relative path
    from the CSV's folder, as prepare reads it; a URL by its string). A CSV that cannot be
    read counts by why (prepare will say the rest)."""
    path = csv_path(params, root)
    try:
        digest = sha256_file(path)
    except OSError as err:  # missing, a folder, unreadable
        return {"files": 0, "csv": error_kind(err)}
    try:
        listing = read_listing(params, root)
    except DataError:
        return {"files": 1, "csv": digest, "images": None}
    images = {r.image for r in listing.rows}
    return {
        "files": 1 + len(images),
        "csv": digest,
        "images": stat_fingerprint(images, listing.path.parent),
    }
