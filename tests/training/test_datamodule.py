"""In-memory batches: each sample once per epoch, reproducible, sharded; device-side norm."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainyard.core.config import DataParams
from trainyard.data.sources import prepare_source as prepare
from trainyard.data.sources.fashion_fetch import fetch_raw
from trainyard.model.classifier import Classifier
from trainyard.training.datamodule import ImageDataModule, TensorBatches


def _ds(n: int = 103, **kw) -> TensorBatches:
    images = torch.arange(n, dtype=torch.uint8).view(n, 1, 1, 1).expand(n, 1, 2, 2).contiguous()
    return TensorBatches(images, torch.arange(n), batch_size=10, **kw)


def _epoch(ds: TensorBatches) -> list[torch.Tensor]:
    return [labels for _, labels in ds]


def test_each_sample_exactly_once_per_epoch_and_images_match_labels():
    ds = _ds(shuffle=True, seed=3)
    for _ in range(3):
        batches = list(ds)
        seen = torch.cat([lbl for _, lbl in batches])
        assert sorted(seen.tolist()) == list(range(103))
        for images, labels in batches:  # the image of sample i carries value i
            assert torch.equal(images[:, 0, 0, 0].long(), labels)
    assert len(ds) == 11 and [len(b) for b in _epoch(ds)][-1] == 3


def test_shuffle_differs_per_epoch_and_is_reproducible():
    a, b = _ds(shuffle=True, seed=5), _ds(shuffle=True, seed=5)
    e1, e2 = torch.cat(_epoch(a)), torch.cat(_epoch(a))
    assert not torch.equal(e1, e2)
    assert torch.equal(e1, torch.cat(_epoch(b)))


def test_drop_last_and_no_shuffle():
    ds = _ds(shuffle=False, drop_last=True)
    batches = _epoch(ds)
    assert len(batches) == len(ds) == 10
    assert torch.equal(torch.cat(batches), torch.arange(100))


def test_ranks_get_disjoint_equal_shards():
    shards = [torch.cat(_epoch(_ds(shuffle=True, seed=1, rank=r, world_size=3))) for r in range(3)]
    assert all(len(s) == 103 // 3 for s in shards)
    union = torch.cat(shards)
    assert len(torch.unique(union)) == len(union)


@pytest.fixture(scope="module")
def prepared(fashion_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("dm")
    fetch_raw(DataParams(debian_dir=str(fashion_dir)), root / "raw")
    prepare(root / "raw", root / "prepared", DataParams(limit=1000, val_size=200), seed=0)
    return root / "prepared"


def test_datamodule_shapes_and_device_normalisation(prepared):
    dm = ImageDataModule(prepared, batch_size=64, eval_batch_size=500, seed=0)
    dm.setup("fit")
    dm.setup("test")
    assert dm.placement == "ram" and "available RAM" in dm.placement_reason
    images, labels = next(iter(dm.train_dataloader()))
    assert images.dtype == torch.uint8 and images.shape == (64, 1, 28, 28)
    assert labels.dtype == torch.int64 and labels.max() < 10
    assert sum(len(y) for _, y in dm.val_dataloader()) == 200
    assert sum(len(y) for _, y in dm.test_dataloader()) == 10_000

    model = Classifier(card=dm.card.contract(), augment=False)
    model.trainer = type("T", (), {"training": False})()  # only .training is read here
    all_images = dm.tensors["train"][0]
    x, _ = model.on_after_batch_transfer((all_images, torch.zeros(len(all_images))), 0)
    # Normalised with the training split's own statistics: mean 0, std 1.
    assert x.dtype == torch.float32
    assert abs(float(x.mean())) < 1e-3 and abs(float(x.std()) - 1) < 1e-3
    assert np.isclose(dm.card.mean[0], float(all_images.float().mean() / 255), atol=1e-5)


def _arrays(n_train: int = 300) -> dict:
    rng = np.random.default_rng(0)

    def split(n: int) -> tuple[np.ndarray, np.ndarray]:
        return (
            rng.integers(0, 256, (n, 1, 28, 28), dtype=np.uint8),
            rng.integers(0, 10, n, dtype=np.int32),
        )

    return {"train": split(n_train), "val": split(50), "test": split(50)}


def _card(channels: int = 1, size: int = 28):
    from trainyard.core.card import Card

    return Card(
        source="test",
        classes=tuple(f"c{i}" for i in range(10)),
        channels=channels,
        height=size,
        width=size,
        mean=(0.3,) * channels,
        std=(0.35,) * channels,
    )


def test_fast_and_naive_paths_yield_identical_batches():
    arrays, card = _arrays(), _card()
    loaders = {}
    for path in ("fast", "naive"):
        dm = ImageDataModule(arrays=arrays, card=card, batch_size=64, seed=11, data_path=path)
        dm.setup("fit")
        loaders[path] = dm.train_dataloader()
    for _epoch in range(2):  # a fresh permutation each epoch, the same for both paths
        fast, naive = list(loaders["fast"]), list(loaders["naive"])
        assert len(fast) == len(naive) == 5
        for (fx, fy), (nx, ny) in zip(fast, naive, strict=True):
            assert torch.equal(fx, nx) and torch.equal(fy, ny)
        labels = torch.cat([y for _, y in fast])
        assert torch.equal(
            torch.sort(labels).values,
            torch.sort(torch.from_numpy(arrays["train"][1].astype(np.int64))).values,
        )


def test_datamodule_needs_exactly_one_source(tmp_path):
    with pytest.raises(ValueError, match="exactly one"):
        ImageDataModule()


def test_placement_follows_the_budget_and_says_why():
    from trainyard.training.datamodule import choose_placement

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert choose_placement(100, cpu, True, 0.5, ram_bytes=1000)[0] == "ram"
    where, why = choose_placement(600, cpu, True, 0.5, ram_bytes=1000)
    assert where == "mmap" and "memory-mapped" in why and "50%" in why
    big_ram = {"ram_bytes": 10**9}
    assert choose_placement(100, cuda, True, 0.5, gpu_free_bytes=1000, **big_ram)[0] == "device"
    where, why = choose_placement(600, cuda, True, 0.5, gpu_free_bytes=1000, **big_ram)
    assert where == "ram" and "GPU" in why
    # device_resident off (or the naive path): never on the GPU
    assert choose_placement(100, cuda, False, 0.5, gpu_free_bytes=1000, **big_ram)[0] == "ram"


def test_memory_mapped_split_serves_the_same_batches_as_ram(tmp_path):
    n = 300
    labels = np.arange(n, dtype=np.int32) % 10
    images = np.zeros((n, 3, 8, 8), dtype=np.uint8)
    images[:, 0, 0, 0] = np.arange(n) % 256  # each image names its sample
    images[:, 1, 0, 0] = np.arange(n) // 256
    for split in ("train", "val", "test"):
        np.save(tmp_path / f"{split}_images.npy", images)
        np.save(tmp_path / f"{split}_labels.npy", labels)
    card = _card(channels=3, size=8)
    (tmp_path / "card.json").write_text(card.to_json())

    def epoch(dm: ImageDataModule) -> list[list[int]]:
        out = []
        for x, y in dm.train_dataloader():
            ids = (x[:, 0, 0, 0].long() + 256 * x[:, 1, 0, 0].long()).tolist()
            assert [i % 10 for i in ids] == y.tolist()  # images travel with their labels
            out.append(sorted(ids))
        return out

    ram = ImageDataModule(tmp_path, batch_size=64, seed=3)
    mapped = ImageDataModule(tmp_path, batch_size=64, seed=3, memory_budget=1e-12)
    for dm in (ram, mapped):
        dm.setup("fit")
    assert (ram.placement, mapped.placement) == ("ram", "mmap")
    assert isinstance(mapped.tensors["train"][0], np.ndarray)  # stays on disk
    for _ in range(2):
        assert epoch(ram) == epoch(mapped)


def test_a_training_epoch_never_ends_on_a_batch_of_one_image():
    """BatchNorm cannot train on one value per channel (a fine-tuned EfficientNet's last
    stage is 1x1 at 32 px): 33 images at batch 16 train as 2 batches; evaluation keeps all."""
    images, labels = torch.zeros(33, 1, 4, 4, dtype=torch.uint8), torch.arange(33)
    train = TensorBatches(images, labels, 16, shuffle=True)
    assert len(train) == 2 and [len(y) for _, y in train] == [16, 16]
    held = TensorBatches(images, labels, 16, shuffle=False)
    assert len(held) == 3 and [len(y) for _, y in held] == [16, 16, 1]
    even = TensorBatches(torch.zeros(34, 1, 4, 4, dtype=torch.uint8), torch.arange(34), 16, True)
    assert [len(y) for _, y in even] == [16, 16, 2]


def test_validation_batches_are_at_most_four_training_batches():
    from trainyard.training.fit import VAL_STEPS, val_batch

    # Fashion-MNIST's cnn (batch 256) validates 1,024 at a time, as evaluate.batch_size says
    assert val_batch(1024, 256) == 1024
    # a Lite0 fine-tune at batch 32: 1,024 images of 160 px a pass peaked at 10.9 GB
    assert val_batch(1024, 32) == VAL_STEPS * 32 == 128
    assert val_batch(100, 32) == 100
    assert val_batch(1024, 0) == 1
