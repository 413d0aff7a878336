"""The import rule (docs/architecture.md): a layer imports only the layers below it.

Read from the source with ast, every import included (those under TYPE_CHECKING too: a type
from a higher layer is still a dependency on it; ``importlib.import_module`` and
``__import__`` calls as well). A light layer (core, data, runtime, watch, serve, bulk) also
never imports a heavy library; those are the packages the bento ships whole, and nothing
it runs reaches torch, Lightning, MLflow, DVC, Optuna or matplotlib however many imports
away (followed from bento/service.py and ``python -m trainyard.bulk``). No module hides an
import inside a function body except a probe (an import inside ``try`` that handles its
failure, as the doctor does to report a broken build) or one named in ``DEFERRED``, nor looks a
function of trainyard's up by its name (``getattr(module, name)``; a benchmark may read a
constant that way, with a default for older checkouts).

Each outside library lives behind one place: MLflow in track/, DVC's Python API in
experiments/dvc_repo.py, Optuna in experiments/study.py. ``bento/`` (the thin BentoML entry)
and ``benchmarks/`` are read too, with their own rules, and nothing imports BentoML's private
``bentoml._internal``.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from conftest import REPO

PACKAGE = REPO / "src" / "trainyard"

# layer -> the layers it may import (its own always allowed). Top-level modules (the
# ``trainyard`` command, presets) may import anything and no layer imports
# them; every layer may read __version__.
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "data": {"core"},
    "runtime": {"core"},
    "model": {"core"},
    "track": {"core", "runtime"},
    "training": {"core", "data", "model", "track"},
    "export": {"core", "data", "model", "runtime"},
    "evaluation": {"core", "data", "runtime", "watch"},
    "watch": {"core"},
    "serve": {"core", "runtime", "watch"},
    # The labelling loop: the folder, the prediction log, Label Studio's client (track/).
    "review": {"core", "data", "watch", "track"},
    "bulk": {"core", "data", "runtime"},
    "stages": {
        "core",
        "data",
        "model",
        "runtime",
        "track",
        "training",
        "export",
        "evaluation",
        "bulk",
        "watch",
    },
    "doctor": {
        "core",
        "data",
        "model",
        "runtime",
        "track",
        "training",
        "export",
        "evaluation",
        "serve",
        "bulk",
        "watch",
    },
    "experiments": {
        "core",
        "data",
        "model",
        "runtime",
        "track",
        "training",
        "export",
        "evaluation",
        "stages",
        "bulk",
    },
}
# One module per `trainyard` command (trainyard.cli lists them): the top layer, which may
# import every layer below it; only trainyard.cli imports it.
ALLOWED["commands"] = set(ALLOWED)
HEAVY = {
    "torch",
    "torchvision",
    "torchmetrics",
    "lightning",
    "pytorch_lightning",
    "lightning_fabric",
    "mlflow",
    "dvc",
    "optuna",
    "optuna_integration",
    "onnx",
    "matplotlib",
}
# A heavy import a library module makes in the one function that needs it, by name: the
# stages that never use it must not pay for it at start-up. torchvision (its models and
# torch._dynamo): 2.6 CPU-s of the export stage's start-up on 2 cores, which rebuilds
# trainyard's own nets; a torchvision backbone imports it there when built.
# onnx (and ml_dtypes with it, 0.6-0.7 s): evaluate and promote import the registry and
# never log a model, which is the one thing it is imported for.
DEFERRED = {("model/backbones.py", "torchvision.models"), ("track/registry.py", "onnx")}
# The libraries each light layer must not import (onnxruntime is the runtime's own).
FORBIDDEN: dict[str, set[str]] = {
    "core": HEAVY | {"onnxruntime", "bentoml", "starlette"},
    "runtime": HEAVY | {"bentoml", "starlette"},
    "serve": HEAVY,
    "bulk": HEAVY | {"bentoml", "starlette"},
    "watch": HEAVY | {"onnxruntime", "bentoml", "starlette"},
    # The datamodule (torch) is training's: the data layer ships whole in the bento.
    "data": HEAVY | {"onnxruntime", "bentoml", "starlette"},
    "model": {"mlflow", "dvc", "onnxruntime", "bentoml"},
}
# Each outside library behind one place: the folder ("x/") or module of src/trainyard that
# alone imports it. Everything else, benchmarks and serving included, calls its functions.
HOMES = {
    "mlflow": "track/",
    "dvc": "experiments/dvc_repo.py",
    "optuna": "experiments/study.py",
    "optuna_integration": "experiments/study.py",
}
# bento/ (the bento's entry) may import these layers; trainyard.track only as a probe.
SERVING_LAYERS = {"core", "runtime", "serve", "watch"}


def layer_of(path: Path, package: Path = PACKAGE) -> str | None:
    rel = path.relative_to(package)
    return rel.parts[0] if len(rel.parts) > 1 else None


def _area(path: Path, repo: Path) -> str:
    """Which rules apply: the library's, serving's or the benchmarks'."""
    rel = path.relative_to(repo)
    if rel.parts[:2] == ("src", "trainyard"):
        return "library"
    if rel.parts[0] in ("bento", "benchmarks"):
        return rel.parts[0]
    raise ValueError(f"{rel}: not a module the import rule reads")


def _package(path: Path, repo: Path) -> str:
    rel = path.relative_to(repo / "src" if _area(path, repo) == "library" else repo)
    return ".".join(rel.with_suffix("").parts[:-1])


def _resolve(name: str, level: int, package: str) -> str:
    """A relative name (``level`` leading dots) as an absolute one, from ``package``."""
    if not level:
        return name
    parts = package.split(".")[: len(package.split(".")) - level + 1]
    return ".".join(parts + ([name] if name else []))


def _from_names(node: ast.ImportFrom, package: str) -> list[str]:
    # `from trainyard import training` and `from .. import track` name the layer in the alias:
    # a one-part base is read with each alias (trainyard.training, bentoml._internal).
    base = _resolve(node.module or "", node.level, package)
    if "." in base:
        return [base]
    return [f"{base}.{alias.name}" if base else alias.name for alias in node.names]


def _call_name(node: ast.Call, package: str, loaders: set[str]) -> str | None:
    """The module a dynamic import call loads: "" when it is computed at run time, None
    when ``node`` is not such a call. ``loaders``: the names import_module is bound to."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name not in loaders:
        return None
    arg = node.args[0] if node.args else None
    if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
        return ""
    level = len(arg.value) - len(arg.value.lstrip("."))
    anchor = node.args[1] if len(node.args) > 1 else None
    anchor = anchor or next((k.value for k in node.keywords if k.arg == "package"), None)
    if level and isinstance(anchor, ast.Constant) and isinstance(anchor.value, str):
        package = anchor.value
    return _resolve(arg.value[level:], level, package)


def imports(tree: ast.AST, package: str) -> Iterator[tuple[ast.AST, str]]:
    """(node, absolute module name) of every import statement and dynamic import call;
    the name is "" for a call whose module is computed at run time."""
    loaders = {"import_module", "__import__"} | {
        alias.asname
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "importlib"
        for alias in node.names
        if alias.name == "import_module" and alias.asname
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            yield from ((node, name) for name in _from_names(node, package))
        elif isinstance(node, ast.Call):
            name = _call_name(node, package, loaders)
            if name is not None:
                yield node, name


def _enclosing_try(node: ast.AST, parents: dict[int, ast.AST]) -> Iterator[ast.Try]:
    while id(node) in parents:
        parent = parents[id(node)]
        if isinstance(parent, ast.Try) and node in parent.body and parent.handlers:
            yield parent
        node = parent


def _is_probe(node: ast.AST, parents: dict[int, ast.AST]) -> bool:
    """An import inside ``try:`` whose handler catches its failure (a deliberate probe)."""
    return next(_enclosing_try(node, parents), None) is not None


def _catches_import_error(node: ast.AST, parents: dict[int, ast.AST]) -> bool:
    """Inside a ``try:`` with an ``except ImportError`` (or ModuleNotFoundError) handler."""
    wanted = {"ImportError", "ModuleNotFoundError"}
    for try_node in _enclosing_try(node, parents):
        for handler in try_node.handlers:
            kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
            if any(getattr(k, "id", None) in wanted for k in kinds):
                return True
    return False


def _library_rules(where: str, name: str, layer: str | None, hidden: bool) -> Iterator[str]:
    parts = name.split(".")
    if hidden and (parts[0] == "trainyard" or parts[0] in HEAVY):
        yield f"{where} is imported inside a function; import it at the top"
    if parts[0] in ("benchmarks", "bento", "team"):
        yield f"{where}: the library never imports {parts[0]} (not in the wheel)"
    if layer is None:
        return
    if parts[0] == "trainyard" and len(parts) > 1:
        target = parts[1]
        if target == "__version__" or target == layer or target in ALLOWED[layer]:
            return
        if target in ALLOWED:
            yield f"{where}: layer {layer!r} may not import layer {target!r}"
        else:  # cli, presets: the top sits above every layer
            yield f"{where}: layer {layer!r} may not import trainyard.{target} (top level)"
    elif parts[0] in FORBIDDEN.get(layer, set()) and parts[0] not in HOMES:
        yield f"{where}: layer {layer!r} may not import {parts[0]}"


def _serving_rules(where: str, name: str, probe: bool) -> Iterator[str]:
    parts = name.split(".")
    if parts[0] in HEAVY - set(HOMES):
        yield f"{where}: bento/ may not import {parts[0]} (the bento ships none of it)"
    if parts[0] == "benchmarks":
        yield f"{where}: bento/ never imports the benchmarks (not in the bento)"
    if parts[0] != "trainyard" or len(parts) < 2 or parts[1] in SERVING_LAYERS:
        return
    if parts[1] == "track" and probe:
        return
    if parts[1] == "track":
        yield f"{where}: bento/ imports trainyard.track only in a try/except ImportError probe"
    elif parts[1] != "__version__":
        yield f"{where}: bento/ may import trainyard.{'/'.join(sorted(SERVING_LAYERS))} only"


def _home_rule(where: str, name: str, rel: str | None) -> Iterator[str]:
    """``rel``: the module's path in src/trainyard (None outside the library)."""
    top = name.split(".")[0]
    home = HOMES.get(top)
    if home is None or rel == home or (home.endswith("/") and (rel or "").startswith(home)):
        return
    yield f"{where}: {top} is imported only in src/trainyard/{home}; call its functions"


def _trainyard_bindings(tree: ast.AST, package: str) -> set[str]:
    """The names an import binds to something of trainyard's (a module or what it holds)."""
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound |= {
                alias.asname or alias.name.split(".")[0]
                for alias in node.names
                if alias.name.split(".")[0] == "trainyard"
            }
        elif (
            isinstance(node, ast.ImportFrom)
            and _resolve(node.module or "", node.level, package).split(".")[0] == "trainyard"
        ):
            bound |= {alias.asname or alias.name for alias in node.names}
    return bound


def _looked_up_by_name(tree: ast.AST, package: str) -> Iterator[tuple[ast.AST, str]]:
    """``getattr(m, ...)`` on a name imported from trainyard: a function looked up by its
    name as a string, a seam that neither the import rule nor a type checker sees."""
    bound = _trainyard_bindings(tree, package)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) == "getattr"
            and node.args
            and getattr(node.args[0], "id", None) in bound
        ):
            yield node, node.args[0].id  # type: ignore[attr-defined]


def violations(path: Path, source: str | None = None, repo: Path = REPO) -> list[str]:
    """What in ``path`` (a module of ``repo``'s src/trainyard, bento/ or benchmarks/)
    breaks the import rule, as readable lines (empty: none)."""
    area, package = _area(path, repo), _package(path, repo)
    library = repo / "src" / "trainyard"
    layer = layer_of(path, library) if area == "library" else None
    in_library = library.as_posix() + "/"
    rel = path.as_posix().removeprefix(in_library) if area == "library" else None
    tree = ast.parse(source if source is not None else path.read_text(), str(path))
    parents = {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    in_function = {
        id(n)
        for fn in ast.walk(tree)
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
        for n in ast.walk(fn)
    }
    found = []
    for node, name in imports(tree, package):
        where = f"{path.relative_to(repo)}:{node.lineno}: {name or '(computed)'}"
        if not name:
            found.append(f"{where}: a module name computed at run time; import it by name")
            continue
        if name.split(".")[:2] == ["bentoml", "_internal"]:
            found.append(f"{where}: BentoML's private API; use its public one")
        found += _home_rule(where, name, rel)
        if area == "bento":
            found += _serving_rules(where, name, _catches_import_error(node, parents))
        elif area == "library":
            # A command imports its library in its run(), as dvc/commands/ do: the CLI
            # imports every command to build its parser, and one command must not start
            # by loading the others' torch, MLflow or Optuna. Still by name: checked here.
            deferred = (layer == "commands" or (rel, name) in DEFERRED) and id(node) in in_function
            hidden = id(node) in in_function and not _is_probe(node, parents) and not deferred
            found += _library_rules(where, name, layer, hidden)
    for node, name in _looked_up_by_name(tree, package) if area != "benchmarks" else ():
        found.append(
            f"{path.relative_to(repo)}:{node.lineno}: getattr on trainyard's {name}: a "
            "function looked up by name; import it, or take a typed object (a Protocol)"
        )
    return found


MODULES = sorted(PACKAGE.rglob("*.py"))
OUTSIDE = sorted((REPO / "bento").rglob("*.py")) + sorted((REPO / "benchmarks").rglob("*.py"))


def test_every_module_is_in_a_known_layer_or_one_of_few_at_the_top():
    layers = {layer_of(p) for p in MODULES} - {None}
    assert layers <= set(ALLOWED), f"layers with no import rule: {layers - set(ALLOWED)}"
    assert len(layers) >= 5
    loose = [p.name for p in MODULES if layer_of(p) is None]
    assert len(loose) <= 6, loose
    assert any(p.name == "service.py" for p in OUTSIDE) and len(OUTSIDE) > 5


@pytest.mark.parametrize(
    "path", MODULES + OUTSIDE, ids=lambda p: str(p.relative_to(REPO)).removeprefix("src/")
)
def test_imports_go_down_the_layers(path):
    assert violations(path) == []


def _check(tmp_path: Path, where: str, source: str) -> list[str]:
    """``source`` written as the module ``where`` of a repository in ``tmp_path``."""
    path = tmp_path / where
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    return violations(path, repo=tmp_path)


# One case per kind of break: a checker that found nothing would pass by finding nothing.
CAUGHT = [
    # the layers
    ("src/trainyard/core/x.py", "from trainyard.data.arrays import row_blocks\n", "layer 'data'"),
    ("src/trainyard/data/x.py", "from ..track import runs\n", "may not import layer 'track'"),
    (
        "src/trainyard/data/x.py",
        "from trainyard import training\n",
        "may not import layer 'training'",
    ),
    ("src/trainyard/data/x.py", "from .. import track\n", "may not import layer 'track'"),
    (
        "src/trainyard/model/x.py",
        "import trainyard.training.fit\n",
        "may not import layer 'training'",
    ),
    ("src/trainyard/stages/x.py", "from trainyard import cli\n", "trainyard.cli (top level)"),
    ("src/trainyard/serve/x.py", "from trainyard.presets import x\n", "trainyard.presets"),
    ("src/trainyard/doctor/x.py", "from ..cli import main\n", "trainyard.cli"),
    ("src/trainyard/stages/x.py", "from trainyard.commands import tune\n", "layer 'commands'"),
    # heavy libraries in a light layer
    ("src/trainyard/serve/x.py", "import torch\n", "may not import torch"),
    ("src/trainyard/serve/x.py", "import pytorch_lightning\n", "may not import pytorch_lightning"),
    ("src/trainyard/serve/x.py", "from torchmetrics import Accuracy\n", "import torchmetrics"),
    ("src/trainyard/core/x.py", "import lightning_fabric\n", "may not import lightning_fabric"),
    ("src/trainyard/runtime/x.py", "import torchmetrics\n", "may not import torchmetrics"),
    ("src/trainyard/core/x.py", "from torch import nn\n", "may not import torch"),
    # dynamic imports
    ("src/trainyard/serve/x.py", "import importlib\nimportlib.import_module('torch')\n", "torch"),
    ("src/trainyard/runtime/x.py", "__import__('torchvision')\n", "import torchvision"),
    ("src/trainyard/core/x.py", "from importlib import import_module as m\nm('onnx')\n", "onnx"),
    (
        "src/trainyard/data/x.py",
        "import importlib\nimportlib.import_module('..training', 'trainyard.data')\n",
        "layer 'training'",
    ),
    (
        "src/trainyard/model/x.py",
        "import importlib\nname = 'torch'\nimportlib.import_module(name)\n",
        "computed at run time",
    ),
    # imports at the top
    ("src/trainyard/training/x.py", "def f():\n    import torch\n", "inside a function"),
    # DEFERRED names one import in one module: another in that module is still caught
    ("src/trainyard/model/backbones.py", "def f():\n    import torch\n", "inside a function"),
    ("src/trainyard/export/x.py", "def f():\n    import torchvision.models\n", "inside a function"),
    (
        "src/trainyard/export/x.py",
        "def f():\n    from trainyard.core import io\n",
        "inside a function",
    ),
    (
        "src/trainyard/training/x.py",
        "def f():\n    import importlib\n    importlib.import_module('trainyard.data')\n",
        "inside a function",
    ),
    # the library never reaches outside it
    ("src/trainyard/doctor/x.py", "import benchmarks.common\n", "never imports benchmarks"),
    ("src/trainyard/track/x.py", "from team.stack import up\n", "never imports team"),
    ("src/trainyard/cli.py", "from bento.service import Classifier\n", "never imports bento"),
    # each outside library behind one place
    (
        "src/trainyard/training/x.py",
        "from mlflow import MlflowClient\n",
        "only in src/trainyard/track/",
    ),
    ("src/trainyard/stages/x.py", "import mlflow\n", "only in src/trainyard/track/"),
    ("src/trainyard/experiments/report.py", "import dvc.api\n", "experiments/dvc_repo.py"),
    ("src/trainyard/experiments/trials.py", "import optuna\n", "experiments/study.py"),
    ("src/trainyard/experiments/tune.py", "from optuna_integration import X\n", "study.py"),
    ("src/trainyard/serve/x.py", "import optuna\n", "experiments/study.py"),
    ("benchmarks/bench_x.py", "from mlflow import MlflowClient\n", "only in src/trainyard/track/"),
    ("benchmarks/bench_x.py", "import dvc.api\n", "experiments/dvc_repo.py"),
    ("benchmarks/bench_x.py", "def f():\n    import optuna\n", "experiments/study.py"),
    # BentoML's public API only
    ("src/trainyard/serve/x.py", "from bentoml._internal.marshal import dispatcher\n", "private"),
    ("bento/service.py", "from bentoml import _internal\n", "BentoML's private API"),
    ("benchmarks/bench_x.py", "import bentoml._internal.server\n", "BentoML's private API"),
    # bento/: the thin entry
    ("bento/service.py", "import torch\n", "bento/ may not import torch"),
    ("bento/service.py", "from lightning import Trainer\n", "bento/ may not import lightning"),
    ("bento/service.py", "import onnx\n", "bento/ may not import onnx"),
    (
        "bento/service.py",
        "from trainyard.training import fit\n",
        "trainyard.core/runtime/serve/watch only",
    ),
    (
        "bento/service.py",
        "from trainyard import presets\n",
        "trainyard.core/runtime/serve/watch only",
    ),
    ("bento/service.py", "from trainyard.track.registry import f\n", "ImportError probe"),
    (
        "bento/service.py",
        "try:\n    import trainyard.track\nexcept ValueError:\n    pass\n",
        "ImportError probe",
    ),
    ("bento/service.py", "import benchmarks.soak\n", "never imports the benchmarks"),
    # a function looked up by its name: the seam no import rule sees
    (
        "bento/service.py",
        "try:\n    from trainyard.track import registry\nexcept ImportError:\n"
        "    registry = None\nfetch = getattr(registry, name)\n",
        "getattr on trainyard's registry",
    ),
    (
        "src/trainyard/serve/x.py",
        "from . import settings\ndef f(name):\n    return getattr(settings, name)\n",
        "function looked up by name",
    ),
    (
        "src/trainyard/stages/x.py",
        "import trainyard.track.registry as r\ngetattr(r, 'fetch_model')\n",
        "getattr on trainyard's r",
    ),
]


def _case_id(case: tuple[str, ...]) -> str:
    return f"{case[0]}: {case[1].strip().splitlines()[-1].strip()}"


@pytest.mark.parametrize(("where", "source", "expected"), CAUGHT, ids=map(_case_id, CAUGHT))
def test_the_checker_finds_each_kind_of_break(tmp_path, where, source, expected):
    found = _check(tmp_path, where, source)
    assert len(found) == 1, found
    assert expected is None or expected in found[0], found


ALLOWED_CASES = [
    (
        "src/trainyard/doctor/x.py",
        "def f():\n    try:\n        import torch\n    except ImportError:\n        return\n",
    ),
    ("src/trainyard/serve/x.py", "from trainyard import __version__\nfrom . import guard\n"),
    ("src/trainyard/track/x.py", "import mlflow\nfrom mlflow.entities import Param\n"),
    ("src/trainyard/experiments/dvc_repo.py", "import dvc.api\nfrom dvc.repo import Repo\n"),
    ("src/trainyard/experiments/study.py", "import optuna\nfrom optuna_integration import X\n"),
    ("src/trainyard/cli.py", "from trainyard.commands import tune\nimport importlib\n"),
    ("bento/service.py", "import bentoml\nfrom trainyard.serve.app import build_app\n"),
    (
        "bento/service.py",
        "def f():\n    try:\n        from trainyard.track.registry import g\n"
        "    except ImportError:\n        return\n",
    ),
    ("benchmarks/bench_x.py", "import torch\nfrom trainyard.track.store import count_runs\n"),
    ("src/trainyard/serve/x.py", "import sys\ndef f(obj):\n    return getattr(obj, 'x', sys)\n"),
    ("benchmarks/bench_x.py", "import trainyard.data.arrays as a\nN = getattr(a, '_N', 1)\n"),
    (
        "benchmarks/bench_x.py",
        "def f():\n    from trainyard.training.builder import build_trainer\n",
    ),
]


@pytest.mark.parametrize(("where", "source"), ALLOWED_CASES, ids=map(_case_id, ALLOWED_CASES))
def test_what_the_rule_allows_is_not_flagged(tmp_path, where, source):
    """Probes, each library in its home, serving's track probe, the benchmarks' lazy imports."""
    assert _check(tmp_path, where, source) == []


# ------------------------------------------------------------------ the bento's boundary
# The bento's boundary is a layer boundary: bento/bentofile.yaml ships these packages whole,
# by glob, and nothing the bento runs reaches a heavy library, however many hops away.
BENTO_PACKAGES = ("core", "data", "runtime", "watch", "serve", "bulk")
# What the image runs: the service, and `python -m trainyard.bulk` (deploy/predict-job.yaml).
BENTO_ENTRIES = ("bento/service.py", "src/trainyard/bulk/__main__.py")
BENTOFILE = Path("bento") / "bentofile.yaml"
# What the issue names; HEAVY holds these and more.
BENTO_HEAVY = {"torch", "lightning", "mlflow", "dvc", "optuna", "matplotlib"}


def package_glob(package: str) -> str:
    """The bentofile's include pattern that ships ``package`` of src/trainyard whole."""
    return f"/src/trainyard/{package}/**/*.py"


def _module_path(name: str, repo: Path) -> Path | None:
    """``trainyard.a.b`` as src/trainyard/a/b.py or its package's __init__.py."""
    base = repo / "src" / Path(*name.split("."))
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)


def _run_paths(name: str, repo: Path) -> list[Path]:
    """The files importing ``name`` runs: each package on the way, then the module (a name
    such as ``trainyard.core.io.atomic_write`` ends at the module that defines it)."""
    parts = name.split(".")
    found = (_module_path(".".join(parts[:i]), repo) for i in range(1, len(parts) + 1))
    return [p for p in found if p is not None]


def _type_checking(tree: ast.AST) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:`` (never run)."""
    return {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING"
        for stmt in node.body
        for n in ast.walk(stmt)
    }


def _run_imports(path: Path, repo: Path) -> Iterator[str]:
    """What ``path`` imports when it runs, its functions' bodies included: not under
    ``if TYPE_CHECKING:``, nor an optional import (``try`` ... ``except ImportError``: the
    service's registry probe, absent from the bento). "" for a name computed at run time."""
    tree = ast.parse(path.read_text(), str(path))
    parents = {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    never = _type_checking(tree)
    rel = path.relative_to(repo)
    package = ".".join(rel.parts[1:-1] if rel.parts[0] == "src" else rel.parts[:-1])
    for node, name in imports(tree, package):
        if id(node) in never or _catches_import_error(node, parents):
            continue
        yield name
        if isinstance(node, ast.ImportFrom) and name.startswith("trainyard."):
            # `from trainyard.bulk import command`: a name imported may be a module
            yield from (f"{name}.{alias.name}" for alias in node.names)


def import_closure(starts: list[Path], repo: Path = REPO) -> dict[str, list[str]]:
    """Every module and outside library that running ``starts`` reaches, followed through
    src/trainyard from module to module: name -> the chain of files that leads to it."""
    chains: dict[str, list[str]] = {}
    todo = [(p, [p.relative_to(repo).as_posix()]) for p in starts]
    while todo:
        path, chain = todo.pop(0)  # breadth first: each chain is a shortest one
        for name in _run_imports(path, repo):
            if not name.startswith("trainyard"):
                chains.setdefault(name.split(".")[0] or "(computed)", chain)
                continue
            for step in _run_paths(name, repo):
                key = step.relative_to(repo).as_posix()
                if key not in chains:
                    chains[key] = [*chain, key]
                    todo.append((step, [*chain, key]))
    return chains


def bento_violations(repo: Path = REPO) -> list[str]:
    """What breaks the bento's rule in ``repo``: a heavy library that its entries or any
    module of its packages reach, a package they reach that the bento does not ship whole,
    and a bentofile that lists modules one by one or leaves a package out."""
    library = repo / "src" / "trainyard"
    chains = import_closure([repo / e for e in BENTO_ENTRIES], repo)
    # The rest of each package ships too, though neither entry imports it (yet).
    rest = [
        p
        for pkg in BENTO_PACKAGES
        for p in sorted((library / pkg).rglob("*.py"))
        if p.relative_to(repo).as_posix() not in chains
    ]
    for name, chain in import_closure(rest, repo).items():
        chains.setdefault(name, chain)
    found = []
    for name, chain in sorted(chains.items()):
        if name in HEAVY or name == "(computed)":
            found.append(f"{' -> '.join(chain)}: imports {name} (the bento must not)")
        elif name.startswith("src/trainyard/") and name.count("/") > 2:
            package = name.split("/")[2]
            if package not in BENTO_PACKAGES:
                found.append(f"{' -> '.join(chain)}: package {package!r} is not the bento's")
    include = yaml.safe_load((repo / BENTOFILE).read_text())["include"]
    whole = {"/src/trainyard/__init__.py", *map(package_glob, BENTO_PACKAGES)}
    for pattern in include:
        if pattern.startswith("/src/") and pattern.endswith(".py") and pattern not in whole:
            found.append(f"{BENTOFILE}: {pattern}: name the package ({package_glob('x')})")
    for package in BENTO_PACKAGES:
        if package_glob(package) not in include:
            found.append(f"{BENTOFILE}: no {package_glob(package)} (the {package} layer)")
    return found


def test_nothing_the_bento_runs_reaches_a_heavy_library_and_it_ships_whole_packages():
    """From bento/service.py and `python -m trainyard.bulk`, and from every module of the
    packages the bento ships, transitively: no torch, Lightning, MLflow, DVC, Optuna or
    matplotlib; every package reached is one the bentofile names by glob."""
    assert bento_violations() == []
    reached = import_closure([REPO / e for e in BENTO_ENTRIES])
    packages = {
        k.split("/")[2] for k in reached if k.startswith("src/trainyard/") and k.count("/") > 2
    }
    assert packages == set(BENTO_PACKAGES), packages  # each shipped package is one it runs
    assert set(BENTO_PACKAGES) <= set(ALLOWED)
    for package in BENTO_PACKAGES:  # light layers import light layers only
        assert ALLOWED[package] <= set(BENTO_PACKAGES), package
        assert FORBIDDEN[package] | set(HOMES) >= BENTO_HEAVY, package


# Stages that run the exported model, not the torch one: each is a process of every
# `dvc repro`, and torch with Lightning costs it five seconds to import.
TORCH_FREE_STAGES = ("src/trainyard/stages/evaluate.py",)


@pytest.mark.parametrize("stage", TORCH_FREE_STAGES)
def test_a_stage_that_runs_the_onnx_model_never_imports_torch(stage):
    reached = import_closure([REPO / stage])
    heavy = {"torch", "torchvision", "torchmetrics", "lightning", "pytorch_lightning"}
    assert {name: reached[name] for name in heavy & set(reached)} == {}


def test_the_export_stage_never_imports_lightning():
    """export rebuilds the net from the checkpoint without the Classifier
    (``model.trained.TrainedNet``): Lightning's import is ~1.7 CPU-s of every export."""
    reached = import_closure([REPO / "src/trainyard/stages/export.py"])
    lightning = {"lightning", "pytorch_lightning", "lightning_fabric"}
    assert {name: reached[name] for name in lightning & set(reached)} == {}


def test_the_export_stage_starts_without_torchvision():
    """export builds trainyard's own nets without torchvision (``DEFERRED``): its import,
    with torch._dynamo, was 2.6 CPU-s of each export's start-up. Run, not read: the static
    closure above counts the deferred import."""
    code = "import sys, trainyard.stages.export; print(sorted(set(sys.modules) & {M}))"
    heavy = {"torchvision", "torchvision.models", "torch._dynamo"}
    out = subprocess.run(
        [sys.executable, "-c", code.replace("{M}", repr(heavy))],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def _bento_repo(tmp_path: Path, files: dict[str, str]) -> Path:
    """A repository with this one's bentofile, the two entries and ``files`` (path -> source)."""
    base = {
        "bento/service.py": "from trainyard.serve import app\n",
        "src/trainyard/__init__.py": "",
        "src/trainyard/bulk/__main__.py": "from trainyard.bulk.engine import run\n",
        **{f"src/trainyard/{p}/__init__.py": "" for p in (*BENTO_PACKAGES, "track", "training")},
        "src/trainyard/serve/app.py": "from trainyard.core import io\n",
        "src/trainyard/core/io.py": "import json\n",
        "src/trainyard/bulk/engine.py": "from trainyard.data.walk import walk\n",
        "src/trainyard/data/walk.py": "import os\n",
        str(BENTOFILE): (REPO / BENTOFILE).read_text(),
    }
    for rel, source in {**base, **files}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(source)
    return tmp_path


BENTO_CAUGHT = [
    # torch two hops away from bulk scoring, every step within the layer rule (as
    # data.datamodule was, before it moved to training)
    (
        {
            "src/trainyard/data/walk.py": "from trainyard.data.x import y\n",
            "src/trainyard/data/x.py": "import torch\n",
        },
        "src/trainyard/bulk/__main__.py -> src/trainyard/bulk/engine.py -> "
        "src/trainyard/data/walk.py -> src/trainyard/data/x.py: imports torch",
    ),
    # and from the service, through a package's __init__
    (
        {
            "src/trainyard/core/io.py": "import trainyard.watch\n",
            "src/trainyard/watch/__init__.py": "from trainyard.watch.x import y\n",
            "src/trainyard/watch/x.py": "from lightning import Trainer\n",
        },
        "bento/service.py -> src/trainyard/serve/app.py -> src/trainyard/core/io.py -> "
        "src/trainyard/watch/__init__.py -> src/trainyard/watch/x.py: imports lightning",
    ),
    # bulk scoring, through a module the walk imports in a function
    (
        {
            "src/trainyard/data/walk.py": "def f():\n    from trainyard.data.y import g\n",
            "src/trainyard/data/y.py": "import optuna\n",
        },
        "data/y.py: imports optuna",
    ),
    (
        {
            "src/trainyard/data/walk.py": "from trainyard.data.sources import csv\n",
            "src/trainyard/data/sources/__init__.py": "import lightning\n",
            "src/trainyard/data/sources/csv.py": "",
        },
        "data/sources/__init__.py: imports lightning",
    ),
    # a dynamic import, and one computed at run time
    (
        {"src/trainyard/serve/app.py": "import importlib\nimportlib.import_module('mlflow')\n"},
        "serve/app.py: imports mlflow",
    ),
    ({"src/trainyard/watch/log.py": "__import__(name)\n"}, "imports (computed)"),
    # a module of a shipped package that no entry imports still ships
    ({"src/trainyard/watch/plots.py": "import matplotlib\n"}, "watch/plots.py: imports matplotlib"),
    # a package the bento does not ship, reached without a probe
    (
        {"src/trainyard/serve/app.py": "from trainyard.track.registry import fetch\n"},
        "package 'track' is not the bento's",
    ),
    (
        {"src/trainyard/bulk/engine.py": "import trainyard.training.datamodule\n"},
        "package 'training' is not the bento's",
    ),
]


@pytest.mark.parametrize(
    ("files", "expected"),
    BENTO_CAUGHT,
    ids=lambda c: c.split(": ")[-1] if isinstance(c, str) else None,
)
def test_the_bento_check_finds_each_heavy_import_however_far(tmp_path, files, expected):
    assert bento_violations(_bento_repo(tmp_path, {})) == []  # the clean base passes
    found = bento_violations(_bento_repo(tmp_path, files))
    assert len(found) == 1 and expected in found[0], found


def test_the_bento_check_wants_whole_packages_in_the_bentofile(tmp_path):
    repo = _bento_repo(tmp_path, {})
    bentofile = (repo / BENTOFILE).read_text()
    (repo / BENTOFILE).write_text(bentofile.replace('  - "/src/trainyard/data/**/*.py"\n', ""))
    assert bento_violations(repo) == [
        f"{BENTOFILE}: no /src/trainyard/data/**/*.py (the data layer)"
    ]
    by_file = bentofile.replace('"/src/trainyard/data/**/*.py"', '"/src/trainyard/data/walk.py"')
    (repo / BENTOFILE).write_text(by_file)
    found = bento_violations(repo)
    assert len(found) == 2 and "data/walk.py: name the package" in found[0], found


def test_the_bento_check_leaves_optional_and_type_only_imports(tmp_path):
    """The service's registry probe (absent from the bento, handled) and a type import."""
    probe = "try:\n    import trainyard.track.registry\nexcept ImportError:\n    pass\n"
    types = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n"
    repo = _bento_repo(tmp_path, {"bento/service.py": probe, "src/trainyard/core/io.py": types})
    assert bento_violations(repo) == []


# ------------------------------------------------------------- the order, written once
# ALLOWED above is the one statement of the layer order: docs/architecture.md's order line
# and table must say the same, and the README points there instead of restating it.
ARCHITECTURE = REPO / "docs" / "architecture.md"


def layer_tiers(allowed: dict[str, set[str]] = ALLOWED) -> list[list[str]]:
    """The layers lowest first, each one tier above the highest layer it may import."""
    tier: dict[str, int] = {}

    def of(layer: str, above: tuple[str, ...] = ()) -> int:
        if layer in above:  # two layers that may import each other: no order at all
            raise ValueError(f"the layers import in a circle: {' -> '.join((*above, layer))}")
        if layer not in tier:
            tier[layer] = 1 + max((of(b, (*above, layer)) for b in allowed[layer]), default=-1)
        return tier[layer]

    for layer in allowed:
        of(layer)
    return [[lay for lay in allowed if tier[lay] == t] for t in range(max(tier.values()) + 1)]


def order_line(allowed: dict[str, set[str]] = ALLOWED) -> str:
    return "  <-  ".join(", ".join(tier) for tier in layer_tiers(allowed))


def order_disagreements(page: str, allowed: dict[str, set[str]] = ALLOWED) -> list[str]:
    """Where the architecture page's order line and its "may import" table disagree with
    ``allowed`` (empty: nowhere)."""
    found = []
    if f"\n{order_line(allowed)}\n" not in page:
        found.append(f"the order line is not: {order_line(allowed)}")
    rows = {}
    for line in page.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 3:
            rows[cells[0].strip("`")] = set(re.findall(r"`(\w+)`", cells[2]))
    for layer in sorted(set(rows) | set(allowed)):
        if rows.get(layer) != allowed.get(layer):
            want, said = sorted(allowed.get(layer, [])), sorted(rows.get(layer, []))
            found.append(f"`{layer}` may import {want}, the table says {said}")
    return found


def test_the_architecture_page_states_this_tables_order():
    assert order_disagreements(ARCHITECTURE.read_text()) == []


def test_the_readme_points_to_the_order_instead_of_restating_it():
    readme = (REPO / "README.md").read_text()
    assert "docs/architecture.md#the-layers" in readme
    assert not re.search(r"\bcore\s*(<-|←)", readme), "the README restates the layer order"


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (("data", "track"), "`data` may import ['core', 'track'], the table says ['core']"),
        (("serve", None), "`serve` may import [], the table says"),
        (("model", "track"), "the order line is not:"),
        (("pipeline", "core"), "`pipeline` may import ['core'], the table says []"),
    ],
)
def test_the_order_check_finds_a_disagreement(change, expected):
    """A table that grew a layer or an import, or lost one, no longer matches the page."""
    layer, target = change
    allowed = {k: set(v) for k, v in ALLOWED.items()}
    if target is None:
        allowed[layer] = set()
    else:
        allowed.setdefault(layer, set()).add(target)
    found = order_disagreements(ARCHITECTURE.read_text(), allowed)
    assert any(expected in f for f in found), found


def test_a_circle_in_the_table_has_no_order():
    with pytest.raises(ValueError, match="in a circle: track -> training -> track"):
        layer_tiers({**ALLOWED, "track": ALLOWED["track"] | {"training"}})
