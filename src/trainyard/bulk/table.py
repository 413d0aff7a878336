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
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from trainyard.bulk.heatmaps import heatmap_name
from trainyard.core.errors import DataError
from trainyard.core.io import atomic_file, atomic_write_json
from trainyard.core.prediction_columns import (
    ERROR,
    HEATMAP,
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


def schema(labelled: bool, explained: bool = False) -> pa.Schema:
    """The table's columns (``PREDICT_TABLE``; ``true_label`` only when the source gave
    labels, ``heatmap`` only with --explain)."""
    wanted = {TRUE_LABEL.name: labelled, HEATMAP.name: explained}
    columns = PREDICT_TABLE.without(*(name for name, there in wanted.items() if not there))
    return pa.schema([arrow_field(c) for c in columns])


# The columns a CSV cell holds as JSON (one value a cell).
LIST_COLUMNS = tuple(c for c in PREDICT_TABLE.columns if c.is_list)


class Ranked(NamedTuple):
    """The top-k of a chunk's rows, flat: the class indices and probabilities of the rows
    that were scored, one row after the other, and how many each row has (0: none)."""

    indices: np.ndarray  # into ``classes``
    classes: list[str]
    probabilities: np.ndarray  # float32
    lengths: np.ndarray  # per row


def ranked_table(
    paths: list[str],
    ranked: Ranked,
    problems: list[str | None],
    true_labels: list[str] | None,
    *,
    min_confidence: float,
    version: str,
    sha256: str,
    heatmaps: str = "",
    first: int = 0,
) -> pa.Table:
    """The rows of ``paths`` from flat top-k arrays (a row's top-k best first, none with its
    problem; ``true_labels`` "" = none, when the source gave labels; ``heatmaps``: with
    --explain, the folder whose ``heatmap_name`` of the source's row, ``first`` the first
    of ``paths``, a scored row's ``heatmap`` names). The columns are built
    from their buffers and the labels by Arrow from the class names: a chunk of 4,096 rows
    in milliseconds (``pa.array`` would also import pandas, half a second, to ask whether a
    list is a DataFrame)."""
    n, scored = len(paths), ranked.lengths > 0
    offsets = np.zeros(n + 1, np.int32)
    np.cumsum(ranked.lengths, out=offsets[1:])
    firsts = offsets[:-1][scored]
    p1 = np.zeros(n, np.float32)
    p1[scored] = ranked.probabilities[firsts]
    # In float64, as a Python float compares: 0.1 is not a float32.
    low = p1.astype(np.float64) < min_confidence
    top1 = np.zeros(n, np.int32)
    top1[scored] = ranked.indices[firsts]
    classes = list(ranked.classes)
    cols: dict[str, pa.Array] = {
        PATH.name: strings(paths),
        LABEL.name: _decoded(top1, classes, scored),
        PROBABILITY.name: _fixed(pa.float32(), p1, scored),
        TOP_LABELS.name: _lists(pa.string(), _decoded(ranked.indices, classes), offsets, scored),
        TOP_PROBABILITIES.name: _lists(
            pa.float32(), _fixed(pa.float32(), ranked.probabilities), offsets, scored
        ),
        LOW_CONFIDENCE.name: _fixed(pa.bool_(), low, scored),
        ERROR.name: strings(problems),
        MODEL_VERSION.name: _decoded(np.zeros(n, np.int32), [version]),
        MODEL_SHA256.name: _decoded(np.zeros(n, np.int32), [sha256]),
    }
    if true_labels is not None:
        cols[TRUE_LABEL.name] = strings([label or None for label in true_labels])
    if heatmaps:
        cols[HEATMAP.name] = strings(
            [f"{heatmaps}/{heatmap_name(first + i)}" if ok else None for i, ok in enumerate(scored)]
        )
    table_schema = schema(true_labels is not None, bool(heatmaps))
    return pa.Table.from_arrays([cols[name] for name in table_schema.names], schema=table_schema)


def _validity(valid: np.ndarray | None) -> pa.Buffer | None:
    """Arrow's validity bitmap (None: every value is there)."""
    if valid is None or valid.all():
        return None
    return pa.py_buffer(np.packbits(valid, bitorder="little"))


def strings(values: list[str] | list[str | None]) -> pa.Array:
    """A string array (None: null) from its buffers."""
    encoded = [b"" if v is None else v.encode() for v in values]
    offsets = np.zeros(len(values) + 1, np.int32)
    np.cumsum(np.fromiter(map(len, encoded), np.int64, len(encoded)), out=offsets[1:])
    valid = np.fromiter((v is not None for v in values), bool, len(values))
    buffers = [_validity(valid), pa.py_buffer(offsets), pa.py_buffer(b"".join(encoded))]
    return pa.Array.from_buffers(pa.string(), len(values), buffers)


def _decoded(indices: np.ndarray, names: list[str], valid: np.ndarray | None = None) -> pa.Array:
    """``names[indices]`` as a string array (null where not ``valid``), taken by NumPy from
    the names' padded bytes: Arrow's ``dictionary_decode`` would import pyarrow.compute,
    70 ms of every job's start-up."""
    encoded = [name.encode() for name in names]
    lengths = np.fromiter(map(len, encoded), np.int32, len(encoded))
    width = max(1, int(lengths.max(initial=0)))
    padded = np.zeros((len(encoded), width), np.uint8)
    for i, raw in enumerate(encoded):
        padded[i, : len(raw)] = np.frombuffer(raw, np.uint8)
    rows = np.asarray(indices, np.intp)
    sizes = lengths[rows] if valid is None else np.where(valid, lengths[rows], 0)
    offsets = np.zeros(len(rows) + 1, np.int32)
    np.cumsum(sizes, out=offsets[1:])
    data = padded[rows][np.arange(width) < sizes[:, None]]
    buffers = [_validity(valid), pa.py_buffer(offsets), pa.py_buffer(data.tobytes())]
    return pa.Array.from_buffers(pa.string(), len(rows), buffers)


def _fixed(kind: pa.DataType, values: np.ndarray, valid: np.ndarray | None = None) -> pa.Array:
    """A float32 or bool array (``valid``: where it is not null) from its buffers."""
    if kind == pa.bool_():
        data = pa.py_buffer(np.packbits(values, bitorder="little"))
    else:
        data = pa.py_buffer(np.ascontiguousarray(values, np.float32))
    return pa.Array.from_buffers(kind, len(values), [_validity(valid), data])


def _lists(kind: pa.DataType, values: pa.Array, offsets: np.ndarray, valid: np.ndarray) -> pa.Array:
    """A list array: row i is ``values[offsets[i]:offsets[i + 1]]``, null where not ``valid``."""
    buffers = [_validity(valid), pa.py_buffer(offsets)]
    return pa.Array.from_buffers(pa.list_(kind), len(offsets) - 1, buffers, children=[values])


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
            # ParquetFile, not pq.read_table: the latter imports pandas (half a second).
            with pq.ParquetFile(self.chunk_file(index)) as pf:
                yield pf.read()

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
