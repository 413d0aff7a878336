"""The end of a fit: its MLflow run completed, or kept for the next start.

Completed (``complete_run``): what the tracking server did not take during the fit is sent,
then the run's outputs (the best checkpoint, the fit's seconds, why it stopped) and its end
(FINISHED), waiting up to ``TRAINYARD_TRACKING_WAIT_S`` seconds for a server that went
away (track.outage). Kept: a server still away by then leaves the finished fit's facts
(``fit-done.json``) and the metrics (``pending-metrics.json``) beside the resumable
checkpoint, and the stage fails with one line. The next start of the same training finds
them (``finished_fit``): it trains nothing, sends the metrics into the same run and
completes it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Protocol

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from trainyard.core.errors import TrackingError
from trainyard.core.io import atomic_write_json, atomic_write_text
from trainyard.track.outage import PENDING_FILE, ServerGap
from trainyard.track.train_run import log_fit_outputs
from trainyard.training.builder import stop_reason
from trainyard.training.gpu_busy import gpu_busy_of
from trainyard.training.history import HISTORY_FILE
from trainyard.training.resume import Resume

log = logging.getLogger(__name__)

FIT_DONE = "fit-done.json"  # in the resume folder: a finished fit whose run is not complete


class FitRun(Protocol):
    """What the end of a fit needs of train.fit's TrackedRun."""

    uri: str
    logger: Any
    resume: Resume
    gap: ServerGap | None

    @property
    def run_id(self) -> str | None: ...


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

    @classmethod
    def load(cls, folder: Path) -> FitResult | None:
        """The result ``save`` wrote in ``folder``; None when there is none."""
        path = folder / FIT_DONE
        if not path.is_file():
            return None
        try:
            raw = json.loads(path.read_text())
            return cls(**{f.name: raw[f.name] for f in fields(cls)})
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise TrackingError(
                f"{path}: not a finished fit trainyard saved ({err}); delete {folder} to train anew"
            ) from None


def complete_run(tracked: FitRun, result: FitResult) -> None:
    """Send what is kept, log the outputs and end the run FINISHED, waiting for an away
    server (``ServerGap.settle``). If it does not answer in time, keep all of it for the
    next start and raise TrackingError: one line saying what is kept and what to do."""
    gap, folder = tracked.gap, tracked.resume.folder
    client, run_id = tracked.logger.experiment, tracked.run_id
    ckpt = folder / result.best_ckpt

    def last_calls() -> None:
        log_fit_outputs(client, run_id, ckpt, result.fit_s, result.stopped_by)
        client.set_terminated(run_id, "FINISHED")

    if gap is None:
        last_calls()
        return
    saved = folder / PENDING_FILE
    try:
        if gap.settle(last_calls):
            return
    except BaseException:  # a signal or an error while waiting: the finished fit is kept
        if gap.pending:
            gap.save(saved)
        result.save(folder)
        tracked.resume.release()
        raise
    n = gap.save(saved)
    result.save(folder)
    tracked.resume.release()
    raise TrackingError(
        f"MLflow server {tracked.uri} still not reachable after training finished (epoch "
        f"{result.epochs_run}/{result.max_epochs}): the checkpoint is kept in {folder}/, {n} "
        f"metric values are saved in {saved}; rerun `dvc repro` when the server is back: it "
        "resumes the finished fit (no retraining) and sends them"
    )


def finished_fit(tracked: FitRun, out_dir: Path) -> FitResult | None:
    """A fit of this training that finished while the server was away (``complete_run``
    kept it): its result, with ``out_dir``'s history.csv written back; None otherwise."""
    res = tracked.resume
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
        tracked.run_id,
    )
    return result


def send_saved(tracked: FitRun) -> None:
    """What an earlier start of this training saved while the server was away
    (``keep_unsent``, ``complete_run``): sent now into the same run."""
    gap = tracked.gap
    if gap is not None:
        gap.take_saved(tracked.resume.folder / PENDING_FILE)
        if gap.pending:
            gap.flush()


def keep_unsent(tracked: FitRun) -> None:
    """A fit stopped (a signal, an error) while the server was away: what it did not take
    is saved beside the checkpoint, for the next start to send."""
    gap = tracked.gap
    if gap is None or not gap.pending or tracked.resume.private:
        return
    path = tracked.resume.folder / PENDING_FILE
    n = gap.save(path)
    log.warning(
        "%d metric values MLflow server %s has not taken are saved in %s; the next start "
        "of this training sends them",
        n,
        tracked.uri,
        path,
    )
