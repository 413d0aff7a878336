"""``serve.batching: auto``: adaptive batching where it wins, decided once at start-up.

What `make bench-serve` shows (docs/benchmarks.md, Serving): on a CPU, batching pays when
a request's own work (HTTP, parsing, a thread hop: about a millisecond of the event loop)
outweighs the model's. The Fashion CNN's batch-1 call takes a twentieth of a millisecond,
and batching it serves more requests. A 160 px resnet18's takes 10-20 ms; ONNX Runtime
computes a batch of 8 no faster per image than 8 single calls on one thread each, and
BentoML's batcher runs one batch at a time per worker where unbatched calls run side by
side on its cores, so batching it serves fewer. On a GPU one call of many images is what
keeps the device busy, so there ``auto`` batches.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np

from trainyard.core.card import card_from_metadata
from trainyard.core.config import ServeParams
from trainyard.runtime.inputs import model_input
from trainyard.runtime.sessions import CUDA, load_onnx

# A batch-1 call slower than this on a CPU: the model's work dominates, batching loses.
MAX_CALL_MS = 2.0
TIMED_CALLS = 5


def choose_batching(params: ServeParams, model_path: Path) -> tuple[ServeParams, str]:
    """``params`` with ``batching`` a bool, and why: as set, or ``auto`` decided by the
    provider and one timed batch-1 call of the model (the median of a few)."""
    if params.batching != "auto":
        return params, "serve.batching"
    model = load_onnx(model_path, params.device, intra_op_threads=1, say=False)
    if model.provider == CUDA:
        on, why = True, "auto: on CUDA"
    else:
        card = card_from_metadata(model.metadata, str(model_path))
        x = model_input(np.zeros((1, *card.input_shape), dtype=np.float32), card)
        model.run(x)  # the first call allocates and picks kernels
        times = []
        for _ in range(TIMED_CALLS):
            start = time.perf_counter()
            model.run(x)
            times.append((time.perf_counter() - start) * 1e3)
        ms = statistics.median(times)
        on = ms < MAX_CALL_MS
        side = "under" if on else "over"
        why = f"auto: a batch-1 call takes {ms:.2f} ms on the CPU, {side} {MAX_CALL_MS:g} ms"
    return params.model_copy(update={"batching": on}), why
