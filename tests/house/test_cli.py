"""The ``trainyard`` command: one module per command, listed once, and the README says so.

`trainyard --help` and the README's command table must name the same commands (a command
added to one and not the other fails here); every module of trainyard/commands is in
``cli.COMMANDS`` with the one shape (``add_parser`` and one ``Command`` class); and no
library function outside the command line takes an ``argparse.Namespace``.
"""

from __future__ import annotations

import ast
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

import trainyard.commands
from trainyard import cli
from trainyard.commands import Command

from conftest import REPO

README_SECTION = "## `trainyard` commands"
PACKAGE = REPO / "src" / "trainyard"
# Where an argparse.Namespace may be a parameter: the command line itself (the commands,
# the dvc.yaml stages' `run(params, args)` under stage_main, bulk scoring's flags).
COMMAND_LINE = ("cli.py", "commands/", "stages/", "bulk/command_line.py", "bulk/__main__.py")


def readme_commands(text: str) -> list[str]:
    """The commands in the first column of the README's command table, in its order."""
    if README_SECTION not in text:
        raise AssertionError(f"README.md has no {README_SECTION!r} section")
    section = text.split(README_SECTION, 1)[1].split("\n## ", 1)[0]
    found = re.findall(r"^\| `trainyard ([a-z][\w-]*)` \|", section, flags=re.M)
    if not found:
        raise AssertionError(f"README.md {README_SECTION!r}: no `trainyard NAME` rows")
    return found


def help_commands(text: str) -> list[str]:
    """The commands `trainyard --help` lists under its positional arguments, in order."""
    listed = text.split("positional arguments:", 1)[1].split("\noptions:", 1)[0]
    # argparse indents a command's name by 4 spaces, the help text beside or under it more.
    return re.findall(r"^    ([a-z][\w-]*)(?:\s|$)", listed, flags=re.M)


@pytest.fixture(scope="module")
def top_help() -> str:
    return cli.get_parser().format_help()


def test_readme_and_trainyard_help_list_the_same_commands(top_help):
    readme = readme_commands((REPO / "README.md").read_text())
    listed = help_commands(top_help)
    assert len(listed) >= 9, top_help
    assert sorted(readme) == sorted(listed), (
        f"only in README.md: {sorted(set(readme) - set(listed))}; "
        f"only in trainyard --help: {sorted(set(listed) - set(readme))}"
    )
    assert len(readme) == len(set(readme)), f"a command twice in README.md: {readme}"


def test_the_readers_see_a_difference(top_help):
    """The comparison above could pass by reading nothing: each reader, on altered text."""
    readme = (REPO / "README.md").read_text()
    row = re.search(r"^\| `trainyard exps` \|.*\n", readme, flags=re.M)
    assert row, "the README's exps row"
    assert "exps" not in readme_commands(readme.replace(row.group(0), ""))
    added = readme.replace(row.group(0), row.group(0) + "| `trainyard new-one` | x |\n")
    assert readme_commands(added)[-1] == "new-one"
    assert "new-one" not in readme_commands(readme + "\n| `trainyard new-one` | x |\n")
    extra = top_help.replace("\noptions:", "\n    new-one      x\n\noptions:", 1)
    assert help_commands(extra)[-1] == "new-one"
    with pytest.raises(AssertionError, match="no"):
        readme_commands("# a README without the section\n")


def test_every_command_module_is_in_the_one_list():
    modules = {
        f"trainyard.commands.{m.name}" for m in pkgutil.iter_modules(trainyard.commands.__path__)
    }
    listed = [m.__name__ for m in cli.COMMANDS]
    assert sorted(listed) == sorted(modules), "a module of trainyard/commands not in COMMANDS"
    assert len(listed) == len(set(listed))


@pytest.mark.parametrize("module", cli.COMMANDS, ids=lambda m: m.__name__.rsplit(".", 1)[1])
def test_each_command_module_has_the_one_shape(module):
    assert callable(getattr(module, "add_parser", None)), "add_parser(subparsers)"
    assert list(inspect.signature(module.add_parser).parameters) == ["subparsers"]
    own = [
        v
        for v in vars(module).values()
        if inspect.isclass(v) and issubclass(v, Command) and v.__module__ == module.__name__
    ]
    assert len(own) == 1, f"one Command class, found {own}"
    assert own[0].run is not Command.run


def test_each_subcommand_runs_its_modules_command():
    parser = cli.get_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, subparser in sub.choices.items():
        command = subparser.get_default("func")
        assert inspect.isclass(command) and issubclass(command, Command), name
        assert command.__module__ in {m.__name__ for m in cli.COMMANDS}, name


def namespace_parameters(source: str, where: str) -> list[str]:
    """Functions in ``source`` with a parameter annotated ``argparse.Namespace``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            arguments = node.args
            for arg in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]:
                if arg.annotation is not None and "Namespace" in ast.unparse(arg.annotation):
                    found.append(f"{where}:{node.lineno}: {node.name}({arg.arg})")
    return found


def test_no_library_function_takes_an_argparse_namespace():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if not rel.startswith(COMMAND_LINE):
            found += namespace_parameters(path.read_text(), rel)
    assert found == [], "typed options (a dataclass or keyword arguments) instead"
    planted = "import argparse\ndef build(args: argparse.Namespace) -> None: ...\n"
    assert namespace_parameters(planted, "x.py") == ["x.py:2: build(args)"]


def test_usage_errors_and_help_exit_as_argparse_says(capsys):
    assert cli.main([]) == 2
    assert cli.main(["no-such-command"]) == 2
    assert cli.main(["--help"]) == 0
    assert "predict-merge" in capsys.readouterr().out


def test_the_console_script_is_cli_main():
    text = (REPO / "pyproject.toml").read_text()
    assert re.search(r'^trainyard = "trainyard\.cli:main"$', text, flags=re.M)
    assert Path(cli.__file__).name == "cli.py"


def test_the_cli_starts_without_any_commands_heavy_library():
    """Every command module is imported to build the parser: none may load torch, Lightning,
    MLflow, Optuna, DVC or matplotlib before its own ``run`` (``trainyard predict`` of a
    small folder would spend seconds on tune's and drift's libraries before its first
    image). A fresh interpreter: this test process has them all loaded already."""
    import subprocess
    import sys

    heavy = ("torch", "lightning", "mlflow", "optuna", "dvc", "matplotlib", "pandas", "scipy")
    code = (
        "import sys, trainyard.cli\n"
        "trainyard.cli.get_parser()\n"
        f"print(' '.join(m for m in {heavy!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_trainyard_predict_imports_what_python_m_trainyard_bulk_does():
    """The console script's start-up against ``python -m trainyard.bulk``'s: beyond the
    bulk command's own modules it may load trainyard's command modules and the standard
    library, nothing else (doctor's data sources and drift's ``pyarrow.compute`` wait for
    their own ``run``); and neither loads ``pyarrow.compute`` or ``numpy.ma``, which the
    table and the decode probe no longer need. Fresh interpreters: this process has them."""
    import subprocess
    import sys

    def loaded(code: str) -> set[str]:
        code += "\nimport sys; print(' '.join(sys.modules))"
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        return set(run.stdout.split())

    bulk = loaded("import trainyard.bulk.command_line")
    cli = loaded("import trainyard.cli; trainyard.cli.get_parser()")
    extra = {m for m in cli - bulk if not m.startswith("trainyard.")}
    assert {m for m in extra if m.split(".")[0] not in sys.stdlib_module_names} == set()
    assert not {"pyarrow.compute", "numpy.ma", "trainyard.doctor.collect"} & (bulk | cli)
