"""A DVC sweep the DVC way: a grid queued with ``dvc exp run --queue -S 'k=a,b'``, run two at a
time by ``dvc queue start -j 2``. Each experiment runs in a temporary copy under
``.dvc/tmp/exps/`` that DVC deletes; the runs and registry versions must land in the
repository's own MLflow store (the one ``make ui`` shows), named and tagged so a row of
``dvc exp show`` and an MLflow run can be matched. Real DVC queue, real MLflow store."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from conftest import VENV_BIN, copy_repo, dvc, make_photo_folder, run_ok, set_params, stage_env

pytestmark = pytest.mark.slow

LRS = ("0.002", "0.004")


def start_queue(repo: Path, jobs: int, log: Path) -> None:
    """``dvc queue start -j N`` as a user types it: it returns at once. Its workers keep the
    stdio they inherit (dvc-task forks them), so with captured pipes ``communicate`` would
    wait for the whole sweep; they write to ``log`` instead."""
    with log.open("a") as out:
        proc = subprocess.run(
            ["dvc", "queue", "start", "-j", str(jobs)],
            cwd=repo,
            env=stage_env(),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=120,
        )
    assert proc.returncode == 0, log.read_text()


def queue_report(repo: Path, status: str, log: Path) -> str:
    """What a user would look at when a queue stalls: the status, each task's log and the
    workers' output."""
    parts = [status, f"--- {log.name}", log.read_text()]
    for line in status.splitlines():
        words = line.split()
        if words and words[-1] in ("Running", "Queued", "Failed"):
            logs = dvc(repo, "queue", "logs", words[0], check=False)
            parts += [f"--- dvc queue logs {words[0]}", logs.stdout[-3000:], logs.stderr[-1000:]]
    # A task that failed before its pipeline started has no log of its own: DVC's hint
    # sends the user to the celery workers' output.
    for out in sorted((repo / ".dvc" / "tmp" / "exps" / "celery").glob("*.out")):
        parts += [f"--- {out.name}", out.read_text(errors="replace")[-4000:]]
    return "\n".join(parts)


def failed_in_setup(repo: Path, status: str) -> list[str]:
    """Failed tasks that DVC says "likely failed during setup": they have no pipeline log, no
    stage ran (treeverse/dvc#10673, open: with ``-j`` > 1 a worker race fails some tasks
    that way). A task whose pipeline failed has a log and is not in this list."""
    failed = [line.split()[0] for line in status.splitlines() if line.endswith("Failed")]
    return [
        task
        for task in failed
        if "failed during setup" in dvc(repo, "queue", "logs", task, check=False).stderr
    ]


def wait_for_queue(repo: Path, jobs: int, log: Path, timeout: float = 900) -> str:
    """Poll ``dvc queue status`` until nothing is queued or running; its last output.

    A task left queued with no worker alive (DVC's own bug, treeverse/dvc#10562: a worker
    may stop with tasks left) gets what DVC's docs tell a user to do, one more
    ``dvc queue start``; the test still needs every task to succeed."""
    deadline = time.monotonic() + timeout
    restarted = False
    while True:
        status = dvc(repo, "queue", "status").stdout
        if not any(word in status for word in ("Queued", "Running")):
            return status
        if time.monotonic() > deadline:
            raise AssertionError(f"the queue did not finish:\n{queue_report(repo, status, log)}")
        stalled = "Running" not in status and "0 active, 0 idle" in status
        if stalled and not restarted:
            time.sleep(15)  # a worker between two tasks also shows this for a moment
            if "0 active, 0 idle" in dvc(repo, "queue", "status").stdout:
                start_queue(repo, jobs, log)
                restarted = True
        # Each `dvc queue status` is a DVC start (a second or two of CPU): polled often, it
        # took a good share of the 2 cores the two experiments train on.
        time.sleep(10)


@pytest.fixture(scope="module")
def swept(tmp_path_factory) -> dict:
    photos = tmp_path_factory.mktemp("photos") / "shapes"
    make_photo_folder(photos, per_class=16, litter=False)
    repo = copy_repo(tmp_path_factory.mktemp("sweep") / "trainyard")
    set_params(
        repo,
        data={"source": "folder", "folder": str(photos), "image_size": 32},
        train={"max_epochs": 1, "time_budget_min": None, "batch_size": 16},
        mlflow={"system_metrics": False},
    )
    env = {"GIT_AUTHOR_NAME": "t", "GIT_COMMITTER_NAME": "t"}
    subprocess.run(["git", "commit", "-qam", "sweep params"], cwd=repo, check=True, env=stage_env())
    dvc(repo, "exp", "run", "--queue", "-S", f"train.lr={','.join(LRS)}", **env)
    t0 = time.monotonic()
    log = repo.parent / "queue-start.log"
    start_queue(repo, 2, log)
    status = wait_for_queue(repo, 2, log)
    report = queue_report(repo, status, log)  # each failed task's log: a failure says why
    exps = shown_exps(repo)
    if failed_in_setup(repo, status) and len(exps) < len(LRS):
        # What a user does after DVC's set-up race: clear the failed tasks, queue the grid
        # points that have no experiment again, start the queue. Once; a pipeline that
        # failed (it has a log) is never retried.
        done = {str(data["params"]["params.yaml"]["data"]["train"]["lr"]) for data in exps.values()}
        missing = [lr for lr in LRS if str(float(lr)) not in done]
        dvc(repo, "queue", "remove", "--failed")
        dvc(repo, "exp", "run", "--queue", "-S", f"train.lr={','.join(missing)}", **env)
        start_queue(repo, 2, log)
        status = wait_for_queue(repo, 2, log)
        report = f"{report}\n--- after queueing {missing} again\n{queue_report(repo, status, log)}"
        exps = shown_exps(repo)
    return {
        "repo": repo,
        "status": status,
        "report": report,
        "exps": exps,
        "seconds": time.monotonic() - t0,
    }


def shown_exps(repo: Path) -> dict[str, dict]:
    """``dvc exp show --json``'s experiments: name -> its data (params, metrics)."""
    shown = json.loads(dvc(repo, "exp", "show", "--json").stdout)
    return {
        exp["name"]: rev["data"]
        for baseline in shown
        for exp in baseline.get("experiments") or []
        for rev in exp["revs"]
    }


def store(repo: Path) -> MlflowClient:
    return MlflowClient(tracking_uri=f"sqlite:///{repo / 'mlflow.db'}")


def test_both_queued_experiments_succeeded(swept):
    assert swept["status"].count("Success") == 2, swept["report"]
    assert len(swept["exps"]) == 2, swept["exps"].keys()
    lrs = {data["params"]["params.yaml"]["data"]["train"]["lr"] for data in swept["exps"].values()}
    assert lrs == {float(lr) for lr in LRS}


def test_the_runs_are_in_the_repositorys_store_named_and_tagged(swept):
    repo, names = swept["repo"], set(swept["exps"])
    client = store(repo)
    exp = client.get_experiment_by_name("shapes")  # mlflow.experiment: auto, the folder's name
    assert exp is not None, [e.name for e in client.search_experiments()]
    runs = client.search_runs([exp.experiment_id])
    assert {r.data.tags.get("dvc.exp_name") for r in runs} == names
    for r in runs:
        assert r.info.status == "FINISHED", r.info
        assert r.info.run_name == r.data.tags["dvc.exp_name"]
        assert r.data.tags["dvc.workspace"] == "temp"
        assert len(r.data.tags["dvc.baseline_rev"]) == 40
        # The params DVC set for this row, in the run of the same name.
        lr = swept["exps"][r.data.tags["dvc.exp_name"]]["params"]["params.yaml"]["data"]["train"]
        assert float(r.data.params["train.lr"]) == lr["lr"]
        assert "test/accuracy" in r.data.metrics  # evaluate logged into the same run
    # The artifacts live beside the repository's store, not in the deleted temporary copy.
    assert Path(exp.artifact_location.removeprefix("file://")) == repo / "mlruns"
    for r in runs:
        root = Path(r.info.artifact_uri.removeprefix("file://"))
        assert (root / "data" / "card.json").is_file(), root
    assert not list((repo / ".dvc" / "tmp").rglob("mlflow.db"))


def test_a_sweep_registers_challengers_and_never_moves_champion(swept):
    client = store(swept["repo"])
    versions = client.search_model_versions("name = 'shapes-classifier'")
    assert {v.tags.get("dvc.exp_name") for v in versions} == set(swept["exps"])
    assert {v.tags["decision"] for v in versions} == {"challenger"}
    assert all("never moves champion" in v.tags["decision_reason"] for v in versions)
    model = client.get_registered_model("shapes-classifier")
    assert "champion" not in model.aliases, model.aliases


def test_trainyard_exps_shows_the_sweep_in_a_readable_table(swept):
    repo = swept["repo"]
    out = run_ok([str(VENV_BIN / "trainyard"), "exps", "--sort-by", "test.accuracy"], repo).stdout
    lines = out.splitlines()
    header = lines[0].split()
    # The metric people compare and the one param that differs; no dependency hashes.
    assert {"test.accuracy", "train.lr"} <= set(header), header
    assert not any(h.startswith(("src/", "data/")) for h in header), header
    assert len(header) < 12, header
    assert max(len(line) for line in lines) < 160, out
    for name in swept["exps"]:
        assert any(line.split()[0] == name for line in lines[2:]), out
