"""The import rule (docs/architecture.md): a layer imports only the layers below it.

Read from the source with ast, every import included (those under TYPE_CHECKING too: a type
from a higher layer is still a dependency on it). A light layer (core, runtime, serve) also
never imports a heavy library, so the service and its bento stay free of torch, Lightning,
MLflow and DVC; and no module hides an import inside a function body except a probe (an
import inside ``try`` that handles its failure, as the doctor does to report a broken build).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import REPO

PACKAGE = REPO / "src" / "trainyard"

# layer -> the layers it may import (its own always allowed). Top-level modules (the
# ``trainyard`` command, presets) may import anything; every layer may read __version__.
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "data": {"core"},
    "runtime": {"core"},
    "model": {"core"},
    "track": {"core", "runtime"},
    "train": {"core", "data", "model", "track"},
    "export": {"core", "data", "model", "runtime"},
    "serve": {"core", "runtime"},
    "stages": {"core", "data", "model", "runtime", "track", "train", "export"},
    "doctor": {"core", "data", "model", "runtime", "track", "train", "export", "serve"},
    "experiments": {"core", "data", "model", "runtime", "track", "train", "export", "stages"},
}
HEAVY = {"torch", "torchvision", "lightning", "mlflow", "dvc", "onnx", "matplotlib"}
# The libraries each light layer must not import (onnxruntime is the runtime's own).
FORBIDDEN: dict[str, set[str]] = {
    "core": HEAVY | {"onnxruntime", "bentoml", "starlette"},
    "runtime": HEAVY | {"bentoml", "starlette"},
    "serve": HEAVY,
    "data": {"mlflow", "dvc", "onnx", "onnxruntime", "bentoml"},
    "model": {"mlflow", "dvc", "onnxruntime", "bentoml"},
}


def layer_of(path: Path) -> str | None:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else None


def _imported(node: ast.Import | ast.ImportFrom, package: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:  # relative: resolve against the module's package
        parts = package.split(".")[: len(package.split(".")) - node.level + 1]
        return [".".join(parts + ([node.module] if node.module else []))]
    return [node.module or ""]


def _is_probe(node: ast.AST, parents: dict[int, ast.AST]) -> bool:
    """An import inside ``try:`` whose handler catches its failure (a deliberate probe)."""
    while id(node) in parents:
        parent = parents[id(node)]
        if isinstance(parent, ast.Try) and node in parent.body and parent.handlers:
            return True
        node = parent
    return False


def violations(path: Path, source: str | None = None) -> list[str]:
    """What in ``path`` breaks the import rule, as readable lines (empty: none)."""
    layer = layer_of(path)
    rel = path.relative_to(PACKAGE.parent)
    package = ".".join(rel.with_suffix("").parts[:-1])
    tree = ast.parse(source if source is not None else path.read_text(), str(path))
    parents = {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    in_function = {
        id(n)
        for fn in ast.walk(tree)
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
        for n in ast.walk(fn)
    }
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        for name in _imported(node, package):
            parts = name.split(".")
            where = f"{rel}:{node.lineno}: {name}"
            hidden = id(node) in in_function and not _is_probe(node, parents)
            if hidden and (parts[0] == "trainyard" or parts[0] in HEAVY):
                found.append(f"{where} is imported inside a function; import it at the top")
            if parts[0] == "benchmarks":
                found.append(
                    f"{where}: the library never imports the benchmarks (not in the wheel)"
                )
            if layer is None:
                continue
            if parts[0] == "trainyard" and len(parts) > 1:
                target = parts[1]
                if target in ALLOWED and target != layer and target not in ALLOWED[layer]:
                    found.append(f"{where}: layer {layer!r} may not import layer {target!r}")
            elif parts[0] in FORBIDDEN.get(layer, set()):
                found.append(f"{where}: layer {layer!r} may not import {parts[0]}")
    return found


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_is_in_a_known_layer_or_one_of_few_at_the_top():
    layers = {layer_of(p) for p in MODULES} - {None}
    assert layers <= set(ALLOWED), f"layers with no import rule: {layers - set(ALLOWED)}"
    assert len(layers) >= 5
    loose = [p.name for p in MODULES if layer_of(p) is None]
    assert len(loose) <= 6, loose


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_go_down_the_layers(path):
    assert violations(path) == []


@pytest.mark.parametrize(
    ("where", "source", "expected"),
    [
        ("core/x.py", "from trainyard.data.arrays import row_blocks\n", "may not import layer"),
        ("serve/x.py", "import torch\n", "may not import torch"),
        ("runtime/x.py", "from mlflow import MlflowClient\n", "may not import mlflow"),
        ("data/x.py", "from ..track import runs\n", "may not import layer 'track'"),
        ("train/x.py", "def f():\n    import torch\n", "inside a function"),
        ("export/x.py", "def f():\n    from trainyard.core import io\n", "inside a function"),
        ("doctor/x.py", "import benchmarks.common\n", "never imports the benchmarks"),
    ],
)
def test_the_checker_finds_each_kind_of_break(where, source, expected):
    """The checker itself: a rule that found nothing would pass by finding nothing."""
    found = violations(PACKAGE / where, source)
    assert len(found) == 1 and expected in found[0], found


def test_a_probe_inside_try_is_allowed():
    source = "def f():\n    try:\n        import torch\n    except ImportError:\n        return\n"
    assert violations(PACKAGE / "doctor" / "x.py", source) == []
