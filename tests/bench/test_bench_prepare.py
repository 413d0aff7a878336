"""The prepare benchmark runs in quick mode, writes valid output and replaces its docs section."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO, run_ok

pytestmark = pytest.mark.slow

START, END = "<!-- bench:prepare:start -->", "<!-- bench:prepare:end -->"

# Runs the benchmark as `make bench-prepare` would, then proves that neither it nor any of
# the prepare processes it started imported the training, tracking or serving stacks.
RUNNER = """
import runpy, sys
sys.argv = ["benchmarks.bench_prepare", *sys.argv[1:]]
runpy.run_module("benchmarks.bench_prepare", run_name="__main__")
heavy = sorted(m for m in ("torch", "lightning", "mlflow", "dvc", "bentoml") if m in sys.modules)
assert not heavy, f"benchmark imported {heavy}"
"""


def _run(tmp: Path, name: str) -> tuple[dict[str, Any], str]:
    out = tmp / f"{name}.json"
    proc = run_ok(
        [
            *(sys.executable, "-c", RUNNER, "--quick", "--work", str(tmp / "work")),
            *("--out", str(out), "--docs", str(tmp / "benchmarks.md")),
        ],
        timeout=300,
    )
    return json.loads(out.read_text()), proc.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("bench_prepare")
    docs = tmp / "benchmarks.md"
    docs.write_text("# Benchmarks\n\n## Serving\nkept as is\n")
    first, first_log = _run(tmp, "first")
    docs_after_first = docs.read_text()
    second, second_log = _run(tmp, "second")
    return {
        "first": first,
        "second": second,
        "first_log": first_log,
        "second_log": second_log,
        "docs_after_first": docs_after_first,
        "docs": docs.read_text(),
        "tmp": tmp,
    }


def test_every_configuration_measured(runs: dict[str, Any]) -> None:
    result = runs["first"]
    n = result["dataset"]["images"]
    n_sub = result["subset"]["images"]
    assert n == 512 and n_sub == 128
    photos = Path(result["work"]) / "full" / "photos"
    assert len(list(photos.rglob("*.jpg"))) == n  # what was generated is what was prepared
    assert len([d for d in photos.iterdir() if d.is_dir()]) == 10
    got = {(r["workers"], r["image_size"], r["subset"]): r for r in result["runs"]}
    assert {(1, 64, False), (2, 64, False), (2, 224, False), (2, 224, True)} <= set(got)
    for key, r in got.items():
        assert r["images"] == (n_sub if key[2] else n), key
        assert r["images_per_s"] > 0 and r["wall_s"] > 0
        assert r["peak_rss_mib"] > 0 and r["rss_self_bytes"] > 0
        assert r["peak_rss_mib"] * 2**20 == max(r["rss_self_bytes"], r["rss_children_bytes"])
        assert r["output_mib"] > 0
        assert r["heavy_imports"] == []
        assert r["pool_workers"] == key[0]  # workers=2 really ran a pool of two
    # 224 px arrays are (224/64)^2 = 12.25x the 64 px ones (labels and card aside)
    assert got[(2, 224, False)]["output_mib"] > 10 * got[(2, 64, False)]["output_mib"]
    assert "workers=2 / workers=1 images/s, 64 px" in result["ratios"]
    assert result["hardware"]["cores"] >= 1 and result["hardware"]["cpu"]


def test_generation_timed_then_reused(runs: dict[str, Any]) -> None:
    first, second = runs["first"]["dataset"], runs["second"]["dataset"]
    assert first["reused"] is False and second["reused"] is True
    assert first["generation_s"] > 0 and first["processes"] >= 1
    assert "generated 512 JPEGs" in runs["first_log"]
    assert "reusing 512 images" in runs["second_log"]
    assert first["drawn_with"] == "examples/make_shapes.py:draw_shape"
    manifest = json.loads((Path(runs["first"]["work"]) / "full" / "manifest.json").read_text())
    assert manifest["images"] == 512 and manifest["jpeg_quality"] == 90


def test_docs_section_replaced_not_duplicated(runs: dict[str, Any]) -> None:
    for text in (runs["docs_after_first"], runs["docs"]):
        assert text.count(START) == 1 and text.count(END) == 1
        assert text.index(START) < text.index(END)
        assert "## Serving\nkept as is" in text  # the rest of the file is untouched
    section = runs["docs"][runs["docs"].index(START) : runs["docs"].index(END)]
    assert "Prepare: image folder -> memory-mapped arrays" in section
    assert "python -m benchmarks.bench_prepare --quick" in section
    assert "quality 90" in section
    assert "| workers=2, 224 px, N/4 | 128 |" in section


def test_module_imports_nothing_heavy() -> None:
    code = (
        "import sys, benchmarks.bench_prepare\n"
        "heavy = [m for m in ('torch', 'lightning', 'mlflow', 'dvc', 'bentoml') "
        "if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)
