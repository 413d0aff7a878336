"""Generated input folders, made once under the temp dir and reused: a folder's
``manifest.json`` says how it was made (count, seed, recipe version, ...), and it is
reused only while the manifest matches what is asked and every file is there."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from benchmarks.harness.stopwatch import Timer

Log = Callable[[str], None]


def wanted(images: int, seed: int, recipe: int, **how: Any) -> dict[str, Any]:
    """What a folder's manifest must say for it to be reused: its file count, the seed,
    the version of the recipe that draws them, and whatever else shapes them."""
    return {"images": images, "seed": seed, "recipe": recipe, **how}


def manifest_ok(folder: Path, want: dict[str, Any], path_of: Callable[[int], Path]) -> dict | None:
    """The folder's manifest when it was made as ``want`` says and every file is there."""
    try:
        have = json.loads((folder / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    if all(have.get(k) == v for k, v in want.items()) and all(
        path_of(i).is_file() for i in range(want["images"])
    ):
        return have
    return None


def generate(
    folder: Path,
    want: dict[str, Any],
    path_of: Callable[[int], Path],
    task: Callable[[Any], int],
    jobs: Iterable[Any],
    log: Log,
    what: str,
) -> dict[str, Any]:
    """``folder/photos``: ``want["images"]`` files, ``path_of(i)`` each, written by
    ``task(job)`` (a picklable function returning the bytes written) over ``jobs`` in a
    pool of one process per core; the manifest written and returned (``reused`` False),
    or the old one while it matches (True)."""
    have = manifest_ok(folder, want, path_of)
    if have is not None:
        made_s = have.get("generation_s")
        log(f"reusing {want['images']:,} images in {folder} ({what}, made in {made_s} s)")
        return have | {"reused": True}
    shutil.rmtree(folder / "photos", ignore_errors=True)
    (folder / "manifest.json").unlink(missing_ok=True)
    for d in {path_of(i).parent for i in range(want["images"])}:
        d.mkdir(parents=True, exist_ok=True)
    processes = os.cpu_count() or 1
    with Timer() as clock, multiprocessing.Pool(processes) as pool:
        total = sum(pool.imap_unordered(task, jobs, chunksize=64))
    how = f"drawn by {processes} processes"
    made = want | {"bytes": total, "how": how, "processes": processes}
    made["generation_s"] = round(clock.seconds, 2)
    write_manifest(folder, made)
    log(
        f"generated {want['images']:,} {what} ({total / 2**20:,.1f} MiB) in "
        f"{clock.seconds:.1f} s, {how} ({want['images'] / clock.seconds:,.0f} files/s)"
    )
    return made | {"reused": False}


def write_manifest(folder: Path, made: dict[str, Any]) -> None:
    """The folder's manifest: how it was made."""
    (folder / "manifest.json").write_text(json.dumps(made, indent=2) + "\n")


def warm_cache(folder: Path) -> int:
    """Read every file once, so every run finds them all in the page cache alike."""
    total = 0
    for root, _dirs, files in os.walk(folder):
        for name in files:
            with open(os.path.join(root, name), "rb") as fh:
                total += len(fh.read())
    return total
