"""Test-only pauses at named steps, so that a test's signal lands where the test means it to
(why, and how a test uses them: docs/testing.md, "Signals at named steps, never on a
timer"; the steps are listed there too).

    TRAINYARD_PAUSE_AT=<step>[:<n>]  pause at the n-th arrival at <step> (n defaults to 1)
    TRAINYARD_PAUSE_FILE=<path>      announce the pause there: the file appears, whole,
                                     holding the pausing process's pid

The pause sleeps in the main thread, so a signal is handled exactly as it would be at that
point of the real work; removing the file also ends the pause. Without the variable a
pause point costs one dict lookup.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

from trainyard.core.io import atomic_write_text

PAUSE_AT = "TRAINYARD_PAUSE_AT"
PAUSE_FILE = "TRAINYARD_PAUSE_FILE"
_arrivals: dict[tuple[str, str], int] = {}


def pause_point(step: str) -> None:
    """Pause here if ``TRAINYARD_PAUSE_AT`` names ``step`` (and this is its n-th arrival)."""
    wanted = os.environ.get(PAUSE_AT)
    if wanted is None or wanted.partition(":")[0] != step:
        return
    path = os.environ[PAUSE_FILE]
    key = (wanted, path)  # counted per pause asked for: a test in-process asks afresh
    _arrivals[key] = _arrivals.get(key, 0) + 1
    if _arrivals[key] != int(wanted.partition(":")[2] or 1):
        return
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(f"pause point {step!r} is off the main thread: no signal reaches it")
    handled: list[int] = []
    # Python-level handlers only (None: installed outside Python, left alone).
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {s: h for s in signals if (h := signal.getsignal(s)) is not None}

    def handle(signum: int, frame: Any) -> None:
        handled.append(signum)
        # The real handler runs with itself installed (resume.interruptions checks that).
        for s, h in previous.items():
            signal.signal(s, h)
        real = previous[signum]
        if callable(real):
            real(signum, frame)
        elif real == signal.SIG_DFL:
            signal.raise_signal(signum)  # the default action: the process ends

    for s in previous:
        signal.signal(s, handle)
    try:
        atomic_write_text(path, f"{os.getpid()}\n")
        while not handled and os.path.exists(path):
            time.sleep(0.01)
    finally:
        if not handled:
            for s, h in previous.items():
                signal.signal(s, h)
