"""Facts about the data: free disk for the data and the DVC cache, and the configured
dataset's size (its card once prepared, else what the source says prepare will make of it:
``trainyard.data.sources.describe_source``, so a new source needs nothing here)."""

from __future__ import annotations

import configparser
import os
import shutil
from pathlib import Path
from typing import Any

from trainyard.core.card import CARD_FILE, SPLITS, Card, load_card
from trainyard.core.config import Params
from trainyard.core.errors import TrainyardError
from trainyard.data.sources import describe_source

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


def expected_dataset(params: Params, root: Path) -> dict[str, Any]:
    """The configured source's size before prepare, as the source itself describes it
    (``trainyard.data.sources.describe_source``): a missing folder or CSV raises its
    DataError, which the doctor shows as a broken dataset."""
    expected = describe_source(params.data, root)
    c, h, w = expected.shape
    return _dataset(params.data.source, "expected", c, h, w, expected.counts, expected.note)


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
            mismatch = _card_mismatch(card, counts, params, root)
            if not mismatch:
                note = f"prepared: {data_dir / CARD_FILE}"
                return _dataset(
                    card.source, "card", card.channels, card.height, card.width, counts, note
                )
            stale = f"the prepared card does not match params ({mismatch}); `dvc repro` redoes it; "
    expected = expected_dataset(params, root)
    expected["note"] = stale + expected["note"]
    expected["stale_card"] = bool(stale)
    return expected


def _card_mismatch(card: Card, counts: dict[str, int], params: Params, root: Path) -> str:
    """Why the prepared card is not what params would prepare now; "" when it is. Only
    what the source says prepare decides from params is compared (an ``auto`` size or a
    folder's image count may be anything)."""
    data = params.data
    if card.source != data.source:
        return f"card source {card.source}, data.source {data.source}"
    try:
        expected = describe_source(data, root)
    except TrainyardError:
        return ""  # the source is gone (a moved folder): the prepared data is what there is
    c, h, w = expected.shape
    if expected.size_known and (card.height, card.width) != (h, w):
        return f"card {card.height}x{card.width}, data.image_size {(h, w)}"
    if expected.channels_known and card.channels != c:
        return f"card {card.channels} channel(s), data.channels {c}"
    want = expected.counts
    if expected.counts_known and (
        counts["train"] + counts["val"] != want["train"] + want["val"]
        or counts["val"] != want["val"]
    ):
        return (
            f"card train+val {counts['train'] + counts['val']:,} (val {counts['val']:,}), "
            f"params {want['train'] + want['val']:,} (val {want['val']:,})"
        )
    return ""
