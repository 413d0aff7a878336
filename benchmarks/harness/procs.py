"""The processes a benchmark starts: timed, their output kept for the error message, in an
environment that finds this venv's commands; and clones of the committed repository, in
which the pipeline benchmarks run ``dvc`` so the user's checkout is never touched."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from benchmarks.harness.stopwatch import Timer


def child_env() -> dict[str, str]:
    """This environment, unbuffered, with this Python's bin first on PATH (dvc, bentoml);
    without a tracking URI (a clone keeps its own MLflow store) or pytest's marker (which
    turns on MLflow's test-only checks)."""
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_timed(
    cmd: list[str], cwd: Path | None = None, env: dict[str, str] | None = None, what: str = ""
) -> tuple[float, subprocess.CompletedProcess[str]]:
    """Run ``cmd`` to its end, output captured: (its wall seconds, the finished process).
    A failure stops the benchmark with the tail of its output."""
    with Timer() as clock:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        out = proc.stdout + proc.stderr
        raise SystemExit(f"{what or ' '.join(cmd)} failed ({proc.returncode}):\n{out[-4000:]}")
    return clock.seconds, proc


def python_child(
    module: str, *args: str, cwd: Path | None = None, what: str = ""
) -> tuple[float, Any]:
    """``python -m module ARGS`` (a benchmark's own child: a fresh process, its own rusage
    and imports): (seconds, the JSON of its last line of output)."""
    seconds, proc = run_timed([sys.executable, "-m", module, *args], cwd=cwd, what=what or module)
    return seconds, json.loads(proc.stdout.strip().splitlines()[-1])


def clone(source: Path, dest: Path, params: dict[str, dict[str, Any]] | None = None) -> Path:
    """A clone of ``source``'s committed files at ``dest``, with ``params`` ({section:
    {key: value}}) set in its params.yaml."""
    subprocess.run(["git", "clone", "-q", str(source), str(dest)], check=True)
    if params:
        path = dest / "params.yaml"
        doc = yaml.safe_load(path.read_text())
        for section, values in params.items():
            doc[section].update(values)
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return dest
