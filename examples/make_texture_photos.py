"""A photo folder the tests never use, for trying the folder source by hand.

    python examples/make_texture_photos.py "/tmp/userphotos/Holiday Photos" 200

Four classes of RGB textures (stripes, échiquier, dots, rings) with random colours,
periods and angles, 200-900 px per side, saved as JPEG/PNG/WEBP (every fifth JPEG with an
EXIF rotation), OS litter (.DS_Store, Thumbs.db, a dot-folder, notes.txt) and three broken
files (zero bytes, a truncated JPEG, HTML named .png). The README's small-folder figures
come from 200 per class.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
from PIL import Image

CLASSES = ("stripes", "échiquier", "dots", "rings")


def texture(cls: str, h: int, w: int, r: random.Random, rng: np.random.Generator) -> Image.Image:
    """One noisy two-colour texture of class ``cls``, its scale tied to the image size."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    period = r.uniform(18, 40) * max(h, w) / 300
    angle = r.uniform(0, np.pi)
    u = x * np.cos(angle) + y * np.sin(angle)
    v = -x * np.sin(angle) + y * np.cos(angle)
    if cls == "stripes":
        mask = np.sin(u / period * 2 * np.pi) > 0
    elif cls == "échiquier":
        mask = (np.floor(u / period) + np.floor(v / period)) % 2 == 0
    elif cls == "dots":
        du, dv = np.mod(u, period) - period / 2, np.mod(v, period) - period / 2
        mask = du**2 + dv**2 < (period / 4) ** 2
    else:
        cy, cx = r.uniform(0, h), r.uniform(0, w)
        mask = np.sin(np.hypot(x - cx, y - cy) / period * 2 * np.pi) > 0
    a, b = rng.integers(0, 256, 3), rng.integers(0, 256, 3)
    img = np.where(mask[..., None], a, b).astype(np.float32) + rng.normal(0, 12, (h, w, 3))
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), "RGB")


def main(root: Path, per_class: int) -> None:
    rng, r = np.random.default_rng(7), random.Random(7)
    for cls in CLASSES:
        folder = root / cls
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            im = texture(cls, r.randint(200, 900), r.randint(200, 900), r, rng)
            ext = r.choice(["jpg", "JPEG", "png", "webp", "jpg"])
            path = folder / f"IMG_{i:04d}.{ext}"
            if ext.lower() in ("jpg", "jpeg"):
                exif = Image.Exif()
                if i % 5 == 0:
                    exif[0x0112] = 6  # shown rotated by 90 degrees
                im.save(path, "JPEG", quality=88, exif=exif)
            else:
                im.save(path, "PNG" if ext == "png" else "WEBP")
        (folder / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
        (folder / "Thumbs.db").write_bytes(b"\xd0\xcf\x11\xe0")
    (root / "notes.txt").write_text("shot on holiday\n")
    (root / ".thumbnails").mkdir(exist_ok=True)
    (root / ".thumbnails" / "a.jpg").write_bytes(b"x")
    (root / "dots" / "broken_zero.jpg").write_bytes(b"")
    jpeg = next((root / "stripes").glob("*.jpg")).read_bytes()
    (root / "stripes" / "cut_short.jpg").write_bytes(jpeg[: len(jpeg) // 3])
    (root / "rings" / "not_a_photo.png").write_text("<html>404</html>")
    print(f"made {sum(1 for p in root.rglob('*') if p.is_file())} files under {root}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 80)
