"""Embeddings kept on disk, keyed by each file's content (sha256) and the model that made
them: the second ``trainyard audit`` of a folder decodes and embeds only the files that are
new or changed, so it costs seconds (docs/audit.md#the-cache).

``<root>/<model key>/`` holds ``vectors.npy`` (float32 ``[N, D]``) and ``hashes.txt`` (row
i's sha256 on line i), each replaced atomically and the hashes last: a run interrupted
between the two leaves rows without a hash, which are never read.
"""

from __future__ import annotations

import io
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from trainyard.core.io import atomic_write_bytes, atomic_write_text


class EmbeddingCache:
    """sha256 -> vector for one model ``key``; ``add`` then ``save`` to keep new ones."""

    def __init__(self, root: Path, key: str, dim: int) -> None:
        self.folder = Path(root) / re.sub(r"[^\w.-]+", "-", key)
        self.dim = dim
        self.rows: dict[str, int] = {}
        self.vectors = np.empty((0, dim), np.float32)
        self._new: list[np.ndarray] = []
        hashes = self.folder / "hashes.txt"
        if hashes.is_file():
            names = hashes.read_text().split()
            vectors = np.load(self.folder / "vectors.npy")
            if vectors.ndim == 2 and vectors.shape[1] == dim and len(vectors) >= len(names):
                self.vectors = vectors[: len(names)]
                self.rows = {h: i for i, h in enumerate(names)}

    def __contains__(self, sha256: str) -> bool:
        return sha256 in self.rows

    def add(self, hashes: Sequence[str], vectors: np.ndarray) -> None:
        """Keep ``vectors`` (one row per hash; a hash already kept, or twice, once) in
        memory until ``save``."""
        fresh = []
        for i, h in enumerate(hashes):
            if h not in self.rows:
                self.rows[h] = len(self.rows)
                fresh.append(i)
        self._new.append(np.asarray(vectors, np.float32)[fresh].reshape(-1, self.dim))

    def get(self, hashes: Sequence[str]) -> np.ndarray:
        """float32 ``[len(hashes), D]``; every hash must be in the cache."""
        self._merge()
        return self.vectors[[self.rows[h] for h in hashes]]

    def save(self) -> None:
        """Write the vectors, then the hashes that name their rows (atomically, in order)."""
        self._merge()
        buf = io.BytesIO()
        np.save(buf, self.vectors)
        atomic_write_bytes(self.folder / "vectors.npy", buf.getvalue())
        names = sorted(self.rows, key=self.rows.__getitem__)
        atomic_write_text(self.folder / "hashes.txt", "\n".join(names) + "\n")

    def _merge(self) -> None:
        if self._new:
            self.vectors = np.concatenate([self.vectors, *self._new])
            self._new = []
