"""The predictions table: its rows (the columns of ``core.prediction_columns.PREDICT_TABLE``),
its chunks on disk, and the one final file.

A job writes its rows in chunks of ``predict.chunk_rows`` (each chunk file atomically,
under ``.<out>.parts/`` beside the output, with a ``job.json`` naming the job). A killed
run, rerun with the same command, finds the chunks already written and scores only the
rest; a changed source, model or setting starts over (and says why). The final file is
written from the chunks at the end, atomically, and the chunks are removed: it holds the
same bytes whether the run was interrupted or not (one Parquet row group per chunk).

Output by extension: ``.parquet`` (default) or ``.csv`` (the top-k columns as JSON lists).
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from trainyard.core.errors import DataError
from trainyard.core.io import atomic_file, atomic_write_json
from trainyard.core.prediction_columns import (
    ERROR,
    LABEL,
    LOW_CONFIDENCE,
    MODEL_SHA256,
    MODEL_VERSION,
    PATH,
    PREDICT_TABLE,
    PROBABILITY,
    TABLE_FORMATS,
    TOP_LABELS,
    TOP_PROBABILITIES,
    TRUE_LABEL,
    Column,
)

log = logging.getLogger(__name__)

JOB_FILE = "job.json"


def output_format(out: Path) -> str:
    """``parquet`` or ``csv``, from the output's extension."""
    fmt = TABLE_FORMATS.get(out.suffix.lower())
    if fmt is None:
        raise DataError(f"--out {out}: write .parquet (default) or .csv")
    return fmt


def summary_path(out: Path) -> Path:
    """The summary JSON beside the table: ``scores.parquet`` -> ``scores.summary.json``."""
    return out.with_name(out.stem + ".summary.json")


def arrow_field(column: Column) -> pa.Field:
    """``column`` (``trainyard.core.prediction_columns``) as a pyarrow field."""
    kind = pa.type_for_alias(column.dtype)
    return pa.field(column.name, pa.list_(kind) if column.is_list else kind)


def schema(labelled: bool) -> pa.Schema:
    """The table's columns (``PREDICT_TABLE``; ``true_label`` only when the source gave
    labels)."""
    columns = PREDICT_TABLE.columns if labelled else PREDICT_TABLE.without(TRUE_LABEL.name)
    return pa.schema([arrow_field(c) for c in columns])


# The columns a CSV cell holds as JSON (one value a cell).
LIST_COLUMNS = tuple(c for c in PREDICT_TABLE.columns if c.is_list)


def chunk_table(
    paths: list[str],
    ranked: list[tuple[list[str], list[float]] | None],
    problems: list[str | None],
    true_labels: list[str] | None,
    *,
    min_confidence: float,
    version: str,
    sha256: str,
) -> pa.Table:
    """The rows of ``paths``: each one's top-k (labels, probabilities), best first, or None
    with its problem; ``true_labels`` ("" = none) when the source gave labels."""
    n = len(paths)
    p1 = [r[1][0] if r else None for r in ranked]
    low = [None if p is None else p < min_confidence for p in p1]
    cols: dict[str, Any] = {
        PATH.name: paths,
        LABEL.name: [r[0][0] if r else None for r in ranked],
        PROBABILITY.name: p1,
        TOP_LABELS.name: [r[0] if r else None for r in ranked],
        TOP_PROBABILITIES.name: [r[1] if r else None for r in ranked],
        LOW_CONFIDENCE.name: low,
        ERROR.name: problems,
        MODEL_VERSION.name: [version] * n,
        MODEL_SHA256.name: [sha256] * n,
    }
    if true_labels is not None:
        cols[TRUE_LABEL.name] = [label or None for label in true_labels]
    return pa.Table.from_pydict(cols, schema=schema(true_labels is not None))


class ChunkStore:
    """The chunks of one job's output, and the job they belong to."""

    def __init__(self, out: Path, job: dict[str, Any]) -> None:
        self.out, self.job = out, job
        self.parts = out.parent / f".{out.name}.parts"

    def chunk_file(self, index: int) -> Path:
        return self.parts / f"chunk-{index:07d}.parquet"

    def open(self) -> set[int]:
        """The chunks already written by an earlier run of this same job (empty when none,
        or when the job changed: those chunks are removed, and the log says why)."""
        job_file = self.parts / JOB_FILE
        if job_file.is_file():
            try:
                before = json.loads(job_file.read_text())
            except (OSError, ValueError):
                before = None
            if before == self.job:
                done = {
                    int(p.stem.removeprefix("chunk-"))
                    for p in self.parts.glob("chunk-*.parquet")
                    if p.stem.removeprefix("chunk-").isdigit()
                }
                return done
            changed = sorted(k for k in self.job if not before or before.get(k) != self.job.get(k))
            log.info(
                "an earlier run left chunks in %s for another job (changed: %s): starting over",
                self.parts,
                ", ".join(changed) or "its record",
            )
        shutil.rmtree(self.parts, ignore_errors=True)
        self.parts.mkdir(parents=True, exist_ok=True)
        atomic_write_json(job_file, self.job)
        return set()

    def write(self, index: int, table: pa.Table) -> None:
        """Chunk ``index``, atomically: a kill mid-write leaves no half chunk."""
        try:
            with atomic_file(self.chunk_file(index)) as tmp:
                pq.write_table(table, tmp)
        except OSError as err:  # a full disk: what is written stays; the rerun continues
            raise DataError(
                f"cannot write {self.chunk_file(index)} ({err.strerror or err}); the chunks "
                "written so far are kept: free space and rerun the same command to continue"
            ) from None

    def chunks(self, count: int) -> Iterator[pa.Table]:
        """The ``count`` chunks in order, each read back from its file."""
        for index in range(count):
            yield pq.read_table(self.chunk_file(index))

    def finish(self, count: int, fmt: str) -> None:
        """Write the final file from the chunks, atomically; then remove the chunks."""
        write_table(self.out, fmt, self.chunks(count), pq.read_schema(self.chunk_file(0)))
        shutil.rmtree(self.parts, ignore_errors=True)


def write_table(out: Path, fmt: str, tables: Iterator[pa.Table], table_schema: pa.Schema) -> None:
    """Stream ``tables`` into ``out`` (Parquet: one row group each; CSV: the list columns
    as JSON), written to a temp file that replaces ``out`` only when whole."""
    try:
        with atomic_file(out) as tmp:
            if fmt == "parquet":
                with pq.ParquetWriter(tmp, table_schema) as writer:
                    for table in tables:
                        writer.write_table(table)
            else:
                with contextlib.ExitStack() as stack:
                    writer = None
                    for table in tables:
                        flat = csv_ready(table)
                        if writer is None:
                            writer = stack.enter_context(pa_csv.CSVWriter(tmp, flat.schema))
                        writer.write_table(flat)
    except OSError as err:
        raise DataError(f"cannot write {out} ({err.strerror or err})") from None


def csv_ready(table: pa.Table) -> pa.Table:
    """The list columns as JSON text (a CSV cell holds one value)."""
    for column in LIST_COLUMNS:
        at = table.schema.get_field_index(column.name)
        values = [json.dumps(v) for v in table.column(column.name).to_pylist()]
        table = table.set_column(at, column.name, pa.array(values, pa.string()))
    return table


def read_tables(path: Path) -> Iterator[pa.Table]:
    """A finished output (or shard output) back as tables, a row group at a time for
    Parquet: merging N shards holds one row group, not N files, in memory."""
    if output_format(path) == "parquet":
        with pq.ParquetFile(path) as pf:
            for i in range(pf.num_row_groups):
                yield pf.read_row_group(i)
    else:
        # Each column read as the type it was written with (the schema's, not a guess).
        types = {c.name: arrow_field(c).type for c in PREDICT_TABLE.columns if not c.is_list}
        options = pa_csv.ConvertOptions(column_types=types, strings_can_be_null=True)
        reader = pa_csv.open_csv(path, convert_options=options)
        for batch in reader:
            table = pa.Table.from_batches([batch])
            for column in LIST_COLUMNS:
                at = table.schema.get_field_index(column.name)
                cells = table.column(column.name).to_pylist()
                lists = [json.loads(v) if v else None for v in cells]
                table = table.set_column(at, column.name, pa.array(lists, arrow_field(column).type))
            yield table
