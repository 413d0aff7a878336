"""The train stage's job: params.yaml read once, at the stage, into what the fit uses.

``TrainJob.from_params`` is the one place the fit reads ``Params``; every step of
``training.fit.train`` gets the fields it needs from the frozen job (the train keys, the
seed, the experiment), never the whole params object. Where it reads and writes is the
``Workspace`` (folders and the MLflow store), beside the job: not params. The stage then
resolves the job once on this machine (``training.nodes.agree``: the hardware, the data's
card, the resume key, the ranks and the recipe's plan); ``TrainJob.planned`` is the same
job with the plan's train keys.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import lightning as L

from trainyard.core.card import Card, load_card
from trainyard.core.config import Params, TrainParams, flatten
from trainyard.track.store import resolve_tracking_uri


@dataclass(frozen=True)
class RunExtras:
    """What a caller above the train stage adds to a fit: ``trainyard tune`` names a trial's
    run, tags it as a child of the study's run, and prunes it with Optuna's callback."""

    run_name: str | None = None
    tags: dict[str, str] = field(default_factory=dict)
    callbacks: tuple[L.Callback, ...] = ()
    refit: bool = True  # train.refit may apply (a tune trial is judged on val: no refit)


@dataclass(frozen=True)
class Workspace:
    """Where a job reads and writes (and what the data it reads holds: ``card``), and the
    MLflow store it is recorded in: not params."""

    data_dir: Path
    out_dir: Path
    root: Path
    uri: str  # the MLflow tracking store
    params_file: Path | None = None  # the params as written, logged with the run

    @cached_property
    def card(self) -> Card:
        """The prepared data in ``data_dir``, described once for every step (read on first
        use)."""
        return load_card(self.data_dir)

    @classmethod
    def at(
        cls,
        data_dir: str | os.PathLike[str],
        out_dir: str | os.PathLike[str],
        root: str | os.PathLike[str] = ".",
        params_file: str | os.PathLike[str] | None = None,
    ) -> Workspace:
        """Reading ``data_dir`` and writing ``out_dir``, tracked in ``root``'s store
        (``MLFLOW_TRACKING_URI`` wins)."""
        return cls(
            Path(data_dir),
            Path(out_dir),
            Path(root),
            resolve_tracking_uri(root),
            None if params_file is None else Path(params_file),
        )


@dataclass(frozen=True)
class TrainJob:
    """One training: its train keys (``auto`` ones until ``planned``) and what else shapes
    it or its record: the seed, the validation batch, the MLflow experiment."""

    train: TrainParams
    seed: int
    eval_batch_size: int  # evaluate.batch_size: the validation batches
    experiment: str  # mlflow.experiment, resolved (one per dataset under auto)
    dataset: str  # the data's short name, for the run's name
    system_metrics: bool
    system_metrics_interval_s: float
    logged: dict[str, Any]  # every param MLflow records (dotted keys): as planned, once planned

    @classmethod
    def from_params(cls, params: Params) -> TrainJob:
        """The job ``params`` describe."""
        return cls(
            train=params.train,
            seed=params.seed,
            eval_batch_size=params.evaluate.batch_size,
            experiment=params.experiment_name(),
            dataset=params.dataset_name(),
            system_metrics=params.mlflow.system_metrics,
            system_metrics_interval_s=params.mlflow.system_metrics_interval_s,
            logged=params.flat(),
        )

    def planned(self, train: TrainParams) -> TrainJob:
        """This job with ``train`` (the plan's: every ``auto`` key resolved), and the params
        MLflow records (``logged``) with those train keys."""
        return replace(
            self, train=train, logged=self.logged | flatten(train.model_dump(), "train.")
        )
