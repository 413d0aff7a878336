"""The prediction log: one row per answered request, in rotating Parquet files.

The service hands each answer's row to ``PredictionLog.offer`` on the request's own path;
that only puts it on a bounded queue (never waits: a full queue drops the row and says
so), and one writer thread per process turns the queue into Parquet files. A file is
written whole under a temporary name and renamed, so a reader (``read_log``, ``trainyard
drift``) never sees half a file, and the folder is kept under ``max_bytes`` by deleting
the oldest files. Each worker process writes its own files (its pid in the name).

The columns are ``trainyard.core.prediction_columns.PREDICTION_LOG``; those drift reads
(``DRIFT_WINDOW``) are the ones a ``trainyard predict`` table has, so one reader serves both.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from trainyard.core.prediction_columns import EMBEDDING, PREDICTION_LOG, TIME, UTC_TIME, Column

log = logging.getLogger(__name__)

PATTERN = "predictions-*.parquet"
SLICE_ROWS = 256  # rows converted between two pauses of the writer thread


def arrow_field(column: Column) -> pa.Field:
    """``column`` (``trainyard.core.prediction_columns``) as a pyarrow field."""
    kind = (
        pa.timestamp("us", tz="UTC")
        if column.dtype == UTC_TIME
        else pa.type_for_alias(column.dtype)
    )
    return pa.field(column.name, pa.list_(kind) if column.is_list else kind)


# One row per request: the columns of PREDICTION_LOG, all of them in every file.
SCHEMA = pa.schema([arrow_field(c) for c in PREDICTION_LOG.columns])
COLUMNS = tuple(SCHEMA.names)


_TIME_UP = object()  # the writer's wake-up when a file's rotate_s has passed


def utc_now() -> datetime:
    return datetime.now(UTC)


@dataclass
class LogCounts:
    """What this process's log did: rows written to files, rows dropped (queue full or a
    failed write), files written, files deleted to stay under the disk bound."""

    written: int = 0
    dropped: int = 0
    files: int = 0
    deleted: int = 0
    last_error: str = ""


@dataclass
class PredictionLog:
    """A bounded queue and its writer thread (started by ``start``, stopped by ``close``).

    ``rotate_rows`` / ``rotate_s``: a file is written when this many rows are waiting, or
    this long after the first of them; ``max_bytes``: the folder's bound (oldest files
    deleted first); ``queue_rows``: rows that may wait before ``offer`` drops.
    """

    folder: Path
    rotate_rows: int = 5000
    rotate_s: float = 60.0
    max_bytes: int = 1 << 30
    queue_rows: int = 10000
    counts: LogCounts = field(default_factory=LogCounts)
    # Told ("written" | "dropped", rows) as it happens: the service counts them on /metrics.
    listener: Callable[[str, int], None] | None = None
    # What ``offer`` was given -> its row, run on the writer thread (not the caller's path).
    convert: Callable[[Any], Mapping[str, Any]] | None = None

    def __post_init__(self) -> None:
        self.folder = Path(self.folder)
        self._queue: queue.Queue[Any] = queue.Queue(self.queue_rows)
        self._thread: threading.Thread | None = None
        self._seq = 0

    def start(self) -> PredictionLog:
        self.folder.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._run, name="prediction-log", daemon=True)
        self._thread.start()
        return self

    def offer(self, row: Any) -> bool:
        """Queue one row (or what ``convert`` makes one of) for writing; False, and
        counted, when the queue is full."""
        try:
            self._queue.put_nowait(row)
        except queue.Full:
            self._count("dropped", 1)
            return False
        return True

    def _count(self, outcome: str, rows: int) -> None:
        if outcome == "written":
            self.counts.written += rows
        else:
            self.counts.dropped += rows
        if self.listener is not None:
            self.listener(outcome, rows)

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued, then stop the thread."""
        if self._thread is None:
            return
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:  # the writer is stuck: what is queued is lost, and counted
            self._count("dropped", self._queue.qsize())
            return
        self._thread.join(timeout)
        self._thread = None

    # ------------------------------------------------------------------ the writer thread

    def _run(self) -> None:
        rows: list[Any] = []
        first = 0.0
        while True:
            wait = self.rotate_s - (time.monotonic() - first) if rows else None
            try:
                row = self._queue.get(timeout=max(wait, 0.0) if wait is not None else None)
            except queue.Empty:
                row = _TIME_UP
            if row is None:  # close(): write what is left, stop
                self._flush(rows)
                return
            if row is not _TIME_UP:
                if not rows:
                    first = time.monotonic()
                rows.append(row)
            due = rows and (
                len(rows) >= self.rotate_rows or time.monotonic() - first >= self.rotate_s
            )
            if due:
                self._flush(rows)
                rows = []

    def _flush(self, rows: list[Any]) -> None:
        if not rows:
            return
        self._seq += 1
        stamp = utc_now().strftime("%Y%m%dT%H%M%S%f")
        path = self.folder / f"predictions-{stamp}-{os.getpid()}-{self._seq:06d}.parquet"
        tmp = path.with_name("." + path.name + ".tmp")
        try:
            pq.write_table(_table_in_slices(rows, self.convert), tmp, compression="zstd")
            os.replace(tmp, path)
        # A full disk, or a row the schema cannot hold: those rows are dropped and counted,
        # the writer goes on.
        except (OSError, ValueError, TypeError, KeyError, pa.ArrowException) as err:
            tmp.unlink(missing_ok=True)
            self._count("dropped", len(rows))
            self.counts.last_error = f"{type(err).__name__}: {err}"
            log.warning(
                "prediction log: %d rows dropped, cannot write %s: %s", len(rows), path, err
            )
            return
        self._count("written", len(rows))
        self.counts.files += 1
        self.counts.deleted += keep_under(self.folder, self.max_bytes)


def rows_table(rows: Sequence[Mapping[str, Any]]) -> pa.Table:
    """Rows (dicts with any subset of the schema's columns) -> a table of the full schema.
    An embedding may be a numpy array: a slice whose rows all have one of the same size is
    built from one flat array (the per-value Python list would hold the GIL, and with it
    the service's answers, far longer)."""
    arrays = [
        _embedding_column([row.get(name) for row in rows])
        if name == EMBEDDING.name
        else pa.array([row.get(name) for row in rows], type=SCHEMA.field(name).type)
        for name in COLUMNS
    ]
    return pa.Table.from_arrays(arrays, schema=SCHEMA)


def _embedding_column(values: list[Any]) -> pa.Array:
    kind = SCHEMA.field(EMBEDDING.name).type
    if values and all(isinstance(v, np.ndarray) and v.ndim == 1 for v in values):
        sizes = {v.shape[0] for v in values}
        if len(sizes) == 1:
            flat = np.concatenate(values).astype(np.float32, copy=False)
            offsets = np.arange(len(values) + 1, dtype=np.int32) * sizes.pop()
            return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat), type=kind)
    return pa.array([v.tolist() if isinstance(v, np.ndarray) else v for v in values], type=kind)


def _table_in_slices(
    rows: list[Any], convert: Callable[[Any], Mapping[str, Any]] | None
) -> pa.Table:
    """The table of ``rows``, built a slice at a time with a pause between slices: the
    writer thread gives the GIL back to the request threads between them."""
    tables = []
    for at in range(0, len(rows), SLICE_ROWS):
        part = rows[at : at + SLICE_ROWS]
        tables.append(rows_table([convert(r) for r in part] if convert else part))
        time.sleep(0)  # let the answers run
    return pa.concat_tables(tables)


def log_files(folder: Path) -> list[Path]:
    """The log's complete files, oldest first (their names start with the UTC time)."""
    return sorted(Path(folder).glob(PATTERN))


def keep_under(folder: Path, max_bytes: int) -> int:
    """Delete the oldest log files until the folder's files total at most ``max_bytes``
    (the newest file always stays); the number deleted."""
    files = log_files(folder)
    sizes = []
    for path in files:
        try:
            sizes.append(path.stat().st_size)
        except FileNotFoundError:  # another worker's cleanup took it
            sizes.append(0)
    total, deleted = sum(sizes), 0
    for path, size in zip(files[:-1], sizes[:-1], strict=True):
        if total <= max_bytes:
            break
        path.unlink(missing_ok=True)
        total -= size
        deleted += 1
    return deleted


def read_log(
    folder: Path, since: datetime | None = None, until: datetime | None = None
) -> pa.Table:
    """Every row of the log in ``folder`` (all processes' files), optionally only those
    with ``since <= time < until``, in time order."""
    files = log_files(folder)
    if not files:
        return SCHEMA.empty_table()
    tables = []
    for path in files:
        try:
            tables.append(pq.read_table(path, schema=SCHEMA))
        except FileNotFoundError:  # deleted by the disk bound while we listed
            continue
    table = pa.concat_tables(tables) if tables else SCHEMA.empty_table()
    # A row with no time compares as null, and filter drops it.
    if since is not None:
        table = table.filter(pc.greater_equal(table.column(TIME.name), _utc(since)))
    if until is not None:
        table = table.filter(pc.less(table.column(TIME.name), _utc(until)))
    return table.sort_by(TIME.name)


def _utc(t: datetime) -> pa.Scalar:
    """``t`` as the time column's type; a time without a zone is taken as UTC."""
    return pa.scalar(t if t.tzinfo else t.replace(tzinfo=UTC), SCHEMA.field(TIME.name).type)
