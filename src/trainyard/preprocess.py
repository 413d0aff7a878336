"""Request input -> model input: the one conversion the service applies to every image.

The contract (input size, normalisation) comes from the ONNX model's own metadata, so the
service never holds a copy that could drift from training. Everything here treats its input
as hostile: image dimensions are checked *before* pixels are decoded (decompression bombs),
any decode failure is the client's bad input, and array validation stops at the first
problem and names it (``images[3][0][7]: ...``) instead of listing a million errors.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np

from trainyard.errors import InputError, ModelError

# Formats the service accepts. MPO is how Pillow names the multi-picture JPEGs many phone
# cameras write; they decode like any JPEG.
IMAGE_FORMATS = ("PNG", "JPEG", "MPO")
DEFAULT_MAX_IMAGE_PIXELS = 25_000_000  # 25 MP: any phone photo; a 30000x30000 bomb is 900 MP


@dataclass(frozen=True)
class InputContract:
    """What the model takes, read from its ONNX metadata (written by trainyard.export)."""

    height: int
    width: int
    scale: float
    mean: float
    std: float

    @classmethod
    def from_metadata(cls, meta: Mapping[str, str]) -> InputContract:
        """Parse ``input_shape`` and ``normalization``; a model without them is refused."""
        try:
            shape = json.loads(meta["input_shape"])
            norm = json.loads(meta["normalization"])
            batch, channels, height, width = shape
            contract = cls(
                height=int(height),
                width=int(width),
                scale=float(norm["scale"]),
                mean=float(norm["mean"]),
                std=float(norm["std"]),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise ModelError(
                f"model metadata has no usable input_shape/normalization ({err!r}); "
                "re-export it with `dvc repro export`"
            ) from None
        if channels != 1 or batch != -1 or contract.std <= 0 or contract.scale <= 0:
            raise ModelError(
                f"model metadata describes input {shape} with normalization {norm}; this "
                "service serves grayscale models [-1, 1, H, W] with a positive scale and std"
            )
        return contract


def normalize(pixels: np.ndarray, contract: InputContract) -> np.ndarray:
    """Pixels 0–255 [N,H,W] -> float32 model input [N,1,H,W], exactly as evaluate does."""
    x = (pixels.astype(np.float32) / contract.scale - contract.mean) / contract.std
    return np.ascontiguousarray(x[:, None, :, :], dtype=np.float32)


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax in float64 (so each row sums to 1 within 1e-12), as float32 out."""
    z = logits.astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return (e / e.sum(axis=1, keepdims=True)).astype(np.float32)


# ---------------------------------------------------------------------------- images


def decode_image(
    data: bytes,
    contract: InputContract,
    *,
    invert: bool = False,
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    field: str = "image",
) -> np.ndarray:
    """PNG/JPEG bytes of any size and mode -> uint8 [H,W] pixels, light garment on black.

    Grayscale; alpha composited on black (the dataset's background); ``invert`` first for
    dark-on-light photos; padded to a square with black and resized (Lanczos) to the
    model's size. An image already at the model's size in mode L passes through unchanged,
    so a Fashion-MNIST PNG gives back exactly its training pixels.
    """
    from PIL import Image

    if not data:
        raise InputError(f"{field}: the file is empty; send a PNG or JPEG image", field=field)
    try:
        # open() reads only the header: the size is known before any pixel is decoded.
        im = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except Image.DecompressionBombError:
        # Pillow's own guard (2x Image.MAX_IMAGE_PIXELS) fired before ours could look.
        raise _too_many_pixels(field, max_pixels, "a likely decompression bomb") from None
    except Exception:  # Pillow signals unreadable input with many types; all mean "not an image"
        raise InputError(
            f"{field}: not a PNG or JPEG image (the bytes are not a decodable image header)",
            field=field,
        ) from None
    with im:
        width, height = im.size
        if width * height > max_pixels:
            raise _too_many_pixels(field, max_pixels, f"{width}x{height} pixels")
        if im.format in ("JPEG", "MPO"):
            # Let libjpeg decode at 1/2..1/8 scale when the image is far larger than needed.
            im.draft("L", (contract.width * 4, contract.height * 4))
        try:
            im.load()
            gray, alpha = _gray_and_alpha(im)
        except InputError:
            raise
        except Exception as err:  # truncated or corrupt data: the client's bytes, not our bug
            raise InputError(
                f"{field}: the {im.format} image is truncated or corrupt ({_short(err)})",
                field=field,
            ) from None
    if invert:
        gray = 255 - gray
    if alpha is not None:  # composite on black: transparent = background
        gray = np.rint(gray.astype(np.float32) * (alpha.astype(np.float32) / 255.0))
        gray = gray.astype(np.uint8)
    return _fit(gray, contract)


def _too_many_pixels(field: str, max_pixels: int, got: str) -> InputError:
    return InputError(
        f"{field}: image too large ({got}); the limit is {max_pixels:,} pixels "
        "(serve.max_image_pixels). Downscale it before sending",
        field=field,
        status=413,
    )


def _short(err: Exception) -> str:
    text = str(err) or type(err).__name__
    return text if len(text) <= 120 else text[:117] + "..."


def _gray_and_alpha(im: Any) -> tuple[np.ndarray, np.ndarray | None]:
    """uint8 grayscale and alpha (None when opaque) from any PNG/JPEG mode."""
    mode = im.mode
    if mode.startswith("I") or mode == "F":
        # 16-bit PNGs load as I;16 (or I); map 0..65535 onto 0..255 as 8-bit tools do.
        arr = np.asarray(im, dtype=np.float64)
        if mode != "F":
            arr = arr / 257.0
        return np.clip(np.rint(arr), 0, 255).astype(np.uint8), None
    if im.has_transparency_data:
        la = im.convert("RGBA").convert("LA") if mode == "P" else im.convert("LA")
        arr = np.asarray(la, dtype=np.uint8)
        return np.ascontiguousarray(arr[:, :, 0]), np.ascontiguousarray(arr[:, :, 1])
    return np.asarray(im.convert("L"), dtype=np.uint8), None


def _fit(gray: np.ndarray, contract: InputContract) -> np.ndarray:
    """Pad to the model's aspect ratio with black (centred), then resize to its size."""
    from PIL import Image

    h, w = gray.shape
    if (h, w) == (contract.height, contract.width):
        return gray
    # Pad rather than stretch: a garment keeps its proportions, as in the dataset.
    target_w = max(w, math.ceil(h * contract.width / contract.height))
    target_h = max(h, math.ceil(w * contract.height / contract.width))
    if (target_h, target_w) != (h, w):
        canvas = np.zeros((target_h, target_w), dtype=np.uint8)
        top, left = (target_h - h) // 2, (target_w - w) // 2
        canvas[top : top + h, left : left + w] = gray
        gray = canvas
    resized = Image.fromarray(gray, mode="L").resize(
        (contract.width, contract.height), Image.Resampling.LANCZOS
    )
    return np.asarray(resized, dtype=np.uint8)


# ---------------------------------------------------------------------------- arrays


def _pixel_adapter(contract: InputContract) -> Any:
    from annotated_types import Len
    from pydantic import Field, TypeAdapter

    # strict: JSON true or "12" is not a pixel; ints are accepted for floats even so.
    pixel = Annotated[float, Field(strict=True, ge=0, le=255, allow_inf_nan=False)]
    row = Annotated[list[pixel], Len(contract.width, contract.width)]
    return TypeAdapter(Annotated[list[row], Len(contract.height, contract.height)])


_ADAPTERS: dict[tuple[int, int], Any] = {}


def pixel_arrays(
    images: Any, contract: InputContract, *, max_images: int, field: str = "images"
) -> np.ndarray:
    """A JSON list of HxW arrays of numbers 0–255 -> float32 [N,H,W], or the first problem.

    Each image is validated on its own (pydantic, in Rust) and only the first error is
    reported, so a huge bad request costs one short message, not one per bad number.
    """
    from pydantic import ValidationError

    h, w = contract.height, contract.width
    if not isinstance(images, list):
        raise InputError(
            f"{field}: expected a list of {h}x{w} arrays, got {_json_type(images)}", field=field
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
    adapter = _ADAPTERS.get((h, w))
    if adapter is None:
        adapter = _ADAPTERS[(h, w)] = _pixel_adapter(contract)
    out = np.empty((len(images), h, w), dtype=np.float32)
    for i, image in enumerate(images):
        try:
            out[i] = np.asarray(adapter.validate_python(image), dtype=np.float32)
        except ValidationError as err:
            first = err.errors(include_url=False)[0]
            where = f"{field}[{i}]" + "".join(f"[{p}]" for p in first["loc"])
            raise InputError(f"{where}: {_explain(first, h, w)}", field=where) from None
    return out


def _explain(error: Mapping[str, Any], h: int, w: int) -> str:
    """One pydantic error -> a sentence about pixels, with the offending value."""
    kind, depth = error["type"], len(error["loc"])
    value = error.get("input")
    if kind in ("too_short", "too_long", "list_type"):
        what = f"{h} rows of {w} numbers" if depth == 0 else f"{w} numbers"
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
