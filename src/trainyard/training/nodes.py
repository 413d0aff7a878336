"""The job resolved once, before the fit (``agree``: the hardware, the resume key, the ranks
and the recipe's plan, every rank agreeing), and training across nodes
(``train.num_nodes``): the launcher's processes checked against the params.

Every node runs the same train stage command; torchrun, SLURM's srun or plain environment
variables (MASTER_ADDR, MASTER_PORT, NODE_RANK, WORLD_SIZE) say which process is which, and
Lightning reads them (its TorchElastic, SLURM and Lightning cluster environments). With
``num_nodes > 1`` the ranks join one process group *before* the fit, the way Lightning's DDP
strategy would at the fit's start (which then finds it and reuses it), so that rank 0 can
hand the others what only it may decide: the recipe's plan (a timing probe: every rank
timing its own would plan different epochs, and DDP hangs when one rank stops first), the
resume decision and the MLflow run. An error on any rank before the fit is raised on every
rank (``Nodes.settle``), instead of leaving the others waiting at the next collective.

So do the processes torchrun or srun start on one machine. One machine's DDP started as one
process (``train.devices > 1``, ``num_nodes`` 1) is Lightning's own: rank 0 launches the
others at the fit's start, and they find its plan and resume decision on this machine
(``recipe.json``, the environment).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import lightning as L
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment
from lightning.pytorch.strategies import Strategy

from trainyard.core.card import Card
from trainyard.core.errors import ParamsError, TrainyardError
from trainyard.track.store import check_tracking_uri
from trainyard.training.builder import RESUME_ROOT, build_trainer
from trainyard.training.device import Hardware, resolve_hardware
from trainyard.training.recipe import RECIPE_FILE, Plan, describe, load_plan, plan
from trainyard.training.resume import LAST_CKPT, resume_folder, resume_key

if TYPE_CHECKING:
    from trainyard.training.job import TrainJob, Workspace

log = logging.getLogger(__name__)

T = TypeVar("T")
DOCS = "docs/experiments.md#across-nodes"
WORLD_SIZE_PARAM = "train.world_size"  # processes the fit ran on (train.num_nodes x devices)


class NodeError(TrainyardError):
    """Another rank failed before the fit, or the ranks do not train the same thing."""


@dataclass(frozen=True)
class Launch:
    """How this process was started: by which launcher, as one of how many processes on
    how many nodes (None: the launcher does not say)."""

    launcher: str
    processes: int
    nodes: int | None


def launch_from_env(env: os._Environ[str] | dict[str, str] | None = None) -> Launch | None:
    """The launcher this process runs under, as Lightning detects it (torchrun before
    SLURM, as Lightning), or None for a process started on its own."""
    env = os.environ if env is None else env
    if env is os.environ and TorchElasticEnvironment.detect():
        local = int(env.get("LOCAL_WORLD_SIZE", "0"))
        world = int(env["WORLD_SIZE"])
        return Launch("torchrun", world, world // local if local else None)
    if env is os.environ and SLURMEnvironment.detect():
        nnodes = env.get("SLURM_NNODES")
        return Launch("srun", int(env["SLURM_NTASKS"]), int(nnodes) if nnodes else None)
    if "WORLD_SIZE" in env:
        return Launch("WORLD_SIZE", int(env["WORLD_SIZE"]), None)
    return None


def check_launch(
    num_nodes: int, per_node: int, launch: Launch | None, local_rank_set: bool
) -> None:
    """A ParamsError naming ``train.num_nodes`` (and ``train.devices``) when the launcher
    started another number of processes than the params train with, or none at all."""
    want = num_nodes * per_node
    if launch is None:
        if num_nodes > 1:
            raise ParamsError(
                f"train.num_nodes is {num_nodes}, but this process was not started as one of "
                f"{num_nodes} nodes: run the same train stage command on every node under "
                f"torchrun (--nnodes {num_nodes} --nproc-per-node {per_node} --node-rank R "
                "--master-addr A --master-port P), srun, or with MASTER_ADDR, MASTER_PORT, "
                f"NODE_RANK and WORLD_SIZE={want} set (see {DOCS})"
            )
        return
    if launch.nodes is not None and launch.nodes != num_nodes:
        raise ParamsError(
            f"train.num_nodes is {num_nodes}, but {launch.launcher} runs on {launch.nodes} "
            f"nodes: set train.num_nodes {launch.nodes} (-S train.num_nodes={launch.nodes})"
        )
    if launch.processes != want:
        raise ParamsError(
            f"train.num_nodes {num_nodes} x train.devices {per_node} is {want} processes, but "
            f"{launch.launcher} started {launch.processes}: set train.num_nodes to the number "
            "of nodes and train.devices to the processes on each (torchrun --nnodes / "
            f"--nproc-per-node, sbatch --nodes / --ntasks-per-node; see {DOCS})"
        )
    if launch.launcher == "WORLD_SIZE" and num_nodes > 1 and per_node > 1 and not local_rank_set:
        # Lightning would start each node's other processes only at the fit's start: too
        # late for the ranks' agreement before it.
        raise ParamsError(
            f"train.num_nodes {num_nodes} with train.devices {per_node}: start every process "
            f"yourself (torchrun --nproc-per-node {per_node}, or srun), not only one a node"
        )


@dataclass
class Nodes:
    """This process's place in the training: its global rank among ``world_size``, and the
    DDP strategy whose process group is up (``joined``) when the ranks agree before the fit."""

    rank: int = 0
    world_size: int = 1
    strategy: Strategy | None = None

    @property
    def lead(self) -> bool:
        """Global rank 0: owns the MLflow run and the outputs."""
        return self.rank == 0

    @property
    def joined(self) -> bool:
        return self.strategy is not None

    def settle(self, step: Callable[[], T]) -> list[T]:
        """Run ``step`` here; every rank's result in rank order (only this one's when not
        joined). A failure on any rank fails every rank: the failing rank raises its own
        error, the others a NodeError that names it and its message."""
        if not self.joined:
            return [step()]
        value: Any = None
        error: BaseException | None = None
        try:
            value = step()
        except Exception as err:  # shared below, re-raised here as it was
            error = err
        found: list[Any] = [None] * self.world_size
        dist.all_gather_object(found, (value, None if error is None else _describe(error)))
        if error is not None:
            raise error
        for rank, (_, message) in enumerate(found):
            if message is not None:
                raise NodeError(f"rank {rank} of {self.world_size} failed: {message}")
        return [v for v, _ in found]

    def from_lead(self, decide: Callable[[], T], same: dict[str, str] | None = None) -> T:
        """Rank 0's ``decide()``, on every rank; first (before rank 0 spends time deciding)
        every rank's ``same`` (``what_trains``) must equal rank 0's (``check_same``)."""
        if same is not None:
            check_same(self.settle(lambda: same))
        return self.settle(lambda: decide() if self.lead else None)[0]

    def together(self, step: Callable[[], T]) -> T:
        """Run ``step`` here and keep its value; a failure on any rank fails every rank
        (as ``settle``, but nothing is shared: the value may be a model or a data set)."""
        kept: list[T] = []
        self.settle(lambda: kept.append(step()))
        return kept[0]


def _describe(err: BaseException) -> str:
    return str(err) if isinstance(err, TrainyardError) else f"{type(err).__name__}: {err}"


def join_nodes(num_nodes: int, devices: int | str, accelerator: str) -> Nodes:
    """This process's rank, after checking the launcher against ``num_nodes`` and
    ``devices`` (``train.*``); with ``num_nodes > 1``, joined to the other ranks' process group
    (gloo on CPU, NCCL on GPU: Lightning's choice), which can take as long as the last
    node needs to start."""
    launch = launch_from_env()
    if launch is None and num_nodes == 1:
        return Nodes()  # one process, or one machine's DDP before Lightning launches it
    # Lightning's own reading of the environment: the same trainer settings as the fit's,
    # so ranks and world size are what the fit will use.
    probe = build_trainer(accelerator=accelerator, devices=devices, num_nodes=num_nodes)
    check_launch(num_nodes, probe.num_devices, launch, "LOCAL_RANK" in os.environ)
    if launch is not None and launch.launcher == "WORLD_SIZE" and probe.num_devices == 1:
        # One process a node: this one is the node's local rank 0. Lightning's plain
        # environment then takes it as started by the user instead of launching it.
        os.environ.setdefault("LOCAL_RANK", "0")
    nodes = Nodes(probe.global_rank, probe.world_size)
    if probe.node_rank >= num_nodes:
        raise ParamsError(
            f"train.num_nodes is {num_nodes}, but this node's rank is {probe.node_rank}"
            f" (NODE_RANK / --node-rank count from 0 to {num_nodes - 1})"
        )
    # torchrun and srun start every process themselves, also on one machine; under plain
    # variables on one machine the others are Lightning's, launched at the fit's start.
    external = launch is not None and launch.launcher != "WORLD_SIZE"
    if num_nodes > 1 or (external and nodes.world_size > 1):
        probe.strategy.setup_environment()  # the process group, as the fit would start it
        nodes.strategy = probe.strategy
    return nodes


def what_trains(job: TrainJob, card: Card, hw: Hardware) -> dict[str, str]:
    """What every rank of one fit must share, by dotted param key: the params that shape the
    model, its data and its steps (the seed, the validation batch, every train key as
    written), the data's hash, and the accelerator and precision."""
    shape = {"seed": job.seed, "evaluate.batch_size": job.eval_batch_size}
    shape |= {f"train.{k}": v for k, v in job.train.model_dump().items()}
    same = {k: str(v) for k, v in shape.items()} | {"data sha256": card.data_sha256}
    return same | {"accelerator": hw.accelerator, "precision": hw.precision}


@dataclass(frozen=True)
class Agreement:
    """The job as every rank trains it, settled once before the fit (``agree``): its train
    keys as the recipe planned them, this machine's hardware, the resume key, this
    process's place among the ranks and the recipe's plan."""

    job: TrainJob  # every auto train key resolved; ``job.logged``: what MLflow records
    hw: Hardware
    key: str  # the resume key: of the job as written (auto keys and all)
    nodes: Nodes
    plan: Plan


def agree(job: TrainJob, ws: Workspace) -> Agreement:
    """Resolve ``job`` on this machine once, before the fit: the hardware, ``ws``'s prepared
    data, the resume key (a rerun after a kill finds its run), the ranks (``join_nodes``)
    and the plan; an interrupted run of the same job keeps the plan it made. Across nodes
    rank 0 alone checks the tracking store and plans (``plan_training``), after every rank
    showed it would train the same thing (``what_trains``), and every rank trains its plan:
    ranks timing their own probes planned different epochs, and DDP hangs when one rank
    stops before the others."""
    hw = resolve_hardware(job.train.accelerator, job.train.precision)
    card = ws.card
    key = resume_key(job, card.data_sha256, ws.uri, ws.out_dir)
    nodes = join_nodes(job.train.num_nodes, job.train.devices, hw.accelerator)
    folder = resume_folder(ws.root, key)

    def decide() -> Plan:
        check_tracking_uri(ws.uri)  # before any work: a dead server fails in seconds
        return plan_training(job, card, ws, hw, folder)

    if not nodes.joined:
        # Alone, or a rank that Lightning launched for one machine's DDP (each such rank
        # plans for itself, as rank 0 does): no one to compare with or wait for.
        recipe = decide()
    else:
        recipe = nodes.from_lead(decide, what_trains(job, card, hw))
        if not nodes.lead:
            for line in describe(recipe):  # what this rank trains: rank 0's choices
                log.info("%s", line)
    return Agreement(job.planned(recipe.train), hw, key, nodes, recipe)


def plan_training(job: TrainJob, card: Card, ws: Workspace, hw: Hardware, folder: Path) -> Plan:
    """The recipe's plan for this data and hardware (trainyard.training.recipe), said once per
    choice; an interrupted run of the same job (its resume ``folder``) resumes with the
    plan it made."""
    recipe = load_plan(folder / RECIPE_FILE, job.train) or plan(
        job.train, card, ws.data_dir, hw.accelerator, hw.precision, hw.device
    )
    for line in describe(recipe):
        log.info(line)
    return recipe


def check_same(found: list[dict[str, str]]) -> None:
    """A NodeError naming the first rank whose ``what_trains`` differs from rank 0's, and
    how: raised alike on every rank, which all hold the same ``found``."""
    lead = found[0]
    for rank, theirs in enumerate(found):
        if differ := [f"{k} {v} vs {theirs.get(k)}" for k, v in lead.items() if v != theirs.get(k)]:
            raise NodeError(
                f"rank {rank} would train something else than rank 0 ({'; '.join(differ)}): "
                "every node needs the same params (train.*), the same prepared data (dvc "
                "pull) and the same kind of hardware (or set train.precision)"
            )


def resume_mode(nodes: Nodes, folder: Path) -> str | None:
    """``"never"`` when rank 0 has a checkpoint in ``folder`` that another rank cannot read
    (a resumed fit loads it on every rank: the folder must be on a filesystem every node
    shares), else None (``train.resume`` decides)."""
    ckpt = nodes.settle(lambda: str((folder / LAST_CKPT).resolve()))[0]
    seen = nodes.settle(lambda: Path(ckpt).is_file())
    if not seen[0] or all(seen):
        return None
    if nodes.lead:
        log.warning(
            "not resuming from %s: rank %s cannot read it (across nodes a resume needs %s on a "
            "filesystem every node shares); starting fresh",
            ckpt,
            ", ".join(str(r) for r, ok in enumerate(seen) if not ok),
            RESUME_ROOT,
        )
    return "never"


class RunHolder(Protocol):
    """What ``ShareRun`` needs of training.tracked_run's TrackedRun."""

    logger: Any
    peer_run_id: str | None

    @property
    def run_id(self) -> str | None: ...


class ShareRun(L.Callback):
    """Every rank knows the MLflow run: rank 0's id, broadcast once the ranks are joined
    (one machine's DDP launches the others only at the fit's start), and each rank says
    which run it trains for; rank 0 records the world size (``train.world_size``)."""

    def __init__(self, tracked: RunHolder) -> None:
        self.tracked = tracked

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        tracked = self.tracked
        run_id = trainer.strategy.broadcast(tracked.run_id if trainer.is_global_zero else None)
        if not trainer.is_global_zero:
            tracked.peer_run_id = run_id
        if trainer.world_size > 1:
            log.info(
                "rank %d/%d logs to MLflow run %s", trainer.global_rank, trainer.world_size, run_id
            )
        if trainer.is_global_zero:
            record_world_size(tracked.logger.experiment, run_id, trainer.world_size)


def record_world_size(client: Any, run_id: str, world_size: int) -> None:
    """Param ``train.world_size``, logged once: MLflow params cannot change, and a resumed
    run has it already (the resume key holds num_nodes and devices, so it is the same)."""
    have = client.get_run(run_id).data.params.get(WORLD_SIZE_PARAM)
    if have is None:
        client.log_param(run_id, WORLD_SIZE_PARAM, world_size)
    elif have != str(world_size):
        log.warning(
            "this fit runs on %d processes; MLflow run %s keeps %s=%s from its start",
            world_size,
            run_id,
            WORLD_SIZE_PARAM,
            have,
        )
