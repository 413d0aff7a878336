"""Ctrl-C in export, evaluate and the registry step.

Fast: the registration cut off at each of its writes (a real sqlite MLflow store).
Slow: a real `dvc repro` in a temp copy of the repository, its whole process group sent
SIGINT as a terminal's Ctrl-C does, at a step inside the stage's work where the stage
announces a pause (trainyard.core.pause_points): never a race with the stage. Each time:
dvc repro fails promptly; every output of the interrupted stage is absent or whole; no temp
file is left; dvc.lock still calls the stage out of date and earlier stages stay intact; the
MLflow run is not left RUNNING and the registry holds no version without its alias; the next
`dvc repro` finishes the job and the one after runs nothing. Train: test_resume.py.
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from trainyard.core.handoffs import (
    EXPORT_RECORD,
    REGISTRY_RECORD,
    TRAIN_RECORD,
    Registration,
    RegistryRecord,
    TrainRecord,
)
from trainyard.track.continued_runs import END_REASON_TAG
from trainyard.track.registry import CHALLENGER, CHAMPION, SHA_TAG, register_and_promote

from conftest import (
    EVALUATE_REPORTS,
    REPO,
    STAGES,
    copy_reproduced,
    dvc,
    pause_env,
    set_params,
    stage_env,
    wait_group_gone,
    wait_paused,
)

EXPORT_OUTS = ("models/model.onnx", "models/model.onnx.sha256", str(EXPORT_RECORD))
EVALUATE_OUTS = (*EVALUATE_REPORTS, str(REGISTRY_RECORD))
MODEL = "fashion-mnist-classifier"


# ------------------------------------------------ the registration, cut off (fast)


@pytest.fixture
def store(mlflow_db):
    """A run with a model logged in it (no file behind it); each test registers its own
    model name, ``m-<run id>``."""
    import mlflow

    uri, exp = mlflow_db
    mlflow.set_tracking_uri(uri)
    with mlflow.start_run(experiment_id=exp) as run:
        model = mlflow.create_external_model(name="model")
    return mlflow.MlflowClient(uri), run.info.run_id, model.model_uri


def name_of(run_id: str) -> str:
    return f"m-{run_id}"


def register(client: Any, run_id: str, uri: str, sha: str = "a" * 64, acc: float = 0.9):
    return register_and_promote(client, name_of(run_id), uri, run_id, acc, "d.dir", sha, 0.0)


def registry_state(client: Any, name: str) -> tuple[dict[int, dict], dict[str, int]]:
    """({version: tags}, {alias: version})."""
    versions = {int(v.version): v.tags for v in client.search_model_versions(f"name = '{name}'")}
    aliases = {a: int(v) for a, v in client.get_registered_model(name).aliases.items()}
    return versions, aliases


def check_registry_consistent(versions: dict[int, dict], aliases: dict[str, int]) -> None:
    """No version without its decision, and each alias on a version that decided it."""
    for v, tags in versions.items():
        assert tags.get("decision") in (CHAMPION, CHALLENGER), (v, tags)
    for alias, v in aliases.items():
        assert versions[v]["decision"] == alias, (alias, v, versions[v])


@pytest.mark.parametrize(
    "cut",
    [
        "in register_model, after the version is made",
        "before the decision tags",
        "before the alias",
        "just after the alias moved",
    ],
)
def test_ctrl_c_in_registration_leaves_no_version_without_alias(store, monkeypatch, cut):
    import mlflow

    client, run_id, uri = store
    assert register(client, run_id, uri, sha="0" * 64)["version"] == 1  # champion v1
    before = registry_state(client, name_of(run_id))

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    if cut.startswith("in register_model"):
        real = mlflow.register_model

        def made_then_interrupted(*a, **k):
            real(*a, **k)
            raise KeyboardInterrupt

        monkeypatch.setattr(mlflow, "register_model", made_then_interrupted)
    elif cut == "before the decision tags":
        monkeypatch.setattr(client, "set_model_version_tag", interrupt)
    elif cut == "before the alias":
        monkeypatch.setattr(client, "set_registered_model_alias", interrupt)
    else:
        real_alias = client.set_registered_model_alias

        def moved_then_interrupted(*a, **k):
            real_alias(*a, **k)
            raise KeyboardInterrupt

        monkeypatch.setattr(client, "set_registered_model_alias", moved_then_interrupted)
    with pytest.raises(KeyboardInterrupt):  # not wrapped: the stage reports "interrupted"
        register(client, run_id, uri, acc=0.95)
    monkeypatch.undo()
    versions, aliases = registry_state(client, name_of(run_id))
    check_registry_consistent(versions, aliases)
    if cut == "just after the alias moved":  # the decision was made: it stands
        assert aliases == {CHAMPION: 2} and set(versions) == {1, 2}
    else:  # undone: as if it never started
        assert (versions, aliases) == before

    again = register(client, run_id, uri, acc=0.95)  # the rerun
    assert (again["alias"], again["previous_champion"]) == (CHAMPION, 1)
    assert again["already_registered"] == (cut == "just after the alias moved")
    versions, aliases = registry_state(client, name_of(run_id))
    check_registry_consistent(versions, aliases)
    # MLflow never reuses a deleted version's number: an undone v2 makes the rerun's v3.
    assert set(versions) == {1, again["version"]} and aliases == {CHAMPION: again["version"]}


def test_a_registration_cut_off_by_sigkill_is_removed_by_the_next(store, caplog):
    import mlflow

    caplog.set_level(logging.INFO, logger="trainyard")
    client, run_id, uri = store
    # What a SIGKILL inside mlflow.register_model leaves: our tags, no decision, no alias.
    tags = {"run_id": run_id, SHA_TAG: "a" * 64, "test_accuracy": "0.900000"}
    name = name_of(run_id)
    mlflow.register_model(uri, name, tags=tags)
    by_hand = mlflow.register_model(uri, name)  # someone's, from the UI: not ours to delete
    result = register(client, run_id, uri)
    assert f"deleted {name} v1: its registration was cut off before the decision" in caplog.text
    versions, aliases = registry_state(client, name)
    assert set(versions) == {int(by_hand.version), result["version"]}
    assert aliases == {CHAMPION: result["version"]}


def test_the_same_model_again_is_not_registered_twice(store):
    client, run_id, uri = store
    first = register(client, run_id, uri)
    second = register(client, run_id, uri)  # `dvc repro -f evaluate`, nothing changed
    assert second == first | {"already_registered": True}
    other = register(client, run_id, uri, sha="b" * 64)  # a new export of the same run
    assert (other["version"], other["alias"]) == (2, CHALLENGER)


# ---------------------------------------------------------- real dvc repro (slow)


# A stage that holds the train run open in MLflow (as export and evaluate do) and waits.
STAGE = """
import sys, time
from trainyard.stages.runner import stage_main
from trainyard.track.continued_runs import logging_into

def body(params, args):
    with logging_into(args.run, "export"):
        print("logging", flush=True)
        time.sleep(60)

stage_main("export", body, lambda p: p.add_argument("--run"))
"""


@pytest.mark.parametrize(
    ("signum", "code", "reason"),
    [(signal.SIGTERM, 143, "SIGTERM in export"), (signal.SIGINT, 130, "Ctrl-C (SIGINT) in export")],
)
def test_sigterm_in_a_stage_is_unwound_like_ctrl_c(tmp_path, signum, code, reason):
    """kill, a scheduler or a container stop sends SIGTERM: the run ends KILLED with the
    reason, not RUNNING, and the stage exits 128 + the signal."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("t", artifact_location=(tmp_path / "art").as_uri())
    run_id = client.create_run(exp).info.run_id
    client.set_terminated(run_id, "FINISHED")
    proc = subprocess.Popen(
        [sys.executable, "-c", STAGE, "--run", run_id],
        env=stage_env(MLFLOW_TRACKING_URI=uri),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "logging", proc.stderr.read()
    assert client.get_run(run_id).info.status == "RUNNING"
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    run = client.get_run(run_id)
    assert run.info.status == "KILLED" and run.data.tags[END_REASON_TAG] == reason
    assert ("terminated (SIGTERM)" if signum == signal.SIGTERM else "interrupted") in err


@pytest.fixture(scope="module")
def repo(reproduced_pipeline, tmp_path_factory) -> Path:
    """The small pipeline, run once: v1 of the model is champion."""
    return copy_reproduced(reproduced_pipeline, tmp_path_factory.mktemp("interrupt") / "trainyard")


@dataclass
class Interrupted:
    rc: int
    log: str
    seconds: float  # from SIGINT until every process of the group had exited


def repro_interrupted(
    repo: Path, log: Path, step: str, at_pause: Callable[[], None] = lambda: None
) -> Interrupted:
    """`dvc repro` in its own process group, its stages set to pause at ``step``; once the
    stage has paused there, ``at_pause()`` and SIGINT to the whole group (as a terminal's
    Ctrl-C); wait until every process of the group is gone."""
    announce = log.with_suffix(".paused")
    proc = subprocess.Popen(
        ["dvc", "repro"],
        cwd=repo,
        # PYTHONUNBUFFERED: the stage's lines reach the log as printed
        env=pause_env(step, announce),
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_paused(announce, proc, log.read_text)
        at_pause()
        os.killpg(proc.pid, signal.SIGINT)
        t0 = time.monotonic()
        rc = proc.wait(timeout=60)
        wait_group_gone(proc.pid, t0 + 60, "the stage did not exit within 60 s of SIGINT")
    except BaseException:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        raise
    seconds = time.monotonic() - t0
    print(f"\nSIGINT at {step}: dvc repro exited {rc}, all gone {seconds:.1f}s later")
    return Interrupted(rc, log.read_text(), seconds)


def ran(output: str) -> set[str]:
    return {s for s in STAGES if f"Running stage '{s}'" in output}


def check_failed(hit: Interrupted, stage: str) -> None:
    assert hit.rc != 0, hit.log[-3000:]
    assert f"trainyard {stage}: interrupted" in hit.log, hit.log[-3000:]
    assert f"failed to reproduce '{stage}'" in hit.log and "exited with 130" in hit.log
    assert hit.seconds < 20, f"{hit.seconds:.1f}s from SIGINT to exit"


def whole_outputs(repo: Path, outs: tuple[str, ...]) -> set[str]:
    """Check that each of ``outs`` is absent or whole and valid; return those present."""
    import onnxruntime as ort
    from PIL import Image

    present = set()
    for rel in outs:
        path = repo / rel
        if not path.exists():
            continue
        present.add(rel)
        if path.suffix == ".json":
            json.loads(path.read_text())
        elif path.suffix == ".onnx":
            ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        elif path.suffix == ".sha256":
            digest, name = path.read_text().split()
            assert hashlib.sha256((path.parent / name).read_bytes()).hexdigest() == digest, rel
        elif path.suffix == ".csv":
            with path.open(newline="") as fh:
                assert len(list(csv.DictReader(fh))) == 10_000, rel
        elif path.suffix == ".png":
            Image.open(path).verify()
    return present


def check_no_temp_files(repo: Path) -> None:
    # io.atomic_* write to hidden ".<name>.<random><suffix>" files beside the target.
    left = [str(p) for d in ("models", "reports") for p in (repo / d).glob(".*")]
    assert left == [], f"temp files left: {left}"


def lock_stages(repo: Path) -> dict[str, Any]:
    return yaml.safe_load((repo / "dvc.lock").read_text())["stages"]


def out_of_date(repo: Path) -> set[str]:
    status = json.loads(dvc(repo, "status", "--json").stdout)
    return set(status) & set(STAGES)


def client_of(repo: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{repo}/mlflow.db")


def train_run(repo: Path):
    run_id = TrainRecord.read(repo / TRAIN_RECORD).run_id
    return client_of(repo).get_run(run_id)


def check_nothing_running(repo: Path) -> None:
    client = client_of(repo)
    exp = client.get_experiment_by_name("fashion-mnist")
    running = client.search_runs([exp.experiment_id], "attributes.status = 'RUNNING'")
    assert running == [], [r.info.run_id for r in running]


def check_finished_again(repo: Path, stage: str) -> None:
    run = train_run(repo)
    assert run.info.status == "FINISHED"
    assert END_REASON_TAG not in run.data.tags
    assert run.data.tags["trainyard.previous_end"] == f"Ctrl-C (SIGINT) in {stage}"
    check_nothing_running(repo)


def check_registry_json(repo: Path) -> Registration:
    """reports/registry.json says what the registry holds; no half-made version in it."""
    record = RegistryRecord.read(repo / REGISTRY_RECORD).registration
    versions, aliases = registry_state(client_of(repo), MODEL)
    check_registry_consistent(versions, aliases)
    assert aliases[record.alias] == record.version
    tags = versions[record.version]
    assert tags[SHA_TAG] == (repo / "models/model.onnx.sha256").read_text().split()[0]
    shas = [t[SHA_TAG] for t in versions.values()]
    assert len(shas) == len(set(shas)), "the same model registered twice"
    return record


def check_rerun_finishes(repo: Path, stages: set[str]) -> str:
    """The next `dvc repro` runs ``stages`` and leaves every output whole; its output (DVC's
    on stdout, the stages' log lines on stderr)."""
    proc = dvc(repo, "repro")
    out = proc.stdout + proc.stderr
    assert ran(proc.stdout) == stages, out
    assert whole_outputs(repo, EXPORT_OUTS + EVALUATE_OUTS) == set(EXPORT_OUTS + EVALUATE_OUTS)
    check_no_temp_files(repo)
    assert ran(dvc(repo, "repro").stdout) == set()  # and the next one runs nothing
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ctrl_c_in_export(repo, tmp_path):
    set_params(repo, export={"opset": 19})  # a new ONNX file: export and evaluate rerun
    lock = lock_stages(repo)

    # 1. While the ONNX file is written (atomic_file's temp beside models/model.onnx).
    log = tmp_path / "export-write.log"
    temps: list[Path] = []
    hit = repro_interrupted(
        repo,
        log,
        "export.onnx_written",
        lambda: temps.extend((repo / "models").glob(".model.onnx.*")),
    )
    check_failed(hit, "export")
    assert temps, "no ONNX temp file at the pause"
    assert whole_outputs(repo, EXPORT_OUTS) == set()  # DVC removed the old; none replaced them
    assert whole_outputs(repo, EVALUATE_OUTS) == set(EVALUATE_OUTS)  # not run: the old ones
    check_no_temp_files(repo)
    assert lock_stages(repo) == lock
    assert out_of_date(repo) == {"export", "evaluate"}  # fetch, prepare, train intact
    run = train_run(repo)
    assert run.info.status == "FINISHED" and END_REASON_TAG not in run.data.tags  # untouched

    # 2. While the model is logged to the (reopened) train run.
    log = tmp_path / "export-mlflow.log"
    hit = repro_interrupted(repo, log, "export.logging")
    assert "[export] logging the ONNX model" in hit.log
    check_failed(hit, "export")
    # The model passed parity and is whole, with its checksum; export.json comes last.
    assert whole_outputs(repo, EXPORT_OUTS) == {"models/model.onnx", "models/model.onnx.sha256"}
    check_no_temp_files(repo)
    assert lock_stages(repo) == lock
    assert out_of_date(repo) == {"export", "evaluate"}
    run = train_run(repo)
    assert run.info.status == "KILLED", run.info.status
    assert run.data.tags[END_REASON_TAG] == "Ctrl-C (SIGINT) in export"
    check_nothing_running(repo)

    # 3. The next dvc repro exports, evaluates and registers the new model.
    check_rerun_finishes(repo, {"export", "evaluate"})
    check_finished_again(repo, "export")
    assert check_registry_json(repo).version == 2


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ctrl_c_in_evaluate(repo, tmp_path):
    set_params(repo, evaluate={"device": "cpu"})  # evaluate alone reruns; the same model
    lock = lock_stages(repo)
    registry_before = registry_state(client_of(repo), MODEL)

    # 1. While ONNX Runtime runs the test set.
    log = tmp_path / "evaluate-inference.log"
    hit = repro_interrupted(repo, log, "evaluate.batch_scored")  # the first batch
    assert "[evaluate] ONNX Runtime on" in hit.log
    check_failed(hit, "evaluate")
    assert whole_outputs(repo, EVALUATE_OUTS) == set()
    assert whole_outputs(repo, EXPORT_OUTS) == set(EXPORT_OUTS)
    check_no_temp_files(repo)
    assert lock_stages(repo) == lock
    assert out_of_date(repo) == {"evaluate"}
    assert train_run(repo).info.status == "FINISHED"  # not reopened yet

    # 2. While its metrics and reports are logged to the (reopened) train run.
    log = tmp_path / "evaluate-mlflow.log"
    hit = repro_interrupted(repo, log, "evaluate.logging")
    assert "[evaluate] test accuracy" in hit.log
    check_failed(hit, "evaluate")
    assert "[evaluate] registering" not in hit.log  # it stopped inside the logging
    assert whole_outputs(repo, EVALUATE_OUTS) == set(EVALUATE_REPORTS)  # registry.json comes last
    check_no_temp_files(repo)
    assert lock_stages(repo) == lock
    assert out_of_date(repo) == {"evaluate"}
    run = train_run(repo)
    assert run.info.status == "KILLED", run.info.status
    assert run.data.tags[END_REASON_TAG] == "Ctrl-C (SIGINT) in evaluate"
    check_nothing_running(repo)
    assert registry_state(client_of(repo), MODEL) == registry_before

    # 3. The next dvc repro evaluates again; the model is registered already: no new version.
    out = check_rerun_finishes(repo, {"evaluate"})
    assert f"this model is already {MODEL} v2" in out
    check_finished_again(repo, "evaluate")
    check_registry_json(repo)
    assert registry_state(client_of(repo), MODEL)[1] == registry_before[1]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ctrl_c_in_the_registry_step(repo, tmp_path):
    set_params(repo, export={"opset": 20})  # a third model, to be registered as v3
    lock = lock_stages(repo)
    versions_before, aliases_before = registry_state(client_of(repo), MODEL)
    assert set(versions_before) == {1, 2}
    log = tmp_path / "registry.log"
    seen: dict[str, Any] = {}

    def half_registered() -> None:
        """At the pause: v3 made with its tags, the decision about to move its alias."""
        client = client_of(repo)
        seen["tags"] = client.get_model_version(MODEL, "3").tags
        seen["aliases"] = registry_state(client, MODEL)[1]

    # Inside the registration's last group of writes: SIGINT waits for them (the registry
    # defers it a few milliseconds), so the new version stands whole with its alias.
    hit = repro_interrupted(repo, log, "registry.moving_alias", half_registered)
    check_failed(hit, "evaluate")
    assert "[export] parity ok" in hit.log  # export ran whole in this repro
    assert "[evaluate] registering" in hit.log
    # interrupted between the version and its alias
    assert SHA_TAG in seen["tags"] and 3 not in seen["aliases"].values()

    # Never a version without its alias: v3 stands whole, its alias moved.
    versions, aliases = registry_state(client_of(repo), MODEL)
    check_registry_consistent(versions, aliases)
    assert set(versions) == {1, 2, 3} and aliases[versions[3]["decision"]] == 3
    assert whole_outputs(repo, EVALUATE_OUTS) == set(EVALUATE_REPORTS)  # no registry.json
    check_no_temp_files(repo)
    now = lock_stages(repo)
    assert now["evaluate"] == lock["evaluate"] and now["export"] != lock["export"]
    assert out_of_date(repo) == {"evaluate"}
    run = train_run(repo)  # the registry step writes no run status
    assert run.info.status == "FINISHED" and END_REASON_TAG not in run.data.tags
    check_nothing_running(repo)

    # The next dvc repro finds it registered (not a second version) and records it.
    out = check_rerun_finishes(repo, {"evaluate"})
    record = check_registry_json(repo)
    assert f"this model is already {MODEL} v3" in out
    assert record.version == 3
    versions, aliases = registry_state(client_of(repo), MODEL)
    assert set(versions) == {1, 2, 3}
    assert aliases[CHAMPION] == (
        record.version if record.alias == CHAMPION else aliases_before[CHAMPION]
    )
