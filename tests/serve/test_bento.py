"""The deployable bento and the Kubernetes manifest, as a deployment would meet them.

Slow: a small real pipeline exports a model; `bentoml build` packs it with
bento/bentofile.yaml; the bento must hold exactly the service, trainyard's light layers
whole (core, data, runtime, watch, serve, bulk: tests/house/test_layers.py BENTO_PACKAGES), the root
params.yaml and the verified model, and neither import nor require the training stack. A
clean virtual environment made from the bento's env/python/requirements.txt alone (what the
image installs) then serves the bento from a folder outside the repository, and its HTTP
answers on real test images must equal offline ONNX Runtime through trainyard's own
preprocessing. In the same environment, deploy/predict-job.yaml's command runs as two
concurrent shards and deploy/predict-merge.yaml's merges them: the same table as one run.

Not slow: the bentofile's include patterns on this checkout (and that they ship every module
the service and `python -m trainyard.bulk` import); deploy/kubernetes.yaml,
deploy/predict-job.yaml and deploy/predict-merge.yaml parsed and checked (kinds, probes,
secret, resources, non-root, the Indexed Job's N and index expansion, the bento's paths),
and against the Kubernetes JSON schemas (kubernetes-validate, strict).
"""

from __future__ import annotations

import argparse
import ast
import copy
import io
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import bentoml
import numpy as np
import pytest
import requests
import yaml
from pathspec import PathSpec
from test_layers import BENTO_ENTRIES, BENTO_PACKAGES
from test_serving import wait_ready

from conftest import REPO, VENV_BIN, copy_reproduced, free_port, repo_files, stage_env, stop_group

BENTO_NAME = "trainyard_classifier"
MANIFEST = REPO / "deploy" / "kubernetes.yaml"
PREDICT_JOB = REPO / "deploy" / "predict-job.yaml"
PREDICT_MERGE = REPO / "deploy" / "predict-merge.yaml"
# Where BentoML's generated image puts the bento (generate.BENTO_PATH), and its files:
# /home/bentoml/bento/src/<what the bentofile includes>.
IMAGE_BENTO = "/home/bentoml/bento"
IMAGE_SRC = f"{IMAGE_BENTO}/src"
API_KEY = "bento-test-key"
PER_CLASS = 3  # real test images per class sent over HTTP
# Never in the bento's requirements: the training and tracking stack.
TRAINING_STACK = {
    "torch",
    "torchvision",
    "torchmetrics",
    "lightning",
    "pytorch-lightning",
    "mlflow",
    "mlflow-skinny",
    "dvc",
    "onnx",
    "onnxscript",
    "matplotlib",
}
SERVING_STACK = {
    "bentoml",
    "onnxruntime",
    "numpy",
    "pillow",
    "pillow-heif",
    "pydantic",
    "pyyaml",
    "pyarrow",  # bulk scoring's tables
}
# Never imported by a shipped module: the bento's environment does not have them.
TRAINING_IMPORTS = {
    "torch",
    "torchvision",
    "torchmetrics",
    "lightning",
    "pytorch_lightning",
    "mlflow",
    "dvc",
    "onnx",
    "onnxscript",
    "matplotlib",
}
# The layers in the bento, each whole, and what the image runs: tests/house/test_layers.py's.
SHIPPED_LAYERS = BENTO_PACKAGES
ENTRY_POINTS = BENTO_ENTRIES
BENTOFILE = REPO / "bento" / "bentofile.yaml"
# Output of a build or an install that failed for want of a package index, not a bug here.
NETWORK_HINTS = (
    "temporary failure in name resolution",
    "name or service not known",
    "network is unreachable",
    "failed to establish a new connection",
    "max retries exceeded",
    "could not fetch url",
    "dns error",
    "failed to fetch",
    "error sending request",
    "connection refused",
    "failed to install uv",
)


def tail(text: str, n: int = 4000) -> str:
    return text[-n:]


def unreachable_index(output: str) -> bool:
    low = output.lower()
    return any(hint in low for hint in NETWORK_HINTS)


def requirement_names(path: Path) -> set[str]:
    """Normalised project names in a requirements file (options and comments skipped)."""
    names = set()
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", line)
        if match:
            names.add(re.sub(r"[-_.]+", "-", match.group(0)).lower())
    return names


def training_imports(source: str, name: str) -> list[str]:
    """``file:line: module`` for each import of the training stack in ``source`` (every
    import, at the top or in a function)."""
    found = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            modules = [node.module or ""]
        else:
            continue
        found += [
            f"{name}:{node.lineno}: {m}" for m in modules if m.split(".")[0] in TRAINING_IMPORTS
        ]
    return found


def _optional(node: ast.Try) -> bool:
    """A ``try`` whose failure to import is handled (an optional import, a probe)."""
    names = set()
    for handler in node.handlers:
        kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        names |= {k.id for k in kinds if isinstance(k, ast.Name)}
    return bool(names & {"ImportError", "ModuleNotFoundError"})


def executed_imports(nodes: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """The imports that run when these statements do (a function's when it is called):
    not those under ``if TYPE_CHECKING:``, nor in a ``try`` that handles ImportError."""
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            yield from executed_imports(node.orelse)
            continue
        if isinstance(node, ast.Try) and _optional(node):
            for part in (*node.handlers, *node.orelse, *node.finalbody):
                yield from executed_imports([part] if isinstance(part, ast.stmt) else part.body)
            continue
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt):
                yield from executed_imports([child])
            elif isinstance(child, ast.excepthandler):
                yield from executed_imports(child.body)


def module_file(name: str, root: Path) -> str | None:
    """``trainyard.a.b`` -> ``src/trainyard/a/b.py`` or ``src/trainyard/a/b/__init__.py``."""
    base = root / "src" / Path(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path.relative_to(root).as_posix()
    return None


def trainyard_closure(entries: tuple[str, ...], root: Path = REPO) -> set[str]:
    """Every trainyard module file (relative to ``root``) that running ``entries`` imports,
    their packages' ``__init__.py`` included, followed from module to module."""
    seen: set[str] = set()
    todo = list(entries)
    while todo:
        rel = todo.pop()
        if rel in seen:
            continue
        seen.add(rel)
        tree = ast.parse((root / rel).read_text(), rel)
        for node in executed_imports(tree.body):
            assert not getattr(node, "level", 0), f"{rel}:{node.lineno}: a relative import"
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:  # `from trainyard.bulk import command`: command may be a module
                names = [node.module or ""]
                names += [f"{node.module}.{alias.name}" for alias in node.names]
            for name in names:
                if name.split(".")[0] != "trainyard":
                    continue
                parts = name.split(".")
                for i in range(1, len(parts) + 1):  # the packages on the way run first
                    found = module_file(".".join(parts[:i]), root)
                    if found and found not in seen:
                        todo.append(found)
    return seen - {e for e in entries if not e.startswith("src/")}


def port_closed(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) != 0


def clean_env(venv: Path | None = None, **extra: str) -> dict[str, str]:
    """os.environ without this project's venv, PYTHONPATH or trainyard/MLflow settings."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "MLFLOW_TRACKING_URI"}
        and not k.startswith("TRAINYARD_")
    }
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and Path(p) != VENV_BIN]
    if venv is not None:
        path.insert(0, str(venv / "bin"))
    env["PATH"] = os.pathsep.join(path)
    env["BENTOML_DO_NOT_TRACK"] = "true"
    env.update(extra)
    return env


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def pipeline_repo(reproduced_pipeline, tmp_path_factory) -> Path:
    """A copy of the session's reproduced small pipeline (a real `dvc repro`: 3,000-image
    slice, 1 epoch; evaluate's drift reference included, which the bento must ship and its
    service load), plus decoys that a loose include pattern would pick up."""
    repo = copy_reproduced(reproduced_pipeline, tmp_path_factory.mktemp("bento") / "trainyard")
    assert (repo / "models/model.reference.npz").is_file()
    assert (repo / "models/model.card.json").is_file()
    run = repo / "mlruns" / "0" / "decoy-run" / "artifacts"
    for rel, data in {
        "config/params.yaml": (repo / "params.yaml").read_bytes(),  # MLflow's copy
        "model/model.onnx": (repo / "models/model.onnx").read_bytes(),
        "model/model.onnx.sha256": (repo / "models/model.onnx.sha256").read_bytes(),
    }.items():
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_bytes(data)
    for rel in ("bento/__pycache__/service.cpython-311.pyc", "src/trainyard/stray.pyc"):
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_bytes(b"\0")
    (repo / "data" / "params.yaml").write_text("seed: 0\n")
    return repo


@pytest.fixture(scope="module")
def bento(pipeline_repo, tmp_path_factory) -> dict[str, Any]:
    """`bentoml build -f bento/bentofile.yaml .` into a fresh BENTOML_HOME."""
    home = tmp_path_factory.mktemp("bentoml-home")
    env = stage_env(BENTOML_HOME=str(home), BENTOML_DO_NOT_TRACK="true")
    start = time.monotonic()
    proc = subprocess.run(
        [str(VENV_BIN / "bentoml"), "build", "-f", "bento/bentofile.yaml", ".", "-o", "tag"],
        cwd=pipeline_repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    seconds = time.monotonic() - start
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        if unreachable_index(out):
            pytest.skip(
                "bentoml build needs a package index (it installs uv and locks the "
                f"requirements with `uv pip compile`), and none was reachable:\n{tail(out)}"
            )
        pytest.fail(f"bentoml build failed ({proc.returncode}):\n{tail(out)}")
    match = re.search(rf"__tag__:{BENTO_NAME}:(\S+)", proc.stdout)
    assert match, f"no bento tag in the build output:\n{tail(out)}"
    version = match.group(1)
    path = home / "bentos" / BENTO_NAME / version
    assert (path / "bento.yaml").is_file(), f"{path}: not a bento"
    print(f"bentoml build: {seconds:.1f} s, {BENTO_NAME}:{version}")
    return {"home": home, "version": version, "path": path, "build_s": seconds}


@pytest.fixture(scope="module")
def clean_venv(bento, tmp_path_factory) -> dict[str, Any]:
    """A venv without system site packages, with only the bento's requirements.txt."""
    root = tmp_path_factory.mktemp("clean-venv") / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", str(root)],
        env=clean_env(),
        check=True,
        capture_output=True,
        timeout=300,
    )
    cfg = (root / "pyvenv.cfg").read_text()
    assert re.search(r"include-system-site-packages\s*=\s*false", cfg), cfg
    reqs = bento["path"] / "env" / "python" / "requirements.txt"
    start = time.monotonic()
    proc = subprocess.run(
        [str(root / "bin" / "python"), "-m", "pip", "install", "--quiet", "-r", str(reqs)],
        env=clean_env(root),
        cwd=root.parent,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    seconds = time.monotonic() - start
    if proc.returncode != 0:
        out = proc.stdout + proc.stderr
        if unreachable_index(out):
            pytest.skip(f"pip could not reach a package index for {reqs}:\n{tail(out)}")
        pytest.fail(f"pip install -r {reqs} failed in a clean venv:\n{tail(out)}")
    print(f"clean venv: pip install -r requirements.txt took {seconds:.1f} s")
    return {"root": root, "install_s": seconds}


# ---------------------------------------------------------------------------- the bento


def shipped_modules(root: Path) -> set[str]:
    """The trainyard modules the bento must hold, as ``trainyard/...`` (its src/ layout):
    the shipped layers, each whole, subpackages included."""
    package = root / "src"
    layers = {
        p.relative_to(package).as_posix()
        for layer in SHIPPED_LAYERS
        for p in (package / "trainyard" / layer).rglob("*.py")
    }
    return {"trainyard/__init__.py"} | layers


@pytest.mark.slow
def test_bento_holds_only_the_service_its_modules_params_and_the_verified_model(
    bento, pipeline_repo
):
    src = bento["path"] / "src"
    got = {p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file()}
    modules = shipped_modules(pipeline_repo)
    assert "trainyard/serve/predictor.py" in modules and "trainyard/core/config.py" in modules
    assert {"trainyard/bulk/__main__.py", "trainyard/data/walk.py"} <= modules
    assert "trainyard/data/sources/csv_list.py" in modules  # subpackages too
    assert not any(m.startswith(("trainyard/training/", "trainyard/track/")) for m in modules)
    expected = {
        "bentofile.yaml",  # BentoML's own copy of the build file
        "bento/service.py",
        "params.yaml",
        "models/model.onnx",
        "models/model.onnx.sha256",
        "models/model.reference.npz",  # evaluate's: the drift score on /metrics
        "models/model.card.md",  # evaluate's model card: GET /card
        "models/model.card.json",
        *modules,
        # the demo page at /ui (trainyard.serve.ui_routes), served from the package's files
        "trainyard/serve/ui/index.html",
        "trainyard/serve/ui/ui.js",
        "trainyard/serve/ui/ui.css",
    }
    assert got == expected, (
        f"unexpected in the bento: {sorted(got - expected)}; missing: {sorted(expected - got)}"
    )
    # Every module that the service and `python -m trainyard.bulk` import is in it.
    imported = {f.removeprefix("src/") for f in trainyard_closure(ENTRY_POINTS, pipeline_repo)}
    assert imported <= got, sorted(imported - got)
    # The copies are the repository's root files, not MLflow's or a decoy.
    for rel in ("params.yaml", "models/model.onnx", "models/model.onnx.sha256"):
        assert (src / rel).read_bytes() == (pipeline_repo / rel).read_bytes(), rel
    # No shipped module imports the training stack, which the bento's environment lacks.
    shipped = sorted(src.rglob("*.py"))
    found = [hit for p in shipped for hit in training_imports(p.read_text(), str(p))]
    assert found == [], found
    info = yaml.safe_load((bento["path"] / "bento.yaml").read_text())
    assert info["service"] == "bento.service:ImageClassifier"
    assert info["name"] == BENTO_NAME
    readme = (bento["path"] / "README.md").read_text()
    assert "Fashion-MNIST" not in readme  # any dataset's model, not one in particular


def bentofile_spec() -> PathSpec:
    return PathSpec.from_lines("gitwildmatch", yaml.safe_load(BENTOFILE.read_text())["include"])


def test_bentofile_ships_the_serving_layers_and_no_training_import():
    """The include patterns, applied to this checkout as `bentoml build` applies them
    (gitwildmatch): the light layers whole, so every module the service and
    `python -m trainyard.bulk` import; none importing the training stack. The slow test
    above checks a real build; this one runs with every test run."""
    spec = bentofile_spec()
    shipped = sorted(f for f in repo_files() if f.endswith(".py") and spec.match_file(f))
    layers = {
        f.split("/")[2] for f in shipped if f.startswith("src/trainyard/") and f.count("/") > 2
    }
    assert layers == set(SHIPPED_LAYERS), shipped
    assert {"bento/service.py", "src/trainyard/__init__.py"} <= set(shipped)
    imported = trainyard_closure(ENTRY_POINTS)
    missing = sorted(imported - set(shipped))
    assert not missing, f"imported by the service or bulk scoring, not in the bento: {missing}"
    # Each shipped layer whole, as this checkout holds it (data/sources/ included).
    assert set(shipped) == {"bento/service.py"} | {f"src/{m}" for m in shipped_modules(REPO)}, (
        shipped
    )
    # An import in a `try` that handles ImportError is not followed: the service's registry
    # fetch (trainyard.track, MLflow) is optional, and absent from the bento.
    assert not any(f.startswith("src/trainyard/track/") for f in imported), sorted(imported)
    found = [hit for f in shipped for hit in training_imports((REPO / f).read_text(), f)]
    assert found == [], found
    # The checker finds an import hidden in a function too.
    assert training_imports("def f():\n    from mlflow import x\n", "t.py") == ["t.py:2: mlflow"]


@pytest.mark.slow
def test_bento_requirements_are_the_serving_stack_only(bento):
    py = bento["path"] / "env" / "python"
    files = [p for p in (py / "requirements.txt", py / "requirements.in") if p.is_file()]
    assert files, f"{py}: no requirements file"
    for path in files:
        names = requirement_names(path)
        assert not names & TRAINING_STACK, f"{path.name}: {sorted(names & TRAINING_STACK)}"
        assert names >= SERVING_STACK, f"{path.name} lacks {sorted(SERVING_STACK - names)}"


@pytest.mark.slow
def test_bento_from_a_clean_venv_answers_like_offline_onnx_runtime(
    bento, clean_venv, pipeline_repo, tmp_path_factory, record_property
):
    from PIL import Image

    from trainyard.core.card import load_card
    from trainyard.core.io import sha256_file
    from trainyard.runtime.inputs import decode_image, model_input
    from trainyard.runtime.sessions import load_onnx

    venv = clean_venv["root"]
    # Nothing of the training stack, and no trainyard: the service must get it from the bento.
    probe = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import importlib.util as u, sys; "
            "print(' '.join(m for m in sys.argv[1:] if u.find_spec(m)))",
            *["torch", "lightning", "mlflow", "dvc", "onnx", "trainyard", "onnxruntime"],
        ],
        env=clean_env(venv),
        cwd=venv.parent,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert probe.stdout.split() == ["onnxruntime"], probe.stdout

    outside = tmp_path_factory.mktemp("serve-cwd")
    for repo in (REPO, pipeline_repo):
        assert not outside.resolve().is_relative_to(repo.resolve())
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = outside / "serve.log"
    env = clean_env(venv, BENTOML_HOME=str(bento["home"]), TRAINYARD_API_KEY=API_KEY)
    cmd = [
        str(venv / "bin" / "bentoml"),
        "serve",
        f"{BENTO_NAME}:{bento['version']}",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    auth = {"Authorization": f"Bearer {API_KEY}"}

    # Real test images (PNG bytes), PER_CLASS of each class, and the offline reference:
    # the same bytes through trainyard's decode + normalisation, then ONNX Runtime.
    data = pipeline_repo / "data" / "prepared"
    card = load_card(data)
    images = np.load(data / "test_images.npy", mmap_mode="r")
    labels = np.load(data / "test_labels.npy", mmap_mode="r")
    picks = [
        int(i) for c in range(card.num_classes) for i in np.flatnonzero(labels == c)[:PER_CLASS]
    ]
    pngs = []
    for i in picks:
        img = np.asarray(images[i])  # [C,H,W] uint8
        pil = Image.fromarray(img[0] if img.shape[0] == 1 else img.transpose(1, 2, 0))
        buf = io.BytesIO()
        pil.save(buf, format="PNG")
        pngs.append(buf.getvalue())
    model_path = bento["path"] / "src" / "models" / "model.onnx"
    model = load_onnx(model_path, device="cpu")
    x = np.concatenate(
        [model_input(decode_image(b, card)[None].astype(np.float32), card) for b in pngs]
    )
    logits = model.run(x).astype(np.float64)
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    offline = e / e.sum(axis=1, keepdims=True)
    version = sha256_file(model_path)[:12]

    start = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, cwd=outside, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        if not wait_ready(url, proc, 120, lambda: tail(log.read_text())):
            pytest.fail(f"bentoml serve not ready within 120 s:\n{tail(log.read_text())}")
        ready_s = time.monotonic() - start

        # The probes and /metrics answer without the key, as the manifest's probes need.
        for path in ("/livez", "/healthz", "/readyz", "/metrics"):
            assert requests.get(f"{url}{path}", timeout=10).status_code == 200, path
        # So do the demo page and the API's description, from the bento's own files.
        page = requests.get(f"{url}/ui", timeout=10)
        assert page.status_code == 200 and "ui/ui.js" in page.text, page.text[:200]
        assert requests.get(f"{url}/ui/ui.js", timeout=10).status_code == 200
        spec = requests.get(f"{url}/docs.json", timeout=10).json()
        assert {"/classify", "/classify_batch", "/metadata"} <= set(spec["paths"])
        assert requests.get(f"{url}/docs", timeout=10).status_code == 200
        refused = requests.post(
            f"{url}/classify", files={"image": ("x.png", pngs[0], "image/png")}, timeout=30
        )
        assert refused.status_code == 401, refused.text
        meta = requests.get(f"{url}/metadata", headers=auth, timeout=10).json()
        # Served from the bento itself, not from the repository it was built in.
        assert Path(meta["model"]["path"]).resolve() == model_path.resolve()
        assert meta["classes"] == list(card.classes)
        # The model card evaluate wrote travels in the bento and is served at /card.
        assert meta["card"] == "/card"
        shipped = requests.get(f"{url}/card?format=json", headers=auth, timeout=10)
        assert shipped.status_code == 200, shipped.text
        assert shipped.json()["model"]["onnx_sha256"] == meta["model"]["sha256"]
        assert requests.get(f"{url}/card", headers=auth, timeout=10).text.startswith("# Model card")

        for n, (i, png) in enumerate(zip(picks, pngs, strict=True)):
            resp = requests.post(
                f"{url}/classify",
                files={"image": (f"test_{i}.png", png, "image/png")},
                headers=auth,
                timeout=30,
            )
            assert resp.status_code == 200, f"test image {i}: {resp.status_code} {resp.text}"
            pred = resp.json()
            best = int(offline[n].argmax())
            assert pred["class_id"] == best, f"test image {i}"
            assert pred["label"] == card.classes[best], f"test image {i}"
            assert np.allclose(pred["probabilities"], offline[n], atol=1e-5, rtol=0), (
                f"test image {i}: {pred['probabilities']} vs {offline[n].tolist()}"
            )
            assert pred["model_version"] == version
        # BentoML's own client knows the endpoints by name (they are @bentoml.api methods).
        upload = outside / "first.png"
        upload.write_bytes(pngs[0])
        with bentoml.SyncHTTPClient(url, token=API_KEY) as client:
            answer = client.classify(image=upload)
        assert np.allclose(answer["probabilities"], offline[0], atol=1e-5, rtol=0)
        metrics = requests.get(f"{url}/metrics", timeout=10).text
        assert "trainyard_predictions" in metrics
    finally:
        if not stop_group(proc, timeout=30):
            pytest.fail(f"bentoml serve ignored SIGTERM for 30 s:\n{tail(log.read_text())}")
    # The workers (own sessions under BentoML's supervisor) let go of the port too.
    end = time.monotonic() + 15
    while not port_closed(port) and time.monotonic() < end:
        time.sleep(0.25)
    assert port_closed(port), f"port {port} still answers after the server stopped"

    timings = {
        "build_s": round(bento["build_s"], 1),
        "clean_venv_install_s": round(clean_venv["install_s"], 1),
        "serve_ready_s": round(ready_s, 1),
    }
    for key, value in timings.items():
        record_property(key, value)
    print(f"bento timings: {timings}; {len(picks)} images compared")


BULK_PER_CLASS = 6  # real test images per class in the bulk job's folder


def job_argv(container: dict, index: int, paths: dict[str, str]) -> list[str]:
    """What a Job's container runs as pod ``index``: command + args after Kubernetes'
    $(VAR) expansion, with the image's paths replaced by ``paths`` (prefix -> local)."""
    argv = []
    for arg in container_argv(container, index):
        for image_path, local in paths.items():
            if arg == image_path or arg.startswith(image_path + "/"):
                arg = local + arg[len(image_path) :]
                break
        argv.append(arg)
    return argv


@pytest.mark.slow
def test_bento_scores_in_shards_like_one_run_from_a_clean_venv(
    bento, clean_venv, pipeline_repo, tmp_path_factory, record_property
):
    """What deploy/predict-job.yaml's pods and deploy/predict-merge.yaml's pod run, from the
    bento's own files in the clean environment made from its requirements (the image's):
    shards 0/2 and 1/2 as two concurrent processes, then the merge. The merged table must
    be the table that one run (--shard 0/1) over the whole folder writes."""
    import pyarrow.parquet as pq
    from PIL import Image

    from trainyard.core.card import load_card

    venv, src = clean_venv["root"], bento["path"] / "src"
    work = tmp_path_factory.mktemp("bulk-job")
    folder = work / "in"
    # Real test images as PNG files under their class's folder (the rows get true_label;
    # "T-shirt/top" cannot name a folder), and one file that is not an image: an error row.
    data = pipeline_repo / "data" / "prepared"
    card = load_card(data)
    images = np.load(data / "test_images.npy", mmap_mode="r")
    labels = np.load(data / "test_labels.npy", mmap_mode="r")
    names = []
    for c, name in enumerate(card.classes):
        if "/" in name:
            continue
        (folder / name).mkdir(parents=True)
        for i in np.flatnonzero(labels == c)[:BULK_PER_CLASS]:
            img = np.asarray(images[i])
            pil = Image.fromarray(img[0] if img.shape[0] == 1 else img.transpose(1, 2, 0))
            pil.save(folder / name / f"test_{i}.png")
            names.append(f"{name}/test_{i}.png")
    broken = f"{next(c for c in card.classes if '/' not in c)}/broken.png"
    (folder / broken).write_bytes(b"not an image")
    names = sorted([*names, broken])
    assert len(names) % 2 == 1  # the shards differ in size

    score_job, merge_job = job_docs()
    (score,) = score_job["spec"]["template"]["spec"]["containers"]
    (merge,) = merge_job["spec"]["template"]["spec"]["containers"]
    python = str(venv / "bin" / "python")
    env = clean_env(venv, **{e["name"]: e["value"] for e in score["env"] if "value" in e})

    def shard_argv(index: int, count: int, out: Path) -> list[str]:
        argv = job_argv(score, index, {IMAGE_SRC: str(src), "/data/in": str(folder)})
        argv = [python if a == "python" else a for a in argv]
        at = argv.index("--shard") + 1
        argv[at] = argv[at].replace(f"/{score_job['spec']['completions']}", f"/{count}")
        assert argv[at] == f"{index}/{count}", argv
        at = argv.index("--out") + 1
        argv[at] = str(out / Path(argv[at]).name)
        # Small chunks: several per shard, as a large folder has.
        return [*argv, "--chunk-rows", "16"]

    def run(argv: list[str]) -> subprocess.Popen:
        return subprocess.Popen(
            argv,
            cwd=score["workingDir"].replace(IMAGE_SRC, str(src)),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def finish(proc: subprocess.Popen) -> str:
        out = proc.communicate(timeout=300)[0]
        assert proc.returncode == 0, f"{shlex.join(proc.args)} exited {proc.returncode}:\n{out}"
        return out

    start = time.monotonic()
    sharded, single = work / "out", work / "single"
    sharded.mkdir()
    single.mkdir()
    procs = [run(shard_argv(k, 2, sharded)) for k in range(2)]  # at the same time
    for proc in procs:
        finish(proc)
    parts = [sharded / "part-0.parquet", sharded / "part-1.parquet"]
    argv = job_argv(merge, 0, {IMAGE_SRC: str(src), "/data/out": str(sharded)})
    argv = [python if a == "python" else a for a in argv]
    at = argv.index("--out")
    listed = argv[4:at]
    assert listed == [str(sharded / f"part-{k}.parquet") for k in range(len(listed))]
    merged = Path(argv[at + 1])
    finish(run([*argv[:4], *map(str, parts), *argv[at:]]))
    finish(run(shard_argv(0, 1, single)))
    seconds = time.monotonic() - start

    one = pq.read_table(single / "part-0.parquet")
    both = pq.read_table(merged)
    assert one.column("path").to_pylist() == names
    assert both.schema == one.schema and "true_label" in one.column_names
    assert both.num_rows == one.num_rows == len(names)
    for column in one.column_names:
        assert both.column(column).to_pylist() == one.column(column).to_pylist(), column
    bad = one.column("path").to_pylist().index(broken)
    assert one.column("error")[bad].as_py() and one.column("label")[bad].as_py() is None
    half = len(names) // 2  # shard_range: contiguous, [0, total*1//2) and the rest
    for part, rows in zip(parts, (half, len(names) - half), strict=True):
        assert pq.read_table(part).num_rows == rows
    summaries = [json.loads(p.with_name(p.stem + ".summary.json").read_text()) for p in parts]
    assert [s["shard"] for s in summaries] == [
        {"index": 0, "count": 2, "rows": [0, half]},
        {"index": 1, "count": 2, "rows": [half, len(names)]},
    ]
    whole = json.loads((single / "part-0.summary.json").read_text())
    joined = json.loads(merged.with_name(merged.stem + ".summary.json").read_text())
    same = ("source", "model", "top_k", "min_confidence", "rows", "scored", "predicted")
    same += ("low_confidence", "bad_files", "bad", "labels")
    for key in same:
        assert joined[key] == whole[key], key
    assert joined["bad_files"] == 1 and joined["labels"]["labelled"] == len(names) - 1
    record_property("bulk_job_s", round(seconds, 1))
    print(f"bulk job: 2 shards + merge + 1 whole run in {seconds:.1f} s, {len(names)} rows")


# ---------------------------------------------------------------------------- Kubernetes


def manifest() -> dict[str, dict]:
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    kinds = [d["kind"] for d in docs]
    assert sorted(kinds) == ["Deployment", "Service"], kinds
    return {d["kind"]: d for d in docs}


def cpu(q: str | int | float) -> float:
    q = str(q)
    return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


def memory(q: str | int) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "K": 1e3, "M": 1e6, "G": 1e9}
    q = str(q)
    for suffix, factor in units.items():
        if q.endswith(suffix):
            return float(q[: -len(suffix)]) * factor
    return float(q)


def test_kubernetes_manifest_deploys_the_bento_with_probes_secret_resources_non_root():
    docs = manifest()
    dep, svc = docs["Deployment"], docs["Service"]
    assert dep["apiVersion"] == "apps/v1" and svc["apiVersion"] == "v1"
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"].startswith(f"{BENTO_NAME}:")  # placeholder tag, see the file

    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 3000}

    def probe_target(name: str) -> tuple[str, int]:
        get = container[name]["httpGet"]
        port = get["port"]
        return get["path"], ports.get(port, port)

    assert probe_target("readinessProbe") == ("/readyz", 3000)
    assert probe_target("livenessProbe") == ("/livez", 3000)

    env = {e["name"]: e for e in container["env"]}
    assert env["TRAINYARD_API_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "trainyard-api-key",
        "key": "api-key",
    }
    assert env["BENTOML_DO_NOT_TRACK"]["value"] == "true"  # a string, as env values must be
    assert "TRAINYARD_MODEL" not in env  # the image serves its own model (no MLflow in it)

    res = container["resources"]
    for kind in ("cpu", "memory"):
        assert kind in res["requests"] and kind in res["limits"], kind
    assert cpu(res["requests"]["cpu"]) <= cpu(res["limits"]["cpu"])
    assert memory(res["requests"]["memory"]) <= memory(res["limits"]["memory"])
    # Room for the supervisor and one worker per CPU of the limit (~140 MiB each, measured).
    assert memory(res["limits"]["memory"]) >= (120 + 140 * cpu(res["limits"]["cpu"])) * 2**20

    pod_sc, sc = pod["securityContext"], container["securityContext"]
    assert pod_sc["runAsNonRoot"] is True and pod_sc["runAsUser"] != 0
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]

    assert svc["spec"]["selector"].items() <= pod_labels.items()
    (svc_port,) = svc["spec"]["ports"]
    target = svc_port["targetPort"]
    assert ports.get(target, target) == 3000


def test_kubernetes_manifest_is_valid_by_the_kubernetes_schema():
    import kubernetes_validate as kv  # a dev dependency: the Kubernetes JSON schemas

    docs = manifest()
    for version in ("1.29.0", kv.latest_version()):
        for doc in docs.values():
            kv.validate(doc, version, strict=True)
    # Strict mode does catch a misspelt field (so passing above means something).
    bad = copy.deepcopy(docs["Deployment"])
    container = bad["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, kv.latest_version(), strict=True)


# ------------------------------------------------------- Kubernetes: bulk scoring Jobs

INDEX_VAR = "JOB_COMPLETION_INDEX"
INDEX_FIELD = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
# Kubernetes' $(VAR) in command and args ($$ is a literal $).
K8S_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def job_docs() -> tuple[dict, dict]:
    """(the Indexed Job that scores, the Job that merges)."""
    (score,) = [d for d in yaml.safe_load_all(PREDICT_JOB.read_text()) if d]
    (merge,) = [d for d in yaml.safe_load_all(PREDICT_MERGE.read_text()) if d]
    return score, merge


def k8s_expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion of a command or args entry: $(VAR) of a variable declared in
    the container's env becomes its value; an undeclared one stays as written."""
    return K8S_VAR.sub(
        lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text
    )


def container_argv(container: dict, index: int) -> list[str]:
    """command + args as the kubelet runs them in pod ``index`` of an Indexed Job: env
    values, and the completion index where the downward API gives it."""
    env = {}
    for var in container.get("env", []):
        field = var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        env[var["name"]] = str(index) if field == INDEX_FIELD else var.get("value", "")
    return [k8s_expand(a, env) for a in [*container["command"], *container.get("args", [])]]


def check_hardened_pod(pod: dict, container: dict) -> None:
    """What the service's Deployment has: no API token, non-root, no privilege escalation,
    no capabilities, requests and limits for CPU and memory; a Job's pod is not restarted
    in place (a failed pod is replaced)."""
    service_pod = manifest()["Deployment"]["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["restartPolicy"] == "Never"
    pod_sc, sc = pod["securityContext"], container["securityContext"]
    assert pod_sc["runAsNonRoot"] is True and pod_sc["runAsUser"] != 0
    assert pod_sc["runAsUser"] == service_pod["securityContext"]["runAsUser"]  # bentoml
    assert pod_sc["fsGroup"] == pod_sc["runAsGroup"]  # the output claim is writable
    assert sc["allowPrivilegeEscalation"] is False and sc.get("privileged") is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    res = container["resources"]
    for kind in ("cpu", "memory"):
        assert kind in res["requests"] and kind in res["limits"], kind
    assert cpu(res["requests"]["cpu"]) <= cpu(res["limits"]["cpu"])
    assert memory(res["requests"]["memory"]) <= memory(res["limits"]["memory"])
    (service,) = service_pod["containers"]
    assert container["image"] == service["image"]  # the bento's image, same placeholder
    assert container["image"].startswith(f"{BENTO_NAME}:")
    # The bento's files: `python -m trainyard.bulk` imports trainyard from there.
    assert container["workingDir"] == IMAGE_SRC
    assert container["command"][:3] == ["python", "-m", "trainyard.bulk"]
    assert bentofile_spec().match_file("src/trainyard/bulk/__main__.py")


def in_bento(path: str) -> str:
    """An image path under the bento's src/ as the repository file the bentofile ships
    there (asserting it does)."""
    assert path.startswith(IMAGE_SRC + "/"), path
    rel = path.removeprefix(IMAGE_SRC + "/")
    assert bentofile_spec().match_file(rel), f"{path}: bento/bentofile.yaml does not ship {rel}"
    return rel


def test_image_bento_path_is_bentomls():
    """IMAGE_SRC: where BentoML's generated Dockerfile copies the bento (WORKDIR)."""
    from bentoml._internal.container import generate  # the only statement of it

    assert generate.BENTO_PATH == IMAGE_BENTO


def test_predict_job_is_an_indexed_job_of_n_shards_with_the_bento_model():
    from trainyard.bulk import command_line
    from trainyard.bulk.listing import parse_shard

    score, _ = job_docs()
    assert score["apiVersion"] == "batch/v1" and score["kind"] == "Job"
    spec = score["spec"]
    assert spec["completionMode"] == "Indexed"
    n = spec["completions"]
    assert n > 1 and spec["parallelism"] == n
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    check_hardened_pod(pod, container)

    # The index reaches the arguments: JOB_COMPLETION_INDEX is declared (downward API), so
    # the kubelet expands $(JOB_COMPLETION_INDEX); an undeclared variable would stay as the
    # literal text "$(...)" and every pod would score the same (or no) shard.
    env = {e["name"]: e for e in container["env"]}
    assert env[INDEX_VAR]["valueFrom"]["fieldRef"]["fieldPath"] == INDEX_FIELD
    raw = [*container["command"], *container["args"]]
    used = {m.group(1) for a in raw for m in K8S_VAR.finditer(a) if m.group(1)}
    assert used == {INDEX_VAR} and used <= set(env), used
    assert container_argv({"command": ["$(X)/$(Y)"], "env": [{"name": "X", "value": "1"}]}, 0) == [
        "1/$(Y)"
    ]

    parser = command_line.add_predict_arguments(argparse.ArgumentParser())
    runs = []
    for k in range(n):
        argv = container_argv(container, k)
        assert argv[:3] == ["python", "-m", "trainyard.bulk"] and "$(" not in shlex.join(argv)
        runs.append(parser.parse_args(argv[3:]))
    # Pod k scores the k-th of n slices, into its own part; every pod the same folder.
    assert [parse_shard(a.shard) for a in runs] == [(k, n) for k in range(n)]
    assert [a.out for a in runs] == [f"/data/out/part-{k}.parquet" for k in range(n)]
    assert {a.source for a in runs} == {"/data/in"}
    assert len({(a.model, a.params, a.workers, a.device) for a in runs}) == 1
    first = runs[0]
    # The model and params baked into the bento (the model's .sha256 is checked beside it).
    assert in_bento(first.model) == "models/model.onnx"
    in_bento(first.model + ".sha256")
    assert in_bento(first.params) == "params.yaml"
    # Decode processes = the CPU limit (workers auto would count the node's cores).
    limits = container["resources"]["limits"]
    assert int(first.workers) == cpu(limits["cpu"])
    # Room for what was measured with 2 decode processes (~280 MiB summed RSS), twice over.
    assert memory(limits["memory"]) >= 2 * 280 * 2**20
    assert first.device == "cpu"  # the bento's onnxruntime is the CPU build

    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    claims = {v["name"]: v["persistentVolumeClaim"] for v in pod["volumes"]}
    assert set(mounts) == {"/data/in", "/data/out"}
    assert mounts["/data/in"]["readOnly"] is True
    assert claims[mounts["/data/in"]["name"]]["readOnly"] is True
    assert not mounts["/data/out"].get("readOnly")
    assert all(c["claimName"] for c in claims.values())


def test_predict_merge_job_merges_the_n_parts_of_the_indexed_job():
    from trainyard.bulk import command_line

    score, merge = job_docs()
    n = score["spec"]["completions"]
    assert merge["apiVersion"] == "batch/v1" and merge["kind"] == "Job"
    assert merge["spec"].get("completionMode", "NonIndexed") == "NonIndexed"
    assert merge["spec"]["completions"] == 1
    pod = merge["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    check_hardened_pod(pod, container)
    argv = container_argv(container, 0)
    assert argv[:4] == ["python", "-m", "trainyard.bulk", "merge"]
    args = command_line.add_merge_arguments(argparse.ArgumentParser()).parse_args(argv[4:])
    (scorer,) = score["spec"]["template"]["spec"]["containers"]
    parts = [f"/data/out/part-{k}.parquet" for k in range(n)]
    assert [str(p) for p in args.shards] == parts  # every part, each once
    assert str(args.out).startswith("/data/out/") and str(args.out) not in parts
    # The same claim, at the same path, as the scoring pods' output.
    mount = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    scoring = score["spec"]["template"]["spec"]
    scoring_mount = {m["mountPath"]: m["name"] for m in scorer["volumeMounts"]}

    def claim(spec: dict, name: str) -> str:
        (vol,) = [v for v in spec["volumes"] if v["name"] == name]
        return vol["persistentVolumeClaim"]["claimName"]

    assert claim(pod, mount["/data/out"]) == claim(scoring, scoring_mount["/data/out"])


def test_predict_jobs_are_valid_by_the_kubernetes_schema():
    import kubernetes_validate as kv

    docs = job_docs()
    for version in ("1.29.0", kv.latest_version()):
        for doc in docs:
            kv.validate(doc, version, strict=True)
    bad = copy.deepcopy(docs[0])
    bad["spec"]["completionsMode"] = bad["spec"].pop("completionMode")
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, kv.latest_version(), strict=True)
