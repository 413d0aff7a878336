"""`make bench-serve`'s models outside the server: the larger model the bench builds, and
ONNX Runtime alone in process plus the decode time of an upload (what batching can save)."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness.exported import IMAGENET_MEAN, IMAGENET_STD, export_classifier, image_card
from benchmarks.harness.stopwatch import per_item_s
from benchmarks.serve_figures import LARGE

ORT_BATCHES = (1, 8, 32)
LARGE_SIZE = 160
LARGE_CLASSES = (
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
)


def build_large_model(path: Path, opset: int) -> None:
    """A randomly initialised resnet18 for 3x160x160 RGB ("crop" resize, 10 classes),
    exported as the pipeline exports (its dataset card and provenance in the metadata),
    with the ``<model>.sha256`` the service checks. Random weights: only speed is
    measured. Run in a child process (``python -m benchmarks.bench_serve --build-large``)
    so the bench's own process never imports torch."""
    import torch

    torch.manual_seed(0)
    stats = {"mean": IMAGENET_MEAN, "std": IMAGENET_STD}
    card = image_card(LARGE_CLASSES, LARGE_SIZE, source="folder", **stats)
    export_classifier(card, LARGE, path, opset, "random-init")


def ort_rate(session: Any, x: np.ndarray, seconds: float, callers: int = 1) -> dict[str, Any]:
    """img/s of ``session`` on batch ``x`` from ``callers`` threads calling it at once (ONNX
    Runtime releases the GIL), as the service's thread pool does with batching off."""
    import threading

    for _ in range(2):
        session.run(x)
    calls = [0] * callers
    start = time.perf_counter()

    def loop(i: int) -> None:
        while calls[i] < 3 or time.perf_counter() - start < seconds:
            session.run(x)
            calls[i] += 1

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.perf_counter() - start
    batch = x.shape[0]
    return {
        "batch": batch,
        "callers": callers,
        "img_per_s": batch * sum(calls) / took,
        "ms_per_batch": took * 1000 * callers / sum(calls),  # one call's time
        "ms_per_image": took * 1000 / (batch * sum(calls)),  # wall time per image
    }


def raw_onnx(
    model: Path, device: str, threads: int, seconds: float, batches: Sequence[int] = ORT_BATCHES
) -> tuple[list[dict[str, Any]], str]:
    """ONNX Runtime alone, in process: the service's session options at each batch size,
    one call at a time (what BentoML's batcher does: one batch in flight per worker); batch
    1 from one thread per core at once (what the thread pool does with batching off); and
    the largest batch with one intra-op thread per core (``serve.intra_op_threads: 0``)."""
    from trainyard.core.card import card_from_metadata
    from trainyard.runtime.sessions import load_onnx

    session = load_onnx(model, device=device, intra_op_threads=threads)  # type: ignore[arg-type]
    shape = card_from_metadata(session.metadata, str(model)).input_shape
    rng = np.random.default_rng(0)
    cores = os.cpu_count() or 1
    plan = [(session, threads, b, 1) for b in batches] + [(session, threads, 1, cores)]
    if threads != 0 and device != "cuda":
        every_core = load_onnx(model, device=device, intra_op_threads=0)  # type: ignore[arg-type]
        plan.append((every_core, 0, max(batches), 1))
    rows = []
    for sess, n_threads, batch, callers in plan:
        x = rng.standard_normal((batch, *shape), dtype=np.float32)
        row = {"threads": n_threads, **ort_rate(sess, x, seconds, callers)}
        rows.append(row)
        print(
            f"  ONNX Runtime {model.name} batch {batch:>3}, {n_threads or 'all'} intra-op "
            f"thread(s), {callers} caller(s): {row['img_per_s']:8.0f} img/s, "
            f"{row['ms_per_image']:.3f} ms per image",
            flush=True,
        )
    return rows, session.provider


def decode_ms(model: Path, images: Sequence[bytes], seconds: float) -> float:
    """Milliseconds to decode and resize one upload for ``model`` (trainyard.runtime.inputs,
    as the service does), averaged over ``images``."""
    from trainyard.core.card import card_from_metadata
    from trainyard.runtime.inputs import decode_image
    from trainyard.runtime.sessions import load_onnx

    card = card_from_metadata(load_onnx(model, device="cpu", intra_op_threads=1).metadata)
    decode_all = lambda: [decode_image(data, card) for data in images]  # noqa: E731
    return 1000 * per_item_s(decode_all, len(images), seconds, warmup=0)
