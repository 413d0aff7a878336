"""Progress of a long loop: a bar in a terminal, a periodic log line otherwise.

`dvc repro` under a terminal shows the stage's stderr as it comes, so a bar redrawn in place
reads well there; in CI logs, `dvc exp run --queue` logs and files a redrawn bar is noise,
so those get one INFO line every ``every_s`` seconds instead (and one at the end).
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

log = logging.getLogger("trainyard.progress")


def duration(seconds: float) -> str:
    """``45s``, ``12m05s`` or ``2h03m``: an ETA readable at a glance."""
    seconds = max(0, round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class Progress:
    """Count ``total`` items of ``unit`` under ``desc``; ``update(n)`` as they finish.

    ``stream``: where the bar draws (stderr); a bar only when it is a terminal, unless
    ``bar`` says otherwise. Use as a context manager, or call ``close()``.
    """

    def __init__(
        self,
        total: int,
        desc: str,
        unit: str = "items",
        every_s: float = 10.0,
        stream: TextIO | None = None,
        bar: bool | None = None,
    ) -> None:
        self.total, self.desc, self.unit, self.every_s = max(0, total), desc, unit, every_s
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", lambda: False)
        self.bar = bool(isatty()) if bar is None else bar
        self.done = 0
        self.t0 = self.t_last = time.monotonic()
        self.closed = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def line(self) -> str:
        """``desc: done/total unit (pct), rate unit/s, ETA``: what both forms show."""
        elapsed = max(time.monotonic() - self.t0, 1e-9)
        rate = self.done / elapsed
        pct = 100.0 * self.done / self.total if self.total else 100.0
        text = f"{self.desc}: {self.done:,}/{self.total:,} {self.unit} ({pct:.0f}%), {rate:,.1f}/s"
        if 0 < self.done < self.total and rate > 0:
            text += f", ETA {duration((self.total - self.done) / rate)}"
        elif self.done >= self.total:
            text += f", {duration(elapsed)}"
        return text

    def update(self, n: int = 1) -> None:
        self.done = min(self.total, self.done + n)
        now = time.monotonic()
        if self.bar:
            if now - self.t_last >= 0.2 or self.done >= self.total:
                self.t_last = now
                width = 24
                filled = int(width * self.done / self.total) if self.total else width
                bar = "#" * filled + "-" * (width - filled)
                self.stream.write(f"\r[{bar}] {self.line()}\x1b[K")
                self.stream.flush()
        elif now - self.t_last >= self.every_s and self.done < self.total:
            self.t_last = now
            log.info(self.line())

    def close(self) -> None:
        """End the bar's line (a terminal), or log the final line (when it took a while)."""
        if self.closed:
            return
        self.closed = True
        if self.bar:
            self.stream.write("\n")
            self.stream.flush()
        elif time.monotonic() - self.t0 >= self.every_s:
            log.info(self.line())
