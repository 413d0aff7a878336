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


def pipeline_writes(root: str | os.PathLike[str] = ".") -> tuple[str, ...]:
    """What `dvc repro` itself rewrites: dvc.lock and every stage's outs, metrics and plots
    in dvc.yaml (a templated path counts from its folder: ``predictions/${key}.parquet`` is
    ``predictions/``)."""
    try:
        stages = (yaml.safe_load((Path(root) / "dvc.yaml").read_text()) or {}).get("stages")
    except (OSError, yaml.YAMLError, AttributeError):
        return ("dvc.lock",)
    paths = ["dvc.lock"]
    for stage in (stages or {}).values():
        body = stage.get("do", stage) if isinstance(stage, dict) else None
        if not isinstance(body, dict):
            continue  # not a stage DVC would run; DVC itself says so
        for kind in ("outs", "metrics", "plots"):
            for entry in body.get(kind) or ():
                path = next(iter(entry)) if isinstance(entry, dict) else str(entry)
                if "${" in path:
                    path = path[: path.index("${")].rpartition("/")[0] + "/"
                if path.strip("/"):
                    paths.append(path)
    return tuple(paths)


def code_changes(porcelain: str, writes: tuple[str, ...]) -> list[str]:
    """The paths of ``git status --porcelain`` that are not the pipeline's own outputs."""
    # "XY path" or "XY old -> new"; the status letters may have lost a leading space
    changed = [
        line.split(maxsplit=1)[-1].split(" -> ")[-1].strip('"')
        for line in porcelain.splitlines()
        if line.strip()
    ]
    return [
        p
        for p in changed
        if p and not any(p == w.rstrip("/") or p.startswith(w.rstrip("/") + "/") for w in writes)
    ]


def git_state(root: str | os.PathLike[str] = ".") -> dict[str, str]:
    """Commit and dirtiness of the repository (empty values outside a git checkout). Dirty
    means a change to what reproduces the run (code, params, dvc.yaml): the pipeline's own
    outputs, which every `dvc repro` rewrites before training ends, do not count."""

    def git(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=True
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    dirty: list[str] = []
    if status:  # a clean tree needs neither dvc.yaml nor a second git call
        # git names paths from its top folder; a DVC project may sit below it (--subdir)
        below = git("rev-parse", "--show-prefix")
        dirty = code_changes(status, tuple(below + w for w in pipeline_writes(root)))
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
