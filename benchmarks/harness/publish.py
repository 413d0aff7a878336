"""A benchmark's ending: its JSON report, the header every result carries (date, command,
commit), and its own section of docs/benchmarks.md, replaced in place so every other
benchmark's section stays as it is.

Three kinds of section live in that file: blocks between ``<!-- bench:KEY:start -->`` and
``<!-- bench:KEY:end -->`` (``update_docs``), ``## Heading`` sections that end at the next
heading or marked block (``replace_section``: the serving benchmarks'), and the ``###``
subsections of the Serving section that a part run alone replaces (``splice_subsection``,
``publish_part``)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

DOCS_START = "<!-- bench:{key}:start -->"
DOCS_END = "<!-- bench:{key}:end -->"
DOCS = "docs/benchmarks.md"
REPO = Path(__file__).resolve().parents[2]


def git_commit(cwd: Path | None = None) -> str:
    """The short commit of the checkout (``unknown`` outside git)."""
    proc = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=False,
    )
    return proc.stdout.strip() or "unknown"


def command_of(module: str, argv: list[str] | None) -> str:
    """The command as typed: ``python -m MODULE ARGS``."""
    args = argv if argv is not None else sys.argv[1:]
    return f"python -m {module} {' '.join(args)}".strip()


def provenance(module: str, argv: list[str] | None, when: str = "%Y-%m-%d") -> dict[str, str]:
    """Date, the command as typed, and the git commit: the header of every result."""
    return {
        "date": time.strftime(when),
        "command": command_of(module, argv),
        "commit": git_commit(),
    }


def bench_parser(module: str, doc: str, name: str, repo: bool = False) -> argparse.ArgumentParser:
    """The command line every benchmark starts from: its doc as the help, ``--out``
    (reports/NAME.json) and ``--docs`` (its section of docs/benchmarks.md), read by
    ``outputs``; with ``repo``, ``--repo`` (the git repository its clones are made from)."""
    parser = argparse.ArgumentParser(
        prog=f"python -m {module}",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", help=f"JSON results (default reports/{name}.json)")
    parser.add_argument(
        "--docs",
        help=f"markdown file whose section is replaced (default {DOCS}; not written with "
        "--quick unless given); '' to skip",
    )
    if repo:
        parser.add_argument("--repo", default=".", help="the git repository to clone")
    return parser


def outputs(name: str, out: str | None, docs: str | None, quick: bool) -> tuple[Path, str]:
    """Where a run writes: ``out`` or ``reports/NAME[-quick].json``, and ``docs`` or
    docs/benchmarks.md ('' with ``--quick``: a smoke run leaves the docs alone unless asked)."""
    path = Path(out or f"reports/{name}{'-quick' if quick else ''}.json")
    return path, docs if docs is not None else ("" if quick else DOCS)


def write_json(path: str | Path, result: dict[str, Any]) -> Path:
    """``result`` as indented JSON (its folder made)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def update_docs(path: Path, key: str, body: str) -> None:
    """Replace the ``key`` block of docs/benchmarks.md (or append it); the rest untouched."""
    start, end = DOCS_START.format(key=key), DOCS_END.format(key=key)
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    block = f"{start}\n{body}\n{end}"
    if start in text and end in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


def _first_of(text: str, marks: tuple[str, ...], after: int) -> int:
    """Where the first of ``marks`` in ``text`` after ``after`` starts (its end if none)."""
    found = [i for i in (text.find(mark, after) for mark in marks) if i != -1]
    return min(found) if found else len(text)


def replace_section(doc: Path, section: str, heading: str | None = None) -> None:
    """Put ``section`` in place of the existing ``heading`` section (or at the end);
    ``heading`` defaults to the section's first line.
    The section ends at the next "## " heading or marked block (``<!-- bench:...``), so
    other benchmarks' sections and markers are left as they are."""
    heading = heading or section.splitlines()[0]
    text = doc.read_text() if doc.is_file() else "# Benchmarks\n"
    start = text.find(f"\n{heading}\n")
    if start == -1:
        text = text.rstrip("\n") + "\n\n" + section.rstrip("\n") + "\n"
    else:
        end = _first_of(text, ("\n## ", "\n<!-- bench:"), start + len(heading) + 2)
        tail = "\n" + text[end:].lstrip("\n") if end < len(text) else ""
        text = text[: start + 1] + section.rstrip("\n") + "\n" + tail
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)


def publish(
    result: dict[str, Any],
    text: str,
    out: str | Path,
    docs: str,
    key: str,
    log: Callable[[str], None] | None = None,
) -> None:
    """Write ``result`` as JSON to ``out`` and replace section ``key`` of ``docs`` with the
    Markdown ``text`` ('' leaves the docs alone); with ``log`` each write is logged,
    without it ``text`` is printed."""
    write_json(out, result)
    if log:
        log(f"wrote {out}")
    else:
        print(text)
    if docs:
        update_docs(Path(docs), key, text)
        if log:
            log(f"updated {docs}")


def splice_subsection(docs: Path, head: str, lines: list[str], first: bool = False) -> None:
    """``lines`` (a subsection under ``head``) in the docs' Serving section, in place of
    the one there; a new one goes after the section's last subsection, or with ``first``
    before its first."""
    text = docs.read_text()
    block = "\n".join(lines).strip("\n") + "\n"
    start = text.find(f"\n{head}\n")
    serving = text.find("\n## Serving\n")
    if start == -1 and first:
        at = text.find("\n### ", serving + 1)
        text = text[: at + 1] + block + "\n" + text[at + 1 :]
    elif start == -1:
        at = _first_of(text, ("\n## ", "\n<!--"), serving + 1)
        text = text[:at].rstrip("\n") + "\n\n" + block + text[at:]
    else:
        end = _first_of(text, ("\n### ", "\n## ", "\n<!--"), start + 1)
        text = text[: start + 1] + block + text[end:]
    docs.write_text(text)


def load_words(loadavg: float, cores: int) -> str:
    """The load average at the start in words: up to half the cores is quiet (what is left
    of the run's own processes); more is other work competing for them."""
    if loadavg <= cores / 2:
        return "(quiet cores)"
    return "(a shared machine: other work ran meanwhile; read the ratios)"


def publish_part(
    docs: Path, name: str, head: str, lines: list[str], part: dict[str, Any], run: dict[str, Any]
) -> None:
    """A part of the Serving section run alone (``bench-serve --rounds-only``, ...): the
    table printed, reports/NAME.json (the command, the machine, the date and the part),
    and the table in the docs under ``head`` (``splice_subsection``), its first line the
    command, the date, the machine and then ``run["said"]``; ``run``: the command, the
    machine (``load_facts``) and ``first``."""
    from trainyard.core.io import atomic_write_json

    command, machine = run["command"], run["machine"]
    date = time.strftime("%Y-%m-%d %H:%M")
    record = {"command": command, "machine": machine, "date": date, **part}
    atomic_write_json(REPO / f"reports/{name}.json", record)
    where = f"{machine['cpu']}, {machine['cores']} cores, load average {machine['loadavg']:.1f}"
    busy = load_words(machine["loadavg"], machine["cores"])
    said = f"`{command}` on {date}: {where} at the start {busy}. {run['said']}".rstrip()
    splice_subsection(docs, head, [*lines[:3], said, "", *lines[3:]], run.get("first", False))
    print("\n".join(lines))


def subsection(
    result: dict[str, Any],
    key: str,
    head: str,
    columns: str,
    body: Callable[[Any], list[str]],
) -> list[str]:
    """``result[key]`` as a markdown subsection of the serving section: ``head``, a table of
    ``columns`` (the header cells, `` | `` between them) whose rows and the notes under it
    ``body`` writes; nothing where the run has no such part."""
    part = result.get(key)
    if not part:
        return []
    table = [f"| {columns} |", "|" + "---|" * (columns.count(" | ") + 1)]
    return ["", head, "", *table, *body(part)]
