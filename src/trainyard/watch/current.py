"""The current window drift compares: a prediction-log folder, or a ``trainyard predict``
table (.parquet or .csv), read with pyarrow alone (watch does not import bulk).

Both name the columns drift reads alike (``trainyard.core.prediction_columns.DRIFT_WINDOW``):
``label`` (top-1), ``probability`` (its probability), and ``embedding`` (list<float32>)
where the model has one. A predict table's rows with an ``error`` (a file that could not be
read) carry no prediction and are skipped, as are the log's rows of another model than the
reference's (after a champion swap).
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from trainyard.core.errors import DataError
from trainyard.core.prediction_columns import (
    DRIFT_WINDOW,
    EMBEDDING,
    ERROR,
    LABEL,
    MODEL_SHA256,
    MODEL_VERSION,
    PROBABILITY,
    REGISTRY_VERSION,
    TABLE_FORMATS,
)
from trainyard.watch.drift_score import OTHER_MODEL, Window
from trainyard.watch.log import log_files, read_log

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def parse_duration(text: str, option: str = "--last") -> timedelta:
    """``90m``, ``24h``, ``7d``, ``1w`` -> a timedelta; a DataError naming ``option``."""
    m = _DURATION.match(text)
    if not m or float(m.group(1)) <= 0:
        raise DataError(f"{option} {text!r}: expected a positive duration such as 90m, 24h, 7d")
    return timedelta(**{_UNITS[m.group(2)]: float(m.group(1))})


def parse_time(text: str, option: str) -> datetime:
    """An ISO 8601 time (UTC when it names no zone); a DataError naming ``option``."""
    try:
        t = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise DataError(
            f"{option} {text!r}: expected an ISO 8601 time such as 2025-06-01T00:00 "
            "(UTC unless it names a zone)"
        ) from None
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


def read_window(
    source: str | Path,
    *,
    model_sha256: str = "",
    since: datetime | None = None,
    until: datetime | None = None,
) -> Window:
    """The predictions in ``source``: a prediction-log folder (rows with ``since <= time <
    until``), or a predict table (.parquet, .pq, .csv); of the model whose sha256 is
    ``model_sha256`` when given. A DataError naming the source when it cannot be read."""
    path = Path(source)
    if path.is_dir():
        if not log_files(path):
            raise DataError(
                f"{path}: no prediction log files (predictions-*.parquet) in this folder; "
                "the service writes them with serve.log_predictions"
            )
        try:
            table = read_log(path, since, until)
        except (OSError, pa.ArrowException) as err:
            raise DataError(f"{path}: cannot read the prediction log: {err}") from None
        return window_from_table(table, f"{path} (prediction log)", model_sha256)
    if since is not None or until is not None:
        raise DataError(
            f"{path}: --last/--since/--until select a window of a prediction-log folder; "
            "a predict table is compared whole"
        )
    return window_from_table(read_table(path), str(path), model_sha256)


def read_table(path: Path) -> pa.Table:
    """A predict output table, by its extension."""
    if not path.is_file():
        raise DataError(f"{path}: not found (expected a prediction-log folder or a .parquet/.csv)")
    fmt = TABLE_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise DataError(f"{path}: expected a .parquet or .csv predictions table, or a log folder")
    try:
        return pq.read_table(path) if fmt == "parquet" else pa_csv.read_csv(path)
    except (OSError, pa.ArrowException) as err:
        raise DataError(f"{path}: not a readable predictions table ({err})") from None


def _answered(table: pa.Table, rows: pa.ChunkedArray, column: str) -> str:
    """Which registered versions (``column``) answered ``rows``, and how to compare them with
    their own reference: after a champion swap the workspace's reference is often another
    model's."""
    if column not in table.column_names:
        return ""
    names = pc.unique(table.filter(rows).column(column)).to_pylist()
    versions = sorted(v for v in names if v and "/" in v)
    if not versions:
        return ""
    return f"; {', '.join(versions)} answered them (--reference models:/{versions[0]})"


def _of_the_model(table: pa.Table, model_sha256: str) -> tuple[pa.ChunkedArray, str] | None:
    """The rows the reference's model answered, and the column that names the registered
    version of each row: a predict table holds the model's whole sha256 (its model_version
    is NAME/N), the log the sha256's first 12 hex digits (its registry_version is NAME/N).
    None: the table does not say which model answered."""
    if MODEL_SHA256.name in table.column_names:
        return pc.equal(table.column(MODEL_SHA256.name), model_sha256), MODEL_VERSION.name
    if MODEL_VERSION.name in table.column_names:
        mine = pc.equal(table.column(MODEL_VERSION.name), model_sha256[:12])
        return mine, REGISTRY_VERSION.name
    return None


def window_from_table(table: pa.Table, source: str, model_sha256: str = "") -> Window:
    """The window of a log or predict table: rows with a prediction and no error."""
    missing = [c for c in DRIFT_WINDOW.required if c not in table.column_names]
    if missing:
        raise DataError(
            f"{source}: no {' or '.join(missing)} column: not a prediction log or a "
            "`trainyard predict` table"
        )
    skipped: dict[str, int] = {}
    keep = pc.is_valid(table.column(LABEL.name))
    if ERROR.name in table.column_names:
        has_error = pc.fill_null(pc.not_equal(table.column(ERROR.name), ""), False)
        keep = pc.and_(keep, pc.invert(has_error))
    skipped["unreadable (an error, no prediction)"] = table.num_rows - (pc.sum(keep).as_py() or 0)
    found = _of_the_model(table, model_sha256) if model_sha256 else None
    if found is not None:
        mine = pc.fill_null(found[0], False)
        others = pc.and_(keep, pc.invert(mine))
        why = f"{OTHER_MODEL} ({model_sha256[:12]})"
        skipped[why + _answered(table, others, found[1])] = pc.sum(others).as_py() or 0
        keep = pc.and_(keep, mine)
    table = table.filter(keep)
    probs = table.column(PROBABILITY.name).to_numpy(zero_copy_only=False).astype(np.float32)
    if probs.size and (np.isnan(probs).any() or probs.min() < 0 or probs.max() > 1):
        raise DataError(f"{source}: probability column holds values outside 0..1")
    labels = np.asarray(table.column(LABEL.name).to_pylist(), dtype=object)
    return Window(
        labels=labels.astype(str) if labels.size else np.array([], str),
        probabilities=probs,
        embeddings=_embeddings(table, source),
        source=source,
        skipped={why: int(n) for why, n in skipped.items() if n},
    )


def _embeddings(table: pa.Table, source: str) -> np.ndarray | None:
    """The ``embedding`` column as [n, D] float32; None when absent or null on every row.
    A CSV holds it as JSON lists. Some rows without one (a model swapped mid-window) is
    an error: the window mixes two models."""
    if EMBEDDING.name not in table.column_names or table.num_rows == 0:
        return None
    column = table.column(EMBEDDING.name)
    if column.null_count == table.num_rows:
        return None
    if column.null_count:
        raise DataError(
            f"{source}: {column.null_count} of {table.num_rows} rows have no embedding: the "
            "window mixes a model with an embedding output and one without; narrow it"
        )
    text = pa.types.is_string(column.type) or pa.types.is_large_string(column.type)
    try:
        rows = [json.loads(v) for v in column.to_pylist()] if text else column.to_pylist()
        out = np.asarray(rows, dtype=np.float32)
    except ValueError:
        raise DataError(f"{source}: embeddings of different lengths: two models' rows") from None
    if out.ndim != 2 or not np.isfinite(out).all():
        raise DataError(f"{source}: the embedding column is not finite [n, D] numbers")
    return out
