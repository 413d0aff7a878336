"""The champion decision is atomic: teammates' evaluate stages deciding at once take turns.

Fast: the turn itself on a real sqlite MLflow store (a lower version still pending is waited
for, one killed before its decision tag is finished, one abandoned is given up on).
Slow: a real `mlflow server`, four processes (three teammates and a sweep) registering
versions of one model at the same moment; replayed one by one in version order, the
recorded decisions must be exactly the ones the sequential rule gives.

The worker is this file run as a script: ``python tests/track/test_registry_race.py '<json>'``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from trainyard.core.pause_points import PAUSE_AT, PAUSE_FILE
from trainyard.track.registry import (
    ACCURACY_TAG,
    CHALLENGER,
    CHAMPION,
    DECISION_TAG,
    PENDING,
    SHA_TAG,
    decide,
    register_and_promote,
)

from conftest import REPO, sqlite_mlflow_server, stage_env

TEAMMATES, ROUNDS, SWEEPS = 3, 3, 2  # versions each teammate registers; the sweep's
MARGIN = 0.006


# ------------------------------------------------ the turn, on a sqlite store (fast)


def logged_model(mlflow_db: tuple[str, str]) -> tuple[str, str]:
    """(run id, model URI): a run with a model logged in it (no file behind it)."""
    import mlflow

    uri, exp = mlflow_db
    mlflow.set_tracking_uri(uri)
    with mlflow.start_run(experiment_id=exp) as run:
        model = mlflow.create_external_model(name="model")
    return run.info.run_id, model.model_uri


def left_pending(name: str, run_id: str, model_uri: str, acc: float) -> Any:
    """What a teammate's registration is while it waits for its turn, or after a SIGKILL
    there: a version with its tags and decision pending."""
    import mlflow

    tags = {"run_id": run_id, SHA_TAG: "c" * 64, ACCURACY_TAG: f"{acc:.6f}"}
    return mlflow.register_model(model_uri, name, tags=tags | {DECISION_TAG: PENDING})


def behind_a_teammate(mlflow_db: tuple[str, str], acc: float) -> tuple[Any, str, str, str, Any]:
    """(client, name, run id, model URI, the teammate's version): a run with a model whose
    registration under ``name`` finds a teammate's version, test accuracy ``acc``, pending
    before it."""
    import mlflow

    client = mlflow.MlflowClient(mlflow_db[0])
    other_run, other_uri = logged_model(mlflow_db)
    run_id, uri = logged_model(mlflow_db)
    name = f"m-{run_id}"
    return client, name, run_id, uri, left_pending(name, other_run, other_uri, acc)


def test_a_lower_pending_version_is_waited_for_and_decided_against(mlflow_db):
    client, name, run_id, uri, teammate = behind_a_teammate(mlflow_db, 0.9)

    def teammate_decides() -> None:  # a second later, as its own register_and_promote does
        time.sleep(1.0)
        client.set_registered_model_alias(name, CHAMPION, teammate.version)
        client.set_model_version_tag(name, teammate.version, DECISION_TAG, CHAMPION)

    thread = threading.Thread(target=teammate_decides)
    start = time.monotonic()
    thread.start()
    try:
        result = register_and_promote(client, name, uri, run_id, 0.905, "d.dir", "a" * 64, 0.01)
    finally:
        thread.join()
    assert time.monotonic() - start >= 1.0  # it waited for its turn
    # ... and then decided against the champion the teammate left, not against none
    assert (result["version"], result["alias"], result["previous_champion"]) == (
        2,
        CHALLENGER,
        1,
    )
    assert "does not beat champion v1 (0.9000)" in result["reason"]
    aliases = client.get_registered_model(name).aliases
    assert {a: str(v) for a, v in aliases.items()} == {CHAMPION: "1", CHALLENGER: "2"}


def test_a_version_killed_between_its_alias_and_decision_tag_is_finished(mlflow_db):
    client, name, run_id, uri, killed = behind_a_teammate(mlflow_db, 0.9)
    client.set_registered_model_alias(name, CHAMPION, killed.version)  # then SIGKILL
    start = time.monotonic()
    result = register_and_promote(client, name, uri, run_id, 0.95, "d.dir", "a" * 64, 0.01)
    assert time.monotonic() - start < 10  # no waiting out the stale bound
    assert client.get_model_version(name, killed.version).tags[DECISION_TAG] == CHAMPION
    assert (result["alias"], result["previous_champion"]) == (CHAMPION, 1)


def test_ctrl_c_while_waiting_for_the_turn_leaves_nothing(mlflow_db, monkeypatch, tmp_path):
    # a teammate that takes its time
    client, name, run_id, uri, _ = behind_a_teammate(mlflow_db, 0.9)
    # The registration pauses in its wait (registered, its turn not come): the Ctrl-C lands
    # there however fast or slow this machine is.
    announce = tmp_path / "waiting.paused"
    monkeypatch.setenv(PAUSE_AT, "registry.waiting")
    monkeypatch.setenv(PAUSE_FILE, str(announce))

    def ctrl_c_once_waiting() -> None:  # a real SIGINT, as a terminal's Ctrl-C sends
        deadline = time.monotonic() + 120
        while not announce.exists():
            if time.monotonic() > deadline:
                return  # no SIGINT: the pytest.raises below fails, saying so
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGINT)

    thread = threading.Thread(target=ctrl_c_once_waiting)
    thread.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            register_and_promote(client, name, uri, run_id, 0.95, "d.dir", "a" * 64, 0.01)
    finally:
        thread.join()
    assert client.search_model_versions(f"tags.run_id = '{run_id}'") == []  # undone
    assert [str(v.version) for v in client.search_model_versions(f"name = '{name}'")] == ["1"]
    assert client.get_registered_model(name).aliases == {}


def test_a_version_pending_too_long_is_abandoned_and_said(mlflow_db, caplog):
    caplog.set_level(logging.INFO, logger="trainyard")
    # the teammate was SIGKILLed while waiting: it never decides
    client, name, run_id, uri, _ = behind_a_teammate(mlflow_db, 0.99)
    start = time.monotonic()
    result = register_and_promote(
        client, name, uri, run_id, 0.9, "d.dir", "a" * 64, 0.01, stale_after_s=1.5
    )
    assert 1.0 <= time.monotonic() - start < 10
    assert f"{name} v1 has been pending for over 1.5 s: taken for an abandoned" in caplog.text
    assert result["alias"] == CHAMPION and result["previous_champion"] is None
    assert result["reason"] == (
        "first version with a test accuracy: becomes champion "
        "(not waited for: v1, pending over 1.5 s, abandoned)"
    )
    # The abandoned version is its own run's to remove (its rerun does); it stays pending.
    assert client.get_model_version(name, "1").tags[DECISION_TAG] == PENDING


# ------------------------------------------- teammates at once on a real server (slow)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[str]:
    with sqlite_mlflow_server(tmp_path_factory.mktemp("mlflow-race-server")) as uri:
        yield uri


def start_workers(server: str, name: str, exp: str, tmp: Path) -> list[subprocess.Popen]:
    """Three teammates (ROUNDS versions each, accuracies drawn at random) and a sweep with
    better accuracies than any (it must still not move champion), each ready to register."""
    accs = random.Random(27).sample([round(0.8 + 0.004 * k, 3) for k in range(25)], 9)
    jobs = [{"accs": accs[i * ROUNDS : (i + 1) * ROUNDS], "sweep": None} for i in range(TEAMMATES)]
    jobs.append({"accs": [0.99] * SWEEPS, "sweep": "exp-sweep"})
    procs = []
    for i, job in enumerate(jobs):
        arg = json.dumps(job | {"uri": server, "name": name, "exp": exp})
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, arg],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=open(tmp / f"worker{i}.log", "w"),  # noqa: SIM115 - the child's
                text=True,
                # The repository root on the path, as pytest's `pythonpath` has it: the
                # worker imports conftest, which imports team/.
                env=stage_env(PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")])),
            )
        )
    return procs


def replay(versions: list[Any]) -> Any:
    """Check every recorded decision against the sequential rule, in version order, each
    against the champion the one before left; return the champion that rule ends with."""
    champion = None
    for v in versions:
        decision = v.tags.get(DECISION_TAG)
        assert decision in (CHAMPION, CHALLENGER), (v.version, v.tags)
        if v.tags.get("dvc.exp_name"):  # a sweep: challenger, whatever it scored
            assert decision == CHALLENGER, (v.version, v.tags)
            continue
        alias, reason = decide(float(v.tags[ACCURACY_TAG]), champion, MARGIN)
        recorded = (decision, v.tags["previous_champion"], v.tags["decision_reason"])
        previous = champion.version if champion is not None else ""
        assert recorded == (alias, str(previous), reason), f"v{v.version}"
        if alias == CHAMPION:
            champion = v
    return champion


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_teammates_deciding_at_once_take_turns(server, tmp_path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(server)
    name = f"race-{uuid.uuid4().hex[:8]}"
    exp = client.create_experiment(name)
    procs = start_workers(server, name, exp, tmp_path)
    try:
        for p in procs:  # each has imported everything and logged its models
            assert p.stdout.readline().strip() == "ready", (tmp_path / "worker0.log").read_text()
        for p in procs:  # ... and now all at once
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = "\n".join(f.read_text() for f in sorted(tmp_path.glob("worker*.log")))
    assert all(p.returncode == 0 for p in procs), logs
    results = [json.loads(line) for out in outs for line in out.splitlines()]
    assert len(results) == TEAMMATES * ROUNDS + SWEEPS
    # They did call at once: every first registration started before any of them ended.
    firsts = [json.loads(out.splitlines()[0]) for out in outs]
    assert max(r["t0"] for r in firsts) < min(r["t1"] for r in firsts)

    versions = sorted(
        client.search_model_versions(f"name = '{name}'"), key=lambda v: int(v.version)
    )
    assert len(versions) == len(results)  # every registration landed, none twice
    champion = replay(versions)
    aliases = client.get_registered_model(name).aliases
    assert str(aliases[CHAMPION]) == champion.version  # one champion: the rule's
    by_version = {v.version: v for v in versions}
    for r in results:  # what each stage wrote to reports/registry.json is what stands
        tags = by_version[str(r["version"])].tags
        assert (r["alias"], r["reason"]) == (tags[DECISION_TAG], tags["decision_reason"])
        assert str(r["previous_champion"] or "") == tags["previous_champion"]


def worker(job: dict[str, Any]) -> None:
    """One teammate's evaluate stages: logs its models, says ready, waits for "go" on stdin,
    then registers them one after the other and prints each result as a JSON line."""
    import mlflow

    from trainyard.track import registry  # looked up at call time: a scratch check swaps it

    mlflow.set_tracking_uri(job["uri"])
    models = []
    for _ in job["accs"]:
        with mlflow.start_run(experiment_id=job["exp"]) as run:
            models.append((run.info.run_id, mlflow.create_external_model(name="model").model_uri))
    client = mlflow.MlflowClient(job["uri"])
    print("ready", flush=True)
    sys.stdin.readline()
    for (run_id, model_uri), acc in zip(models, job["accs"], strict=True):
        sha = hashlib.sha256(run_id.encode()).hexdigest()
        t0 = time.time()
        result = registry.register_and_promote(
            client, job["name"], model_uri, run_id, acc, "d.dir", sha, MARGIN, sweep=job["sweep"]
        )
        print(json.dumps(result | {"t0": t0, "t1": time.time()}), flush=True)


if __name__ == "__main__":
    worker(json.loads(sys.argv[1]))
