"""A run's lineage: the code (git commit, dirtiness), the data (DVC's hash of the prepared
data), the host and library versions, and the DVC experiment that ran it."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
from importlib.metadata import version
from pathlib import Path

import yaml

from trainyard import __version__
from trainyard.track.store import DVC_EXP_BASELINE_REV, DVC_EXP_NAME, in_temp_workspace


def dvc_experiment_tags(root: str | os.PathLike[str] = ".") -> dict[str, str]:
    """Tags matching a run to its row of ``dvc exp show``: the experiment's name and
    baseline commit, and where it ran (``workspace`` or ``temp``: queue, ``--temp``)."""
    name = os.environ.get(DVC_EXP_NAME, "").strip()
    if not name:
        return {}
    return {
        "dvc.exp_name": name,
        "dvc.baseline_rev": os.environ.get(DVC_EXP_BASELINE_REV, "").strip(),
        "dvc.workspace": "temp" if in_temp_workspace(root) else "workspace",
    }


def git_state(root: str | os.PathLike[str] = ".") -> dict[str, str]:
    """Commit and dirtiness of the repository (empty values outside a git checkout)."""

    def git(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=True
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return {"git_commit": commit or "unknown", "git_dirty": str(bool(dirty)).lower()}


def run_tags(root: str | os.PathLike[str], data_sha256: str, device: str) -> dict[str, str]:
    """Lineage tags of a training run: commit, data hash, host, device and library versions."""
    git = git_state(root)
    return {
        "mlflow.source.git.commit": git["git_commit"],
        "git.commit": git["git_commit"],
        "git.dirty": git["git_dirty"],
        "data.sha256": data_sha256,
        "host": socket.gethostname(),
        "device": device,
        "python": platform.python_version(),
        "torch": version("torch"),
        "lightning": version("lightning"),
        "trainyard": __version__,
    }


def dvc_data_version(root: str | os.PathLike[str] = ".", out: str = "data/prepared") -> str:
    """DVC's hash of ``out`` as recorded in dvc.lock (``<md5>.dir``), or "" if not recorded."""

    lock = Path(root) / "dvc.lock"
    if not lock.is_file():
        return ""
    stages = (yaml.safe_load(lock.read_text()) or {}).get("stages", {})
    for stage in stages.values():
        for entry in stage.get("outs", []):
            if entry.get("path") == out:
                return str(entry.get("md5", ""))
    return ""
