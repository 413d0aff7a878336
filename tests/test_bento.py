"""The deployable bento and the Kubernetes manifest, as a deployment would meet them.

Slow: a small real pipeline exports a model; `bentoml build` packs it with
serving/bentofile.yaml; the bento must hold exactly the service, trainyard's serving layers
(core, runtime, serve), the root params.yaml and the verified model, and neither import nor
require the training stack. A clean virtual environment made from the bento's
env/python/requirements.txt alone (what the image installs) then serves the bento from a
folder outside the repository, and its HTTP answers on real test images must equal offline
ONNX Runtime through trainyard's own preprocessing.

Not slow: the bentofile's include patterns on this checkout; deploy/kubernetes.yaml parsed
and checked (kinds, probes, secret, resources, non-root), and against the Kubernetes JSON
schemas (kubernetes-validate, strict).
"""

from __future__ import annotations

import ast
import copy
import io
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import bentoml
import numpy as np
import pytest
import requests
import yaml
from pathspec import PathSpec

from conftest import REPO, VENV_BIN, dvc, repo_files, small_pipeline_repo, stage_env, stop_group

BENTO_NAME = "trainyard_classifier"
MANIFEST = REPO / "deploy" / "kubernetes.yaml"
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
SERVING_STACK = {"bentoml", "onnxruntime", "numpy", "pillow", "pillow-heif", "pydantic", "pyyaml"}
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
# The layers serving imports (tests/test_layers.py: serve -> core, runtime), under src/.
SHIPPED_LAYERS = ("core", "runtime", "serve")
BENTOFILE = REPO / "serving" / "bentofile.yaml"
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
def pipeline_repo(fashion_dir, tmp_path_factory) -> Path:
    """A repository copy after a real `dvc repro export` (3,000-image slice, 1 epoch), plus
    decoys that a loose include pattern would pick up."""
    repo = small_pipeline_repo(tmp_path_factory.mktemp("bento-pipeline") / "trainyard", fashion_dir)
    dvc(repo, "repro", "export")
    run = repo / "mlruns" / "0" / "decoy-run" / "artifacts"
    for rel, data in {
        "config/params.yaml": (repo / "params.yaml").read_bytes(),  # MLflow's copy
        "model/model.onnx": (repo / "models/model.onnx").read_bytes(),
        "model/model.onnx.sha256": (repo / "models/model.onnx.sha256").read_bytes(),
    }.items():
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_bytes(data)
    for rel in ("serving/__pycache__/service.cpython-311.pyc", "src/trainyard/stray.pyc"):
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_bytes(b"\0")
    (repo / "data" / "params.yaml").write_text("seed: 0\n")
    return repo


@pytest.fixture(scope="module")
def bento(pipeline_repo, tmp_path_factory) -> dict[str, Any]:
    """`bentoml build -f serving/bentofile.yaml .` into a fresh BENTOML_HOME."""
    home = tmp_path_factory.mktemp("bentoml-home")
    env = stage_env(BENTOML_HOME=str(home), BENTOML_DO_NOT_TRACK="true")
    start = time.monotonic()
    proc = subprocess.run(
        [str(VENV_BIN / "bentoml"), "build", "-f", "serving/bentofile.yaml", ".", "-o", "tag"],
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


@pytest.mark.slow
def test_bento_holds_only_the_service_its_modules_params_and_the_verified_model(
    bento, pipeline_repo
):
    src = bento["path"] / "src"
    got = {p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file()}
    package = pipeline_repo / "src"
    modules = {"trainyard/__init__.py"} | {
        p.relative_to(package).as_posix()
        for layer in SHIPPED_LAYERS
        for p in (package / "trainyard" / layer).glob("*.py")
    }
    assert "trainyard/serve/predictor.py" in modules and "trainyard/core/config.py" in modules
    expected = {
        "bentofile.yaml",  # BentoML's own copy of the build file
        "serving/service.py",
        "params.yaml",
        "models/model.onnx",
        "models/model.onnx.sha256",
        *modules,
        # the demo page at /ui (trainyard.serve.ui), served from the package's files
        "trainyard/serve/ui/index.html",
        "trainyard/serve/ui/ui.js",
        "trainyard/serve/ui/ui.css",
    }
    assert got == expected, (
        f"unexpected in the bento: {sorted(got - expected)}; missing: {sorted(expected - got)}"
    )
    # The copies are the repository's root files, not MLflow's or a decoy.
    for rel in ("params.yaml", "models/model.onnx", "models/model.onnx.sha256"):
        assert (src / rel).read_bytes() == (pipeline_repo / rel).read_bytes(), rel
    # No shipped module imports the training stack, which the bento's environment lacks.
    shipped = sorted(src.rglob("*.py"))
    found = [hit for p in shipped for hit in training_imports(p.read_text(), str(p))]
    assert found == [], found
    info = yaml.safe_load((bento["path"] / "bento.yaml").read_text())
    assert info["service"] == "serving.service:ImageClassifier"
    assert info["name"] == BENTO_NAME
    readme = (bento["path"] / "README.md").read_text()
    assert "Fashion-MNIST" not in readme  # any dataset's model, not one in particular


def test_bentofile_ships_the_serving_layers_and_no_training_import():
    """The include patterns, applied to this checkout as `bentoml build` applies them
    (gitwildmatch): the serving layers' modules, none importing the training stack. The
    slow test above checks a real build; this one runs with every test run."""
    include = yaml.safe_load(BENTOFILE.read_text())["include"]
    spec = PathSpec.from_lines("gitwildmatch", include)
    shipped = sorted(f for f in repo_files() if f.endswith(".py") and spec.match_file(f))
    layers = {
        f.split("/")[2] for f in shipped if f.startswith("src/trainyard/") and f.count("/") > 2
    }
    assert layers == set(SHIPPED_LAYERS), shipped
    assert {"serving/service.py", "src/trainyard/__init__.py"} <= set(shipped)
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
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"bentoml serve exited {proc.returncode}:\n{tail(log.read_text())}")
            try:
                if requests.get(f"{url}/readyz", timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"bentoml serve not ready within 120 s:\n{tail(log.read_text())}")
            time.sleep(0.25)
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
