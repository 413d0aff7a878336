"""Do the model's heatmaps mean something? The deletion test (Petsiuk et al., "RISE",
BMVC 2018), on the exported model's own ``cam`` output, with ONNX Runtime only.

For each image of a seeded sample of the test split, delete the ``DELETE_SHARE`` of its
pixels that the predicted class's map ranks highest, then (separately) as many pixels that
a random map ranks highest (the mean over ``RANDOM_MAPS`` random maps), and measure how
much the predicted class's (calibrated) probability drops each time. A map that points at
what the model uses makes the first drop much larger than the second: the test passes when
it is at least ``PASS_RATIO`` times the random one (and positive).

What "delete" means, the same for both arms, and why (figures: docs/pipeline.md):

- *Fill: the image blurred* (Gaussian, sigma ``BLUR_SHARE`` of the longer side: 2 px on
  Fashion-MNIST's 28), the canvas RISE starts its insertion curve from for "no
  information" (its deletion curve fills with zeros, a constant). Deleting
  must remove what the pixels say without saying something new. A constant fill (the
  dataset's mean, or the background colour) draws a hole with a sharp edge whose shape the
  model reads by itself (the leak ROAD, Rong et al. 2022, measures): on Fashion-MNIST even
  the best ranking a 7x7 map can give (each cell's own occlusion drop) deletes only 1.8x
  (background) or 2.6x (mean) what random cells delete, since any hole hurts, against 9.7x
  with the blur. A fill under which no map can beat chance measures the fill, not the map.
- *Granularity: the map's.* A map of h x w cells cannot rank the pixels inside a cell, so
  the random arm ranks by a random map of the same h x w, upsampled the same way
  (``runtime.explain.upsample``, bilinear): both arms delete blobs of the same kind, and the
  only difference is whether the ranking knows the image. Scattered single pixels (the
  first version's random arm) are a noise pattern a CNN reacts to strongly on its own
  (Fashion-MNIST: 0.59 of the top class's probability at the mean, more than any map's
  region), which measured the pattern.

The pixels are ranked by the unrectified upsampled map (the same order as the heatmap's
where it is positive, and no ties where it is not); ties are broken at random. Each
image's random draws (its random maps, its tie-breaks) come from a generator seeded by
``DELETION_SEED`` and the image's row, so the figures do not depend on the batch size.

How good could a map be? The *occlusion ceiling*: on up to ``CEILING_SAMPLE`` of the
images (the first of the seeded draw; fewer at a fine grid, ``CEILING_RUNS``), blur each
cell of the map's grid alone and rank the cells by what that costs the class
(``cell_drops``), then delete by that ranking exactly as by the map's (same upsampling,
share, fill and tie-breaks; the same random arm). A map cannot rank inside a cell, so this
is about the best a map of that grid does (an estimate, not a bound: cells interact); below
``PASS_RATIO`` no map of that grid passes on this data, and ``ceiling_verdict`` says which
of the two a failing map is.

Also the heatmaps of the report's worst mistakes (``mistake_heatmaps``), from one run.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from PIL import Image, ImageFilter

from trainyard.core.card import Card, normalize_pixels
from trainyard.evaluation.pictures import worst_mistakes
from trainyard.runtime.explain import explain_kind, heatmap, upsample
from trainyard.runtime.inputs import softmax
from trainyard.runtime.sessions import OnnxModel

DELETION_SAMPLE = 500  # test images (seeded): ~3 model runs each, seconds on 2 cores
# Of those, the images (seeded) that also get the occlusion ceiling: h' x w' + 1 more runs
# each, so at most CEILING_SAMPLE and at most CEILING_RUNS runs in all (about the test's own
# 7 x 500): 123 images at a 5x5 map, 64 at 7x7. 128 for Lite0's 7x7 at 224 px added 160 s
# to evaluate on a busy 2-core machine (docs/pipeline.md).
CEILING_SAMPLE = 128
CEILING_RUNS = 3200
DELETION_SEED = 0
DELETE_SHARE = 0.2
PASS_RATIO = 2.0
BLUR_SHARE = 1 / 14  # the fill's Gaussian sigma, of the image's longer side (2 px at 28)
# The random arm estimates the drop an uninformed ranking causes; one random map per image
# adds a draw's luck the map's arm does not have (on a folder of ~120 test images the ratio
# moved 1.9x-3.2x from seed to seed), so each image's random drop is the mean of a few maps.
RANDOM_MAPS = 5


def has_maps(model: OnnxModel) -> bool:
    """Whether the model has a ``cam`` output (and says how it is made)."""
    return model.has_cam and explain_kind(model.metadata) is not None


def blurred(images: np.ndarray, card: Card) -> np.ndarray:
    """uint8 images [B, C, H, W] blurred (the deleted pixels' fill) and normalised."""
    sigma = BLUR_SHARE * max(images.shape[2:])
    out = np.empty(images.shape, dtype=np.uint8)
    for i, im in enumerate(images):
        hwc = im[0] if im.shape[0] == 1 else im.transpose(1, 2, 0)  # mode L or RGB
        soft = np.asarray(
            Image.fromarray(np.ascontiguousarray(hwc)).filter(ImageFilter.GaussianBlur(sigma))
        )
        out[i] = soft[None] if soft.ndim == 2 else soft.transpose(2, 0, 1)
    return normalize_pixels(out, card.mean, card.std)


def _delete(
    x: np.ndarray, fill: np.ndarray, scores: np.ndarray, ties: np.ndarray, count: int
) -> np.ndarray:
    """``x`` [B, C, H, W] with the ``count`` highest-scoring pixels of each image (scores
    [B, H*W]; ties broken by ``ties``, random, not towards the top-left) taken from ``fill``."""
    top = np.lexsort((ties, -scores), axis=-1)[:, :count]
    mask = np.zeros(scores.shape, dtype=bool)
    np.put_along_axis(mask, top, True, axis=1)
    return np.where(mask.reshape(x.shape[0], 1, *x.shape[2:]), fill, x)


def _cell_of_pixel(size: tuple[int, int], grid: tuple[int, int]) -> np.ndarray:
    """int [H, W]: the map cell (row-major index into the ``grid`` h' x w') each pixel of an
    image of ``size`` lies in, as nearest upsampling places it: each cell one block."""
    (height, width), (gh, gw) = size, grid
    rows = np.minimum(((np.arange(height) + 0.5) * gh / height).astype(np.intp), gh - 1)
    cols = np.minimum(((np.arange(width) + 0.5) * gw / width).astype(np.intp), gw - 1)
    return rows[:, None] * gw + cols[None, :]


def cell_drops(
    model: OnnxModel,
    x: np.ndarray,
    fill: np.ndarray,
    top: np.ndarray,
    before: np.ndarray,
    grid: tuple[int, int],
) -> np.ndarray:
    """float32 [B, h', w']: how far the class ``top`` falls from ``before`` with one cell of
    the map's ``grid`` alone taken from ``fill`` (the deletion's fill), for each cell: one
    model run of the batch ``x`` per cell. Ranked, about the best map a grid this coarse
    can be (the occlusion ceiling's ranking)."""
    owner = _cell_of_pixel(x.shape[2:], grid)
    rows = np.arange(x.shape[0])
    drops = np.empty((x.shape[0], grid[0] * grid[1]), dtype=np.float32)
    for cell in range(drops.shape[1]):
        occluded = np.where(owner == cell, fill, x)
        drops[:, cell] = before - softmax(model.run(occluded))[rows, top]
    return drops.reshape(x.shape[0], *grid)


def _batch_drops(
    model: OnnxModel,
    images: np.ndarray,
    card: Card,
    rngs: list[np.random.Generator],
    ceiling: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[int, int]]:
    """(drop of the predicted class's probability with its map's top pixels deleted, with
    a random map's top pixels deleted, with the top pixels of the occlusion ranking deleted
    (NaN outside ``ceiling``, a bool per image), the map's h' x w') for each of the uint8
    ``images``, each image's random draws from its own generator of ``rngs``."""
    x = normalize_pixels(images, card.mean, card.std)
    fill = blurred(images, card)
    b, _, h, w = x.shape
    logits, _, cam = model.run_with_cam(x)
    top = logits.argmax(axis=1)
    rows = np.arange(b)
    before = softmax(logits)[rows, top]
    count = max(1, math.floor(DELETE_SHARE * h * w))

    def draw(shape: tuple[int, ...]) -> np.ndarray:
        return np.stack([g.random(shape, dtype=np.float32) for g in rngs])

    def drop(maps: np.ndarray, ties: np.ndarray, which: np.ndarray = rows) -> np.ndarray:
        scores = np.stack([upsample(m, (h, w)).ravel() for m in maps])
        deleted = _delete(x[which], fill[which], scores, ties, count)
        return before[which] - softmax(model.run(deleted))[np.arange(len(which)), top[which]]

    grid = cam.shape[2:]  # the map's h' x w'
    noise = [drop(draw(grid), draw((h * w,))) for _ in range(RANDOM_MAPS)]
    ties = draw((h * w,))
    mine = drop(cam[rows, top], ties)
    # The ceiling's deletion is the map's with the ranking swapped: same fill, same count,
    # the same tie-breaks (no new draws, so the map's and the random arm's stay as they were).
    best = np.full(b, np.nan, dtype=np.float32)
    if ceiling.any():
        pick = np.flatnonzero(ceiling)
        oracle = cell_drops(model, x[pick], fill[pick], top[pick], before[pick], grid)
        best[pick] = drop(oracle, ties[pick], pick)
    return mine, np.mean(noise, axis=0), best, grid


def _ratio(top: float, random: float) -> float | None:
    return round(top / random, 4) if random > 0 else None


def _ceiling(
    top: np.ndarray, rand: np.ndarray, best: np.ndarray, grid: tuple[int, int]
) -> dict[str, Any]:
    """The occlusion ceiling from the per-image drops (``best``: NaN off its sample): its
    drop and ratio, and the map's ratio on the same images (the like-for-like comparison)."""
    sampled = ~np.isnan(best)
    rand_here = float(rand[sampled].mean())
    drop_best = float(best[sampled].mean())
    return {
        "samples": int(sampled.sum()),
        "grid": f"{grid[0]}x{grid[1]}",
        "drop_top": round(drop_best, 6),
        "ratio": _ratio(drop_best, rand_here),
        "map_ratio": _ratio(float(top[sampled].mean()), rand_here),
    }


def deletion_test(
    model: OnnxModel,
    images: np.ndarray,
    card: Card,
    batch_size: int,
    sample: int = DELETION_SAMPLE,
    ceiling_sample: int = CEILING_SAMPLE,
) -> dict[str, Any]:
    """The deletion test on ``sample`` test images drawn with ``DELETION_SEED`` (all, if
    fewer): the mean drops, their ratio (None when the random drop is not positive),
    ``passed``, and the occlusion ceiling (``ceiling``) on up to ``ceiling_sample`` of them
    (fewer at a fine map: ``CEILING_RUNS``)."""
    n = images.shape[0]
    rng = np.random.default_rng(DELETION_SEED)
    chosen = rng.choice(n, size=min(sample, n), replace=False)
    rows = np.sort(chosen)
    one = normalize_pixels(np.asarray(images[rows[:1]]), card.mean, card.std)
    cells = math.prod(model.run_with_cam(one)[2].shape[2:])  # the map's h' x w', one run
    ceiling_sample = max(1, min(ceiling_sample, CEILING_RUNS // (cells + 1)))
    # The draw's order is random: its first images are a seeded sample of the sample.
    in_ceiling = np.isin(rows, chosen[:ceiling_sample])
    top, rand, best = [], [], []
    for start in range(0, len(rows), batch_size):
        part = rows[start : start + batch_size]
        # One generator per image, seeded by its row: its random maps and tie-breaks are the
        # same whatever the batch size (drawn from one stream, evaluate.batch_size decided
        # which image got which map, and on a 75-image folder moved the ratio 1.95x-2.08x).
        rngs = [np.random.default_rng((DELETION_SEED, int(row))) for row in part]
        sampled = in_ceiling[start : start + len(part)]
        t, r, c, grid = _batch_drops(model, np.asarray(images[part]), card, rngs, sampled)
        top.append(t)
        rand.append(r)
        best.append(c)
    t, r = np.concatenate(top), np.concatenate(rand)
    drop_top, drop_random = float(t.mean()), float(r.mean())
    return {
        "samples": len(rows),
        "share": DELETE_SHARE,
        "maps": explain_kind(model.metadata),
        "drop_top": round(drop_top, 6),
        "drop_random": round(drop_random, 6),
        "ratio": _ratio(drop_top, drop_random),
        "passed": bool(drop_top > 0 and drop_top >= PASS_RATIO * drop_random),
        "ceiling": _ceiling(t, r, np.concatenate(best), grid),
    }


def mistake_heatmaps(
    model: OnnxModel, images: np.ndarray, card: Card, indices: np.ndarray, preds: np.ndarray
) -> dict[int, np.ndarray]:
    """Test image index -> the heatmap (0..1, the image's size) of its predicted class,
    for ``indices`` (the report's worst mistakes: a few dozen, one run)."""
    if not len(indices):
        return {}
    rows = np.sort(np.asarray(indices))  # a memmap reads them in file order
    _, _, cam = model.run_with_cam(normalize_pixels(images[rows], card.mean, card.std))
    size = (card.height, card.width)
    return {int(i): heatmap(cam[j, preds[i]], size) for j, i in enumerate(rows)}


def explain_split(
    model: OnnxModel,
    images: np.ndarray,
    labels: np.ndarray,
    preds: np.ndarray,
    confidence: np.ndarray,
    card: Card,
    batch_size: int,
) -> tuple[dict[str, Any] | None, dict[int, np.ndarray]]:
    """(the deletion test, the worst mistakes' heatmaps) of the test split; (None, {}) for
    a model exported without maps."""
    if not has_maps(model):
        return None, {}
    mistakes = worst_mistakes(labels, preds, confidence)
    heatmaps = mistake_heatmaps(model, images, card, mistakes, preds)
    return deletion_test(model, images, card, batch_size), heatmaps


def deletion_metrics(result: dict[str, Any]) -> dict[str, Any]:
    """The deletion test as ``reports/metrics.json``'s ``explain`` block (the occlusion
    ceiling's keys beside the test's)."""
    ceiling = result["ceiling"]
    return {
        "deletion_drop_top20": result["drop_top"],
        "deletion_drop_random20": result["drop_random"],
        "deletion_ratio": result["ratio"],
        "passed": result["passed"],
        "occlusion_ceiling_ratio": ceiling["ratio"],
        "occlusion_ceiling_drop_top20": ceiling["drop_top"],
        "occlusion_map_ratio": ceiling["map_ratio"],
        "occlusion_samples": ceiling["samples"],
        "occlusion_grid": ceiling["grid"],
    }


def deletion_mlflow(metrics: dict[str, Any]) -> dict[str, float]:
    """The deletion test's MLflow metrics (beside ``test/ece``) from evaluate's metrics;
    none for a model without maps (and no ratio when it is undefined)."""
    if "explain" not in metrics:
        return {}
    block = deletion_metrics(metrics["explain"])
    return {
        f"test/{key}": float(value)
        for key, value in block.items()
        if key.startswith(("deletion_", "occlusion_"))
        and isinstance(value, float | int)
        and key != "occlusion_samples"
    }


def ceiling_verdict(block: dict[str, Any]) -> str | None:
    """What the occlusion ceiling says about the map, from metrics.json's ``explain`` block:
    whether a better map could pass where this one fails, or no map at its grid could.
    None for a block written before the ceiling (or without a ratio to compare with)."""
    ceiling, mine = block.get("occlusion_ceiling_ratio"), block.get("occlusion_map_ratio")
    if ceiling is None or mine is None:
        return None
    how = f"ranking its {block['occlusion_grid']} cells by their own occlusion drop"
    same = f"on the same {block['occlusion_samples']} images"
    if block["passed"]:
        return f"the map reaches {mine:.2f}x of the ceiling's {ceiling:.2f}x ({how}, {same})"
    if ceiling >= PASS_RATIO:
        return (
            f"the map fails, and a better map could pass: {how} reaches {ceiling:.2f}x "
            f"(the map {mine:.2f}x {same})"
        )
    return (
        f"no map at this {block['occlusion_grid']} grid can reach {PASS_RATIO:g}x on this "
        f"data: the map reaches {mine:.2f}x of the ceiling's {ceiling:.2f}x ({how}, {same})"
    )


def deletion_note(result: dict[str, Any]) -> str:
    """The deletion test in two lines under the mistakes picture's title (as narrow as it):
    the map's ratio and verdict, and the ratio a ranking of its grid's cells reached."""
    ratio, ceiling = result["ratio"], result["ceiling"]
    best = "n/a" if ceiling["ratio"] is None else f"{ceiling['ratio']:.2f}x"
    return (
        f"deletion test: the map's top {result['share']:.0%} costs "
        + ("n/a" if ratio is None else f"{ratio:.2f}x")
        + f" a random map's ({'passes' if result['passed'] else 'FAILS'} at {PASS_RATIO:g}x)\n"
        f"its {ceiling['grid']} cells ranked by their own occlusion: {best}"
    )


def deletion_line(result: dict[str, Any]) -> str:
    """The log line: both drops, their ratio, whether the maps pass, and the ceiling."""
    ratio = "n/a" if result["ratio"] is None else f"{result['ratio']:.2f}x"
    verdict = (
        "passed"
        if result["passed"]
        else f"FAILED (need >= {PASS_RATIO:g}x): the heatmaps do not show what the model uses"
    )
    ceiling = ceiling_verdict(deletion_metrics(result))
    return (
        f"deletion test ({result['maps']}, {result['samples']} test images): blurring the "
        f"top {result['share']:.0%} of the map drops the predicted class's probability by "
        f"{result['drop_top']:.3f}, a random map's top {result['share']:.0%} by "
        f"{result['drop_random']:.3f}; ratio {ratio}, {verdict}"
        + (f"; occlusion ceiling: {ceiling}" if ceiling else "")
    )
