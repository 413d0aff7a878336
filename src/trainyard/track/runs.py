"""MLflow plumbing: where runs go, a fast reachability check, lineage, system metrics, and
the train run reopened by the later stages."""

from __future__ import annotations

import base64
import contextlib
import fcntl
import gc
import logging
import os
import platform
import signal
import socket
import subprocess
import traceback
import urllib.error
import urllib.request
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import mlflow
import yaml
from mlflow.entities import Param
from mlflow.exceptions import MlflowException
from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

from trainyard import __version__
from trainyard.core.errors import Terminated, TrackingError
from trainyard.track.outage import GapMonitor, ServerGap
from trainyard.track.records import TRAIN_RECORD

log = logging.getLogger(__name__)


def quiet_mlflow() -> None:
    """MLflow's chatter off, at its source; its warnings and errors stay.

    - "🏃 View run ... at: <url>" / "🧪 View experiment at: <url>", written to stdout at
      every run's end on a tracking server: MLflow's own switch (an explicit
      ``MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT=false`` brings them back). train's last line
      names the run and the store.
    - the system-metrics monitor's INFO lines (started, stopping, terminated, "Skip logging
      GPU metrics"), four a training; its failures are warnings and still show;
    - "Creating initial MLflow database tables..." / "Updating database tables" on a new
      sqlite store.
    """
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    for name in ("mlflow.system_metrics", "mlflow.store.db.utils"):
        logging.getLogger(name).setLevel(logging.WARNING)


quiet_mlflow()  # at import: whoever uses MLflow through trainyard imports this module

# Why a run ended other than FINISHED (Ctrl-C, SIGTERM, an error), set by every stage that
# ends a run early; kept as PREVIOUS_END_TAG once the run is finished again.
END_REASON_TAG = "trainyard.end_reason"
PREVIOUS_END_TAG = "trainyard.previous_end"


def carry_end_reason(client: Any, run_id: str, tags: dict[str, str]) -> None:
    """A run going on again after an early end: its reason becomes the previous one, so a
    run that later ends FINISHED carries no stale reason but keeps the history."""
    if END_REASON_TAG in tags:
        client.set_tag(run_id, PREVIOUS_END_TAG, tags[END_REASON_TAG])
        client.delete_tag(run_id, END_REASON_TAG)


# Set by DVC for every stage command: DVC_ROOT is the repository, also when the stage runs
# in a temporary copy of it (dvc exp run --queue / --temp, dvc queue start -j N, under
# .dvc/tmp/exps/), which DVC deletes afterwards; the experiment's name and baseline commit.
DVC_ROOT, DVC_EXP_NAME, DVC_EXP_BASELINE_REV = "DVC_ROOT", "DVC_EXP_NAME", "DVC_EXP_BASELINE_REV"
STORE_FILE, ARTIFACTS_DIR = "mlflow.db", "mlruns"


def store_root(root: str | os.PathLike[str] = ".") -> Path:
    """The repository whose embedded store a stage writes to: ``DVC_ROOT`` when DVC runs
    the stage (for a queued or ``--temp`` experiment, the repository, not the temporary
    copy the stage runs in), else ``root``."""
    dvc_root = os.environ.get(DVC_ROOT, "").strip()
    if dvc_root and Path(dvc_root).is_dir():
        return Path(dvc_root).resolve()
    return Path(root).resolve()


def in_temp_workspace(root: str | os.PathLike[str] = ".") -> bool:
    """True when DVC runs this stage in a temporary copy of the repository (a queued or
    ``--temp`` experiment): what it leaves in ``root`` is deleted after the experiment."""
    return store_root(root) != Path(root).resolve()


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


def resolve_tracking_uri(root: str | os.PathLike[str] = ".") -> str:
    """``MLFLOW_TRACKING_URI`` if set, else the embedded sqlite store of the repository
    (``store_root``): ``<repo>/mlflow.db``, whichever copy of the workspace runs."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    if uri:
        return uri
    return f"sqlite:///{store_root(root) / STORE_FILE}"


# MLflow 3's UI opens an experiment without this tag in its GenAI view (traces, "Detect
# issues"); this value (the UI's CUSTOM_MODEL_DEVELOPMENT) opens it on its training runs.
EXPERIMENT_KIND_TAG, MODEL_TRAINING = "mlflow.experimentKind", "custom_model_development"
KIND = {EXPERIMENT_KIND_TAG: MODEL_TRAINING}


def ensure_experiment(uri: str, name: str) -> str:
    """The id of experiment ``name``, created if missing; safe when several runs of a
    sweep (``dvc queue start -j N``, tune workers) create it at once. It is tagged as
    model training (``mlflow.experimentKind``), an existing one too if it has no kind yet.

    On the embedded store its artifacts go to ``<repo>/mlruns`` beside ``mlflow.db``:
    MLflow's default is ``./mlruns`` of the process that creates the experiment, and for
    a queued experiment that is the temporary copy DVC deletes.
    """
    with store_lock(uri):
        client = mlflow.MlflowClient(tracking_uri=uri)
        found = client.get_experiment_by_name(name)
        if found is not None:
            return _kind_set(client, found)
        location = None
        if uri.startswith("sqlite:///"):
            location = (Path(uri.removeprefix("sqlite:///")).parent / ARTIFACTS_DIR).as_uri()
        try:
            return str(client.create_experiment(name, artifact_location=location, tags=KIND))
        except MlflowException as err:  # another process (a server's client) was first
            found = client.get_experiment_by_name(name)
            if found is None:
                raise TrackingError(f"MLflow experiment {name!r}: {err.message}") from None
            return _kind_set(client, found)


def _kind_set(client: mlflow.MlflowClient, experiment: Any) -> str:
    """An experiment made before trainyard tagged its kind (or by hand) gets the tag now;
    a kind someone chose in the UI stays. Returns the experiment's id."""
    if EXPERIMENT_KIND_TAG not in experiment.tags:
        client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING)
    return str(experiment.experiment_id)


@contextlib.contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """Exclusive among processes on this machine, for an embedded sqlite store: its first
    use creates the tables (two queued experiments starting together both tried, and one
    failed), and an experiment is looked up, then created. Other stores: no lock."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    lock_path = Path(uri.removeprefix("sqlite:///") + ".lock")
    with open(lock_path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _limit_http_retries() -> None:
    # MLflow's default (7 retries, backoff 2) turns a dead server into a multi-minute hang.
    # A server lost during a fit costs one such call; then track.outage keeps the metrics.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")


def check_tracking_uri(uri: str, timeout: float = 5.0) -> None:
    """Fail within ``timeout`` seconds if the tracking store cannot be used."""
    _limit_http_retries()
    if uri.startswith(("http://", "https://")):
        _check_server(uri.rstrip("/"), timeout)
    elif uri.startswith("sqlite:///"):
        db = Path(uri.removeprefix("sqlite:///"))
        if not db.parent.is_dir():
            raise TrackingError(
                f"MLFLOW_TRACKING_URI={uri}: folder {db.parent} does not exist; create it or "
                "unset MLFLOW_TRACKING_URI"
            )
        # The store's first use creates (or upgrades) its tables: once, under the lock.
        # Two queued experiments starting together both ran the migrations, and one failed
        # ("table _alembic_tmp_tags already exists").
        with store_lock(uri):
            mlflow.MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
    elif uri.startswith("file:") or "://" not in uri:
        path = Path(uri.removeprefix("file://").removeprefix("file:"))
        if not path.parent.is_dir():
            raise TrackingError(f"MLFLOW_TRACKING_URI={uri}: folder {path.parent} does not exist")


def _check_server(uri: str, timeout: float) -> None:
    """The server answers /health, and a signed-in read (one experiment) with the
    credentials MLflow itself will send: ``MLFLOW_TRACKING_USERNAME``/``PASSWORD`` (basic
    auth) or ``MLFLOW_TRACKING_TOKEN`` (bearer). Each failure is one line saying which."""
    try:
        with urllib.request.urlopen(f"{uri}/health", timeout=timeout) as resp:
            if resp.status != 200:
                raise TrackingError(f"MLflow tracking server {uri}: /health answered {resp.status}")
    except (urllib.error.URLError, OSError, TimeoutError) as err:
        reason = getattr(err, "reason", err)
        raise TrackingError(
            f"MLflow tracking server {uri} is not reachable ({reason}). Start it "
            "(`mlflow server --port …`) or unset MLFLOW_TRACKING_URI to use the embedded "
            "store (mlflow.db in the repository)."
        ) from None
    user = os.environ.get("MLFLOW_TRACKING_USERNAME", "")
    password = os.environ.get("MLFLOW_TRACKING_PASSWORD", "")
    token = os.environ.get("MLFLOW_TRACKING_TOKEN", "")
    request = urllib.request.Request(f"{uri}/api/2.0/mlflow/experiments/search?max_results=1")
    if user or password:
        pair = base64.b64encode(f"{user}:{password}".encode()).decode()
        request.add_header("Authorization", f"Basic {pair}")
    elif token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        # A busy server's first API call can take seconds (its workers load lazily).
        with urllib.request.urlopen(request, timeout=max(timeout, 30)):
            return
    except urllib.error.HTTPError as err:
        code = err.code
    except (urllib.error.URLError, OSError, TimeoutError) as err:
        raise TrackingError(
            f"MLflow tracking server {uri} answers /health but not its API "
            f"({getattr(err, 'reason', err)})"
        ) from None
    who = f"user {user!r}" if user else ("the token" if token else "no credentials")
    if code == 401 and not (user or password or token):
        raise TrackingError(
            f"MLflow tracking server {uri} asks for a sign-in (HTTP 401): set "
            "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD"
        )
    if code == 401:
        raise TrackingError(
            f"MLflow tracking server {uri} refused the sign-in of {who} (HTTP 401: wrong "
            "password or unknown user): check MLFLOW_TRACKING_USERNAME / "
            "MLFLOW_TRACKING_PASSWORD"
        )
    if code == 403:
        raise TrackingError(
            f"MLflow tracking server {uri}: {who} may not read experiments (HTTP 403): "
            "ask the server's admin for a permission"
        )
    raise TrackingError(f"MLflow tracking server {uri}: its API answered HTTP {code}")


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


def open_run(run_id: str, root: str | os.PathLike[str] = ".") -> str:
    """Point MLflow at the current store, check the train run ``run_id`` is there, return it."""

    uri = resolve_tracking_uri(root)
    check_tracking_uri(uri)
    mlflow.set_tracking_uri(uri)
    try:
        mlflow.get_run(run_id)
    except MlflowException as err:
        raise TrackingError(
            f"MLflow run {run_id} (from {TRAIN_RECORD.name}) is not in the tracking store "
            f"{uri}: {err.message}. Rerun train with the same MLFLOW_TRACKING_URI."
        ) from None
    return run_id


@contextlib.contextmanager
def logging_into(run_id: str, stage: str) -> Iterator[None]:
    """Reopen the train run ``run_id`` as the active run for a later stage (export, evaluate).

    MLflow sets the run RUNNING while it is open; it ends FINISHED, or FAILED on an error.
    A Ctrl-C ends it KILLED with a ``trainyard.end_reason`` tag naming the stage, as a Ctrl-C
    in train does: MLflow's own context manager would call it FAILED, as if the training
    had failed. The next successful run of the stage ends it FINISHED again and keeps the
    old reason as ``trainyard.previous_end`` (carry_end_reason).
    """

    try:
        # Inside the try: a Ctrl-C that lands within start_run, after it has set the run
        # RUNNING, must not leave it RUNNING.
        mlflow.start_run(run_id=run_id)
        carry_end_reason(mlflow.MlflowClient(), run_id, mlflow.get_run(run_id).data.tags)
        yield
    except KeyboardInterrupt as err:
        release_interrupted_store(err)
        what = "SIGTERM" if isinstance(err, Terminated) else "Ctrl-C (SIGINT)"
        _end_run(run_id, "KILLED", f"{what} in {stage}")
        raise
    except BaseException:
        _end_run(run_id, "FAILED")
        raise
    mlflow.end_run("FINISHED")


def log_to_open_run(
    metrics: dict[str, float] | None = None,
    tags: dict[str, str] | None = None,
    artifacts: dict[Path, str] | None = None,
) -> None:
    """Into the run ``logging_into`` holds open: ``metrics``, ``tags``, and each file of
    ``artifacts`` into its artifact folder (path -> folder)."""
    if metrics:
        mlflow.log_metrics(metrics)
    if tags:
        mlflow.set_tags(tags)
    for path, folder in (artifacts or {}).items():
        mlflow.log_artifact(str(path), folder)


# The client type, for the layers that hold one (train, experiments) without importing MLflow.
TrackingClient = mlflow.MlflowClient


def tracking_client(uri: str | None = None) -> TrackingClient:
    """An MLflow client of the store ``uri``; with none, the one ``open_run`` pointed
    MLflow at (``MLFLOW_TRACKING_URI`` or MLflow's default before that)."""
    return mlflow.MlflowClient(tracking_uri=uri)


def log_new_params(client: TrackingClient, run_id: str, flat: dict[str, Any]) -> list[str]:
    """Log the params ``run_id`` does not have yet (values cut to MLflow's 250 characters);
    MLflow params never change, so return the keys it has with another value."""
    have = client.get_run(run_id).data.params
    values = {k: str(v)[:250] for k, v in flat.items()}
    new = [Param(k, v) for k, v in values.items() if k not in have]
    for i in range(0, len(new), 100):
        client.log_batch(run_id, params=new[i : i + 100])
    return sorted(k for k, v in values.items() if k in have and have[k] != v)


def count_runs(uri: str, filter_string: str = "") -> int:
    """How many runs of every experiment in the store ``uri`` match ``filter_string``."""
    client = mlflow.MlflowClient(tracking_uri=uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    return len(client.search_runs(experiments, filter_string)) if experiments else 0


INTERRUPTS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def signals_handled(handler: Any, signals: tuple[int, ...] = INTERRUPTS) -> Iterator[bool]:
    """``handler`` for ``signals`` inside the block, the previous handlers restored after.
    Outside the main thread Python cannot handle signals: they are left alone, and the
    block gets False."""
    try:
        previous = {s: signal.signal(s, handler) for s in signals}
    except ValueError:  # not the main thread
        yield False
        return
    try:
        yield True
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM during a few store writes that belong together, then deliver
    them to the handlers that were in place.

    Ctrl-C raises wherever Python happens to be; inside MLflow's sqlite session code that can
    leave a statement or a transaction holding mlflow.db's write lock, so the clean-up's
    own writes wait out MLflow's 20 s busy timeout (seen in tests/test_interrupt.py). A
    registration's writes take milliseconds: letting them finish and stopping right after is
    both faster and leaves the registry whole. SIGKILL cannot be held; the next registration
    removes what it cut off. Outside the main thread signals cannot be handled: no deferral.
    """
    received: list[int] = []

    def hold(signum: int, frame: Any) -> None:
        received.append(signum)

    try:
        with signals_handled(hold):
            yield
    finally:
        if received:  # once, to the handler that would have had it (KeyboardInterrupt, ...)
            signal.raise_signal(received[0])


def release_interrupted_store(err: BaseException) -> None:
    """Let go of the store after a Ctrl-C, before writing to it again.

    A Ctrl-C that lands while sqlite runs one of MLflow's statements leaves that statement
    half-stepped, holding a lock on mlflow.db until its cursor is freed, and the cursor lives
    on in the frames of the interrupt's traceback. A write from the handler (mark the run
    KILLED, undo a registration) then waits out MLflow's 20 s busy timeout and fails: the
    run stayed RUNNING (seen in tests/test_interrupt.py). Clearing those finished frames
    frees the cursor and its lock.
    """
    traceback.clear_frames(err.__traceback__)
    gc.collect()  # cursors held in reference cycles


def _end_run(run_id: str, status: str, reason: str | None = None) -> None:
    """End ``run_id`` ``status`` on the way out of an error; never raises, so the stage
    reports the error it is handling, not a tracking hiccup on top of it."""

    try:
        client = mlflow.MlflowClient()
        if reason is not None:
            client.set_tag(run_id, END_REASON_TAG, reason)
        active = mlflow.active_run()
        if active is not None and active.info.run_id == run_id:
            mlflow.end_run(status)
        else:  # interrupted inside start_run, before it made the run the active one
            client.set_terminated(run_id, status)
    except Exception as err:
        log.warning("could not mark MLflow run %s %s: %s", run_id, status, err)


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


class SystemMetrics:
    """MLflow's own system-metrics monitor (CPU, RAM, disk, network; GPU via NVML) on a run
    created outside the fluent API (Lightning's MLFlowLogger creates its run by client).
    With ``gap`` (the fit's ``ServerGap``) its samples are kept while the server is away,
    and an outage neither stops the sampling nor prints more than the gap's own line."""

    def __init__(
        self,
        run_id: str,
        tracking_uri: str,
        interval_s: float,
        enabled: bool,
        resume: bool = False,
        gap: ServerGap | None = None,
    ) -> None:
        self.monitor: SystemMetricsMonitor | None = None
        if not enabled:
            return

        # resume: a resumed run's samples continue after its last step, not over it
        if gap is not None:  # samples kept while the server is away (track.outage)
            self.monitor = GapMonitor(gap, interval_s, resume)
            return
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
