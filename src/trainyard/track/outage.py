"""A tracking server that goes away during a fit: the fit goes on.

What the fit logs while the server does not answer (connection refused, a timeout, 5xx) is
kept in memory with its own steps and timestamps, and sent when the server answers again:
``ServerGap`` says so once when the gap opens and once when it closes, and records each gap
on the run (tag ``trainyard.tracking_gap``). While the server is away a log call only keeps
its values; at most every ``RETRY_EVERY_S`` seconds one asks ``/health`` (a
``PROBE_TIMEOUT_S`` probe, no retries) before sending, so a step never waits out MLflow's
HTTP retries again. The end of the fit waits for the server a bounded time
(``TRAINYARD_TRACKING_WAIT_S``, ``settle``); a server still away by then gets what is kept
saved to a file (``save``) that the next start sends (``take_saved``).

Only an ``http(s)://`` store has a server to lose: on the embedded store every error is
raised as before.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import mlflow
import requests
from mlflow.entities import Metric, RunTag
from mlflow.exceptions import MlflowException

from trainyard.core.errors import TrackingError
from trainyard.core.io import atomic_write_json

log = logging.getLogger(__name__)

WAIT_ENV = "TRAINYARD_TRACKING_WAIT_S"  # how long the end of a fit waits for the server
DEFAULT_WAIT_S = 60.0
RETRY_EVERY_S = 15.0  # while the server is away: how often a log call asks it again
PROBE_TIMEOUT_S = 2.0
GAP_TAG = "trainyard.tracking_gap"
PENDING_FILE = "pending-metrics.json"  # in the resume folder: what a server away did not take

# urllib3 says "Retrying (Retry(total=1, ...)) after connection broken by ..." for each of
# MLflow's HTTP retries; the gap's own line says what happened, once.
_RETRY_LINE = re.compile(r"Retrying \(.*\) after connection broken")


def _not_retry_line(record: logging.LogRecord) -> bool:
    return _RETRY_LINE.match(record.getMessage()) is None


if _not_retry_line not in logging.getLogger("urllib3.connectionpool").filters:
    logging.getLogger("urllib3.connectionpool").addFilter(_not_retry_line)


def wait_seconds() -> float:
    """``TRAINYARD_TRACKING_WAIT_S`` (seconds, >= 0), else ``DEFAULT_WAIT_S``."""
    raw = os.environ.get(WAIT_ENV, "").strip()
    if not raw:
        return DEFAULT_WAIT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also NaN
        raise TrackingError(f"{WAIT_ENV}={raw!r}: expected a number of seconds >= 0")
    return value


@contextlib.contextmanager
def recording(uri: str, what: str) -> Iterator[None]:
    """An MLflow error inside as one TrackingError: the store at ``uri`` could not record
    ``what`` (``the predict run``), and why (``unreachable``'s words, else MLflow's)."""
    try:
        yield
    except MlflowException as err:
        why = unreachable(err) or err.message
        raise TrackingError(f"MLflow at {uri}: could not record {what} ({why})") from None


def unreachable(err: BaseException) -> str | None:
    """Why ``err`` means the tracking server did not answer (``connection refused``,
    ``timed out``, ``HTTP 503``, ...), or None for any other error (a refused request, a bug).

    MLflow wraps what ``requests`` raised in an ``MlflowException`` ("API request to ...
    failed with exception ..."), the original as its context; 5xx answers end as
    "too many 503 error responses" once its retries are spent.
    """
    chain, e = [], err
    while e is not None and len(chain) < 6:
        chain.append(e)
        e = e.__cause__ or e.__context__
    transport = (requests.exceptions.ConnectionError, requests.exceptions.Timeout)
    transport += (requests.exceptions.RetryError, ConnectionError, TimeoutError)
    text = " ".join(str(e) for e in chain)
    wrapped = re.search(r"API request to \S+ failed with (timeout )?exception", text)
    status = re.search(r"too many (5\d\d) error responses|error code (5\d\d)", text)
    if not (any(isinstance(e, transport) for e in chain) or wrapped or status):
        return None
    if status:
        return f"HTTP {status[1] or status[2]}"
    lower = text.lower()
    for needle, why in (
        ("refused", "connection refused"),
        ("timed out", "timed out"),
        ("timeout", "timed out"),
        ("name resolution", "host not found"),
        ("not known", "host not found"),
        ("reset", "connection reset"),
        ("aborted", "connection lost"),
        ("disconnected", "connection lost"),
    ):
        if needle in lower:
            return why
    return type(chain[-1]).__name__


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


class ServerGap:
    """The fit's metrics and tags on their way to run ``run_id`` of the store ``uri``,
    kept while the server is away. Shared by the fit's logger and the system-metrics thread
    (one lock: at most one call to the server at a time). ``epoch`` (1-based) is the fit's,
    kept current by its logger, for the line that opens a gap."""

    def __init__(
        self, uri: str, run_id: str, client: Any = None, retry_every_s: float = RETRY_EVERY_S
    ) -> None:
        self.uri, self.run_id = uri, run_id
        self.client = client if client is not None else mlflow.MlflowClient(uri)
        self.watch = uri.startswith(("http://", "https://"))
        self.retry_every_s = retry_every_s
        self.wait_s = wait_seconds()  # read now: a bad value stops the stage before training
        self.epoch = 0
        self.metrics: list[Metric] = []  # kept, in the order they were logged
        self.tags: dict[str, str] = {}
        self.since: float | None = None  # wall time the open gap began; None: none open
        self.kept = 0  # values kept in the open gap
        self.gaps: list[str] = []  # the closed ones, for GAP_TAG
        self._next_try = 0.0
        self._lock = threading.RLock()

    @property
    def away(self) -> bool:
        """The server did not answer the last call and has not answered since."""
        return self.since is not None

    @property
    def pending(self) -> bool:
        """Something the server has not taken yet."""
        return self.away or bool(self.metrics) or bool(self.tags)

    def log_metrics(
        self, metrics: Mapping[str, float], step: int, timestamp_ms: int | None = None
    ) -> None:
        """Send ``metrics`` at ``step`` (now, or ``timestamp_ms``), or keep them while the
        server is away; raises only an error that is not the server's absence."""
        ts = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
        self._send([Metric(k, float(v), ts, int(step)) for k, v in metrics.items()], {})

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Set ``tags`` on the run, or keep them (the latest value of each) while away."""
        self._send([], {k: str(v) for k, v in tags.items()})

    def _send(self, metrics: list[Metric], tags: dict[str, str]) -> None:
        with self._lock:
            self.metrics += metrics
            self.tags.update(tags)
            if self.away:
                self.kept += len(metrics)
                if time.monotonic() < self._next_try or not self._answers():
                    return
            self.flush()

    def _answers(self) -> bool:
        """One quick ``/health`` probe, no retries; a failed one sets the next try."""
        try:
            url = self.uri.rstrip("/") + "/health"
            with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT_S) as resp:
                if resp.status == 200:
                    return True
        except (urllib.error.URLError, OSError, ValueError):
            pass
        self._next_try = time.monotonic() + self.retry_every_s
        return False

    def flush(self) -> bool:
        """Send everything kept; True when nothing is left. A server that does not answer
        opens (or keeps open) the gap; any other error drops the batch and is raised."""
        with self._lock:
            try:
                self._log_batch()
            except Exception as err:
                why = unreachable(err) if self.watch else None
                if why is None:
                    self.metrics, self.tags = [], {}  # a bad value must not block the rest
                    raise
                self._went_away(why)
                return False
            if self.away:
                self._came_back()
            return True

    def _log_batch(self) -> None:
        if self.metrics or self.tags:
            tags = [RunTag(k, v) for k, v in self.tags.items()]
            # MLflow's client splits it into requests of at most 1,000 values; a part sent
            # twice after a failure is stored once (same key, step, timestamp and value).
            self.client.log_batch(self.run_id, metrics=self.metrics, tags=tags)
        self.metrics, self.tags = [], {}

    def _went_away(self, why: str) -> None:
        self._next_try = time.monotonic() + self.retry_every_s
        if self.away:
            return
        self.since, self.kept = time.time(), len(self.metrics)
        log.warning(
            "MLflow server %s not reachable since epoch %d (%s): training goes on, metrics "
            "are kept and sent when it answers",
            self.uri,
            self.epoch,
            why,
        )

    def _came_back(self) -> None:
        assert self.since is not None
        self.gaps.append(f"{_iso(self.since)} to {_iso(time.time())}: {self.kept} values kept")
        log.info(
            "MLflow server %s answers again: %d buffered metric values sent", self.uri, self.kept
        )
        self.since, self.kept = None, 0
        self.tags[GAP_TAG] = "; ".join(self.gaps)[-5000:]  # MLflow's limit; the latest gaps
        try:
            self._log_batch()
        except Exception as err:  # gone again at once: the tag waits with the metrics
            if unreachable(err) is None:
                raise
            self._went_away(unreachable(err) or "")

    def attempt(self, calls: Callable[[], None]) -> bool:
        """Run ``calls`` (to the server) unless it is away; False when it is or when they
        find it gone (the gap opens). Other errors are raised."""
        with self._lock:
            if self.away:
                return False
            try:
                calls()
            except Exception as err:
                why = unreachable(err) if self.watch else None
                if why is None:
                    raise
                self._went_away(why)
                return False
            return True

    def settle(self, last_calls: Callable[[], None]) -> bool:
        """Send what is kept, then ``last_calls`` (the run's outputs and end), waiting up to
        ``wait_s`` seconds for an away server to answer; False if it did not by then."""
        wait_s = self.wait_s
        deadline = time.monotonic() + wait_s
        if self.away:
            log.info(
                "training finished; waiting up to %gs for MLflow server %s (%s)",
                wait_s,
                self.uri,
                WAIT_ENV,
            )
        while True:
            with self._lock:
                if (not self.away or self._answers()) and self.flush() and self.attempt(last_calls):
                    return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(2.0, left))

    def save(self, path: Path) -> int:
        """Write what the server has not taken to ``path`` (JSON); how many metric values."""
        with self._lock:
            atomic_write_json(
                path,
                {
                    "run_id": self.run_id,
                    "tracking_uri": self.uri,
                    "since": self.since if self.since is not None else time.time(),
                    "gaps": self.gaps,
                    "tags": self.tags,
                    # key, value, timestamp (ms), step: as MLflow stores them
                    "metrics": [[m.key, m.value, m.timestamp, m.step] for m in self.metrics],
                },
            )
            return len(self.metrics)

    def take_saved(self, path: Path) -> int:
        """Keep what an earlier start saved to ``path`` for this run (``save``), as an open
        gap that the next ``flush`` closes; the file is removed. How many metric values."""
        if not path.is_file():
            return 0
        try:
            raw = json.loads(path.read_text())
            if raw["run_id"] != self.run_id:
                raise ValueError(f"run_id {raw['run_id']!r} is not this run's ({self.run_id})")
            metrics = [Metric(str(k), float(v), int(t), int(s)) for k, v, t, s in raw["metrics"]]
            tags = {str(k): str(v) for k, v in raw["tags"].items()}
            gaps, since = [str(g) for g in raw["gaps"]], float(raw["since"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise TrackingError(
                f"{path}: not a list of metrics trainyard saved for MLflow run {self.run_id} "
                f"({err}); delete the file to go on without them"
            ) from None
        path.unlink()
        if not metrics and not tags:
            return 0
        with self._lock:
            self.metrics = metrics + self.metrics
            self.tags = tags | self.tags
            self.gaps = gaps + self.gaps
            self.since, self.kept = since, len(metrics)
        return len(metrics)
