"""The house's size limits (docs/architecture.md), so that the shape stays readable.

Modules at most 600 lines and functions at most 80, in the library, the service entry and
the benchmarks; the service entry stays thin; the README fits on a screen (the rest is in docs/).
"""

from __future__ import annotations

import ast

import pytest

from conftest import REPO

MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
CODE = sorted(
    p
    for folder in ("src/trainyard", "bento", "benchmarks", "team")
    for p in (REPO / folder).rglob("*.py")
    if "__pycache__" not in p.parts
)


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``name: N lines`` for each function (or method) longer than ``limit`` lines."""
    return [
        f"{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > limit
    ]


@pytest.mark.parametrize("path", CODE, ids=lambda p: str(p.relative_to(REPO)))
def test_module_and_functions_stay_small(path):
    source = path.read_text()
    assert len(source.splitlines()) <= MAX_MODULE_LINES
    assert long_functions(source) == []


def test_the_function_check_measures_what_it_claims():
    body = "".join(f"    x = {i}\n" for i in range(MAX_FUNCTION_LINES))
    assert long_functions(f"def ok():\n{body[: -len('    x = 79')]}") == []
    assert long_functions(f"def long():\n{body}") == [f"long: {MAX_FUNCTION_LINES + 1} lines"]


def test_service_entry_is_thin_and_readme_fits():
    assert len((REPO / "bento/service.py").read_text().splitlines()) <= 150
    assert len((REPO / "README.md").read_text().splitlines()) <= 110
    assert len(list((REPO / "docs").glob("*.md"))) >= 5
