"""The train stage's job: params.yaml read once, at the stage, into what the fit uses.

``TrainJob.from_params`` is the one place the fit reads ``Params``; every step of
``training.fit.train`` gets the fields it needs from the frozen job (the train keys, the
seed, the experiment), never the whole params object. Where it reads and writes is the
``Workspace`` (folders and the MLflow store), beside the job: not params. The stage then
resolves the job once on this machine (``training.nodes.agree``: the hardware, the data's
card, the resume key, the ranks and the recipe's plan); ``TrainJob.planned`` is the same
job with the plan's train keys.

The ``Plan`` is what ``training.recipe.plan`` decided for the job's ``auto`` keys, each
``Choice`` with who made it and why: said in the log (``describe``), saved beside the
resumable checkpoint (``recipe.json``: a resumed fit keeps it, ``load_plan``) and recorded
in the MLflow run (``Plan.tags``). The rules that make one are the recipe's; the record is
the job's, so the fit and its run read it without the recipe's rules and probes.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import lightning as L

from trainyard.core.card import Card, load_card
from trainyard.core.config import Params, TrainParams, flatten
from trainyard.core.io import atomic_write_json
from trainyard.track.store import resolve_tracking_uri

log = logging.getLogger(__name__)

RECIPE_FILE = "recipe.json"  # the plan, beside the resumable checkpoint and in the MLflow run
# The train keys a plan holds: those the recipe fills, in the order it decides them.
KEYS = (
    "pretrained",
    "arch",
    "augment",
    "batch_size",
    "lr",
    "max_epochs",
    "early_stopping_patience",
    "compile",
)


@dataclass(frozen=True)
class RunExtras:
    """What a caller above the train stage adds to a fit: ``trainyard tune`` names a trial's
    run, tags it as a child of the study's run, and prunes it with Optuna's callback."""

    run_name: str | None = None
    tags: dict[str, str] = field(default_factory=dict)
    callbacks: tuple[L.Callback, ...] = ()


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


@dataclass(frozen=True)
class Choice:
    """One train key: its value, who set it (``params`` or the recipe) and why."""

    key: str
    value: Any
    by: str
    reason: str

    def line(self) -> str:
        return f"train.{self.key} = {self.value} ({self.by}: {self.reason})"


@dataclass(frozen=True)
class Plan:
    """The resolved train params and the choices that made them."""

    train: TrainParams
    choices: tuple[Choice, ...]
    finetune: bool
    frozen_stages: int = 0  # front stages of the fine-tuned net frozen throughout

    @property
    def planned_epochs(self) -> bool:
        """The recipe chose max_epochs (so the time budget is what bounds the fit)."""
        return any(c.key == "max_epochs" and c.by == "recipe" for c in self.choices)

    def to_dict(self) -> dict[str, Any]:
        return {
            "recipe": self.train.recipe,
            "finetune": self.finetune,
            "frozen_stages": self.frozen_stages,
            "choices": {
                c.key: {"value": c.value, "by": c.by, "reason": c.reason} for c in self.choices
            },
        }

    def tags(self) -> dict[str, str]:
        """MLflow tags: ``recipe.<key>`` = "<value> (<by>: <reason>)"."""
        return {f"recipe.{c.key}": c.line().split(" = ", 1)[1][:5000] for c in self.choices}

    def save(self, path: Path) -> None:
        atomic_write_json(path, self.to_dict())


def load_plan(path: Path, tp: TrainParams) -> Plan | None:
    """The plan saved beside an interrupted run's checkpoint (a resumed fit keeps the
    epochs it planned, whatever a new timing probe would say), or None."""
    try:
        saved = json.loads(path.read_text())
        found = saved["choices"]
        # Every key: a plan saved by an older trainyard (no compile) is planned anew.
        choices = tuple(
            Choice(k, found[k]["value"], found[k]["by"], found[k]["reason"]) for k in KEYS
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
    values = {c.key: c.value for c in choices if c.key in KEYS}
    try:
        train = tp.model_copy(update=values)
    except ValueError:
        return None
    log.info("recipe: the interrupted run's plan (%s)", path)
    return Plan(train, choices, bool(saved.get("finetune")), int(saved.get("frozen_stages", 0)))


def describe(p: Plan) -> list[str]:
    """One line per choice, for the log."""
    head = f"recipe {p.train.recipe}" + (" (fine-tune)" if p.finetune else "")
    if p.frozen_stages:
        head += f" (front {p.frozen_stages} stages frozen)"
    return [f"{head}: {c.line()}" for c in p.choices]
