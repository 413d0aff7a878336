"""Keep-alive connections spread evenly over the workers (``serve.workers`` > 1).

BentoML's workers share one listening socket. A connection goes to whichever worker's
event loop accepts first, and uvloop accepts every pending connection at once, so when a
client (or a proxy) opens its keep-alive connections together, one worker can take them
all and keep them for their whole life: two starts with the same settings served 525 and
1,347 req/s, and in four starts one worker took all 16 of wrk's connections once. Neither
libuv's single-accept mode (``UV_TCP_SINGLE_ACCEPT``) nor BentoML's settings change it.

So each worker counts its open HTTP connections in a slot of a small file that all the
workers of one ``bentoml serve`` map (in the folder BentoML already shares with them for
the Prometheus series), and a worker holding more than its share (the total over the
workers, rounded up) answers its next response with ``Connection: close``. HTTP clients
then reconnect, as they must, and the new connection goes to a worker that is free to
accept it. A worker only ever writes its own slot: no lock.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np
from uvicorn.protocols.http.h11_impl import H11Protocol

try:  # httptools (uvicorn's parser of choice) is an optional extra of uvicorn
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    PROTOCOLS: tuple[Any, ...] = (HttpToolsProtocol, H11Protocol)
except ImportError:  # pragma: no cover
    PROTOCOLS = (H11Protocol,)

SLOT_FILE = "trainyard-connections.bin"
FOLDER_ENV = "PROMETHEUS_MULTIPROC_DIR"  # set by `bentoml serve` for its workers


class ConnectionShare:
    """This worker's slot among ``workers`` in the shared file in ``folder``."""

    def __init__(self, folder: Path, workers: int, index: int) -> None:
        path = folder / SLOT_FILE
        size = 8 * workers
        with open(path, "a+b") as f:  # every worker: made once, never truncated
            if os.fstat(f.fileno()).st_size < size:
                f.truncate(size)
            self._map = mmap.mmap(f.fileno(), size)
        self.counts = np.frombuffer(self._map, dtype=np.int64, count=workers)
        self.workers, self.index = workers, index
        self.counts[index] = 0  # a restarted worker starts with no connections

    def opened(self) -> None:
        self.counts[self.index] += 1

    def closed(self) -> None:
        self.counts[self.index] -= 1

    def over_share(self) -> bool:
        """More open connections here than the total over the workers, rounded up."""
        total = int(self.counts.clip(min=0).sum())
        return int(self.counts[self.index]) > -(-total // self.workers)


SHARE: ConnectionShare | None = None  # this worker's, once balance_connections ran


def balance_connections(workers: int, worker_index: int) -> ConnectionShare | None:
    """Count this worker's connections in the shared file, and let the guard close its
    surplus; None (nothing to balance) with one worker or outside `bentoml serve`."""
    global SHARE
    folder = os.environ.get(FOLDER_ENV)
    if workers < 2 or not folder or not 1 <= worker_index <= workers:
        return None
    SHARE = ConnectionShare(Path(folder), workers, worker_index - 1)
    for cls in PROTOCOLS:
        if not getattr(cls, "_trainyard_counted", False):
            _count_connections(cls)
    return SHARE


def _count_connections(cls: Any) -> None:
    made, lost = cls.connection_made, cls.connection_lost

    def connection_made(self: Any, transport: Any) -> None:
        if SHARE is not None:
            SHARE.opened()
        made(self, transport)

    def connection_lost(self: Any, exc: Exception | None) -> None:
        if SHARE is not None:
            SHARE.closed()
        lost(self, exc)

    cls.connection_made, cls.connection_lost = connection_made, connection_lost
    cls._trainyard_counted = True


def surplus_connection() -> bool:
    """Whether this worker holds more than its share: its next response closes one."""
    return SHARE is not None and SHARE.over_share()
