"""``trainyard tune``: an Optuna search over params.yaml's ``tune.space``.

Each trial is one real training (trainyard.training.fit.train) on the base params
(params.yaml and the command's ``-S``) with the space's keys sampled by TPE, pruned on
``val/acc`` by the median pruner, and recorded as a child MLflow run of the study's run. The
study lives in an Optuna RDB storage: running the command again continues it up to
``--trials`` in all, also
after a kill, and several workers (processes, machines) may run one study at once. At the
end the best trial is printed, written as -S overrides and queued as a DVC experiment.
The worker and its trials: trainyard.experiments.trials; Optuna (the storage, the study,
a trial's plumbing): trainyard.experiments.study; the study's MLflow runs:
trainyard.track.study_runs; the best trial as a DVC experiment: trainyard.experiments.best.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from trainyard.commands import Command, Subparsers, command_parser
from trainyard.core.config import DEFAULT_PARAMS, parse_params
from trainyard.core.errors import ParamsError, Terminated, TrainyardError
from trainyard.stages.runner import configure_logging

if TYPE_CHECKING:
    from trainyard.experiments.study import Study
    from trainyard.experiments.trials import Setup, Tuner

log = logging.getLogger("trainyard.experiments.tune")  # the trials' logger too
HELP = "hyperparameter search with Optuna over params.yaml's tune.space"


# ---------------------------------------------------------------- command line


def parse_override(text: str) -> tuple[str, Any]:
    """``key=value`` as DVC's ``-S`` takes it: a dotted key, the value read as YAML."""
    key, eq, value = text.partition("=")
    if not eq or not key.strip() or any(not p for p in key.strip().split(".")):
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE, e.g. train.lr=0.001")
    try:
        parsed = yaml.safe_load(value) if value.strip() else value
    except yaml.YAMLError:
        parsed = value
    return key.strip(), parsed


def _positive(kind: type) -> Any:
    def check(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be above 0")
        return value

    return check


def add_parser(subparsers: Subparsers) -> None:
    parser = command_parser(subparsers, "tune", HELP, CmdTune)
    parser.add_argument(
        "--trials",
        type=_positive(int),
        metavar="N",
        help="trials in the study in all, earlier runs' included: a rerun continues up to N "
        "(default: tune.trials)",
    )
    parser.add_argument(
        "--timeout",
        type=_positive(float),
        metavar="MIN",
        help="start no trial after MIN minutes (default: tune.timeout_min)",
    )
    parser.add_argument(
        "-S",
        "--set-param",
        dest="overrides",
        action="append",
        default=[],
        type=parse_override,
        metavar="KEY=VALUE",
        help="override a param for every trial, as dvc exp run -S (e.g. -S data.limit=8000)",
    )
    parser.add_argument("--params", default=str(DEFAULT_PARAMS), help="params file")
    parser.add_argument(
        "--study",
        metavar="NAME",
        help="Optuna study name (default: tune.study; auto = <MLflow experiment>-tune)",
    )
    parser.add_argument(
        "--no-queue",
        action="store_true",
        help="do not queue the best trial as a DVC experiment",
    )


def load_raw(path: Path) -> dict[str, Any]:
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ParamsError(f"{path}: params file not found (run from the repository root)") from None
    except yaml.YAMLError as err:
        raise ParamsError(f"{path}: not valid YAML: {err}") from None
    if raw is not None and not isinstance(raw, dict):
        raise ParamsError(f"{path}: expected a mapping of keys, got {type(raw).__name__}")
    return raw or {}


def load_setup(
    params: str | Path,
    overrides: list[tuple[str, Any]],
    trials: int | None = None,
    timeout: float | None = None,
    study: str | None = None,
) -> Setup:
    """The params file with the -S overrides (KEY, VALUE) and the flags (as ``tune.*``
    keys), validated as a whole: a bad key or value names itself."""
    from trainyard.experiments import study as st
    from trainyard.experiments.trials import Setup, set_key

    path = Path(params)
    raw = load_raw(path)
    given_overrides = dict(overrides)
    flags = {"tune.trials": trials, "tune.timeout_min": timeout, "tune.study": study}
    chosen = [(k, v) for k, v in flags.items() if v is not None]
    for key, value in [*given_overrides.items(), *chosen]:
        set_key(raw, key, value)
    given = bool(given_overrides) or any(v is not None for v in flags.values())
    base = parse_params(raw, f"{path} with the command's -S and flags" if given else str(path))
    if base.train.num_nodes > 1 or (isinstance(base.train.devices, int) and base.train.devices > 1):
        raise ParamsError(
            "train.devices / train.num_nodes: trainyard tune trains each trial on one device; "
            "for several GPUs run one tune worker per GPU (CUDA_VISIBLE_DEVICES=N)"
        )
    keep = {k: v for k, v in given_overrides.items() if not k.startswith("tune.")}
    return Setup(raw, base, keep, st.storage_url(base.tune))


# ---------------------------------------------------------------- the command


def report_best(tuner: Tuner, study: Study, queue: bool) -> bool:
    """Print the best trial, write it as -S overrides, queue it as a DVC experiment;
    False when no trial completed."""
    from trainyard.experiments import best as best_mod
    from trainyard.experiments import study as st
    from trainyard.experiments import workers
    from trainyard.experiments.study import best_trial, trial_values

    top = best_trial(study)
    if top is None:
        print(f"no trial of study {study.study_name} completed: see the failures above")
        return False
    setup = tuner.setup
    best = best_mod.Best(
        study=study.study_name,
        number=top.number,
        value=float(top.value or 0.0),
        params=trial_values(top),
        base_overrides=setup.overrides,
        storage=workers.redacted(setup.url),
    )
    print(f"best trial {top.number} of study {study.study_name}: val/acc {best.value:.4f}")
    for key, value in best.params.items():
        print(f"  {key} = {best_mod.yaml_value(value)}")
    runs = f"MLflow run {tuner.runs.parent_id}, experiment {tuner.runs.experiment}"
    print(f"  ({runs}, child run {top.user_attrs.get(st.RUN_ATTR, '?')})")
    path = best.write(setup.root)
    print(f"written {path.relative_to(setup.root)} (the -S overrides of the best trial)")
    if queue:
        line = best_mod.queue(best, setup.root)
        print(line)
        if line.startswith("queued"):
            print(f"  or run it now: {best.command()}")
            return True
    print(f"run it as a pipeline experiment: {best.command()}")
    return True


def _terminate(signum: int, frame: Any) -> None:
    raise Terminated


class CmdTune(Command):
    def run(self) -> int:
        """0 when the study has a completed trial, 1 on an error or when none completed,
        130/143 when interrupted (a rerun continues)."""
        from trainyard.experiments.study import quiet_optuna
        from trainyard.experiments.trials import Tuner

        configure_logging("tune")
        quiet_optuna()
        signal.signal(signal.SIGTERM, _terminate)
        a = self.args
        tuner: Tuner | None = None
        try:
            tuner = Tuner(load_setup(a.params, a.overrides, a.trials, a.timeout, a.study))
            tuner.open()
            tuner.run_trials()
            study = tuner.finish()
            return 0 if report_best(tuner, study, queue=not a.no_queue) else 1
        except TrainyardError as err:
            print(f"trainyard tune: error: {err}", file=sys.stderr)
            return 1
        except KeyboardInterrupt as err:
            return _interrupted(tuner, err)


def _interrupted(tuner: Tuner | None, err: KeyboardInterrupt) -> int:
    """End the study's MLflow run as interrupted; 130 (Ctrl-C) or 143 (SIGTERM)."""
    from trainyard.track.interrupts import release_interrupted_store

    term = isinstance(err, Terminated)
    what = "SIGTERM" if term else "Ctrl-C (SIGINT)"
    if tuner is not None and tuner.runs.parent_id:
        tuner.lock.release()
        release_interrupted_store(err)
        try:
            tuner.finish(interrupted=f"{what} in trainyard tune")
        except Exception as end_err:
            log.warning("could not end the study's MLflow run: %s", end_err)
    print(
        f"trainyard tune: {'terminated (SIGTERM)' if term else 'interrupted'}; "
        "`trainyard tune` again continues the study",
        file=sys.stderr,
    )
    return 143 if term else 130
