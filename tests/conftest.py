"""Shared fixtures: the real dataset files, crafted IDX files, a copy of the repository."""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

# make test's order of work (a pytest-xdist hook: registered by being here).
from scheduling import pytest_xdist_make_scheduler  # noqa: F401

from team.mlflow_server import JOB_EXECUTION, wait_healthy
from trainyard.core.card import Card
from trainyard.core.handoffs import TrainRecord
from trainyard.core.pause_points import PAUSE_AT, PAUSE_FILE
from trainyard.data.idx import read_idx, write_idx_bytes
from trainyard.evaluation.scoring import REPORT_FILES

# One OpenMP pool per xdist worker's share of the cores, for this process and every stage it
# starts (they inherit the variable; OpenMP reads it when its pool first starts, which no
# import above does). torch's default is a thread per core in every process: with 2 workers
# on 2 cores each step's threads wait on each other's. Measured on 2 cores, an
# EfficientNet-Lite0 step at 32 px, batch 16: 168 ms alone, 770-900 ms with two such
# processes at 2 threads, 166-173 ms at 1 thread; the 28 px cnn at batch 256: 167 ms alone
# at 2 threads, 643 ms two at a time at 2 threads, 379-491 ms at 1.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))

# Every `mlflow server` the tests start (and the stages' children) as the team stack starts
# its own: without MLflow's GenAI job runner (team/mlflow_server.py says why).
os.environ.setdefault(JOB_EXECUTION, "false")

REPO = Path(__file__).resolve().parents[1]
# A background job of a non-interactive shell (`cmd &` in a script) starts with SIGINT
# ignored, and every process it starts inherits that: the Ctrl-C tests' stages would not
# see their Ctrl-C. Python's own handler here; a process started from here then gets
# SIGINT's default, as from a terminal.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
# The evaluate stage's reports (dvc.yaml's outs, registry.json aside): written here once so
# the pipeline tests that check them cannot drift apart.
# What the evaluate stage writes into reports/ (besides registry.json): its report files and
# metrics.json.
# dvc.yaml's pipeline stages, in their order.
STAGES = ("fetch", "prepare", "train", "export", "evaluate")
EVALUATE_REPORTS = (*(f"reports/{f}" for f in REPORT_FILES.values()), "reports/metrics.json")
FASHION_DIR = Path(os.environ.get("TRAINYARD_FASHION_DIR", "/usr/share/datasets/fashion-mnist"))
VENV_BIN = Path(sys.executable).parent


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def fashion_dir() -> Path:
    """The real Fashion-MNIST files (Debian's dataset-fashion-mnist)."""
    if not (FASHION_DIR / "train-images-idx3-ubyte.gz").is_file():
        pytest.fail(
            f"Fashion-MNIST files not found in {FASHION_DIR}: run "
            "`apt-get install dataset-fashion-mnist` or set TRAINYARD_FASHION_DIR"
        )
    return FASHION_DIR


def write_gz(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(data, mtime=0))
    return path


@pytest.fixture
def tiny_idx(tmp_path: Path) -> dict[str, Path]:
    """Small valid IDX image and label files (.gz) with known content."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(12, 28, 28), dtype=np.uint8)
    labels = np.arange(12, dtype=np.uint8) % 10
    return {
        "images": write_gz(tmp_path / "imgs-idx3-ubyte.gz", write_idx_bytes(images)),
        "labels": write_gz(tmp_path / "lbls-idx1-ubyte.gz", write_idx_bytes(labels)),
        "images_array": images,  # type: ignore[dict-item]
        "labels_array": labels,  # type: ignore[dict-item]
    }


def repo_files() -> list[str]:
    """Tracked and untracked-but-not-ignored files: what a fresh clone would hold."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return [f for f in out.split("\0") if f and (REPO / f).is_file()]


# The suite's copies train from scratch: the default fine-tune of ImageNet weights costs a
# 160 px EfficientNet per folder test; test_pipeline_folder runs the params as shipped.
SHIPPED_PRETRAINED = "  pretrained: auto "
SUITE_PRETRAINED = "  pretrained: null "


def copy_repo(dest: Path, shipped_params: bool = False) -> Path:
    """A git repository at ``dest`` holding this checkout's files, committed; its
    params.yaml trains from scratch (``train.pretrained: null``) unless ``shipped_params``."""
    for rel in repo_files():
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, target)
    if not shipped_params:
        params = dest / "params.yaml"
        text = params.read_text()
        assert text.count(SHIPPED_PRETRAINED) == 1, "params.yaml: train.pretrained moved"
        params.write_text(text.replace(SHIPPED_PRETRAINED, SUITE_PRETRAINED))
    env = git_env()
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "copy"]):
        subprocess.run(cmd, cwd=dest, check=True, env=env, capture_output=True)
    return dest


def git_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        GIT_AUTHOR_NAME="t",
        GIT_AUTHOR_EMAIL="t@t",
        GIT_COMMITTER_NAME="t",
        GIT_COMMITTER_EMAIL="t@t",
    )
    return env


def stage_env(**extra: str) -> dict[str, str]:
    """Environment for running the pipeline: venv first on PATH, no inherited MLflow URI."""
    env = git_env()
    env.pop("MLFLOW_TRACKING_URI", None)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    # DVC runs stage commands through $SHELL; CI has none set, so /bin/sh (dash). Use it
    # here too: the tests see what CI sees, not what an interactive bash would hide.
    env["SHELL"] = "/bin/sh"
    # pytest's marker for its own process: inherited, it turns on MLflow's test-only checks
    # inside the pipeline, which is not what a user's `dvc repro` runs.
    env.pop("PYTEST_CURRENT_TEST", None)
    env.update(extra)
    return env


def run_ok(
    cmd: list[str], cwd: Path = REPO, timeout: float = 600, **env: str
) -> subprocess.CompletedProcess:
    """``cmd`` run in ``cwd`` as the pipeline runs (``stage_env(**env)``), its output
    captured as text; fails with the tail of that output unless it exits 0."""
    proc = subprocess.run(
        cmd, cwd=cwd, env=stage_env(**env), capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def dvc(repo: Path, *args: str, check: bool = True, **env: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        ["dvc", *args], cwd=repo, env=stage_env(**env), capture_output=True, text=True, timeout=900
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"dvc {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def train_concurrently(repo: Path, outs: list[str], **env: str) -> list[Path]:
    """The train stage's script run once per out folder, all at the same time; each must
    exit 0. Returns each run's train.json."""
    procs = [
        subprocess.Popen(
            ["python", "-m", "trainyard.stages.train", "--data", "data/prepared", "--out", out],
            cwd=repo,
            env=stage_env(**env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for out in outs
    ]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-3000:]
        assert "database is locked" not in out
    return [TrainRecord.path_in(repo / out) for out in outs]


def stop_group(proc: subprocess.Popen, timeout: float = 15) -> bool:
    """SIGTERM a server started with ``start_new_session=True`` (its whole process group),
    SIGKILL after ``timeout``; True when it stopped on SIGTERM (or had already exited)."""

    if proc.poll() is not None:
        return True
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
        return True
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return False


def wait_group_gone(pgid: int, deadline: float, failure: str) -> None:
    """Wait until no process of the group ``pgid`` is left, failing with ``failure`` past
    ``deadline`` (``time.monotonic``): a stage may outlive the dvc that started it by a
    moment (it ends its MLflow run)."""
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        assert time.monotonic() < deadline, failure
        time.sleep(0.05)


def pause_env(step: str, announce: Path, **extra: str) -> dict[str, str]:
    """``stage_env`` for a process that pauses at ``step`` (``name`` or ``name:n``, the n-th
    arrival) and announces it in ``announce`` (trainyard.core.pause_points): a test's signal
    lands at that step on any machine, never in a race with the process."""
    return stage_env(**{PAUSE_AT: step, PAUSE_FILE: str(announce)}, **extra)


def wait_paused(
    announce: Path, proc: subprocess.Popen, output: Callable[[], str], timeout: float = 300
) -> int:
    """Wait for ``proc`` (or a process it started) to announce its pause in ``announce``;
    the pausing process's pid. Fails with ``output()`` if ``proc`` ended first."""
    deadline = time.monotonic() + timeout
    while not announce.exists():
        if proc.poll() is not None:
            raise AssertionError(
                f"exited {proc.returncode} before pausing ({announce.name}):\n{output()[-4000:]}"
            )
        assert time.monotonic() < deadline, f"no pause ({announce.name}) within {timeout:g} s"
        time.sleep(0.02)
    return int(announce.read_text())


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def sqlite_mlflow_server(root: Path, start_s: float = 90) -> Iterator[str]:
    """A real `mlflow server` (sqlite backend, artifacts proxied into ``root``) on a free
    port; yields its URI once /health answers (within ``start_s``), stops its process group
    after."""
    port = free_port()
    log = open(root / "server.log", "w")  # noqa: SIM115 - closed below
    cmd = [str(VENV_BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--backend-store-uri", f"sqlite:///{root}/mlflow.db"]
    cmd += ["--artifacts-destination", str(root / "artifacts"), "--workers", "1"]
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=stage_env()
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(uri, proc, root / "server.log", timeout=start_s)
        yield uri
    finally:
        stop_group(proc, timeout=20)
        log.close()


@pytest.fixture(scope="module")
def mlflow_db(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """One sqlite MLflow store per module, MLflow's global URI pointed at it (the registry
    registers through the fluent API) and restored after: (uri, experiment id)."""
    import mlflow

    root = tmp_path_factory.mktemp("mlflow-db")
    uri = f"sqlite:///{root}/mlflow.db"
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    try:
        yield uri, mlflow.create_experiment("t", artifact_location=(root / "art").as_uri())
    finally:
        mlflow.set_tracking_uri(previous)


def set_params(repo: Path, **changes: dict) -> None:
    path = repo / "params.yaml"
    params = yaml.safe_load(path.read_text())
    for section, values in changes.items():
        params[section].update(values)
    path.write_text(yaml.safe_dump(params, sort_keys=False))


def fashion_card(mean: float = 0.286, std: float = 0.353):
    """The card the Fashion-MNIST source writes, with the given statistics."""
    from trainyard.data.sources import fashion_mnist

    return fashion_mnist.fashion_card(mean, std)


def train_checkpoint(
    root: Path,
    images: np.ndarray,
    labels: np.ndarray,
    steps: int,
    batch_size: int,
    mean: float,
    std: float,
    card: Any = None,
) -> Path:
    """A real Lightning checkpoint (``root/best.ckpt``) after ``steps`` CPU steps, on
    Fashion-MNIST-like images [N,28,28] or [N,1,28,28], carrying a Fashion-MNIST card
    (or ``card``, for images [N,C,H,W] of another contract)."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from trainyard.model.classifier import Classifier
    from trainyard.training.builder import build_trainer
    from trainyard.training.datamodule import TensorBatches

    if images.ndim == 3:
        images = images[:, None]
    x = torch.from_numpy(np.ascontiguousarray(images, dtype=np.uint8))
    y = torch.from_numpy(labels.astype(np.int64))
    loader = DataLoader(TensorBatches(x, y, batch_size, shuffle=True), batch_size=None)
    L.seed_everything(0, verbose=False)
    trainer = build_trainer(max_steps=steps, root=root)
    card = fashion_card(mean, std) if card is None else card
    trainer.fit(Classifier(card=card.contract(), arch="cnn"), loader)
    trainer.save_checkpoint(root / "best.ckpt")
    return root / "best.ckpt"


def make_card(
    classes: int | tuple[str, ...],
    shape: tuple[int, int, int],
    mean: float | tuple[float, ...] = 0.5,
    std: float | tuple[float, ...] = 0.25,
    source: str = "folder",
    **more: Any,
) -> Card:
    """A card for [C,H,W] images: ``classes`` named (or counted: c0, c1, ...); a single
    ``mean``/``std`` holds for every channel; ``more``: Card's other fields."""
    channels, height, width = shape
    names = tuple(f"c{i}" for i in range(classes)) if isinstance(classes, int) else classes

    def per_channel(value: float | tuple[float, ...]) -> tuple[float, ...]:
        return tuple(value) if isinstance(value, tuple) else (value,) * channels

    return Card(source, names, channels, height, width, per_channel(mean), per_channel(std), **more)


def save_onnx(graph: Any, path: Path, props: dict[str, str]) -> Path:
    """``graph`` as an opset-17 model (IR version 8, which every onnxruntime here reads),
    with metadata ``props``, checked and saved at ``path``."""
    import onnx
    from onnx import helper

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    helper.set_model_props(model, props)
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def write_tiny_onnx(
    folder: Path,
    card: Any,
    seed: int = 0,
    run_id: str = "tiny-run",
    data_sha: str = "d" * 64,
    embedding: bool = False,
    cam: bool = False,
) -> tuple[Path, dict]:
    """model.onnx (flatten -> matmul -> add: logits) carrying ``card``, plus its .sha256.
    Returns (path, weights) so a test can compute the expected answer itself.

    One output, as models were exported before the embedding; ``embedding=True`` adds a
    second output, ``embedding`` = flat input @ weights["embedding_weight"] ([N, 4]), as now;
    ``cam=True`` the class maps, ``cam`` [N, classes, H, W] = the input's channel mean x
    weights["cam_weight"][class], with metadata ``explain: cam``."""
    from onnx import TensorProto, helper, numpy_helper

    from trainyard.core.card import METADATA_KEY
    from trainyard.core.io import sha256_file

    rng = np.random.default_rng(seed)
    c, h, w = card.input_shape
    weights = {
        "weight": rng.normal(0, 1, (c * h * w, card.num_classes)).astype(np.float32),
        "bias": rng.normal(0, 1, card.num_classes).astype(np.float32),
    }
    nodes = [
        helper.make_node("Flatten", ["input"], ["flat"], axis=1),
        helper.make_node("MatMul", ["flat", "weight"], ["product"]),
        helper.make_node("Add", ["product", "bias"], ["logits"]),
    ]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", card.num_classes])]
    if embedding:
        weights["embedding_weight"] = rng.normal(0, 1, (c * h * w, 4)).astype(np.float32)
        nodes.append(helper.make_node("MatMul", ["flat", "embedding_weight"], ["embedding"]))
        outputs.append(helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["N", 4]))
    if cam:
        k = card.num_classes
        weights["cam_weight"] = rng.normal(0, 1, (1, k, 1, 1)).astype(np.float32)
        nodes.append(helper.make_node("ReduceMean", ["input"], ["gray"], axes=[1], keepdims=1))
        nodes.append(helper.make_node("Mul", ["gray", "cam_weight"], ["cam"]))
        outputs.append(helper.make_tensor_value_info("cam", TensorProto.FLOAT, ["N", k, h, w]))
    initializer = [numpy_helper.from_array(v, k) for k, v in weights.items()]
    graph = helper.make_graph(
        nodes,
        "tiny",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", c, h, w])],
        outputs,
        initializer=initializer,
    )
    props = {
        METADATA_KEY: json.dumps(card.contract()),
        "classes": json.dumps(list(card.classes)),
        "mlflow_run_id": run_id,
        "data_sha256": data_sha,
        "arch": "tiny",
    } | ({"explain": "cam"} if cam else {})
    folder.mkdir(parents=True, exist_ok=True)
    path = save_onnx(graph, folder / "model.onnx", props)
    path.with_name("model.onnx.sha256").write_text(f"{sha256_file(path)}  model.onnx\n")
    return path, weights


def small_pipeline_repo(dest: Path, fashion_dir: Path) -> Path:
    """A committed copy of the repository set to a 3,000-image slice, 1 epoch, and system
    metrics every second: a real pipeline that runs in about a minute."""
    repo = copy_repo(dest)
    set_params(
        repo,
        data={"limit": 3000, "val_size": 500, "debian_dir": str(fashion_dir)},
        train={"max_epochs": 1},
        mlflow={"system_metrics_interval_s": 1},
    )
    return repo


def shared_folder(
    tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]
) -> Path:
    """``build(folder)`` once per test run, whatever the number of xdist workers: the first
    worker to ask builds under an exclusive lock in the run's common temp root, the others
    wait for it and use its folder (pytest-xdist's "session-scoped fixtures execute only
    once" recipe). A build that failed fails the other workers with its error instead of
    running again. Users only read the folder: it is the run's one copy."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # popen-gwN's parent: the run's temp root, common to the workers
    folder, failed = root / f"shared-{name}", root / f"shared-{name}.failed"
    with open(root / f"shared-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if failed.exists():
            pytest.fail(
                f"the shared {name}: its build failed in another worker:\n{failed.read_text()}"
            )
        if not (folder / ".built").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            try:
                build(folder)
            except BaseException:
                failed.write_text(traceback.format_exc()[-6000:])
                raise
            (folder / ".built").touch()
    return folder


@pytest.fixture(scope="session")
def reproduced_pipeline(fashion_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small pipeline after its first `dvc repro`, run once per test run (shared by the
    xdist workers): modules take their own copy (``copy_reproduced``) instead of each
    training from scratch. Never changed itself; the first repro's output is beside it, in
    ``first_repro.log``."""

    def build(folder: Path) -> None:
        repo = small_pipeline_repo(folder / "trainyard", fashion_dir)
        first = dvc(repo, "repro")
        (folder / "first_repro.log").write_text(first.stdout + first.stderr)

    return shared_folder(tmp_path_factory, "reproduced", build) / "trainyard"


SERVED_IMAGES = 240  # real test images the serving tests send and compare with offline ONNX


@pytest.fixture(scope="session")
def test_set(fashion_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """The first SERVED_IMAGES Fashion-MNIST test images [N,28,28] and their labels."""
    images = read_idx(fashion_dir / "t10k-images-idx3-ubyte.gz")[:SERVED_IMAGES]
    labels = read_idx(fashion_dir / "t10k-labels-idx1-ubyte.gz")[:SERVED_IMAGES]
    return images, labels


@pytest.fixture(scope="session")
def model_dir(fashion_dir: Path, test_set: tuple[np.ndarray, np.ndarray], tmp_path_factory) -> Path:
    """models/model.onnx + .sha256 from the real export code (its parity gate on
    ``test_set``), after a few training steps on real Fashion-MNIST: one model per test run,
    shared by the xdist workers and the serving modules, which only read it."""
    from trainyard.export.onnx_export import export_and_verify

    def build(root: Path) -> None:
        train = read_idx(fashion_dir / "train-images-idx3-ubyte.gz")[:512]
        labels = read_idx(fashion_dir / "train-labels-idx1-ubyte.gz")[:512]
        train_checkpoint(root, train, labels, steps=8, batch_size=64, mean=0.286, std=0.353)
        export_and_verify(
            root / "best.ckpt",
            root / "model.onnx",
            test_set[0][:, None],
            opset=18,
            max_abs_diff=1e-4,
            run_id="run-for-serving-tests",
            data_sha256="d" * 64,
        )

    return shared_folder(tmp_path_factory, "serving-model", build)


def copy_reproduced(src: Path, dest: Path) -> Path:
    """A copy of the reproduced pipeline ``src`` at ``dest`` that owns its MLflow store:
    MLflow records absolute artifact paths (sqlite rows, some text files), so every
    mention of ``src`` in the store and in text files is rewritten to ``dest`` (a store
    still naming ``src`` would write into the shared original: that fails here)."""

    # .dvc/tmp holds only DVC's caches and locks (keyed by absolute path): rebuilt on use.
    def dvc_tmp(folder: str, names: list[str]) -> list[str]:
        return ["tmp"] if Path(folder) == src / ".dvc" else []

    shutil.copytree(src, dest, symlinks=True, ignore=dvc_tmp)
    old, new = str(src), str(dest)
    db = sqlite3.connect(dest / "mlflow.db")
    with db:
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        for table in tables:
            for col in db.execute(f'PRAGMA table_info("{table}")').fetchall():
                if "CHAR" in col[2].upper() or "TEXT" in col[2].upper():
                    db.execute(
                        f'UPDATE "{table}" SET "{col[1]}" = replace("{col[1]}", ?, ?) '
                        f'WHERE "{col[1]}" LIKE ?',
                        (old, new, f"%{old}%"),
                    )
    db.execute("VACUUM")  # no old value left behind in free pages
    db.close()
    for path in dest.rglob("*"):
        if not path.is_file() or path.is_symlink() or path.name == "mlflow.db":
            continue
        data = path.read_bytes()
        if old.encode() in data:
            try:
                path.write_text(data.decode().replace(old, new))
            except UnicodeDecodeError:
                # Binary: a checkpoint's record of where Lightning wrote it. Read-only
                # provenance, and DVC-tracked: rewritten, its hash would change.
                continue
    assert old.encode() not in (dest / "mlflow.db").read_bytes(), f"{dest}/mlflow.db names {src}"
    return dest


# ---------------------------------------------------------------- folder datasets

PHOTO_CLASSES = ("circle", "square", "triangle")


def _load_make_shapes():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_shapes", REPO / "examples/make_shapes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


draw_shape = _load_make_shapes().draw_shape


def make_photo_folder(
    root: Path,
    per_class: int = 12,
    classes: tuple[str, ...] = PHOTO_CLASSES,
    seed: int = 0,
    litter: bool = True,
    bad: bool = False,
) -> dict[str, list[str]]:
    """A class-per-folder tree of shapes: mixed sizes, modes and formats, plus OS litter
    and (``bad``) broken files. Returns {"good": [rel...], "bad": [rel...]}."""
    rng = np.random.default_rng(seed)
    formats = [
        ("png", "RGB"),
        ("jpg", "RGB"),
        ("JPEG", "L"),
        ("webp", "RGB"),
        ("bmp", "RGB"),
        ("gif", "P"),
        ("tif", "RGB"),
        ("png", "RGBA"),
        ("png", "LA"),
    ]
    good: list[str] = []
    for c, name in enumerate(classes):
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            ext, mode = formats[(i + c) % len(formats)]
            size = (int(rng.integers(40, 160)), int(rng.integers(40, 160)))
            im = draw_shape(PHOTO_CLASSES[c % 3], size, rng, mode)
            rel = f"{name}/img_{i:03d}.{ext}"
            fmt = {"jpg": "JPEG", "tif": "TIFF"}.get(ext.lower(), ext.upper())
            im.save(root / rel, format=fmt)
            good.append(rel)
    if litter:
        (root / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
        (root / classes[0] / "Thumbs.db").write_bytes(b"\xd0\xcf\x11\xe0")
        (root / classes[0] / "notes.txt").write_text("taken on holiday\n")
        (root / ".hidden").mkdir(exist_ok=True)
        (root / ".hidden" / "x.png").write_bytes(b"not even an image")
        (root / classes[1] / "._img_000.png").write_bytes(b"\0\5\26\7 AppleDouble")
    bad_files: list[str] = []
    if bad:
        target = root / classes[0]
        (target / "zero.png").write_bytes(b"")
        (target / "text.jpg").write_text("this is not a jpeg\n")
        full = (root / good[0]).read_bytes()
        (target / "truncated.png").write_bytes(full[: len(full) // 2])
        bad_files = [f"{classes[0]}/{n}" for n in ("zero.png", "text.jpg", "truncated.png")]
    return {"good": good, "bad": bad_files}
