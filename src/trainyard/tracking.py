"""MLflow plumbing: where runs go, a fast reachability check, and the run handed between stages."""

from __future__ import annotations

import json
import logging
import os
import platform
import socket
import subprocess
import urllib.error
import urllib.request
import warnings
from pathlib import Path
from typing import Any

from trainyard.errors import TrackingError
from trainyard.io import atomic_write_json

log = logging.getLogger(__name__)

RUN_FILE = "train.json"  # written by train, read by export and evaluate


def resolve_tracking_uri(root: str | os.PathLike[str] = ".") -> str:
    """``MLFLOW_TRACKING_URI`` if set, else the embedded sqlite store ``<root>/mlflow.db``."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    if uri:
        return uri
    return f"sqlite:///{Path(root).resolve() / 'mlflow.db'}"


def _limit_http_retries() -> None:
    # MLflow's default (7 retries, backoff 2) turns a dead server into a multi-minute hang.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")


def check_tracking_uri(uri: str, timeout: float = 5.0) -> None:
    """Fail within ``timeout`` seconds if the tracking store cannot be used."""
    _limit_http_retries()
    if uri.startswith(("http://", "https://")):
        url = uri.rstrip("/") + "/health"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as resp:
                if resp.status != 200:
                    raise TrackingError(
                        f"MLflow tracking server {uri}: /health answered {resp.status}"
                    )
        except (urllib.error.URLError, OSError, TimeoutError) as err:
            reason = getattr(err, "reason", err)
            raise TrackingError(
                f"MLflow tracking server {uri} is not reachable ({reason}). Start it "
                "(`mlflow server --port …`) or unset MLFLOW_TRACKING_URI to use the embedded "
                "store (mlflow.db in the repository)."
            ) from None
    elif uri.startswith("sqlite:///"):
        db = Path(uri.removeprefix("sqlite:///"))
        if not db.parent.is_dir():
            raise TrackingError(
                f"MLFLOW_TRACKING_URI={uri}: folder {db.parent} does not exist; create it or "
                "unset MLFLOW_TRACKING_URI"
            )
    elif uri.startswith("file:") or "://" not in uri:
        path = Path(uri.removeprefix("file://").removeprefix("file:"))
        if not path.parent.is_dir():
            raise TrackingError(f"MLFLOW_TRACKING_URI={uri}: folder {path.parent} does not exist")


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
    import lightning
    import torch

    from trainyard import __version__

    git = git_state(root)
    return {
        "mlflow.source.git.commit": git["git_commit"],
        "git.commit": git["git_commit"],
        "git.dirty": git["git_dirty"],
        "data.sha256": data_sha256,
        "host": socket.gethostname(),
        "device": device,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "trainyard": __version__,
    }


def write_run_file(path: str | os.PathLike[str], info: dict[str, Any]) -> None:
    atomic_write_json(path, info)


def read_run_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise TrackingError(f"{path}: missing; run `dvc repro train` first")
    info = json.loads(path.read_text())
    if "run_id" not in info:
        raise TrackingError(f"{path}: has no run_id; rerun the train stage")
    return info


def open_run(info: dict[str, Any], root: str | os.PathLike[str] = ".") -> str:
    """Point MLflow at the current store, check the train run is there, return its id."""
    import mlflow
    from mlflow.exceptions import MlflowException

    uri = resolve_tracking_uri(root)
    check_tracking_uri(uri)
    mlflow.set_tracking_uri(uri)
    try:
        mlflow.get_run(info["run_id"])
    except MlflowException as err:
        raise TrackingError(
            f"MLflow run {info['run_id']} (from {RUN_FILE}) is not in the tracking store {uri}: "
            f"{err.message}. Rerun train with the same MLFLOW_TRACKING_URI."
        ) from None
    return info["run_id"]


def dvc_data_version(root: str | os.PathLike[str] = ".", out: str = "data/prepared") -> str:
    """DVC's hash of ``out`` as recorded in dvc.lock (``<md5>.dir``), or "" if not recorded."""
    import yaml

    lock = Path(root) / "dvc.lock"
    if not lock.is_file():
        return ""
    stages = (yaml.safe_load(lock.read_text()) or {}).get("stages", {})
    for stage in stages.values():
        for entry in stage.get("outs", []):
            if entry.get("path") == out:
                return str(entry.get("md5", ""))
    return ""


class SystemMetrics:
    """MLflow's own system-metrics monitor (CPU, RAM, disk, network; GPU via NVML) on a run
    created outside the fluent API (Lightning's MLFlowLogger creates its run by client)."""

    def __init__(
        self,
        run_id: str,
        tracking_uri: str,
        interval_s: float,
        enabled: bool,
        resume: bool = False,
    ) -> None:
        self.monitor = None
        if not enabled:
            return
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        # resume: a resumed run's samples continue after its last step, not over it
        self.monitor = SystemMetricsMonitor(
            run_id, sampling_interval=interval_s, tracking_uri=tracking_uri, resume_logging=resume
        )

    def __enter__(self) -> SystemMetrics:
        if self.monitor is not None:
            self.monitor.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.monitor is None:
            return
        self.monitor.finish()  # stops the sampling thread, flushes what it published
        # MLflow publishes only after a whole sampling interval: the samples of the last,
        # partial interval were dropped, and a fit shorter than one interval logged no system
        # metrics at all. Publish what was collected since the last publish.
        try:
            metrics = self.monitor.aggregate_metrics()
            if metrics:
                self.monitor.publish_metrics(metrics)
                self.monitor.mlflow_logger.flush()
        except Exception as err:  # a tracking hiccup must not fail a finished training
            log.warning("could not log the last system metrics sample: %s", err)


def log_dataset_inputs(
    client: Any,
    run_id: str,
    splits: dict[str, tuple[Any, Any]],
    digest: str,
    source: str,
    name: str = "dataset",
) -> None:
    """Record the splits as MLflow dataset inputs (name, digest, source, schema)."""
    import mlflow.data
    from mlflow.entities import DatasetInput, InputTag

    inputs = []
    for split, (images, labels) in splits.items():
        with warnings.catch_warnings():
            # "source can be interpreted in multiple ways": both candidates are the same class.
            warnings.simplefilter("ignore", UserWarning)
            dataset = mlflow.data.from_numpy(
                images,
                targets=labels,
                source=source,
                name=f"{name}-{split}",
                digest=f"{digest[:16]}-{split}",
            )
        context = {"train": "training", "val": "validation"}.get(split, split)
        inputs.append(
            DatasetInput(
                dataset._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", context)]
            )
        )
    client.log_inputs(run_id, datasets=inputs)
