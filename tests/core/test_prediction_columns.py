"""One schema for the prediction tables (``trainyard.core.prediction_columns``): the table
``trainyard predict`` writes, the service's prediction log and drift's reader agree on it,
and docs/predict.md's column table is the same table."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from trainyard.bulk import table as bulk_table
from trainyard.core.config import ServeParams
from trainyard.core.prediction_columns import (
    DRIFT_WINDOW,
    HEATMAP,
    PREDICT_TABLE,
    PREDICTION_LOG,
    TRUE_LABEL,
    UTC_TIME,
)
from trainyard.serve.log_and_shadow import Seen, ShadowAnswer, log_row
from trainyard.watch import log as watch_log
from trainyard.watch.current import read_window

from conftest import REPO

SHA = "ab" * 32


def bulk_chunk(labelled: bool, heatmaps: str = ""):
    """Three rows as bulk scoring writes them: two scored, one unreadable (``heatmaps``:
    with --explain, the source's rows 10 to 12)."""
    ranked = bulk_table.Ranked(
        np.array([0, 1, 1, 0], np.int32),  # cat, dog | (unreadable) | dog, cat
        ["cat", "dog"],
        np.array([0.9, 0.1, 0.4, 0.35], np.float32),
        np.array([2, 0, 2], np.int64),
    )
    return bulk_table.ranked_table(
        ["a.png", "b.png", "c.png"],
        ranked,
        [None, "not an image", None],
        ["cat", "", "cat"] if labelled else None,
        min_confidence=0.5,
        version="local",
        sha256=SHA,
        heatmaps=heatmaps,
        first=10,
    )


def served(label: str, probability: float, shadow: bool) -> dict:
    """The log row of one answer, as the service makes it."""
    answer = {
        "label": label,
        "class_id": 0,
        "probabilities": [probability, 1 - probability],
        "top_k": [{"label": label, "probability": probability}],
        "model_version": SHA[:12],
    }
    seen = Seen(
        "/classify",
        answer,
        "trainyard/3",
        2.5,
        {"width": 4, "height": 4, "format": "PNG"},
        embedding=np.ones(3, np.float32) * probability,
        image=b"png",
    )
    other = ShadowAnswer("cd" * 6, "trainyard/4", label, 0.5, 3.0) if shadow else None
    return log_row(seen, other, ServeParams(log_images=True))


@pytest.mark.parametrize("suffix", [".parquet", ".csv"])
def test_a_predict_table_and_a_log_are_read_alike_by_drift(tmp_path: Path, suffix: str) -> None:
    chunk = bulk_chunk(labelled=True, heatmaps="scores.heatmaps")
    assert chunk.column_names == list(PREDICT_TABLE.names)
    assert chunk.column(HEATMAP.name).to_pylist() == [
        "scores.heatmaps/0000010.png",
        None,  # unreadable: no heatmap
        "scores.heatmaps/0000012.png",
    ]
    out = tmp_path / f"scores{suffix}"
    bulk_table.write_table(out, bulk_table.output_format(out), iter([chunk]), chunk.schema)
    assert next(bulk_table.read_tables(out)).equals(chunk)  # bulk's own reader (merge)

    table_window = read_window(out)
    assert table_window.labels.tolist() == ["cat", "dog"]
    assert table_window.probabilities.tolist() == pytest.approx([0.9, 0.4])
    assert table_window.skipped == {"unreadable (an error, no prediction)": 1}

    folder = tmp_path / "log"
    plog = watch_log.PredictionLog(folder).start()
    for label, p, shadow in (("cat", 0.9, True), ("dog", 0.4, False)):
        assert plog.offer(served(label, p, shadow))
    plog.close()
    assert plog.counts.written == 2 and plog.counts.dropped == 0
    assert pq.read_schema(watch_log.log_files(folder)[0]).names == list(PREDICTION_LOG.names)
    log_window = read_window(folder, model_sha256=SHA)
    assert log_window.labels.tolist() == table_window.labels.tolist()
    assert log_window.probabilities.tolist() == table_window.probabilities.tolist()
    assert log_window.embeddings == pytest.approx(np.array([[0.9] * 3, [0.4] * 3]))


def test_the_writers_build_one_type_for_each_column() -> None:
    """Each column has one type in both tables, whichever writer builds it."""
    log_fields = {f.name: f for f in watch_log.SCHEMA}
    for column in PREDICT_TABLE.columns:
        assert bulk_table.arrow_field(column) == watch_log.arrow_field(column)
    for name in set(PREDICT_TABLE.names) & set(PREDICTION_LOG.names):
        assert bulk_table.schema(True).field(name) == log_fields[name]
    assert set(DRIFT_WINDOW.required) <= set(PREDICT_TABLE.names) & set(PREDICTION_LOG.names)
    assert set(DRIFT_WINDOW.names) <= set(PREDICT_TABLE.names) | set(PREDICTION_LOG.names)
    assert bulk_table.schema(False).names == [
        n for n in PREDICT_TABLE.names if n not in (TRUE_LABEL.name, HEATMAP.name)
    ]
    assert bulk_table.schema(True, explained=True).names == list(PREDICT_TABLE.names)
    assert bulk_chunk(labelled=False).column_names == bulk_table.schema(False).names
    explained = bulk_chunk(labelled=False, heatmaps="h")
    assert explained.column_names == bulk_table.schema(False, explained=True).names
    with pytest.raises(ValueError, match="not optional"):
        PREDICT_TABLE.without("label")


def test_the_service_logs_only_the_logs_columns() -> None:
    """A key the log does not have would be dropped without a word: none is."""
    for shadow in (True, False):
        assert set(served("cat", 0.9, shadow)) <= set(PREDICTION_LOG.names)
    assert set(served("cat", 0.9, True)) == set(PREDICTION_LOG.names)


def doc_columns() -> dict[str, tuple[str, str]]:
    """docs/predict.md's column table: name -> (type, in)."""
    text = (REPO / "docs" / "predict.md").read_text()
    section = text.split("## The columns of a predict table and of the prediction log")[1]
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+) \| ([^|]+) \|", section, re.M)
    return {name: (kind.strip(), where.strip()) for name, kind, where in rows}


def test_the_docs_column_table_is_the_module() -> None:
    documented = doc_columns()
    every = {c.name: c for c in PREDICT_TABLE.columns + PREDICTION_LOG.columns}
    assert set(documented) == set(every)
    for name, (kind, where) in documented.items():
        column = every[name]
        want = UTC_TIME if column.dtype == UTC_TIME else column.dtype
        assert kind == (f"list<{want}>" if column.is_list else want), name
        tables = {"predict": PREDICT_TABLE, "log": PREDICTION_LOG}
        assert {t for t, cols in tables.items() if name in cols.names} == set(
            re.findall(r"predict|log", where)
        ), name
        assert ("only" in where) == (name in PREDICT_TABLE.optional), name
