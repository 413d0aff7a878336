"""The summary beside a predictions table: counts, and the model's score where labels were given.

Computed from the table itself (chunk by chunk, so it is the same for a run that was
resumed, and for shards merged into one table): predicted classes, low-confidence and
bad-file counts, and with labels the accuracy, per-class recall and a confusion matrix
(rows: the true class, columns: the predicted one, in the model's class order).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

import numpy as np
import pyarrow as pa

from trainyard.core.prediction_columns import ERROR, LABEL, LOW_CONFIDENCE, PATH, TRUE_LABEL

MAX_BAD_LISTED = 100  # bad files spelled out in the summary (the table has all of them)


class Tally:
    """Counts over a table's chunks."""

    def __init__(self, classes: list[str]) -> None:
        self.classes = classes
        self.index = {c: i for i, c in enumerate(classes)}
        self.rows = self.low = 0
        self.predicted: Counter[str] = Counter()
        self.bad: list[dict[str, str]] = []
        self.bad_count = 0
        self.confusion = np.zeros((len(classes), len(classes)), dtype=np.int64)
        self.labelled = self.unknown = 0
        self.unknown_labels: Counter[str] = Counter()

    def add(self, table: pa.Table) -> None:
        self.rows += table.num_rows
        # The counted columns only: the top-k lists as Python objects were most of the time.
        wanted = (PATH.name, LABEL.name, ERROR.name, LOW_CONFIDENCE.name, TRUE_LABEL.name)
        cols = table.select([n for n in wanted if n in table.column_names]).to_pydict()
        truth = cols.get(TRUE_LABEL.name)
        pairs = zip(cols[LABEL.name], cols[ERROR.name], strict=True)
        for i, (label, error) in enumerate(pairs):
            if error is not None:
                self.bad_count += 1
                if len(self.bad) < MAX_BAD_LISTED:
                    self.bad.append({"path": cols[PATH.name][i], "reason": error})
                continue
            self.predicted[label] += 1
            self.low += bool(cols[LOW_CONFIDENCE.name][i])
            if truth is None or not truth[i]:
                continue
            if truth[i] not in self.index:
                self.unknown += 1
                self.unknown_labels[truth[i]] += 1
                continue
            self.labelled += 1
            self.confusion[self.index[truth[i]], self.index[label]] += 1

    def result(self, label_from: str) -> dict[str, Any]:
        """The summary's counts (and ``labels`` when the source had them)."""
        out: dict[str, Any] = {
            "rows": self.rows,
            "scored": self.rows - self.bad_count,
            "predicted": {c: self.predicted.get(c, 0) for c in self.classes},
            "low_confidence": self.low,
            "bad_files": self.bad_count,
            "bad": self.bad,
        }
        if label_from:
            out["labels"] = self.scores(label_from)
        return out

    def scores(self, label_from: str) -> dict[str, Any]:
        """Accuracy, per-class recall and the confusion matrix on the labelled rows."""
        m = self.confusion
        per_class = m.sum(axis=1)
        recall = {
            c: (float(m[i, i] / per_class[i]) if per_class[i] else None)
            for i, c in enumerate(self.classes)
        }
        return {
            "from": label_from,
            "labelled": self.labelled,
            "accuracy": float(np.trace(m) / self.labelled) if self.labelled else None,
            "per_class_recall": recall,
            "confusion": {"classes": self.classes, "matrix": m.tolist()},
            "not_model_classes": dict(self.unknown_labels.most_common(20)),
            "not_model_classes_rows": self.unknown,
        }


def tally(tables: Iterable[pa.Table], classes: list[str], label_from: str) -> dict[str, Any]:
    """``Tally`` over ``tables``, as the summary's dict."""
    counts = Tally(classes)
    for table in tables:
        counts.add(table)
    return counts.result(label_from)


def summary_line(summary: dict[str, Any]) -> str:
    """One line for the log: rows, img/s, bad files, low confidence, accuracy."""
    speed = summary.get("speed", {})
    text = (
        f"{summary['rows']:,} rows ({summary['scored']:,} scored, {summary['bad_files']:,} "
        f"bad file(s), {summary['low_confidence']:,} low-confidence)"
    )
    if speed.get("img_per_s"):
        text += f", {speed['img_per_s']:,.0f} img/s on {speed.get('device', '?')}"
    labels = summary.get("labels")
    if labels and labels.get("accuracy") is not None:
        text += f"; accuracy {labels['accuracy']:.4f} on {labels['labelled']:,} labelled rows"
    return text
