"""Facts about the data: free disk for the data and the DVC cache, and the configured
dataset's size (its card once prepared, else what prepare will make of it)."""

from __future__ import annotations

import configparser
import os
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

from trainyard.core.card import CARD_FILE, SPLITS, load_card
from trainyard.core.config import DataParams, Params
from trainyard.core.errors import TrainyardError
from trainyard.data.sources import fashion_mnist
from trainyard.data.sources.folder import AUTO_SIZE_MAX
from trainyard.data.walk import scan_folder

# ----------------------------------------------------------------------------- disk


def _shown(path: Path) -> str:
    """``path`` relative to the working directory when it is under it."""
    try:
        return str(path.absolute().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def dvc_cache_dir(root: Path) -> Path | None:
    """The DVC cache of the repository at ``root`` (``[cache] dir`` in .dvc/config or
    config.local, relative to .dvc/), read without importing dvc; None: not a DVC repo."""
    dvc_dir = root / ".dvc"
    if not dvc_dir.is_dir():
        return None
    cache = dvc_dir / "cache"
    for name in ("config", "config.local"):
        parser = configparser.ConfigParser()
        try:
            parser.read(dvc_dir / name)
        except configparser.Error:
            continue
        if parser.has_option("cache", "dir"):
            cache = dvc_dir / parser.get("cache", "dir").strip("'\"")
    return Path(os.path.normpath(cache))


def collect_disk(root: Path, data_dir: Path) -> list[dict[str, Any]]:
    """Free space on the filesystems holding the data and the DVC cache."""
    places = [("data", data_dir)]
    cache = dvc_cache_dir(root)
    if cache is not None:
        places.append(("dvc cache", cache))
    out = []
    for what, path in places:
        checked = _existing(path)
        usage = shutil.disk_usage(checked)
        out.append(
            {
                "what": what,
                "path": _shown(path),
                "checked": str(checked),
                "free_bytes": int(usage.free),
                "total_bytes": int(usage.total),
                "filesystem": os.stat(checked).st_dev,
            }
        )
    return out


# ----------------------------------------------------------------------------- dataset


def _split_sizes(counts: dict[str, int], c: int, h: int, w: int) -> dict[str, dict[str, int]]:
    return {s: {"images": int(n), "bytes": int(n) * c * h * w} for s, n in counts.items()}


def _dataset(
    source: str, origin: str, c: int, h: int, w: int, counts: dict[str, int], note: str
) -> dict[str, Any]:
    """The dataset facts: shape, images and bytes per split, what training places."""
    splits = _split_sizes({s: counts.get(s, 0) for s in SPLITS}, c, h, w)
    return {
        "source": source,
        "from": origin,
        "channels": c,
        "height": h,
        "width": w,
        "splits": splits,
        # What training places (train + val); test is read in batches by evaluate.
        "placed_bytes": splits["train"]["bytes"] + splits["val"]["bytes"],
        "total_bytes": sum(s["bytes"] for s in splits.values()),
        "note": note,
    }


def expected_fashion(params: Params) -> dict[str, Any]:
    """Fashion-MNIST's size before prepare: the 60,000-image train file (or data.limit)
    less data.val_size for train, data.val_size for val, the 10,000-image test file."""
    raw, size = fashion_mnist.RAW_BY_NAME, fashion_mnist.IMAGE_SIZE
    pool = params.data.limit or raw["train-images-idx3-ubyte.gz"].count
    test = raw["t10k-images-idx3-ubyte.gz"].count
    val = params.data.val_size
    counts = {"train": pool - val, "val": val, "test": test}
    note = (
        f"expected: {pool:,} train-file images ({pool - val:,} train + {val:,} val, "
        f"data.val_size) and {test:,} test, 1x{size}x{size}; nothing prepared yet"
    )
    return _dataset(fashion_mnist.SOURCE, "expected", 1, size, size, counts, note)


def _folder_counts(folder: Path, data: DataParams) -> tuple[dict[str, int], str]:
    """Images per split and the layout's name, as prepare finds them (``data.walk``: the
    same layout, litter and extensions; a tree prepare refuses raises its DataError). Val
    and test the layout lacks are estimated as fractions of train."""
    scan = scan_folder(folder)
    found = Counter(e.split for e in scan.entries)
    if scan.layout == "splits":
        counts = {s: found.get(s, 0) for s in SPLITS}
        layout = "train/val/test folders"
        if "val" not in found:
            counts["val"] = round(counts["train"] * data.val_fraction)
            counts["train"] -= counts["val"]
        if "test" not in found:
            counts["test"] = round(counts["train"] * data.test_fraction)
            counts["train"] -= counts["test"]
    else:
        total = len(scan.entries)
        layout = "class folders"
        val, test = round(total * data.val_fraction), round(total * data.test_fraction)
        counts = {"train": total - val - test, "val": val, "test": test}
    return counts, layout


def expected_folder(params: Params, root: Path) -> dict[str, Any]:
    """A folder source's size before prepare: its image files counted, times C*H*W of
    data.image_size (channels ``auto`` counted as 3, image_size ``auto`` as its largest
    choice: the larger cases)."""
    data = params.data
    folder = Path(data.folder or "").expanduser()
    if not folder.is_absolute():
        folder = root / folder
    if not folder.is_dir():
        raise TrainyardError(
            f"data.folder: {folder} is not a folder; set data.folder to your image tree "
            "(photos/<class>/*.jpg)"
        )
    counts, layout = _folder_counts(folder, data)
    c = 3 if data.channels == "auto" else int(data.channels)
    h, w = data.size_hw or (AUTO_SIZE_MAX, AUTO_SIZE_MAX)
    note = (
        f"estimated: {sum(counts.values()):,} image files in {folder} ({layout}) at "
        f"data.image_size {h}x{w}"
        + (" (auto: counted at its largest; prepare picks it)" if data.size_hw is None else "")
        + f", {c} channel(s)"
        + (
            " (channels auto: counted as 3; an all-grayscale folder prepares as 1)"
            if data.channels == "auto"
            else ""
        )
        + "; nothing prepared yet"
    )
    return _dataset("folder", "expected", c, h, w, counts, note)


def collect_dataset(params: Params, root: Path, data_dir: Path) -> dict[str, Any]:
    """The prepared dataset's card when it matches params, else the expected size."""
    stale = ""
    if (data_dir / CARD_FILE).is_file():
        try:
            card = load_card(data_dir)
        except TrainyardError as err:
            stale = f"the prepared card is unusable ({err}); "
        else:
            counts = {s: int(card.counts.get(s, {}).get("total", 0)) for s in SPLITS}
            mismatch = _card_mismatch(card, counts, params)
            if not mismatch:
                note = f"prepared: {data_dir / CARD_FILE}"
                return _dataset(
                    card.source, "card", card.channels, card.height, card.width, counts, note
                )
            stale = f"the prepared card does not match params ({mismatch}); `dvc repro` redoes it; "
    if params.data.source == "folder":
        expected = expected_folder(params, root)
    else:
        expected = expected_fashion(params)
    expected["note"] = stale + expected["note"]
    expected["stale_card"] = bool(stale)
    return expected


def _card_mismatch(card: Any, counts: dict[str, int], params: Params) -> str:
    data = params.data
    if card.source != data.source:
        return f"card source {card.source}, data.source {data.source}"
    if data.source == "folder":
        # image_size auto: any size prepare chose matches
        if data.size_hw is not None and (card.height, card.width) != data.size_hw:
            return f"card {card.height}x{card.width}, data.image_size {data.size_hw}"
        if data.channels != "auto" and card.channels != data.channels:
            return f"card {card.channels} channel(s), data.channels {data.channels}"
        return ""
    expected = expected_fashion(params)["splits"]
    if (
        counts["train"] + counts["val"] != (expected["train"]["images"] + expected["val"]["images"])
        or counts["val"] != expected["val"]["images"]
    ):
        return (
            f"card train+val {counts['train'] + counts['val']:,} (val {counts['val']:,}), "
            f"params {expected['train']['images'] + expected['val']['images']:,} "
            f"(val {expected['val']['images']:,})"
        )
    return ""
