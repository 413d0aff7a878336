"""Tracking store checks: a dead server fails fast with its URI named."""

from __future__ import annotations

import socket

import pytest

from trainyard.errors import TrackingError
from trainyard.tracking import check_tracking_uri, resolve_tracking_uri


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
