"""Make examples/shapes/: a small class-per-folder image set (circles, squares, triangles).

It is `data.folder`'s default, so `dvc exp run -S data.source=folder` works out of the box,
and the tests draw their folder datasets with the same function. Mixed sizes (40-160 px),
formats (PNG, JPEG) and positions; a seeded run always writes the same files.

    python examples/make_shapes.py [--out examples/shapes] [--per-class 40] [--seed 0]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

CLASSES = ("circle", "square", "triangle")


def draw_shape(
    kind: str, size: tuple[int, int], rng: np.random.Generator, mode: str = "RGB"
) -> Any:
    """A PIL image of one light shape on a random dark background."""
    from PIL import Image, ImageDraw

    w, h = size
    bg = tuple(int(v) for v in rng.integers(0, 90, 3))
    fg = tuple(int(v) for v in rng.integers(150, 256, 3))
    im = Image.new("RGB", (w, h), bg)
    draw = ImageDraw.Draw(im)
    r = int(min(w, h) * rng.uniform(0.25, 0.4))
    cx = int(w / 2 + rng.uniform(-0.1, 0.1) * w)
    cy = int(h / 2 + rng.uniform(-0.1, 0.1) * h)
    if kind == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fg)
    elif kind == "square":
        draw.rectangle((cx - r, cy - r, cx + r, cy + r), fill=fg)
    else:
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fg)
    return im.convert(mode) if mode != "RGB" else im


def make_shapes(out: Path, per_class: int, seed: int) -> int:
    rng = np.random.default_rng(seed)
    for c, name in enumerate(CLASSES):
        (out / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            size = (int(rng.integers(40, 160)), int(rng.integers(40, 160)))
            im = draw_shape(name, size, rng)
            if (i + c) % 2:
                im.save(out / name / f"{name}_{i:03d}.jpg", format="JPEG", quality=85)
            else:
                im.save(out / name / f"{name}_{i:03d}.png", format="PNG", optimize=True)
    return per_class * len(CLASSES)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "shapes")
    parser.add_argument("--per-class", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args()
    print(f"wrote {make_shapes(a.out, a.per_class, a.seed)} images to {a.out}")
