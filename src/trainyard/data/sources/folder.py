"""Image-folder source: a class-per-subfolder tree of images -> the prepared format.

Its two layouts (``photos/<class>/...``, split by prepare; ``photos/{train,val,test}/
<class>/...``, the user's own splits, a missing val or test carved out of train) and what
is passed over, counted or warned about are ``trainyard.data.walk``'s rules, which the
doctor shares. Classes are the subfolder names, sorted as torchvision's ``ImageFolder``
sorts them. What is particular to a folder is only the walk; inspecting, splitting,
decoding, writing and bad files (``data.on_bad_file``) are every image-file source's
(``trainyard.data.image_files``).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainyard.core.errors import DataError
from trainyard.core.image_formats import IMAGE_EXTENSIONS
from trainyard.data.fingerprint import files_fingerprint
from trainyard.data.image_files import ImageSet, expected_image_set
from trainyard.data.prepared_writer import Expected
from trainyard.data.splits import estimated_counts
from trainyard.data.walk import Scan, rel_path, scan_folder, walk_files

if TYPE_CHECKING:
    from trainyard.core.config import DataParams

log = logging.getLogger(__name__)

SOURCE = "folder"
KEY = "data.folder"


@contextmanager
def folder_images(params: DataParams) -> Iterator[ImageSet]:
    """The images of ``params.folder``, for ``prepare_image_set``."""
    assert params.folder is not None  # DataParams guarantees it for source: folder
    root = Path(params.folder).expanduser().resolve()
    scan = scan_folder(root)
    log.info(
        "folder %s: %d images in %d classes (%s layout)",
        root,
        len(scan.entries),
        len(scan.classes),
        scan.layout,
    )
    _log_ignored(scan)
    extra: dict[str, object] = {"layout": scan.layout}
    if scan.unreadable_images:
        extra["unreadable_images"] = dict(sorted(scan.unreadable_images.items()))
    yield ImageSet(
        source=SOURCE,
        key=KEY,
        where=root,
        classes=scan.classes,
        files=scan.entries,
        bad=list(scan.bad),
        ignored=scan.ignored,
        extra=extra,
    )


def describe_folder(params: DataParams, root: Path) -> Expected:
    """What prepare will make of ``params.folder`` (relative to ``root``), before it runs:
    its image files counted, times C*H*W of data.image_size (channels ``auto`` counted as 3,
    image_size ``auto`` as its largest choice: the larger cases). The walk is prepare's own
    (``data.walk``), so a tree prepare refuses raises its DataError here too."""
    folder = folder_path(params, root)
    if not folder.is_dir():
        raise DataError(
            f"{KEY}: {folder} is not a folder; set data.folder to your image tree "
            "(photos/<class>/*.jpg)"
        )
    counts, layout = _folder_counts(folder, params)
    return expected_image_set(
        counts,
        params,
        f"{sum(counts.values()):,} image files in {folder} ({layout})",
        channels_auto="counted as 3; an all-grayscale folder prepares as 1",
    )


def folder_path(params: DataParams, root: Path) -> Path:
    """``data.folder`` as a path; a relative one is relative to ``root``."""
    folder = Path(params.folder or "").expanduser()
    return folder if folder.is_absolute() else root / folder


def fingerprint_folder(params: DataParams, root: Path) -> dict[str, Any]:
    """What ``data.folder`` (relative to ``root``) holds, for ``source_fingerprint``: the
    stat fingerprint of every file under it, named relative to it (the walk is prepare's
    own, ``data.walk.walk_files``: hidden and litter files do not count, other files do),
    and what the walk could not read (a missing folder, a broken symlink)."""
    folder = folder_path(params, root)
    bad: list[tuple[str, str]] = []
    entries = [(rel_path(path, folder), path) for path in walk_files(folder, folder, bad)]
    return {"files": len(entries), "stat": files_fingerprint(entries), "bad": sorted(bad)}


def _folder_counts(folder: Path, data: DataParams) -> tuple[dict[str, int], str]:
    """Images per split and the layout's name, as prepare finds them."""
    scan = scan_folder(folder)
    found = Counter(e.split for e in scan.entries)
    layout = "train/val/test folders" if scan.layout == "splits" else "class folders"
    return estimated_counts(found, data), layout


def _counted(counts: dict[str, int]) -> str:
    """``.txt 3, .json 2``: counts by extension, the most common first."""
    return ", ".join(f"{ext} {k}" for ext, k in sorted(counts.items(), key=lambda t: (-t[1], t[0])))


def _log_ignored(scan: Scan) -> None:
    """INFO for the non-image files passed over; a WARNING for image files trainyard cannot
    read (never silent: they may be a good part of the user's data)."""
    if scan.other_files:
        n = sum(scan.other_files.values())
        log.info("%d other file(s) ignored (not images): %s", n, _counted(scan.other_files))
    if scan.unreadable_images:
        n = sum(scan.unreadable_images.values())
        log.warning(
            "%d image file(s) left out: trainyard cannot read %s; convert them to PNG or "
            "JPEG (e.g. ImageMagick: magick mogrify -format png *.psd; camera raw: export "
            "from your photo app) if they belong in the dataset. Read: %s",
            n,
            _counted(scan.unreadable_images),
            " ".join(sorted(IMAGE_EXTENSIONS)),
        )
