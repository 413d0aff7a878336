"""Lightning DataModule over the prepared uint8 arrays, fed as whole batches.

Why not a per-sample Dataset: on small images, per-sample ``__getitem__`` + collate costs
more than the forward pass, which is the classic reason GPU utilisation sits low. Here each
batch is one index gather from a split. Normalisation and augmentation run later on whole
batches, on the training device (see models.Classifier).

Where a split lives is chosen by size, and logged: on the GPU (device-resident: no batch
ever crosses the bus), whole in RAM, or memory-mapped from disk (batches gathered from the
map, pinned and copied asynchronously on a GPU) when it fits neither budget.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from trainyard.core.card import SPLITS, Card, load_card
from trainyard.data.arrays import load_split
from trainyard.training.placement import Placement, choose_placement

log = logging.getLogger(__name__)


DataPath = Literal["fast", "naive"]


def epoch_order(
    n: int,
    shuffle: bool,
    seed: int,
    epoch: int,
    rank: int = 0,
    world_size: int = 1,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Sample order for one epoch: a ``seed + epoch`` permutation, this rank's equal share,
    on ``device`` (the data's: every batch's index is then a slice of it, already there).

    Drawn on the host, so both data paths, and a CPU and a GPU run, visit the same samples
    in the same order; it crosses to the device once an epoch (``host_to_device``).
    """
    if shuffle:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
    else:
        order = torch.arange(n)
    per_rank = n // world_size
    return host_to_device(order[rank::world_size][:per_rank], device)


def host_to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on ``device`` without waiting for it: to a GPU, pinned and queued on
    the stream (a copy from pageable memory makes the host wait until the GPU has run
    everything queued before it: a synchronisation); elsewhere a plain ``to``."""
    device = torch.device(device)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


class TensorBatches(IterableDataset):
    """Yields (uint8 images [B,C,H,W], int64 labels [B]) batches by index.

    The fast path: one gather per batch, no per-sample Python. Every epoch is a fresh,
    reproducible permutation in which every sample appears exactly once; with
    ``world_size > 1`` (DDP) each rank takes a disjoint, equal-length share. ``images``
    is a tensor (in RAM, or on the GPU: then batches never cross the bus at all) or a
    numpy memory map (a batch's rows are read in file order: sequential-ish disk reads).
    """

    def __init__(
        self,
        images: torch.Tensor | np.ndarray,
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

    def _drops_tail(self, n: int) -> bool:
        # A shuffled (training) epoch never ends on a batch of one image: BatchNorm cannot
        # train on a single value per channel (EfficientNet's last stage is 1x1 at 32 px).
        return self.drop_last or (self.shuffle and n % self.batch_size == 1 and n > 1)

    def __len__(self) -> int:
        n = self.labels.shape[0] // self.world_size
        return n // self.batch_size if self._drops_tail(n) else -(-n // self.batch_size)

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
        stop = len(idx) - len(idx) % self.batch_size if self._drops_tail(len(idx)) else len(idx)
        mapped = isinstance(self.images, np.ndarray)
        for start in range(0, stop, self.batch_size):
            sel = idx[start : start + self.batch_size]
            if mapped:
                # The same samples as in RAM, in file order within the batch.
                sel = torch.sort(sel).values
                yield torch.from_numpy(self.images[sel.numpy()]), self.labels[sel]
            else:
                yield self.images[sel], self.labels[sel]


class PerSampleDataset(Dataset):
    """The textbook path, kept for comparison: one ``__getitem__`` per image + collate."""

    def __init__(self, images: torch.Tensor | np.ndarray, labels: torch.Tensor) -> None:
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.images[i]
        if isinstance(image, np.ndarray):
            image = torch.from_numpy(np.array(image))
        return image, self.labels[i]


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


Splits = dict[str, tuple[np.ndarray, np.ndarray]]


class ImageDataModule(L.LightningDataModule):
    """Train/val/test splits from ``data/prepared`` (or arrays), served by either data path.

    ``data_path="fast"``: whole-batch gathers (TensorBatches); ``"naive"``: per-sample
    Dataset + DataLoader, for comparison. Where the splits live is ``choose_placement``'s
    call (device-resident needs ``device_resident`` and the fast path), made in ``setup``
    and reported in ``placement`` / ``placement_reason``.
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
        card: Card | None = None,
        memory_budget: float = 0.5,
    ) -> None:
        super().__init__()
        if (data_dir is None) == (arrays is None):
            raise ValueError("give exactly one of data_dir or arrays")
        if card is None and data_dir is None:
            raise ValueError("arrays need a card")
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self.batch_size, self.eval_batch_size, self.seed = batch_size, eval_batch_size, seed
        self.data_path, self.device_resident = data_path, device_resident
        self.memory_budget = memory_budget
        self.card = card if card is not None else load_card(self.data_dir)
        self._arrays: Splits = dict(arrays) if arrays is not None else {}
        self.tensors: dict[str, tuple[torch.Tensor | np.ndarray, torch.Tensor]] = {}
        self.placement: Placement | None = None
        self.placement_reason = ""

    def split_arrays(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        """(uint8 images [N,C,H,W], labels [N]) of ``split``: memory-mapped, opened once."""
        if split not in self._arrays:
            self._arrays[split] = load_split(self.data_dir, split)
        return self._arrays[split]

    def train_on(self, *splits: str) -> None:
        """Train on ``splits`` together from the next fit on (``train.refit``: train + val);
        the val split stays as it is."""
        parts = [self.split_arrays(s) for s in splits]
        self._arrays["train"] = (
            np.concatenate([x for x, _ in parts]),
            np.concatenate([y for _, y in parts]),
        )
        self.tensors.pop("train", None)  # placed anew by the next setup

    def _device(self) -> torch.device:
        trainer = self.trainer
        if trainer is None:
            return torch.device("cpu")
        return trainer.strategy.root_device

    def _splits_for(self, stage: str | None) -> tuple[str, ...]:
        # The test split is evaluate's (ONNX Runtime); training never needs it in memory.
        return ("test",) if stage == "test" else ("train", "val") if stage else SPLITS

    def setup(self, stage: str | None = None) -> None:
        splits = [s for s in self._splits_for(stage) if s not in self.tensors]
        if not splits:
            return
        device = self._device()
        nbytes = sum(self.split_arrays(s)[0].nbytes for s in splits)
        resident = self.device_resident and self.data_path == "fast"
        self.placement, self.placement_reason = choose_placement(
            nbytes, device, resident, self.memory_budget
        )
        log.info("data: %s (%s)", self.placement, self.placement_reason)
        for split in splits:
            images, labels = self.split_arrays(split)
            y = torch.from_numpy(labels.astype(np.int64))
            if self.placement == "mmap":
                self.tensors[split] = (images, y)
                continue
            # np.array copies the map into RAM (from_numpy alone would stay on the map).
            # uint8 (4x smaller than float) until the batch is on the device.
            x = torch.from_numpy(np.array(images))
            target = device if self.placement == "device" else torch.device("cpu")
            self.tensors[split] = (x.to(target), y.to(target))

    def _rank_world(self) -> tuple[int, int]:
        trainer = self.trainer
        if trainer is None:
            return 0, 1
        return trainer.global_rank, trainer.world_size

    def _loader(self, split: str, batch_size: int, shuffle: bool) -> DataLoader:
        images, labels = self.tensors[split]
        rank, world = self._rank_world()
        on_host = isinstance(images, np.ndarray) or images.device.type == "cpu"
        # Pinned host batches let the host-to-device copy run asynchronously.
        pin = torch.cuda.is_available() and on_host
        if self.data_path == "naive":
            sampler = EpochSampler(len(labels), shuffle, self.seed, rank, world)
            return DataLoader(
                PerSampleDataset(images, labels),
                batch_size=batch_size,
                sampler=sampler,
                num_workers=0,
                pin_memory=pin,
                # as TensorBatches: a training epoch never ends on a batch of one image
                drop_last=shuffle and (len(labels) // world) % batch_size == 1,
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
