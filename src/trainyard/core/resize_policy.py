"""The card's resize policies (``pad``, ``crop``, ``stretch``; see ``trainyard.core.card``) on
decoded ``[h, w, C]`` uint8 pixels: the last step of ``imaging.image_to_pixels``, after the
decode, reduce and channel conversion.
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image

INTERPOLATION = {"bilinear": 2, "bicubic": 3, "lanczos": 1, "nearest": 0}  # PIL.Image.Resampling


def pad_size(h: int, w: int, height: int, width: int) -> tuple[int, int]:
    """The canvas the pad policy puts an h x w image on: the target's aspect, no pixel lost."""
    return max(h, math.ceil(w * height / width)), max(w, math.ceil(h * width / height))


def apply_resize(
    arr: np.ndarray, height: int, width: int, policy: str, fill: int, interpolation: str
) -> np.ndarray:
    """[h, w, C] uint8 -> [height, width, C] uint8 by the card's resize policy."""
    h, w, c = arr.shape
    if (h, w) == (height, width):
        return arr
    resample = INTERPOLATION[interpolation]
    if policy == "pad":
        # Pad rather than stretch: the object keeps its proportions and every pixel stays.
        th, tw = pad_size(h, w, height, width)
        if (th, tw) != (h, w):
            canvas = np.full((th, tw, c), fill, dtype=np.uint8)
            top, left = (th - h) // 2, (tw - w) // 2
            canvas[top : top + h, left : left + w] = arr
            arr = canvas
        return _resize(arr, width, height, resample)
    if policy == "crop":
        # torchvision's Resize(shorter side) + CenterCrop: scale so both sides cover the
        # target, then take the centre.
        scale = max(height / h, width / w)
        rh, rw = max(height, round(h * scale)), max(width, round(w * scale))
        resized = _resize(arr, rw, rh, resample)
        top, left = (rh - height) // 2, (rw - width) // 2
        return resized[top : top + height, left : left + width]
    if policy == "stretch":
        return _resize(arr, width, height, resample)
    raise ValueError(f"unknown resize policy {policy!r}")


def _resize(arr: np.ndarray, width: int, height: int, resample: int) -> np.ndarray:
    if arr.shape[:2] == (height, width):
        return arr
    mode = "L" if arr.shape[2] == 1 else "RGB"
    im = Image.fromarray(arr[:, :, 0] if mode == "L" else arr, mode=mode)
    out = np.asarray(im.resize((width, height), resample), dtype=np.uint8)
    return out[:, :, None] if out.ndim == 2 else out
