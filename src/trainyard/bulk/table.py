"""The predictions table: its columns, its chunks on disk, and the one final file.

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

log = logging.getLogger(__name__)

FORMATS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv"}
JOB_FILE = "job.json"


def output_format(out: Path) -> str:
    """``parquet`` or ``csv``, from the output's extension."""
    fmt = FORMATS.get(out.suffix.lower())
    if fmt is None:
        raise DataError(f"--out {out}: write .parquet (default) or .csv")
    return fmt


def summary_path(out: Path) -> Path:
    """The summary JSON beside the table: ``scores.parquet`` -> ``scores.summary.json``."""
    return out.with_name(out.stem + ".summary.json")


def schema(labelled: bool) -> pa.Schema:
    """The table's columns (``true_label`` only when the source gave labels)."""
    fields = [
        pa.field("path", pa.string()),
        pa.field("label", pa.string()),  # top-1; null for a file that could not be read
        pa.field("probability", pa.float32()),
        pa.field("top_labels", pa.list_(pa.string())),
        pa.field("top_probabilities", pa.list_(pa.float32())),
        pa.field("low_confidence", pa.bool_()),
    ]
    if labelled:
        fields.append(pa.field("true_label", pa.string()))
    fields += [
        pa.field("error", pa.string()),  # why the file could not be scored, else null
        pa.field("model_version", pa.string()),
        pa.field("model_sha256", pa.string()),
    ]
    return pa.schema(fields)


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
    for name in ("top_labels", "top_probabilities"):
        at = table.schema.get_field_index(name)
        values = [json.dumps(v) for v in table.column(name).to_pylist()]
        table = table.set_column(at, name, pa.array(values, pa.string()))
    return table


def read_tables(path: Path) -> Iterator[pa.Table]:
    """A finished output (or shard output) back as tables, a row group at a time for
    Parquet: merging N shards holds one row group, not N files, in memory."""
    if output_format(path) == "parquet":
        with pq.ParquetFile(path) as pf:
            for i in range(pf.num_row_groups):
                yield pf.read_row_group(i)
    else:
        reader = pa_csv.open_csv(
            path, convert_options=pa_csv.ConvertOptions(strings_can_be_null=True)
        )
        for batch in reader:
            table = pa.Table.from_batches([batch])
            for name, kind in (("top_labels", pa.string()), ("top_probabilities", pa.float32())):
                at = table.schema.get_field_index(name)
                lists = [json.loads(v) if v else None for v in table.column(name).to_pylist()]
                table = table.set_column(at, name, pa.array(lists, pa.list_(kind)))
            yield table
