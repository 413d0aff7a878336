"""Data sources: one module per kind of input, each producing the prepared format + card.

- ``fashion_mnist`` (+ ``fashion_fetch``): the embedded default, four IDX files;
- ``folder``: any class-per-subfolder tree of images;
- ``csv_list``: a CSV of image paths or URLs and labels (and optionally splits).

Adding a source: a module here with a ``prepare_<name>`` function (an image-file source
lists its files as a ``trainyard.data.image_files.ImageSet`` and hands it to
``prepare_image_set``) and a ``describe_<name>`` function (what prepare will write, for
``trainyard doctor``), and one line in ``SOURCES``. Nothing downstream changes: train,
export, evaluate and the service read only the prepared arrays and the dataset card
(``trainyard.core.card``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from trainyard.core.card import Card
from trainyard.data.sources.csv_list import describe_csv, prepare_csv
from trainyard.data.sources.fashion_mnist import describe_fashion_mnist, prepare_fashion_mnist
from trainyard.data.sources.folder import describe_folder, prepare_folder
from trainyard.data.store import Expected

if TYPE_CHECKING:  # pydantic stays out of the light paths (benchmarks, gpu-check)
    from trainyard.core.config import DataParams


@dataclass(frozen=True)
class Source:
    """One ``data.source``: how prepare writes it, and what it will write (the doctor)."""

    # (raw_dir, out_dir, params, seed, max_image_pixels, for_pretrained) -> the card
    prepare: Callable[..., Card]
    # (params, repository root) -> the expected size; DataError for an unusable source
    describe: Callable[..., Expected]


# Fashion-MNIST's images are 28x28 whatever data.image_size / data.max_image_pixels say.
SOURCES: dict[str, Source] = {
    "fashion-mnist": Source(
        lambda raw, out, params, seed, _pixels, _pre: prepare_fashion_mnist(raw, out, params, seed),
        describe_fashion_mnist,
    ),
    "folder": Source(
        lambda _raw, out, params, seed, pixels, pre: prepare_folder(params, out, seed, pixels, pre),
        describe_folder,
    ),
    "csv": Source(
        lambda _raw, out, params, seed, pixels, pre: prepare_csv(params, out, seed, pixels, pre),
        describe_csv,
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
