"""Request input -> model input: the one conversion the service applies to every request.

The contract (channels, size, resize policy, normalisation) is the dataset card the ONNX
model carries in its metadata (``trainyard.core.card``), so the service never holds a copy that
could drift from training; images go through ``trainyard.core.imaging.image_to_pixels``, the
function prepare used on the training images. Array validation stops at the first problem
and names it (``images[3][0][7]: ...``) instead of listing a million errors.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any

import numpy as np
from annotated_types import Len
from pydantic import Field, TypeAdapter, ValidationError

from trainyard.core.card import Card, normalize_pixels
from trainyard.core.errors import InputError
from trainyard.core.imaging import (
    DEFAULT_MAX_ASPECT_RATIO,
    DEFAULT_MAX_IMAGE_PIXELS,
    IMAGE_FORMATS,
    image_to_pixels,
)

__all__ = [
    "DEFAULT_MAX_ASPECT_RATIO",
    "DEFAULT_MAX_IMAGE_PIXELS",
    "IMAGE_FORMATS",
    "decode_image",
    "model_input",
    "pixel_arrays",
    "softmax",
]


def model_input(pixels: np.ndarray, card: Card) -> np.ndarray:
    """Pixels 0–255 [N,C,H,W] -> float32 model input, exactly as evaluate does."""
    return normalize_pixels(pixels, card.mean, card.std)


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax in float64 (so each row sums to 1 within 1e-12), as float32 out."""
    z = logits.astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return (e / e.sum(axis=1, keepdims=True)).astype(np.float32)


def decode_image(data: bytes, card: Card, **options: Any) -> np.ndarray:
    """Image bytes of any supported format, size and mode -> uint8 [C,H,W] for ``card``.

    Exactly what prepare produced for a training image from the same bytes. ``options``:
    ``image_to_pixels``'s own, with its defaults: ``invert`` (dark-on-light photos for a
    light-on-dark dataset) flips the pixels before the resize; ``max_pixels``,
    ``max_aspect_ratio``, ``field`` (the name errors use), ``info``.
    """
    return image_to_pixels(data, **card.pixel_options(), **options)


# ---------------------------------------------------------------------------- arrays


def _pixel_adapter(card: Card) -> Any:

    # strict: JSON true or "12" is not a pixel; ints are accepted for floats even so.
    pixel = Annotated[float, Field(strict=True, ge=0, le=255, allow_inf_nan=False)]
    row = Annotated[list[pixel], Len(card.width, card.width)]
    plane = Annotated[list[row], Len(card.height, card.height)]
    if card.channels == 1:
        return TypeAdapter(plane)  # grayscale: H rows of W numbers
    return TypeAdapter(Annotated[list[plane], Len(card.channels, card.channels)])


def image_shape_text(card: Card) -> str:
    """How one JSON image looks for ``card``: '28x28' or '3x64x64' (channels first)."""
    hw = f"{card.height}x{card.width}"
    return hw if card.channels == 1 else f"{card.channels}x{hw}"


_ADAPTERS: dict[tuple[int, int, int], Any] = {}


def pixel_arrays(images: Any, card: Card, *, max_images: int, field: str = "images") -> np.ndarray:
    """A JSON list of images of numbers 0–255 -> float32 [N,C,H,W], or the first problem.

    One image is H rows of W numbers for a grayscale model, C such planes (channels
    first) otherwise. Each image is validated on its own (pydantic, in Rust) and only the
    first error is reported, so a huge bad request costs one short message.
    """

    c, h, w = card.input_shape
    shape = image_shape_text(card)
    if not isinstance(images, list):
        raise InputError(
            f"{field}: expected a list of {shape} arrays, got {_json_type(images)}", field=field
        )
    if not images:
        raise InputError(f"{field}: the list is empty; send 1 to {max_images} images", field=field)
    if len(images) > max_images:
        raise InputError(
            f"{field}: {len(images)} images, more than the limit of {max_images} per request "
            "(serve.max_batch_images); split them over several requests",
            field=field,
            status=413,
        )
    adapter = _ADAPTERS.get((c, h, w))
    if adapter is None:
        adapter = _ADAPTERS[(c, h, w)] = _pixel_adapter(card)
    out = np.empty((len(images), c, h, w), dtype=np.float32)
    for i, image in enumerate(images):
        try:
            out[i] = np.asarray(adapter.validate_python(image), dtype=np.float32).reshape(c, h, w)
        except ValidationError as err:
            first = err.errors(include_url=False)[0]
            where = f"{field}[{i}]" + "".join(f"[{p}]" for p in first["loc"])
            raise InputError(f"{where}: {_explain(first, c, h, w)}", field=where) from None
    return out


def _explain(error: Mapping[str, Any], c: int, h: int, w: int) -> str:
    """One pydantic error -> a sentence about pixels, with the offending value."""
    kind = error["type"]
    # Depth below the image: grayscale images have rows then numbers; colour images
    # have planes, rows, numbers.
    depth = len(error["loc"]) + (1 if c == 1 else 0)
    value = error.get("input")
    if kind in ("too_short", "too_long", "list_type"):
        what = {
            0: f"{c} channel planes of {h} rows of {w} numbers",
            1: f"{h} rows of {w} numbers",
        }.get(depth, f"{w} numbers")
        got = f"{len(value)} items" if isinstance(value, list) else _json_type(value)
        return f"expected {what}, got {got}"
    if kind == "finite_number":
        return "NaN and Infinity are not pixel values; use numbers 0–255"
    if kind in ("greater_than_equal", "less_than_equal"):
        return f"pixel value {value!r} is outside 0–255"
    return f"expected a number 0–255, got {_json_type(value)}"


def _json_type(value: Any) -> str:
    """How a JSON value reads to the person who sent it: null, true, a string "ab"..."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, str):
        text = json.dumps(value)
        return "a string " + (text if len(text) <= 40 else text[:37] + '..."')
    if isinstance(value, int | float):
        return f"the number {value!r}"
    return {dict: "an object", list: "a list"}.get(type(value), type(value).__name__)
