"""Optuna behind ``trainyard tune``: the one module that imports it (tests/house/test_layers.py).

- storage: Optuna's RDB storage with heartbeats (a worker that dies mid-trial has its trial
  failed by the next worker), sqlite beside mlflow.db by default (the study's lock, the
  URL shown without its password, a worker's identity: trainyard.experiments.workers);
- the study (TPE seeded per trial, median pruner), a trial's sampled values, its pruning
  callback, and what the trials module reads of a study (counts, the best trial);
- which MLflow run is the study's (a study user attr) and the trials failed for a dead
  worker; the runs themselves are trainyard.track.study_runs.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import optuna
import sqlalchemy.exc
from optuna.distributions import BaseDistribution
from optuna.exceptions import ExperimentalWarning, UpdateFinishedTrialError
from optuna.trial import FrozenTrial, Trial, TrialState
from optuna_integration import PyTorchLightningPruningCallback

from trainyard.core.config import Params, TuneChoices, TuneParams
from trainyard.experiments.workers import (
    StudyError,
    cannot_open,
    connect_args,
    redacted,
    worker_dead,
    worker_id,
)
from trainyard.track.store import store_root
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
# Optuna's types (with Trial, FrozenTrial above) and its pruned signal, for the modules that
# hold them without importing Optuna.
Study, TrialPruned = optuna.Study, optuna.TrialPruned


def storage_url(tune: TuneParams, root: str | os.PathLike[str] = ".") -> str:
    """``tune.storage``; ``auto`` is sqlite ``optuna.db`` beside mlflow.db (``store_root``)."""
    if tune.storage == "auto":
        return f"sqlite:///{store_root(root) / OPTUNA_DB}"
    return tune.storage


def open_storage(
    url: str, on_stale: Any, heartbeat_s: int = HEARTBEAT_S, grace_s: int = GRACE_S
) -> optuna.storages.RDBStorage:
    """Optuna's RDB storage with heartbeats; ``on_stale(study, trial)`` is called for each
    trial failed because its worker stopped beating for ``grace_s``."""
    kwargs: dict[str, Any] = {"engine_kwargs": {"connect_args": connect_args(url)}}
    if url.startswith("sqlite:"):
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
            # A new storage's tables, created by two workers at once (workers open it under
            # the study's lock; one of another study, or an older trainyard, may not): the
            # other one's are there now.
            if attempt == 2:
                raise
            time.sleep(1)
        except Exception as err:  # a bad URL, a missing driver, a server that does not answer
            raise cannot_open(url, err) from None
    raise AssertionError("unreachable")


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


class TrialSeededTPE(optuna.samplers.BaseSampler):
    """TPE drawing trial ``n``'s randomness from ``seed + n``. The number is the storage's
    (unique in the study, whichever worker asks): two workers never draw alike, and one
    worker draws what ``TPESampler(seed=seed + n)`` draws on the same earlier trials, so
    a study run again on the same params repeats its trials."""

    def __init__(self, seed: int | None, startup: int) -> None:
        self.seed, self.startup = seed, startup
        self._tpe: dict[int, optuna.samplers.TPESampler] = {}  # by trial number

    def _for(self, trial: FrozenTrial) -> optuna.samplers.TPESampler:
        if trial.number not in self._tpe:
            seed = None if self.seed is None else (self.seed + trial.number) % 2**32
            self._tpe[trial.number] = optuna.samplers.TPESampler(
                seed=seed, n_startup_trials=self.startup
            )
        return self._tpe[trial.number]

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self._for(trial).before_trial(study, trial)

    def infer_relative_search_space(
        self, study: optuna.Study, trial: FrozenTrial
    ) -> dict[str, BaseDistribution]:
        return self._for(trial).infer_relative_search_space(study, trial)

    def sample_relative(
        self, study: optuna.Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        return self._for(trial).sample_relative(study, trial, search_space)

    def sample_independent(
        self,
        study: optuna.Study,
        trial: FrozenTrial,
        param_name: str,
        param_distribution: BaseDistribution,
    ) -> Any:
        return self._for(trial).sample_independent(study, trial, param_name, param_distribution)

    def after_trial(
        self, study: optuna.Study, trial: FrozenTrial, state: TrialState, values: Any
    ) -> None:
        self._for(trial).after_trial(study, trial, state, values)
        self._tpe.pop(trial.number, None)


def load_study(
    storage: optuna.storages.RDBStorage, name: str, tune: TuneParams, seed: int | None = None
) -> optuna.Study:
    """The study ``name`` (created on first use): maximize val/acc, TPE seeded per trial
    from ``seed`` (TrialSeededTPE), the median pruner or none (``tune.pruner``)."""
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
        sampler=TrialSeededTPE(seed, startup),
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


def settle_others(
    storage: optuna.storages.RDBStorage,
    load: Callable[[], optuna.Study],
    runs: StudyRuns,
    wait_s: float = GRACE_S + HEARTBEAT_S,
    poll_s: float = 2.0,
) -> list[int]:
    """The study holds its trials: wait up to ``wait_s`` for those other workers still
    run, so that a dead worker's trial is failed and its run ended before this worker
    reports the study (at once on this machine; elsewhere once its heartbeat has been
    silent for the grace period). Returns the trials still running (a live worker's)."""
    deadline = time.monotonic() + wait_s
    said = False
    while True:
        study = load()
        fail_dead_workers(storage, study, runs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)
        running = running_trials(study)
        if not running or time.monotonic() >= deadline:
            return running
        if not said:
            said = True
            log.info(
                "the study holds its trials; waiting up to %.0f s for trial(s) %s of other "
                "workers (one whose worker died is failed after %d s without heartbeats)",
                wait_s,
                ", ".join(map(str, running)),
                GRACE_S,
            )
        time.sleep(poll_s)


def running_trials(study: optuna.Study) -> list[int]:
    """Numbers of the study's trials some worker is running now."""
    return [t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))]
