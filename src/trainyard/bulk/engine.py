"""Bulk scoring: decode (in worker processes, or a thread of this process for small images:
trainyard.bulk.where_to_score), run the model in batches, write chunks.

The caller's thread runs ONNX Runtime while the decoders read the next files (a bounded
window of tasks ahead), so decode and inference overlap and memory stays flat:
at most the window's images and one batch are held, whatever the source's size. Rows are
turned into a chunk table as soon as their chunk is complete, and written (``ChunkStore``).

Probabilities are the service's: ``softmax(model.run(model_input(pixels, card)))`` on
pixels from ``decode_image`` (``trainyard.runtime.inputs``), top-k by the same stable sort.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterator
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from trainyard.bulk.decode import (
    TASK_BYTES,
    TASK_IMAGES,
    TASK_MAX_IMAGES,
    DecodePool,
    DecodeSpec,
    InlineDecoder,
    Task,
    rank,
)
from trainyard.bulk.heatmaps import fresh_folder, write_heatmaps
from trainyard.bulk.listing import Inputs, chunk_count, shard_range
from trainyard.bulk.summary import tally
from trainyard.bulk.table import ChunkStore, Ranked, ranked_table, read_tables, summary_path
from trainyard.core.errors import DataError
from trainyard.core.io import atomic_write_json
from trainyard.core.nvml_sampler import UNDERFED_PCT, NvmlSampler, unavailable
from trainyard.core.pause_points import pause_point
from trainyard.core.progress import Progress
from trainyard.runtime.inputs import model_input, softmax
from trainyard.runtime.sessions import CUDA, OnnxModel

log = logging.getLogger(__name__)

# Model-input values per in-process task: 256 Fashion-MNIST images, 2 at 160 px.
TASK_PIXELS = 200_000
LOG_EVERY_S = 60.0  # off a terminal: one progress line a minute
INPUT_BOUND_SHARE = 0.5  # waiting on decode this share of the time: the input is the limit


@dataclass
class Job:
    """One scoring job: what to score, with which model, how, and where it goes."""

    inputs: Inputs
    model: OnnxModel
    sha256: str
    version: str  # the registry's NAME/VERSION, or "local"
    spec: DecodeSpec
    out: Path
    fmt: str
    top_k: int
    min_confidence: float
    batch_size: int
    workers: int
    chunk_rows: int
    shard: tuple[int, int] = (0, 1)
    strict: bool = False
    about: dict[str, Any] = field(default_factory=dict)  # model source, provenance
    inline: bool = False  # decoded by a thread of this process (trainyard.bulk.where_to_score)
    place: str = ""  # where the images are decoded and scored, and why
    heatmaps: str = ""  # --explain: the heatmap folder, relative to the table's; "" = off

    @property
    def classes(self) -> list[str]:
        return self.model.classes

    @property
    def rows(self) -> tuple[int, int]:
        """This shard's rows [start, stop) of the source."""
        return shard_range(len(self.inputs), *self.shard)

    def chunk(self, c: int) -> tuple[int, int]:
        """Rows [lo, hi) of the source in this shard's chunk ``c``."""
        start, stop = self.rows
        lo = start + c * self.chunk_rows
        return lo, min(lo + self.chunk_rows, stop)

    def identity(self) -> dict[str, Any]:
        """What must be equal for a rerun to continue an earlier run's chunks."""
        start, stop = self.rows
        return {
            "source_fingerprint": self.inputs.fingerprint(),
            "model_sha256": self.sha256,
            "model_version": self.version,
            "shard": list(self.shard),
            "rows": [start, stop],
            "top_k": self.top_k,
            "min_confidence": self.min_confidence,
            "chunk_rows": self.chunk_rows,
            "labels": self.inputs.label_from,
        } | ({"heatmaps": self.heatmaps} if self.heatmaps else {})


class _Scorer:
    """Top-k for batches of pixels, and the chunk table of their rows."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.k = min(job.top_k, len(job.classes))
        self.infer_s = 0.0
        self.first_row_s: float | None = None  # from the process's start

    def top(
        self, pixels: np.ndarray, rows: np.ndarray, sizes: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(top-k class indices, their probabilities) per image, as the service ranks them;
        with ``sizes`` (--explain) the heatmaps of the source's ``rows`` are written too."""
        t0 = time.perf_counter()
        x = model_input(pixels, self.job.spec.card)
        if sizes is None:
            probs = softmax(self.job.model.run(x))
        else:
            logits, _, cam = self.job.model.run_with_cam(x)
            probs = softmax(logits)
        self.infer_s += time.perf_counter() - t0
        self.scored()
        top, top_probs = rank(probs, self.k)
        if sizes is not None:
            write_heatmaps(self.job.spec.heatmaps, rows, top[:, 0], cam, sizes, self.job.spec.card)
        return top, top_probs

    def scored(self) -> None:
        """Rows were scored: the first time, note how long after the start."""
        if self.first_row_s is None:
            self.first_row_s = process_age()

    def table(
        self, lo: int, hi: int, top: np.ndarray, probs: np.ndarray, problems: list[str | None]
    ) -> pa.Table:
        """The rows [lo, hi) of the source as a chunk table."""
        job = self.job
        ok = np.fromiter((p is None for p in problems), bool, len(problems))
        ranked = Ranked(
            top[ok].ravel(), self.job.classes, probs[ok].ravel(), np.where(ok, self.k, 0)
        )
        truth = None if job.inputs.labels is None else job.inputs.labels[lo:hi]
        return ranked_table(
            job.inputs.names[lo:hi],
            ranked,
            problems,
            truth,
            min_confidence=job.min_confidence,
            version=job.version,
            sha256=job.sha256,
            heatmaps=job.heatmaps,
            first=lo,
        )


def process_age() -> float | None:
    """Seconds since this process started (Linux's /proc; None elsewhere): start-up,
    imports included."""
    try:
        with open("/proc/self/stat", "rb") as fh:
            started = int(fh.read().rsplit(b")", 1)[1].split()[19])
        with open("/proc/uptime", "rb") as fh:
            uptime = float(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return uptime - started / os.sysconf("SC_CLK_TCK")


def _tasks(job: Job, chunks: list[int]) -> Iterator[Task]:
    """The chunks' rows in tasks. To workers, about ``TASK_BYTES`` of files each (at least
    a model batch where they score, at most ``TASK_MAX_IMAGES``): a task of 28 px PNGs
    holds a thousand, one of phone photos a few, so each costs a worker about the same
    time. In this process (nothing to send, its files not stat-ed) about ``TASK_PIXELS``
    of model input each, at least a batch: 28 px images go 256 at a time, so the hand-over
    between the decode thread and the model (a lock, a wake-up) is paid per task, not per
    batch of 4."""
    least = job.batch_size if job.spec.model or job.inline else 1
    if job.inline:
        least = max(least, TASK_PIXELS // max(1, math.prod(job.spec.card.input_shape)))
    for c in chunks:
        lo, hi = job.chunk(c)
        a = lo
        while a < hi:
            b = min(a + least, hi)
            size = 0 if job.inline else sum(map(_file_bytes, range(a, b), [job] * (b - a)))
            while b < hi and b - a < TASK_MAX_IMAGES and not job.inline and size < TASK_BYTES:
                size += _file_bytes(b, job)
                b += 1
            yield (
                [job.inputs.location(i) for i in range(a, b)],
                [job.inputs.problems.get(i) for i in range(a, b)],
                a,
            )
            a = b


def _file_bytes(row: int, job: Job) -> int:
    """A row's file size; a URL or a file that cannot be stat-ed counts as an average one."""
    try:
        return os.stat(job.inputs.location(row)).st_size
    except (OSError, ValueError):
        return TASK_BYTES // TASK_IMAGES


def _score_chunk(
    job: Job, scorer: _Scorer, results: Iterator[Any], lo: int, hi: int, clock: dict[str, float]
) -> pa.Table:
    """Pull the decoded tasks of rows [lo, hi), score them ``batch_size`` images at a time
    (the images that decoded, in row order; the last batch of the chunk shorter)."""
    n = hi - lo
    top = np.zeros((n, scorer.k), np.int64)
    probs = np.zeros((n, scorer.k), np.float32)
    problems: list[str | None] = []
    waiting = _Batcher(job.batch_size)
    while len(problems) < n:
        t0 = time.perf_counter()
        result = next(results)
        clock["wait_s"] += time.perf_counter() - t0
        at = len(problems)
        if job.spec.model:  # scored in the worker (a CPU): its top-k, its problems
            scorer.scored()
            top[at : at + len(result[2])], probs[at : at + len(result[2])] = result[:2]
            found = result[2]
        else:  # pixels, problems, and with --explain the sizes
            pixels, found = result[0], result[1]
            good = np.flatnonzero([p is None for p in found])
            every = len(good) == len(found)
            # Blocks of a task's images, not one array per image: 28 px images are cheap.
            sizes = None if len(result) == 2 else result[2] if every else result[2][good]
            waiting.add(pixels if every else pixels[good], at + good, sizes)
            for x, rows, shown in waiting.full(len(problems) + len(found) >= n):
                top[rows], probs[rows] = scorer.top(x, lo + rows, shown)
        problems.extend(found)
        _check_strict(job, lo + at, found)
    return scorer.table(lo, hi, top, probs, problems)


class _Batcher:
    """Decoded images waiting for the model, with their rows in the chunk."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.pixels: list[np.ndarray] = []
        self.rows: list[np.ndarray] = []
        self.sizes: list[np.ndarray] = []  # --explain: (width, height) per image
        self.count = 0

    def add(self, pixels: np.ndarray, rows: np.ndarray, sizes: np.ndarray | None = None) -> None:
        if len(rows):
            self.pixels.append(pixels)
            self.rows.append(rows)
            if sizes is not None:
                self.sizes.append(sizes)
            self.count += len(rows)

    def full(self, last: bool) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
        """The whole batches waiting (``last``: the rest too), each with its rows (and
        with --explain the images' sizes)."""
        if not self.count or (self.count < self.size and not last):
            return
        x, rows = _joined(self.pixels), _joined(self.rows)
        sizes = _joined(self.sizes) if self.sizes else None
        cut = len(x) if last else len(x) - len(x) % self.size
        for a in range(0, cut, self.size):
            part = None if sizes is None else sizes[a : a + self.size]
            yield x[a : a + self.size], rows[a : a + self.size], part
        self.pixels, self.rows = [x[cut:]], [rows[cut:]]
        self.sizes = [] if sizes is None else [sizes[cut:]]
        self.count = len(x) - cut


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _check_strict(job: Job, first: int, problems: list[str | None]) -> None:
    """With ``--strict``, the first bad file of a task stops the job, naming it."""
    if not job.strict:
        return
    for i, problem in enumerate(problems):
        if problem is not None:
            raise DataError(
                f"{job.inputs.names[first + i]}: {problem} (--strict stops at the first bad "
                "file; without it the row records the reason and the run goes on)"
            )


def _gpu_sampler(job: Job) -> NvmlSampler | None:
    if job.model.provider != CUDA:
        return None
    try:
        return NvmlSampler(0.05)
    except Exception as err:  # no NVML: the job goes on, the summary says why
        log.info("GPU busy: not measured (%s)", err)
        return None


def run(job: Job, progress_stream: Any = None) -> dict[str, Any]:
    """Score ``job``, resuming from its chunks on disk; write the table and its summary
    (both atomically); return the summary."""
    start, stop = job.rows
    count = chunk_count(stop - start, job.chunk_rows)
    store = ChunkStore(job.out, job.identity())
    done = store.open()
    if job.heatmaps and not done:
        fresh_folder(Path(job.spec.heatmaps))
    todo = [c for c in range(count) if c not in done]
    resumed = sum(hi - lo for lo, hi in map(job.chunk, done))
    if done:
        log.info(
            "continuing an interrupted run: %d of %d chunk(s) already scored", len(done), count
        )
    scorer, clock = _Scorer(job), {"wait_s": 0.0}
    pool: DecodePool | InlineDecoder | None = None
    if todo:
        pool = InlineDecoder(job.spec) if job.inline else DecodePool(job.spec, job.workers)
    sampler = _gpu_sampler(job) if todo else None
    t0 = time.perf_counter()
    try:
        with Progress(stop - start, "scoring", "images", LOG_EVERY_S, progress_stream) as bar:
            bar.update(resumed)
            if pool is not None:
                results = pool.imap(_tasks(job, todo))
                if sampler is not None:
                    sampler.window(True)
                for c in todo:
                    lo, hi = job.chunk(c)
                    try:
                        table = _score_chunk(job, scorer, results, lo, hi, clock)
                    except BrokenProcessPool:
                        raise DataError(
                            "a decode worker died (killed, or out of memory) while scoring rows "
                            f"{lo:,}-{hi:,}; the chunks scored so far are kept: rerun the same "
                            "command to continue"
                        ) from None
                    store.write(c, table)
                    pause_point("predict.chunk_written")
                    bar.update(hi - lo)
    finally:
        if pool is not None:
            pool.close()
        gpu = sampler.close() if sampler is not None else None
    elapsed = time.perf_counter() - t0
    store.finish(count, job.fmt)
    summary = _summary(job, elapsed, stop - start - resumed, clock, scorer, gpu)
    summary["resumed_rows"] = resumed
    atomic_write_json(summary_path(job.out), summary)
    return summary


def _summary(
    job: Job,
    elapsed: float,
    scored_now: int,
    clock: dict[str, float],
    scorer: _Scorer,
    gpu: dict[str, Any] | None,
) -> dict[str, Any]:
    counts = tally(read_tables(job.out), job.classes, job.inputs.label_from)
    wait_share = clock["wait_s"] / elapsed if elapsed > 0 else 0.0
    speed = {
        "img_per_s": scored_now / elapsed if elapsed > 0 and scored_now else None,
        "seconds": elapsed,
        "rows_this_run": scored_now,
        "device": "GPU" if job.model.provider == CUDA else "CPU",
        "provider": job.model.provider,
        "io_binding": job.model.io_binding,
        "batch_size": job.batch_size,
        "workers": job.workers,
        "decode_wait_share": wait_share,
        "inference_share": scorer.infer_s / elapsed if elapsed > 0 and not job.spec.model else None,
        "scoring": _scoring(job),
        "place": job.place,
        "first_row_s": scorer.first_row_s,
        "gpu_busy": gpu
        if gpu is not None
        else unavailable("no CUDA device" if job.model.provider != CUDA else "not measured"),
        "verdict": verdict(job.model.provider, wait_share, gpu, job.spec.model != ""),
    }
    start, stop = job.rows
    return {
        "source": {
            "kind": job.inputs.kind,
            "where": str(job.inputs.where),
            "fingerprint": job.inputs.fingerprint(),
            "rows": len(job.inputs),
            "ignored_files": job.inputs.ignored,
        },
        "shard": {"index": job.shard[0], "count": job.shard[1], "rows": [start, stop]},
        "model": {
            "sha256": job.sha256,
            "version": job.version,
            "classes": job.classes,
            **job.about,
        },
        "output": str(job.out),
        "top_k": job.top_k,
        "min_confidence": job.min_confidence,
        **counts,
        "speed": speed,
    }


def _scoring(job: Job) -> str:
    if job.inline:
        return "in this process: a decode thread, the model on one thread"
    return "in the decode workers, one thread each" if job.spec.model else "batched here"


def verdict(
    provider: str, wait_share: float, gpu: dict[str, Any] | None, in_workers: bool = False
) -> str:
    """Training's words for where the time went: input-bound (waiting on decode),
    "GPU underfed" (the GPU idle though decode kept up), or not input-bound. Scored in the
    workers (a CPU), every core decodes and scores: the CPU is the limit."""
    if in_workers:
        return "CPU-bound: every decode worker also scores, one core each"
    if wait_share >= INPUT_BOUND_SHARE:
        return (
            f"input-bound: waiting on decode {wait_share:.0%} of the time (more "
            "predict.workers, or smaller images)"
        )
    busy = (gpu or {}).get("mean_pct")
    if provider == CUDA and busy is not None and busy < UNDERFED_PCT:
        return (
            f"GPU underfed: busy {busy:.0f}% with decode keeping up (a larger predict.batch_size)"
        )
    return "not input-bound"
