"""Interrupted training resumes: the resume decision (fast) and real `dvc repro` runs killed
with SIGKILL and SIGTERM in the train stage, then rerun (slow)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from trainyard.core.config import parse_params
from trainyard.core.handoffs import TRAIN_RECORD, TrainRecord
from trainyard.track.continued_runs import END_REASON_TAG
from trainyard.training.job import TrainJob
from trainyard.training.resume import (
    KEY_CODE,
    LAST_CKPT,
    PACKAGE,
    RESUME_ROOT,
    STATE_FILE,
    AtomicCheckpointIO,
    Resume,
    checkpoint_problem,
    prepare,
    resume_key,
)

from conftest import (
    dvc,
    pause_env,
    run_ok,
    set_params,
    small_pipeline_repo,
    wait_group_gone,
    wait_paused,
)

# ---------------------------------------------------------------- the decision (fast)


def key_of(
    data: str = "d" * 64, uri: str = "sqlite:///x.db", out: str = "models", seed: int = 42, **train
):
    job = TrainJob.from_params(parse_params({"seed": seed, "train": train}))
    return resume_key(job, data, uri, out)


def test_key_follows_what_defines_the_training():
    base = key_of()
    assert key_of() == base
    assert key_of(lr=0.002) != base
    assert key_of(max_epochs=3) != base
    assert key_of(data="e" * 64) != base  # new data
    assert key_of(uri="sqlite:///other.db") != base  # another MLflow store
    assert key_of(out="elsewhere") != base
    assert key_of(seed=1) != base
    # knobs that do not change what is learned
    assert key_of(resume="never") == base
    assert key_of(checkpoint_every_min=1) == base


def test_the_key_is_the_job_as_written_and_mlflow_records_it_as_planned():
    """A rerun after a kill plans again (its probe may time otherwise): the key hashes the
    auto keys as written; the params MLflow records are the planned ones."""
    job = TrainJob.from_params(parse_params({"train": {"lr": "auto", "max_epochs": "auto"}}))
    assert job.logged["train.lr"] == "auto"
    planned = job.planned(job.train.model_copy(update={"lr": 0.003, "max_epochs": 7}))
    assert (planned.logged["train.lr"], planned.logged["train.max_epochs"]) == (0.003, 7)
    assert planned.logged["seed"] == job.logged["seed"]
    assert resume_key(job, "d" * 64, "sqlite:///x.db", "models") != resume_key(
        planned, "d" * 64, "sqlite:///x.db", "models"
    )


def test_key_hashes_the_model_and_data_code_that_is_there():
    # A moved file would hash as "" and a code change would resume an old checkpoint.
    assert [name for name in KEY_CODE if not (PACKAGE / name).is_file()] == []


@pytest.fixture
def store(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("t")
    return uri, client, exp


def interrupted(root: Path, key: str, uri: str, client, exp, ckpt: bytes | None = b"valid"):
    """A folder as a killed training leaves it: state.json, a RUNNING run, maybe last.ckpt."""
    run = client.create_run(exp)
    folder = root / RESUME_ROOT / key
    folder.mkdir(parents=True)
    Resume(folder=folder, key=key).write_state(run.info.run_id, exp, uri)
    if ckpt == b"valid":
        ckpt_state = {"state_dict": {}, "epoch": 1, "global_step": 20, "loops": {}}
        torch.save(ckpt_state, folder / LAST_CKPT)
    elif ckpt is not None:
        (folder / LAST_CKPT).write_bytes(ckpt)
    return run.info.run_id, folder


def test_same_key_resumes_into_the_same_run(tmp_path, store):
    uri, client, exp = store
    run_id, folder = interrupted(tmp_path, "k1", uri, client, exp)
    res = prepare(tmp_path, "k1", "auto", uri, client, lead=True)
    try:
        assert res.resuming and res.run_id == run_id and res.ckpt_path == folder / LAST_CKPT
    finally:
        res.release()


def test_other_key_starts_fresh_and_fails_the_old_run(tmp_path, store):
    uri, client, exp = store
    run_id, folder = interrupted(tmp_path, "old", uri, client, exp)
    res = prepare(tmp_path, "new", "auto", uri, client, lead=True)
    res.release()
    assert not res.resuming and res.run_id is None
    run = client.get_run(run_id)
    assert run.info.status == "FAILED"
    assert "other train params, data or code" in run.data.tags[END_REASON_TAG]
    assert not folder.exists()


def test_resume_never_starts_fresh(tmp_path, store):
    uri, client, exp = store
    run_id, folder = interrupted(tmp_path, "k1", uri, client, exp)
    res = prepare(tmp_path, "k1", "never", uri, client, lead=True)
    res.release()
    assert not res.resuming
    assert client.get_run(run_id).info.status == "FAILED"
    assert not (folder / LAST_CKPT).exists() and not (folder / STATE_FILE).exists()


@pytest.mark.parametrize("ckpt", [b"PK\x03\x04 truncated", None])
def test_corrupt_or_missing_checkpoint_starts_fresh(tmp_path, store, caplog, ckpt):
    uri, client, exp = store
    caplog.set_level(logging.INFO, logger="trainyard")
    run_id, _ = interrupted(tmp_path, "k1", uri, client, exp, ckpt=ckpt)
    res = prepare(tmp_path, "k1", "auto", uri, client, lead=True)
    res.release()
    assert not res.resuming
    said = {(r.levelname, r.getMessage()) for r in caplog.records}
    if ckpt is None:
        assert any(m.startswith("not resuming (no checkpoint yet)") for _, m in said), said
    else:
        assert any(
            level == "WARNING" and m.startswith("last checkpoint") and "unreadable" in m
            for level, m in said
        ), said
    assert client.get_run(run_id).info.status == "FAILED"  # never left RUNNING


def test_a_live_training_keeps_its_folder(tmp_path, store, caplog):
    uri, client, exp = store
    caplog.set_level(logging.INFO, logger="trainyard")
    first = prepare(tmp_path, "k1", "auto", uri, client, lead=True)
    first.write_state(client.create_run(exp).info.run_id, exp, uri)
    try:
        second = prepare(tmp_path, "k1", "auto", uri, client, lead=True)
        assert second.private and second.folder != first.folder and not second.resuming
        assert "another training with the same params" in caplog.text
        # nor does a training with other params touch it
        prepare(tmp_path, "k2", "auto", uri, client, lead=True).release()
        assert (first.folder / STATE_FILE).is_file()
    finally:
        first.release()


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"epoch": 1}, path)
    assert checkpoint_problem(path) == "incomplete (no state_dict, global_step, loops)"

    def dies_mid_write(obj, fh, *a, **k):
        fh.write(b"half a checkpoint")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", dies_mid_write)
    with pytest.raises(KeyboardInterrupt):
        AtomicCheckpointIO().save_checkpoint({"epoch": 2}, path)
    assert torch.load(path, weights_only=True) == {"epoch": 1}  # the old one, whole
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_the_completed_run_says_why_it_stopped_and_what_trained_the_model(tmp_path, store):
    """The run's closing calls tag it from the fit's result: ``train.stopped_by``, and with
    train.refit which images trained the model that ships (``refit``)."""
    from lightning.pytorch.loggers.logger import DummyLogger

    from trainyard.track.train_run import TrainRun
    from trainyard.training.tracked_run import FitResult, TrackedRun

    uri, client, exp = store
    ckpt = tmp_path / "refit.ckpt"
    ckpt.write_bytes(b"weights")
    why = "train.refit: true: the 2 epochs validation chose"
    refit = {"trained_on": "train + val", "epochs": 2, "why": why}
    for info, expected in ((None, None), (refit, f"train + val, 2 epochs ({why})")):
        run_id = client.create_run(exp).info.run_id
        tracked = TrackedRun(uri, DummyLogger(), Resume(tmp_path, "k"), True, "")
        tracked.run = TrainRun(uri, run_id, client)
        result = FitResult(ckpt.name, 0.7, 3, 4, "max_epochs", 1.0, None, None, "ram", "", info)
        tracked.complete(result)
        run = client.get_run(run_id)
        assert tracked.completed and run.info.status == "FINISHED"
        assert run.data.tags["train.stopped_by"] == "max_epochs"
        assert run.data.tags.get("refit") == expected


# ---------------------------------------------------------------- real dvc repro (slow)

EPOCHS = 2  # the kill lands after epoch 1; the rerun must still train one more


@pytest.fixture(scope="module")
def repo(fashion_dir, tmp_path_factory) -> Path:
    """Prepared data, and the reference: an uninterrupted deterministic training."""
    repo = small_pipeline_repo(tmp_path_factory.mktemp("resume") / "trainyard", fashion_dir)
    # Half the small pipeline's slice: each epoch is still ~20 steps, so a kill still lands
    # between the first checkpoint and the end of training.
    set_params(
        repo,
        data={"limit": 1500, "val_size": 300},
        train={"max_epochs": EPOCHS, "deterministic": True},
    )
    dvc(repo, "repro", "prepare")
    t0 = time.perf_counter()
    run_ok(["python", "-m", "trainyard.stages.train", "--out", "reference"], repo)
    (repo / "reference/seconds").write_text(f"{time.perf_counter() - t0:.1f}")
    return repo


def client_of(repo: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{repo}/mlflow.db")


def history(client, run_id: str, key: str) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}


def start_repro(repo: Path, log: Path) -> subprocess.Popen:
    """`dvc repro train`, its train stage set to pause once it has written its first
    last.ckpt (announced in ``log`` with the suffix .paused)."""
    return subprocess.Popen(
        ["dvc", "repro", "train"],
        cwd=repo,
        env=pause_env(f"train.checkpoint_saved.{LAST_CKPT}", log.with_suffix(".paused")),
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: dvc and the train stage
    )


def kill_after_first_checkpoint(repo: Path, proc: subprocess.Popen, log: Path, sig: int) -> str:
    """Wait for the train stage's pause after its first last.ckpt, send ``sig`` to the
    whole group there, wait until every process of it is gone; the run id from
    state.json."""
    wait_paused(log.with_suffix(".paused"), proc, log.read_text)
    (ckpt,) = (repo / RESUME_ROOT).glob(f"*/{LAST_CKPT}")
    os.killpg(proc.pid, sig)
    proc.wait(timeout=120)
    wait_group_gone(proc.pid, time.monotonic() + 120, "the train stage did not exit")
    return json.loads((ckpt.parent / STATE_FILE).read_text())["run_id"]


def check_resumed(repo: Path, run_id: str, rerun: subprocess.CompletedProcess) -> None:
    out = rerun.stdout + rerun.stderr
    assert "[train] resuming from epoch" in out, out[-3000:]
    assert f"MLflow run {run_id}" in out
    assert TrainRecord.read(repo / TRAIN_RECORD).run_id == run_id
    client = client_of(repo)
    exp = client.get_experiment_by_name("fashion-mnist")
    running = client.search_runs([exp.experiment_id], "attributes.status = 'RUNNING'")
    assert running == [], [r.info.run_id for r in running]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["trainyard.resumes"] == "1"
    val = history(client, run_id, "val/acc")
    assert len(val) == EPOCHS, val  # every epoch's val/acc, each at its own step
    assert run.data.metrics["val/acc"] == val[max(val)]  # the final epoch's
    assert not list((repo / RESUME_ROOT).glob("*/*.ckpt"))  # done: nothing left to resume


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigkill_in_train_then_rerun_resumes_the_same_run(repo, tmp_path):
    log = tmp_path / "killed.log"
    proc = start_repro(repo, log)
    run_id = kill_after_first_checkpoint(repo, proc, log, signal.SIGKILL)
    client = client_of(repo)
    assert client.get_run(run_id).info.status == "RUNNING"  # what SIGKILL leaves
    t0 = time.perf_counter()
    rerun = dvc(repo, "repro", "train")
    seconds = time.perf_counter() - t0
    check_resumed(repo, run_id, rerun)
    # train.deterministic on the CPU: identical to the uninterrupted reference run
    reference = TrainRecord.read(TrainRecord.path_in(repo / "reference"))
    ref_id = reference.run_id
    for key in ("val/acc", "val/loss", "train/loss_step", "lr-AdamW"):
        assert history(client, run_id, key) == history(client, ref_id, key), key
    ref_s = float((repo / "reference/seconds").read_text())
    fit_s = TrainRecord.read(repo / TRAIN_RECORD).fit_time_s
    ref_fit_s = reference.fit_time_s
    print(
        f"\nresumed rerun {seconds:.1f}s (fit {fit_s:.1f}s) vs uninterrupted training "
        f"{ref_s:.1f}s (fit {ref_fit_s:.1f}s)"
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigterm_in_train_marks_killed_then_rerun_resumes(repo, tmp_path):
    set_params(repo, train={"lr": 0.002})  # new params: a fresh run first
    log = tmp_path / "terminated.log"
    proc = start_repro(repo, log)
    run_id = kill_after_first_checkpoint(repo, proc, log, signal.SIGTERM)
    assert "[train] WARNING interrupted by SIGTERM; the next `dvc repro` resumes it" in (
        log.read_text()
    )
    run = client_of(repo).get_run(run_id)
    assert run.info.status == "KILLED"
    assert run.data.tags[END_REASON_TAG].startswith("SIGTERM at epoch")
    rerun = dvc(repo, "repro", "train")
    check_resumed(repo, run_id, rerun)
    assert client_of(repo).get_run(run_id).data.tags["trainyard.previous_end"].startswith("SIGTERM")
