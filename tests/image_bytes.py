"""Image bytes the image tests share: an image encoded in a format, and a real small PNG
whose header claims a size it does not hold (a decompression bomb's header)."""

from __future__ import annotations

import io
import struct
import zlib

from PIL import Image

from trainyard.core.image_formats import ensure_format


def encode(im: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    # pillow-heif (a dependency here) writes HEIC once registered, as imaging does lazily.
    assert fmt != "HEIF" or ensure_format("HEIF"), "pillow-heif is not installed"
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def png_claiming(width: int, height: int) -> bytes:
    """A real 4x4 PNG whose IHDR says ``width`` x ``height`` (CRC fixed)."""
    data = bytearray(encode(Image.new("RGB", (4, 4), (9, 9, 9))))
    assert data[12:16] == b"IHDR"
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)
