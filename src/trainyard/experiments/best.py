"""The study's best trial as a pipeline run: its -S overrides in a file, and a queued DVC
experiment that runs the whole pipeline (fetch .. evaluate) with them."""

from __future__ import annotations

import logging
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from trainyard.core.io import atomic_write_text

log = logging.getLogger(__name__)

BEST_FILE = Path("reports/tune-best.yaml")


def yaml_value(value: Any) -> str:
    """``value`` as DVC's ``-S key=value`` text, read back exactly by YAML 1.1 (PyYAML,
    which reads params.yaml) and 1.2 (DVC): floats in full (repr), with a ``.0`` before an
    exponent (PyYAML reads ``1e-05`` as a string), other values as YAML flow text."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    if isinstance(value, float):
        if not math.isfinite(value):
            return {math.inf: ".inf", -math.inf: "-.inf"}.get(value, ".nan")
        text = repr(value)
        mantissa, e, exponent = text.partition("e")
        if e and "." not in mantissa:
            text = f"{mantissa}.0e{exponent}"
        return text
    if isinstance(value, int):
        return str(value)
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    return text.removesuffix("\n...").strip()


def override_args(overrides: dict[str, Any]) -> list[str]:
    """``["-S", "key=value", ...]`` for dvc exp run."""
    args: list[str] = []
    for key, value in overrides.items():
        args += ["-S", f"{key}={yaml_value(value)}"]
    return args


@dataclass(frozen=True)
class Best:
    """The study's best trial and the overrides that rerun it as a pipeline experiment:
    the tune command's own -S (other than tune.*) and the trial's sampled params."""

    study: str
    number: int
    value: float
    params: dict[str, Any]
    base_overrides: dict[str, Any]
    storage: str

    @property
    def overrides(self) -> dict[str, Any]:
        return self.base_overrides | self.params

    @property
    def exp_name(self) -> str:
        return f"{self.study}-best-{self.number}"

    def command(self, queue: bool = False) -> str:
        args = ["dvc", "exp", "run", *(["--queue"] if queue else []), "-n", self.exp_name]
        return " ".join(_quote(a) for a in args + override_args(self.overrides))

    def write(self, root: str | os.PathLike[str] = ".") -> Path:
        """``reports/tune-best.yaml`` (atomically): the trial, its params and the -S list."""
        path = Path(root) / BEST_FILE
        doc = {
            "study": self.study,
            "storage": self.storage,
            "trial": self.number,
            "val_acc": self.value,
            "params": self.params,
            "overrides": [f"{k}={yaml_value(v)}" for k, v in self.overrides.items()],
            "command": self.command(),
        }
        head = (
            f"# trainyard tune: the best trial of study {self.study} "
            f"({time.strftime('%Y-%m-%d %H:%M:%S')}).\n"
            "# overrides: dvc exp run -S each one (the tune command's own -S included).\n"
        )
        atomic_write_text(path, head + yaml.safe_dump(doc, sort_keys=False, width=10**6))
        return path


def _quote(arg: str) -> str:
    safe = all(c.isalnum() or c in "-_.=/:,+" for c in arg)
    return arg if safe and arg else "'" + arg.replace("'", "'\\''") + "'"


def dvc_executable() -> str | None:
    """This environment's dvc (beside the running Python), else the one on PATH."""
    local = Path(sys.executable).parent / "dvc"
    return str(local) if local.is_file() else shutil.which("dvc")


def queue(best: Best, root: str | os.PathLike[str] = ".") -> str:
    """Queue the best trial as a DVC experiment; returns the line that says what happened
    (queued, already there, or why not)."""
    root = Path(root)
    dvc = dvc_executable()
    if not (root / ".dvc").is_dir() or not (root / ".git").exists():
        return f"not queued: {root.resolve()} is not a DVC repository in git (no .dvc/ or .git)"
    if dvc is None:
        return "not queued: dvc is not installed here"
    if best.exp_name in known_experiments(dvc, root):
        return f"DVC experiment {best.exp_name} is already queued or run (dvc queue status)"
    proc = _dvc(
        dvc, root, "exp", "run", "--queue", "-n", best.exp_name, *override_args(best.overrides)
    )
    said = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
    if proc.returncode == 0:
        return f"queued DVC experiment {best.exp_name}: run it with `dvc queue start`"
    return f"not queued: dvc exp run --queue failed: {said[-1] if said else proc.returncode}"


def _dvc(dvc: str, root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([dvc, *args], cwd=root, capture_output=True, text=True, timeout=300)


def known_experiments(dvc: str, root: Path) -> set[str]:
    """Names of the repository's experiments: in the queue (queued, running, done and not
    yet cleaned) and applied ones. DVC queues a second experiment of the same name, so a
    rerun of a study whose best trial did not change would queue it twice."""
    names: set[str] = set()
    status = _dvc(dvc, root, "queue", "status")
    for line in status.stdout.splitlines()[1:]:
        cols = line.split()
        if len(cols) >= 2:
            names.add(cols[1])
    listed = _dvc(dvc, root, "exp", "list", "--all-commits", "--name-only")
    names.update(line.strip() for line in listed.stdout.splitlines() if line.strip())
    return names
