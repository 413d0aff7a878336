"""Signals around store writes: a handler for SIGINT/SIGTERM within a block, a few writes
that belong together finished before a signal is delivered, and the store let go of after a
Ctrl-C."""

from __future__ import annotations

import contextlib
import gc
import signal
import traceback
from collections.abc import Iterator
from typing import Any

INTERRUPTS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def signals_handled(handler: Any, signals: tuple[int, ...] = INTERRUPTS) -> Iterator[bool]:
    """``handler`` for ``signals`` inside the block, the previous handlers restored after.
    Outside the main thread Python cannot handle signals: they are left alone, and the
    block gets False."""
    try:
        previous = {s: signal.signal(s, handler) for s in signals}
    except ValueError:  # not the main thread
        yield False
        return
    try:
        yield True
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM during a few store writes that belong together, then deliver
    them to the handlers that were in place.

    Ctrl-C raises wherever Python happens to be; inside MLflow's sqlite session code that can
    leave a statement or a transaction holding mlflow.db's write lock, so the clean-up's
    own writes wait out MLflow's 20 s busy timeout (seen in tests/pipeline/test_interrupt.py). A
    registration's writes take milliseconds: letting them finish and stopping right after is
    both faster and leaves the registry whole. SIGKILL cannot be held; the next registration
    removes what it cut off. Outside the main thread signals cannot be handled: no deferral.
    """
    received: list[int] = []

    def hold(signum: int, frame: Any) -> None:
        received.append(signum)

    try:
        with signals_handled(hold):
            yield
    finally:
        if received:  # once, to the handler that would have had it (KeyboardInterrupt, ...)
            signal.raise_signal(received[0])


def release_interrupted_store(err: BaseException) -> None:
    """Let go of the store after a Ctrl-C, before writing to it again.

    A Ctrl-C that lands while sqlite runs one of MLflow's statements leaves that statement
    half-stepped, holding a lock on mlflow.db until its cursor is freed, and the cursor lives
    on in the frames of the interrupt's traceback. A write from the handler (mark the run
    KILLED, undo a registration) then waits out MLflow's 20 s busy timeout and fails: the
    run stayed RUNNING (seen in tests/pipeline/test_interrupt.py). Clearing those finished frames
    frees the cursor and its lock.
    """
    traceback.clear_frames(err.__traceback__)
    gc.collect()  # cursors held in reference cycles
