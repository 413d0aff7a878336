"""Fetch stage: local copies, the download path against a real local HTTP server, refusals."""

from __future__ import annotations

import functools
import gzip
import http.server
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainyard.core.config import DataParams
from trainyard.core.errors import DataError
from trainyard.data.sources.fashion_fetch import fetch_raw
from trainyard.data.sources.fashion_mnist import RAW_FILES

NAMES = [f.name for f in RAW_FILES]


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def http_dir(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A real HTTP server on 127.0.0.1 serving a temp folder; yields (folder, base URL)."""
    root = tmp_path / "www"
    root.mkdir()
    handler = functools.partial(_QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield root, f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def _copies(fashion_dir: Path, dest: Path, names: list[str] = NAMES) -> Path:
    """``dest`` holding copies of Fashion-MNIST's raw files ``names``."""
    dest.mkdir(exist_ok=True)
    for name in names:
        shutil.copy(fashion_dir / name, dest / name)
    return dest


def _empty(tmp_path: Path) -> str:
    d = tmp_path / "no-debian"
    d.mkdir()
    return str(d)


def test_fetch_from_debian_package(fashion_dir, tmp_path):
    out = tmp_path / "raw"
    fetched = fetch_raw(DataParams(debian_dir=str(fashion_dir)), out)
    assert sorted(p.name for p in out.iterdir()) == sorted(NAMES)
    assert {f.origin for f in fetched} == {str(fashion_dir)}


def test_download_from_local_http_server(fashion_dir, http_dir, tmp_path):
    root, url = http_dir
    _copies(fashion_dir, root)
    out = tmp_path / "raw"
    params = DataParams(debian_dir=_empty(tmp_path), mirrors=[url])
    fetched = fetch_raw(params, out)
    assert [f.origin for f in fetched] == [url] * 4
    for name in NAMES:  # byte-identical to what was served
        assert (out / name).read_bytes() == (root / name).read_bytes()


def test_second_mirror_used_when_first_lacks_files(fashion_dir, http_dir, tmp_path):
    root, url = http_dir
    _copies(fashion_dir, root / "good")
    params = DataParams(debian_dir=_empty(tmp_path), mirrors=[url + "missing/", url + "good/"])
    fetched = fetch_raw(params, tmp_path / "raw")
    assert {f.origin for f in fetched} == {url + "good/"}


def test_served_corrupt_file_is_refused_and_nothing_is_written(fashion_dir, http_dir, tmp_path):
    root, url = http_dir
    _copies(fashion_dir, root)
    # Valid gzip, one label changed: only the checksum can catch it.
    labels = bytearray(gzip.decompress((fashion_dir / "t10k-labels-idx1-ubyte.gz").read_bytes()))
    labels[100] = (labels[100] + 1) % 10
    (root / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(bytes(labels)))
    out = tmp_path / "raw"
    params = DataParams(debian_dir=_empty(tmp_path), mirrors=[url])
    with pytest.raises(DataError, match=r"t10k-labels-idx1-ubyte\.gz.*checksum mismatch"):
        fetch_raw(params, out)
    assert not out.exists()  # all or nothing
    assert list(tmp_path.glob(".raw.*")) == []  # no temp leftovers


def test_served_truncated_file_is_refused(fashion_dir, http_dir, tmp_path):
    root, url = http_dir
    _copies(fashion_dir, root)
    blob = (fashion_dir / "train-labels-idx1-ubyte.gz").read_bytes()
    (root / "train-labels-idx1-ubyte.gz").write_bytes(blob[:-100])
    params = DataParams(debian_dir=_empty(tmp_path), mirrors=[url])
    with pytest.raises(DataError, match=r"train-labels-idx1-ubyte\.gz.*cannot decompress"):
        fetch_raw(params, tmp_path / "raw")


def test_corrupt_local_copy_is_an_error_not_a_download(fashion_dir, tmp_path):
    src = _copies(fashion_dir, tmp_path / "mine")
    blob = (src / "train-images-idx3-ubyte.gz").read_bytes()
    (src / "train-images-idx3-ubyte.gz").write_bytes(blob[: len(blob) // 3])
    with pytest.raises(DataError, match=rf"{src}/train-images-idx3-ubyte\.gz"):
        fetch_raw(DataParams(source_dir=str(src)), tmp_path / "raw")


def test_missing_file_in_source_dir_is_named(fashion_dir, tmp_path):
    src = _copies(fashion_dir, tmp_path / "mine", NAMES[1:])
    with pytest.raises(DataError, match=rf"{NAMES[0]}: missing from data.source_dir"):
        fetch_raw(DataParams(source_dir=str(src)), tmp_path / "raw")


def test_nonexistent_source_dir(tmp_path):
    with pytest.raises(DataError, match=r"data\.source_dir: folder .* does not exist"):
        fetch_raw(DataParams(source_dir=str(tmp_path / "nope")), tmp_path / "raw")


def test_no_source_at_all_says_what_to_do(http_dir, tmp_path):
    _, url = http_dir  # serves an empty folder: every file is a 404
    params = DataParams(debian_dir=_empty(tmp_path), mirrors=[url])
    with pytest.raises(DataError, match=r"apt-get install dataset-fashion-mnist") as info:
        fetch_raw(params, tmp_path / "raw")
    assert "404" in str(info.value)
