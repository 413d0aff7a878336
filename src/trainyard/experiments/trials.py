"""The trials of ``trainyard tune``: the worker loop, one trial's training, the data.

A worker opens the study (and its MLflow parent run), then under the study's lock counts the
trials and starts the next one, until the study holds ``--trials``. A trial samples the
space, applies it over the base params, validates them, and trains on data prepared once per
distinct data params by the fetch and prepare stages' own code (``.cache/tune/data-<hash>``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import json
import logging
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import yaml

from trainyard.core.card import CARD_FILE
from trainyard.core.config import Params, parse_params
from trainyard.core.errors import ParamsError, Terminated, TrainyardError
from trainyard.core.pause_points import pause_point
from trainyard.data.sources import source_fingerprint
from trainyard.experiments import best as best_mod
from trainyard.experiments import study as st
from trainyard.experiments import workers
from trainyard.experiments.study import Study, Trial, TrialPruned
from trainyard.stages import fetch as fetch_stage
from trainyard.stages import prepare as prepare_stage
from trainyard.track.store import check_tracking_uri, ensure_experiment, resolve_tracking_uri
from trainyard.track.study_runs import StudyRuns
from trainyard.training.fit import train
from trainyard.training.job import RunExtras, TrainJob, Workspace
from trainyard.training.nodes import agree
from trainyard.training.resume import ResumeCallback

log = logging.getLogger("trainyard.experiments.tune")

CACHE = Path(".cache/tune")  # prepared data per data params, each trial's outputs


def set_key(raw: dict[str, Any], key: str, value: Any) -> None:
    """Set dotted ``key`` in the params mapping ``raw``; ``tune.space.<params key>`` keeps
    the params key (itself dotted) whole."""
    if key.startswith("tune.space."):
        parents, last = ["tune", "space"], key.removeprefix("tune.space.")
    else:
        *parents, last = key.split(".")
    node = raw
    for i, part in enumerate(parents):
        child = node.setdefault(part, {})
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            where = ".".join(parents[: i + 1])
            raise ParamsError(f"-S {key}: {where} is a value, not a section of params")
        node = child
    node[last] = value


@dataclass
class Setup:
    """What the command was asked: base params (file + -S), the study and its storage."""

    raw: dict[str, Any]
    base: Params
    overrides: dict[str, Any]
    url: str
    root: Path = field(default_factory=Path.cwd)

    @property
    def study_name(self) -> str:
        name = self.base.tune.study
        return f"{self.base.experiment_name()}-tune" if name == "auto" else name

    @property
    def trials(self) -> int:
        return self.base.tune.trials


# ---------------------------------------------------------------- data


def data_key(params: Params, root: Path) -> str:
    """A hash of what the fetch and prepare stages read: seed, data.*, and the source's
    input files as they are now (``source_fingerprint``: a folder's files, a CSV and the
    images it lists, Fashion-MNIST's files), relative paths resolved against ``root``."""
    ident: dict[str, Any] = {
        "seed": params.seed,
        "data": params.data.model_dump(mode="json"),
        "files": source_fingerprint(params.data, root),
    }
    blob = json.dumps(ident, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def prepared_data(params: Params, root: Path) -> Path:
    """``.cache/tune/data-<hash>/prepared`` for ``params``' data section, made by the fetch
    and prepare stages' own code the first time (one worker at a time, the others wait
    and reuse it)."""
    folder = root / CACHE / f"data-{data_key(params, root)}"
    prepared = folder / "prepared"
    if (prepared / CARD_FILE).is_file():
        return prepared
    folder.parent.mkdir(parents=True, exist_ok=True)
    with workers.StudyLock(folder.with_suffix(".lock")):
        if not (prepared / CARD_FILE).is_file():
            log.info("preparing the data once for the study's trials: %s", folder)
            raw = folder / "raw"
            if not raw.is_dir():
                fetch_stage.run(params, argparse.Namespace(out=str(raw)))
            prepare_stage.run(params, argparse.Namespace(raw=str(raw), out=str(prepared)))
    return prepared


# ---------------------------------------------------------------- trials


class TrialCallback(L.Callback):
    """Records on the trial, as soon as the fit starts, its MLflow run (a worker killed
    mid-trial leaves it for the next to end) and remembers the fit's resume folder and the
    last validated epoch (what a pruned trial reached)."""

    def __init__(self, trial: Trial) -> None:
        self.trial = trial
        self.resume_folder: Path | None = None
        self.epoch, self.val_acc = -1, float("nan")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for cb in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(cb, ResumeCallback):
                self.resume_folder = cb.resume.folder
                self.trial.set_user_attr(st.RESUME_ATTR, str(self.resume_folder.resolve()))
        run_id = getattr(trainer.logger, "run_id", None)
        if run_id:  # last: a person reads it as "the fit has started"
            self.trial.set_user_attr(st.RUN_ATTR, run_id)
        # tests signal a worker here, mid-trial: `tune.trial_fitting:<n>`, its n-th trial
        pause_point("tune.trial_fitting")

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking and "val/acc" in trainer.callback_metrics:
            self.epoch = trainer.current_epoch
            self.val_acc = float(trainer.callback_metrics["val/acc"])

    def drop_resume_folder(self) -> None:
        """A pruned or failed trial is never resumed (train.resume: never): its folder
        would otherwise be settled, as an abandoned training, by the next trial's start."""
        if self.resume_folder is not None:
            shutil.rmtree(self.resume_folder, ignore_errors=True)


def _short(values: dict[str, Any]) -> str:
    return " ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items()
    )


def _one_line(err: BaseException) -> str:
    """The error's message on one line (a params error lists its keys on lines of their
    own: ``invalid params in ...: train.batch_size: ...``)."""
    text = str(err).strip() or type(err).__name__
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    out = lines[0] if lines else ""
    for line in lines[1:]:
        out += (" " if out.endswith(":") else "; ") + line
    return out


class Tuner:
    """One worker of the study: opens it, runs trials until it has ``trials`` in all (or
    the timeout), and says the best."""

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        base = setup.base
        uri = resolve_tracking_uri(setup.root)
        check_tracking_uri(uri)
        self.runs = StudyRuns(uri, base.experiment_name())
        self.lock = workers.StudyLock.for_storage(setup.url, setup.study_name, setup.root)
        with self.lock:  # the first workers of a new storage would create its tables at once
            self.storage = st.open_storage(setup.url, st.StaleTrials(self.runs))
        self.started = time.monotonic()
        self._data: dict[str, Path] = {}

    def load(self) -> Study:
        """The study, its sampler seeded from ``seed`` and each trial's number."""
        base = self.setup.base
        return st.load_study(self.storage, self.setup.study_name, base.tune, base.seed)

    def open(self) -> None:
        """The study (created on first use), its MLflow parent run, dead workers' trials."""
        base = self.setup.base
        ensure_experiment(self.runs.uri, self.runs.experiment)
        self.data_dir(base)  # a data problem stops the command before any trial
        with self.lock:
            study = self.load()
            done = st.trial_counts(study)["all"]
            st.note_base_changes(study, base)
            self.runs.parent_id = st.open_parent(
                self.runs, study, base, self.setup.url, self.setup.root
            )
            st.fail_dead_workers(self.storage, study, self.runs)
        log.info(
            "study %s (%s) in %s: %s; MLflow run %s in experiment %s",
            study.study_name,
            "continued" if done else "new",
            workers.redacted(self.setup.url),
            f"{done} of {self.setup.trials} trials done" if done else f"{self.setup.trials} trials",
            self.runs.parent_id,
            self.runs.experiment,
        )

    def data_dir(self, params: Params) -> Path:
        key = json.dumps([params.seed, params.data.model_dump(mode="json")], default=str)
        if key not in self._data:
            self._data[key] = prepared_data(params, self.setup.root)
        return self._data[key]

    def run_trials(self) -> None:
        """Trials until the study holds ``trials`` (every state counts, a running one of
        another worker too) or the timeout; the count and the new trial are decided under
        the study's lock, so the workers (of all machines, on PostgreSQL) never overshoot.
        A full study waits a little for the other workers' trials (st.settle_others)."""
        timeout = self.setup.base.tune.timeout_min
        while True:
            with self.lock:
                study = self.load()
                st.fail_dead_workers(self.storage, study, self.runs)
                if st.trial_counts(study)["all"] >= self.setup.trials:
                    break
                if timeout is not None and time.monotonic() - self.started > timeout * 60:
                    log.info("timeout (%g min) reached: no new trial", timeout)
                    return
                self.runs.mark_parent_running()
                st.run_one_trial(study, self.objective)
        st.settle_others(self.storage, self.load, self.runs)

    def objective(self, trial: Trial) -> float:
        self.lock.release()  # the trial exists: the next worker may count it
        trial.set_user_attr(st.WORKER_ATTR, st.worker_id())
        t0, n = time.monotonic(), trial.number
        callback = TrialCallback(trial)
        try:
            values = st.suggest(trial, self.setup.base.tune)
            trial.set_user_attr("params", values)
            log.info("trial %d (%d/%d): %s", n, n + 1, self.setup.trials, _short(values))
            record = self.fit(trial, values, callback)
        except TrialPruned:
            callback.drop_resume_folder()
            why = (
                f"at epoch {callback.epoch + 1}: val/acc {callback.val_acc:.4f} below the "
                "median of earlier trials"
            )
            self.runs.end_trial(n, "PRUNED", f"pruned by Optuna {why}")
            self.trial_ended(n, f"PRUNED {why}", t0)
            raise
        except (KeyboardInterrupt, SystemExit) as err:
            callback.drop_resume_folder()
            raise self.interrupted(trial, err) from None
        except Exception as err:
            callback.drop_resume_folder()
            msg = _one_line(err)
            trial.set_user_attr(st.ERROR_ATTR, msg[:2000])
            self.runs.end_trial(n, "FAIL", f"{type(err).__name__}: {msg}")
            exc = None if isinstance(err, TrainyardError) else err  # a bug: its traceback
            self.trial_ended(n, f"FAILED: {msg}", t0, exc)
            raise
        trial.set_user_attr(st.RUN_ATTR, record.run_id)
        self.runs.end_trial(n, "COMPLETE")
        self.trial_ended(
            n, f"COMPLETE: val/acc {record.best_val_acc:.4f}", t0, value=record.best_val_acc
        )
        return record.best_val_acc

    def fit(self, trial: Trial, values: dict[str, Any], callback: TrialCallback) -> Any:
        """The trial's training: the base params with its values, validated as a whole."""
        params, raw = self.trial_params(trial.number, values)
        out = self.setup.root / CACHE / self.setup.study_name / f"trial-{trial.number}"
        out.mkdir(parents=True, exist_ok=True)
        params_file = out / "params.yaml"  # the trial's own params, in its run's config/
        params_file.write_text(yaml.safe_dump(raw, sort_keys=False))
        name = self.setup.study_name
        extras = RunExtras(
            run_name=f"{name}-trial-{trial.number}",
            tags=self.runs.trial_tags(name, trial.number),
            callbacks=(callback, st.pruning_callback(trial)),
            refit=False,
        )
        ws = Workspace.at(self.data_dir(params), out, self.setup.root, params_file)
        record = train(agree(TrainJob.from_params(params), ws), ws, extras)
        assert record is not None  # one device: this process is rank 0
        return record

    def trial_params(self, number: int, values: dict[str, Any]) -> tuple[Params, dict[str, Any]]:
        """The base params with the trial's values; trials start anew (train.resume: never)
        and on one device, and log into the study's experiment whatever data they sample."""
        raw = copy.deepcopy(self.setup.raw)
        for key, value in values.items():
            set_key(raw, key, value)
        set_key(raw, "train.resume", "never")
        if raw.get("train", {}).get("devices", "auto") == "auto":
            set_key(raw, "train.devices", 1)
        params = parse_params(raw, f"trial {number}'s params")
        if params.experiment_name() != self.runs.experiment:
            set_key(raw, "mlflow.experiment", self.runs.experiment)
            params = parse_params(raw, f"trial {number}'s params")
        return params, raw

    def trial_ended(
        self, number: int, what: str, t0: float, exc: BaseException | None = None, value: Any = None
    ) -> None:
        """The trial's end line, with the study's best so far (``value``: this trial's, not
        yet told to the study), and the parent run's running best."""
        best = ""
        try:
            scores = [s for s in st.completed_scores(self.load()) if s[1] != number]
            if value is not None:
                scores.append((value, number))
            if scores:
                top, top_n = max(scores, key=lambda s: (s[0], -s[1]))
                self.runs.log_trial_score(number, value, (top, top_n))
                best = f" (best so far: trial {top_n}, {top:.4f})"
        except Exception as err:  # the parent's chart is not worth a trial
            log.warning("could not log trial %d on the study's MLflow run: %s", number, err)
        log.info(
            "trial %d (%d/%d) %s in %.1fs%s",
            number,
            number + 1,
            self.setup.trials,
            what,
            time.monotonic() - t0,
            best,
            exc_info=exc,
        )

    def interrupted(self, trial: Trial, err: BaseException) -> KeyboardInterrupt:
        """Ctrl-C or SIGTERM in a trial: the trial FAILs (Optuna re-raises the interrupt),
        its run is KILLED (train did that inside the fit), and the command stops."""
        code = err.code if isinstance(err, SystemExit) else None
        term = isinstance(err, Terminated) or code == 128 + signal.SIGTERM
        what = "SIGTERM" if term else "Ctrl-C (SIGINT)"
        with contextlib.suppress(Exception):  # the store may be what the signal cut into
            trial.set_user_attr(st.ERROR_ATTR, f"interrupted by {what}")
        # train's own reason (signal, epoch, step) stays when the fit was what it cut short
        self.runs.end_trial(trial.number, "FAIL", f"{what} mid-trial", killed=True, overwrite=False)
        return Terminated() if term else KeyboardInterrupt()

    def finish(self, interrupted: str | None = None) -> Study:
        """End this worker: the parent run FINISHED (KILLED if ``interrupted``) unless
        another worker still runs a trial, with the best trial as tags."""
        study = self.load()
        count = st.trial_counts(study)
        log.info(
            "study %s: %d trials (%d complete, %d pruned, %d failed, %d running)",
            study.study_name,
            count["all"],
            count["COMPLETE"],
            count["PRUNED"],
            count["FAIL"],
            count["RUNNING"],
        )
        top = st.best_trial(study)
        best = None
        if top is not None:
            values = {k: best_mod.yaml_value(v) for k, v in st.trial_values(top).items()}
            best = (top.number, float(top.value or 0.0), values)
        running = st.running_trials(study)
        if running:
            log.info(
                "trial(s) %s still running in another worker: the study's MLflow run stays "
                "RUNNING until that worker ends",
                ", ".join(map(str, running)),
            )
        self.runs.finish_parent(best, count["all"], bool(running), interrupted)
        return study
