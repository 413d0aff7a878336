"""Prepare stage on the real files: stratified seeded split, limit, stats, atomic output."""

from __future__ import annotations

import json

import numpy as np
import pytest

from trainyard.core.config import DataParams
from trainyard.core.errors import DataError
from trainyard.data.arrays import split_train_val, stratified_take
from trainyard.data.sources import prepare_source as prepare
from trainyard.data.sources.fashion_fetch import fetch_raw
from trainyard.data.sources.fashion_mnist import CLASS_NAMES


@pytest.fixture(scope="module")
def raw_dir(fashion_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("raw") / "raw"
    fetch_raw(DataParams(debian_dir=str(fashion_dir)), out)
    return out


def test_prepare_with_limit(raw_dir, tmp_path):
    out = tmp_path / "prepared"
    card = prepare(raw_dir, out, DataParams(limit=2000, val_size=500), seed=1)
    counts = card.counts
    assert (counts["train"]["total"], counts["val"]["total"], counts["test"]["total"]) == (
        1500,
        500,
        10_000,
    )
    # Fashion-MNIST's train file is balanced (6000 per class): the slice must be too.
    assert set(counts["train"]["per_class"].values()) == {150}
    assert set(counts["val"]["per_class"].values()) == {50}
    assert list(counts["test"]["per_class"]) == list(CLASS_NAMES)
    train = np.load(out / "train_images.npy")
    assert train.dtype == np.uint8 and train.shape == (1500, 1, 28, 28)
    labels = np.load(out / "train_labels.npy")
    assert labels.dtype == np.int32 and labels.shape == (1500,)
    # The card's statistics are the train split's own.
    assert card.mean[0] == pytest.approx(train.mean() / 255, abs=1e-6)
    assert card.std[0] == pytest.approx(train.std() / 255, abs=1e-6)
    assert 0.25 < card.mean[0] < 0.32 and 0.30 < card.std[0] < 0.40
    assert card.classes == CLASS_NAMES and card.input_shape == (1, 28, 28)
    assert (card.source, card.resize, card.fill) == ("fashion-mnist", "pad", 0)
    on_disk = json.loads((out / "card.json").read_text())
    assert on_disk["data_sha256"] == card.data_sha256 and len(card.data_sha256) == 64
    assert on_disk["classes"] == list(CLASS_NAMES)
    assert not list(tmp_path.glob(".prepared.*"))


def test_same_seed_same_data_other_seed_other_split(raw_dir, tmp_path):
    a = prepare(raw_dir, tmp_path / "a", DataParams(limit=1000, val_size=100), seed=7)
    b = prepare(raw_dir, tmp_path / "b", DataParams(limit=1000, val_size=100), seed=7)
    c = prepare(raw_dir, tmp_path / "c", DataParams(limit=1000, val_size=100), seed=8)
    assert a.data_sha256 == b.data_sha256 != c.data_sha256


def test_split_is_disjoint_and_stratified():
    labels = np.repeat(np.arange(10), 600)
    train, val = split_train_val(labels, val_size=1000, limit=None, seed=0)
    assert len(np.intersect1d(train, val)) == 0
    assert len(train) + len(val) == 6000
    assert np.bincount(labels[val], minlength=10).tolist() == [100] * 10


def test_stratified_take_handles_uneven_classes():
    labels = np.array([0] * 70 + [1] * 20 + [2] * 10)
    picked = stratified_take(labels, 10, np.random.default_rng(0))
    assert np.bincount(labels[picked], minlength=3).tolist() == [7, 2, 1]


def test_corrupt_raw_label_stops_prepare(raw_dir, tmp_path):
    import gzip
    import shutil

    bad = tmp_path / "raw"
    shutil.copytree(raw_dir, bad)
    path = bad / "t10k-labels-idx1-ubyte.gz"
    data = bytearray(gzip.decompress(path.read_bytes()))
    data[8 + 5] = 11  # label 11 in a 10-class dataset
    path.write_bytes(gzip.compress(bytes(data)))
    out = tmp_path / "prepared"
    with pytest.raises(DataError, match=r"t10k-labels-idx1-ubyte\.gz: 1 labels outside 0\.\.9"):
        prepare(bad, out, DataParams(limit=100, val_size=20), seed=0)
    assert not out.exists()


@pytest.mark.parametrize("block_bytes", [1, 7_000, 16 << 20])
def test_channel_stats_is_exact_for_arrays_and_files_whatever_the_block(
    tmp_path, monkeypatch, block_bytes
):
    import trainyard.data.arrays as prepare_module

    monkeypatch.setattr(prepare_module, "_STATS_BYTES", block_bytes)
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (301, 3, 9, 11), dtype=np.uint8)
    images[:, 2] = 77  # a constant channel: std falls back to 1.0, not a division by 0
    np.save(tmp_path / "train_images.npy", images)
    as_float = images.astype(np.float64)
    want_mean = tuple(np.round(as_float.mean(axis=(0, 2, 3))[:2] / 255, 6))
    want_std = tuple(np.round(as_float.std(axis=(0, 2, 3))[:2] / 255, 6))
    for source in (images, tmp_path / "train_images.npy"):
        mean, std = prepare_module.channel_stats(source)
        assert mean[:2] == pytest.approx(want_mean, abs=1e-6)
        assert std[:2] == pytest.approx(want_std, abs=1e-6)
        assert (mean[2], std[2]) == (round(77 / 255, 6), 1.0)
