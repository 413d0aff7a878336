"""Benchmark: the prepare stage on a folder of photos, 1 vs 2 workers, 64 vs 224 px, one run.

    python -m benchmarks.bench_prepare                 # make bench-prepare: 20,000 images
    python -m benchmarks.bench_prepare --images 5000   # smaller folder
    python -m benchmarks.bench_prepare --quick         # 512 images, seconds; what the tests run

The folder (``--work DIR``, default ``<system temp>/trainyard-bench-prepare/<N>``) is made
once and reused while its ``manifest.json`` matches (image count, seed, recipe version):

- ``full/photos/`` holds N RGB JPEG files (Pillow, ``quality=90``) in 10 class folders
  ``0_circle``, ``1_square``, ``2_triangle``, ``3_circle``, ... (the shape cycles over
  circle/square/triangle); image ``i`` goes to class ``i % 10`` as ``img_<i:06d>.jpg``.
- Image ``i`` is drawn from its own generator ``numpy.random.default_rng([seed, i])``:
  width and height each uniform in 128..224 px, then ``draw_shape(kind, (w, h), rng)`` from
  ``examples/make_shapes.py`` (a light shape on a random dark background), then Gaussian
  noise (sigma 12 grey levels, per pixel and channel, clipped to 0..255) so the JPEGs are
  not trivially compressible (about 12 KiB each: 20,000 make 240 MiB). Where
  ``examples/make_shapes.py`` cannot be loaded (an installed package without the
  repository), the base image is a flat per-class colour instead (same noise on top); the
  manifest (``full/manifest.json``) records which recipe drew it.
- Generation runs in a ``multiprocessing`` pool of one process per core, and is timed.
- ``subset/photos/`` holds the first N/4 images (hard links to the same files): the
  largest configuration runs on it too, to show how peak memory depends on N.

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
import importlib.util
import json
import multiprocessing
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import trainyard.data.arrays as arrays_module
from benchmarks.common import update_docs
from trainyard.core.host import cpu_name

DOCS_KEY = "prepare"
RECIPE = 1  # bump when the way images are drawn changes: old folders are then remade
NUM_CLASSES = 10
SHAPES = ("circle", "square", "triangle")
SIZE_RANGE = (128, 224)  # px, both sides, inclusive
JPEG_QUALITY = 90
NOISE_SIGMA = 12.0
FULL_IMAGES = 20_000
QUICK_IMAGES = 512  # the subset (N/4 = 128) still gets the 2 workers prepare asks for
HEAVY = ("torch", "lightning", "mlflow", "dvc", "bentoml")
MAKE_SHAPES = Path(__file__).resolve().parents[1] / "examples" / "make_shapes.py"

# (name, workers, image_size, on the subset): the subset row repeats the largest one.
CONFIGS = (
    ("workers=1, 64 px", 1, 64, False),
    ("workers=2, 64 px", 2, 64, False),
    ("workers=1, 224 px", 1, 224, False),
    ("workers=2, 224 px", 2, 224, False),
    ("workers=2, 224 px, N/4", 2, 224, True),
)


# ----------------------------------------------------------------------------- the folder


def class_names() -> list[str]:
    return [f"{k}_{SHAPES[k % len(SHAPES)]}" for k in range(NUM_CLASSES)]


def image_path(root: Path, i: int) -> Path:
    return root / class_names()[i % NUM_CLASSES] / f"img_{i:06d}.jpg"


_draw: Any = None  # draw_shape from examples/make_shapes.py, loaded once per process


def load_draw_shape() -> Any:
    """``draw_shape`` from the repository's examples/make_shapes.py, or None."""
    global _draw
    if _draw is None:
        _draw = False
        try:
            spec = importlib.util.spec_from_file_location("_trainyard_make_shapes", MAKE_SHAPES)
            if spec is not None and spec.loader is not None and MAKE_SHAPES.is_file():
                mod = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(mod)
                _draw = mod.draw_shape
        except Exception:  # any failure: the noise recipe below draws instead
            _draw = False
    return _draw or None


def _make_image(job: tuple[str, int, int]) -> int:
    """Draw and write image ``i`` (pool task); returns its size in bytes."""
    from PIL import Image

    root, i, seed = job
    rng = np.random.default_rng([seed, i])
    w, h = (int(v) for v in rng.integers(SIZE_RANGE[0], SIZE_RANGE[1] + 1, 2))
    draw = load_draw_shape()
    k = i % NUM_CLASSES
    if draw is not None:
        base = np.asarray(draw(SHAPES[k % len(SHAPES)], (w, h), rng), dtype=np.float32)
    else:
        base = np.empty((h, w, 3), dtype=np.float32)
        base[:] = np.array([(37 * k) % 256, (91 * k) % 256, (151 * k) % 256], np.float32)
    noisy = base + rng.normal(0.0, NOISE_SIGMA, base.shape).astype(np.float32)
    im = Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8), "RGB")
    path = image_path(Path(root), i)
    im.save(path, format="JPEG", quality=JPEG_QUALITY)
    return path.stat().st_size


def _manifest(n: int, seed: int) -> dict[str, Any]:
    return {
        "images": n,
        "seed": seed,
        "recipe": RECIPE,
        "classes": NUM_CLASSES,
        "size_range_px": list(SIZE_RANGE),
        "jpeg_quality": JPEG_QUALITY,
        "noise_sigma": NOISE_SIGMA,
        "drawn_with": "examples/make_shapes.py:draw_shape"
        if load_draw_shape()
        else "uniform noise (examples/make_shapes.py not found)",
    }


def _matches(folder: Path, want: dict[str, Any]) -> dict[str, Any] | None:
    """The folder's manifest when it was made the way ``want`` says and is complete."""
    try:
        have = json.loads((folder / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    same = all(have.get(k) == v for k, v in want.items())
    if same and all(image_path(folder / "photos", i).is_file() for i in range(want["images"])):
        return have
    return None


def ensure_photos(
    folder: Path, n: int, seed: int, log: Any, source: Path | None = None
) -> dict[str, Any]:
    """``folder/photos`` with the N images (made, or reused when the manifest matches).

    With ``source`` (a folder already holding at least these images) the files are hard
    links to its images 0..n-1 (copies where links fail) instead of being drawn again.
    Returns the manifest plus ``generation_s`` (None when reused) and ``reused``.
    """
    want = _manifest(n, seed)
    have = _matches(folder, want)
    if have is not None:
        log(
            f"bench-prepare: reusing {n:,} images in {folder / 'photos'} "
            f"({have.get('how')} in {have.get('generation_s')} s when made)"
        )
        return have | {"reused": True}
    photos = folder / "photos"
    shutil.rmtree(photos, ignore_errors=True)
    (folder / "manifest.json").unlink(missing_ok=True)
    for name in class_names():
        (photos / name).mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if source is not None:
        total = 0
        for i in range(n):
            src, dst = image_path(source / "photos", i), image_path(photos, i)
            try:
                os.link(src, dst)
            except OSError:
                shutil.copyfile(src, dst)
            total += dst.stat().st_size
        how = f"linked from {source / 'photos'}"
        processes = 1
    else:
        processes = os.cpu_count() or 1
        jobs = [(str(photos), i, seed) for i in range(n)]
        # By its importable name: run as __main__ (python -m, runpy), this module's own
        # functions would not pickle by reference.
        from benchmarks.bench_prepare import _make_image as make_image

        with multiprocessing.Pool(processes) as pool:
            total = sum(pool.imap_unordered(make_image, jobs, chunksize=64))
        how = f"drawn by {processes} processes"
    dt = time.perf_counter() - t0
    made = want | {"bytes": total, "how": how, "processes": processes, "generation_s": round(dt, 2)}
    (folder / "manifest.json").write_text(json.dumps(made, indent=2) + "\n")
    log(
        f"bench-prepare: {'generated' if source is None else 'made'} {n:,} JPEGs "
        f"({total / 2**20:,.0f} MiB) in {dt:.1f} s, {how} ({n / dt:,.0f} images/s)"
    )
    return made | {"reused": False}


def warm_cache(photos: Path) -> int:
    """Read every file once so each run finds them all in the page cache alike."""
    total = 0
    for path in sorted(photos.rglob("*")):
        if path.is_file():
            total += len(path.read_bytes())
    return total


# ----------------------------------------------------------------------------- one run


def peak_rss_self() -> int:
    """This process's peak RSS in bytes: ``VmHWM`` where /proc has it, else ``ru_maxrss``.

    Linux keeps ``ru_maxrss`` across ``exec``: a child started from a process holding torch
    (the data-path benchmark) would report its parent's ~800 MiB. ``VmHWM`` belongs to the
    new address space alone."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
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
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "benchmarks.bench_prepare", "--child", json.dumps(spec)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    outer = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(
            f"bench-prepare: prepare failed (workers={workers}, {image_size} px):\n"
            + proc.stderr[-4000:]
        )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process_s"] = outer  # with interpreter start-up and imports
    result["output_bytes"] = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    if not keep:
        shutil.rmtree(out, ignore_errors=True)
    return result


# ----------------------------------------------------------------------------- reporting

STATS_BYTES = getattr(arrays_module, "_STATS_BYTES", 16 << 20)


def table(result: dict[str, Any]) -> str:
    lines = [
        "| configuration | images | wall s | images/s | peak RSS MiB | output MiB |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in result["runs"]:
        lines.append(
            f"| {r['name']} | {r['images']:,} | {r['wall_s']:.1f} | "
            f"{r['images_per_s']:,.0f} | {r['peak_rss_mib']:,.0f} | {r['output_mib']:,.0f} |"
        )
    return "\n".join(lines)


def phases_table(result: dict[str, Any]) -> str:
    lines = [
        "| configuration | pool | header pass s | decode pass s | stats s | hash s | "
        "rest s | RSS main, passes MiB | RSS main MiB | RSS worker MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["runs"]:
        p = r["phases_s"]
        rest = r["wall_s"] - sum(p.values())
        lines.append(
            f"| {r['name']} | {r['pool_workers']} | {p['header_pass_s']:.1f} | "
            f"{p['decode_pass_s']:.1f} | {p['stats_s']:.1f} | {p['hash_s']:.1f} | "
            f"{rest:.1f} | {r['rss_main_passes_mib']:,.0f} | {r['rss_main_mib']:,.0f} | "
            f"{r['rss_worker_mib']:,.0f} |"
        )
    return "\n".join(lines)


def markdown(result: dict[str, Any]) -> str:
    hw, ds = result["hardware"], result["dataset"]
    gen = f"{ds['how']} in {ds['generation_s']:.1f} s" + (
        ", reused from an earlier run" if ds["reused"] else ""
    )
    lines = [
        "## Prepare: image folder -> memory-mapped arrays",
        "",
        f"Measured {result['date']} on {hw['cpu']}, {hw['cores']} cores "
        f"({hw['cores_usable']} usable), Python {hw['python']}, Pillow {hw['pillow']}, "
        f"with `{result['command']}`.",
        "",
        f"The folder: {ds['images']:,} RGB JPEGs ({ds['bytes'] / 2**20:,.0f} MiB, {gen}), "
        f"JPEG quality {ds['jpeg_quality']}, width and height each uniform in "
        f"{ds['size_range_px'][0]}-{ds['size_range_px'][1]} px, in {ds['classes']} class "
        f"folders; image i is drawn with `numpy.random.default_rng([seed={ds['seed']}, i])` "
        f"by {ds['drawn_with']} (shape kind cycling circle/square/triangle over the "
        f"classes) plus Gaussian noise of sigma {ds['noise_sigma']:g} grey levels. "
        f"The N/4 row runs on the first {result['subset']['images']:,} of the same files. "
        "Every file was read once before the runs (page cache warm for all). Each row is "
        "one `prepare` (source `folder`, resize `crop`, val/test fractions 0.1) in a "
        "fresh process; wall time excludes interpreter start-up; images/s = images "
        "prepared / wall time; peak RSS is the largest single process (the stage's own "
        "process or its largest pool worker; `VmHWM` or `ru_maxrss`, which include "
        "resident pages of the memory-mapped output); output = the prepared folder's size.",
        "",
        table(result),
        "",
    ]
    lines += [f"- {k}: **{v:.2f}x**" for k, v in result["ratios"].items()]
    runs = result["runs"]
    passes = [r["rss_main_passes_mib"] for r in runs]
    workers = [r["rss_worker_mib"] for r in runs if r["pool_workers"] > 1]
    lines += [
        "",
        f"While streaming (both passes) the prepare process peaks at {min(passes):,.0f}-"
        f"{max(passes):,.0f} MiB in every row"
        + (f" and each pool worker at {max(workers):,.0f} MiB at most" if workers else "")
        + ", whatever the image count. The statistics pass after it (`channel_stats`) reads "
        f"the train array in {STATS_BYTES / 2**20:,.0f} MiB blocks with plain reads (not a "
        "memory map, whose touched pages would count as resident), so it adds about three "
        "blocks: one read, its uint16 squares.",
    ]
    lines += [
        "",
        "Where the time and memory went (pool: the worker processes prepare started; "
        "header/decode pass: its two passes over the files; stats: the train split's "
        "per-channel mean/std; hash: sha256 of the arrays; RSS main, passes: the prepare "
        "process's peak before the statistics, i.e. while streaming into the memory maps):",
        "",
        phases_table(result),
        "",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_prepare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--images", type=int, help=f"folder size (default {FULL_IMAGES:,})")
    parser.add_argument(
        "--quick", action="store_true", help=f"{QUICK_IMAGES} images (seconds; for tests)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--work", help="folder for the images and the prepared outputs (default: temp dir)"
    )
    parser.add_argument("--out", help="JSON results (default reports/bench-prepare.json)")
    parser.add_argument(
        "--docs",
        help="markdown file whose prepare section is replaced (default docs/benchmarks.md; "
        "not written with --quick unless given); '' to skip",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)  # one prepare run: JSON spec
    return parser


def hardware() -> dict[str, Any]:
    """The CPU, its cores and the library versions the table is measured with."""
    from PIL import __version__ as pillow_version

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "cores_usable": usable,
        "python": platform.python_version(),
        "pillow": pillow_version,
        "numpy": np.__version__,
    }


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


def _publish(result: dict[str, Any], out_path: Path, docs: str, log: Any) -> None:
    """Write the JSON (and the docs section when ``docs``), then print the tables."""
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    log(f"bench-prepare: wrote {out_path}")
    if docs:
        update_docs(Path(docs), DOCS_KEY, markdown(result))
        log(f"bench-prepare: updated {docs}")
    ratios = "".join(f"{k}: {v:.2f}x\n" for k, v in result["ratios"].items())
    print(f"\n{table(result)}\n\n{ratios}\n{phases_table(result)}")


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
    out_path = Path(args.out or f"reports/bench-prepare{'-quick' if args.quick else ''}.json")
    docs = args.docs if args.docs is not None else ("" if args.quick else "docs/benchmarks.md")
    work = Path(args.work or Path(tempfile.gettempdir()) / "trainyard-bench-prepare" / str(n))
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    hw = hardware()
    log(f"bench-prepare: {hw['cpu']}, {hw['cores']} cores; work folder {work}")
    work.mkdir(parents=True, exist_ok=True)
    full = ensure_photos(work / "full", n, args.seed, log)
    n_sub = max(NUM_CLASSES * 4, n // 4)
    subset = ensure_photos(work / "subset", n_sub, args.seed, log, source=work / "full")
    warm_cache(work / "full" / "photos")

    runs = run_configs(work, n, n_sub, args.seed, log)
    command = "python -m benchmarks.bench_prepare " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "command": command.strip(),
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
    _publish(result, out_path, docs, log)
    return result


if __name__ == "__main__":
    main()
