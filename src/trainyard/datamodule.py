"""Lightning DataModule over the prepared uint8 arrays, fed as whole in-memory batches.

Why not a per-sample Dataset: on 28x28 images, per-sample ``__getitem__`` + collate costs
more than the forward pass, which is the classic reason GPU utilisation sits low. Here the
whole split is one uint8 tensor; each batch is one index gather. Normalisation and
augmentation run later on whole batches, on the training device (see models.Classifier).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from trainyard.errors import DataError
from trainyard.prepare import SPLITS, STATS_FILE


def epoch_order(
    n: int,
    shuffle: bool,
    seed: int,
    epoch: int,
    rank: int = 0,
    world_size: int = 1,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Sample order for one epoch: a ``seed + epoch`` permutation, this rank's equal share.

    Both data paths use it, so they visit the same samples in the same order.
    """
    if shuffle:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
    else:
        order = torch.arange(n)
    per_rank = n // world_size
    return order[rank::world_size][:per_rank].to(device)


class TensorBatches(IterableDataset):
    """Yields (uint8 images [B,1,H,W], int64 labels [B]) batches by index from memory.

    The fast path: one gather per batch, no per-sample Python. Every epoch is a fresh,
    reproducible permutation in which every sample appears exactly once; with
    ``world_size > 1`` (DDP) each rank takes a disjoint, equal-length share. The tensors
    may live on the GPU, and then batches never cross the bus at all.
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

    def __len__(self) -> int:
        n = self.labels.shape[0] // self.world_size
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        idx = epoch_order(
            self.labels.shape[0],
            self.shuffle,
            self.seed,
            self.epoch,
            self.rank,
            self.world_size,
            self.images.device,
        )
        self.epoch += 1
        stop = len(idx) - len(idx) % self.batch_size if self.drop_last else len(idx)
        for start in range(0, stop, self.batch_size):
            sel = idx[start : start + self.batch_size]
            yield self.images[sel], self.labels[sel]


class PerSampleDataset(Dataset):
    """The textbook path, kept for comparison: one ``__getitem__`` per image + collate."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i], self.labels[i]


class EpochSampler(Sampler[int]):
    """Per-sample indices in ``epoch_order``: the naive path visits what the fast one does."""

    def __init__(self, n: int, shuffle: bool, seed: int, rank: int = 0, world_size: int = 1):
        self.n, self.shuffle, self.seed = n, shuffle, seed
        self.rank, self.world_size, self.epoch = rank, world_size, 0

    def __len__(self) -> int:
        return self.n // self.world_size

    def __iter__(self) -> Iterator[int]:
        order = epoch_order(self.n, self.shuffle, self.seed, self.epoch, self.rank, self.world_size)
        self.epoch += 1
        return iter(order.tolist())


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


DataPath = Literal["fast", "naive"]
Splits = dict[str, tuple[np.ndarray, np.ndarray]]


class FashionDataModule(L.LightningDataModule):
    """Train/val/test splits from ``data/prepared`` (or arrays), served by either data path.

    ``data_path="fast"``: whole-batch gathers from one tensor (TensorBatches);
    ``"naive"``: per-sample Dataset + DataLoader, for comparison.
    ``device_resident``: on a GPU, the uint8 splits are copied to the device once
    (Fashion-MNIST is 55 MB) so no batch ever waits on a host-to-device copy.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        batch_size: int = 256,
        eval_batch_size: int = 1024,
        seed: int = 0,
        data_path: DataPath = "fast",
        device_resident: bool = True,
        arrays: Splits | None = None,
        stats: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if (data_dir is None) == (arrays is None):
            raise ValueError("give exactly one of data_dir or arrays")
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self.batch_size, self.eval_batch_size, self.seed = batch_size, eval_batch_size, seed
        self.data_path, self.device_resident = data_path, device_resident
        self.stats = stats if stats is not None else load_stats(self.data_dir)
        self._arrays: Splits = dict(arrays) if arrays is not None else {}
        self.tensors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def mean(self) -> float:
        return float(self.stats["pixel_mean"])

    @property
    def std(self) -> float:
        return float(self.stats["pixel_std"])

    def split_arrays(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        """(uint8 images [N,H,W], uint8 labels [N]) of ``split``, read from disk once."""
        if split not in self._arrays:
            self._arrays[split] = load_split(self.data_dir, split)
        return self._arrays[split]

    def _device(self) -> torch.device:
        trainer = self.trainer
        if trainer is None or not self.device_resident or self.data_path != "fast":
            return torch.device("cpu")
        return trainer.strategy.root_device

    def setup(self, stage: str | None = None) -> None:
        device = self._device()
        for split in SPLITS:
            if split in self.tensors:
                continue
            images, labels = self.split_arrays(split)
            # [N,H,W] uint8 -> [N,1,H,W]; stays uint8 (4x smaller than float) until the
            # batch is on the device.
            self.tensors[split] = (
                torch.from_numpy(np.ascontiguousarray(images)).unsqueeze(1).to(device),
                torch.from_numpy(labels.astype(np.int64)).to(device),
            )

    def _rank_world(self) -> tuple[int, int]:
        trainer = self.trainer
        if trainer is None:
            return 0, 1
        return trainer.global_rank, trainer.world_size

    def _loader(self, split: str, batch_size: int, shuffle: bool) -> DataLoader:
        images, labels = self.tensors[split]
        rank, world = self._rank_world()
        pin = torch.cuda.is_available() and images.device.type == "cpu"
        if self.data_path == "naive":
            sampler = EpochSampler(len(labels), shuffle, self.seed, rank, world)
            return DataLoader(
                PerSampleDataset(images, labels),
                batch_size=batch_size,
                sampler=sampler,
                num_workers=0,
                pin_memory=pin,
            )
        ds = TensorBatches(
            images, labels, batch_size, shuffle=shuffle, seed=self.seed, rank=rank, world_size=world
        )
        # batch_size=None: the dataset already yields batches.
        return DataLoader(ds, batch_size=None, pin_memory=pin)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", self.eval_batch_size, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", self.eval_batch_size, shuffle=False)
