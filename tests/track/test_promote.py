"""Promote and roll back `champion` by hand (`trainyard promote` / `rollback`), and a service
that follows the alias: a real `mlflow server`, versions registered as evaluate registers
them, a real prediction log with shadow rows, a real `bentoml serve` under load.
"""

from __future__ import annotations

import getpass
import os
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
from test_serving import Server, classify, png, server_env, write_params

from trainyard import cli
from trainyard.core.io import sha256_file
from trainyard.core.model_ref import parse_model_ref
from trainyard.watch.log import PredictionLog, read_log, utc_now

from conftest import REPO, fashion_card, sqlite_mlflow_server, write_tiny_onnx


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[str]:
    """A real `mlflow server`; MLFLOW_TRACKING_URI points at it for the module."""
    import mlflow

    # 180 s: its start took 72-90+ s on 2 cores shared with another suite.
    with sqlite_mlflow_server(tmp_path_factory.mktemp("mlflow-promote"), start_s=180) as uri:
        saved, previous = os.environ.get("MLFLOW_TRACKING_URI"), mlflow.get_tracking_uri()
        os.environ["MLFLOW_TRACKING_URI"] = uri
        mlflow.set_tracking_uri(uri)
        try:
            yield uri
        finally:
            mlflow.set_tracking_uri(previous)
            if saved is None:
                os.environ.pop("MLFLOW_TRACKING_URI", None)
            else:
                os.environ["MLFLOW_TRACKING_URI"] = saved


LOGGED: dict[int, tuple[str, str, str]] = {}  # seed -> (model URI, run id, sha256): logged once


def register(
    server: str, tmp: Path, name: str, accuracies: list[float], distinct: bool = False
) -> list[str]:
    """Versions 1.. of ``name`` registered as evaluate registers them (the first champion,
    the worse ones challengers); their sha256s. ``distinct``: each version its own tiny
    ONNX model, else all the same one (logged once for the module: the commands never open
    the file)."""
    import mlflow

    from trainyard.track.registry import log_onnx_model, register_and_promote

    client = mlflow.MlflowClient(server)
    experiment = mlflow.set_experiment("promote").experiment_id
    shas = []
    for i, acc in enumerate(accuracies):
        seed = i if distinct else 0
        if seed not in LOGGED:
            path, _ = write_tiny_onnx(tmp / f"model-{seed}", fashion_card(), seed=seed)
            with mlflow.start_run(experiment_id=experiment) as run:
                uri = log_onnx_model(path, np.zeros((1, 1, 28, 28), np.float32))
            LOGGED[seed] = (uri, run.info.run_id, sha256_file(path))
        uri, run_id, sha = LOGGED[seed]
        register_and_promote(client, name, uri, run_id, acc, f"data-{i}", sha, 0.0)
        shas.append(sha)
    return shas


def shadow_log(folder: Path, name: str, answering: int, shadow: int, rows: int) -> list[dict]:
    """A prediction log where v``shadow`` ran beside v``answering`` on ``rows`` requests,
    agreeing on 9 in 10, and 20 rows without a shadow; the shadow's rows."""
    log = PredictionLog(folder).start()
    written = []
    for i in range(rows):
        row = {
            "time": utc_now(),
            "registry_version": f"{name}/{answering}",
            "label": "Coat",
            "latency_ms": 2.0 + i % 7,
            "shadow_registry_version": f"{name}/{shadow}",
            "shadow_label": "Coat" if i % 10 else "Shirt",
            "shadow_latency_ms": 3.0 + i % 11,
        }
        log.offer(row)
        written.append(row)
    for _ in range(20):  # requests the shadow did not score: not its evidence
        log.offer({"time": utc_now(), "registry_version": f"{name}/{answering}", "label": "Bag"})
    log.close()
    return written


def trainyard(capsys, *args: str) -> tuple[int, str, str]:
    """The `trainyard` command, as its console script runs it: (exit code, stdout, stderr)."""
    code = cli.main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def champion_of(server: str, name: str) -> Any:
    import mlflow

    return mlflow.MlflowClient(server).get_model_version_by_alias(name, "champion")


@pytest.fixture
def params(tmp_path) -> Path:
    path = tmp_path / "params.yaml"
    path.write_text((REPO / "params.yaml").read_text())
    return path


# ---------------------------------------------------------------------------- promote


def test_promote_refuses_without_enough_shadow_rows_and_says_how_to_get_them(
    server, tmp_path, params, capsys
):
    register(server, tmp_path, "refused", [0.9, 0.8])
    shadow_log(tmp_path / "log", "refused", answering=1, shadow=2, rows=50)
    args = ("promote", "refused", "--from", "challenger", "--params", params)
    code, _, err = trainyard(capsys, *args, "--log", tmp_path / "log")
    assert code == 2
    assert "refused v2 ran as the shadow on 50 logged request(s)" in err and "200 needed" in err
    assert "serve.shadow: challenger" in err and "serve.log_predictions: true" in err
    # No --log: serve.log_dir beside the params file, where no log is yet.
    code, _, err = trainyard(capsys, *args)
    assert code == 2 and f"on 0 logged request(s) in {tmp_path / 'logs/predictions'}" in err
    assert champion_of(server, "refused").version == "1"


def test_promote_records_the_shadows_figures_on_the_version(server, tmp_path, params, capsys):
    register(server, tmp_path, "promoted", [0.9, 0.8])
    rows = shadow_log(tmp_path / "log", "promoted", answering=1, shadow=2, rows=300)
    before = datetime.now(UTC).replace(microsecond=0)
    code, out, err = trainyard(
        capsys,
        *("promote", "promoted", "--from", "challenger", "--reason", "better on coats"),
        *("--log", tmp_path / "log", "--params", params),
    )
    assert code == 0, err
    assert "promoted: champion is now v2 (was v1)" in out and "agreed on 90.0% of 300" in out
    assert "models:/promoted@champion picks it up within serve.reload_s (10 s)" in out
    # Each version registered on its own data version (register's data-0, data-1).
    assert "v2: test accuracy 0.8000 against v1's 0.9000 (different data versions" in out
    v2 = champion_of(server, "promoted")
    assert v2.version == "2"
    tags = v2.tags
    assert tags["promote.action"] == "promote" and tags["promote.reason"] == "better on coats"
    assert tags["promote.previous_champion"] == "1" and tags["promote.forced"] == "false"
    assert tags["promote.user"] == getpass.getuser() and tags["promote.from"] == "challenger"
    assert before <= datetime.fromisoformat(tags["promote.time"]) <= datetime.now(UTC)
    assert (tags["shadow.rows"], tags["shadow.agreement"]) == ("300", "0.9000")
    assert tags["shadow.against"] == "promoted/1"
    for key, column in (("shadow", "shadow_latency_ms"), ("answer", "latency_ms")):
        values = [r[column] for r in rows]
        assert float(tags[f"shadow.{key}_p50_ms"]) == pytest.approx(np.median(values), abs=0.01)
        p99 = np.percentile(values, 99)
        assert float(tags[f"shadow.{key}_p99_ms"]) == pytest.approx(p99, abs=0.01)


def test_a_move_compares_the_test_accuracies_only_on_the_same_data():
    from types import SimpleNamespace

    from trainyard.track.promotion import compared_accuracy

    def version(n: int, acc: str | None, data: str = "d1") -> SimpleNamespace:
        tags = {"data_version": data} | ({"test_accuracy": acc} if acc else {})
        return SimpleNamespace(version=str(n), tags=tags)

    v1, worse, better = version(1, "0.922700"), version(2, "0.899900"), version(3, "0.930000")
    assert compared_accuracy(worse, v1) == (
        "test accuracy 0.8999 against v1's 0.9227: 2.28 points LOWER"
    )
    assert compared_accuracy(better, v1).endswith(": 0.73 points higher")
    assert compared_accuracy(version(4, "0.922700"), v1).endswith(": the same")
    other_data = version(5, "0.990000", data="d2")
    assert compared_accuracy(other_data, v1).endswith(
        "(different data versions: not the same test split)"
    )
    assert compared_accuracy(worse, None) == "test accuracy 0.8999"
    assert compared_accuracy(worse, version(6, None)) == "test accuracy 0.8999"
    assert compared_accuracy(version(7, None), v1) == ""


def test_force_promotes_without_figures_and_says_it_was_forced(server, tmp_path, params, capsys):
    register(server, tmp_path, "forced", [0.9, 0.8, 0.7])
    code, out, err = trainyard(
        capsys, "promote", "forced", "--version", 3, "--force", "--params", params,
        "--log", tmp_path / "empty",
    )  # fmt: skip
    assert code == 0, err
    assert "forced, no shadow figures" in out
    tags = champion_of(server, "forced").tags
    assert tags["promote.forced"] == "true" and tags["promote.previous_champion"] == "1"
    assert not [k for k in tags if k.startswith("shadow.")]


# ---------------------------------------------------------------------------- rollback


def test_rollback_puts_the_previous_champion_back_and_a_second_undoes_it(
    server, tmp_path, params, capsys
):
    register(server, tmp_path, "rolled", [0.9, 0.8, 0.7])
    forced = ("--force", "--log", tmp_path / "none")
    assert trainyard(capsys, "promote", "rolled", "--version", 3, *forced)[0] == 0
    code, out, err = trainyard(
        capsys, "rollback", "rolled", "--reason", "p99 doubled", "--params", params
    )
    assert code == 0, err
    assert "rolled: champion is now v1 (was v3); rolled back" in out
    assert "models:/rolled@champion picks it up within serve.reload_s" in out
    v1 = champion_of(server, "rolled")
    assert v1.version == "1"
    assert (v1.tags["promote.action"], v1.tags["promote.reason"]) == ("rollback", "p99 doubled")
    assert v1.tags["promote.previous_champion"] == "3"
    assert v1.tags["promote.user"] == getpass.getuser()
    assert trainyard(capsys, "rollback", "rolled")[0] == 0  # the rollback undone
    assert champion_of(server, "rolled").version == "3"


def test_rollback_after_evaluates_decision_returns_to_the_champion_it_replaced(
    server, tmp_path, capsys
):
    register(server, tmp_path, "evaluated", [0.7, 0.9])  # v2 beat v1 at evaluate
    assert trainyard(capsys, "rollback", "evaluated")[0] == 0
    assert champion_of(server, "evaluated").version == "1"


def test_rollback_with_no_history_is_a_clear_error(server, tmp_path, capsys):
    register(server, tmp_path, "fresh", [0.9])
    code, _, err = trainyard(capsys, "rollback", "fresh")
    assert code == 2
    assert "nothing to roll back to: fresh v1 is champion with no previous champion" in err
    assert "trainyard promote fresh --version N" in err
    assert champion_of(server, "fresh").version == "1"


def test_an_unknown_model_version_or_alias_is_named(server, tmp_path, capsys):
    register(server, tmp_path, "named", [0.9, 0.8])
    forced = ("--force", "--log", tmp_path / "none")
    code, _, err = trainyard(capsys, "promote", "no-such-model", "--version", 1, *forced)
    assert code == 2 and "no registered model 'no-such-model'" in err and "named" in err
    code, _, err = trainyard(capsys, "promote", "named", "--version", 9, *forced)
    assert code == 2 and "named has no version 9; its versions: 1, 2" in err
    code, _, err = trainyard(capsys, "promote", "named", "--from", "nope", *forced)
    assert code == 2 and "named has no alias 'nope'" in err and "champion -> v1" in err
    code, _, err = trainyard(capsys, "promote", "named", "--version", 1, *forced)
    assert code == 2 and "named v1 is already champion" in err
    code, _, err = trainyard(capsys, "rollback", "no-such-model")
    assert code == 2 and "no registered model 'no-such-model'" in err


# ---------------------------------------------------------------------------- following


def test_follow_alias_fetches_a_moved_version_once_also_from_workers_at_once(
    server, tmp_path, capsys
):
    from trainyard.track.model_refs import MlflowRegistry

    shas = register(server, tmp_path, "followed", [0.9, 0.8], distinct=True)
    uri, cache = "models:/followed@champion", tmp_path / "cache"
    ref, registry = parse_model_ref(uri, "serve.model"), MlflowRegistry()
    assert registry.follow(ref, "1", cache) is None  # not moved: nothing fetched
    assert not cache.exists()
    forced = ("--force", "--log", tmp_path / "none", "--reason", "r")
    assert trainyard(capsys, "promote", "followed", "--version", 2, *forced)[0] == 0
    results: list[Any] = []

    def worker() -> None:
        try:
            results.append(registry.follow(ref, "1", cache))
        except Exception as err:  # reported by the assertion below
            results.append(err)

    threads = [threading.Thread(target=worker) for _ in range(4)]  # four workers see it at once
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for path, provenance in results:
        assert sha256_file(path) == shas[1]
        assert (provenance["registry_version"], provenance["registry_alias"]) == ("2", "champion")
        assert provenance["model_source"] == uri and provenance["reason"] == "r"
    assert sorted(p.name for p in (cache / "followed" / "2").iterdir()) == [
        "model.onnx",
        "model.onnx.sha256",
    ]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_served_champion_is_swapped_under_load_without_a_failed_request(server, tmp_path, capsys):
    """Two workers serving models:/NAME@champion, four clients posting without pause; the
    champion moves: every answer is a 200, and the answers move to the new model within
    serve.reload_s and a few seconds, and stay there."""
    shas = register(server, tmp_path, "served", [0.9, 0.8], distinct=True)
    old, new = shas[0][:12], shas[1][:12]
    # The prediction log on: a swap carries it over, and no row is lost on either side.
    params = write_params(
        tmp_path / "params.yaml",
        workers=2,
        reload_s=1,
        access_log=False,
        log_predictions=True,
        log_dir=str(tmp_path / "log"),
        log_rotate_s=0.5,
    )
    env = server_env(params, "models:/served@champion", TRAINYARD_MODEL_CACHE=str(tmp_path / "c"))
    srv = Server(env, tmp_path / "serve.log")
    answers: list[tuple[float, int, str, str]] = []  # (sent, status, body's version, header)
    stop = threading.Event()
    image = png(np.random.default_rng(0).integers(0, 255, (28, 28), dtype=np.uint8))

    def client() -> None:
        while not stop.is_set():
            sent = time.monotonic()
            try:
                r = classify(srv.url, image)
                body = r.json().get("model_version", "") if r.status_code == 200 else r.text
                answers.append((sent, r.status_code, body, r.headers.get("x-model-version", "")))
            except requests.RequestException as err:
                answers.append((sent, 0, repr(err), ""))

    try:
        srv.wait_ready(120)
        assert "following models:/served@champion: a look every 1 s" in srv.tail(100_000)
        clients = [threading.Thread(target=client) for _ in range(4)]
        for t in clients:
            t.start()
        time.sleep(3)
        forced = ("--force", "--log", tmp_path / "none", "--reason", "swap test")
        t0 = time.monotonic()
        assert trainyard(capsys, "promote", "served", "--version", 2, *forced)[0] == 0
        promoted = time.monotonic()  # the alias moved just before the command returned
        deadline = promoted + 20
        while time.monotonic() < deadline and not (
            [a for a in answers if a[0] > promoted and a[2] == new]
            and server_version(srv.url) == (new, new)
        ):
            time.sleep(0.2)
        time.sleep(3)  # load goes on after the switch: no answer may come from the old model
        stop.set()
        for t in clients:
            t.join(60)
        meta = requests.get(f"{srv.url}/metadata", timeout=10).json()
    finally:
        stop.set()
        srv.stop()
    failed = [a for a in answers if a[1] != 200]
    assert not failed, failed[:5]
    assert {a[2] for a in answers} == {old, new}
    last_old = max(a[0] for a in answers if a[2] == old)
    after = [a for a in answers if a[0] > last_old]
    # Each worker swaps at its own (jittered) look; then the old model never answers again.
    switch_s = last_old - promoted
    assert switch_s < 1.2 + 5, switch_s
    assert len(after) > 20 and {(a[2], a[3]) for a in after} == {(new, new)}
    assert (meta["model"]["version"], meta["source"]["registry_version"]) == (new, "2")
    log = srv.tail(200_000)
    assert log.count("models:/served@champion moved: v1 -> v2") == 2, log[-3000:]
    assert "Downloading artifacts" not in log  # MLflow's progress bars: not in a server's log
    assert log.count("reason: swap test") == 2
    # One log row per answer, from the workers' both models; the last written at shutdown.
    rows = read_log(tmp_path / "log").to_pylist()
    assert len(rows) == len(answers)
    assert {r["registry_version"] for r in rows} == {"served/1", "served/2"}
    assert {r["model_version"] for r in rows} == {old, new}
    mismatched = sum(1 for a in answers if a[2] != a[3])
    print(f"{len(answers)} requests, 0 failed; promote took {promoted - t0:.1f} s; the old "
          f"model's last answer was sent {switch_s:.2f} s after it returned; {mismatched} "
          "answers with the other model's header")  # fmt: skip


def server_version(url: str) -> tuple[str, str]:
    """(/metadata's model version, a response's X-Model-Version) as one worker says them."""
    r = requests.get(f"{url}/metadata", timeout=10)
    return r.json()["model"]["version"], r.headers.get("x-model-version", "")
