"""The fit's MLflow run, from its open to its end: one object the fit calls at its start
(``TrackedRun.open``), around ``trainer.fit`` (``watching``) and at its end (``complete``,
``close``).

- **open**: an interrupted run of this very training (its resume key) is reopened RUNNING,
  else a new one is made with the params, the lineage tags and a readable name; rank 0 then
  writes the resume state, logs what the run learns from and sends what an earlier start
  kept while the tracking server was away (``begin``). Every rank opens one; only rank 0's
  logs (under DDP the others learn its id: ``join_run``, ``nodes.ShareRun``).
- **watching**: system metrics during the fit; metrics go through the run's ``ServerGap``
  (track.outage), kept while the server is away. A SIGTERM/SIGINT marks the run KILLED,
  keeps the checkpoint and what the server did not take, and exits 143/130.
- **complete**: what is kept is sent, then the outputs, and the run ends FINISHED, waiting
  up to ``TRAINYARD_TRACKING_WAIT_S`` seconds for a server that went away. A server still
  away by then leaves the finished fit (``fit-done.json``) and the metrics
  (``pending-metrics.json``) beside the resumable checkpoint, and the stage fails with one
  line; the next start finds them (``finished_fit``), trains nothing and completes the run.
- **close**: the resume folder goes: a forced rerun of the same params trains anew.

``FitResult`` is what a finished fit hands ``complete`` (and train.json), and what is kept
for the next start while the server is away.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers.logger import DummyLogger
from lightning.pytorch.utilities import rank_zero_only

from trainyard.core.card import Card
from trainyard.core.errors import TrackingError
from trainyard.core.fit_history import HISTORY_FILE
from trainyard.core.io import atomic_write_json, atomic_write_text
from trainyard.data.arrays import load_split
from trainyard.track.lineage import dvc_data_version, dvc_experiment_tags, run_tags
from trainyard.track.outage import PENDING_FILE
from trainyard.track.store import DVC_EXP_NAME, ensure_experiment, tracking_client
from trainyard.track.train_run import TrainRun
from trainyard.training.builder import stop_reason
from trainyard.training.device import Hardware
from trainyard.training.gpu_busy import gpu_busy_of
from trainyard.training.job import RunExtras, TrainJob, Workspace
from trainyard.training.nodes import Agreement, Nodes, resume_mode
from trainyard.training.recipe import RECIPE_FILE, Plan
from trainyard.training.resume import LAST_CKPT, Resume, interruptions, resume_folder
from trainyard.training.resume import prepare as prepare_resume
from trainyard.training.run_logger import RunLogger

log = logging.getLogger(__name__)

FIT_DONE = "fit-done.json"  # in the resume folder: a finished fit whose run is not complete


@dataclass(frozen=True)
class FitResult:
    """What a finished fit leaves for its outputs: train.json and the run's last calls."""

    best_ckpt: str  # file name, in the resume folder
    best_score: float
    epochs_run: int
    max_epochs: int
    stopped_by: str
    fit_s: float
    input_bound: dict[str, Any] | None
    gpu_busy: dict[str, Any] | None
    data_placement: str  # where the splits lived (gpu, ram, mmap)
    history_csv: str  # models/history.csv's text: DVC deletes the file before a rerun
    # train.refit: what trained the shipped model (trainyard.training.refit); None before it
    refit: dict[str, Any] | None = None

    @classmethod
    def of(
        cls,
        trainer: L.Trainer,
        checkpoint: ModelCheckpoint,
        input_bound: dict[str, Any] | None,
        fit_s: float,
        placement: str,
        history: Path,
    ) -> FitResult:
        """The result of ``trainer``'s fit (rank 0), read once it has returned."""
        return cls(
            best_ckpt=Path(checkpoint.best_model_path).name,
            best_score=float(checkpoint.best_model_score),
            epochs_run=int(trainer.current_epoch),
            max_epochs=int(trainer.max_epochs or 0),
            stopped_by=stop_reason(trainer),
            fit_s=fit_s,
            input_bound=input_bound,
            gpu_busy=gpu_busy_of(trainer),
            data_placement=placement,
            history_csv=history.read_text() if history.is_file() else "",
        )

    def save(self, folder: Path) -> None:
        atomic_write_json(folder / FIT_DONE, asdict(self))

    def tags(self) -> dict[str, str]:
        """The run's tags for this result: why the fit stopped, and with train.refit
        which images trained the model that ships (``refit``)."""
        tags = {"train.stopped_by": self.stopped_by}
        if self.refit is not None:
            r = self.refit
            tags["refit"] = f"{r.get('trained_on')}, {r.get('epochs')} epochs ({r.get('why')})"
        return {k: v[:5000] for k, v in tags.items()}  # MLflow's limit on a tag's value

    @classmethod
    def load(cls, folder: Path) -> FitResult | None:
        """The result ``save`` wrote in ``folder``; None when there is none."""
        path = folder / FIT_DONE
        if not path.is_file():
            return None
        try:
            raw = json.loads(path.read_text())
            return cls(
                **{f.name: raw[f.name] for f in fields(cls) if f.name != "refit"},
                refit=raw.get("refit"),
            )
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise TrackingError(
                f"{path}: not a finished fit trainyard saved ({err}); delete {folder} to train anew"
            ) from None


@dataclass
class TrackedRun:
    """The MLflow run a fit logs to, and the resume folder that goes with it."""

    uri: str
    # Rank 0's creates the run; another node's rank logs nothing, and must not even open
    # the store (MLflow's client creates an sqlite file's tables): Lightning's stand-in.
    logger: RunLogger | DummyLogger
    resume: Resume
    lead: bool  # rank 0, the one rank that owns the MLflow run (under DDP all run this)
    dvc_md5: str  # DVC's hash of data/prepared, "" when dvc.lock has none
    run: TrainRun | None = None  # rank 0: the run in the store, its metrics through a gap
    peer_run_id: str | None = None  # on the other ranks: rank 0's run, once it is shared
    finished: FitResult | None = None  # a fit that finished while the server was away
    completed: bool = False  # the run ended FINISHED with its outputs (``complete``)
    # mlflow.system_metrics and its interval: sampled around the fit (``watching``)
    system_metrics: bool = False
    system_metrics_interval_s: float = 5.0

    @property
    def run_id(self) -> str | None:
        """The MLflow run's id (Lightning's logger creates the run on first use); on
        other ranks rank 0's, once known (across nodes before the fit, else at its start)."""
        if isinstance(self.logger, RunLogger) and self.logger.run_id:
            return self.logger.run_id
        return self.peer_run_id

    @classmethod
    def open(
        cls,
        job: TrainJob,
        ws: Workspace,
        key: str,
        tags: dict[str, str],
        name: str,
        dvc_md5: str,
        resume_mode: str | None = None,
    ) -> TrackedRun:
        """The fit's run: an interrupted run of this very training (``key``, from
        ``resume_key``), reopened, or a new one named ``name`` with the job's params (as
        planned: what MLflow records) and ``tags``, in the job's experiment
        (``mlflow.experiment``). ``resume_mode`` overrides ``train.resume``."""
        lead = rank_zero_only.rank == 0
        uri = ws.uri
        # An interrupted run of these exact params, data and code resumes: same MLflow run.
        client = tracking_client(uri) if lead else None
        mode = resume_mode or job.train.resume
        resume = prepare_resume(ws.root, key, mode, uri, client, lead=lead)
        experiment = job.experiment
        if lead:  # before Lightning's logger, which would race another run creating it
            ensure_experiment(uri, experiment)
        logger = RunLogger(
            experiment_name=experiment,
            run_name=None if resume.run_id else name,
            tracking_uri=uri,
            tags=tags,
            log_model=False,
            run_id=resume.run_id,
        )
        tracked = cls(
            uri,
            logger,
            resume,
            lead,
            dvc_md5,
            system_metrics=job.system_metrics,
            system_metrics_interval_s=job.system_metrics_interval_s,
        )
        if client is None:  # another rank: rank 0 alone writes to the run
            return tracked
        tracked.run = TrainRun(uri, str(logger.run_id), client)  # the logger makes the run
        if resume.run_id:
            tracked.run.reopen(job.logged)
        else:
            tracked.run.log_params(job.logged)
        logger.gap = tracked.run.gap  # from now on: kept while the server is away
        return tracked

    @classmethod
    def peer(cls, uri: str, resume: Resume, run_id: str | None) -> TrackedRun:
        """Another node's rank: rank 0's run ``run_id`` and resume decision, no logger."""
        return cls(uri, DummyLogger(), resume, False, "", peer_run_id=run_id)

    def begin(
        self,
        recipe: Plan,
        card: Card,
        data_dir: str | os.PathLike[str],
        params_file: str | os.PathLike[str] | None,
    ) -> None:
        """Rank 0: the plan (``recipe.json``) and the run's id beside the checkpoint, what
        the run learns from (``data_dir``'s splits as datasets, params and ``card``, the
        recipe's choices), and what an earlier start kept while the server was away, sent."""
        run, folder = self.run, self.resume.folder
        if run is None:
            return
        recipe.save(folder / RECIPE_FILE)
        self.resume.write_state(run.run_id, self.logger.experiment_id, self.uri)
        splits = {split: load_split(data_dir, split) for split in ("train", "val")}
        run.log_inputs(splits, card, data_dir, params_file, recipe.tags(), recipe.to_dict())
        run.send_kept(folder)

    def finished_fit(self, out_dir: Path) -> FitResult | None:
        """A fit of this training that finished while the server was away (``complete``
        kept it): its result, with ``out_dir``'s history.csv written back; None otherwise."""
        res = self.resume
        result = FitResult.load(res.folder) if res.resuming else None
        if result is None:
            return None
        atomic_write_text(out_dir / HISTORY_FILE, result.history_csv)
        log.info(
            "the fit finished before (epoch %d/%d, best val/acc %.4f): nothing to train; "
            "completing MLflow run %s",
            result.epochs_run,
            result.max_epochs,
            result.best_score,
            self.run_id,
        )
        return result

    @contextlib.contextmanager
    def watching(self, trainer: L.Trainer) -> Iterator[None]:
        """Around ``trainer.fit``: system metrics (rank 0, ``mlflow.system_metrics``), and
        SIGTERM/SIGINT recorded. A signal ends the run KILLED, keeps the checkpoint and
        exits 128 + its number; an error keeps what the server did not take, and is raised."""
        resume, run = self.resume, self.run
        monitor: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
        if run is not None:
            interval_s, enabled = self.system_metrics_interval_s, self.system_metrics
            monitor = run.system_metrics(interval_s, enabled, resume.resuming)
        try:
            with interruptions(resume), monitor:
                yield
        except BaseException:
            if resume.signal is None:
                self._keep_unsent()
                resume.release()
                raise
        if resume.signal is not None:
            if self.lead:
                self._keep_unsent()
                self._end_killed(trainer)
            raise SystemExit(128 + resume.signal)

    def _keep_unsent(self) -> None:
        # A private folder (another live training holds the key's) is never resumed.
        if self.run is not None and not self.resume.private:
            self.run.keep_unsent(self.resume.folder)

    def _end_killed(self, trainer: L.Trainer) -> None:
        """After a signal: mark the run KILLED, say what the next start will do, and exit."""
        resume = self.resume
        assert resume.signal is not None and self.run is not None
        name = signal.Signals(resume.signal).name
        ckpt = resume.folder / LAST_CKPT
        if ckpt.is_file() and not resume.private:
            then = f"the next `dvc repro` resumes it from {ckpt}"
        else:
            then = "no checkpoint yet: the next start begins anew"
        where = f"epoch {trainer.current_epoch + 1}, step {trainer.global_step}"
        self.run.end_interrupted("KILLED", f"{name} at {where}")
        log.warning("interrupted by %s; %s", name, then)
        resume.release()
        raise SystemExit(128 + resume.signal)

    def complete(self, result: FitResult) -> None:
        """Send what is kept, log the outputs and end the run FINISHED, waiting for an away
        server. If it does not answer in time, keep all of it for the next start and raise
        TrackingError: one line saying what is kept and what to do."""
        if self.run is None:  # only rank 0 ends the run
            return
        folder = self.resume.folder
        try:
            n = self.run.complete(folder, folder / result.best_ckpt, result.fit_s, result.tags())
        except BaseException:  # a signal or an error while waiting: the finished fit is kept
            result.save(folder)
            self.resume.release()
            raise
        if n is None:
            self.completed = True
            return
        result.save(folder)
        self.resume.release()
        raise TrackingError(
            f"MLflow server {self.uri} still not reachable after training finished (epoch "
            f"{result.epochs_run}/{result.max_epochs}): the checkpoint is kept in {folder}/, {n} "
            f"metric values are saved in {folder / PENDING_FILE}; rerun `dvc repro` when the "
            "server is back: it resumes the finished fit (no retraining) and sends them"
        )

    def close(self) -> None:
        """The run is complete and its outputs written: nothing is left to resume (a forced
        rerun of the same params must train anew, not reopen a finished run)."""
        self.resume.finish()


def join_run(
    nodes: Nodes, start: Callable[[str | None], TrackedRun], folder: Path, uri: str
) -> TrackedRun:
    """Across nodes: rank 0 opens (or reopens) the MLflow run (``start``); every rank
    learns its id and whether the fit resumes (from which checkpoint: ``resume_mode``)."""
    mode = resume_mode(nodes, folder)
    opened: list[TrackedRun] = []

    def decide() -> tuple[str | None, str, str]:
        opened.append(start(mode))
        res = opened[0].resume
        ckpt = "" if res.ckpt_path is None else str(res.ckpt_path.resolve())
        return opened[0].run_id, str(res.folder.resolve()), ckpt

    run_id, lead_folder, ckpt = nodes.from_lead(decide)
    if opened:
        return opened[0]
    resume = Resume(Path(lead_folder), folder.name, ckpt_path=Path(ckpt) if ckpt else None)
    return TrackedRun.peer(uri, resume, run_id)


@contextlib.contextmanager
def tracked_run(
    team: Agreement, ws: Workspace, extras: RunExtras, pretrained: dict[str, str]
) -> Iterator[TrackedRun]:
    """The MLflow run of the agreed job's resume key around the fit: opened, or an
    interrupted one reopened (``open``: the resume decision), every rank told which (across
    nodes: ``join_run``), and what it learns from logged (``begin``); ``finished`` holds a
    fit that finished while the server was away. Once the body has completed the run
    (``complete``), the resume folder goes (``close``): a forced rerun of the same params
    trains anew. The hardware, the data's card and the ``pretrained`` weights become its
    tags."""
    job, key, card = team.job, team.key, ws.card

    def start(resume_mode: str | None = None) -> TrackedRun:
        dvc_md5 = dvc_data_version(ws.root)
        tags = lineage_tags(ws.root, card, pretrained, team.hw, dvc_md5) | extras.tags
        name = extras.run_name or run_name(job.dataset, job.train.arch, key)
        tracked = TrackedRun.open(job, ws, key, tags, name, dvc_md5, resume_mode)
        tracked.begin(team.plan, card, ws.data_dir, ws.params_file)
        return tracked

    joined = team.nodes.joined
    folder = resume_folder(ws.root, key)
    tracked = join_run(team.nodes, start, folder, ws.uri) if joined else start()
    # Finished while the server was away (TrackedRun.complete): nothing left to train.
    tracked.finished = None if joined else tracked.finished_fit(ws.out_dir)
    yield tracked
    if tracked.completed:
        tracked.close()


def lineage_tags(
    root: str | os.PathLike[str],
    card: Card,
    pretrained: dict[str, str],
    hw: Hardware,
    dvc_md5: str,
) -> dict[str, str]:
    """The run's tags: code, data, host, device, and the ``pretrained`` weights if any."""
    tags = run_tags(root, card.data_sha256, hw.device)
    tags["data.dvc_md5"] = dvc_md5 or "not in dvc.lock"
    tags["precision"] = hw.precision
    tags["data.source"] = card.source
    tags["data.classes"] = str(card.num_classes)
    tags["data.input_shape"] = "x".join(str(d) for d in card.input_shape)
    tags["data.skipped_files"] = str(len(card.skipped))
    # Which weights the backbone started from, their exact bytes and their licence.
    for key, value in pretrained.items():
        tags[f"pretrained.{key}"] = value
    return tags | dvc_experiment_tags(root)


def run_name(dataset: str, arch: str, key: str) -> str:
    """A name a person can tell apart in the MLflow UI: the DVC experiment's name when DVC
    runs one, else dataset, architecture and the first characters of the resume key (the
    hash of params, data and code). MLflow's own random names were all the same: the seed
    is set before the run is created."""
    exp = os.environ.get(DVC_EXP_NAME, "").strip()
    return exp or f"{dataset}-{arch}-{key[:6]}"
