"""What every source made of image files shares: a list of files -> the prepared format.

A source (``sources.folder``, ``sources.csv_list``) finds its files, their classes and any
splits they come with, and hands them over as an ``ImageSet``; ``prepare_image_set`` does
the rest, the same way for all of them:

- **inspect** (``file_workers.inspect_files``): read each file once, its sha256 and its
  header (format, size, grayscale or not), which decides the channels, the image size
  (``data.image_size: auto``: ``auto_image_size``), the splits and the duplicates before any
  pixel is decoded;
- **split** (``splits``: ``assign_splits``, ``find_duplicates``): the source's own splits
  where given, else a seeded stratified draw (``data.val_fraction``, ``data.test_fraction``);
- **decode** (``file_workers.decode_files``, with ``decode_spec``): each image through
  ``trainyard.core.imaging.image_to_pixels`` (the service's decoder) straight into its row of
  a memory-mapped array;
- **write** (``write_split``, ``image_set_card``): the splits and the dataset card;
- **bad files** (``check_bad_files``): a file that cannot be read or decoded stops prepare
  with a list of every one (``data.on_bad_file: error``), or is left out and recorded in the
  card (``skip``).

Both passes run in a process pool (``FilePool``, ``data.workers``), one image at a time
per process, under one budget of decoded bytes in flight (``data.decode_budget``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import statistics
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from trainyard.core.card import SPLITS, Card
from trainyard.core.errors import DataError
from trainyard.core.progress import Progress
from trainyard.data.decode_budget import DECODE_BUDGET, DecodeBudget, install
from trainyard.data.file_workers import TRAINING_ASPECT, decode_files, inspect_files
from trainyard.data.image_size import (
    AUTO_SIZE_MAX,
    SAMPLE_MAX_PIXELS,
    background_fill,
    choose_image_size,
)
from trainyard.data.prepared_writer import Expected, PreparedWriter, open_prepared
from trainyard.data.splits import check_balance, split_files

if TYPE_CHECKING:
    from trainyard.core.config import DataParams

log = logging.getLogger(__name__)

CHUNK = 64  # files per pool task: big enough to amortise the hop, small for balance
MAX_LISTED = 50  # bad files spelled out in an error message (all are in the log)
PROGRESS_EVERY_S = 10.0  # off a terminal: a progress INFO line this often, per pass


@dataclass
class ImageFile:
    """One image of a source."""

    path: Path  # the local file to read
    rel: str  # what the card and errors show: a path relative to the source, a CSV row
    label: int  # index into the source's classes
    split: str | None  # the source's own split, or None when prepare splits


@dataclass
class ImageSet:
    """What a source found, ready for ``prepare_image_set``."""

    source: str  # the card's ``source``
    key: str  # the params key errors name (``data.folder``, ``data.csv``)
    where: Path  # the folder or file, as error messages show it
    classes: tuple[str, ...]
    files: list[ImageFile]
    bad: list[tuple[str, str]] = field(default_factory=list)  # (rel, reason) found early
    ignored: int = 0  # files passed over (not images): the card's ``ignored``
    extra: dict[str, Any] = field(default_factory=dict)  # the source's facts for the card


# ------------------------------------------------------------------ pool work (both passes)


def _chunks(n: int) -> Iterator[slice]:
    for start in range(0, n, CHUNK):
        yield slice(start, min(start + CHUNK, n))


class FilePool:
    """A process pool of ``workers``, or the calling process when 1 (tests, tiny sets)."""

    def __init__(self, workers: int) -> None:
        self.executor = None
        if workers > 1:  # the workers share one budget of decoded bytes
            budget = (DecodeBudget(DECODE_BUDGET),)
            self.executor = ProcessPoolExecutor(workers, initializer=install, initargs=budget)

    def map(
        self,
        fn: Any,
        calls: list[tuple[Any, ...]],
        progress: Progress | None = None,
        sizes: list[int] | None = None,
    ) -> list[Any]:
        """``fn(*call)`` for every call, in order; ``progress`` advances by the call's
        ``sizes`` entry as each one completes (a large set shows it is alive)."""
        step = sizes or [0] * len(calls)
        if self.executor is None:
            out = []
            for args, n in zip(calls, step, strict=True):
                out.append(fn(*args))
                if progress is not None:
                    progress.update(n)
            return out
        futures = {self.executor.submit(fn, *args): n for args, n in zip(calls, step, strict=True)}
        for done in as_completed(futures):
            done.result()  # the first failure stops the stage here
            if progress is not None:
                progress.update(futures[done])
        return [f.result() for f in futures]

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(cancel_futures=True)


def worker_count(params: DataParams) -> int:
    """``data.workers``: ``auto`` = one per core this process may use."""
    if params.workers == "auto":
        return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
    return int(params.workers)


# ------------------------------------------------------------------ size and decoding


def expected_image_set(
    counts: dict[str, int], params: DataParams, what: str, channels_auto: str = "counted as 3"
) -> Expected:
    """A source's estimate before prepare runs: ``counts`` images times C*H*W of
    data.image_size (channels ``auto`` counted as 3, image_size ``auto`` as its largest
    choice: the larger cases). ``what`` says what was counted, for the doctor's note."""
    c = 3 if params.channels == "auto" else int(params.channels)
    h, w = params.size_hw or (AUTO_SIZE_MAX, AUTO_SIZE_MAX)
    note = (
        f"estimated: {what} at data.image_size {h}x{w}"
        + (" (auto: counted at its largest; prepare picks it)" if params.size_hw is None else "")
        + f", {c} channel(s)"
        + (f" (channels auto: {channels_auto})" if params.channels == "auto" else "")
        + "; nothing prepared yet"
    )
    return Expected(
        counts=counts,
        shape=(c, h, w),
        note=note,
        channels_known=params.channels != "auto",
        size_known=params.size_hw is not None,
    )


def decode_spec(
    params: DataParams, channels: int, max_pixels: int, size: tuple[int, int], fill: int = 0
) -> dict[str, Any]:
    """The ``image_to_pixels`` arguments every image of this dataset is decoded with: the
    card's channels, size, resize policy and background ``fill`` (the service decodes
    uploads the same way)."""
    height, width = size
    return {
        "channels": channels,
        "height": height,
        "width": width,
        "resize": params.resize,
        "fill": fill,
        "interpolation": "bilinear",
        "max_pixels": max_pixels,
        "max_aspect_ratio": TRAINING_ASPECT,
    }


# ------------------------------------------------------------------ writing


def read_headers(
    files: list[ImageFile], pool: FilePool, max_pixels: int, bad: list[tuple[str, str]]
) -> tuple[list[ImageFile], list[str], bool, list[int], tuple[int, list[str]]]:
    """Pass 1: read every file once. Returns the readable files, their sha256, whether all
    of them are grayscale, their shorter sides, and how many carry transparency with the
    paths of those small enough to sample for the background; the unreadable ones go to
    ``bad``."""
    n = len(files)
    paths = [str(f.path) for f in files]
    chunks = list(_chunks(n))
    calls = [(paths[s], max_pixels) for s in chunks]
    with Progress(n, "reading headers", "files", PROGRESS_EVERY_S) as progress:
        results = pool.map(inspect_files, calls, progress, [s.stop - s.start for s in chunks])
    inspected = [r for chunk in results for r in chunk]
    keep = []
    for i, (item, found) in enumerate(zip(files, inspected, strict=True)):
        if found[4] is None:
            keep.append(i)
        else:
            bad.append((item.rel, found[4]))
    kept = [files[i] for i in keep]
    hashes = [inspected[i][0] for i in keep]
    gray = all(inspected[i][1] for i in keep)
    shorter = [min(inspected[i][2], inspected[i][3]) for i in keep]
    clear = [i for i in keep if inspected[i][5]]
    small = [paths[i] for i in clear if inspected[i][2] * inspected[i][3] <= SAMPLE_MAX_PIXELS]
    return kept, hashes, gray, shorter, (len(clear), small)


def write_split(
    writer: PreparedWriter,
    pool: FilePool,
    split: str,
    files: list[ImageFile],
    splits: np.ndarray,
    labels: np.ndarray,
    spec: dict[str, Any],
    bad: list[tuple[str, str]],
    progress: Progress,
    key: str = "data",
) -> list[int]:
    """Pass 2 for one split: decode its images into their array, drop the rows of files
    that fail (they go to ``bad``), write its labels. Returns the indices written."""
    members = [i for i in range(len(files)) if splits[i] == split]
    if not members:
        raise DataError(
            f"{key}: the {split} split would be empty; raise data.{split}_fraction above 0 "
            f"or give the source its own {split} images"
        )
    writer.allocate(split, len(members), (spec["channels"], spec["height"], spec["width"]))
    array = str(writer.images_path(split))
    chunks = list(_chunks(len(members)))
    calls = [
        (array, list(range(s.start, s.stop)), [str(files[i].path) for i in members[s]], spec)
        for s in chunks
    ]
    sizes = [s.stop - s.start for s in chunks]
    failed = [f for chunk in pool.map(decode_files, calls, progress, sizes) for f in chunk]
    for slot, problem in failed:
        bad.append((files[members[slot]].rel, problem))
    failed_slots = {slot for slot, _ in failed}
    written = [m for k, m in enumerate(members) if k not in failed_slots]
    if failed_slots:
        writer.keep_rows(split, [k not in failed_slots for k in range(len(members))])
    writer.write_labels(split, labels[written])
    return written


def bad_files_error(key: str, where: Path, bad: list[tuple[str, str]]) -> DataError:
    """Every bad file, each with why (the first ``MAX_LISTED`` in the message, all in the
    log), and what to do."""
    lines = [f"  {rel}: {reason}" for rel, reason in sorted(bad)]
    shown = lines[:MAX_LISTED]
    more = len(lines) - len(shown)
    for line in lines:  # every one of them, whatever the message shows
        log.error("bad file %s", line.strip())
    return DataError(
        f"{key}: {len(bad)} bad file(s) in {where}:\n"
        + "\n".join(shown)
        + (f"\n  ... and {more} more (all listed in the log above)" if more else "")
        + "\nFix or remove them, or set data.on_bad_file: skip to leave them out "
        "(they are then recorded in the dataset card and in MLflow)."
    )


def check_bad_files(
    images: ImageSet, bad: list[tuple[str, str]], on_bad_file: str, written: dict[str, list[int]]
) -> None:
    """Stop on bad files (``data.on_bad_file: error``) or log each one skipped; stop when a
    split lost every image."""
    if bad and on_bad_file == "error":
        raise bad_files_error(images.key, images.where, bad)
    for rel, reason in sorted(bad):
        log.warning("skipped %s: %s", rel, reason)
    for split in SPLITS:
        if not written[split]:
            raise DataError(f"{images.key}: every {split} image was a bad file")


def image_set_card(
    images: ImageSet,
    params: DataParams,
    seed: int,
    channels: int,
    files: list[ImageFile],
    hashes: list[str],
    bad: list[tuple[str, str]],
    dups: dict[str, list[int]],
    size: tuple[int, int],
    shorter_sides: Sequence[int] = (),
    fill: int = 0,
) -> Card:
    """The dataset card before ``PreparedWriter.finish`` adds counts, statistics and hash."""
    source_hash = hashlib.sha256()
    for f, h in sorted(zip(files, hashes, strict=True), key=lambda t: t[0].rel):
        source_hash.update(f"{f.rel}\0{h}\n".encode())
    n_dups = len(dups["val"]) + len(dups["test"])
    height, width = size
    extra: dict[str, Any] = images.extra | {
        "seed": seed,
        "val_fraction": params.val_fraction,
        "test_fraction": params.test_fraction,
        "channels_param": params.channels,
    }
    if params.image_size == "auto":
        extra["image_size_param"] = "auto"
    if shorter_sides:  # what the recipe reads to judge whether ImageNet features help
        extra["median_shorter_side"] = int(statistics.median(shorter_sides))
    return Card(
        source=images.source,
        classes=images.classes,
        channels=channels,
        height=height,
        width=width,
        mean=(0.0,) * channels,
        std=(1.0,) * channels,
        resize=params.resize,
        fill=fill,
        interpolation="bilinear",
        source_sha256=source_hash.hexdigest(),
        skipped=tuple({"file": rel, "reason": reason} for rel, reason in sorted(bad)),
        ignored=images.ignored,
        duplicates={
            "across_splits": n_dups,
            "val": len(dups["val"]),
            "test": len(dups["test"]),
            "removed": bool(params.dedupe and n_dups),
        },
        # No absolute path and no timing: the card is part of data/prepared, whose
        # DVC hash is the data version; it must change only with the data.
        extra=extra,
    )


def prepare_image_set(
    images: ImageSet,
    params: DataParams,
    out_dir: str | os.PathLike[str],
    seed: int,
    max_image_pixels: int | None = None,
    for_pretrained: bool = False,
) -> Card:
    """Inspect, split, decode and write ``images`` into ``out_dir`` (atomically: nothing is
    left there on an error); return the dataset card.

    ``max_image_pixels`` overrides ``params.max_image_pixels`` (data.max_image_pixels);
    ``for_pretrained``: see ``auto_image_size``.
    """
    max_pixels = max_image_pixels or params.max_image_pixels
    t0 = time.perf_counter()
    pool = FilePool(min(worker_count(params), max(1, len(images.files) // CHUNK)))
    try:
        bad = list(images.bad)
        files, hashes, gray, shorter, clear = read_headers(images.files, pool, max_pixels, bad)
        channels = (1 if gray else 3) if params.channels == "auto" else int(params.channels)
        size = choose_image_size(params, shorter, for_pretrained)
        fill = background_fill(clear[0], len(files), clear[1], seed)
        labels, splits, dups = split_files(files, hashes, images.classes, params, seed, images.key)
        check_balance(images.classes, labels, splits)
        spec = decode_spec(params, channels, max_pixels, size, fill)
        total = int((splits != "dropped").sum())
        with (
            open_prepared(out_dir) as writer,
            Progress(total, "decoding", "images", PROGRESS_EVERY_S) as progress,
        ):
            written = {
                split: write_split(
                    writer, pool, split, files, splits, labels, spec, bad, progress, images.key
                )
                for split in SPLITS
            }
            progress.close()
            check_bad_files(images, bad, params.on_bad_file, written)
            card = image_set_card(
                images, params, seed, channels, files, hashes, bad, dups, size, shorter, fill
            )
            card = writer.finish(card)
    finally:
        pool.close()
    dt = time.perf_counter() - t0
    done = sum(c["total"] for c in card.counts.values())
    log.info("prepared %d images in %.1f s (%.0f images/s)", done, dt, done / dt)
    return card
