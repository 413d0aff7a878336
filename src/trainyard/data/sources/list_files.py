"""Files that list images, read one way for every reader: the csv source (``data.csv``)
and ``trainyard predict``'s CSV and path-list sources (``trainyard.bulk.listing``).

- a **CSV** (``.tsv``: tab-separated) with a header row: ``read_csv`` -> each row's cells
  of the columns asked for, by what they hold (``image``, ``label``, ``split``);
- a **text file of paths**: ``read_paths`` -> one path or URL a line, blank lines and
  ``#`` comments skipped.

Both are UTF-8 (an Excel BOM dropped). A CSV's problems (a missing column, a row of the
wrong length, an empty cell that must hold something) are collected with their line, so a
reader adds its own and reports them all at once (``raise_problems``), each naming its row
and column.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from trainyard.core.errors import DataError
from trainyard.data.image_files import MAX_LISTED


@dataclass(frozen=True)
class Wanted:
    """A column to read: ``name`` in the header, named by the setting ``param`` (what a
    missing column's error cites), holding ``what`` (the key of its cells in each row)."""

    name: str
    param: str
    what: str
    required: bool = True  # False: read when the header has it; empty cells allowed


@dataclass(frozen=True)
class ListedCsv:
    """A CSV's rows with no problem so far, and the problems of the others."""

    path: Path
    found: frozenset[str]  # the ``what`` of each column the header has
    rows: list[tuple[int, dict[str, str]]]  # (line, what -> the cell, stripped)
    problems: list[tuple[int, str]]  # (line, the problem: "row 3, column 'image': ...")


def read_csv(path: Path, key: str, wanted: Sequence[Wanted]) -> ListedCsv:
    """The ``wanted`` columns of the CSV at ``path``, blank rows left out (the header is
    line 1). ``key`` leads every error (``data.csv``, ``predict source``); a DataError for
    a file that is not a CSV or lacks a required column, the row problems collected."""
    rows: list[tuple[int, dict[str, str]]] = []
    problems: list[tuple[int, str]] = []
    try:
        with open(path, newline="", encoding="utf-8-sig") as fh:  # -sig: Excel's BOM
            reader = csv.reader(fh, delimiter="\t" if path.suffix.lower() == ".tsv" else ",")
            index, width = _header(path, key, next(reader, None), wanted)
            for cells in reader:
                if not any(c.strip() for c in cells):
                    continue  # blank lines
                row = _row(reader.line_num, cells, index, width, wanted, problems)
                if row is not None:
                    rows.append((reader.line_num, row))
    except UnicodeDecodeError as err:
        raise DataError(f"{key}: {path} is not UTF-8 text ({err}); save it as UTF-8") from None
    except csv.Error as err:
        raise DataError(f"{key}: {path} is not a readable CSV ({err})") from None
    return ListedCsv(path, frozenset(index), rows, problems)


def _header(
    path: Path, key: str, header: list[str] | None, wanted: Sequence[Wanted]
) -> tuple[dict[str, int], int]:
    """(what -> the index of its column, the header's width); DataError naming a required
    column that is missing or repeated and the setting that names it."""
    if not header:
        names = ",".join(w.name for w in wanted if w.required)
        raise DataError(f"{key}: {path} is empty; it needs a header row ({names})")
    header = [h.strip() for h in header]
    index = {}
    for w in wanted:
        if w.required and header.count(w.name) > 1:
            raise DataError(f"{key}: {path} has the column {w.name!r} ({w.param}) more than once")
        if w.required and w.name not in header:
            raise DataError(
                f"{key}: {path} has no column {w.name!r} ({w.param}); its columns are "
                f"{', '.join(repr(h) for h in header)}: set {w.param} to the one to read"
            )
        if w.name in header:
            index[w.what] = header.index(w.name)
    return index, len(header)


def _row(
    line: int,
    cells: list[str],
    index: dict[str, int],
    width: int,
    wanted: Sequence[Wanted],
    problems: list[tuple[int, str]],
) -> dict[str, str] | None:
    """One data row's cells by what they hold, or None (its problems go to ``problems``)."""
    if len(cells) != width:
        problem = f"{len(cells)} field(s), the header has {width}"
        problems.append((line, f"row {line}: {problem} (an unquoted comma in a value? quote it)"))
        return None
    row = {what: cells[at].strip() for what, at in index.items()}
    empty = [w for w in wanted if w.required and not row[w.what]]
    problems += [(line, f"row {line}, column {w.name!r}: empty {w.what}") for w in empty]
    return None if empty else row


def raise_problems(key: str, path: Path, problems: list[tuple[int, str]]) -> None:
    """A DataError listing every problem (the first ``MAX_LISTED``) in row order; none:
    nothing."""
    if not problems:
        return
    lines = [text for _, text in sorted(problems, key=lambda p: p[0])]
    more = len(lines) - MAX_LISTED
    raise DataError(
        f"{key}: {len(lines)} problem(s) in {path}:\n  "
        + "\n  ".join(lines[:MAX_LISTED])
        + (f"\n  ... and {more} more" if more > 0 else "")
    )


def read_paths(path: Path, key: str) -> list[str]:
    """The paths or URLs a text file lists, one a line (blank lines and ``#`` comments
    skipped), in order."""
    try:
        with open(path, encoding="utf-8-sig") as fh:
            lines = [line.strip() for line in fh]
    except UnicodeDecodeError as err:
        raise DataError(f"{key}: {path} is not UTF-8 text ({err}); save it as UTF-8") from None
    return [line for line in lines if line and not line.startswith("#")]
