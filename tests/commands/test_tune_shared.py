"""``trainyard tune`` as a team shares a study: the real local team stack (team.stack:
Debian's PostgreSQL, ``mlflow server --app-name basic-auth`` on it), two clones of the
repository, alice and bob each running a worker of one Optuna study on PostgreSQL at once.

What a team relies on: the workers split ``--trials`` between them, exactly, without
repeating a trial's params; one worker SIGKILLed mid-trial leaves the study to the other,
which fails the killed trial and ends its MLflow run, and finishes the study; a password in
``tune.storage`` (params.yaml is committed and logged) is refused, never echoed; a wrong
``PGPASSWORD`` or a server that is not there is one line before any training.

The killed worker runs under a hostname of its own (``unshare --uts``) where the machine
allows it, so that the other worker cannot tell its death from its pid and relies on
Optuna's heartbeats, as a worker on another machine would.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import mlflow
import optuna
import pytest
from optuna.trial import TrialState

from team.stack import Ports, Stack, down, up
from trainyard.core.pause_points import PAUSE_AT, PAUSE_FILE
from trainyard.experiments import study as st
from trainyard.experiments import workers

from conftest import VENV_BIN, copy_repo, free_port, make_photo_folder, stage_env, wait_paused

pytestmark = pytest.mark.slow
TRIALS = 8
STUDY = "shared-tune"
_STORAGES: dict[str, optuna.storages.RDBStorage] = {}  # the test's own, by URL (load)


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    """The team stack, and this process signed in as alice (MLflow, PostgreSQL)."""
    folder = tmp_path_factory.mktemp("team") / ".team"
    try:
        started = up(folder, Ports(free_port(), free_port(), free_port()))
        with pytest.MonkeyPatch.context() as mp:
            for key, value in started.env("alice").items():
                mp.setenv(key, value)
            yield started
    finally:
        for storage in _STORAGES.values():
            storage.engine.dispose()
        _STORAGES.clear()
        down(folder, purge=True)


@pytest.fixture(scope="module")
def clones(tmp_path_factory) -> tuple[Path, Path, Path]:
    """alice's and bob's clones, and a folder of 36 tiny images both train on."""
    base = tmp_path_factory.mktemp("tune-shared")
    photos = base / "photos"
    make_photo_folder(photos, per_class=12, litter=False)
    return copy_repo(base / "alice"), copy_repo(base / "bob"), photos


def tune_args(stack: Stack, photos: Path, study: str = STUDY) -> list[str]:
    """A trial of one epoch on 16x16 images: a few seconds of training."""
    sets = {
        "data.source": "folder",
        "data.folder": str(photos),
        "data.image_size": 16,
        "train.arch": "cnn",
        "train.max_epochs": 1,
        "train.time_budget_min": "null",
        "mlflow.system_metrics": "false",
        "tune.storage": stack.optuna_url,
        "tune.study": study,
    }
    return ["--no-queue", *(a for k, v in sets.items() for a in ("-S", f"{k}={v}"))]


def other_hostname() -> list[str]:
    """A command prefix that runs its command under another hostname, or [] where this
    machine does not allow a UTS namespace (then the pid tells the death)."""
    prefix = ["unshare", "--uts", "sh", "-c", 'hostname tune-elsewhere && exec "$@"', "sh"]
    try:
        probe = subprocess.run([*prefix, "hostname"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return prefix if probe.stdout.strip() == "tune-elsewhere" else []


def start(
    repo: Path, stack: Stack, user: str, *args: str, prefix: tuple[str, ...] = (), **env: str
) -> subprocess.Popen:
    return subprocess.Popen(
        [*prefix, str(VENV_BIN / "trainyard"), "tune", *args],
        cwd=repo,
        env=stage_env(**(stack.env(user) | env)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the kill takes the worker's whole process group
    )


def load(stack: Stack, study: str = STUDY) -> optuna.Study | None:
    """The study, through one storage for the module (an engine per poll would soon use up
    PostgreSQL's connections), opened under the workers' lock as they open it."""
    if stack.optuna_url not in _STORAGES:
        with workers.AdvisoryLock(stack.optuna_url, STUDY):
            _STORAGES[stack.optuna_url] = optuna.storages.RDBStorage(stack.optuna_url)
    try:
        return optuna.load_study(study_name=study, storage=_STORAGES[stack.optuna_url])
    except KeyError:  # not created yet
        return None


def pause_at(announce: Path, trial: int) -> dict[str, str]:
    """A worker's environment to pause in its ``trial``-th trial's fit, said in ``announce``."""
    return {PAUSE_AT: f"tune.trial_fitting:{trial}", PAUSE_FILE: str(announce)}


def acquiring(lock: workers.AdvisoryLock) -> threading.Event:
    """``lock.acquire()`` in a thread; the event is set once it holds the lock."""
    done = threading.Event()
    threading.Thread(target=lambda: (lock.acquire(), done.set()), daemon=True).start()
    return done


def test_the_study_lock_is_one_worker_at_a_time_and_dies_with_its_holder(stack):
    """What keeps the study at exactly --trials across machines: PostgreSQL's advisory
    lock, taken by a worker to count the trials and start the next one."""
    first = workers.AdvisoryLock(stack.optuna_url, STUDY)
    second = workers.AdvisoryLock(stack.optuna_url, STUDY)
    first.acquire()
    waiting = acquiring(second)
    assert not waiting.wait(1.0)
    first.release()
    assert waiting.wait(10)
    second.release()
    # A worker SIGKILLed while it holds the lock: its connection goes, the lock with it.
    code = (
        "import sys, time; from trainyard.experiments.workers import AdvisoryLock as L; "
        "L(sys.argv[1], sys.argv[2]).acquire(); print('held', flush=True); time.sleep(600)"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, stack.optuna_url, STUDY], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline() == "held\n"
        waiting = acquiring(first)
        assert not waiting.wait(1.0)
    finally:
        holder.kill()
        holder.wait()
    assert waiting.wait(10), "the killed holder's lock was not released"
    first.release()


def test_two_workers_split_a_postgresql_study_and_one_survives_the_others_kill(
    stack, clones, tmp_path
):
    alice, bob, photos = clones
    args = ["--trials", str(TRIALS), *tune_args(stack, photos)]
    elsewhere = other_hostname()
    # alice's worker stops in its first trial's fit, bob's in its second's (the trial's run
    # recorded; he finished one before it), whichever starts first: both took trials. Then
    # bob's is SIGKILLed there and alice's goes on.
    paused = {user: tmp_path / f"{user}.paused" for user in ("alice", "bob")}
    t0 = time.monotonic()
    survivor = start(alice, stack, "alice", *args, **pause_at(paused["alice"], 1))
    victim = start(bob, stack, "bob", *args, prefix=tuple(elsewhere), **pause_at(paused["bob"], 2))
    pids = {
        user: wait_paused(paused[user], proc, lambda p=proc: p.communicate()[1], timeout=240)
        for user, proc in (("alice", survivor), ("bob", victim))
    }
    (killed,) = (  # bob's trial, by the pid his worker announced
        t
        for t in load(stack).get_trials()
        if t.state == TrialState.RUNNING
        and t.user_attrs[st.WORKER_ATTR].split("/")[2] == str(pids["bob"])
    )
    os.killpg(victim.pid, signal.SIGKILL)
    killed_on = datetime.datetime.now()  # Optuna's trial times: local, naive
    victim.communicate()
    killed_at = time.monotonic() - t0
    paused["alice"].unlink()  # alice's worker goes on
    out, err = survivor.communicate(timeout=420)
    took = time.monotonic() - t0
    assert survivor.returncode == 0, err[-6000:]
    assert "Traceback" not in err, err[max(0, err.find("Traceback") - 3000) :][:9000]  # which call

    study = load(stack)
    trials = study.get_trials()
    assert sorted(t.number for t in trials) == list(range(TRIALS)), [t.number for t in trials]
    drawn = [tuple(sorted(t.params.items())) for t in trials]
    assert len(set(drawn)) == TRIALS, "a trial repeated another's params"
    who = {t.user_attrs[st.WORKER_ATTR] for t in trials}
    assert len(who) == 2, who  # both took trials
    failed = [t for t in trials if t.state == TrialState.FAIL]
    assert [t.number for t in failed] == [killed.number], [(t.number, t.state) for t in trials]
    assert all(
        t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials if t not in failed
    )

    # The killed trial's run, found from the trial, ended by alice's worker with the reason.
    # The stack's URI named: another test in this process may have set MLflow's global one.
    client = mlflow.MlflowClient(tracking_uri=stack.mlflow_uri)
    run = client.get_run(failed[0].user_attrs[st.RUN_ATTR])
    assert run.info.status == "KILLED" and run.data.tags["optuna.state"] == "FAIL"
    assert run.data.tags["optuna.trial"] == str(killed.number)
    reason = run.data.tags["trainyard.end_reason"]
    if elsewhere:  # another machine's worker: its heartbeats stopped
        assert "stopped sending heartbeats" in reason, reason
    else:
        assert "was killed mid-trial" in reason, reason
    assert f"trial {killed.number}: " in err
    # One study run for both workers, ended by the survivor; no run left RUNNING.
    exp = client.get_experiment_by_name("photos")
    runs = client.search_runs([exp.experiment_id], f"tags.`optuna.study` = '{STUDY}'")
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert parents[0].data.tags["optuna.storage"] == stack.optuna_url  # no password in it
    assert parents[0].info.run_id == study.user_attrs[st.PARENT_ATTR]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parents[0].info.run_id}
    assert not [r.info.run_name for r in runs if r.info.status == "RUNNING"]
    assert f"best trial {st.best_trial(study).number} of study {STUDY}" in out
    split = sorted(sum(t.user_attrs[st.WORKER_ATTR] == w for t in trials) for w in who)
    failed_after = (failed[0].datetime_complete - killed_on).total_seconds()
    print(
        f"\n{TRIALS} trials in {took:.0f} s, split {split[0]}/{split[1]}; bob's worker killed "
        f"at {killed_at:.0f} s in trial {killed.number}, failed {failed_after:.0f} s later by "
        f"alice's ({'heartbeats' if elsewhere else 'its pid'})"
    )


def test_a_bad_storage_stops_the_command_before_training_with_one_line(stack, clones):
    """A password in tune.storage is refused by the params check and never said; a wrong
    PGPASSWORD and a port nobody listens on are one line each, before any trial."""
    alice, _bob, photos = clones
    secret = stack.secrets["optuna"]
    with_password = stack.optuna_url.replace("optuna@", f"optuna:{secret}@")
    closed = f"postgresql://optuna@127.0.0.1:{free_port()}/optuna"
    args = tune_args(stack, photos, "refused-tune")
    procs = {  # all three at once, by what their error says
        "tune.storage: the URL holds a password": start(
            alice, stack, "alice", *args, "-S", f"tune.storage={with_password}"
        ),
        "password authentication failed": start(
            alice, stack, "alice", *args, PGPASSWORD="not-the-password"
        ),
        "Connection refused": start(alice, stack, "alice", *args, "-S", f"tune.storage={closed}"),
    }
    said = {}
    for key, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 1, err[-4000:]
        assert "Traceback" not in err and "[tune] trial" not in err and "[tune] epoch" not in err
        assert secret not in out + err and "not-the-password" not in out + err
        lines = [ln for ln in err.splitlines() if ln.startswith("trainyard tune: error:")]
        assert len(lines) == 1, err[-4000:]
        said[key] = err[err.index(lines[0]) :]
    refused = said["tune.storage: the URL holds a password"]
    assert refused.startswith("trainyard tune: error: invalid params in")
    assert "\n  tune.storage: the URL holds a password" in refused and "PGPASSWORD" in refused
    for key in ("password authentication failed", "Connection refused"):
        (line,) = said[key].splitlines()  # one line, nothing after it
        assert line.startswith("trainyard tune: error: tune.storage postgresql://optuna@127.0.0.1:")
        assert "cannot open the Optuna storage" in line and key in line, line
    assert (
        "(libpq reads the password from PGPASSWORD or ~/.pgpass)"
        in said["password authentication failed"]
    )
    assert load(stack, "refused-tune") is None  # none of them got as far as the study
