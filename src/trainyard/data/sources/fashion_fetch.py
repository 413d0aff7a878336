"""Fetch stage: locate the four Fashion-MNIST files, verify them, copy them to data/raw.

Order: ``data.source_dir`` (a user's folder), then Debian's ``dataset-fashion-mnist``
package, then the upstream mirrors. Each file must match its recorded content checksum
(see dataset.RawFile) whatever its origin.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainyard.core.errors import DataError
from trainyard.core.io import atomic_dir, atomic_file
from trainyard.data.fingerprint import stat_fingerprint
from trainyard.data.idx import read_gz
from trainyard.data.sources.fashion_mnist import RAW_FILES, RawFile

if TYPE_CHECKING:  # pydantic stays out of the light paths (bench, gpu-check)
    from trainyard.core.config import DataParams

log = logging.getLogger(__name__)

_MAX_DOWNLOAD = 64 << 20  # the largest file is 26 MB; anything far bigger is not ours


@dataclass(frozen=True)
class FetchedFile:
    name: str
    origin: str  # folder or URL it came from
    content_sha256: str


def verify_file(path: Path, spec: RawFile) -> str:
    """Check a .gz file's decompressed content against its recorded checksum."""
    content = read_gz(path)
    if len(content) != spec.content_size:
        raise DataError(
            f"{path}: decompressed size {len(content)} bytes, expected {spec.content_size} "
            f"for {spec.name}; the file is truncated or not the Fashion-MNIST file. "
            "Delete it and fetch again (apt-get install dataset-fashion-mnist, or set "
            "data.source_dir to a folder with the original files)."
        )
    digest = hashlib.sha256(content).hexdigest()
    if digest != spec.content_sha256:
        raise DataError(
            f"{path}: checksum mismatch for {spec.name} (content sha256 {digest}, expected "
            f"{spec.content_sha256}); the file is corrupt or not the original. Delete it and "
            "fetch again."
        )
    return digest


def _download(url: str, dest: Path, timeout: float) -> None:
    log.info("downloading %s", url)
    req = urllib.request.Request(url, headers={"User-Agent": "trainyard"})
    with urllib.request.urlopen(req, timeout=timeout) as resp, atomic_file(dest) as tmp:
        size = 0
        with open(tmp, "wb") as out:
            while block := resp.read(1 << 20):
                size += len(block)
                if size > _MAX_DOWNLOAD:
                    raise DataError(f"{url}: larger than {_MAX_DOWNLOAD} bytes; refusing it")
                out.write(block)


def _candidate_dirs(params: DataParams) -> list[Path]:
    if params.source_dir:
        # A folder the user named is the only local source: silently using another copy
        # would hide a typo in the path.
        src = Path(params.source_dir).expanduser()
        if not src.is_dir():
            raise DataError(
                f"data.source_dir: folder {src} does not exist; fix the path in params.yaml "
                "or set it to null to use Debian's package or the download"
            )
        return [src]
    return [Path(params.debian_dir)]


def fingerprint_fashion_mnist(params: DataParams, root: Path) -> dict[str, Any]:
    """Where fetch will find the four .gz files, for ``source_fingerprint``: the stat
    fingerprint of those in data.source_dir (relative to ``root``), else in
    data.debian_dir, and data.mirrors when some are not there (fetch downloads them)."""
    if params.source_dir:
        folder = Path(params.source_dir).expanduser()
        folder = folder if folder.is_absolute() else root / folder
    else:
        folder = Path(params.debian_dir)
    local = [folder / spec.name for spec in RAW_FILES if (folder / spec.name).is_file()]
    found: dict[str, Any] = {
        "files": len(local),
        "folder": folder.as_posix(),
        "stat": stat_fingerprint(local, folder),
    }
    if len(local) < len(RAW_FILES) and not params.source_dir:
        found["mirrors"] = list(params.mirrors)
    return found


def fetch_raw(params: DataParams, out_dir: str | os.PathLike[str]) -> list[FetchedFile]:
    """Place the four verified .gz files in ``out_dir`` (written atomically, all or none)."""
    out_dir = Path(out_dir)
    fetched: list[FetchedFile] = []
    dirs = _candidate_dirs(params)
    with atomic_dir(out_dir) as tmp:
        for spec in RAW_FILES:
            dest = tmp / spec.name
            local = next((d / spec.name for d in dirs if (d / spec.name).is_file()), None)
            if local is not None:
                # A corrupt local copy is an error, not a reason to download over it.
                digest = verify_file(local, spec)
                shutil.copyfile(local, dest)
                fetched.append(FetchedFile(spec.name, str(local.parent), digest))
                continue
            if params.source_dir:
                raise DataError(
                    f"{spec.name}: missing from data.source_dir ({dirs[0]}); put the four "
                    "Fashion-MNIST .gz files there"
                )
            fetched.append(_fetch_remote(spec, params, dest))
    return fetched


def _fetch_remote(spec: RawFile, params: DataParams, dest: Path) -> FetchedFile:
    errors: list[str] = []
    for mirror in params.mirrors:
        url = mirror.rstrip("/") + "/" + spec.name
        try:
            _download(url, dest, params.download_timeout_s)
            digest = verify_file(dest, spec)
        except (urllib.error.URLError, OSError, TimeoutError, DataError) as err:
            dest.unlink(missing_ok=True)
            errors.append(f"  {url}: {err}")
            continue
        return FetchedFile(spec.name, mirror, digest)
    tried = "\n".join(errors) or "  (data.mirrors is empty)"
    raise DataError(
        f"{spec.name}: not found in {params.debian_dir} and no mirror gave a valid copy:\n"
        f"{tried}\n"
        "Install it with `apt-get install dataset-fashion-mnist`, or download the four files "
        "and set data.source_dir to their folder."
    )
