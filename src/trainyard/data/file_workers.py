"""What a pool worker does to its chunk of an image-file source, one image at a time: read
each file's sha256 and header (pass 1, ``inspect_files``) and decode each into its row of a
memory-mapped array (pass 2, ``decode_files``). ``trainyard.data.image_files`` runs both
passes in its process pool."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from trainyard.core.errors import InputError
from trainyard.core.imaging import image_to_pixels, read_header
from trainyard.data.decode_budget import reserve

# The service's aspect-ratio limit (serve.max_aspect_ratio) guards untrusted uploads; a
# user's own long panorama or receipt is training data (the pad canvas stays bounded).
TRAINING_ASPECT = math.inf
# The user's own images are held to data.max_image_pixels (memory), not the service's limit.
LIMIT_KEY = "data.max_image_pixels"

# sha256, grayscale, width, height, problem, transparent
Inspected = tuple[str, bool, int, int, str | None, bool]


def inspect_files(paths: Sequence[str], max_pixels: int) -> list[Inspected]:
    """(sha256, grayscale, width, height, problem, transparent) per file: pass 1, in a
    worker."""
    out: list[Inspected] = []
    for p in paths:
        try:
            with open(p, "rb") as fh:
                data = fh.read()
        except OSError as err:
            out.append(("", False, 0, 0, f"unreadable ({err.strerror or err})", False))
            continue
        digest = hashlib.sha256(data).hexdigest()
        try:
            header = read_header(
                data,
                max_pixels=max_pixels,
                field="file",
                max_aspect_ratio=TRAINING_ASPECT,
                limit_key=LIMIT_KEY,
            )
        except InputError as err:
            out.append((digest, False, 0, 0, str(err).removeprefix("file: "), False))
            continue
        out.append(
            (digest, header.grayscale, header.width, header.height, None, header.transparent)
        )
    return out


def decode_files(
    array_path: str, slots: Sequence[int], paths: Sequence[str], spec: dict[str, Any]
) -> list[tuple[int, str]]:
    """Decode ``paths`` into rows ``slots`` of the memory-mapped array (``spec``:
    ``decode_spec``): pass 2, in a worker. Returns (slot, problem) for the files that failed."""

    images = np.load(array_path, mmap_mode="r+")
    failed = []
    for slot, p in zip(slots, paths, strict=True):
        try:
            with open(p, "rb") as fh:
                data = fh.read()
            images[slot] = image_to_pixels(
                data, field="file", limit_key=LIMIT_KEY, reserve=reserve, **spec
            )
        except InputError as err:
            failed.append((slot, str(err).removeprefix("file: ")))
        except OSError as err:
            failed.append((slot, f"unreadable ({err.strerror or err})"))
    images.flush()
    del images
    return failed
