"""Real image folders for the recipe benchmark, built from images that ship in packages.

None of them is in the tests: they are what a user brings, and the recipe is measured on them.

- ``digits``: scikit-learn's 1,797 handwritten-digit scans (8x8, 16 grey levels, 10 classes),
  written as PNGs in train/val/test folders (60/20/20, seeded); one train image in five is
  saved as HEIC or AVIF, the formats phones save.
- ``clipart``: Debian's openclipart-png, 7 categories of real clip art in nested subfolders
  (RGBA, LA and P modes, some over 100 megapixels), one pool that the benchmark splits.
- ``clipart-check``: 5 other openclipart-png categories, none of the 7 above (education,
  electronics, office, people, recreation: 1,253 drawings): a check folder, that no rule of
  the recipe was tuned on.
- ``symbols-check``: 4 more openclipart-png categories (computer, shapes, signs_and_symbols,
  special), at most 300 drawings each (1,125 in all): a second check folder.
- ``emoji``: Google's Noto emoji as 64 px RGBA PNGs from the npm package
  ``emoji-datasource-google``, one folder per category of ``emoji-datasource``'s
  ``emoji.json`` (9 once "Component", the bare skin-tone swatches, is dropped; 1,906 images,
  skin-tone variants left out), one pool that the benchmark splits. ``npm pack`` fetches both
  tarballs into a cache folder, as a user would.

- ``twemoji-check``: the same emoji and categories drawn by another hand, Twitter's Twemoji
  (``emoji-datasource-twitter``, 64 px): a check folder for the rules tuned on Google's set.
- ``icons-check``: Debian's ``oxygen-icon-theme`` at 64x64, one class per icon context
  (actions, apps, categories, devices, mimetypes, places, status: 572 icons; symlinked
  aliases and contexts under 30 icons left out): a check folder.
- ``adwaita-check``: GNOME's ``adwaita-icon-theme`` at 64x64, built the same way: its
  monochrome symbolic icons by context (actions, devices, legacy, status: 430 icons), added
  on 2026-12-07 after every rule was set.

``python -m benchmarks.recipe_folders OUT`` writes all eight under OUT.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

import numpy as np

OPENCLIPART = Path("/usr/share/openclipart/png")
CLIPART_CATEGORIES = (
    "animals",
    "buildings",
    "food",
    "geography",
    "plants",
    "tools",
    "transportation",
)
# The check folder's categories: disjoint from the tuning ones (a test says so).
CLIPART_CHECK_CATEGORIES = ("education", "electronics", "office", "people", "recreation")
# A second check folder, symbols rather than things: 2,158, 1,645, 1,113 and 225 drawings,
# sampled to at most 300 a class so that computer does not outweigh special ninefold.
SYMBOLS_CHECK_CATEGORIES = ("computer", "shapes", "signs_and_symbols", "special")
SYMBOLS_PER_CLASS = 300
EMOJI_IMAGES = ("emoji-datasource-google", "16.0.0")  # img/google/64/*.png
EMOJI_NAMES = ("emoji-datasource", "16.0.0")  # emoji.json: image file -> category
TWEMOJI_IMAGES = ("emoji-datasource-twitter", "16.0.0")  # img/twitter/64/*.png
OXYGEN_64 = Path("/usr/share/icons/oxygen/base/64x64")
ADWAITA_64 = Path("/usr/share/icons/Adwaita/64x64")
ICONS_MIN_CLASS = 30  # emblems (3) and emotes (12) are too few to split 60/20/20
EMOJI_DROP = ("Component",)  # five skin-tone and hair swatches, not emoji of their own
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trainyard-bench"


def digits_folder(out: Path, seed: int = 0, phone_every: int = 5) -> Path:
    """scikit-learn's digits as train/val/test class folders of PNG (+ HEIC/AVIF) files."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.clip(np.rint(digits.images * 255.0 / 16.0), 0, 255).astype(np.uint8)
    labels = digits.target
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(labels))
    n = len(order)
    cut1, cut2 = int(0.6 * n), int(0.8 * n)
    splits = {"train": order[:cut1], "val": order[cut1:cut2], "test": order[cut2:]}
    root = out / "digits"
    if root.exists():
        shutil.rmtree(root)
    phone = 0
    for split, idx in splits.items():
        for k, i in enumerate(idx):
            folder = root / split / str(labels[i])
            folder.mkdir(parents=True, exist_ok=True)
            im = Image.fromarray(images[i], mode="L")
            if split == "train" and phone_every and k % phone_every == 0:
                phone += 1
                if phone % 2:
                    _save_heic(im, folder / f"{i:04d}.heic")
                else:
                    im.save(folder / f"{i:04d}.avif", quality=90)
            else:
                im.save(folder / f"{i:04d}.png")
    return root


def _save_heic(im: object, path: Path) -> None:
    import pillow_heif

    pillow_heif.register_heif_opener()
    im.convert("RGB").save(path, format="HEIF", quality=90)  # type: ignore[attr-defined]


def clipart_folder(
    out: Path,
    categories: tuple[str, ...] = CLIPART_CATEGORIES,
    name: str = "clipart",
    per_class: int | None = None,
    seed: int = 0,
) -> Path:
    """openclipart-png's categories as one class folder each (symlinks: no copy); with
    ``per_class``, a seeded sample of at most that many drawings of each."""
    if not OPENCLIPART.is_dir():
        raise SystemExit(f"{OPENCLIPART} missing: apt-get install openclipart-png")
    root = out / name
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    for category in categories:
        if per_class is None:
            os.symlink(OPENCLIPART / category, root / category)
            continue
        files = sorted((OPENCLIPART / category).rglob("*.png"))
        random.Random(seed).shuffle(files)
        (root / category).mkdir()
        for i, f in enumerate(files[:per_class]):  # nested folders may repeat a file name
            os.symlink(f, root / category / f"{i:04d}_{f.name}")
    return root


def unpack_tarball(tgz: Path, dest: Path) -> None:
    """Extract ``tgz`` into ``dest``: plain files and folders only, every one inside ``dest``
    (a tarball from a registry is someone else's file)."""
    inside = dest.resolve()
    with tarfile.open(tgz) as tar:
        members = tar.getmembers()
        for m in members:
            target = (inside / m.name).resolve()
            if not (m.isfile() or m.isdir()) or not target.is_relative_to(inside):
                raise SystemExit(f"{tgz}: refusing to unpack {m.name!r} (a link or a way out)")
        # The "data" filter (3.11.4+) also drops modes and owners from elsewhere.
        extra = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(inside, members=members, **extra)


def npm_package(name: str, version: str, cache: Path = CACHE) -> Path:
    """``name@version`` from the npm registry, unpacked once under ``cache/npm/``: the
    folder that holds its package.json."""
    done = cache / "npm" / f"{name}-{version}"
    if (done / "package" / "package.json").is_file():
        return done / "package"
    npm = shutil.which("npm")
    if npm is None:
        raise SystemExit(
            f"the emoji folder needs npm to fetch {name}@{version} (apt-get install npm), "
            "or leave emoji out: --folders digits,clipart"
        )
    done.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=done.parent, prefix=".part-") as tmp:
        proc = subprocess.run(
            [npm, "pack", "--silent", f"{name}@{version}"],
            cwd=tmp,
            capture_output=True,
            text=True,
        )
        tgz = sorted(Path(tmp).glob("*.tgz"))
        if proc.returncode != 0 or len(tgz) != 1:
            raise SystemExit(f"npm pack {name}@{version} failed in {tmp}:\n{proc.stderr[-2000:]}")
        unpack_tarball(tgz[0], Path(tmp) / "out")
        if done.exists():  # a half-done earlier attempt: never a package.json
            shutil.rmtree(done)
        # The rename is the commit: an interrupted fetch leaves no folder that looks done.
        (Path(tmp) / "out").rename(done)
    return done / "package"


def class_name(category: str) -> str:
    """``"Smileys & Emotion"`` -> ``"smileys-emotion"``: a folder name without spaces."""
    return re.sub(r"[^a-z0-9]+", "-", category.lower()).strip("-")


def emoji_classes(
    emoji_json: Path, images: Path, root: Path, drop: tuple[str, ...] = EMOJI_DROP
) -> Path:
    """``root/<category>/<image>.png`` symlinks to ``images`` for each emoji in
    ``emoji_json`` (a list of ``{"image": ..., "category": ...}``) whose image is there;
    categories in ``drop`` left out."""
    entries = json.loads(emoji_json.read_text())
    if root.exists():
        shutil.rmtree(root)
    kept = 0
    for entry in entries:
        name = entry["image"]
        if Path(name).name != name:  # a registry's file: a name, never a path elsewhere
            raise SystemExit(f"{emoji_json}: image {name!r} is not a file name")
        src = images / name
        if entry["category"] in drop or not src.is_file():
            continue
        folder = root / class_name(entry["category"])
        folder.mkdir(parents=True, exist_ok=True)
        os.symlink(src.resolve(), folder / name)
        kept += 1
    if not kept:
        raise SystemExit(f"{emoji_json}: no emoji whose image is in {images}")
    return root


def clipart_check_folder(out: Path) -> Path:
    """The check folder: openclipart categories the recipe was never tuned on."""
    return clipart_folder(out, CLIPART_CHECK_CATEGORIES, "clipart-check")


def symbols_check_folder(out: Path) -> Path:
    """The second check folder: 4 more openclipart categories (symbols and shapes, not
    things), at most ``SYMBOLS_PER_CLASS`` drawings each."""
    return clipart_folder(out, SYMBOLS_CHECK_CATEGORIES, "symbols-check", SYMBOLS_PER_CLASS)


def emoji_folder(
    out: Path, cache: Path = CACHE, package: tuple[str, str] = EMOJI_IMAGES, name: str = "emoji"
) -> Path:
    """The emoji pool: a vendor's 64 px images (Google's), one class folder per emoji.json
    category."""
    vendor = package[0].rsplit("-", 1)[1]  # emoji-datasource-google -> img/google/64
    images = npm_package(*package, cache=cache) / "img" / vendor / "64"
    names = npm_package(*EMOJI_NAMES, cache=cache) / "emoji.json"
    return emoji_classes(names, images, out / name)


def twemoji_check_folder(out: Path, cache: Path = CACHE) -> Path:
    """The emoji check folder: the same categories in Twitter's Twemoji drawings."""
    return emoji_folder(out, cache, TWEMOJI_IMAGES, "twemoji-check")


def icons_check_folder(
    out: Path, source: Path = OXYGEN_64, name: str = "icons-check", package: str = "oxygen"
) -> Path:
    """An icon theme's 64 px icons (Oxygen's), one class folder per context
    (``source/<context>/*.png``): regular files only (a theme's symlinks are the same icon
    under another name), each image once, contexts of fewer than ``ICONS_MIN_CLASS`` icons
    left out."""
    if not source.is_dir():
        raise SystemExit(f"{source} missing: apt-get install {package}-icon-theme")
    root = out / name
    if root.exists():
        shutil.rmtree(root)
    seen: set[bytes] = set()
    for context in sorted(p for p in source.iterdir() if p.is_dir()):
        icons = []
        for f in sorted(context.glob("*.png")):
            if f.is_symlink():
                continue
            digest = hashlib.sha256(f.read_bytes()).digest()
            if digest not in seen:
                seen.add(digest)
                icons.append(f)
        if len(icons) < ICONS_MIN_CLASS:
            continue
        (root / context.name).mkdir(parents=True)
        for f in icons:
            os.symlink(f, root / context.name / f.name)
    return root


def adwaita_check_folder(out: Path, source: Path = ADWAITA_64) -> Path:
    """GNOME's Adwaita icons as ``icons_check_folder`` builds Oxygen's: monochrome symbolic
    icons, a check folder added after every rule was set."""
    return icons_check_folder(out, source, "adwaita-check", "adwaita")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(digits_folder(args.out))
    print(clipart_folder(args.out))
    print(clipart_check_folder(args.out))
    print(symbols_check_folder(args.out))
    print(emoji_folder(args.out))
    print(twemoji_check_folder(args.out))
    print(icons_check_folder(args.out))
    print(adwaita_check_folder(args.out))


if __name__ == "__main__":
    main()
