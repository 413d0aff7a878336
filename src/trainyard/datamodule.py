"""Lightning DataModule over the prepared uint8 arrays, fed as whole in-memory batches.

Why not a per-sample Dataset: on 28x28 images, per-sample ``__getitem__`` + collate costs
more than the forward pass, which is the classic reason GPU utilisation sits low. Here the
whole split is one uint8 tensor; each batch is one index gather. Normalisation and
augmentation run later on whole batches, on the training device (see models.Classifier).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from trainyard.errors import DataError
from trainyard.prepare import SPLITS, STATS_FILE


class TensorBatches(IterableDataset):
    """Yields (uint8 images [B,1,H,W], int64 labels [B]) batches by index from memory.

    Shuffling uses ``seed + epoch`` so every epoch is a fresh, reproducible permutation and
    every sample appears exactly once per epoch. With ``world_size > 1`` (DDP) each rank
    takes a disjoint, equal-length stride of the permutation.
    """

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        batch_size: int,
        shuffle: bool,
        seed: int = 0,
        drop_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if images.shape[0] != labels.shape[0]:
            raise ValueError("images and labels differ in length")
        self.images, self.labels = images, labels
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed
        self.drop_last, self.rank, self.world_size = drop_last, rank, world_size
        self.epoch = 0

    def _indices(self) -> torch.Tensor:
        n = self.labels.shape[0]
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=g)
        else:
            order = torch.arange(n)
        per_rank = n // self.world_size if self.world_size > 1 else n
        return order[self.rank :: self.world_size][:per_rank]

    def __len__(self) -> int:
        n = self.labels.shape[0] // self.world_size if self.world_size > 1 else self.labels.shape[0]
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self):  # type: ignore[override]
        idx = self._indices()
        self.epoch += 1
        stop = len(idx) - len(idx) % self.batch_size if self.drop_last else len(idx)
        for start in range(0, stop, self.batch_size):
            sel = idx[start : start + self.batch_size]
            yield self.images[sel], self.labels[sel]


def load_split(data_dir: str | os.PathLike[str], split: str) -> tuple[np.ndarray, np.ndarray]:
    data_dir = Path(data_dir)
    out = []
    for kind in ("images", "labels"):
        path = data_dir / f"{split}_{kind}.npy"
        if not path.is_file():
            raise DataError(f"{path}: missing; run `dvc repro prepare` first")
        arr = np.load(path, allow_pickle=False)
        if arr.dtype != np.uint8:
            raise DataError(f"{path}: expected uint8, got {arr.dtype}")
        out.append(arr)
    return out[0], out[1]


def load_stats(data_dir: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(data_dir) / STATS_FILE
    if not path.is_file():
        raise DataError(f"{path}: missing; run `dvc repro prepare` first")
    return json.loads(path.read_text())


class FashionDataModule(L.LightningDataModule):
    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        batch_size: int = 256,
        eval_batch_size: int = 1024,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.data_dir = Path(data_dir)
        self.batch_size, self.eval_batch_size, self.seed = batch_size, eval_batch_size, seed
        self.stats = load_stats(self.data_dir)
        self.tensors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def mean(self) -> float:
        return float(self.stats["pixel_mean"])

    @property
    def std(self) -> float:
        return float(self.stats["pixel_std"])

    def setup(self, stage: str | None = None) -> None:
        for split in SPLITS:
            if split not in self.tensors:
                images, labels = load_split(self.data_dir, split)
                # [N,H,W] uint8 -> [N,1,H,W]; stays uint8 (4x smaller than float) until the
                # batch reaches the device.
                self.tensors[split] = (
                    torch.from_numpy(images).unsqueeze(1).contiguous(),
                    torch.from_numpy(labels.astype(np.int64)),
                )

    def _rank_world(self) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return 0, 1
        return trainer.global_rank, trainer.world_size

    def _loader(self, split: str, batch_size: int, shuffle: bool) -> DataLoader:
        images, labels = self.tensors[split]
        rank, world = self._rank_world()
        ds = TensorBatches(
            images,
            labels,
            batch_size,
            shuffle=shuffle,
            seed=self.seed,
            drop_last=False,
            rank=rank,
            world_size=world,
        )
        # batch_size=None: the dataset already yields batches; pin memory for async H2D copy.
        return DataLoader(ds, batch_size=None, pin_memory=torch.cuda.is_available())

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", self.eval_batch_size, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", self.eval_batch_size, shuffle=False)
