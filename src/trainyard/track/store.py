"""Where a stage's MLflow runs go, and whether that store can be used: the tracking URI (the
repository's embedded sqlite store, also from DVC's temporary workspaces), its lock, a fast
reachability and sign-in check, the experiments, and a client for the layers above.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import os
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlflow
from mlflow.exceptions import MlflowException

from trainyard.core.errors import TrackingError

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
            try:
                mlflow.MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
            except MlflowException as err:
                if "database schema" not in err.message:
                    raise
                raise TrackingError(schema_mismatch(db, err.message)) from None
    elif uri.startswith("file:") or "://" not in uri:
        path = Path(uri.removeprefix("file://").removeprefix("file:"))
        if not path.parent.is_dir():
            raise TrackingError(f"MLFLOW_TRACKING_URI={uri}: folder {path.parent} does not exist")


def schema_mismatch(db: Path, message: str) -> str:
    """What to do when this MLflow cannot read the store ``db``'s schema. A newer MLflow
    upgrades a store's tables when it opens them (a venv made after an MLflow release, a
    teammate's), after which an older one cannot read it, and MLflow's own advice
    (``mlflow db upgrade``) cannot help: this environment's MLflow must be upgraded."""
    from alembic.script import ScriptDirectory
    from alembic.util import CommandError

    found = re.search(r"found version (\w+)", message)
    revision = found.group(1) if found else ""
    try:  # a revision this MLflow's own migrations know: the store is the older one
        migrations = Path(mlflow.__file__).parent / "store" / "db_migrations"
        older = ScriptDirectory(str(migrations)).get_revision(revision) is not None
    except CommandError:  # "Can't locate revision": a newer MLflow's
        older = False
    if older:
        return (
            f"the MLflow store {db} was written by an older MLflow than this environment's "
            f"({mlflow.__version__}): back it up, then run `mlflow db upgrade sqlite:///{db}`"
        )
    return (
        f"the MLflow store {db} was written by a newer MLflow than this environment's "
        f"({mlflow.__version__}; schema {revision or 'unknown'}): upgrade MLflow here "
        "(`pip install -U 'mlflow[auth]'` in this environment); `mlflow db upgrade` cannot "
        "make a store older"
    )


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


# The client type, for the layers that hold one (train, experiments) without importing MLflow.
TrackingClient = mlflow.MlflowClient


def tracking_client(uri: str | None = None) -> TrackingClient:
    """An MLflow client of the store ``uri``; with none, the one ``open_run`` pointed
    MLflow at (``MLFLOW_TRACKING_URI`` or MLflow's default before that)."""
    return mlflow.MlflowClient(tracking_uri=uri)


def count_runs(uri: str, filter_string: str = "") -> int:
    """How many runs of every experiment in the store ``uri`` match ``filter_string``."""
    client = mlflow.MlflowClient(tracking_uri=uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    return len(client.search_runs(experiments, filter_string)) if experiments else 0
