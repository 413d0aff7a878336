"""``data.image_size: auto``: the size prepare gives a folder's or a CSV's images, from their
own sizes and from whether the recipe may fine-tune ImageNet weights on them."""

from __future__ import annotations

import logging
import random
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # pydantic stays out of the light paths (benchmarks, gpu-check)
    from trainyard.core.config import DataParams

log = logging.getLogger(__name__)

# data.image_size: auto = the median shorter side of the images, clamped to this range: 8x8
# digit scans train at 32 (the smallest size every architecture takes), photos at 64 (CPU
# training stays fast; set image_size yourself for more detail).
AUTO_SIZE_MIN = 32
AUTO_SIZE_MAX = 64
# When the recipe may fine-tune ImageNet weights (train.pretrained), images of
# PRETRAINED_MIN_SIDE px or more are prepared at PRETRAINED_SIZE: ImageNet features are
# learnt on objects of 50-200 px, and on 64 px emoji upsampled a frozen EfficientNet-Lite0
# scored 0.77 at 128 px, 0.78 at 160 and 0.80 at 224 (docs/own-images.md); 160 is what a
# CPU's 4-minute budget affords. Smaller images (8x8 scans, 28 px Fashion-MNIST) train
# from scratch, where pretrained features measured no better.
PRETRAINED_MIN_SIDE = 32
PRETRAINED_SIZE = 160


def auto_image_size(shorter_sides: Sequence[int], for_pretrained: bool = False) -> tuple[int, str]:
    """``data.image_size: auto``: the images' median shorter side, clamped to
    ``AUTO_SIZE_MIN``..``AUTO_SIZE_MAX``; ``PRETRAINED_SIZE`` when ``for_pretrained`` and
    that median is ``PRETRAINED_MIN_SIDE`` or more. Returns (size, the reason, for the log)."""
    if not shorter_sides:
        return AUTO_SIZE_MAX, "no readable images"
    median = int(statistics.median(shorter_sides))
    if for_pretrained and median >= PRETRAINED_MIN_SIDE:
        return PRETRAINED_SIZE, (
            f"the median shorter side of {len(shorter_sides):,} images is {median} px, and "
            f"train.pretrained may fine-tune ImageNet weights: {PRETRAINED_SIZE} px"
        )
    size = min(AUTO_SIZE_MAX, max(AUTO_SIZE_MIN, median))
    how = "" if size == median else f", clamped to {AUTO_SIZE_MIN}..{AUTO_SIZE_MAX}"
    return size, f"the median shorter side of {len(shorter_sides):,} images is {median} px{how}"


def choose_image_size(
    params: DataParams, shorter_sides: Sequence[int], for_pretrained: bool = False
) -> tuple[int, int]:
    """(height, width) of the prepared images: data.image_size, or chosen (auto) and logged."""
    if params.size_hw is not None:
        return params.size_hw
    size, reason = auto_image_size(shorter_sides, for_pretrained)
    log.info("data.image_size auto: %dx%d (%s); set data.image_size to choose", size, size, reason)
    return size, size


# The background transparent pixels are composited on (and pad borders drawn in). Black,
# unless at least TRANSPARENT_SHARE of the images carry transparency AND their opaque
# pixels hold dark strokes (at least DARK_SHARE of them under DARK_LUMA, in a seeded sample):
# drawings with black outlines and lettering, made for a page, which vanish on black. Then
# white. Measured, the recipe's defaults, seed 42 (docs/benchmarks.md): openclipart (1,491
# of 1,500 transparent, 37% of opaque pixels dark) 0.796 on black -> 0.901 on white; Noto
# emoji (transparent, 6% dark: bright colour on transparency) 0.821 on black -> 0.789 on
# white, so emoji stay on black.
TRANSPARENT_SHARE = 0.5
DARK_SHARE, DARK_LUMA = 0.15, 64
SAMPLE, SAMPLE_MAX_PIXELS = 64, 4_000_000  # images sampled; larger ones are not decoded
WHITE, BLACK = 255, 0


def dark_share(paths: Sequence[str], seed: int = 0) -> float | None:
    """The share of opaque pixels darker than DARK_LUMA over a seeded sample of ``paths``
    (each reduced to 64 px, alpha-weighted); None when none could be read."""
    from PIL import Image

    picked = list(paths)
    random.Random(seed).shuffle(picked)
    dark = opaque = 0.0
    for path in picked[:SAMPLE]:
        try:
            with Image.open(path) as im:
                im = im.convert("RGBA")
                im.thumbnail((64, 64))
                rgba = np.asarray(im, dtype=np.float32)
        except (OSError, ValueError):  # unreadable here: prepare names it in its own pass
            continue
        alpha = rgba[..., 3] / 255.0
        luma = rgba[..., :3] @ np.array([0.299, 0.587, 0.114], dtype=np.float32)
        dark += float(((luma < DARK_LUMA) * alpha).sum())
        opaque += float(alpha.sum())
    return dark / opaque if opaque else None


def background_fill(transparent: int, total: int, sample: Sequence[str], seed: int = 0) -> int:
    """The fill of a folder's images (the card's ``fill``: the service composites uploads
    on it too): ``WHITE`` when ``transparent`` of ``total`` carry transparency and the
    ``sample`` (transparent files small enough to decode) shows dark strokes, else
    ``BLACK``. A white choice is said in the log."""
    if not total or transparent < TRANSPARENT_SHARE * total:
        return BLACK
    share = dark_share(sample, seed)
    if share is None or share < DARK_SHARE:
        return BLACK
    log.info(
        "background: white (%d of %d images carry transparency, and %.0f%% of their opaque "
        "pixels are dark strokes: drawn for a page, on black their outlines would vanish)",
        transparent,
        total,
        100 * share,
    )
    return WHITE
