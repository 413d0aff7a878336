"""Optuna behind ``trainyard tune``: the one module that imports it (tests/test_layers.py).

- storage: Optuna's RDB storage with heartbeats (a worker that dies mid-trial has its trial
  failed by the next worker), sqlite beside mlflow.db by default;
- a lock file shared by this machine's workers of one study: the trial count and the
  MLflow parent run are decided by one worker at a time;
- the study (TPE sampler, median pruner), a trial's sampled values, its pruning callback,
  and what the trials module reads of a study (counts, the best trial);
- which MLflow run is the study's (a study user attr) and the trials failed for a dead
  worker; the runs themselves are trainyard.track.study_runs.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import optuna
import sqlalchemy.engine
import sqlalchemy.exc
from optuna.exceptions import ExperimentalWarning, UpdateFinishedTrialError
from optuna.trial import FrozenTrial, Trial, TrialState
from optuna_integration import PyTorchLightningPruningCallback

from trainyard.core.config import Params, TuneChoices, TuneParams
from trainyard.core.errors import TrainyardError
from trainyard.track.runs import store_root
from trainyard.track.study_runs import StudyRuns

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
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
# Optuna's types (with Trial, FrozenTrial above) and its pruned signal, for the modules that
# hold them without importing Optuna.
Study, TrialPruned = optuna.Study, optuna.TrialPruned


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


# ---------------------------------------------------------------- the study


def startup_trials(trials: int) -> int:
    """Random trials before TPE models the space, and completed trials before the median
    pruner judges: Optuna's 10 and 5 suit long studies, but an 8-trial study would never
    leave random search. A third of the study, 3 to 10."""
    return max(3, min(10, trials // 3))


def load_study(
    storage: optuna.storages.RDBStorage, name: str, tune: TuneParams, seed: int | None = None
) -> optuna.Study:
    """The study ``name`` (created on first use): maximize val/acc, TPE sampler seeded by
    ``seed``, the median pruner or none (``tune.pruner``)."""
    startup = startup_trials(tune.trials)
    pruner: optuna.pruners.BasePruner = (
        optuna.pruners.MedianPruner(
            n_startup_trials=startup, n_warmup_steps=tune.pruner_warmup_epochs
        )
        if tune.pruner == "median"
        else optuna.pruners.NopPruner()
    )
    return optuna.create_study(
        storage=storage,
        study_name=name,
        direction="maximize",
        load_if_exists=True,
        sampler=optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup),
        pruner=pruner,
    )


def run_one_trial(study: optuna.Study, objective: Callable[[Trial], float]) -> None:
    """One new trial of ``objective``; its exception fails the trial, not the worker."""
    study.optimize(objective, n_trials=1, catch=(Exception,), gc_after_trial=True)


def pruning_callback(trial: Trial) -> L.Callback:
    """Lightning's callback that reports val/acc to Optuna and prunes the trial."""
    return PyTorchLightningPruningCallback(trial, monitor="val/acc")


def trial_counts(study: optuna.Study) -> dict[str, int]:
    """The study's trials by state name (COMPLETE, PRUNED, FAIL, RUNNING, ...) and ``all``."""
    trials = study.get_trials(deepcopy=False)
    return {"all": len(trials)} | {s.name: sum(t.state == s for t in trials) for s in TrialState}


def completed_scores(study: optuna.Study) -> list[tuple[float, int]]:
    """(val/acc, trial number) of each completed trial."""
    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    return [(float(t.value or 0.0), t.number) for t in done]


def best_trial(study: optuna.Study) -> FrozenTrial | None:
    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    return max(done, key=lambda t: (t.value or 0.0, -t.number), default=None)


def trial_values(trial: FrozenTrial) -> dict[str, Any]:
    """The trial's params as the params file takes them (a list choice as a list)."""
    values = trial.user_attrs.get("params")
    return values if isinstance(values, dict) else dict(trial.params)


def _not_trial_failed(record: logging.LogRecord) -> bool:
    text = record.getMessage()
    return not (
        record.name.startswith("optuna") and text.startswith("Trial ") and " failed" in text
    )


def quiet_optuna() -> None:
    """Optuna's lines through the command's log, warnings only; its "Trial N failed"
    warnings (one with a traceback) are left out: the trial's own end line says why, with
    the traceback when the error is a bug."""
    optuna.logging.disable_default_handler()
    optuna.logging.enable_propagation()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # On the handler: a logger's filter does not see its children's records (Optuna logs
    # from optuna.study._optimize).
    for handler in logging.getLogger().handlers:
        handler.addFilter(_not_trial_failed)


# ---------------------------------------------------------------- the study's MLflow run


def open_parent(
    runs: StudyRuns,
    study: optuna.Study,
    base: Params,
    url: str,
    root: str | os.PathLike[str],
) -> str:
    """The study's MLflow run: the one its user attrs name (set RUNNING again), or a new one
    in the study's experiment. Call under the StudyLock: two first workers make one."""
    attrs = study.user_attrs
    space = space_dict(base.tune)
    run_id = attrs.get(PARENT_ATTR) if attrs.get(URI_ATTR) == runs.uri else None
    if run_id and runs.reopen_parent(run_id, base, space):
        return run_id
    if attrs.get(PARENT_ATTR):
        log.warning(
            "the study's MLflow run %s is not in %s (another store, or deleted): a new one",
            attrs[PARENT_ATTR],
            runs.uri,
        )
    optuna_tags = {
        "optuna.storage": redacted(url),
        "optuna.direction": "maximize",
        "optuna.sampler": "TPESampler",
        "optuna.pruner": base.tune.pruner,
    }
    run_id = runs.create_parent(study.study_name, optuna_tags, base, space, root)
    study.set_user_attr(PARENT_ATTR, run_id)
    study.set_user_attr(URI_ATTR, runs.uri)
    return run_id


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
    storage: optuna.storages.RDBStorage, study: optuna.Study, runs: StudyRuns
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
        runs.end_trial(trial.number, TrialState.FAIL.name, reason, killed=True)


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

    def __init__(self, runs: StudyRuns) -> None:
        self.runs = runs

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        reason = (
            "its worker stopped sending heartbeats (killed, or its machine lost); failed "
            f"by {worker_id()}"
        )
        log.warning("trial %d: %s", trial.number, reason)
        drop_resume_folder(trial)
        self.runs.end_trial(trial.number, TrialState.FAIL.name, reason, killed=True)


def running_trials(study: optuna.Study) -> list[int]:
    """Numbers of the study's trials some worker is running now."""
    return [t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))]
