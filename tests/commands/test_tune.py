"""``trainyard tune``: real Optuna studies in sqlite storages, real MLflow sqlite stores, the
real console script in subprocesses on a tiny image folder (36 drawn shapes at 16x16, two
epochs a trial: a trial takes a second or two, a process start about ten).

What a user relies on: a study of N trials is N child runs under one parent run and its best
trial becomes a queued DVC experiment; a kill mid-trial and a rerun continue the same study
and parent run with the killed trial failed and its run ended; a trial that fails does not
stop the study; two workers on one sqlite study share it without overshooting or
duplicating; a pruned trial is recorded as such; trial n draws from seed + n whichever
worker asks; a password in tune.storage is refused, unsaid. A study shared on PostgreSQL
by two clones: tests/commands/test_tune_shared.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import optuna
import pytest
import yaml
from optuna.trial import TrialState

from trainyard.commands import tune
from trainyard.core.errors import ParamsError
from trainyard.experiments import best as best_mod
from trainyard.experiments import study as st
from trainyard.experiments import workers
from trainyard.track.store import ensure_experiment
from trainyard.track.study_runs import StudyRuns

from conftest import (
    REPO,
    VENV_BIN,
    copy_repo,
    dvc,
    make_photo_folder,
    pause_env,
    stage_env,
    wait_paused,
)

TRAINYARD = str(VENV_BIN / "trainyard")
STUDY = "photos-tune"  # auto: <MLflow experiment>-tune, the experiment is the folder's name


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tune-data") / "photos"
    make_photo_folder(root, per_class=12, litter=False)
    return root


def base_args(photos: Path, epochs: int = 2) -> list[str]:
    """-S overrides for a trial of a second or two."""
    sets = {
        "data.source": "folder",
        "data.folder": str(photos),
        "data.image_size": 16,
        "train.arch": "cnn",
        "train.max_epochs": epochs,
        "train.time_budget_min": "null",
        "mlflow.system_metrics": "false",
    }
    return [a for k, v in sets.items() for a in ("-S", f"{k}={v}")]


def workdir(tmp_path: Path) -> Path:
    """A folder with the repository's params.yaml: not a git or DVC repository."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    return tmp_path


def env_for(cwd: Path) -> dict[str, str]:
    return stage_env(MLFLOW_TRACKING_URI=f"sqlite:///{cwd}/mlflow.db")


def start(cwd: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [TRAINYARD, "tune", *args],
        cwd=cwd,
        env=env_for(cwd),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def start_paused(cwd: Path, step: str, announce: Path, *args: str) -> subprocess.Popen:
    """A worker that pauses at ``step`` (``tune.trial_fitting:<n>``: its n-th trial's fit
    has started, the trial's run recorded) and says so in ``announce``; its output goes to
    ``announce``'s ``.log`` (a pipe nobody reads while the test waits could fill up)."""
    log = announce.with_suffix(".log")
    return subprocess.Popen(
        [TRAINYARD, "tune", *args],
        cwd=cwd,
        env=pause_env(step, announce, MLFLOW_TRACKING_URI=f"sqlite:///{cwd}/mlflow.db"),
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
    )


def run_tune(cwd: Path, *args: str, expect: int = 0) -> tuple[str, str]:
    proc = start(cwd, *args)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == expect, f"exit {proc.returncode}\n{out}\n{err[-6000:]}"
    assert "database is locked" not in err
    return out, err


def load_study(cwd: Path) -> optuna.Study:
    """The study. Opening a storage writes to it the first time (tables, version rows):
    under the workers' lock, as they do, so that a poll never races a starting worker."""
    with workers.StudyLock(cwd / "optuna.db.lock"):
        storage = optuna.storages.RDBStorage(f"sqlite:///{cwd}/optuna.db")
    return optuna.load_study(study_name=STUDY, storage=storage)


def study_runs(cwd: Path) -> tuple[mlflow.entities.Run, list[mlflow.entities.Run]]:
    """The study's parent run and its child runs (by trial number)."""
    client = mlflow.MlflowClient(f"sqlite:///{cwd}/mlflow.db")
    exp = client.get_experiment_by_name("photos")
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`optuna.study` = '{STUDY}'")
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1, [r.info.run_name for r in parents]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parents[0].info.run_id}
    return parents[0], sorted(children, key=lambda r: int(r.data.tags["optuna.trial"]))


def all_runs(cwd: Path) -> list[mlflow.entities.Run]:
    client = mlflow.MlflowClient(f"sqlite:///{cwd}/mlflow.db")
    exps = [e.experiment_id for e in client.search_experiments()]
    return client.search_runs(exps)


# ---------------------------------------------------------------- fast: the pieces


@pytest.mark.parametrize(
    "value",
    [
        0.0011155792840695788,
        1e-05,
        2.5e-10,
        1e16,
        0.1,
        3.0,
        64,
        True,
        None,
        "cnn",
        "1e-05",
        [32, 48],
    ],
)
def test_override_values_read_back_exactly_by_pyyaml(value):
    text = best_mod.yaml_value(value)
    assert yaml.safe_load(text) == value and type(yaml.safe_load(text)) is type(value), text


def test_overrides_apply_before_validation_and_a_bad_key_is_named(tmp_path):
    cwd = workdir(tmp_path)
    ns = argparse.Namespace(
        params=str(cwd / "params.yaml"), trials=3, timeout=None, study=None, overrides=[]
    )
    ns.overrides = [
        tune.parse_override("train.max_epochs=1"),
        tune.parse_override("data.limit=8000"),
    ]
    setup = tune.load_setup(**vars(ns))
    assert (setup.base.train.max_epochs, setup.base.data.limit, setup.trials) == (1, 8000, 3)
    assert setup.study_name == "fashion-mnist-tune"
    assert setup.overrides == {"train.max_epochs": 1, "data.limit": 8000}  # tune.* never kept
    ns.overrides = [tune.parse_override("train.max_epoch=1")]
    with pytest.raises(ParamsError, match=r"train\.max_epoch: unknown key"):
        tune.load_setup(**vars(ns))
    ns.overrides, ns.study = [], "no spaces allowed"
    with pytest.raises(ParamsError, match=r"tune\.study"):
        tune.load_setup(**vars(ns))
    with pytest.raises(argparse.ArgumentTypeError):
        tune.parse_override("train.lr")


@pytest.mark.parametrize(
    "url", ["postgresql://tune:s3cr3t@db/optuna", "postgresql://tune@db/optuna?password=s3cr3t"]
)
def test_a_password_in_the_storage_url_is_refused_without_saying_it(tmp_path, url):
    cwd = workdir(tmp_path)
    ns = argparse.Namespace(
        params=str(cwd / "params.yaml"), trials=None, timeout=None, study=None, overrides=[]
    )
    ns.overrides = [tune.parse_override(f"tune.storage={url}")]
    with pytest.raises(ParamsError) as err:
        tune.load_setup(**vars(ns))
    assert "tune.storage: the URL holds a password" in str(err.value)
    assert "PGPASSWORD or ~/.pgpass" in str(err.value) and "s3cr3t" not in str(err.value)
    ns.overrides = [tune.parse_override("tune.storage=postgresql://tune@db/optuna")]
    assert tune.load_setup(**vars(ns)).url == "postgresql://tune@db/optuna"


def test_a_dead_worker_is_told_from_a_live_one():
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    gone = workers.worker_id(int(proc.stdout))
    assert workers.worker_dead(gone.rsplit("/", 1)[0] + "/1")  # the pid is gone
    assert not workers.worker_dead(workers.worker_id())  # this process
    host, boot, pid, ticks = workers.worker_id().split("/")
    assert workers.worker_dead(f"{host}/{boot}/{pid}/{int(ticks) + 1}")  # same pid, another process
    assert not workers.worker_dead(f"elsewhere/{boot}/{proc.stdout.strip()}/1")  # another machine's


@pytest.mark.filterwarnings(
    "ignore:Heartbeat of storage", "ignore::optuna.exceptions.ExperimentalWarning"
)
def test_a_silent_worker_trial_is_failed_and_its_run_killed(tmp_path):
    """A worker on another machine (or one whose pid this machine cannot judge) that stops
    beating: Optuna fails its trial at the next trial start, the callback ends its run."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    ensure_experiment(uri, "photos")
    runs = StudyRuns(uri, "photos")
    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("photos").experiment_id
    runs.parent_id = client.create_run(exp, run_name=STUDY).info.run_id
    tags = {"mlflow.parentRunId": runs.parent_id, "optuna.study": STUDY, "optuna.trial": "0"}
    assert runs.trial_tags(STUDY, 0) == tags  # what a trial's training is tagged with
    child = client.create_run(exp, tags=tags).info.run_id
    storage = st.open_storage(
        f"sqlite:///{tmp_path}/optuna.db", st.StaleTrials(runs), heartbeat_s=1, grace_s=1
    )
    study = optuna.create_study(storage=storage, study_name=STUDY, direction="maximize")
    storage.record_heartbeat(study.ask()._trial_id)
    optuna.storages.fail_stale_trials(study)
    assert study.trials[0].state == TrialState.RUNNING  # within its grace period
    time.sleep(2.2)
    optuna.storages.fail_stale_trials(study)
    assert study.trials[0].state == TrialState.FAIL
    run = client.get_run(child)
    assert run.info.status == "KILLED" and run.data.tags["optuna.state"] == "FAIL"
    assert "stopped sending heartbeats" in run.data.tags["trainyard.end_reason"]
    assert client.get_run(runs.parent_id).info.status == "RUNNING"  # the study's own


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
def test_two_workers_of_one_storage_never_draw_alike_and_one_worker_repeats_itself(tmp_path):
    """Each worker loads the study with the same seed; trial n draws from seed + n, the
    number the storage assigns. Two workers asking at once (they used to draw from the
    trial count each had just read: the same count, the same draws) get two numbers and two
    draws; a study run again from scratch draws the same values trial for trial."""
    tune_params = tune.parse_params({}, "params").tune

    def draws(url: str, workers_asking: int) -> list[dict]:
        storage = optuna.storages.RDBStorage(url)
        studies = [st.load_study(storage, STUDY, tune_params, seed=42) for _ in range(3)]
        trials = [studies[i % workers_asking].ask() for i in range(6)]  # all RUNNING at once
        return [st.suggest(t, tune_params) for t in trials]

    shared = draws(f"sqlite:///{tmp_path}/shared.db", 3)
    assert len({json.dumps(d, sort_keys=True) for d in shared}) == 6
    alone = draws(f"sqlite:///{tmp_path}/alone.db", 1)
    assert alone == shared  # what trial n draws depends on n (and the seed), not the worker
    seeded = optuna.samplers.TPESampler(seed=42 + 4, n_startup_trials=3)
    ref = optuna.create_study(sampler=seeded)
    for _ in range(4):  # trials 0..3, so that the next is trial 4
        ref.add_trial(optuna.trial.create_trial(state=TrialState.FAIL))
    assert st.suggest(ref.ask(), tune_params) == alone[4]


# ---------------------------------------------------------------- slow: real studies


@pytest.mark.slow
def test_a_study_is_child_runs_under_one_parent_and_its_best_is_queued_in_dvc(tmp_path, photos):
    repo = copy_repo(tmp_path / "repo")
    out, err = run_tune(repo, "--trials", "3", *base_args(photos))
    study = load_study(repo)
    trials = study.get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 3, err[-4000:]
    parent, children = study_runs(repo)
    assert parent.info.run_name == STUDY and parent.info.status == "FINISHED"
    assert study.user_attrs[st.PARENT_ATTR] == parent.info.run_id
    assert [r.info.run_name for r in children] == [f"{STUDY}-trial-{n}" for n in range(3)]
    for trial, run in zip(trials, children, strict=True):
        assert run.info.status == "FINISHED" and run.data.tags["optuna.state"] == "COMPLETE"
        assert trial.user_attrs[st.RUN_ATTR] == run.info.run_id
        # the command's -S and the trial's sampled values are the run's params, exactly
        assert run.data.params["train.max_epochs"] == "2"
        assert run.data.params["data.image_size"] == "16"
        assert run.data.params["train.resume"] == "never"
        for key, value in trial.params.items():
            assert run.data.params[key] == str(value), key
    best = max(trials, key=lambda t: (t.value, -t.number))
    assert parent.data.tags["best_trial"] == str(best.number)
    assert parent.data.metrics["best_val_acc"] == pytest.approx(best.value)
    # MLflow's UI opens the study's experiment on its training runs, not the GenAI view
    exp = mlflow.MlflowClient(f"sqlite:///{repo}/mlflow.db").get_experiment_by_name("photos")
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    # one [tune] line per trial's start and end
    for n in range(3):
        assert f"[tune] trial {n} ({n + 1}/3): train.lr=" in err
        assert f"[tune] trial {n} ({n + 1}/3) COMPLETE: val/acc " in err
    assert f"best trial {best.number} of study {STUDY}: val/acc {best.value:.4f}" in out
    # the best as -S overrides, and queued as a DVC experiment with exactly those values
    written = yaml.safe_load((repo / "reports/tune-best.yaml").read_text())
    assert written["trial"] == best.number and written["params"] == best.params
    assert "train.max_epochs=2" in written["overrides"]
    name = f"{STUDY}-best-{best.number}"
    assert f"queued DVC experiment {name}" in out, out
    assert name in dvc(repo, "queue", "status").stdout
    shown = json.loads(dvc(repo, "exp", "show", "--json").stdout)
    queued = [
        rev["data"]["params"]["params.yaml"]["data"]
        for row in shown
        for exp in row.get("experiments") or []
        for rev in exp["revs"]
        if rev.get("name") == name
    ]
    assert len(queued) == 1
    assert queued[0]["train"]["lr"] == best.params["train.lr"]
    assert queued[0]["train"]["max_epochs"] == 2
    # A rerun with the same --trials: nothing left to run, nothing queued twice.
    out2, err2 = run_tune(repo, "--trials", "3", *base_args(photos))
    assert len(load_study(repo).get_trials()) == 3 and "trial 3" not in err2
    assert f"DVC experiment {name} is already queued or run" in out2
    assert study_runs(repo)[0].info.run_id == parent.info.run_id


@pytest.mark.slow
def test_killed_mid_trial_a_rerun_continues_the_study_and_ends_the_killed_run(tmp_path, photos):
    cwd = workdir(tmp_path / "work")
    args = ["--trials", "3", "--no-queue", *base_args(photos)]
    # The worker stops in trial 1's fit (its second trial), its run recorded: SIGKILL there.
    announce = tmp_path / "trial-1.paused"
    proc = start_paused(cwd, "tune.trial_fitting:2", announce, *args)
    wait_paused(announce, proc, announce.with_suffix(".log").read_text)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    study = load_study(cwd)
    assert [(t.number, t.state) for t in study.trials] == [
        (0, TrialState.COMPLETE),
        (1, TrialState.RUNNING),
    ]
    parent_before = study.user_attrs[st.PARENT_ATTR]
    killed_run = study.trials[1].user_attrs[st.RUN_ATTR]
    assert (
        mlflow.MlflowClient(f"sqlite:///{cwd}/mlflow.db").get_run(killed_run).info.status
        == "RUNNING"
    )

    _out, err = run_tune(cwd, *args)
    assert "trial 1: worker process" in err and "was killed mid-trial" in err, err[-4000:]
    study = load_study(cwd)
    assert [t.number for t in study.trials] == [0, 1, 2]
    assert study.trials[1].state == TrialState.FAIL
    assert "killed" in study.trials[1].user_attrs[st.ERROR_ATTR]
    assert study.trials[0].state == TrialState.COMPLETE and study.trials[2].state.is_finished()
    assert study.user_attrs[st.PARENT_ATTR] == parent_before
    parent, children = study_runs(cwd)
    assert parent.info.run_id == parent_before and parent.info.status == "FINISHED"
    killed = next(r for r in children if r.info.run_id == killed_run)
    assert killed.info.status == "KILLED" and killed.data.tags["optuna.state"] == "FAIL"
    assert "killed mid-trial" in killed.data.tags["trainyard.end_reason"]
    assert [r.info.status for r in all_runs(cwd) if r.info.status == "RUNNING"] == []


@pytest.mark.slow
def test_sigterm_mid_trial_fails_the_trial_and_ends_both_runs_killed(tmp_path, photos):
    cwd = workdir(tmp_path / "work")
    # The worker stops in trial 0's fit, its run recorded: SIGTERM there. Lightning's
    # handler notes it and the fit stops at its next batch, as it would in any batch.
    announce = tmp_path / "trial-0.paused"
    args = ["--trials", "2", "--no-queue", *base_args(photos)]
    proc = start_paused(cwd, "tune.trial_fitting", announce, *args)
    wait_paused(announce, proc, announce.with_suffix(".log").read_text)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    err = announce.with_suffix(".log").read_text()
    assert proc.returncode == 143, err[-4000:]
    assert "trainyard tune: terminated (SIGTERM); `trainyard tune` again continues" in err
    (trial,) = load_study(cwd).trials
    assert trial.state == TrialState.FAIL
    assert trial.user_attrs[st.ERROR_ATTR] == "interrupted by SIGTERM"
    parent, (child,) = study_runs(cwd)
    assert child.info.status == "KILLED" and child.data.tags["optuna.state"] == "FAIL"
    assert child.data.tags["trainyard.end_reason"].startswith("SIGTERM at epoch")  # train's
    assert parent.info.status == "KILLED"
    assert parent.data.tags["trainyard.end_reason"] == "SIGTERM in trainyard tune"
    assert not Path(trial.user_attrs[st.RESUME_ATTR]).exists()  # never resumed: removed


@pytest.mark.slow
def test_a_failing_trial_is_recorded_and_the_study_goes_on(tmp_path, photos):
    cwd = workdir(tmp_path)
    # batch size 0 is no batch size: such a trial fails validation, the others train.
    space = (
        "tune.space={train.batch_size: {choices: [0, 16]}, "
        "train.lr: {low: 0.001, high: 0.01, log: true}}"
    )
    # seed 1: the trials draw batch sizes 16, 0, 16 (a failure between two trainings)
    args = [*base_args(photos), "-S", space, "-S", "seed=1"]
    _out, err = run_tune(cwd, "--trials", "3", "--no-queue", *args)
    trials = load_study(cwd).trials
    failed = [t for t in trials if t.state == TrialState.FAIL]
    done = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(trials) == 3 and failed and done, [(t.state, t.params) for t in trials]
    assert max(t.number for t in trials) > min(t.number for t in failed)  # one ran after a failure
    for t in failed:
        assert t.params["train.batch_size"] == 0
        assert "train.batch_size" in t.user_attrs[st.ERROR_ATTR]
        assert f"[tune] trial {t.number} ({t.number + 1}/3) FAILED: invalid params" in err
    assert all(t.params["train.batch_size"] == 16 for t in done)
    _parent, children = study_runs(cwd)  # a trial that never trained has no run
    assert [int(r.data.tags["optuna.trial"]) for r in children] == [t.number for t in done]


@pytest.mark.slow
def test_two_workers_share_one_sqlite_study(tmp_path, photos):
    cwd = workdir(tmp_path / "work")
    args = ["--trials", "4", "--no-queue", *base_args(photos)]
    # Each worker stops in its first trial's fit until both are there: both take trials
    # whichever starts first, then they go on together (the pause ends when its file goes).
    announce = [tmp_path / f"worker-{i}.paused" for i in range(2)]
    procs = [start_paused(cwd, "tune.trial_fitting", a, *args) for a in announce]
    for proc, a in zip(procs, announce, strict=True):
        wait_paused(a, proc, a.with_suffix(".log").read_text)
    for a in announce:
        a.unlink()
    for proc, a in zip(procs, announce, strict=True):
        proc.wait(timeout=600)
        err = a.with_suffix(".log").read_text()
        assert proc.returncode == 0, err[-4000:]
        assert "database is locked" not in err and "Traceback" not in err
    trials = load_study(cwd).trials
    assert sorted(t.number for t in trials) == [0, 1, 2, 3]
    assert all(t.state.is_finished() and t.state != TrialState.FAIL for t in trials)
    workers = {t.user_attrs[st.WORKER_ATTR] for t in trials}
    assert len(workers) == 2, workers  # both took trials
    parent, children = study_runs(cwd)  # one parent, each trial one child under it
    assert sorted(int(r.data.tags["optuna.trial"]) for r in children) == [0, 1, 2, 3]
    assert parent.info.status == "FINISHED"


@pytest.mark.slow
def test_a_pruned_trial_is_recorded_pruned_and_its_run_killed(tmp_path, photos):
    cwd = workdir(tmp_path)
    # Five finished trials that scored 1.5 at every epoch (more than any accuracy): the
    # median pruner, past its start-up trials (3 for a 6-trial study), prunes the next one
    # at its first epoch.
    study = optuna.create_study(
        study_name=STUDY, storage=f"sqlite:///{cwd}/optuna.db", direction="maximize"
    )
    for _ in range(5):
        study.add_trial(
            optuna.trial.create_trial(value=1.5, intermediate_values={e: 1.5 for e in range(3)})
        )
    _out, err = run_tune(
        cwd,
        "--trials",
        "6",
        "--no-queue",
        *base_args(photos, epochs=3),
        "-S",
        "tune.pruner_warmup_epochs=0",
    )
    trial = load_study(cwd).trials[5]
    assert trial.state == TrialState.PRUNED, err[-4000:]
    assert list(trial.intermediate_values) == [0]
    assert "[tune] trial 5 (6/6) PRUNED at epoch 1: val/acc" in err
    _parent, children = study_runs(cwd)
    (run,) = children
    assert run.info.run_id == trial.user_attrs[st.RUN_ATTR]
    assert run.data.tags["optuna.state"] == "PRUNED" and run.info.status == "KILLED"
    assert run.data.tags["trainyard.end_reason"].startswith("pruned by Optuna at epoch 1")


@pytest.mark.slow
def test_a_bad_override_names_the_key(tmp_path):
    cwd = workdir(tmp_path)
    _out, err = run_tune(cwd, "-S", "train.lrr=0.1", expect=1)
    assert "trainyard tune: error: invalid params" in err and "train.lrr: unknown key" in err
    assert os.listdir(cwd) == ["params.yaml"]  # stopped before any store or study


def test_a_short_study_leaves_random_search():
    """TPE's start-up is a third of the study (3 to 10): an 8-trial study models the space
    after 3 random trials instead of never (Optuna's default start-up is 10)."""
    assert [st.startup_trials(n) for n in (1, 8, 20, 100)] == [3, 3, 6, 10]
