"""Every trainyard module a stage runs is one of its DVC deps.

A module missing from a stage's deps is code DVC does not watch: change it and `dvc repro`
calls the stage up to date and keeps outputs the new code would not make (a stale
dvc.lock that a teammate's `dvc pull` then trusts). The imports are read from the source
(every import, also those inside functions, which run lazily), not from one run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

from conftest import REPO

SRC = REPO / "src"


def module_file(name: str) -> Path | None:
    path = SRC.joinpath(*name.split("."))
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    return path.with_suffix(".py") if path.with_suffix(".py").is_file() else None


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:` (never run)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def trainyard_imports(path: Path, package: str) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_only(tree)
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from .x import y
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # `from trainyard.x import y` loads trainyard.x, and trainyard.x.y if a module
            names |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    found = set()
    for name in names:
        parts = name.split(".")
        if parts[0] != "trainyard":
            continue
        # importing trainyard.a.b runs trainyard/__init__ and trainyard/a/__init__ first
        found |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    return {name for name in found if module_file(name)}


def modules_run_by(script: Path) -> set[Path]:
    todo, seen = trainyard_imports(script, ""), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = module_file(name)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        todo |= trainyard_imports(path, package) - seen
    return {module_file(name).relative_to(REPO) for name in seen}


def stage_deps(stage: dict) -> list[Path]:
    return [Path(dep) for dep in stage["deps"] if isinstance(dep, str) and "${" not in dep]


# A foreach stage (predict: one per predict.sources entry) is checked through its template.
STAGES = {
    name: stage.get("do", stage)
    for name, stage in yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"].items()
}


@pytest.mark.parametrize("name", list(STAGES))
def test_every_trainyard_module_a_stage_runs_is_a_dep(name):
    stage = STAGES[name]
    script = SRC / "trainyard" / "stages" / f"{name}.py"
    assert f"python -m trainyard.stages.{name} " in stage["cmd"]
    deps = stage_deps(stage)
    assert Path(f"src/trainyard/stages/{name}.py") in deps
    undeclared = sorted(
        str(module)
        for module in modules_run_by(script)
        if not any(module == dep or dep in module.parents for dep in deps)
    )
    assert undeclared == [], f"stage {name!r} runs these but does not list them in deps"


def test_the_import_reader_follows_lazy_relative_and_package_imports(tmp_path):
    """The reader itself: a check that found nothing would pass by finding nothing."""
    script = tmp_path / "stage.py"
    script.write_text(
        "from typing import TYPE_CHECKING\n"
        "from trainyard.stages.runner import stage_main\n"
        "if TYPE_CHECKING:\n"
        "    from trainyard.training import fit\n"
        "def body():\n"
        "    from trainyard.data.sources import fashion_fetch\n"
    )
    found = {str(p) for p in modules_run_by(script)}
    assert "src/trainyard/stages/runner.py" in found and "src/trainyard/__init__.py" in found
    assert "src/trainyard/data/sources/fashion_fetch.py" in found  # lazy, inside a function
    assert "src/trainyard/data/sources/__init__.py" in found  # the package runs first
    assert "src/trainyard/core/errors.py" in found  # through stages.common's own imports
    assert not any("train/" in p for p in found)  # TYPE_CHECKING only
