"""The Optuna study behind ``trainyard tune`` and its MLflow runs.

- storage: Optuna's RDB storage with heartbeats (a worker that dies mid-trial has its trial
  failed by the next worker), sqlite beside mlflow.db by default;
- a lock file shared by this machine's workers of one study: the trial count and the
  MLflow parent run are decided by one worker at a time;
- the study's MLflow parent run (created once, reopened by every later worker) and the
  ending of a trial's child run (its Optuna state as a tag, pruned and killed trials with
  the reason).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import socket
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlflow
import optuna
import sqlalchemy.engine
import sqlalchemy.exc
from mlflow.entities import Param
from mlflow.exceptions import MlflowException
from optuna.exceptions import ExperimentalWarning, UpdateFinishedTrialError
from optuna.trial import FrozenTrial, Trial, TrialState

from trainyard import __version__
from trainyard.core.config import Params, TuneChoices, TuneParams
from trainyard.core.errors import TrainyardError
from trainyard.track.runs import END_REASON_TAG, carry_end_reason, git_state, store_root

log = logging.getLogger(__name__)

OPTUNA_DB = "optuna.db"
# A trial's worker records a heartbeat every HEARTBEAT_S; one silent for GRACE_S is failed
# by the next worker that starts a trial (a SIGKILL, a lost machine).
HEARTBEAT_S, GRACE_S = 10, 30
# Study user attrs: the MLflow parent run and where it lives, the base params and space of
# the last worker (a rerun on other base params is said, not hidden).
PARENT_ATTR, URI_ATTR = "mlflow_parent_run_id", "mlflow_tracking_uri"
BASE_ATTR, SPACE_ATTR = "base_params", "space"
# Trial user attrs
RUN_ATTR, ERROR_ATTR, WORKER_ATTR = "mlflow_run_id", "error", "worker"
RESUME_ATTR = "resume_folder"  # the fit's checkpoints (.cache/train-resume/<key>)
STATE_TAG, STUDY_TAG, TRIAL_TAG = "optuna.state", "optuna.study", "optuna.trial"
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)


class StudyError(TrainyardError):
    """The Optuna storage cannot be opened or does not hold what the study needs."""


def storage_url(tune: TuneParams, root: str | os.PathLike[str] = ".") -> str:
    """``tune.storage``; ``auto`` is sqlite ``optuna.db`` beside mlflow.db (``store_root``)."""
    if tune.storage == "auto":
        return f"sqlite:///{store_root(root) / OPTUNA_DB}"
    return tune.storage


def redacted(url: str) -> str:
    """The storage URL without its password, for logs and tags."""
    try:
        return sqlalchemy.engine.make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a URL sqlalchemy parses: open_storage says what is wrong
        return url


def open_storage(
    url: str, on_stale: Any, heartbeat_s: int = HEARTBEAT_S, grace_s: int = GRACE_S
) -> optuna.storages.RDBStorage:
    """Optuna's RDB storage with heartbeats; ``on_stale(study, trial)`` is called for each
    trial failed because its worker stopped beating for ``grace_s``."""
    kwargs: dict[str, Any] = {}
    if url.startswith("sqlite:"):
        # Several workers write one file: wait for its lock up to a minute (sqlite's own
        # default is 5 s) rather than fail a trial on "database is locked".
        kwargs["engine_kwargs"] = {"connect_args": {"timeout": 60}}
        path = url.removeprefix("sqlite:///")
        if path and path != ":memory:" and not Path(path).parent.is_dir():
            raise StudyError(f"tune.storage {url}: folder {Path(path).parent} does not exist")
    for attempt in (1, 2):
        try:
            with warnings.catch_warnings():  # heartbeats are "experimental" since Optuna 2.9
                warnings.simplefilter("ignore", ExperimentalWarning)
                return optuna.storages.RDBStorage(
                    url,
                    heartbeat_interval=heartbeat_s,
                    grace_period=grace_s,
                    heartbeat_stale_trial_callback=on_stale,
                    **kwargs,
                )
        except sqlalchemy.exc.IntegrityError:
            # A new storage's tables, created by two workers at once (this machine's
            # workers open it under the StudyLock; another machine's may not): the other
            # one's are there now.
            if attempt == 2:
                raise
            time.sleep(1)
        except Exception as err:  # a bad URL, a missing driver, a server that does not answer
            raise StudyError(
                f"tune.storage {redacted(url)}: cannot open the Optuna storage: "
                f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            ) from None
    raise AssertionError("unreachable")


class StudyLock:
    """An exclusive lock among this machine's workers of one storage, held while a worker
    counts the study's trials and creates the next one (two workers never both start the
    last trial) and while the parent run is looked up or created. Workers on other
    machines (a PostgreSQL storage) are not covered: a study may then end a trial or two
    past ``--trials``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh: Any = None

    @classmethod
    def for_storage(cls, url: str, study: str, root: str | os.PathLike[str]) -> StudyLock:
        if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
            return cls(Path(url.removeprefix("sqlite:///") + ".lock"))
        return cls(Path(root) / ".cache" / "tune" / f"{study}.lock")

    def acquire(self) -> None:
        if self._fh is not None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(self.path, "a")  # noqa: SIM115  (held across calls until release)
        fcntl.flock(fh, fcntl.LOCK_EX)
        self._fh = fh

    def release(self) -> None:
        """Idempotent: the trial's objective releases it as soon as its trial exists."""
        if self._fh is not None:
            fcntl.flock(self._fh, fcntl.LOCK_UN)
            self._fh.close()
            self._fh = None

    def __enter__(self) -> StudyLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


# ---------------------------------------------------------------- workers


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def _start_ticks(pid: int) -> str:
    """When process ``pid`` started (clock ticks since boot, /proc): a reused pid differs."""
    stat = _read(f"/proc/{pid}/stat")
    return stat.rpartition(")")[2].split()[19] if stat else ""


def worker_id(pid: int | None = None) -> str:
    """This process, unique on this machine and across its reboots: host, boot, pid, start."""
    pid = os.getpid() if pid is None else pid
    boot = _read("/proc/sys/kernel/random/boot_id")
    return f"{socket.gethostname()}/{boot}/{pid}/{_start_ticks(pid)}"


def worker_dead(worker: str) -> bool:
    """True only for a worker of this machine that is certainly gone (another machine's
    workers are left to the heartbeats)."""
    parts = worker.split("/")
    if len(parts) != 4:
        return False
    host, boot, pid, ticks = parts
    if host != socket.gethostname() or boot != _read("/proc/sys/kernel/random/boot_id"):
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, ValueError):
        return False
    return bool(ticks) and _start_ticks(int(pid)) != ticks


# ---------------------------------------------------------------- trial params


def _label(choice: Any) -> Any:
    # Optuna's categorical choices are None, bool, int, float or str; a list (an image size
    # [H, W]) is offered by its JSON text and mapped back.
    if choice is None or isinstance(choice, bool | int | float | str):
        return choice
    return json.dumps(choice)


def suggest(trial: Trial, tune: TuneParams) -> dict[str, Any]:
    """One value per ``tune.space`` key, sampled by the study's sampler."""
    values: dict[str, Any] = {}
    for key, entry in tune.space.items():
        if isinstance(entry, TuneChoices):
            labels = [_label(c) for c in entry.choices]
            values[key] = entry.choices[labels.index(trial.suggest_categorical(key, labels))]
        elif entry.is_int:
            step = int(entry.step or 1)
            values[key] = trial.suggest_int(
                key, int(entry.low), int(entry.high), step=step, log=entry.log
            )
        else:
            values[key] = trial.suggest_float(
                key, entry.low, entry.high, step=entry.step, log=entry.log
            )
    return values


# ---------------------------------------------------------------- MLflow runs


def _experiment_id(client: mlflow.MlflowClient, name: str) -> str:
    found = client.get_experiment_by_name(name)
    if found is None:
        raise StudyError(f"MLflow experiment {name!r} is missing from the tracking store")
    return str(found.experiment_id)


@dataclass
class Tracking:
    """Where the study's runs go: the store, the experiment, the parent run."""

    uri: str
    experiment: str
    parent_id: str = ""

    @property
    def client(self) -> mlflow.MlflowClient:
        return mlflow.MlflowClient(tracking_uri=self.uri)

    def trial_runs(self, number: int) -> list[Any]:
        """The child runs of trial ``number`` (one; more only if a store was reused)."""
        if not self.parent_id:
            return []
        client = self.client
        return client.search_runs(
            [_experiment_id(client, self.experiment)],
            filter_string=(
                f"tags.`mlflow.parentRunId` = '{self.parent_id}' "
                f"and tags.`{TRIAL_TAG}` = '{number}'"
            ),
        )

    def end_trial(
        self,
        number: int,
        state: TrialState,
        reason: str | None = None,
        killed: bool = False,
        overwrite: bool = True,
    ) -> None:
        """Tag trial ``number``'s child run with its Optuna state; a run not FINISHED by its
        training ends with ``reason`` (tag trainyard.end_reason; not over one already there
        unless ``overwrite``): KILLED when pruned or its worker ``killed``, else FAILED.
        Never raises: the study goes on."""
        try:
            for run in self.trial_runs(number):
                if not overwrite and END_REASON_TAG in run.data.tags:
                    reason = None
                self._end(run, state, reason, killed)
        except Exception as err:
            log.warning("could not tag the MLflow run of trial %d: %s", number, err)

    def _end(self, run: Any, state: TrialState, reason: str | None, killed: bool) -> None:
        client, run_id = self.client, run.info.run_id
        client.set_tag(run_id, STATE_TAG, state.name)
        # A failed trial's run is FAILED even if its fit had finished (the trial failed
        # after it); a pruned one already ended by its fit (FAILED, Lightning's word for an
        # exception) is KILLED: stopped on purpose.
        if state == TrialState.COMPLETE or (
            state == TrialState.PRUNED and run.info.status == "FINISHED"
        ):
            return
        status = "FAILED" if state == TrialState.FAIL and not killed else "KILLED"
        if reason:
            client.set_tag(run_id, END_REASON_TAG, reason[:5000])
        client.set_terminated(run_id, status)


def open_parent(
    tracking: Tracking,
    study: optuna.Study,
    base: Params,
    url: str,
    root: str | os.PathLike[str],
) -> str:
    """The study's MLflow run: the one its user attrs name (set RUNNING again), or a new one
    in the study's experiment. Call under the StudyLock: two first workers make one."""
    client = tracking.client
    attrs = study.user_attrs
    run_id = attrs.get(PARENT_ATTR) if attrs.get(URI_ATTR) == tracking.uri else None
    if run_id and _live(client, run_id):
        carry_end_reason(client, run_id, client.get_run(run_id).data.tags)
        client.update_run(run_id, status="RUNNING")
        _log_base_params(client, run_id, base)
        return run_id
    if attrs.get(PARENT_ATTR):
        log.warning(
            "the study's MLflow run %s is not in %s (another store, or deleted): a new one",
            attrs[PARENT_ATTR],
            tracking.uri,
        )
    git = git_state(root)
    tags = {
        STUDY_TAG: study.study_name,
        "optuna.storage": redacted(url),
        "optuna.direction": "maximize",
        "optuna.sampler": "TPESampler",
        "optuna.pruner": base.tune.pruner,
        "mlflow.source.git.commit": git["git_commit"],
        "git.commit": git["git_commit"],
        "git.dirty": git["git_dirty"],
        "host": socket.gethostname(),
        "trainyard": __version__,
    }
    exp_id = _experiment_id(client, tracking.experiment)
    run_id = client.create_run(exp_id, run_name=study.study_name, tags=tags).info.run_id
    _log_base_params(client, run_id, base)
    study.set_user_attr(PARENT_ATTR, run_id)
    study.set_user_attr(URI_ATTR, tracking.uri)
    return run_id


def _live(client: mlflow.MlflowClient, run_id: str) -> bool:
    try:
        return client.get_run(run_id).info.lifecycle_stage != "deleted"
    except MlflowException:
        return False


def _log_base_params(client: mlflow.MlflowClient, run_id: str, base: Params) -> None:
    """The base params as the parent's params (MLflow params never change: a rerun on other
    base params logs the new keys only, and names the changed ones in a tag) and the search
    space as ``tune/space.json``."""
    have = client.get_run(run_id).data.params
    flat = {k: str(v)[:250] for k, v in base.flat().items()}
    new = [Param(k, v) for k, v in flat.items() if k not in have]
    for i in range(0, len(new), 100):
        client.log_batch(run_id, params=new[i : i + 100])
    changed = sorted(k for k, v in flat.items() if k in have and have[k] != v)
    if changed:
        client.set_tag(run_id, "trainyard.params_changed_on_rerun", ", ".join(changed)[:5000])
    client.log_dict(run_id, space_dict(base.tune), "tune/space.json")
    client.set_tag(run_id, "optuna.trials_target", str(base.tune.trials))


def space_dict(tune: TuneParams) -> dict[str, Any]:
    """``tune.space`` as written in params.yaml (JSON-able)."""
    return {k: v.model_dump(exclude_defaults=True) for k, v in tune.space.items()}


def note_base_changes(study: optuna.Study, base: Params) -> None:
    """Say when this worker's base params or space differ from the last worker's (the
    study then mixes trials of two setups), and record this worker's."""
    flat = json.loads(json.dumps(base.flat(), default=str))
    space = space_dict(base.tune)
    before = study.user_attrs.get(BASE_ATTR)
    if isinstance(before, dict):
        changed = sorted(k for k in flat.keys() | before.keys() if flat.get(k) != before.get(k))
        if changed:
            shown = ", ".join(f"{k} ({before.get(k)!r} -> {flat.get(k)!r})" for k in changed[:8])
            log.warning(
                "study %s: earlier trials ran on other base params: %s; --study NAME starts "
                "a separate study",
                study.study_name,
                shown + (" ..." if len(changed) > 8 else ""),
            )
    if study.user_attrs.get(SPACE_ATTR) not in (None, space):
        log.warning("study %s: tune.space changed since its earlier trials", study.study_name)
    study.set_user_attr(BASE_ATTR, flat)
    study.set_user_attr(SPACE_ATTR, space)


def fail_dead_workers(
    storage: optuna.storages.RDBStorage, study: optuna.Study, tracking: Tracking
) -> None:
    """Fail the RUNNING trials whose worker on this machine is gone (a SIGKILL), at once:
    the heartbeat's grace period covers other machines; and end their child runs KILLED."""
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        worker = trial.user_attrs.get(WORKER_ATTR)
        if not isinstance(worker, str) or not worker_dead(worker):
            continue
        pid = worker.split("/")[2]
        reason = f"worker process {pid} was killed mid-trial; failed by {os.getpid()}"
        try:
            storage.set_trial_user_attr(trial._trial_id, ERROR_ATTR, reason)
            storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
        except UpdateFinishedTrialError:
            continue  # another worker was first
        log.warning("trial %d: %s", trial.number, reason)
        drop_resume_folder(trial)
        tracking.end_trial(trial.number, TrialState.FAIL, reason, killed=True)


def drop_resume_folder(trial: FrozenTrial) -> None:
    """A killed trial's checkpoints: never resumed (trials run with train.resume: never),
    and left there, the next training's start would settle its run as an abandoned one
    (FAILED, "other train params"), over the reason given here."""
    folder = trial.user_attrs.get(RESUME_ATTR)
    if isinstance(folder, str) and folder:
        shutil.rmtree(folder, ignore_errors=True)


class StaleTrials:
    """Optuna's heartbeat callback: a trial whose worker stopped beating was failed; end
    its child run KILLED with the reason."""

    def __init__(self, tracking: Tracking) -> None:
        self.tracking = tracking

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        reason = (
            "its worker stopped sending heartbeats (killed, or its machine lost); failed "
            f"by {worker_id()}"
        )
        log.warning("trial %d: %s", trial.number, reason)
        drop_resume_folder(trial)
        self.tracking.end_trial(trial.number, TrialState.FAIL, reason, killed=True)


def running_trials(study: optuna.Study) -> list[int]:
    """Numbers of the study's trials some worker is running now."""
    return [t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))]
