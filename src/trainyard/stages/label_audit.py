"""``trainyard audit``'s work, and the DVC stage a user may add after prepare
(``python -m trainyard.stages.label_audit``, docs/audit.md#as-a-dvc-stage; not in
dvc.yaml, so ``make run`` does not grow).

A class-per-folder tree is read the way prepare reads it: the same walk, the same first
pass (each file's sha256 and header), the same splits (the tree's own, else prepare's
seeded stratified draw) and the same decoder, at the pretrained model's 224 px under
``data.resize``. Each image is embedded once by the pretrained EfficientNet-Lite0 and kept
in the embedding cache by its sha256; ``trainyard.evaluation.audit_findings`` then finds
the suspects and ``audit_report`` writes them.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainyard.core.config import Params
from trainyard.core.errors import DataError
from trainyard.data.file_workers import decode_files
from trainyard.data.image_files import (
    FilePool,
    ImageFile,
    decode_spec,
    read_headers,
    worker_count,
)
from trainyard.data.image_size import background_fill
from trainyard.data.splits import assign_splits
from trainyard.data.walk import scan_folder
from trainyard.evaluation.audit_findings import TINY, TINY_DIM, audit, tiny_images
from trainyard.evaluation.audit_report import THUMB, Audited, write_outputs
from trainyard.evaluation.embedding_cache import EmbeddingCache
from trainyard.model.embeddings import EMBED_SIZE, Embedder, embedding_key
from trainyard.stages.runner import stage_main
from trainyard.track.audit_run import record_audit_run

log = logging.getLogger(__name__)

CACHE = Path(".cache") / "audit"  # the embedding cache, beside the workspace's other caches
OUT = Path("reports") / "audit"
BATCH = 256  # images decoded then embedded at a time: 38 MB of 224 px pixels
CHUNK = 64  # files per pool task (prepare's)


@dataclass(frozen=True)
class AuditJob:
    folder: Path
    out: Path = OUT
    cache: Path = CACHE


@dataclass
class Embedded:
    """What the run cost: files embedded now (the others came from the cache), and the
    model's forward passes (0 when everything was cached: no model is even loaded)."""

    computed: int = 0
    forward_passes: int = 0


def _decode_chunk(
    array: Path, paths: list[str], pool: FilePool, spec: dict[str, Any]
) -> dict[int, str]:
    """Decode ``paths`` into the rows of a new memory-mapped ``array`` (prepare's workers
    and decoder); {row: why} for the files that failed."""
    shape = (len(paths), 3, spec["height"], spec["width"])
    np.lib.format.open_memmap(array, "w+", np.uint8, shape).flush()
    calls = [
        (str(array), list(range(s, min(s + CHUNK, len(paths)))), paths[s : s + CHUNK], spec)
        for s in range(0, len(paths), CHUNK)
    ]
    return {slot: why for part in pool.map(decode_files, calls) for slot, why in part}


def _embed_missing(
    files: list[ImageFile],
    hashes: list[str],
    caches: tuple[EmbeddingCache, EmbeddingCache],
    pool: FilePool,
    spec: dict[str, Any],
    bad: list[tuple[str, str]],
) -> Embedded:
    """Decode the files whose content is missing from either cache (embeddings, tiny
    images), embed those missing embeddings, keep both. Failures go to ``bad``."""
    vectors, tinies = caches
    todo: dict[str, int] = {}
    for i, h in enumerate(hashes):
        if h not in vectors or h not in tinies:
            todo.setdefault(h, i)
    done, rows = Embedded(), list(todo.values())
    embedder = Embedder(EMBED_SIZE) if any(hashes[i] not in vectors for i in rows) else None
    with tempfile.TemporaryDirectory(prefix="trainyard-audit-") as tmp:
        for start in range(0, len(rows), BATCH):
            chunk = rows[start : start + BATCH]
            array = Path(tmp) / "pixels.npy"
            failed = _decode_chunk(array, [str(files[i].path) for i in chunk], pool, spec)
            bad += [(files[chunk[k]].rel, why) for k, why in failed.items()]
            ok = [k for k in range(len(chunk)) if k not in failed]
            if not ok:  # a chunk of only broken files (a second audit: all that is left)
                continue
            pixels = np.load(array, mmap_mode="r")
            tinies.add([hashes[chunk[k]] for k in ok], tiny_images(pixels[ok]))
            new = [k for k in ok if hashes[chunk[k]] not in vectors]
            if new and embedder is not None:
                vectors.add([hashes[chunk[k]] for k in new], embedder.embed(pixels[new]))
                done.computed += len(new)
            del pixels
    if rows:
        vectors.save()
        tinies.save()
    done.forward_passes = embedder.calls if embedder is not None else 0
    return done


def _splits(files: list[ImageFile], classes: tuple[str, ...], params: Params) -> np.ndarray:
    """The splits prepare would give these files (the tree's own, else its seeded draw)."""
    labels = np.array([f.label for f in files], dtype=np.int64)
    d = params.data
    given = [f.split for f in files]
    try:
        return assign_splits(labels, given, classes, d.val_fraction, d.test_fraction, params.seed)
    except DataError as err:  # a class too small to split: audited all the same, as train
        log.warning("%s; every image counted as train", err)
        return np.array([g or "train" for g in given], dtype=object)


@dataclass
class FolderVectors:
    """A folder's readable images (walk order), their sha256, embeddings and tiny images,
    the embedding's model key, what was embedded now, and the files that failed."""

    classes: tuple[str, ...]
    files: list[ImageFile]
    hashes: list[str]
    x: np.ndarray
    tiny: np.ndarray
    key: str
    embedded: Embedded
    bad: list[tuple[str, str]]


def embed_folder(params: Params, root: Path, cache: Path = CACHE) -> FolderVectors:
    """Every image of the class-per-folder ``root``, read as prepare reads it and embedded
    by the pretrained Lite0 at 224 px through the cache under ``cache`` (the audit's work;
    the recipe benchmark's frozen probe reads the same vectors)."""
    scan = scan_folder(root)
    if len(scan.classes) < 2:
        raise DataError(f"{root}: {len(scan.classes)} class folder(s); an audit needs two")
    bad = list(scan.bad)
    max_pixels = params.data.max_image_pixels
    pool = FilePool(min(worker_count(params.data), max(1, len(scan.entries) // 64)))
    try:
        files, hashes, _, _, clear = read_headers(scan.entries, pool, max_pixels, bad)
        fill = background_fill(clear[0], len(files), clear[1], params.seed)
        spec = decode_spec(params.data, 3, max_pixels, (EMBED_SIZE, EMBED_SIZE), fill)
        key = f"{embedding_key(EMBED_SIZE)}-{spec['resize']}-fill{fill}"
        vectors = EmbeddingCache(cache, key, Embedder.dim)
        tinies = EmbeddingCache(cache, f"tiny{TINY}-{spec['resize']}-fill{fill}", TINY_DIM)
        embedded = _embed_missing(files, hashes, (vectors, tinies), pool, spec, bad)
    finally:
        pool.close()
    decoded = {b[0] for b in bad}
    keep = [i for i, f in enumerate(files) if f.rel not in decoded]
    files, hashes = [files[i] for i in keep], [hashes[i] for i in keep]
    x, tiny = vectors.get(hashes), tinies.get(hashes)
    return FolderVectors(scan.classes, files, hashes, x, tiny, key, embedded, bad)


def audit_folder(params: Params, job: AuditJob) -> dict[str, Any]:
    """Audit ``job.folder``: write suspects.csv, report.html and summary.json into
    ``job.out``; the summary (with ``embedded``: how many were computed, not cached)."""
    t0 = time.perf_counter()
    root = job.folder.expanduser().resolve()
    got = embed_folder(params, root, job.cache)
    files, hashes, classes = got.files, got.hashes, got.classes
    splits = _splits(files, classes, params)
    labels = np.array([f.label for f in files], dtype=np.int64)
    findings = audit(got.x, got.tiny, labels, splits, hashes, classes, params.seed)
    rels, paths = [f.rel for f in files], [f.path for f in files]
    thumbs = job.cache / f"thumbs{THUMB}"
    images = Audited(root, rels, paths, labels, splits, classes, got.bad, hashes, thumbs)
    extra = {
        "model": got.key,
        "embedded": got.embedded.computed,
        "forward_passes": got.embedded.forward_passes,
        "seconds": round(time.perf_counter() - t0, 2),
    }
    summary = write_outputs(job.out, findings, images, extra)
    log.info(
        "audit of %d images (%d embedded now) in %.1f s: %d label issue(s), %d duplicate(s) "
        "across splits, %d outlier(s); %s",
        len(files),
        got.embedded.computed,
        summary["seconds"],
        summary["label_issues"],
        summary["exact_duplicates_across_splits"] + summary["near_duplicates_across_splits"],
        summary["outliers"],
        job.out / "report.html",
    )
    return summary


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=str(OUT))


def run(params: Params, args: argparse.Namespace) -> None:
    if params.data.folder is None:
        raise DataError("data.folder is not set: the audit reads a class-per-folder tree")
    job = AuditJob(Path(params.data.folder), Path(args.out))
    summary = audit_folder(params, job)
    record_audit_run(params, summary, job.out)


if __name__ == "__main__":
    stage_main("audit", run, add_args)
