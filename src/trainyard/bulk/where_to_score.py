"""Where a bulk job's images are decoded and scored, and at what batch: measured, not guessed.

``predict.batch_size: auto`` is measured on zeros (``choose_batch``). On a CPU the decode
runs in this process (a decode thread beside the model's: small images, where a worker's
start-up and the hop of every image cost more than the decode) or in decode workers, one
process per core, each decoding and scoring its share (photos); ``choose_place`` estimates
both from what one image costs here, as docs/predict.md ("Fast on any machine") says. On a
GPU the workers decode and this process scores (``choose_place`` is not asked).
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainyard.bulk.decode import DecodeSpec, decode_many, rank
from trainyard.data.fingerprint import is_url
from trainyard.runtime.inputs import softmax
from trainyard.runtime.sessions import CUDA, OnnxModel, load_onnx

log = logging.getLogger("trainyard.bulk")

CPU_BATCHES = (1, 4, 16, 64)  # per model call on one thread
GPU_BATCHES = (64, 128, 256, 512, 1024)
CPU_GIVE_UP = 0.9  # on a CPU, a batch size this much slower than the best ends the probe
CPU_TIE = 0.95  # on a CPU, a larger batch within 5% of the best is taken: beside the decode
# thread its per-call Python (normalise, softmax, top-k) holds the GIL less often (28 px
# PNGs in this process: 3,280 img/s at batch 16, 3,770 at 64, which the probe had within 5%)
GPU_GAIN = 1.15  # a doubling of the batch must raise img/s this much to be taken
PROBE_S = 0.05  # per batch size probed: enough for a stable rate, little start-up
POOL_START_S = 1.0  # decode workers' start-up, measured here (forkserver, imports, model)
SAMPLE_IMAGES = 16  # images decoded here to measure what one costs (the median)
SAMPLE_S = 0.2  # at most this long: a folder of phone photos is decided in 2 images
TOP_K = 5  # the probe's top-k (predict.top_k's default)
GIL_S = 10e-6  # per image, this thread's own Python work (softmax, top-k, the table)
WORKERS_GAIN = 1.1  # workers only when estimated this much faster: a near tie (which noise
# on a shared machine flips) stays here, with no process to start and less memory


@dataclass(frozen=True)
class Probe:
    """The batch chosen, its img/s, and the one-thread session it was measured on (a CPU:
    the session that scores in this process)."""

    batch: int
    img_per_s: float | None  # None: a batch size given, not measured
    single: OnnxModel | None = None


@dataclass(frozen=True)
class Place:
    """Where a job's images are decoded and scored, and why."""

    inline: bool  # decoded by a thread of this process, scored here
    reason: str


def choose_batch(
    model: OnnxModel, path: Path, input_shape: tuple[int, ...], asked: int | str
) -> Probe:
    """``predict.batch_size``: a number as is; ``auto`` is measured here on zeros (the
    kernels' speed does not depend on the pixels): on a GPU the largest power of two
    (64..1024) whose doubling still raised img/s 15%; on a CPU the best of 1, 4, 16 and 64
    images per call on one thread (what scores each image on a CPU, here or in a worker:
    small models gain from a batch, large ones lose cache; a near tie goes to the larger
    size, ``CPU_TIE``; a size 10% slower than the best ends the probe: the larger ones lose
    more, and EfficientNet-Lite0's batch of 64 alone would cost a second of start-up)."""
    gpu = model.provider == CUDA
    single = None if gpu else _one_thread(model, path)
    if asked != "auto":  # on a CPU still measured: where to score depends on it
        rate = None if single is None else _rate(single, _zeros(int(asked), input_shape))
        return Probe(int(asked), rate, single)
    sizes, gain, probe = (
        (GPU_BATCHES, GPU_GAIN, model) if single is None else (CPU_BATCHES, CPU_TIE, single)
    )
    best, best_rate, top = sizes[0], 0.0, 0.0  # top: the highest rate yet, ties measured on it
    for size in sizes:
        rate = _rate(probe, _zeros(size, input_shape))
        if top and rate < top * gain:
            if gpu or rate < top * CPU_GIVE_UP:
                break
            continue
        best, best_rate, top = size, rate, max(top, rate)
    where = "the GPU" if gpu else "one CPU thread"
    log.info("predict.batch_size auto: %d (%.0f img/s on %s at that batch)", best, best_rate, where)
    return Probe(best, best_rate, single)


def _one_thread(model: OnnxModel, path: Path) -> OnnxModel:
    """``model`` itself where it runs on one intra-op thread, else such a session of ``path``."""
    if model.session.get_session_options().intra_op_num_threads == 1:
        return model
    return load_onnx(path, device="cpu", intra_op_threads=1, say=False)


def _zeros(batch: int, input_shape: tuple[int, ...]) -> np.ndarray:
    return np.zeros((batch, *input_shape), np.float32)


def _rate(model: OnnxModel, x: np.ndarray, seconds: float = PROBE_S) -> float:
    """img/s of ``model`` on batch ``x``, the probabilities' softmax and top-k included
    (per call: small batches of a small model pay them often): one warm-up call, then calls
    for ``seconds`` (at least 3 on a GPU), and the fastest call's rate. Interference (the
    fingerprint's thread, another process, the caches) only ever adds time, so the fastest
    call is the model's own cost: averaged, one slow call of batch 4 once ended the probe at
    batch 1 (2,300 against 4,000 img/s on 28 px PNGs). On a CPU (one intra-op thread: the
    model runs on this thread) CPU time is counted, not the clock's: another process's turn
    on the core is not the model's; one call is a measure there, and EfficientNet-Lite0's
    batch of 64 costs a third of a second a call."""
    gpu = model.provider == CUDA
    clock, least = (time.perf_counter, 3) if gpu else (time.thread_time, 1)
    model.run(x)  # kernel choice, arena growth
    calls, fastest, t0 = 0, float("inf"), time.perf_counter()
    while calls < least or time.perf_counter() - t0 < seconds:
        c0 = clock()
        rank(softmax(model.run(x)), TOP_K)
        fastest = min(fastest, clock() - c0)
        calls += 1
    return len(x) / max(fastest, 1e-9)


def decode_cost(locations: list[str], spec: DecodeSpec) -> float:
    """Seconds to read and decode one image here: the median over the first few files after
    one not counted (the first decode of a format loads its plugin), at most ``SAMPLE_S``
    in all; unreadable ones count, as they cost their time too. 0 without a file. A local
    file's cost is this thread's CPU time, as the model's probe counts (``_rate``): on a
    shared machine other processes' turns on the core would otherwise inflate every decode
    of a 28 px PNG (0.05 ms measured as 0.3) and send the job to the workers, whose start-up
    then delays the first row by seconds; a URL's is the clock's (its download waits). The
    median, not the mean: one decode preempted by another process (ten times its cost)
    would otherwise do the same."""
    if not locations:
        return 0.0
    decode_many(locations[:1], [None], spec)
    times: list[float] = []
    t0 = time.perf_counter()
    for location in locations[1 : SAMPLE_IMAGES + 1]:
        clock = time.perf_counter if is_url(location) else time.thread_time
        t1 = clock()
        decode_many([location], [None], spec)
        times.append(clock() - t1)
        if time.perf_counter() - t0 > SAMPLE_S:
            break
    # statistics', not NumPy's median: np.median imports numpy.ma (17 ms of start-up).
    return statistics.median(times) if times else time.perf_counter() - t0


def choose_place(
    rows: int, decode_s: float, model_img_per_s: float, workers: int, cores: int
) -> Place:
    """In this process or in ``workers`` decode workers: the one whose estimate is shorter
    (the module's docstring)."""
    model_s = 1 / model_img_per_s
    here = rows * (max(decode_s + GIL_S, model_s) if cores > 1 else decode_s + model_s)
    there = POOL_START_S + rows * (decode_s + model_s) / max(workers, 1)
    costs = (
        f"decode {decode_s * 1e3:.2f} ms, model {model_s * 1e3:.2f} ms an image on one thread: "
        f"about {here:.1f} s in this process vs {there:.1f} s in {workers} worker(s) "
        f"(start-up {POOL_START_S:.0f} s)"
    )
    if workers > 1 and there * WORKERS_GAIN < here:
        return Place(False, f"decode workers: {costs}")
    return Place(True, f"in this process (a decode thread, the model here): {costs}")
