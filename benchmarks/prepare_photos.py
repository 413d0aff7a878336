"""`make bench-prepare`'s folder of photos (and the data-path benchmark's): N RGB JPEGs in
10 class folders, made once under the temp dir and reused while its manifest matches.

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
- ``subset/photos/`` holds the first N/4 images (hard links to the same files).

Imports numpy and Pillow only.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness.made_once import Log, generate, manifest_ok, wanted, write_manifest
from benchmarks.harness.stopwatch import Timer

RECIPE = 1  # bump when the way images are drawn changes: old folders are then remade
NUM_CLASSES = 10
SHAPES = ("circle", "square", "triangle")
SIZE_RANGE = (128, 224)  # px, both sides, inclusive
JPEG_QUALITY = 90
NOISE_SIGMA = 12.0
MAKE_SHAPES = Path(__file__).resolve().parents[1] / "examples" / "make_shapes.py"


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
    """How the folder is drawn: what its manifest must say to be reused."""
    drawn_with = (
        "examples/make_shapes.py:draw_shape"
        if load_draw_shape()
        else "uniform noise (examples/make_shapes.py not found)"
    )
    return wanted(
        n,
        seed,
        RECIPE,
        classes=NUM_CLASSES,
        size_range_px=list(SIZE_RANGE),
        jpeg_quality=JPEG_QUALITY,
        noise_sigma=NOISE_SIGMA,
        drawn_with=drawn_with,
    )


def ensure_photos(
    folder: Path, n: int, seed: int, log: Log, source: Path | None = None
) -> dict[str, Any]:
    """``folder/photos`` with the N images (made, or reused when the manifest matches).

    With ``source`` (a folder already holding at least these images) the files are hard
    links to its images 0..n-1 (copies where links fail) instead of being drawn again.
    Returns the manifest plus ``generation_s`` and ``reused``.
    """
    want = _manifest(n, seed)
    photos = folder / "photos"
    say = lambda msg: log(f"bench-prepare: {msg}")  # noqa: E731
    if source is None:
        # By its importable name: run as __main__ (python -m, runpy), a module's own
        # functions would not pickle by reference.
        from benchmarks.prepare_photos import _make_image as make_image

        jobs = ((str(photos), i, seed) for i in range(n))
        return generate(
            folder, want, lambda i: image_path(photos, i), make_image, jobs, say, "JPEGs"
        )
    have = manifest_ok(folder, want, lambda i: image_path(photos, i))
    if have is not None:
        say(f"reusing {n:,} images in {photos} ({have.get('how')})")
        return have | {"reused": True}
    return link_subset(folder, want, source, say)


def link_subset(folder: Path, want: dict[str, Any], source: Path, log: Log) -> dict[str, Any]:
    """``folder/photos``: hard links to ``source``'s first ``want["images"]`` images
    (copies where links fail); its manifest written and returned."""
    photos = folder / "photos"
    shutil.rmtree(photos, ignore_errors=True)
    for name in class_names():
        (photos / name).mkdir(parents=True, exist_ok=True)
    total = 0
    with Timer() as clock:
        for i in range(want["images"]):
            src, dst = image_path(source / "photos", i), image_path(photos, i)
            try:
                os.link(src, dst)
            except OSError:
                shutil.copyfile(src, dst)
            total += dst.stat().st_size
    how = f"linked from {source / 'photos'}"
    made = want | {"bytes": total, "how": how, "processes": 1}
    made["generation_s"] = round(clock.seconds, 2)
    write_manifest(folder, made)
    log(f"made {want['images']:,} JPEGs ({total / 2**20:,.0f} MiB) in {clock.seconds:.1f} s, {how}")
    return made | {"reused": False}
