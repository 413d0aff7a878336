"""Image-folder source: a class-per-subfolder tree of images -> the prepared format.

Two layouts, found by looking at the folder:

    photos/<class>/**/*.jpg                    one pool, split here (seeded, stratified)
    photos/{train,val,test}/<class>/**/*.jpg   the user's own splits (a missing val or
                                               test is carved out of train)

Classes are the subfolder names, sorted as torchvision's ``ImageFolder`` sorts them.
Hidden files and folders and OS litter (Thumbs.db, desktop.ini, __MACOSX) are passed over
silently, other files without an image extension with an INFO line counting them by
extension, image formats trainyard cannot read (.psd, .svg, camera raw) with a WARNING that
lists them (the rules: ``trainyard.data.walk``, which the doctor shares). A file with an
image extension that cannot be read is a *bad file*: with ``data.on_bad_file: error`` the
stage lists every one of them and stops; with ``skip`` they are left out and recorded in the
card.

Two passes over the files, both in a process pool: the first reads each file once (its
sha256 and its header: format, size, grayscale or not), which decides the channels, the
image size (``data.image_size: auto``), the splits and the duplicates before any pixel is
decoded; the second decodes each image with
``trainyard.core.imaging.image_to_pixels`` straight into its slot of a memory-mapped array, so
neither pass holds more than a few images per process.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import statistics
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from trainyard.core.card import SPLITS, Card
from trainyard.core.errors import DataError, InputError
from trainyard.core.imaging import IMAGE_EXTENSIONS, image_to_pixels, read_header
from trainyard.core.progress import Progress
from trainyard.data.arrays import row_blocks
from trainyard.data.store import PreparedWriter, open_prepared
from trainyard.data.walk import Entry, Scan, scan_folder

if TYPE_CHECKING:
    from trainyard.core.config import DataParams

log = logging.getLogger(__name__)

SOURCE = "folder"
_CHUNK = 64  # files per pool task: big enough to amortise the hop, small for balance
_MAX_LISTED = 50  # bad files spelled out in an error message (all are in the log)
PROGRESS_EVERY_S = 10.0  # off a terminal: a progress INFO line this often, per pass

# The service's aspect-ratio limit (serve.max_aspect_ratio) guards untrusted uploads; a
# user's own long panorama or receipt is training data (the pad canvas stays bounded).
TRAINING_ASPECT = math.inf
# The user's own images are held to data.max_image_pixels (memory), not the service's limit.
LIMIT_KEY = "data.max_image_pixels"
# data.image_size: auto = the median shorter side of the images, clamped to this range: 8x8
# digit scans train at 32 (the smallest size every architecture takes), photos at 64 (CPU
# training stays fast; set image_size yourself for more detail).
AUTO_SIZE_MIN = 32
AUTO_SIZE_MAX = 64
# Class balance warnings (train split): largest/smallest above this ratio, or fewer images.
IMBALANCE_RATIO = 10
TINY_CLASS = 10


# ------------------------------------------------------------------ pool work (both passes)


Inspected = tuple[str, bool, int, int, str | None]  # sha256, grayscale, width, height, problem


def _inspect(paths: Sequence[str], max_pixels: int) -> list[Inspected]:
    """(sha256, grayscale, width, height, problem) per file: pass 1, in a worker."""
    out: list[Inspected] = []
    for p in paths:
        try:
            with open(p, "rb") as fh:
                data = fh.read()
        except OSError as err:
            out.append(("", False, 0, 0, f"unreadable ({err.strerror or err})"))
            continue
        digest = hashlib.sha256(data).hexdigest()
        try:
            header = read_header(
                data,
                max_pixels=max_pixels,
                field="file",
                max_aspect_ratio=TRAINING_ASPECT,
                limit_key=LIMIT_KEY,
            )
        except InputError as err:
            out.append((digest, False, 0, 0, str(err).removeprefix("file: ")))
            continue
        out.append((digest, header.grayscale, header.width, header.height, None))
    return out


def _decode(
    array_path: str, slots: Sequence[int], paths: Sequence[str], spec: dict[str, Any]
) -> list[tuple[int, str]]:
    """Decode ``paths`` into rows ``slots`` of the memory-mapped array: pass 2, in a worker.
    Returns (slot, problem) for the files that failed."""

    images = np.load(array_path, mmap_mode="r+")
    failed = []
    for slot, p in zip(slots, paths, strict=True):
        try:
            with open(p, "rb") as fh:
                data = fh.read()
            images[slot] = image_to_pixels(data, field="file", limit_key=LIMIT_KEY, **spec)
        except InputError as err:
            failed.append((slot, str(err).removeprefix("file: ")))
        except OSError as err:
            failed.append((slot, f"unreadable ({err.strerror or err})"))
    images.flush()
    del images
    return failed


def _chunks(n: int) -> Iterator[slice]:
    for start in range(0, n, _CHUNK):
        yield slice(start, min(start + _CHUNK, n))


class _Pool:
    """A process pool of ``workers``, or the calling process when 1 (tests, tiny sets)."""

    def __init__(self, workers: int) -> None:
        self.executor = ProcessPoolExecutor(workers) if workers > 1 else None

    def map(
        self,
        fn: Any,
        calls: list[tuple[Any, ...]],
        progress: Progress | None = None,
        sizes: list[int] | None = None,
    ) -> list[Any]:
        """``fn(*call)`` for every call, in order; ``progress`` advances by the call's
        ``sizes`` entry as each one completes (a large folder shows it is alive)."""
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


def _workers(params: DataParams) -> int:
    if params.workers == "auto":
        return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
    return int(params.workers)


# ------------------------------------------------------------------ splitting


def assign_splits(
    labels: np.ndarray,
    given: list[str | None],
    classes: tuple[str, ...],
    val_fraction: float,
    test_fraction: float,
    seed: int,
) -> np.ndarray:
    """Split name per item: the layout's own where given, else a seeded stratified draw.

    Items without a given split (flat layout), and train items when the layout has no
    val/ or test/, are split per class: ``round(n * fraction)`` (at least 1) to val and
    test each, the rest to train. A class too small for that is an error naming it.
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
                f"data.folder: class {name!r} has {n} image(s), too few for the stratified "
                f"split (val_fraction {val_fraction}, test_fraction {test_fraction} need at "
                f"least {need}: one per split); add images to it or put your own "
                "train/val/test folders in data.folder"
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


# ------------------------------------------------------------------ the stage


def _bad_files_error(root: Path, bad: list[tuple[str, str]]) -> DataError:
    lines = [f"  {rel}: {reason}" for rel, reason in sorted(bad)]
    shown = lines[:_MAX_LISTED]
    more = len(lines) - len(shown)
    for line in lines:  # every one of them, whatever the message shows
        log.error("bad file %s", line.strip())
    return DataError(
        f"data.folder: {len(bad)} bad file(s) in {root}:\n"
        + "\n".join(shown)
        + (f"\n  ... and {more} more (all listed in the log above)" if more else "")
        + "\nFix or remove them, or set data.on_bad_file: skip to leave them out "
        "(they are then recorded in the dataset card and in MLflow)."
    )


def _first_pass(
    scan: Scan, pool: _Pool, max_pixels: int, bad: list[tuple[str, str]]
) -> tuple[list[Entry], list[str], bool, list[int]]:
    """Pass 1: read every file once. Returns the readable entries, their sha256, whether
    all of them are grayscale and their shorter sides; the unreadable ones go to ``bad``."""
    n = len(scan.entries)
    paths = [str(e.path) for e in scan.entries]
    chunks = list(_chunks(n))
    calls = [(paths[s], max_pixels) for s in chunks]
    with Progress(n, "reading headers", "files", PROGRESS_EVERY_S) as progress:
        results = pool.map(_inspect, calls, progress, [s.stop - s.start for s in chunks])
    inspected = [r for chunk in results for r in chunk]
    keep = []
    for i, (entry, found) in enumerate(zip(scan.entries, inspected, strict=True)):
        if found[4] is None:
            keep.append(i)
        else:
            bad.append((entry.rel, found[4]))
    entries = [scan.entries[i] for i in keep]
    hashes = [inspected[i][0] for i in keep]
    gray = all(inspected[i][1] for i in keep)
    shorter = [min(inspected[i][2], inspected[i][3]) for i in keep]
    return entries, hashes, gray, shorter


def auto_image_size(shorter_sides: Sequence[int]) -> tuple[int, str]:
    """``data.image_size: auto``: the images' median shorter side, clamped to
    ``AUTO_SIZE_MIN``..``AUTO_SIZE_MAX``; returns (size, the reason, for the log)."""
    if not shorter_sides:
        return AUTO_SIZE_MAX, "no readable images"
    median = int(statistics.median(shorter_sides))
    size = min(AUTO_SIZE_MAX, max(AUTO_SIZE_MIN, median))
    how = "" if size == median else f", clamped to {AUTO_SIZE_MIN}..{AUTO_SIZE_MAX}"
    return size, f"the median shorter side of {len(shorter_sides):,} images is {median} px{how}"


def _image_size(params: DataParams, shorter: list[int]) -> tuple[int, int]:
    """(height, width) of the prepared images: data.image_size, or chosen (auto) and logged."""
    if params.size_hw is not None:
        return params.size_hw
    size, reason = auto_image_size(shorter)
    log.info("data.image_size auto: %dx%d (%s); set data.image_size to choose", size, size, reason)
    return size, size


def _check_balance(classes: tuple[str, ...], labels: np.ndarray, splits: np.ndarray) -> None:
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


def _split(
    entries: list[Entry], hashes: list[str], classes: tuple[str, ...], params: DataParams, seed: int
) -> tuple[np.ndarray, np.ndarray, dict[str, list[int]]]:
    """Labels, the split of each entry (``dropped`` for removed duplicates) and the
    duplicates across splits, which are logged as leakage."""
    labels = np.array([e.label for e in entries], dtype=np.int64)
    splits = assign_splits(
        labels,
        [e.split for e in entries],
        classes,
        params.val_fraction,
        params.test_fraction,
        seed,
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


def _decode_spec(
    params: DataParams, channels: int, max_pixels: int, size: tuple[int, int]
) -> dict[str, Any]:
    """The ``image_to_pixels`` arguments every image of this dataset is decoded with."""
    height, width = size
    return {
        "channels": channels,
        "height": height,
        "width": width,
        "resize": params.resize,
        "fill": 0,
        "interpolation": "bilinear",
        "max_pixels": max_pixels,
        "max_aspect_ratio": TRAINING_ASPECT,
    }


def _write_split(
    writer: PreparedWriter,
    pool: _Pool,
    split: str,
    entries: list[Entry],
    splits: np.ndarray,
    labels: np.ndarray,
    spec: dict[str, Any],
    bad: list[tuple[str, str]],
    progress: Progress,
) -> list[int]:
    """Pass 2 for one split: decode its images into their array, drop the rows of files
    that fail (they go to ``bad``), write its labels. Returns the entries written."""
    members = [i for i in range(len(entries)) if splits[i] == split]
    if not members:
        raise DataError(
            f"data.folder: the {split} split would be empty; raise "
            f"data.{split}_fraction above 0 or add a {split}/ folder"
        )
    writer.allocate(split, len(members), (spec["channels"], spec["height"], spec["width"]))
    array = str(writer.images_path(split))
    chunks = list(_chunks(len(members)))
    calls = [
        (array, list(range(s.start, s.stop)), [str(entries[i].path) for i in members[s]], spec)
        for s in chunks
    ]
    sizes = [s.stop - s.start for s in chunks]
    failed = [f for chunk in pool.map(_decode, calls, progress, sizes) for f in chunk]
    for slot, problem in failed:
        bad.append((entries[members[slot]].rel, problem))
    failed_slots = {slot for slot, _ in failed}
    written = [m for k, m in enumerate(members) if k not in failed_slots]
    if failed_slots:
        _compact(writer, split, [k not in failed_slots for k in range(len(members))])
    writer.write_labels(split, labels[written])
    return written


def _check_bad_files(
    root: Path, bad: list[tuple[str, str]], on_bad_file: str, written: dict[str, list[int]]
) -> None:
    """Stop on bad files (``data.on_bad_file: error``) or log each one skipped; stop when a
    split lost every image."""
    if bad and on_bad_file == "error":
        raise _bad_files_error(root, bad)
    for rel, reason in sorted(bad):
        log.warning("skipped %s: %s", rel, reason)
    for split in SPLITS:
        if not written[split]:
            raise DataError(f"data.folder: every {split} image was a bad file")


def _card(
    scan: Scan,
    params: DataParams,
    seed: int,
    channels: int,
    entries: list[Entry],
    hashes: list[str],
    bad: list[tuple[str, str]],
    dups: dict[str, list[int]],
    size: tuple[int, int],
) -> Card:
    """The dataset card before ``PreparedWriter.finish`` adds counts, statistics and hash."""
    source_hash = hashlib.sha256()
    for e, h in sorted(zip(entries, hashes, strict=True), key=lambda t: t[0].rel):
        source_hash.update(f"{e.rel}\0{h}\n".encode())
    n_dups = len(dups["val"]) + len(dups["test"])
    height, width = size
    extra: dict[str, Any] = {
        "layout": scan.layout,
        "seed": seed,
        "val_fraction": params.val_fraction,
        "test_fraction": params.test_fraction,
        "channels_param": params.channels,
    }
    if params.image_size == "auto":
        extra["image_size_param"] = "auto"
    if scan.unreadable_images:
        extra["unreadable_images"] = dict(sorted(scan.unreadable_images.items()))
    return Card(
        source=SOURCE,
        classes=scan.classes,
        channels=channels,
        height=height,
        width=width,
        mean=(0.0,) * channels,
        std=(1.0,) * channels,
        resize=params.resize,
        fill=0,
        interpolation="bilinear",
        source_sha256=source_hash.hexdigest(),
        skipped=tuple({"file": rel, "reason": reason} for rel, reason in sorted(bad)),
        ignored=scan.ignored,
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


def prepare_folder(
    params: DataParams,
    out_dir: str | os.PathLike[str],
    seed: int,
    max_image_pixels: int | None = None,
) -> Card:
    """Prepare ``params.folder`` into ``out_dir`` (atomically); return the dataset card.

    ``max_image_pixels`` overrides ``params.max_image_pixels`` (data.max_image_pixels).
    """

    assert params.folder is not None  # DataParams guarantees it for source: folder
    root = Path(params.folder).expanduser().resolve()
    max_pixels = max_image_pixels or params.max_image_pixels
    t0 = time.perf_counter()
    scan = scan_folder(root)
    n = len(scan.entries)
    log.info(
        "folder %s: %d images in %d classes (%s layout)", root, n, len(scan.classes), scan.layout
    )
    _log_ignored(scan)
    pool = _Pool(min(_workers(params), max(1, n // _CHUNK)))
    try:
        bad = list(scan.bad)
        entries, hashes, gray, shorter = _first_pass(scan, pool, max_pixels, bad)
        channels = (1 if gray else 3) if params.channels == "auto" else int(params.channels)
        size = _image_size(params, shorter)
        labels, splits, dups = _split(entries, hashes, scan.classes, params, seed)
        _check_balance(scan.classes, labels, splits)
        spec = _decode_spec(params, channels, max_pixels, size)
        total = int((splits != "dropped").sum())
        with (
            open_prepared(out_dir) as writer,
            Progress(total, "decoding", "images", PROGRESS_EVERY_S) as progress,
        ):
            written = {
                split: _write_split(
                    writer, pool, split, entries, splits, labels, spec, bad, progress
                )
                for split in SPLITS
            }
            progress.close()
            _check_bad_files(root, bad, params.on_bad_file, written)
            card = _card(scan, params, seed, channels, entries, hashes, bad, dups, size)
            card = writer.finish(card)
    finally:
        pool.close()
    dt = time.perf_counter() - t0
    done = sum(c["total"] for c in card.counts.values())
    log.info("prepared %d images in %.1f s (%.0f images/s)", done, dt, done / dt)
    return card


def _counted(counts: dict[str, int]) -> str:
    """``.txt 3, .json 2``: counts by extension, the most common first."""
    return ", ".join(f"{ext} {k}" for ext, k in sorted(counts.items(), key=lambda t: (-t[1], t[0])))


def _log_ignored(scan: Scan) -> None:
    """INFO for the non-image files passed over; a WARNING for image files trainyard cannot
    read (never silent: they may be a good part of the user's data)."""
    if scan.other_files:
        n = sum(scan.other_files.values())
        log.info("%d other file(s) ignored (not images): %s", n, _counted(scan.other_files))
    if scan.unreadable_images:
        n = sum(scan.unreadable_images.values())
        log.warning(
            "%d image file(s) left out: trainyard cannot read %s; convert them to PNG or "
            "JPEG (e.g. ImageMagick: magick mogrify -format png *.psd; camera raw: export "
            "from your photo app) if they belong in the dataset. Read: %s",
            n,
            _counted(scan.unreadable_images),
            " ".join(sorted(IMAGE_EXTENSIONS)),
        )


def _compact(writer: PreparedWriter, split: str, keep: list[bool]) -> None:
    """Rewrite ``split``'s images without the rows of files that failed to decode.

    Both files are streamed (plain reads in blocks, appends): memory stays bounded.
    """

    path = writer.images_path(split)
    mask = np.asarray(keep, dtype=bool)
    tmp = writer.tmp / f".{split}_images.compact.npy"
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
