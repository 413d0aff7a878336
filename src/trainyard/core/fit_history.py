"""The fit's per-epoch history as a CSV (``models/history.csv``): its columns, the writer and
the reader. The train stage's callback (``trainyard.training.history.History``) writes it;
the evaluate stage's learning curves and ``dvc plots`` read it. It lives here, with no torch
or Lightning, so that the evaluate stage reads it without importing them.
"""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path

from trainyard.core.errors import DataError

EPOCH, STEP, TRAIN_LOSS, VAL_LOSS, VAL_ACC, LR, EPOCH_TIME = (
    "epoch",
    "step",
    "train/loss",
    "val/loss",
    "val/acc",
    "lr",
    "epoch_time_s",
)
COLUMNS = (EPOCH, STEP, TRAIN_LOSS, VAL_LOSS, VAL_ACC, LR, EPOCH_TIME)
Row = dict[str, float | int | None]
HISTORY_FILE = "history.csv"  # in the train stage's out folder: models/history.csv


def history_csv(rows: list[Row]) -> str:
    """The CSV text of ``rows``: the header, then one line per epoch; a missing value is an
    empty field (``nan`` would be read as a number by some readers and not by others)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(COLUMNS)
    for row in rows:
        writer.writerow(["" if row.get(c) is None else row[c] for c in COLUMNS])
    return buf.getvalue()


def _number(text: str, path: Path, line: int, column: str) -> float | None:
    if text.strip() == "":
        return None
    try:
        return float(text)
    except ValueError:
        raise DataError(
            f"{path}: line {line}, column {column!r}: {text!r} is not a number"
        ) from None


def read_history(path: str | os.PathLike[str]) -> list[Row]:
    """The rows of a history CSV, in file order (``epoch`` and ``step`` as int, the rest float
    or None). Raises ``DataError`` naming the file for a missing column or a bad number."""
    path = Path(path)
    with open(path, newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        missing = [c for c in (EPOCH, STEP) if c not in (reader.fieldnames or ())]
        if missing:
            raise DataError(f"{path}: no column {', '.join(missing)} (header {reader.fieldnames})")
        rows = []
        for line, raw in enumerate(reader, start=2):
            row: Row = {c: _number(raw.get(c) or "", path, line, c) for c in COLUMNS}
            if row[EPOCH] is None or row[STEP] is None:
                raise DataError(f"{path}: line {line} has no epoch or step")
            row[EPOCH], row[STEP] = int(row[EPOCH]), int(row[STEP])
            rows.append(row)
    return rows
