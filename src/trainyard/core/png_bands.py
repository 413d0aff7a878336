"""A PNG's rows in bands, so that a poster is box-reduced without being decoded whole.

Pillow decodes a PNG in one piece: a 623 MP RGBA poster is 2.5 GB in memory before the
first pixel can be averaged away. Here the file's zlib stream is inflated a band of rows at
a time, and each band is handed to Pillow's own PNG decoder as a small PNG of its own (the
same header fields, palette and transparency; the rows stored uncompressed). Pillow thus
still does the unfiltering (all five filter types) and the unpacking, in C, exactly as for
the whole file. A row's filter refers to the row above it, so each band after the first
starts with the previous band's last row, unfiltered (filter type 0): a band decodes as the
same pixels the whole file gives, and only a band and what the caller keeps are held. The
hand-off leaves out two checksums (``_stored``: the zlib stream's, by never ending it;
``_band_png``: the IDAT chunk's, which Pillow does not read). Computing them cost about
2.5 s of CPU on a 623 MP poster, whose whole decode takes about 5.

Streamed: non-interlaced, single-image PNGs of 8-bit samples (grey, RGB, palette,
grey+alpha, RGBA), and of 1-, 2- and 4-bit ones whose rows fill whole bytes. Interlaced and
animated files and 16-bit samples are not (Pillow keeps only the high byte of a 16-bit
sample, so a band's last row could not be handed on as the next band's reference):
``png_layout`` returns None and the caller decodes them whole.
"""

from __future__ import annotations

import io
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

from PIL import Image

_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# (bit depth, colour type) -> the raw mode of one row, as Pillow's PNG plugin unpacks it; the
# same name packs a decoded row back into the file's bytes, losslessly for these depths.
_RAWMODES = {
    (1, 0): "1",
    (2, 0): "L;2",
    (4, 0): "L;4",
    (8, 0): "L",
    (8, 2): "RGB",
    (1, 3): "P;1",
    (2, 3): "P;2",
    (4, 3): "P;4",
    (8, 3): "P",
    (8, 4): "LA",
    (8, 6): "RGBA",
}
_SAMPLES = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # samples per pixel, by colour type
# What a band needs from the file's chunks to read as the file does: palette, transparency.
_CARRIED = frozenset({b"PLTE", b"tRNS"})
# Compressed bytes handed to zlib per call (the part it does not consume is copied each
# call, so a 1 GB IDAT chunk is not handed over whole), and the most it inflates per call:
# small pieces reuse the allocator's memory, where band-sized ones each fault in fresh pages
# (a 623 MP poster to 64 px, 20 MiB bands: 8.0 s of CPU in band-sized pieces, 6.6 s in these).
_FEED = 1 << 16
_PIECE = 1 << 20
_STORED = 65535  # the largest stored deflate block


@dataclass(frozen=True)
class PngLayout:
    """What a streamed decode needs from a PNG's chunks."""

    width: int
    height: int
    depth: int
    colour: int
    carried: bytes  # the PLTE and tRNS chunks, verbatim
    idat: int  # offset of the first IDAT chunk
    # The eXIf chunk as Pillow keeps it (info["exif"]), wherever it is: Pillow's getexif()
    # decodes the whole image to look for one after the image data.
    exif: bytes | None

    @property
    def rawmode(self) -> str:
        return _RAWMODES[(self.depth, self.colour)]

    @property
    def row_bytes(self) -> int:
        """One stored row: its filter byte and its samples, padded to a whole byte."""
        return 1 + -(-self.width * _SAMPLES[self.colour] * self.depth // 8)


def _chunks(data: bytes) -> Iterator[tuple[int, bytes, int]]:
    """(offset, type, length) of each chunk after the signature, up to IEND or the end."""
    pos = len(_SIGNATURE)
    while pos + 8 <= len(data):
        length, tag = struct.unpack_from(">I4s", data, pos)
        yield pos, tag, length
        if tag == b"IEND":
            return
        pos += 12 + length


def png_layout(data: bytes) -> PngLayout | None:
    """The layout of a PNG whose rows can be streamed (``png_bands``), else None: not a
    PNG, interlaced, animated, 16-bit, or no image data."""
    if not data.startswith(_SIGNATURE):
        return None
    header, carried, idat, exif = None, [], 0, None
    for pos, tag, length in _chunks(data):
        if tag == b"IHDR" and length >= 13:
            header = struct.unpack_from(">IIBBBBB", data, pos + 8)
        elif tag == b"acTL":
            return None  # animated: the first frame need not be the IDAT image
        elif tag in _CARRIED and not idat:
            carried.append(data[pos : pos + 12 + length])
        elif tag == b"IDAT" and not idat:
            idat = pos
        elif tag == b"eXIf" and exif is None:
            exif = b"Exif\x00\x00" + data[pos + 8 : pos + 8 + length]
    if header is None or not idat:
        return None
    width, height, depth, colour, _compression, _filter, interlace = header
    if interlace or (depth, colour) not in _RAWMODES:
        return None
    if width * depth % 8:
        # Rows end in padding bits that a decoded row does not keep, and the next row's
        # filters add to them (carries included): such a file is decoded whole (1 byte a
        # pixel for these depths).
        return None
    return PngLayout(width, height, depth, colour, b"".join(carried), idat, exif)


def _idat_feed(data: bytes, pos: int) -> Iterator[memoryview]:
    """The compressed image data, in pieces of at most ``_FEED`` bytes (no copies)."""
    view = memoryview(data)
    while pos + 8 <= len(data):
        length, tag = struct.unpack_from(">I4s", data, pos)
        if tag != b"IDAT":
            return
        body = view[pos + 8 : min(len(data), pos + 8 + length)]
        for start in range(0, len(body), _FEED):
            yield body[start : start + _FEED]
        pos += 12 + length


def _stored(parts: list[bytes]) -> list[bytes | memoryview]:
    """``parts`` as the start of a zlib stream of stored (uncompressed) deflate blocks, in
    pieces that are views of ``parts``: no copy (``zlib.compress(raw, 0)`` costs several).

    No final block and no checksum: Pillow's decoder stops at the band's last row, before
    it would look for either, and leaving them out saves an adler32 of every byte."""
    pieces: list[bytes | memoryview] = [b"\x78\x01"]  # zlib header: deflate, 32 KiB window
    for part in parts:
        view = memoryview(part)
        for start in range(0, len(part), _STORED):
            block = view[start : start + _STORED]
            pieces += [struct.pack("<BHH", 0, len(block), len(block) ^ 0xFFFF), block]
    return pieces


def _band_png(layout: PngLayout, parts: list[bytes], rows: int) -> bytes:
    """A PNG of ``rows`` stored rows (filter byte + samples each, in ``parts``), read as
    the file is read: the same header fields, palette and transparency.

    The IDAT chunk's CRC is left 0: Pillow's reader does not check it (PngImagePlugin's
    load_read skips it), and a CRC of every byte would cost a sixth of the decode. Were a
    Pillow to check it, every streamed PNG would fail loudly (tests/data/test_large_images.py),
    never decode to wrong pixels."""
    header = struct.pack(">IIBBBBB", layout.width, rows, layout.depth, layout.colour, 0, 0, 0)
    stream = _stored(parts)
    idat = [struct.pack(">I", sum(len(p) for p in stream)), b"IDAT", *stream, b"\0\0\0\0"]
    return b"".join([_SIGNATURE, *_chunk(b"IHDR", header), layout.carried, *idat, *_END])


def _chunk(tag: bytes, body: bytes) -> list[bytes]:
    crc = zlib.crc32(body, zlib.crc32(tag))
    return [struct.pack(">I", len(body)), tag, body, struct.pack(">I", crc)]


_END = _chunk(b"IEND", b"")


def _inflate(
    inflate: zlib._Decompress, feed: Iterator[memoryview], pending: bytes, need: int
) -> tuple[list[bytes], bytes]:
    """Exactly ``need`` bytes of the inflated stream, and the compressed input left over.
    ValueError when the stream ends first (a truncated or corrupt file)."""
    parts, got, done = [], 0, False
    while got < need:
        if not pending and not done:
            piece = next(feed, None)
            done = piece is None
            pending = piece or b""
        # Called with no input too: zlib may still hold output of a match cut short.
        out = inflate.decompress(pending, min(_PIECE, need - got))
        pending = inflate.unconsumed_tail
        parts.append(out)
        got += len(out)
        if got < need and (inflate.eof or (done and not out)):
            raise ValueError(f"the image data ends early ({got:,} of {need:,} bytes of a band)")
    return parts, pending


def png_bands(data: bytes, layout: PngLayout, rows: int) -> Iterator[tuple[int, Image.Image, int]]:
    """(top, band, skip) for each band of ``rows`` image rows (the last may be shorter):
    image rows ``top..`` are the band's rows from ``skip`` on (row 0 of a band after the
    first is the previous band's last row, its filters' reference). Each band is a
    Pillow image in the file's mode, palette and transparency included.

    Raises ValueError (zlib.error on a corrupt stream) when the data ends early."""
    inflate = zlib.decompressobj()
    feed = _idat_feed(data, layout.idat)
    pending, last = b"", b""
    for top in range(0, layout.height, rows):
        n = min(rows, layout.height - top)
        parts, pending = _inflate(inflate, feed, pending, n * layout.row_bytes)
        # The row above, unfiltered, with filter type 0 (none), is the band's reference.
        png = _band_png(layout, [b"\0" + last if last else b"", *parts], n + bool(last))
        del parts
        with io.BytesIO(png) as fh:  # closed: the band keeps no reference to ``png``
            band = Image.open(fh, formats=("PNG",))
            band.load()
        del png
        h = band.height
        last = band.crop((0, h - 1, layout.width, h)).tobytes("raw", layout.rawmode)
        yield top, band, int(top > 0)
