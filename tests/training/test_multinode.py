"""Training across nodes (train.num_nodes): the launcher's processes checked against the params
(fast), and two real train stage processes on one machine as two nodes over gloo, each in its
own working folder with its own copy of the prepared data, as `dvc pull` leaves it (slow)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from trainyard.core.config import DataParams, parse_params
from trainyard.core.errors import ParamsError
from trainyard.core.handoffs import TrainRecord
from trainyard.data.sources import prepare_source
from trainyard.data.sources.fashion_fetch import fetch_raw
from trainyard.training.nodes import Launch, check_launch, join_nodes, launch_from_env

from conftest import REPO, free_port, stage_env

# What a launcher sets: none may leak from the test's own environment into a "node".
LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "GROUP_RANK", "RANK", "LOCAL_RANK")
LAUNCH_VARS += ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS")

# ---------------------------------------------------------------- the launch check (fast)


def test_plain_environment_says_the_processes_not_the_nodes():
    assert launch_from_env({"WORLD_SIZE": "4", "NODE_RANK": "1"}) == Launch("WORLD_SIZE", 4, None)
    assert (
        launch_from_env({"NODE_RANK": "1"}) is None
    )  # no WORLD_SIZE: not launched as one of several


def test_processes_must_be_num_nodes_times_devices():
    check_launch(2, 1, Launch("WORLD_SIZE", 2, None), local_rank_set=False)
    check_launch(2, 4, Launch("torchrun", 8, 2), local_rank_set=True)
    check_launch(1, 1, None, local_rank_set=False)  # one process, no launcher
    with pytest.raises(
        ParamsError,
        match=r"train\.num_nodes 2 x train\.devices 1 is 2 processes, but WORLD_SIZE started 3",
    ):
        check_launch(2, 1, Launch("WORLD_SIZE", 3, None), local_rank_set=False)
    # torchrun --nnodes 2 with params for one node: each node would train alone.
    with pytest.raises(ParamsError, match=r"train\.num_nodes is 1, but torchrun runs on 2 nodes"):
        check_launch(1, 1, Launch("torchrun", 2, 2), local_rank_set=True)
    with pytest.raises(ParamsError, match=r"train\.num_nodes is 2, but srun runs on 3 nodes"):
        check_launch(2, 1, Launch("srun", 3, 3), local_rank_set=True)


def test_several_nodes_without_a_launcher_name_the_key(monkeypatch):
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    tp = parse_params({"train": {"num_nodes": 2, "accelerator": "cpu", "devices": 1}}).train
    with pytest.raises(
        ParamsError, match=r"train\.num_nodes is 2, but this process was not started"
    ):
        join_nodes(tp.num_nodes, tp.devices, "cpu")
    # One node, no launcher: the plain single process (or one machine's DDP), no probing.
    assert join_nodes(1, tp.devices, "cpu").world_size == 1


def test_plain_launch_of_several_devices_a_node_needs_each_process_started():
    # Lightning would start a node's other processes only at the fit: too late to agree.
    with pytest.raises(ParamsError, match=r"torchrun --nproc-per-node 2"):
        check_launch(2, 2, Launch("WORLD_SIZE", 4, None), local_rank_set=False)


# ---------------------------------------------------------------- two nodes (slow)


@pytest.fixture(scope="module")
def prepared(fashion_dir, tmp_path_factory) -> Path:
    """800 Fashion-MNIST images (600 train, 200 val): two epochs in seconds."""
    root = tmp_path_factory.mktemp("multinode-data")
    fetch_raw(DataParams(debian_dir=str(fashion_dir)), root / "raw")
    prepare_source(root / "raw", root / "prepared", DataParams(limit=800, val_size=200), seed=0)
    return root / "prepared"


def make_node(tmp_path: Path, rank: int, prepared: Path, **train: object) -> Path:
    """A node's working folder: its own data/prepared and params.yaml (2 nodes, CPU)."""
    node = tmp_path / f"node{rank}"
    shutil.copytree(prepared, node / "data" / "prepared")
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["train"].update(
        num_nodes=2, accelerator="cpu", devices=1, precision="32-true", max_epochs=2
    )
    params["train"].update(time_budget_min=None, **train)
    params["mlflow"]["system_metrics"] = False
    (node / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return node


def start_nodes(
    nodes: list[Path], uri: str, launcher: str, timeout: float = 240
) -> list[subprocess.CompletedProcess]:
    """The train stage command on every node at once, as the docs say to start it: under
    torchrun, or with MASTER_ADDR/MASTER_PORT/NODE_RANK/WORLD_SIZE (what `dvc repro` on
    node 0 inherits). Each node's output is its log."""
    port = str(free_port())
    stage = ["-m", "trainyard.stages.train", "--data", "data/prepared", "--out", "models"]
    procs = []
    for rank, node in enumerate(nodes):
        env = stage_env(MLFLOW_TRACKING_URI=uri, OMP_NUM_THREADS="1")
        for var in LAUNCH_VARS:
            env.pop(var, None)
        if launcher == "torchrun":
            cmd = ["torchrun", "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(rank)]
            cmd += ["--master-addr", "127.0.0.1", "--master-port", port, *stage]
        else:
            cmd = ["python", *stage]
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK=str(rank))
            env["WORLD_SIZE"] = "2"
        procs.append(
            subprocess.Popen(
                cmd, cwd=node, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    done = []
    try:
        for p in procs:
            out = p.communicate(timeout=timeout)[0]
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return done


def files_in(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


def runs_in(uri: str) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exps = [e.experiment_id for e in client.search_experiments()]
    return client.search_runs(exps) if exps else []


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("launcher", ["env", "torchrun"])
def test_two_nodes_train_one_run_owned_by_rank_zero(prepared, tmp_path, launcher):
    """Rank 0 alone creates the MLflow run and writes the outputs; rank 1 trains its plan in
    lockstep, knows the run and leaves its working folder as it found it."""
    nodes = [make_node(tmp_path, rank, prepared) for rank in (0, 1)]
    before = [files_in(node) for node in nodes]
    (tmp_path / "store").mkdir()
    uri = f"sqlite:///{tmp_path}/store/mlflow.db"
    rank0, rank1 = start_nodes(nodes, uri, launcher)
    assert rank0.returncode == 0, rank0.stdout[-4000:]
    assert rank1.returncode == 0, rank1.stdout[-4000:]

    runs = runs_in(uri)
    assert len(runs) == 1, [r.info.run_id for r in runs]
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.params["train.world_size"] == "2"
    assert run.data.params["train.num_nodes"] == "2"
    # Two epochs on 600 images sharded over two ranks: well above chance (0.10).
    assert run.data.metrics["val/acc"] > 0.4

    record = TrainRecord.read(TrainRecord.path_in(nodes[0] / "models"))
    assert record.run_id == run.info.run_id
    assert {"models/train.json", "models/best.ckpt"} <= files_in(nodes[0])
    # Rank 1: no outputs, no resume folder, no MLflow store of its own: nothing at all.
    assert files_in(nodes[1]) == before[1]
    assert not (nodes[1] / "models").exists() and not (nodes[1] / ".cache").exists()

    run_id = run.info.run_id
    assert f"[train] rank 1/2 logs to MLflow run {run_id}" in rank1.stdout, rank1.stdout[-3000:]
    assert f"[train] rank 0/2 logs to MLflow run {run_id}" in rank0.stdout
    # One plan, rank 0's (a probe per rank could plan different epochs): rank 1 says it too.
    plan_lines = [line for line in rank0.stdout.splitlines() if "recipe auto: " in line]
    assert plan_lines and all(line in rank1.stdout for line in plan_lines)
    # Rank 0 alone says each epoch.
    assert rank0.stdout.count("[train] epoch 2/2 train/loss ") == 1
    assert "[train] epoch " not in rank1.stdout
    assert "sync_dist=True" not in rank0.stdout + rank1.stdout


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_nodes_with_other_params_fail_together_before_any_run(prepared, tmp_path):
    """A node with another train.lr would train another model in lockstep: every rank stops
    with the difference named, none waits, and no MLflow run is made."""
    nodes = [make_node(tmp_path, 0, prepared), make_node(tmp_path, 1, prepared, lr=0.01)]
    (tmp_path / "store").mkdir()
    uri = f"sqlite:///{tmp_path}/store/mlflow.db"
    results = start_nodes(nodes, uri, "env", timeout=180)
    for proc in results:
        assert proc.returncode == 1, proc.stdout[-3000:]
        assert "error: rank 1 would train something else than rank 0 (train.lr auto vs 0.01)" in (
            proc.stdout
        )
    assert runs_in(uri) == []
    assert not (nodes[0] / "models").exists()
