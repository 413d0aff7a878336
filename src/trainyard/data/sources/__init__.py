"""Data sources: one module per kind of input, each producing the prepared format + card.

- ``fashion_mnist`` (+ ``fashion_fetch``): the embedded default, four IDX files;
- ``folder``: any class-per-subfolder tree of images.

Adding a source: a module here with a ``prepare_<name>`` function, and one line in
``SOURCES``. Nothing downstream changes: train, export, evaluate and the service read only
the prepared arrays and the dataset card (``trainyard.core.card``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from trainyard.core.card import Card
from trainyard.data.sources.fashion_mnist import prepare_fashion_mnist
from trainyard.data.sources.folder import prepare_folder

if TYPE_CHECKING:  # pydantic stays out of the light paths (benchmarks, gpu-check)
    from trainyard.core.config import DataParams

# data.source -> its prepare function (raw_dir, out_dir, params, seed, max_image_pixels).
# Fashion-MNIST's images are 28x28 whatever data.image_size / data.max_image_pixels say.
SOURCES: dict[str, Callable[..., Card]] = {
    "fashion-mnist": lambda raw, out, params, seed, _pixels: prepare_fashion_mnist(
        raw, out, params, seed
    ),
    "folder": lambda _raw, out, params, seed, pixels: prepare_folder(params, out, seed, pixels),
}


def prepare_source(
    raw_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    params: DataParams,
    seed: int,
    max_image_pixels: int | None = None,
) -> Card:
    """Prepare ``params.source`` into ``out_dir`` (written atomically); return its card.

    ``max_image_pixels``: the folder source's pixel limit, None for data.max_image_pixels.
    """
    return SOURCES[params.source](raw_dir, out_dir, params, seed, max_image_pixels)
