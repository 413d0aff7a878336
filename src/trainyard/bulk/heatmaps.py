"""``trainyard predict --explain``: the top label's heatmap of every scored image, a PNG
the size of the image (as shown), in a folder beside the table.

``scores.parquet`` -> ``scores.heatmaps/0000042.png`` for the source's row 42 (its place in
the source's order, the same in every shard and every rerun: two files of one name in two
folders never collide). The table's ``heatmap`` column holds that path relative to the
table's folder; a row with no prediction has none. Written where the row is scored (a
decode worker on a CPU, this process on a GPU or inline), before its chunk: a chunk on
disk has all its heatmaps, and a rerun that scores a chunk again writes them again.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from trainyard.core.card import Card
from trainyard.core.errors import DataError, ModelError
from trainyard.core.io import atomic_file
from trainyard.runtime.explain import heatmap_png
from trainyard.runtime.sessions import OnnxModel
from trainyard.runtime.upload_frame import upload_heatmap


def heatmap_folder(out: Path) -> Path:
    """Where ``--explain`` writes a table's heatmaps: ``<out without suffix>.heatmaps``."""
    return out.with_name(out.stem + ".heatmaps")


def heatmap_name(row: int) -> str:
    """The file of the source's row ``row`` in the heatmap folder."""
    return f"{row:07d}.png"


def check_explains(model: OnnxModel, path: Path) -> None:
    """Refuse ``--explain`` for a model exported without its ``cam`` output."""
    if not model.has_cam:
        raise ModelError(
            f"--explain: {path} was exported without its class activation map output 'cam' "
            "(no 'explain' in its ONNX metadata), so it cannot show what its answers looked "
            "at; re-export it with this trainyard (dvc repro export), or score without --explain"
        )


def fresh_folder(folder: Path) -> None:
    """An empty heatmap folder for a job that starts over (none of an older job's files)."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)


def write_heatmaps(
    folder: str,
    rows: Sequence[int] | np.ndarray,
    top1: np.ndarray,
    cam: np.ndarray,
    sizes: np.ndarray,
    card: Card,
) -> None:
    """The PNG of each scored image: ``rows`` (the source's), ``top1`` (its class),
    ``cam`` [n,classes,h,w] (the model's output), ``sizes`` [n,2] (width, height shown)."""
    for i, row in enumerate(rows):
        shown = {"width": int(sizes[i, 0]), "height": int(sizes[i, 1])}
        png = heatmap_png(upload_heatmap(cam[i, int(top1[i])], card, shown))
        target = Path(folder) / heatmap_name(int(row))
        try:
            with atomic_file(target) as tmp:
                tmp.write_bytes(png)
        except OSError as err:
            raise DataError(
                f"cannot write {target} ({err.strerror or err}); the chunks written so far "
                "are kept: free space and rerun the same command to continue"
            ) from None
