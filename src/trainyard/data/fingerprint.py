"""A cheap fingerprint of a set of input files: what changed since the last run.

One sha256 over the sorted ``(name, size, mtime_ns)`` of each file, from ``os.stat`` only
(no file is opened: a million files cost a million stats). ``name`` is the file's path
relative to a root (or its absolute path outside it), or an http(s) URL, which counts by its
string only. A file that is missing or cannot be stat-ed counts by its name and the error's
kind (``ENOENT``, ``EACCES``...), so it appearing or being fixed changes the fingerprint too.

An edited image (new bytes, new mtime) changes it; so do a renamed, added or removed file.
Touching a file without changing it changes it too (mtime), which errs on the safe side.
It is a cache key for one machine: a git clone gives every file a new mtime.

Used by each data source's ``fingerprint`` (``trainyard.data.sources``: one per source, for
prepare and the ``trainyard tune`` cache) and by anything else that keys work on its input
files (``stat_fingerprint``: a bulk scorer's list of inputs).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

URL_PREFIXES = ("http://", "https://")

# (name, path to stat or None for a URL)
Entry = tuple[str, str | os.PathLike[str] | None]


def is_url(text: str) -> bool:
    """An http(s) URL (any case), counted by its string only."""
    return text[:8].lower().startswith(URL_PREFIXES)


def error_kind(err: OSError) -> str:
    """An OSError's kind, the same on every run: ``ENOENT``, ``EACCES``, ``EISDIR``..."""
    return errno.errorcode.get(err.errno or 0, type(err).__name__)


def stat_triple(name: str, path: str | os.PathLike[str] | None) -> tuple[str, int | str, int]:
    """``(name, size, mtime_ns)`` of ``path`` (following symlinks); a URL (``path`` None) is
    ``(name, "url", 0)``, a file that cannot be stat-ed ``(name, "<error kind>", 0)``."""
    if path is None:
        return (name, "url", 0)
    try:
        st = os.stat(path)
    except OSError as err:
        return (name, error_kind(err), 0)
    return (name, st.st_size, st.st_mtime_ns)


def files_fingerprint(entries: Iterable[Entry]) -> str:
    """sha256 hex over the sorted ``(name, size, mtime_ns)`` of ``entries``, each a ``(name,
    path)`` pair: ``name`` is what identifies the file in the fingerprint (a relative path,
    a URL), ``path`` where to stat it (None: a URL, counted by its name). A name listed
    twice counts once. The order of ``entries`` does not matter."""
    triples = sorted({stat_triple(name, path) for name, path in dict(entries).items()})
    digest = hashlib.sha256()
    for triple in triples:
        # One ASCII JSON array a line: a name with a comma, a quote, a newline or bytes
        # that are not UTF-8 (escaped as surrogates) stays unambiguous.
        digest.update(json.dumps(triple).encode() + b"\n")
    return digest.hexdigest()


def stat_entries(paths: Iterable[str | os.PathLike[str]], root: Path | None = None) -> list[Entry]:
    """The ``(name, path)`` entries of ``paths`` for ``files_fingerprint``: a URL by its
    string; a relative path joined to ``root`` (the working directory without one), named
    relative to ``root`` ('/'-separated, normalised), by its absolute path outside it.
    String operations only (no ``Path`` per file): a million paths stay cheap."""
    base = os.path.abspath(os.path.expanduser(os.fspath(root))) if root is not None else None
    join_to = base or os.getcwd()
    prefix = None if base is None else base.rstrip(os.sep) + os.sep
    entries: list[Entry] = []
    for raw in paths:
        text = os.fspath(raw)
        if is_url(text):
            entries.append((text, None))
            continue
        path = os.path.expanduser(text) if text.startswith("~") else text
        if not os.path.isabs(path):
            path = os.path.join(join_to, path)
        name = os.path.normpath(path)
        if prefix is not None and name.startswith(prefix):
            name = name[len(prefix) :]
        entries.append((name if os.sep == "/" else name.replace(os.sep, "/"), path))
    return entries


def stat_fingerprint(paths: Iterable[str | os.PathLike[str]], root: Path | None = None) -> str:
    """The fingerprint (sha256 hex) of a list of input files, for a caller that has its own
    list (a bulk scorer's folder walk, CSV rows, text file of paths or glob).

    ``paths``: absolute paths, paths relative to ``root``, or http(s) URLs (by their string
    only). Files are named relative to ``root`` in the fingerprint, so the same tree under
    another root fingerprints alike (given the same sizes and mtimes); without a root they
    are named by their absolute paths. Each file is stat-ed, never opened; a missing or
    unreadable one counts by its name and the error's kind. Order and repeats do not matter.
    """
    return files_fingerprint(stat_entries(paths, root))
