"""Memory of the processes a benchmark starts: the RSS (and PSS) of a process tree, and the
RSS of a server's workers sampled on a timer. psutil is imported where it is used: the
bare GPU machine of ``make gpu-check`` has none and never calls these."""

from __future__ import annotations

import threading
import time

from trainyard.core.host import proc_bytes


def tree_memory(pid: int) -> tuple[int, int, int, int]:
    """(RSS summed over the process tree, PSS summed, processes, RSS of ``pid`` itself)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0, 0, 0, 0
    rss = pss = own = 0
    for p in procs:
        try:
            r = p.memory_info().rss
        except psutil.Error:
            continue
        rss += r
        own = r if p.pid == pid else own
        found = proc_bytes(f"/proc/{p.pid}/smaps_rollup", "Pss")
        pss += r if found is None else found
    return rss, pss, len(procs), own


def worker_pids(serve_pid: int) -> list[int]:
    """The `bentoml serve` workers: its child processes running the service worker."""
    import psutil

    out = []
    for child in psutil.Process(serve_pid).children(recursive=True):
        try:
            if any("worker" in part for part in child.cmdline()):
                out.append(child.pid)
        except psutil.Error:
            continue
    return sorted(out)


class RssSampler(threading.Thread):
    """Every ``interval`` s, the RSS of each worker; sample() takes one now."""

    def __init__(self, pids: list[int], interval: float) -> None:
        super().__init__(daemon=True)
        self.pids, self.interval = pids, interval
        self.samples: dict[str, list[tuple[float, int]]] = {str(p): [] for p in pids}
        self.lost: list[int] = []
        self.t0 = time.monotonic()
        self._done = threading.Event()

    def sample(self) -> None:
        """One RSS sample of every worker now; a worker gone is noted as lost."""
        import psutil

        now = time.monotonic() - self.t0
        for pid in self.pids:
            try:
                self.samples[str(pid)].append((now, psutil.Process(pid).memory_info().rss))
            except psutil.Error:
                if pid not in self.lost:
                    self.lost.append(pid)

    def run(self) -> None:
        while not self._done.wait(self.interval):
            self.sample()

    def stop(self) -> None:
        """Stop the periodic sampling and wait for its thread."""
        self._done.set()
        self.join()
