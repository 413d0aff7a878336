"""Tracking store checks: a dead server fails fast with its URI named."""

from __future__ import annotations

import socket

import pytest

from trainyard.core.errors import TrackingError
from trainyard.track.runs import check_tracking_uri, resolve_tracking_uri


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again on exit: nothing listens there


@pytest.mark.timeout(30)
def test_unreachable_server_is_named():
    uri = f"http://127.0.0.1:{_dead_port()}"
    with pytest.raises(TrackingError, match=rf"{uri} is not reachable"):
        check_tracking_uri(uri, timeout=3)


def test_sqlite_in_missing_folder(tmp_path):
    with pytest.raises(TrackingError, match="does not exist"):
        check_tracking_uri(f"sqlite:///{tmp_path}/nope/mlflow.db")


def test_default_is_embedded_sqlite(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert resolve_tracking_uri(tmp_path) == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://example:5000")
    assert resolve_tracking_uri(tmp_path) == "http://example:5000"


def test_a_run_shorter_than_one_sampling_interval_still_gets_system_metrics(tmp_path):
    # MLflow publishes only after a whole interval; the last partial one is published on
    # exit, so a short fit (or the tail of any fit) is not lost.
    import time

    from mlflow.tracking import MlflowClient

    from trainyard.track.runs import SystemMetrics

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("short"))
    with SystemMetrics(run.info.run_id, uri, interval_s=30.0, enabled=True):
        time.sleep(0.3)
    metrics = client.get_run(run.info.run_id).data.metrics
    assert "system/cpu_utilization_percentage" in metrics, sorted(metrics)
