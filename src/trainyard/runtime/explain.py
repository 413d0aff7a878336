"""Heatmaps from a model's ``cam`` output, drawn with numpy and Pillow only (the bento ships
this module: no torch, no matplotlib).

The export writes ``cam`` [N, K, h, w] (``trainyard.export.cam``): per class, a map over
the net's last feature maps, unrectified. ``upsample`` brings one to the image's size;
``heatmap`` keeps its positive part (what speaks *for* the class) scaled to 0..1;
``overlay`` draws that over the image with a fixed colour map, ``heatmap_png`` alone.
The ONNX metadata ``explain`` says how the maps were made (``cam``, ``gradcam`` or
``hirescam``); a model exported before them has neither the key nor the output.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

CAM_OUTPUT = "cam"  # the exported model's third output, [N, K, h, w] float32
EXPLAIN_KEY = "explain"  # ONNX metadata: "cam" | "gradcam" | "hirescam"; absent: no maps
EXPLAIN_KINDS = ("cam", "gradcam", "hirescam")
# matplotlib's "jet" at five stops (dark blue, blue, cyan-green, yellow-red, dark red),
# interpolated linearly: cold where the map is 0, hot at its maximum.
JET = np.array(
    [[0, 0, 128], [0, 0, 255], [0, 255, 255], [255, 255, 0], [255, 0, 0], [128, 0, 0]],
    dtype=np.float32,
)


def explain_kind(metadata: dict[str, str]) -> str | None:
    """``cam``, ``gradcam`` or ``hirescam``: how a model's ``cam`` output is made, from its ONNX
    metadata; None for a model exported without one."""
    kind = metadata.get(EXPLAIN_KEY)
    return kind if kind in EXPLAIN_KINDS else None


def upsample(cam_row: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """One class's map [h, w] -> float32 [H, W] for an image ``size`` = (H, W), bilinear,
    unrectified (NaN read as 0): what ranks the image's pixels (the deletion test)."""
    cam = np.nan_to_num(np.asarray(cam_row, dtype=np.float32), nan=0.0, posinf=0.0, neginf=0.0)
    height, width = size
    small = Image.fromarray(np.ascontiguousarray(cam))  # mode F: 32-bit float
    return np.asarray(small.resize((width, height), Image.Resampling.BILINEAR), dtype=np.float32)


def heatmap(cam_row: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """One class's map [h, w] -> float32 [H, W] in 0..1 for an image ``size`` = (H, W):
    upsampled bilinearly, its positive part (what speaks for the class), divided by its
    maximum (after the upsampling, which at a scale that is no integer would miss the
    peak: the hottest pixel is 1). All zeros when nothing is positive."""
    big = np.maximum(upsample(cam_row, size), 0.0)
    top = float(big.max()) if big.size else 0.0
    if top <= 0.0:
        return np.zeros(size, dtype=np.float32)
    return np.clip(big / np.float32(top), 0.0, 1.0)


def colorize(heat: np.ndarray) -> np.ndarray:
    """float [H, W] in 0..1 -> uint8 RGB [H, W, 3] by the ``JET`` colour map."""
    t = np.clip(np.asarray(heat, dtype=np.float32), 0.0, 1.0) * (len(JET) - 1)
    low = np.minimum(t.astype(np.intp), len(JET) - 2)
    frac = (t - low)[..., None]
    rgb = JET[low] * (1.0 - frac) + JET[low + 1] * frac
    return np.rint(rgb).astype(np.uint8)


def _rgb(image: np.ndarray | Image.Image) -> np.ndarray:
    """An image as uint8 RGB [H, W, 3]: a PIL image, or an array [H, W], [H, W, C] or
    [C, H, W] (C = 1 or 3, the model's layout)."""
    if isinstance(image, Image.Image):
        return np.asarray(image.convert("RGB"))
    a = np.asarray(image)
    if a.ndim == 3 and a.shape[0] in (1, 3) and a.shape[2] not in (1, 3):
        a = a.transpose(1, 2, 0)  # [C, H, W] -> [H, W, C]
    if a.ndim == 3 and a.shape[2] == 1:
        a = a[..., 0]
    if a.dtype != np.uint8:
        a = np.clip(a, 0, 255).astype(np.uint8)
    return np.stack([a] * 3, axis=-1) if a.ndim == 2 else a[..., :3]


def overlay(image: np.ndarray | Image.Image, heat: np.ndarray, alpha: float = 0.45) -> np.ndarray:
    """uint8 RGB [H, W, 3]: ``heat`` (0..1, the image's size) coloured and blended over the
    image, ``alpha`` of the colour where the map is hot, fading to the image where it is 0
    (what is not behind the answer stays readable)."""
    rgb = _rgb(image).astype(np.float32)
    heat = np.asarray(heat, dtype=np.float32)
    if heat.shape != rgb.shape[:2]:
        raise ValueError(f"heatmap {heat.shape} is not the image's size {rgb.shape[:2]}")
    weight = (alpha * np.clip(heat, 0.0, 1.0))[..., None]
    blended = rgb * (1.0 - weight) + colorize(heat).astype(np.float32) * weight
    return np.rint(blended).astype(np.uint8)


def heatmap_png(heat: np.ndarray) -> bytes:
    """PNG bytes of the map alone, coloured by ``JET``, opacity the map's value (a page can
    lay it over the image it shows). An indexed PNG: the map in 256 levels, each palette
    entry its colour and its opacity (tRNS), deflated at level 1; browsers and Pillow's
    ``convert("RGBA")`` read RGBA. At 640x480 it takes ~5 ms where an RGBA PNG took ~120
    (the colour map over every pixel, four times the bytes to deflate): it is on
    ``/classify?explain=1``'s answer path."""
    levels = np.rint(np.clip(np.nan_to_num(np.asarray(heat, np.float32)), 0.0, 1.0) * 255)
    levels = np.ascontiguousarray(levels, dtype=np.uint8)
    im = Image.frombytes("P", (levels.shape[1], levels.shape[0]), levels.tobytes())
    im.putpalette(_PALETTE, rawmode="RGBA")
    out = io.BytesIO()
    im.save(out, format="PNG", compress_level=1)
    return out.getvalue()


# heatmap_png's palette: level i is colorize(i / 255) at opacity i.
_PALETTE = np.concatenate(
    [
        colorize(np.linspace(0.0, 1.0, 256, dtype=np.float32)),
        np.arange(256, dtype=np.uint8)[:, None],
    ],
    axis=1,
).tobytes()
