"""Data sources: one module per kind of input, each producing the prepared format + card.

- ``fashion_mnist`` (+ ``fashion_fetch``): the embedded default, four IDX files;
- ``folder``: any class-per-subfolder tree of images;
- ``csv_list``: a CSV of image paths or URLs and labels (and optionally splits).

Adding a source: a module here with a ``prepare_<name>`` function (for a source of image
files, a ``<name>_images`` context manager listing them as a
``trainyard.data.image_files.ImageSet``: ``prepare_image_set`` does the rest), a
``describe_<name>`` function (what prepare will write, for ``trainyard doctor``), a
``fingerprint_<name>`` function (a cheap, stat-only summary of its input files:
``source_fingerprint``, which prepare logs and ``trainyard tune`` keys its
prepared-data cache on) and one line in ``SOURCES``. Nothing downstream changes: train,
export, evaluate and the service read only the prepared arrays and the dataset card
(``trainyard.core.card``).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainyard.core.card import Card
from trainyard.data.image_files import ImageSet, prepare_image_set
from trainyard.data.prepared_writer import Expected
from trainyard.data.sources.csv_list import csv_images, describe_csv, fingerprint_csv
from trainyard.data.sources.fashion_fetch import fingerprint_fashion_mnist
from trainyard.data.sources.fashion_mnist import describe_fashion_mnist, prepare_fashion_mnist
from trainyard.data.sources.folder import describe_folder, fingerprint_folder, folder_images

if TYPE_CHECKING:  # pydantic stays out of the light paths (benchmarks, gpu-check)
    from trainyard.core.config import DataParams


@dataclass(frozen=True)
class Source:
    """One ``data.source``: how prepare writes it, and what it will write (the doctor)."""

    # (raw_dir, out_dir, params, seed, max_image_pixels, for_pretrained) -> the card
    prepare: Callable[..., Card]
    # (params, repository root) -> the expected size; DataError for an unusable source
    describe: Callable[..., Expected]
    # (params, repository root) -> what its input files are (JSON-able, with "files": how
    # many it covers), from stat and small reads only (never decodes an image), never
    # raising for a missing input: the missing input counts by its name and why
    fingerprint: Callable[[DataParams, Path], dict[str, Any]]


def _image_files(
    images: Callable[[DataParams], AbstractContextManager[ImageSet]],
) -> Callable[..., Card]:
    """The ``prepare`` of a source of image files that ``images`` lists."""

    def prepare(_raw: Any, out: Any, params: DataParams, seed: int, pixels: Any, pre: bool) -> Card:
        with images(params) as found:
            return prepare_image_set(found, params, out, seed, pixels, pre)

    return prepare


# Fashion-MNIST's images are 28x28 whatever data.image_size / data.max_image_pixels say.
SOURCES: dict[str, Source] = {
    "fashion-mnist": Source(
        lambda raw, out, params, seed, _pixels, _pre: prepare_fashion_mnist(raw, out, params, seed),
        describe_fashion_mnist,
        fingerprint_fashion_mnist,
    ),
    "folder": Source(
        _image_files(folder_images),
        describe_folder,
        fingerprint_folder,
    ),
    "csv": Source(
        _image_files(csv_images),
        describe_csv,
        fingerprint_csv,
    ),
}


def prepare_source(
    raw_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    params: DataParams,
    seed: int,
    max_image_pixels: int | None = None,
    for_pretrained: bool = False,
) -> Card:
    """Prepare ``params.source`` into ``out_dir`` (written atomically); return its card.

    ``max_image_pixels``: an image source's pixel limit, None for data.max_image_pixels.
    ``for_pretrained``: the recipe may fine-tune ImageNet weights (``pretrained_intent``):
    ``data.image_size: auto`` then sizes images for them (``auto_image_size``).
    """
    source = SOURCES[params.source]
    return source.prepare(raw_dir, out_dir, params, seed, max_image_pixels, for_pretrained)


def describe_source(params: DataParams, root: Path) -> Expected:
    """What prepare will write for ``params.source`` (its paths relative to ``root``),
    before it runs; a DataError when the source is unusable (a missing folder or CSV)."""
    return SOURCES[params.source].describe(params, root)


@dataclass(frozen=True)
class SourceFingerprint:
    """``source_fingerprint`` with how many files (and URLs) it covers (prepare's log)."""

    digest: str  # sha256 hex
    files: int


def fingerprint_source(params: DataParams, root: Path) -> SourceFingerprint:
    """``source_fingerprint`` and the number of files it covers."""
    inputs = SOURCES[params.source].fingerprint(params, root)
    blob = json.dumps({"source": params.source, "inputs": inputs}, sort_keys=True)
    return SourceFingerprint(hashlib.sha256(blob.encode()).hexdigest(), int(inputs["files"]))


def source_fingerprint(params: DataParams, root: Path) -> str:
    """A sha256 hex of ``params.source``'s input files as they are now (relative paths in
    ``params`` are relative to ``root``, as the stages read them from the repository root):
    a folder's files, a CSV's own bytes and the images it lists, Fashion-MNIST's four .gz
    files (or its mirrors). Stat-based (``trainyard.data.fingerprint``): an edited, added,
    removed or touched file changes it; it is for one machine (a clone has new mtimes), so
    it stays out of the dataset card. The data params themselves are not in it."""
    return fingerprint_source(params, root).digest
