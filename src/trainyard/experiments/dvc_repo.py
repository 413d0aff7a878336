"""DVC's Python API behind trainyard: the one module that imports ``dvc`` (test_layers.py).

What ``trainyard report`` asks of the repository: DVC's own params and metrics diffs against
a revision, and a file as it was at a revision (from git or the DVC cache). The commands
``dvc exp run``, ``dvc queue`` and ``dvc exp show`` are run as processes (experiments/best.py,
exps.py), not through this API.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dvc.api
from dvc.exceptions import DvcException, PathMissingError
from dvc.repo import Repo

from trainyard.core.errors import TrainyardError


def diffs_against(root: Path, rev: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The workspace of the repository ``root`` against commit ``rev``: DVC's params diff
    (changed params only) and metrics diff (every metric, ``--all``), as DVC returns them."""
    with Repo(str(root)) as repo:
        params = repo.params.diff(a_rev=rev)
        metrics = repo.metrics.diff(a_rev=rev, all=True)
    return params, metrics


def read_at_revision(root: Path, path: Path, rev: str) -> bytes | None:
    """``path``'s bytes at commit ``rev`` of the repository ``root``, from git or the DVC
    cache; None when it is not there."""
    try:
        with dvc.api.open(str(path), rev=rev, mode="rb", repo=str(root)) as fh:
            return fh.read()
    except PathMissingError:
        return None
    except DvcException as err:
        raise TrainyardError(f"{path} at {rev[:7]}: cannot be read ({err})") from err
