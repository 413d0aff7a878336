"""Reader for the IDX format (yann.lecun.com/exdb/mnist) with every header field checked."""

from __future__ import annotations

import gzip
import os
import struct
import zlib
from pathlib import Path

import numpy as np

from trainyard.core.errors import DataError

# IDX magic: two zero bytes, a type code (0x08 = unsigned byte), then the number of dims.
_UBYTE = 0x08


def read_idx_bytes(data: bytes, source: str = "<bytes>") -> np.ndarray:
    """Parse decompressed IDX bytes into a uint8 array, validating magic and dimensions."""
    if len(data) < 4:
        raise DataError(f"{source}: too short for an IDX header ({len(data)} bytes)")
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != _UBYTE or ndim not in (1, 3):
        raise DataError(
            f"{source}: bad IDX magic {data[:4].hex()} (expected 00000801 for labels or "
            "00000803 for images); the file is not an IDX ubyte file"
        )
    header = 4 + 4 * ndim
    if len(data) < header:
        raise DataError(f"{source}: IDX header truncated ({len(data)} bytes)")
    dims = struct.unpack(f">{ndim}I", data[4:header])
    if any(d == 0 for d in dims):
        raise DataError(f"{source}: IDX dimensions {dims} contain a zero")
    expected = int(np.prod(dims, dtype=np.int64))
    payload = len(data) - header
    if payload != expected:
        raise DataError(
            f"{source}: IDX header says dimensions {dims} ({expected} bytes) but the file "
            f"holds {payload} bytes of data; the file is truncated or corrupt"
        )
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims)


def read_gz(path: str | os.PathLike[str]) -> bytes:
    """Decompress a .gz file fully, turning gzip/zlib failures into a DataError naming it."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    try:
        with gzip.open(path, "rb") as fh:
            return fh.read()
    except (EOFError, OSError, zlib.error) as err:
        raise DataError(
            f"{path}: cannot decompress ({err}); the file is truncated or not gzip. "
            "Delete it and run the fetch stage again."
        ) from None


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Read an IDX file (.gz or plain) into a uint8 array."""
    path = Path(path)
    data = read_gz(path) if path.suffix == ".gz" else path.read_bytes()
    return read_idx_bytes(data, str(path))


def check_images(arr: np.ndarray, source: str, count: int | None = None, size: int = 28) -> None:
    if arr.ndim != 3 or arr.shape[1:] != (size, size):
        raise DataError(f"{source}: expected images of shape (N, {size}, {size}), got {arr.shape}")
    if count is not None and arr.shape[0] != count:
        raise DataError(f"{source}: expected {count} images, got {arr.shape[0]}")


def check_labels(arr: np.ndarray, source: str, num_classes: int, count: int | None = None) -> None:
    if arr.ndim != 1:
        raise DataError(f"{source}: expected a 1-D label array, got shape {arr.shape}")
    if count is not None and arr.shape[0] != count:
        raise DataError(f"{source}: expected {count} labels, got {arr.shape[0]}")
    bad = np.flatnonzero(arr >= num_classes)
    if bad.size:
        raise DataError(
            f"{source}: {bad.size} labels outside 0..{num_classes - 1} "
            f"(first at index {bad[0]}: {arr[bad[0]]})"
        )


def write_idx_bytes(arr: np.ndarray) -> bytes:
    """Encode a uint8 array as IDX (used by tests and by users converting their own data)."""
    arr = np.ascontiguousarray(arr, dtype=np.uint8)
    return (
        struct.pack(">HBB", 0, _UBYTE, arr.ndim)
        + struct.pack(f">{arr.ndim}I", *arr.shape)
        + arr.tobytes()
    )
