"""Image -> pixels: the one conversion from an image file to model pixels.

prepare applies it to every folder image, the service to every upload, with the same
arguments taken from the dataset card, so the model sees at serving time exactly what it
saw in training (no train/serve skew). Everything here treats its input as hostile: the
pixel count is checked from the header *before* any pixel is decoded (decompression
bombs), and every decode failure becomes an ``InputError`` that says what was wrong.

Memory stays bounded by the target size, not the file's: JPEGs decode at 1/2..1/8 scale,
and any image far larger than the target is box-reduced (``Image.reduce``, in strips for
modes with alpha) to about twice the target before any conversion or float arithmetic. A
large non-interlaced PNG of up to 8-bit samples is reduced band by band as its rows are
inflated (``trainyard.core.png_bands``), so a 623 MP RGBA poster never exists decoded
whole; other images cost their decoded bytes (4 per pixel for RGBA) and little more.
``reserve`` lets a caller that decodes many images at once (prepare's pool) hold off a
decode until the memory it will take is free (docs/own-images.md has the measurements).

Which formats are read, and the optional plugins they need: ``trainyard.core.image_formats``
(a file whose plugin is not installed is refused with a 415 that names the package).
"""

from __future__ import annotations

import functools
import io
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageOps

from trainyard.core.errors import InputError
from trainyard.core.image_formats import (
    IMAGE_FORMATS,
    MISSING_FORMAT,
    container_format,
    ensure_format,
)
from trainyard.core.png_bands import PngLayout, png_bands, png_layout
from trainyard.core.resize_policy import apply_resize, pad_size

# Pillow's own bomb guard (an error at 2x ~89 MP) would refuse a user's 600 MP poster before
# our limit is consulted. Every open in trainyard goes through ``_open``, which checks the
# caller's limit (data.max_image_pixels or serve.max_image_pixels) from the header first.
Image.MAX_IMAGE_PIXELS = None

DEFAULT_MAX_IMAGE_PIXELS = 25_000_000  # 25 MP: any phone photo; a 30000x30000 bomb is 900 MP
# The key that sets the pixel limit, named in the too-large error (prepare passes its own).
SERVE_LIMIT_KEY = "serve.max_image_pixels"
# Longer side / shorter side. A 1x20000 strip is a few bytes of PNG, but the pad policy
# would square it to 400 MP and crop would scale it to a 28x560000 strip: refused first.
DEFAULT_MAX_ASPECT_RATIO = 100
# The pad policy squares the image (to the target's aspect) before the resize: that canvas
# may hold at most this many times max_pixels (a 24 MP 3:2 photo pads to 36 MP).
PAD_CANVAS_FACTOR = 4
_GRAY_MODES = frozenset({"1", "L", "LA", "La", "I", "I;16", "I;16B", "I;16L", "I;16N", "F"})
# Images are box-reduced to at least this many times the target before the resize: enough
# for the resize's own antialiasing (Pillow's reducing_gap), far less memory than full size.
REDUCE_TO = 2
# Bytes of one strip converted at a time when reducing an image with alpha (premultiplied).
_STRIP_BYTES = 32 * 2**20
# PNGs over this many pixels (64 MiB as RGBA) are decoded in bands (``png_bands``) when
# reduced; smaller ones whole, as before.
STREAM_PIXELS = 2**24
# Decoded bytes of one band of a streamed PNG (at least one box of rows): smaller than a
# strip, as the CPU's caches like (a 623 MP poster to 224 px: 5.1-5.9 s of CPU in 8 MiB
# bands, 6.3-6.6 s in 32 MiB ones; Pillow's whole decode and strips 5.1-5.4 s).
_BAND_BYTES = 8 * 2**20
# Bytes a pixel takes in Pillow's memory, by mode (4 for the others: RGB is stored as RGBX).
_PIXEL_BYTES = {"1": 1, "L": 1, "P": 1, "I;16": 2, "I;16B": 2, "I;16L": 2, "I;16N": 2}
# What a caller's ``reserve`` is: called with the bytes a decode will hold, held meanwhile.
Reserve = Callable[[int], AbstractContextManager[object]]
# EXIF orientation -> the transpose that shows the image upright (as ImageOps.exif_transpose).
_T = Image.Transpose
_ORIENT = {
    2: _T.FLIP_LEFT_RIGHT,
    3: _T.ROTATE_180,
    4: _T.FLIP_TOP_BOTTOM,
    5: _T.TRANSPOSE,
    6: _T.ROTATE_270,
    7: _T.TRANSVERSE,
    8: _T.ROTATE_90,
}
_TURNED = frozenset({_T.TRANSPOSE, _T.ROTATE_270, _T.TRANSVERSE, _T.ROTATE_90})


@dataclass(frozen=True)
class ImageHeader:
    """What an image's header says, read without decoding a pixel."""

    format: str
    mode: str
    width: int
    height: int
    grayscale: bool
    transparent: bool = False  # an alpha channel or a transparent palette entry


def _open(data: bytes, max_pixels: int, field: str, max_aspect_ratio: float, limit_key: str) -> Any:

    if not data:
        raise InputError(f"{field}: the file is empty (0 bytes); send an image file", field=field)
    needs = container_format(data)
    if needs is not None and not ensure_format(needs):
        raise InputError(f"{field}: {MISSING_FORMAT[needs]}", field=field, status=415)
    try:
        with _quiet_bomb_warning():
            # open() reads only the header: the size is known before any pixel is decoded.
            im = Image.open(io.BytesIO(data), formats=_readable())
    except Image.DecompressionBombError:
        # Pillow's own guard, when re-enabled by other code, fired before ours could look.
        raise too_many_pixels(field, max_pixels, "a likely decompression bomb", limit_key) from None
    except Exception:  # Pillow signals unreadable input with many types; all mean "not an image"
        raise InputError(
            f"{field}: not an image ({', '.join(IMAGE_FORMATS)}): the bytes are not a "
            "decodable image header",
            field=field,
        ) from None
    width, height = im.size
    if width * height > max_pixels:
        im.close()
        raise too_many_pixels(field, max_pixels, f"{width}x{height} pixels", limit_key)
    if width < 1 or height < 1:
        im.close()
        raise InputError(f"{field}: the image has no pixels ({width}x{height})", field=field)
    if max(width, height) > max_aspect_ratio * min(width, height):
        im.close()
        raise InputError(
            f"{field}: image too elongated ({width}x{height} pixels); the longer side may be "
            f"at most {max_aspect_ratio:g} times the shorter (serve.max_aspect_ratio). "
            "Crop or pad it first",
            field=field,
        )
    return im


def _readable() -> tuple[str, ...]:
    """The formats Pillow can read here: naming one it lacks raises KeyError inside it."""
    Image.init()
    return _readable_among(len(Image.OPEN))


@functools.cache
def _readable_among(registered: int) -> tuple[str, ...]:
    """Computed again only when Pillow's registry grows (a plugin registered later)."""
    return tuple(f for f in IMAGE_FORMATS if f in Image.OPEN)


def _quiet_bomb_warning() -> AbstractContextManager[object]:
    """Pillow's guard is off (above) unless someone turned it back on: ours decides, and
    Pillow's warning is silenced. Off, there is nothing to silence (a 28 px PNG decodes in
    0.1 ms, of which catch_warnings would take 5 us)."""
    return nullcontext() if Image.MAX_IMAGE_PIXELS is None else _bomb_warning_ignored()


@contextmanager
def _bomb_warning_ignored() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        yield


def read_header(
    data: bytes,
    *,
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    field: str = "image",
    max_aspect_ratio: float = DEFAULT_MAX_ASPECT_RATIO,
    limit_key: str = SERVE_LIMIT_KEY,
) -> ImageHeader:
    """Format, mode, size (as stored, before EXIF orientation) and whether the image is
    grayscale and transparent or not, from the header alone."""
    with _open(data, max_pixels, field, max_aspect_ratio, limit_key) as im:
        alpha = bool(im.has_transparency_data) or im.mode == "PA"
        return ImageHeader(im.format, im.mode, im.size[0], im.size[1], _is_gray(im), alpha)


def _is_gray(im: Any) -> bool:
    if im.mode in _GRAY_MODES:
        return True
    if im.mode in ("P", "PA"):
        palette = im.getpalette() or []
        rgb = np.asarray(palette[: len(palette) // 3 * 3]).reshape(-1, 3)
        return bool((rgb == rgb[:, :1]).all())
    return False


def image_to_pixels(
    data: bytes,
    *,
    channels: int,
    height: int,
    width: int,
    resize: str = "pad",
    fill: int = 0,
    interpolation: str = "bilinear",
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    field: str = "image",
    invert: bool = False,
    info: dict[str, Any] | None = None,
    max_aspect_ratio: float = DEFAULT_MAX_ASPECT_RATIO,
    limit_key: str = SERVE_LIMIT_KEY,
    reserve: Reserve | None = None,
) -> np.ndarray:
    """Image bytes of any supported format and mode -> uint8 pixels ``[C, H, W]``.

    ``info``, when given, receives the file's ``format``, ``width`` and ``height`` as soon
    as the header is read (also when decoding then fails): what the service reports as
    input image sizes, without opening the image twice. ``reserve``, when given, is called
    once the header is read with the bytes the decode will hold at most (the file's own
    included), and the context manager it returns is held while they are. ``info`` also
    gets ``turned`` (True) when the EXIF shows the image turned by 90 degrees (sides swapped).

    In order: header check (format, pixel count against ``limit_key``'s ``max_pixels``,
    aspect ratio), decode (JPEGs far larger than needed decode at 1/2..1/8 scale), a box
    reduce of anything over ``REDUCE_TO`` x the target (alpha premultiplied, so transparent
    pixels' colours do not bleed; a large PNG's rows as they are inflated), EXIF
    orientation, conversion to ``channels`` (16-bit maps to 8-bit, transparency is
    composited on ``fill``), then the resize policy (see ``trainyard.core.card``). An image
    already at the target size is not resampled, so a Fashion-MNIST PNG gives back exactly
    its training pixels.
    """

    if channels not in (1, 3):
        raise ValueError(f"channels must be 1 or 3, got {channels}")
    with _open(data, max_pixels, field, max_aspect_ratio, limit_key) as im:
        fmt = im.format
        if info is not None:
            info.update(format=fmt, width=im.width, height=im.height)
        try:
            arr = _decode(im, data, height, width, channels, resize, fill, invert, info, reserve)
        except InputError:
            raise
        except Exception as err:  # truncated or corrupt data: the sender's bytes, not our bug
            raise InputError(
                f"{field}: the {fmt} image is truncated or corrupt ({_short(err)})", field=field
            ) from None
    if resize == "pad":
        _check_canvas(arr.shape[0], arr.shape[1], height, width, max_pixels, field, limit_key)
    out = apply_resize(arr, height, width, resize, fill, interpolation)
    return np.ascontiguousarray(out.transpose(2, 0, 1))


def _decode(
    im: Any,
    data: bytes,
    height: int,
    width: int,
    channels: int,
    resize: str,
    fill: int,
    invert: bool,
    info: dict[str, Any] | None,
    reserve: Reserve | None,
) -> np.ndarray:
    """The opened image ``im`` -> ``[H, W, C]`` uint8 at about the target size: orientation,
    the reduce (while ``reserve`` holds its bytes), EXIF turn, then ``channels``."""
    big_png = im.format == "PNG" and im.width * im.height > STREAM_PIXELS
    layout = png_layout(data) if big_png else None
    # The orientation first: the reduce works on the stored image, whose sides are
    # the target's swapped when the EXIF says it is shown turned by 90 degrees.
    method = _ORIENT.get(_exif(im, layout).get(0x0112, 1))
    th, tw = (width, height) if method in _TURNED else (height, width)
    if info is not None and method in _TURNED:
        info["turned"] = True  # shown with width and height swapped
    if im.format in ("JPEG", "MPO"):
        # Any scale that keeps both sides at least twice the target: enough for every
        # policy (crop needs the shorter side >= target) and far cheaper to decode.
        im.draft(im.mode, (REDUCE_TO * tw, REDUCE_TO * th))
    factors = _reduce_factors(im.width, im.height, tw, th, resize)
    if factors == (1, 1):
        layout = None  # small enough: decoded whole, passed through bit-exactly
    with (reserve or nullcontext)(len(data) + _footprint(im, factors, layout)):
        small = _reduce(im, factors, data, layout)
        if method is not None:
            small = small.transpose(method)
        return _to_channels(small, channels, fill, invert)


def _exif(im: Any, layout: PngLayout | None) -> Any:
    """``im``'s EXIF without decoding a pixel. For a PNG Pillow's own getexif() decodes the
    whole image in case an eXIf chunk follows the image data; the layout has found it."""
    if layout is None:
        return im.getexif()
    if layout.exif is not None:
        im.info.setdefault("exif", layout.exif)
    return Image.Image.getexif(im)  # reads info["exif"] (and XMP) only


def _reduce_factors(w: int, h: int, tw: int, th: int, policy: str) -> tuple[int, int]:
    """Integer box-reduce factors (x, y) that keep what ``policy`` needs at least
    ``REDUCE_TO`` x the target: both sides for crop, the side that limits the scale for pad
    (the other is padded anyway), each side on its own for stretch."""
    kx, ky = w // (REDUCE_TO * tw), h // (REDUCE_TO * th)
    if policy == "crop":
        kx = ky = min(kx, ky)
    elif policy == "pad":
        kx = ky = max(kx, ky)
    return max(1, kx), max(1, ky)


def _work_mode(im: Any) -> str:
    """The mode a reduce averages in: alpha kept (Pillow's reduce premultiplies RGBA/LA),
    palettes and 1-bit expanded, 16-bit as 32-bit integers, other colour spaces as RGB."""
    mode = im.mode
    if mode in ("RGBA", "LA", "RGBa", "La", "L", "RGB", "I", "F"):
        return mode
    if mode.startswith("I;16"):
        return "I"
    if im.has_transparency_data or mode == "PA":
        return "LA" if mode == "1" else "RGBA"
    return "L" if mode == "1" else "RGB"


def _strip_rows(im: Any, ky: int, layout: PngLayout | None) -> int:
    """Rows of one strip (or streamed band): whole reduce boxes, about ``_STRIP_BYTES``
    (``_BAND_BYTES``) decoded."""
    target = _STRIP_BYTES if layout is None else _BAND_BYTES
    return ky * max(1, target // (4 * im.width * ky))


def _footprint(im: Any, factors: tuple[int, int], layout: PngLayout | None) -> int:
    """Bytes a decode of ``im`` holds at most besides the file: the image decoded whole
    (or, streamed, a band in its five forms: inflated, handed on, decoded, converted,
    premultiplied), the strips of a reduce, and the float compositing of the result."""
    (w, h), (kx, ky) = im.size, factors
    strip = 4 * w * min(h, _strip_rows(im, ky, layout)) if factors != (1, 1) else 0
    whole = _PIXEL_BYTES.get(im.mode, 4) * w * h
    held = 5 * strip if layout is not None else whole + 3 * strip
    # _to_channels: float32 RGBA and RGB copies of the reduced image, about 32 bytes a pixel.
    return held + 32 * -(-w // kx) * -(-h // ky)


def _reduce(im: Any, factors: tuple[int, int], data: bytes, layout: PngLayout | None) -> Any:
    """``im`` box-reduced by ``factors`` (``im`` itself, loaded, when (1, 1): the target
    size passes through bit-exactly).

    A PNG with a ``layout`` is decoded band by band from ``data`` and never whole. Modes
    that need a conversion first (alpha, palettes) are converted and reduced in strips of
    whole factor rows, so the full-size image is never copied either.
    """
    kx, ky = factors
    mode = _work_mode(im)
    w, h = im.size
    rows = _strip_rows(im, ky, layout)
    if layout is not None:
        strips = png_bands(data, layout, rows)
    else:
        im.load()
        if factors == (1, 1):
            return im
        if mode == im.mode and mode not in ("RGBA", "LA"):
            return im.reduce((kx, ky))  # the C reduce allocates only the small result
        strips = ((top, im.crop((0, top, w, min(h, top + rows))), 0) for top in range(0, h, rows))
    out = Image.new(mode, (-(-w // kx), -(-h // ky)))
    for top, strip, skip in strips:
        if strip.mode != mode:
            strip = strip.convert(mode)
        out.paste(strip.reduce((kx, ky), (0, skip, w, strip.height)), (0, top // ky))
    if layout is not None and mode == im.mode and mode not in ("RGBA", "LA"):
        # As im.reduce above keeps it: a tRNS colour key stays with the pixels.
        out.info = dict(im.info)
    return out


def _to_channels(im: Any, channels: int, fill: int, invert: bool = False) -> np.ndarray:
    """uint8 [h, w, channels] from any mode; ``invert`` flips the image's own pixels, then
    alpha is composited on ``fill`` (transparent stays background either way)."""

    mode = im.mode
    if mode.startswith("I") or mode == "F":
        # 16-bit PNGs and TIFFs load as I;16 or I: map 0..65535 onto 0..255 as 8-bit tools do.
        arr = np.asarray(im, dtype=np.float64)
        if mode != "F":
            arr = arr / 257.0
        gray = np.clip(np.rint(arr), 0, 255).astype(np.uint8)[:, :, None]
        if invert:
            gray = 255 - gray
        return np.repeat(gray, channels, axis=2) if channels == 3 else gray
    if im.has_transparency_data or mode in ("RGBA", "LA", "PA", "La", "RGBa"):
        rgba = np.asarray(im.convert("RGBA"), dtype=np.float32)
        alpha = rgba[:, :, 3:4] / 255.0
        own = 255.0 - rgba[:, :, :3] if invert else rgba[:, :, :3]
        rgb = own * alpha + float(fill) * (1.0 - alpha)
        composited = Image.fromarray(np.clip(np.rint(rgb), 0, 255).astype(np.uint8), mode="RGB")
        im = composited if channels == 3 else composited.convert("L")
    else:
        want = "RGB" if channels == 3 else "L"
        if mode != want:  # already the model's mode (a Fashion-MNIST PNG): no copy
            im = im.convert(want)
        if invert:
            im = ImageOps.invert(im)
    arr = np.asarray(im, dtype=np.uint8)
    return arr[:, :, None] if arr.ndim == 2 else arr


def _check_canvas(
    h: int, w: int, height: int, width: int, max_pixels: int, field: str, limit_key: str
) -> None:
    """Refuse (413) an image whose padded canvas would exceed PAD_CANVAS_FACTOR x max_pixels
    (the canvas is allocated whole before the resize)."""
    th, tw = pad_size(h, w, height, width)
    if th * tw > PAD_CANVAS_FACTOR * max_pixels:
        raise too_many_pixels(
            field,
            max_pixels,
            f"{w}x{h} pixels pad to {tw}x{th}, over {PAD_CANVAS_FACTOR} times the limit",
            limit_key,
        )


def too_many_pixels(
    field: str, max_pixels: int, got: str, limit_key: str = SERVE_LIMIT_KEY
) -> InputError:
    """413 for an image over ``limit_key``'s limit: a user's own setting (``data.``) can be
    raised, an upload's (``serve.``) only met by a smaller image."""
    fix = "Downscale it first" + (
        f", or raise {limit_key}" if not limit_key.startswith("serve.") else ""
    )
    return InputError(
        f"{field}: image too large ({got}); the limit is {max_pixels:,} pixels "
        f"({limit_key}). {fix}",
        field=field,
        status=413,
    )


def _short(err: Exception) -> str:
    text = str(err) or type(err).__name__
    return text if len(text) <= 120 else text[:117] + "..."
