"""The one clock every benchmark uses: wall time with the device synchronised at both ends.

CUDA kernels run asynchronously to the Python that queues them, so a timer that does not
synchronise measures how fast work is *queued*, not done. On the CPU ``sync`` is free.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def sync(device: str) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


class Timer:
    """Seconds between ``start()`` and ``stop()``, synchronised; ``seconds`` accumulates
    over several windows (e.g. the training part of each epoch). As a context manager:
    ``with Timer() as t: ...`` then ``t.seconds``."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self.seconds = 0.0
        self._t0: float | None = None

    def start(self) -> None:
        """Open a window (after the device's queued work)."""
        sync(self.device)
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        """Close the window: its seconds, also added to ``seconds``."""
        if self._t0 is None:
            raise RuntimeError("Timer.stop() before start()")
        sync(self.device)
        dt = time.perf_counter() - self._t0
        self.seconds += dt
        self._t0 = None
        return dt

    @property
    def running(self) -> bool:
        """Whether a window is open."""
        return self._t0 is not None

    def __enter__(self) -> Timer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def median_call_s(
    fn: Callable[[], Any],
    budget_s: float,
    min_calls: int = 5,
    max_calls: int = 2000,
    device: str = "cpu",
) -> float:
    """Median seconds per call of ``fn``, after 3 warm-up calls: at least ``min_calls``,
    then until ``budget_s`` has passed or ``max_calls`` were made."""
    for _ in range(3):
        fn()
    sync(device)
    times: list[float] = []
    start = time.perf_counter()
    timer = Timer(device)
    while len(times) < max_calls and (
        len(times) < min_calls or time.perf_counter() - start < budget_s
    ):
        timer.start()
        fn()
        times.append(timer.stop())
    return statistics.median(times)


def per_item_s(fn: Callable[[], Any], items: int, seconds: float, warmup: int = 1) -> float:
    """Seconds per item of ``fn()`` (which handles ``items`` items), over ``seconds`` at
    least and 3 calls at least, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    calls, t0 = 0, time.perf_counter()
    while calls < 3 or time.perf_counter() - t0 < seconds:
        fn()
        calls += 1
    return (time.perf_counter() - t0) / (calls * items)


def round_robin(
    rows: dict[str, Callable[[], float]], repeats: int, log: Callable[[str], None], unit: str
) -> dict[str, dict[str, Any]]:
    """Each row ``repeats`` times, repeat by repeat: drift in machine load (shared, noisy
    hosts) then spreads over all rows instead of biasing whichever ran last. ``{row:
    {"median", "runs"}}``."""
    runs: dict[str, list[float]] = {name: [] for name in rows}
    for rep in range(repeats):
        for name, fn in rows.items():
            runs[name].append(fn())
            log(f"bench: [{rep + 1}/{repeats}] {name:32s} {runs[name][-1]:>12,.0f} {unit}")
    return {name: {"median": statistics.median(v), "runs": v} for name, v in runs.items()}
