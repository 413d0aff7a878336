"""Decoding (and on a CPU, scoring) for bulk scoring, in worker processes.

Each image goes through ``trainyard.runtime.inputs.decode_image``, the function the service
decodes an upload with, for the model's dataset card: a bulk answer and a served answer for
the same file start from the same pixels. The limits are the training data's (a user's own
files: ``data.max_image_pixels``, no aspect-ratio limit), not the service's upload limits.

``DecodePool`` keeps a bounded window of tasks in flight and hands the results back in
order, so memory stays flat however many files the source lists. On a GPU the caller runs
the model on the pixels that come back, in large batches (decode and inference overlap).
On a CPU each worker also runs the model, its own ONNX Runtime session on one thread, on
small batches (``score_many``): one model call per core at a time beat one call on every
core by 1.4x (EfficientNet-Lite0 at 160 px: 249 img/s on one thread at batch 1, 178 at
batch 64; 133 on both threads), the rule the service follows too.
"""

from __future__ import annotations

import importlib.machinery
import math
import multiprocessing
import os
import queue
import signal
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainyard.bulk.heatmaps import write_heatmaps
from trainyard.core.card import Card
from trainyard.core.errors import InputError
from trainyard.data.fingerprint import is_url
from trainyard.data.sources.csv_list import download
from trainyard.runtime.inputs import decode_image, model_input, softmax
from trainyard.runtime.sessions import OnnxModel, load_onnx

TASK_IMAGES = 32  # images per task where their sizes are unknown (URLs)
TASK_BYTES = 256 << 10  # file bytes per task: a hop amortised, the workers kept balanced
TASK_MAX_IMAGES = 256  # ... and at most this many (28 px PNGs: 300 bytes each): the first
# results come early, the last tasks end together
WINDOW_PER_WORKER = 4  # tasks in flight per worker: enough to never leave one idle
PARENT_CHECK_S = 1.0  # how often a worker checks that the job still runs


@dataclass(frozen=True)
class DecodeSpec:
    """How every image of a job is read (picklable: it travels to the workers once)."""

    card: Card
    max_pixels: int  # data.max_image_pixels
    download_timeout_s: float
    max_download_bytes: int
    model: str = ""  # a model file: the workers score too (on a CPU); "" = decode only
    top_k: int = 5
    batch_size: int = 16  # images per model call in a worker
    heatmaps: str = ""  # --explain: the folder of the heatmaps (trainyard.bulk.heatmaps); "" = off


# A task: its files, the problems already known of them, the source's row of the first.
Task = tuple[list[str], list[str | None], int]

_SPEC: DecodeSpec | None = None  # this worker's spec (set by the pool's initializer)
_MODEL: OnnxModel | None = None  # this worker's session, when it scores


def _install(spec: DecodeSpec, parent: int) -> None:
    global _SPEC, _MODEL
    _SPEC = spec
    if spec.model:  # the file was verified by the parent; one thread: one core per worker
        _MODEL = load_onnx(spec.model, device="cpu", intra_op_threads=1, say=False)
    # Ctrl-C reaches the whole process group: the parent stops the job and keeps what is
    # written; a worker ends its task quietly instead of printing a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A pool's workers wait for work forever: after a SIGKILL of the job they would stay
    # (holding its stderr, a terminal's or a pipe's). They leave when the job is gone.
    threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()


def _exit_with(parent: int) -> None:
    while True:
        time.sleep(PARENT_CHECK_S)
        if not _alive(parent):
            os._exit(0)


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs: a zombie (killed, not yet reaped by its own parent)
    does not."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: the signal probe
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # the pid was reused by another user's process
            return False
        return True


def read_bytes(location: str, spec: DecodeSpec) -> bytes:
    """The file's bytes, or a URL's (downloaded with the csv source's limits); OSError or
    InputError with the reason."""
    if not is_url(location):
        with open(location, "rb") as fh:
            return fh.read()
    with tempfile.TemporaryDirectory(prefix="trainyard-predict-") as tmp:
        dest = Path(tmp) / "image"
        problem = download(location, dest, spec.download_timeout_s, spec.max_download_bytes)
        if problem is not None:
            raise InputError(problem)
        return dest.read_bytes()


def decode_many(
    locations: Sequence[str], known: Sequence[str | None], spec: DecodeSpec | None = None
) -> tuple[Any, ...]:
    """(pixels uint8 [n,C,H,W], problem per image: None or why it could not be read), and
    with ``spec.heatmaps`` each image's (width, height) as shown, int32 [n,2], third.
    ``known``: problems found before decoding (a broken symlink): not read again."""
    spec = spec or _SPEC
    assert spec is not None, "decode_many runs in a DecodePool worker or with a spec"
    card = spec.card
    pixels = np.zeros((len(locations), *card.input_shape), dtype=np.uint8)
    problems: list[str | None] = list(known)
    sizes = np.zeros((len(locations), 2), np.int32) if spec.heatmaps else None
    for i, location in enumerate(locations):
        if problems[i] is not None:
            continue
        try:
            data = read_bytes(location, spec)
            info: dict[str, Any] = {}
            pixels[i] = decode_image(
                data,
                card,
                max_pixels=spec.max_pixels,
                field="file",
                max_aspect_ratio=math.inf,
                info=info,
            )
            if sizes is not None:
                shown = (info["width"], info["height"])
                sizes[i] = shown[::-1] if info.get("turned") else shown
        except InputError as err:
            problems[i] = str(err).removeprefix("file: ")
        except OSError as err:
            problems[i] = f"unreadable ({err.strerror or err})"
    return (pixels, problems) if sizes is None else (pixels, problems, sizes)


def rank(probs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(top-k class indices, their probabilities) per row, best first: the service's order
    (a stable sort: ties keep the class order)."""
    order = np.argsort(-probs, axis=1, kind="stable")[:, :k]
    return order, np.take_along_axis(probs, order, axis=1)


def score_many(
    locations: Sequence[str], known: Sequence[str | None], first: int = 0
) -> tuple[np.ndarray, np.ndarray, list[str | None]]:
    """In a scoring worker: ``decode_many``, then the model on the images that decoded,
    ``batch_size`` at a time: (top-k indices, their probabilities, problems). With
    ``spec.heatmaps`` the heatmaps too, the task's images being the source's rows from
    ``first``."""
    spec, model = _SPEC, _MODEL
    assert spec is not None and model is not None, "score_many runs in a scoring worker"
    decoded = decode_many(locations, known, spec)
    pixels, problems = decoded[0], decoded[1]
    k = min(spec.top_k, spec.card.num_classes)
    top = np.zeros((len(locations), k), np.int64)
    probs = np.zeros((len(locations), k), np.float32)
    good = np.flatnonzero([p is None for p in problems])
    for a in range(0, len(good), spec.batch_size):
        rows = good[a : a + spec.batch_size]
        x = model_input(pixels[rows], spec.card)
        if not spec.heatmaps:
            top[rows], probs[rows] = rank(softmax(model.run(x)), k)
            continue
        logits, _, cam = model.run_with_cam(x)
        top[rows], probs[rows] = rank(softmax(logits), k)
        write_heatmaps(spec.heatmaps, first + rows, top[rows, 0], cam, decoded[2][rows], spec.card)
    return top, probs, problems


class DecodePool:
    """``workers`` decode processes, fed a bounded window of tasks, results in order."""

    def __init__(self, spec: DecodeSpec, workers: int) -> None:
        self.spec, self.workers = spec, workers
        # forkserver: the parent holds ONNX Runtime's threads, which fork would copy mid-flight.
        context = multiprocessing.get_context("forkserver")
        self.main_spec = _main_not_rerun()
        self.executor = ProcessPoolExecutor(
            workers, mp_context=context, initializer=_install, initargs=(spec, os.getpid())
        )

    def imap(self, tasks: Iterator[Task]) -> Iterator[Any]:
        """``score_many`` (a scoring pool) or ``decode_many`` of each task, in order, at
        most ``workers x 4`` tasks ahead."""
        window: deque[Future[Any]] = deque()
        limit = self.workers * WINDOW_PER_WORKER
        for locations, known, first in tasks:
            if self.spec.model:
                future = self.executor.submit(score_many, locations, known, first)
            else:
                future = self.executor.submit(decode_many, locations, known)
            window.append(future)
            if len(window) >= limit:
                yield window.popleft().result()
        while window:
            yield window.popleft().result()

    def close(self) -> None:
        """Stop the workers now: queued tasks are dropped (a Ctrl-C does not wait for them)."""
        self.executor.shutdown(wait=False, cancel_futures=True)
        if self.main_spec is not _UNCHANGED:
            sys.modules["__main__"].__spec__ = self.main_spec


_UNCHANGED = object()


def _main_not_rerun() -> Any:
    """Keep the workers from running this program's main script again.

    A new worker re-runs the parent's ``__main__`` when it was started as a script (the
    ``trainyard`` console script: every command's imports, torch and MLflow among them,
    seconds before the first image), unless ``__main__`` names a module spec called
    ``__main__`` (multiprocessing.spawn skips those). The workers need nothing from it:
    their functions are this module's. ``python -m trainyard.bulk`` has its spec already.
    Returns what ``close`` puts back."""
    main = sys.modules["__main__"]
    if getattr(main, "__spec__", None) is not None or not getattr(main, "__file__", None):
        return _UNCHANGED
    main.__spec__ = importlib.machinery.ModuleSpec("__main__", None)
    return None


class InlineDecoder:
    """``DecodePool``'s ``imap`` in this process: one thread decodes the next tasks (at most
    ``window`` ahead) while the caller's thread runs the model, which releases the GIL.
    For images cheaper to decode than to send to a worker (trainyard.bulk.where_to_score)."""

    def __init__(self, spec: DecodeSpec, window: int = 2 * WINDOW_PER_WORKER) -> None:
        self.spec = spec
        self.results: queue.Queue[Any] = queue.Queue(window)
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def imap(self, tasks: Iterator[Task]) -> Iterator[Any]:
        """``decode_many`` of each task, in order."""
        self.thread = threading.Thread(target=self._decode, args=(tasks,), daemon=True)
        self.thread.start()
        while True:
            item = self.results.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def _decode(self, tasks: Iterator[Task]) -> None:
        try:
            for locations, known, _first in tasks:
                if not self._put(decode_many(locations, known, self.spec)):
                    return
        except BaseException as err:  # the caller raises it: a bug is not a silent stop
            self._put(err)
            return
        self._put(_END)

    def _put(self, item: Any) -> bool:
        """Hand ``item`` over unless the caller stopped; whether it was."""
        while not self.stop.is_set():
            try:
                self.results.put(item, timeout=PARENT_CHECK_S)
                return True
            except queue.Full:
                continue
        return False

    def close(self) -> None:
        """Stop decoding (the thread ends at its next hand-over)."""
        self.stop.set()


_END = object()  # the end of an InlineDecoder's tasks


def worker_count(workers: int | str) -> int:
    """``predict.workers``: ``auto`` = one per core this process may use."""
    if workers == "auto":
        return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
    return int(workers)
