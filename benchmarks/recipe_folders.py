"""Real image folders for the recipe benchmark, built from images that ship in packages.

None of them is in the tests: they are what a user brings, and the recipe is measured on them.

- ``digits``: scikit-learn's 1,797 handwritten-digit scans (8x8, 16 grey levels, 10 classes),
  written as PNGs in train/val/test folders (60/20/20, seeded); one train image in five is
  saved as HEIC or AVIF, the formats phones save.
- ``clipart``: Debian's openclipart-png, 7 categories of real clip art in nested subfolders
  (RGBA, LA and P modes, some over 100 megapixels), one pool that prepare splits.

``python -m benchmarks.recipe_folders OUT`` writes both under OUT.
"""

from __future__ import annotations

import argparse
import os
import shutil
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


def clipart_folder(out: Path, categories: tuple[str, ...] = CLIPART_CATEGORIES) -> Path:
    """openclipart-png's categories as one class folder each (symlinks: no copy)."""
    if not OPENCLIPART.is_dir():
        raise SystemExit(f"{OPENCLIPART} missing: apt-get install openclipart-png")
    root = out / "clipart"
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    for name in categories:
        os.symlink(OPENCLIPART / name, root / name)
    return root


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(digits_folder(args.out))
    print(clipart_folder(args.out))


if __name__ == "__main__":
    main()
