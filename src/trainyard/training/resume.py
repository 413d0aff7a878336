"""Resumable training: a last checkpoint outside DVC's outs, keyed by what defines the run.

``.cache/train-resume/<key>/`` holds ``last.ckpt`` (every epoch, and every
``train.checkpoint_every_min`` within long epochs), the best checkpoint so far and
``state.json`` (the MLflow run that owns them). ``<key>`` hashes the seed, every train param
that changes the result, the validation batch, the data's hash, the model and data code, the
MLflow store and experiment, and the output folder: changed params or data never resume into
an old checkpoint. DVC deletes a stage's outs before it runs; this folder is not one of them.

A start (rank 0) first settles earlier interrupted runs: one with this key resumes (same MLflow
run, set back to RUNNING); any other left RUNNING or KILLED is marked FAILED with a
``trainyard.end_reason`` tag and its folder removed. SIGTERM and SIGINT end the fit at the next
batch, mark the run KILLED and leave the checkpoint for the next start (training.tracked_run).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning as L
import numpy as np
import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch.plugins.io import TorchCheckpointIO

from trainyard.core.io import atomic_write_json, sha256_file
from trainyard.core.pause_points import pause_point
from trainyard.track.interrupts import signals_handled
from trainyard.track.train_run import end_interrupted_run, run_status
from trainyard.training.builder import RESUME_ROOT

if TYPE_CHECKING:
    from trainyard.training.job import TrainJob

log = logging.getLogger(__name__)

LAST_CKPT = "last.ckpt"
STATE_FILE = "state.json"
# Train params that do not change what is learned: left out of the key.
NOT_IN_KEY = ("resume", "checkpoint_every_min")
# Code whose change makes an old checkpoint a different model or data order (package paths).
KEY_CODE = (
    "model/networks.py",
    "model/backbones.py",
    "model/augment.py",
    "model/classifier.py",
    "training/datamodule.py",
)
PACKAGE = Path(__file__).resolve().parent.parent  # src/trainyard


def resume_key(
    job: TrainJob, data_sha256: str, tracking_uri: str, out_dir: str | os.PathLike[str]
) -> str:
    """A short hash of everything that defines this training and where it is recorded
    (``job`` as written, auto keys and all: a rerun after a kill finds its run)."""
    train = {k: v for k, v in job.train.model_dump().items() if k not in NOT_IN_KEY}
    ident = {
        "seed": job.seed,
        "train": train,
        "eval_batch_size": job.eval_batch_size,
        "data_sha256": data_sha256,
        "code": {name: _code_sha256(PACKAGE / name) for name in KEY_CODE},
        "tracking_uri": tracking_uri,
        "experiment": job.experiment,
        "out": str(Path(out_dir).resolve()),
    }
    blob = json.dumps(ident, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def resume_folder(root: str | os.PathLike[str], key: str) -> Path:
    """Where the training of resume ``key`` keeps its checkpoints, under ``root``."""
    return Path(root) / RESUME_ROOT / key


def _code_sha256(path: Path) -> str:
    # "" for a file not there (an installed wheel without sources): the key still works.
    try:
        return sha256_file(path)
    except OSError:
        return ""


def checkpoint_problem(path: Path) -> str | None:
    """Why ``path`` cannot be resumed from (None: it is a complete Lightning checkpoint)."""

    if not path.is_file():
        return "no checkpoint yet"
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # truncated, not a zip, unpickling error: all mean unusable
        return f"unreadable ({type(err).__name__}: {str(err)[:120]})"
    missing = [k for k in ("state_dict", "epoch", "global_step", "loops") if k not in ckpt]
    return f"incomplete (no {', '.join(missing)})" if missing else None


class AtomicCheckpointIO(TorchCheckpointIO):
    """Every checkpoint goes to a temp file in its folder, fsynced, then renamed: a kill
    mid-write leaves the previous checkpoint whole, never a truncated one."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options=None) -> None:
        path = Path(path)
        if type(get_filesystem(str(path))).__name__ != "LocalFileSystem":
            return super().save_checkpoint(checkpoint, path, storage_options)

        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as fh:
                torch.save(checkpoint, fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
            pause_point(f"train.checkpoint_saved.{path.name}")  # e.g. .last.ckpt
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()


@dataclass
class Resume:
    """What this start does: resume ``run_id`` from ``ckpt_path``, or start fresh."""

    folder: Path
    key: str
    run_id: str | None = None
    ckpt_path: Path | None = None
    private: bool = False  # another live training holds the key's folder: not resumable
    signal: int | None = None  # SIGTERM/SIGINT received during the fit
    _lock: Any = field(default=None, repr=False)

    @property
    def resuming(self) -> bool:
        return self.ckpt_path is not None

    def write_state(self, run_id: str, experiment_id: str, uri: str) -> None:
        atomic_write_json(
            self.folder / STATE_FILE,
            {
                "key": self.key,
                "run_id": run_id,
                "experiment_id": experiment_id,
                "tracking_uri": uri,
                "pid": os.getpid(),
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            },
        )

    def finish(self) -> None:
        """The run is complete and its outputs written: nothing is left to resume (a forced
        rerun of the same params must train anew, not reopen a finished run)."""
        shutil.rmtree(self.folder, ignore_errors=True)
        self.release()

    def release(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None


def _try_lock(folder: Path) -> Any:
    """An exclusive lock on ``folder`` (held for the whole training), or None if taken."""
    folder.mkdir(parents=True, exist_ok=True)
    fh = open(folder / ".lock", "a")  # noqa: SIM115  (held open for the training's life)
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        fh.close()
        return None
    return fh


def _read_state(folder: Path) -> dict[str, Any] | None:
    try:
        state = json.loads((folder / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) and state.get("run_id") else None


def prepare(
    root: str | os.PathLike[str], key: str, mode: str, uri: str, client: Any, lead: bool
) -> Resume:
    """Decide whether this start resumes; on rank 0, settle every earlier interrupted run."""
    folder = resume_folder(root, key)
    base = folder.parent
    if not lead:
        # Rank 0 decided before launching the other ranks and passed its decision down.
        ckpt = os.environ.get("TRAINYARD_RESUME_CKPT")
        folder = Path(os.environ.get("TRAINYARD_RESUME_DIR", str(folder)))
        return Resume(folder=folder, key=key, ckpt_path=Path(ckpt) if ckpt else None)

    _settle_others(base, key, uri, client)
    lock = _try_lock(folder)
    if lock is None:
        private = base / f"{key}.{os.getpid()}"
        shutil.rmtree(private, ignore_errors=True)
        log.warning(
            "another training with the same params holds %s; this one checkpoints "
            "privately and will not be resumable",
            folder,
        )
        res = Resume(folder=private, key=key, private=True)
        return _export(res)
    res = Resume(folder=folder, key=key, _lock=lock)
    state = _read_state(folder)
    if state is not None and state.get("key") == key:
        run_id = state["run_id"]
        problem = checkpoint_problem(folder / LAST_CKPT)
        status = run_status(client, run_id)
        if mode == "never":
            problem = "train.resume is never"
        elif status is None:
            problem = f"its MLflow run {run_id} is not in {uri}"
        if problem is None:
            res.run_id, res.ckpt_path = run_id, folder / LAST_CKPT
            return _export(res)
        if problem.startswith("unreadable") or problem.startswith("incomplete"):
            msg = f"last checkpoint {folder / LAST_CKPT} is {problem}; starting fresh"
            log.warning(msg)
        else:
            log.info("not resuming (%s); starting fresh", problem)
        if status is not None:
            end_interrupted_run(client, run_id, "FAILED", f"interrupted; not resumed: {problem}")
    _wipe(folder)
    return _export(res)


def _export(res: Resume) -> Resume:
    # Inherited by the DDP ranks Lightning launches at fit time.
    os.environ["TRAINYARD_RESUME_DIR"] = str(res.folder)
    os.environ["TRAINYARD_RESUME_CKPT"] = str(res.ckpt_path or "")
    return res


def _wipe(folder: Path) -> None:
    """Empty ``folder`` but keep its lock file (held by this process)."""
    for entry in folder.iterdir():
        if entry.name == ".lock":
            continue
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def _settle_others(base: Path, key: str, uri: str, client: Any) -> None:
    """Folders of other keys in this store whose training is gone: their runs are never
    resumed by this start (params, data or code changed), so mark them FAILED and drop them."""
    if not base.is_dir():
        return
    for folder in sorted(base.iterdir()):
        if not folder.is_dir() or folder.name == key:
            continue
        state = _read_state(folder)
        if state is None or state.get("tracking_uri") != uri:
            # No state: a start killed before it made its run (or one that is just
            # starting: it locks before it writes state). Another store: not ours to judge.
            continue
        lock = _try_lock(folder)
        if lock is None:
            continue  # a live training owns it
        try:
            end_interrupted_run(
                client,
                state["run_id"],
                "FAILED",
                "interrupted; not resumed: the next training had other train params, data "
                f"or code (resume key {state.get('key')} -> {key})",
            )
            shutil.rmtree(folder, ignore_errors=True)
        finally:
            lock.close()


class ResumeCallback(L.Callback):
    """Makes a resumed fit continue the interrupted one exactly: the RNG streams (global and
    the augmentation generator) travel in the checkpoint, the datasets' epoch counters follow
    the restored epoch, and the log says where the fit picks up."""

    def __init__(self, resume: Resume, run_id: str) -> None:
        self.resume, self.run_id = resume, run_id
        self._loaded: dict[str, Any] | None = None

    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:

        gen = getattr(pl_module, "_aug_gen", None)
        states = _collect_rng_states(include_cuda=True)
        # numpy's state as plain lists: checkpoints stay loadable with weights_only=True
        name, keys, pos, has_gauss, gauss = states["numpy"]
        states["numpy"] = [name, keys.tolist(), pos, has_gauss, gauss]
        # How many epochs each train dataset/sampler has drawn: a checkpoint at an epoch's
        # end resumes with the next epoch's order, one within an epoch redraws that epoch's.
        done = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        counters = [obj.epoch - (0 if done else 1) for obj in self._counters(trainer)]
        checkpoint["trainyard_rng"] = {
            "next_epoch": trainer.current_epoch + (1 if done else 0),  # 0-based
            "data_epochs": counters,
            "global": states,
            "augment": None if gen is None else (str(gen.device), gen.get_state()),
        }

    def on_load_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:

        self._loaded = checkpoint.get("trainyard_rng")
        if self._loaded is None:
            return
        # Here, not at on_train_start: a resumed fit creates its train loader iterator (which
        # draws a seed from the global RNG) before on_train_start, just as the uninterrupted
        # fit does after the checkpoint was written.
        states = dict(self._loaded["global"])
        name, keys, pos, has_gauss, gauss = states["numpy"]
        states["numpy"] = (name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss)
        _set_rng_states(states)
        if self._loaded.get("augment") is not None:
            device, state = self._loaded["augment"]
            gen = torch.Generator(device=torch.device(device))
            gen.set_state(state)
            pl_module._aug_gen = gen

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        next_epoch = trainer.current_epoch
        if self._loaded is not None:
            next_epoch = int(self._loaded.get("next_epoch", next_epoch))
            # The datasets' epoch counters exist only now (their order is drawn lazily, at
            # the first batch).
            counters = self._loaded.get("data_epochs", [])
            for obj, epoch in zip(self._counters(trainer), counters, strict=False):
                obj.epoch = max(0, int(epoch))
            self._loaded = None
        if self.resume.resuming and trainer.is_global_zero:
            log.info(
                "resuming from epoch %d, step %d, MLflow run %s (%s)",
                next_epoch + 1,
                trainer.global_step,
                self.run_id,
                self.resume.ckpt_path,
            )

    @staticmethod
    def _counters(trainer: L.Trainer) -> list[Any]:
        """The train loaders' TensorBatches / EpochSampler: each counts the epochs it has
        drawn (its shuffle order is seed + that count), from 0 in a new process."""
        loaders = trainer.train_dataloader
        if loaders is None:
            return []
        found = []
        for dl in loaders if isinstance(loaders, list | tuple) else [loaders]:
            for obj in (getattr(dl, "dataset", None), getattr(dl, "sampler", None)):
                if obj is not None and isinstance(getattr(obj, "epoch", None), int):
                    found.append(obj)
        return found


@contextlib.contextmanager
def interruptions(resume: Resume) -> Iterator[None]:
    """Record SIGTERM/SIGINT in ``resume.signal``. Inside ``trainer.fit`` Lightning's own
    SIGTERM handler (which chains to this one) stops at the next batch; outside it, and for
    SIGINT, the signal raises KeyboardInterrupt here."""

    def handler(signum: int, frame: Any) -> None:
        resume.signal = signum
        if signum == signal.SIGINT or signal.getsignal(signal.SIGTERM) is handler:
            raise KeyboardInterrupt

    with signals_handled(handler):  # not the main thread: signals left alone
        yield
