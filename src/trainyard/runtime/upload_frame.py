"""A map over the model's input, back over the upload it came from: the reverse of the
card's resize policy (trainyard.core.resize_policy), so a heatmap lies on the image as shown.

The model saw the upload padded to its aspect (``pad``), scaled and centre-cropped
(``crop``) or stretched (``stretch``) to ``card.height`` x ``card.width``. A map of that
frame is cut back to the upload's own pixels: the padding dropped, the cropped-away border
zero (the model never saw it), then resized to the upload's width and height. Shared by
the service (``/classify?explain=1``) and ``trainyard predict --explain``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from PIL import Image

from trainyard.core.card import Card
from trainyard.runtime.explain import heatmap


def to_upload(heat: np.ndarray, card: Card, width: int, height: int) -> np.ndarray:
    """``heat`` float32 [card.height, card.width] -> float32 [height, width] over the upload
    (``width`` x ``height``, as shown: after its EXIF orientation)."""
    mh, mw = card.height, card.width
    if (height, width) == (mh, mw):
        return np.asarray(heat, np.float32)
    if card.resize == "pad":
        # The canvas the upload was centred on (resize_policy.pad_size), in upload pixels.
        th, tw = max(height, math.ceil(width * mh / mw)), max(width, math.ceil(height * mw / mh))
        top, left = (th - height) // 2, (tw - width) // 2
        return _resized(heat, tw, th)[top : top + height, left : left + width]
    if card.resize == "crop":
        # The upload scaled to cover the target, its centre kept: outside it, nothing seen.
        scale = max(mh / height, mw / width)
        rh, rw = max(mh, round(height * scale)), max(mw, round(width * scale))
        seen = np.zeros((rh, rw), np.float32)
        top, left = (rh - mh) // 2, (rw - mw) // 2
        seen[top : top + mh, left : left + mw] = heat
        return _resized(seen, width, height)
    return _resized(heat, width, height)  # stretch


def _resized(a: np.ndarray, width: int, height: int) -> np.ndarray:
    """A float32 map resized bilinearly (Pillow's 32-bit float mode), clipped to 0..1."""
    if a.shape == (height, width):
        return a
    im = Image.fromarray(np.ascontiguousarray(a, np.float32))  # mode F
    return np.clip(np.asarray(im.resize((width, height), Image.BILINEAR)), 0.0, 1.0)


def upload_heatmap(cam_row: np.ndarray, card: Card, info: dict[str, Any]) -> np.ndarray:
    """One class's activation map [h, w] (the model's ``cam`` output) -> its heatmap, 0..1
    float32 [H, W] over the upload whose ``info`` (``decode_image``'s: ``width``,
    ``height``, ``turned``) the decode filled: the size the upload is shown at."""
    width, height = info["width"], info["height"]
    if info.get("turned"):
        width, height = height, width
    return to_upload(heatmap(cam_row, (card.height, card.width)), card, width, height)
