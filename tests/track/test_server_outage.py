"""A real `mlflow server` killed in the middle of a training (docs/faults.md, "The tracking
server goes away"): the fit goes on and keeps its metrics; the run is completed when the
server returns, during the fit or within the bounded wait at its end; a server still away
then fails the stage with one line, and the rerun completes the run without training."""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from trainyard.core.handoffs import TRAIN_RECORD, TrainRecord
from trainyard.track.outage import unreachable

from conftest import (
    VENV_BIN,
    dvc,
    free_port,
    pause_env,
    set_params,
    small_pipeline_repo,
    wait_paused,
)

pytestmark = pytest.mark.slow

GONE = re.compile(
    r"\[train\] WARNING MLflow server (\S+) not reachable since epoch (\d+) \(connection "
    r"refused\): training goes on, metrics are kept and sent when it answers"
)
BACK = re.compile(r"\[train\] MLflow server (\S+) answers again: (\d+) buffered metric values sent")


class Server:
    """`mlflow server` on a fixed loopback port and sqlite backend: killed (SIGKILL, as a
    crashed host) and started again on the same port with the same store."""

    def __init__(self, root: Path) -> None:
        self.root, self.port = root, free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> float:
        """Start it; the wall time (s) it first answered."""
        log = open(self.root / "server.log", "a")  # noqa: SIM115 - the server holds it
        self.proc = subprocess.Popen(
            [
                str(VENV_BIN / "mlflow"),
                "server",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--backend-store-uri",
                f"sqlite:///{self.root}/mlflow.db",
                "--artifacts-destination",
                str(self.root / "artifacts"),
                "--workers",
                "1",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return time.time()
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"mlflow server did not start:\n{self.log()}")
            time.sleep(0.3)

    def kill(self) -> float:
        """SIGKILL its process group; the wall time it was gone."""
        assert self.proc is not None
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        return time.time()

    def log(self) -> str:
        return (self.root / "server.log").read_text()[-3000:]


@pytest.fixture(scope="module")
def prepared(fashion_dir, tmp_path_factory) -> Path:
    """The small pipeline with prepared data: 3 short epochs (5 steps of 32 images, a
    200-image val split), system metrics every second."""
    repo = small_pipeline_repo(tmp_path_factory.mktemp("outage") / "trainyard", fashion_dir)
    set_params(
        repo,
        data={"limit": 1000, "val_size": 200},
        train={
            "max_epochs": 3,
            "batch_size": 32,
            "limit_train_batches": 5,
            "precision": "32-true",
            "early_stopping_patience": 3,
        },
    )
    dvc(repo, "repro", "prepare")
    return repo


@pytest.fixture
def repo(prepared, tmp_path) -> Path:
    """A copy of the prepared pipeline (its own resume folder and outputs)."""

    def dvc_tmp(folder: str, names: list[str]) -> list[str]:
        return ["tmp"] if Path(folder) == prepared / ".dvc" else []

    return Path(shutil.copytree(prepared, tmp_path / "trainyard", symlinks=True, ignore=dvc_tmp))


@pytest.fixture
def server(tmp_path):
    srv = Server(tmp_path)
    srv.start()
    yield srv
    srv.kill()


class Training:
    """The train stage as a process, its stderr read line by line as it comes."""

    def __init__(self, repo: Path, **env: str) -> None:
        # It pauses once epoch 1 is checkpointed: the server is killed mid-fit on any machine.
        self.paused = repo.parent / "epoch-1.paused"
        self.proc = subprocess.Popen(
            [
                "python",
                "-m",
                "trainyard.stages.train",
                "--data",
                "data/prepared",
                "--out",
                "models",
            ],
            cwd=repo,
            env=pause_env("train.checkpoint_saved.last.ckpt", self.paused, **env),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self._new: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))
            self._new.put(line)
        self._new.put(None)

    def server_killed_after_epoch_1(self, server: Server) -> float:
        """Kill ``server`` while the fit is paused after epoch 1, then let the fit go on;
        the time it was killed."""
        wait_paused(self.paused, self.proc, lambda: "\n".join(self.lines))
        gone = server.kill()
        self.paused.unlink()
        return gone

    def wait_for(self, text: str, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._new.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                line = ""
            if line is None or time.monotonic() > deadline:
                raise AssertionError(f"no line with {text!r}:\n" + "\n".join(self.lines[-30:]))
            if text in line:
                return

    def finish(self, timeout: float = 300) -> int:
        rc = self.proc.wait(timeout=timeout)
        deadline = time.monotonic() + 10
        while self._new.get(timeout=max(0.1, deadline - time.monotonic())) is not None:
            pass  # the reader's last lines
        return rc

    def matching(self, pattern: re.Pattern[str]) -> list[re.Match[str]]:
        return [m for line in self.lines if (m := pattern.search(line))]


def resume_folder(repo: Path) -> Path:
    (folder,) = (repo / ".cache/train-resume").iterdir()
    return folder


def test_server_back_during_the_fit_loses_nothing(repo, server):
    from mlflow.tracking import MlflowClient

    train = Training(repo, MLFLOW_TRACKING_URI=server.uri, TRAINYARD_TRACKING_WAIT_S="120")
    gone = train.server_killed_after_epoch_1(server)
    train.wait_for("not reachable since epoch")
    time.sleep(2)  # away a while: the system metrics (one a second) keep theirs
    back = server.start()
    rc = train.finish()
    log = "\n".join(train.lines)
    assert rc == 0, log[-4000:]

    (warning,) = train.matching(GONE)  # said once, naming the server and the epoch
    assert warning[1] == server.uri and warning[2] in ("1", "2"), warning[0]
    (answer,) = train.matching(BACK)
    assert int(answer[2]) > 0
    assert "Traceback" not in log

    run_id = TrainRecord.read(repo / TRAIN_RECORD).run_id
    client = MlflowClient(tracking_uri=server.uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    val = client.get_metric_history(run_id, "val/acc")
    assert len({m.step for m in val}) == 3  # every epoch's, none lost
    # The values logged while the server was away keep their own time, not the send's.
    cpu = client.get_metric_history(run_id, "system/cpu_utilization_percentage")
    assert any(gone * 1000 < m.timestamp < back * 1000 for m in cpu)
    gap = run.data.tags["trainyard.tracking_gap"]
    assert re.fullmatch(r"\S+Z to \S+Z: \d+ values kept", gap), gap
    assert run.data.tags["train.stopped_by"] == "max_epochs"
    with pytest.raises(Exception) as refused:  # a 404 from a live server
        client.get_run("0" * 32)
    assert unreachable(refused.value) is None  # not an outage: raised as before
    assert not (repo / ".cache/train-resume").exists() or not any(
        (repo / ".cache/train-resume").iterdir()
    )


def test_server_still_away_fails_at_the_end_and_the_rerun_completes(repo, server):
    from mlflow.tracking import MlflowClient

    record_before = (repo / TRAIN_RECORD).read_text()  # the copy's committed one
    train = Training(repo, MLFLOW_TRACKING_URI=server.uri, TRAINYARD_TRACKING_WAIT_S="3")
    train.server_killed_after_epoch_1(server)
    train.wait_for("epoch 3/3 train/loss")  # the fit went on to its end
    ended = time.monotonic()
    rc = train.finish()
    waited = time.monotonic() - ended
    log = "\n".join(train.lines)
    assert rc == 1, log[-4000:]
    assert waited < 40, waited  # the 3 s wait, not MLflow's retries over and over
    assert len(train.matching(GONE)) == 1
    errors = [line for line in train.lines if "error:" in line]
    assert len(errors) == 1, errors
    assert "Traceback" not in log
    folder = resume_folder(repo)
    saved = folder / "pending-metrics.json"
    kept = f".cache/train-resume/{folder.name}/"
    assert re.fullmatch(
        f"trainyard train: error: MLflow server {re.escape(server.uri)} still not reachable "
        f"after training finished \\(epoch 3/3\\): the checkpoint is kept in {kept}, "
        f"[1-9][0-9]* metric values are saved in {kept}pending-metrics.json; rerun `dvc repro` "
        "when the server is back: it resumes the finished fit \\(no retraining\\) and sends them",
        errors[0],
    ), errors[0]
    assert (folder / "last.ckpt").is_file() and saved.is_file()
    assert (repo / TRAIN_RECORD).read_text() == record_before  # no output of a failed stage
    run_id = json.loads((folder / "state.json").read_text())["run_id"]

    server.start()
    rerun = dvc(repo, "repro", "train", MLFLOW_TRACKING_URI=server.uri)
    out = rerun.stdout + rerun.stderr
    assert "the fit finished before (epoch 3/3" in out, out[-4000:]
    assert not re.search(r"epoch \d/3 (train/loss|step)", out), out[-4000:]  # no training
    assert len(BACK.findall(out)) == 1
    assert TrainRecord.read(repo / TRAIN_RECORD).run_id == run_id
    assert (repo / "models/history.csv").read_text().count("\n") == 4  # header + 3 epochs

    client = MlflowClient(tracking_uri=server.uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert len({m.step for m in client.get_metric_history(run_id, "val/acc")}) == 3
    assert "trainyard.tracking_gap" in run.data.tags
    names = {a.path for a in client.list_artifacts(run_id, "checkpoints")}
    assert names == {"checkpoints/best.ckpt"}
    assert not saved.exists()


def test_a_dead_server_costs_one_call_then_log_calls_do_not_wait(tmp_path, caplog, monkeypatch):
    """Against a port nothing listens on (a real refusal): the first call pays MLflow's
    retries and opens the gap with one warning; later calls only keep their values."""
    import mlflow

    from trainyard.track.outage import ServerGap

    monkeypatch.delenv("TRAINYARD_TRACKING_WAIT_S", raising=False)
    # what track.store sets for every stage (_limit_http_retries)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    uri = f"http://127.0.0.1:{free_port()}"
    gap = ServerGap(uri, "0123456789abcdef")
    t0 = time.monotonic()
    gap.epoch = 3
    gap.log_metrics({"train/loss": 1.0}, step=1)
    assert time.monotonic() - t0 < 20  # MLFLOW_HTTP_REQUEST_MAX_RETRIES=2: seconds
    assert gap.away
    t0 = time.monotonic()
    for step in range(2, 502):
        gap.log_metrics({"train/loss": 1.0 / step}, step=step)
    assert time.monotonic() - t0 < 1.0  # no call to the server in between
    gone = [r.getMessage() for r in caplog.records if "not reachable since" in r.getMessage()]
    assert gone == [
        f"MLflow server {uri} not reachable since epoch 3 (connection refused): training goes "
        "on, metrics are kept and sent when it answers"
    ]
    assert gap.kept == 501 and gap.wait_s == 60.0

    saved = tmp_path / "pending-metrics.json"
    assert gap.save(saved) == 501
    again = ServerGap(uri, "0123456789abcdef")
    assert again.take_saved(saved) == 501 and again.away and not saved.exists()
    assert [(m.step, m.value) for m in again.metrics[:2]] == [(1, 1.0), (2, 0.5)]
    with pytest.raises(mlflow.exceptions.MlflowException) as refused:
        mlflow.MlflowClient(uri).get_run("0123456789abcdef")
    assert unreachable(refused.value) == "connection refused"
    assert unreachable(ValueError("a bug")) is None


def test_a_bad_wait_value_stops_before_training(monkeypatch):
    from trainyard.core.errors import TrackingError
    from trainyard.track.outage import wait_seconds

    monkeypatch.setenv("TRAINYARD_TRACKING_WAIT_S", "soon")
    with pytest.raises(TrackingError, match=r"TRAINYARD_TRACKING_WAIT_S='soon': expected"):
        wait_seconds()
    monkeypatch.setenv("TRAINYARD_TRACKING_WAIT_S", "2.5")
    assert wait_seconds() == 2.5
