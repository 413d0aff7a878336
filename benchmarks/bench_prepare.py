"""Benchmark: the prepare stage on a folder of photos, 1 vs 2 workers, 64 vs 224 px, one run.

    python -m benchmarks.bench_prepare                 # make bench-prepare: 20,000 images
    python -m benchmarks.bench_prepare --images 5000   # smaller folder
    python -m benchmarks.bench_prepare --quick         # 512 images, seconds; what the tests run

The folder (``--work DIR``, default ``<system temp>/trainyard-bench-prepare/<N>``) is made
once and reused while its ``manifest.json`` matches (image count, seed, recipe version):
``benchmarks.prepare_photos`` says how it is drawn. ``subset/photos/`` holds its first N/4
images: the largest configuration runs on it too, to show how peak memory depends on N.

Every file is read once before the runs (page cache warm for all of them alike). Each
configuration then runs ``trainyard.data.sources.prepare_source`` (source ``folder``, the default
``crop`` resize, val/test fractions 0.1) in a fresh Python process, which reports its wall
time, where the time went (header pass, decode pass, statistics, hash) and its peak RSS:
its own high-water mark (``VmHWM``; ``ru_maxrss`` where /proc lacks it) and ``ru_maxrss``
of its finished pool workers (RUSAGE_CHILDREN, the largest one of them). The table shows the
larger of the two: the largest single process, not a sum. Both count resident pages of
memory-mapped files as well as allocated memory.

Imports only numpy, Pillow and trainyard's data modules (pydantic in the child process):
never torch, lightning, mlflow, dvc or bentoml.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness.host_facts import cpu_facts
from benchmarks.harness.made_once import warm_cache
from benchmarks.harness.procs import python_child
from benchmarks.harness.publish import bench_parser, command_of, outputs, publish
from benchmarks.prepare_photos import NUM_CLASSES, ensure_photos
from benchmarks.prepare_report import markdown, print_summary
from trainyard.core.host import proc_bytes

MODULE = "benchmarks.bench_prepare"
DOCS_KEY = "prepare"
FULL_IMAGES = 20_000
QUICK_IMAGES = 512  # the subset (N/4 = 128) still gets the 2 workers prepare asks for
HEAVY = ("torch", "lightning", "mlflow", "dvc", "bentoml")

# (name, workers, image_size, on the subset): the subset row repeats the largest one.
CONFIGS = (
    ("workers=1, 64 px", 1, 64, False),
    ("workers=2, 64 px", 2, 64, False),
    ("workers=1, 224 px", 1, 224, False),
    ("workers=2, 224 px", 2, 224, False),
    ("workers=2, 224 px, N/4", 2, 224, True),
)


# ----------------------------------------------------------------------------- one run


def peak_rss_self() -> int:
    """This process's peak RSS in bytes: ``VmHWM`` where /proc has it, else ``ru_maxrss``.

    Linux keeps ``ru_maxrss`` across ``exec``: a child started from a process holding torch
    (the data-path benchmark) would report its parent's ~800 MiB. ``VmHWM`` belongs to the
    new address space alone."""
    if (hwm := proc_bytes("/proc/self/status", "VmHWM")) is not None:
        return hwm
    scale = 1 if sys.platform == "darwin" else 1024  # KiB on Linux, bytes on macOS
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _time_phases(
    phases: dict[str, float], calls: dict[str, int], pool_workers: list[int], before: list[int]
) -> None:
    """Timers around prepare's phases, patched where prepare looks them up: the two passes'
    pool maps (``image_files.FilePool``), the statistics (``store.channel_stats``, the name
    ``PreparedWriter.finish`` calls) and the hash (``PreparedWriter.digest``)."""
    # Imported here, in the child: the parent process stays free of pydantic.
    from trainyard.data import image_files as src
    from trainyard.data import prepared_writer as store

    def timed(fn: Any, key: str) -> Any:
        def wrapper(*a: Any, **kw: Any) -> Any:
            calls[key] += 1
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                phases[key] += time.perf_counter() - t

        return wrapper

    pool_init, pool_map = src.FilePool.__init__, src.FilePool.map

    def init(self: Any, workers: int) -> None:
        pool_workers.append(workers)
        pool_init(self, workers)

    def map_(self: Any, fn: Any, args: list[Any], *rest: Any) -> list[Any]:
        key = "header_pass_s" if fn is src.inspect_files else "decode_pass_s"
        return timed(pool_map, key)(self, fn, args, *rest)

    src.FilePool.__init__ = init  # type: ignore[method-assign]
    src.FilePool.map = map_  # type: ignore[method-assign]
    stats = timed(store.channel_stats, "stats_s")

    def channel_stats(images: Any) -> Any:
        # The high-water mark only grows: read here, it is the peak of both passes (the streaming).
        before.append(peak_rss_self())
        return stats(images)

    store.channel_stats = channel_stats
    store.PreparedWriter.digest = timed(store.PreparedWriter.digest, "hash_s")  # type: ignore[method-assign]


def child_run(spec: dict[str, Any]) -> dict[str, Any]:
    """One prepare run, in the fresh process that ``run_prepare`` starts: its numbers."""
    from trainyard.core.config import DataParams
    from trainyard.data.sources import prepare_source

    phases = {"header_pass_s": 0.0, "decode_pass_s": 0.0, "stats_s": 0.0, "hash_s": 0.0}
    calls = dict.fromkeys(phases, 0)
    pool_workers: list[int] = []
    before_stats: list[int] = []
    _time_phases(phases, calls, pool_workers, before_stats)
    params = DataParams(
        source="folder",
        folder=spec["folder"],
        image_size=spec["image_size"],
        workers=spec["workers"],
    )
    t0 = time.perf_counter()
    card = prepare_source("unused", spec["out"], params, seed=spec["seed"])
    wall = time.perf_counter() - t0
    untimed = [k for k, n in calls.items() if n == 0]
    if untimed:  # a renamed function would otherwise read as a phase taking 0 s
        raise SystemExit(f"bench-prepare: the timers never ran for {untimed}: update _time_phases")
    # Linux reports ru_maxrss in KiB; RUSAGE_CHILDREN: the largest finished pool worker.
    scale = 1 if sys.platform == "darwin" else 1024
    return {
        "wall_s": wall,
        "images": int(sum(c["total"] for c in card.counts.values())),
        "pool_workers": pool_workers[0] if pool_workers else None,
        "phases_s": {k: round(v, 3) for k, v in phases.items()},
        "rss_self_bytes": peak_rss_self(),
        "rss_children_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * scale,
        "rss_before_stats_bytes": before_stats[0] if before_stats else None,
        "heavy_imports": sorted(m for m in HEAVY if m in sys.modules),
    }


def run_prepare(
    folder: Path, out: Path, workers: int, image_size: int, seed: int, keep: bool = False
) -> dict[str, Any]:
    """prepare in a fresh process (its rusage is this run's alone); returns its numbers.
    ``keep``: leave the prepared folder in ``out`` (the data-path benchmark trains on it)."""
    shutil.rmtree(out, ignore_errors=True)
    spec = {
        "folder": str(folder),
        "out": str(out),
        "workers": workers,
        "image_size": image_size,
        "seed": seed,
    }
    what = f"bench-prepare: prepare (workers={workers}, {image_size} px)"
    outer, result = python_child(MODULE, "--child", json.dumps(spec), what=what)
    result["process_s"] = outer  # with interpreter start-up and imports
    result["output_bytes"] = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    if not keep:
        shutil.rmtree(out, ignore_errors=True)
    return result


# ----------------------------------------------------------------------------- main


def _parser() -> argparse.ArgumentParser:
    parser = bench_parser(MODULE, __doc__ or "", "bench-prepare")
    parser.add_argument("--images", type=int, help=f"folder size (default {FULL_IMAGES:,})")
    parser.add_argument(
        "--quick", action="store_true", help=f"{QUICK_IMAGES} images (seconds; for tests)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--work", help="folder for the images and the prepared outputs (default: temp dir)"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)  # one prepare run: JSON spec
    return parser


def hardware() -> dict[str, Any]:
    """The CPU, its cores and the library versions the table is measured with."""
    from PIL import __version__ as pillow_version

    return cpu_facts() | {"pillow": pillow_version, "numpy": np.__version__}


def run_configs(work: Path, n: int, n_sub: int, seed: int, log: Any) -> list[dict[str, Any]]:
    """Every row of ``CONFIGS``, each one prepare in a fresh process, checked and logged."""
    runs = []
    for name, workers, size, on_subset in CONFIGS:
        folder = work / ("subset" if on_subset else "full")
        log(f"bench-prepare: {name} ...")
        r = run_prepare(folder / "photos", work / "prepared", workers, size, seed)
        if r["heavy_imports"]:
            raise SystemExit(f"bench-prepare: prepare imported {r['heavy_imports']}")
        expected = n_sub if on_subset else n
        if r["images"] != expected:
            raise SystemExit(f"bench-prepare: prepared {r['images']} of {expected} images")
        row = {
            "name": name,
            "workers": workers,
            "image_size": size,
            "subset": on_subset,
            **r,
            "images_per_s": r["images"] / r["wall_s"],
            "rss_main_mib": r["rss_self_bytes"] / 2**20,
            "rss_worker_mib": r["rss_children_bytes"] / 2**20,
            "rss_main_passes_mib": r["rss_before_stats_bytes"] / 2**20,
            "peak_rss_mib": max(r["rss_self_bytes"], r["rss_children_bytes"]) / 2**20,
            "output_mib": r["output_bytes"] / 2**20,
        }
        runs.append(row)
        log(
            f"bench-prepare: {name:24s} {row['images']:>7,} images {row['wall_s']:7.1f} s "
            f"{row['images_per_s']:>8,.0f} images/s  peak RSS {row['peak_rss_mib']:>7,.0f} MiB  "
            f"output {row['output_mib']:>7,.0f} MiB"
        )
    return runs


def ratios_of(runs: list[dict[str, Any]], n: int, n_sub: int) -> dict[str, float]:
    """2 workers against 1 (images/s, per size), and peak RSS at N against N/4."""
    by = {(r["workers"], r["image_size"], r["subset"]): r for r in runs}
    ratios: dict[str, float] = {}
    for size in (64, 224):
        one, two = by.get((1, size, False)), by.get((2, size, False))
        if one and two:
            ratios[f"workers=2 / workers=1 images/s, {size} px"] = (
                two["images_per_s"] / one["images_per_s"]
            )
    big, small = by.get((2, 224, False)), by.get((2, 224, True))
    if big and small:
        ratios[f"peak RSS, {n:,} / {n_sub:,} images (workers=2, 224 px)"] = (
            big["peak_rss_mib"] / small["peak_rss_mib"]
        )
    return ratios


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """``python -m benchmarks.bench_prepare``: make (or reuse) the folder, run every
    configuration, write the results; returns them."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.child:
        report = child_run(json.loads(args.child))
        print(json.dumps(report), flush=True)
        return report

    n = args.images or (QUICK_IMAGES if args.quick else FULL_IMAGES)
    if n < 40:
        parser.error("--images must be at least 40 (4 per class, N/4 >= 1 per split)")
    out_path, docs = outputs("bench-prepare", args.out, args.docs, args.quick)
    work = Path(args.work or Path(tempfile.gettempdir()) / "trainyard-bench-prepare" / str(n))
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    hw = hardware()
    log(f"bench-prepare: {hw['cpu']}, {hw['cores']} cores; work folder {work}")
    work.mkdir(parents=True, exist_ok=True)
    full = ensure_photos(work / "full", n, args.seed, log)
    n_sub = max(NUM_CLASSES * 4, n // 4)
    subset = ensure_photos(work / "subset", n_sub, args.seed, log, source=work / "full")
    warm_cache(work / "full" / "photos")  # the page cache warm for every run alike

    runs = run_configs(work, n, n_sub, args.seed, log)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "command": command_of(MODULE, argv),
        "hardware": hw,
        "work": str(work),
        "dataset": dict(full),
        "subset": {"images": n_sub, "how": subset.get("how", "reused")},
        "runs": runs,
        "ratios": ratios_of(runs, n, n_sub),
        "peak_rss_note": "largest single process: max(VmHWM of the prepare process, "
        "largest ru_maxrss among its finished pool workers); includes resident pages of "
        "memory-mapped files",
    }
    publish(
        result, markdown(result), out_path, docs, DOCS_KEY, lambda m: log(f"bench-prepare: {m}")
    )
    print_summary(result)
    return result


if __name__ == "__main__":
    main()
