"""IDX reader on crafted good and corrupt files."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from trainyard.core.errors import DataError
from trainyard.data.idx import check_labels, read_idx, read_idx_bytes, write_idx_bytes

from conftest import write_gz


def test_roundtrip_images_and_labels(tiny_idx):
    assert np.array_equal(read_idx(tiny_idx["images"]), tiny_idx["images_array"])
    assert np.array_equal(read_idx(tiny_idx["labels"]), tiny_idx["labels_array"])


def test_wrong_magic_is_refused(tmp_path):
    data = bytearray(write_idx_bytes(np.zeros((2, 28, 28), np.uint8)))
    data[2] = 0x0D  # float32 type code: not what Fashion-MNIST holds
    path = write_gz(tmp_path / "bad-magic.gz", bytes(data))
    with pytest.raises(DataError, match=r"bad-magic\.gz: bad IDX magic"):
        read_idx(path)


def test_dimensions_disagreeing_with_payload(tmp_path):
    header = struct.pack(">HBB3I", 0, 8, 3, 5, 28, 28)  # says 5 images
    path = write_gz(tmp_path / "short.gz", header + bytes(3 * 28 * 28))  # holds 3
    with pytest.raises(DataError, match=r"short\.gz: IDX header says dimensions \(5, 28, 28\)"):
        read_idx(path)


def test_zero_dimension_refused():
    with pytest.raises(DataError, match="contain a zero"):
        read_idx_bytes(struct.pack(">HBB3I", 0, 8, 3, 0, 28, 28), "zero")


def test_too_short_for_header():
    with pytest.raises(DataError, match="too short"):
        read_idx_bytes(b"\x00\x00", "tiny")


def test_truncated_gzip_names_the_file(tiny_idx, tmp_path):
    blob = tiny_idx["images"].read_bytes()
    cut = tmp_path / "cut-idx3-ubyte.gz"
    cut.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(DataError, match=r"cut-idx3-ubyte\.gz: cannot decompress"):
        read_idx(cut)


def test_not_gzip_at_all(tmp_path):
    path = tmp_path / "text.gz"
    path.write_text("this is not gzip")
    with pytest.raises(DataError, match=r"text\.gz: cannot decompress"):
        read_idx(path)


def test_labels_outside_range_are_refused():
    labels = np.array([0, 3, 9, 10, 12], dtype=np.uint8)
    with pytest.raises(DataError, match=r"2 labels outside 0\.\.9 \(first at index 3: 10\)"):
        check_labels(labels, "lbl", num_classes=10)


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="file not found"):
        read_idx(tmp_path / "nope.gz")
