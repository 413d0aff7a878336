"""A budget of decoded bytes in flight across prepare's decode workers.

Each worker process decodes one image at a time, so W workers given W huge images that
must be decoded whole (a TIFF, an interlaced or 16-bit PNG: 4 bytes a pixel) would hold
all W at once. ``image_to_pixels`` says what each decode will hold (its ``reserve``
argument); a worker then waits until that fits, with what the others hold, under
``DECODE_BUDGET``. A decode larger than the whole budget waits until it is the only one,
so every image under data.max_image_pixels still decodes, one at a time. Decodes under
``SMALL`` do not ask at all: photos, JPEGs (decoded at 1/8 scale) and PNGs (streamed in
bands) keep their throughput.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

# What the decodes of one prepare hold at most at once, unless one image alone needs more.
DECODE_BUDGET = 1 << 30
# Decodes under this many bytes run without asking: the pool's workers times this is small.
SMALL = 64 << 20


class DecodeBudget:
    """Bytes reserved by processes that share this object (made before they start: the
    pool's initializer hands it to each worker)."""

    def __init__(self, limit: int, context: Any = None) -> None:
        ctx = context or multiprocessing.get_context()
        self.limit = limit
        self._cond = ctx.Condition()
        self._used = ctx.RawValue("q", 0)
        self._peak = ctx.RawValue("q", 0)

    @contextmanager
    def hold(self, cost: int) -> Iterator[None]:
        """Wait until ``cost`` bytes fit under the limit with those already held, then
        hold them for the block. A cost over the limit is held as the whole limit: it
        waits until nothing else is held, and holds off every other reservation."""
        cost = min(cost, self.limit)
        with self._cond:
            self._cond.wait_for(lambda: self._used.value + cost <= self.limit)
            self._used.value += cost
            self._peak.value = max(self._peak.value, self._used.value)
        try:
            yield
        finally:
            with self._cond:
                self._used.value -= cost
                self._cond.notify_all()

    @property
    def peak(self) -> int:
        """The most bytes held at once so far."""
        return int(self._peak.value)


# This process's budget: set in each pool worker by ``install``; None in the main process,
# which decodes alone (data.workers: 1) and so has nothing to share.
_installed: DecodeBudget | None = None


def install(budget: DecodeBudget | None) -> None:
    """Pool initializer: the budget this worker's decodes reserve from."""
    global _installed
    _installed = budget


def reserve(cost: int) -> AbstractContextManager[object]:
    """``image_to_pixels``' ``reserve`` for prepare: hold ``cost`` bytes of the installed
    budget (nothing for a small decode, or in a process without a budget)."""
    if _installed is None or cost < SMALL:
        return nullcontext()
    return _installed.hold(cost)
