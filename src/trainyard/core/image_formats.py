"""Which image files trainyard reads: the formats Pillow may open, the extensions a folder
source lists, and the optional plugin packages some formats need.

Optional format plugins (pillow-heif for HEIC/HEIF) are imported the first time a file
needs one, so trainyard runs where they are not installed (a bare GPU machine); such a
file is then refused with a 415 that names the package to install
(``trainyard.core.imaging``).
"""

from __future__ import annotations

from collections.abc import Callable

from PIL import Image

# What Pillow may open. Multi-picture JPEGs from phone cameras open through "JPEG" and then
# call themselves "MPO" (naming MPO here raises KeyError inside Pillow).
IMAGE_FORMATS = ("PNG", "JPEG", "BMP", "GIF", "WEBP", "TIFF", "HEIF", "AVIF")
# File extensions a folder source reads (any case); ``data.walk`` says what the others become.
IMAGE_EXTENSIONS = frozenset(
    {".jpg", ".jpeg", ".jfif", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".mpo"}
    | {".heic", ".heif", ".hif", ".avif"}
)
# ISO-BMFF brands (the ``ftyp`` box) that mark a file as HEIF or AVIF, the phone formats;
# mif1/msf1 are generic HEIF, which pillow-heif reads too.
HEIF_BRANDS = frozenset(
    {b"heic", b"heix", b"heim", b"heis", b"hevc", b"hevx", b"hevm", b"hevs", b"mif1", b"msf1"}
)
AVIF_BRANDS = frozenset({b"avif", b"avis"})
# What a file in a format Pillow cannot read here needs, said to the user (a 415: the
# format is valid, this installation cannot read it).
MISSING_FORMAT = {
    "HEIF": "HEIC/HEIF images need the pillow-heif package, which is not installed here "
    "(pip install pillow-heif)",
    "AVIF": "AVIF images need Pillow >= 11.3 built with AVIF support, which this Pillow is "
    "not (pip install -U pillow)",
}


def _register_heif() -> None:
    # Imported here, not at the top: only HEIC/HEIF files need pillow-heif, and a bare GPU
    # machine's image (make gpu-check) has none. No thumbnails: only the primary image.
    import pillow_heif

    pillow_heif.register_heif_opener(thumbnails=False)


# Formats Pillow reads through a separate plugin package: registered the first time a file
# needs one (AVIF is Pillow's own, >= 11.3).
_PLUGINS: dict[str, Callable[[], None]] = {"HEIF": _register_heif}


def ensure_format(fmt: str) -> bool:
    """Whether Pillow can read ``fmt`` (one of ``IMAGE_FORMATS``) here, registering its
    plugin package the first time one is needed (HEIF: pillow-heif, which also writes
    HEIC: call this before saving one). False when the plugin is not installed."""
    Image.init()  # every plugin Pillow has; a no-op after the first call
    if fmt in Image.OPEN:
        return True
    register = _PLUGINS.get(fmt)
    if register is None:
        return False
    try:
        register()  # a missing package is retried per file: cheap next to a decode
    except ImportError:
        return False
    return fmt in Image.OPEN


def container_format(data: bytes) -> str | None:
    """HEIF or AVIF by the ISO-BMFF ``ftyp`` box (major and compatible brands), else None:
    the formats whose reader may be missing, told apart before Pillow is asked."""
    if data[4:8] != b"ftyp":
        return None
    end = min(int.from_bytes(data[:4], "big"), len(data), 256)
    brands = {data[8:12]} | {data[i : i + 4] for i in range(16, end - 3, 4)}
    if brands & AVIF_BRANDS:
        return "AVIF"
    return "HEIF" if brands & HEIF_BRANDS else None
