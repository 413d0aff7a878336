"""The bulk-scoring benchmark runs in quick mode (40 real-photo JPEGs, the small cnn, a real
`bentoml serve`, 400 PNGs for the memory check), writes its JSON with the ratios and
replaces only its docs section; its pure parts (the memory figures, the ratios) on fixed
numbers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from benchmarks import bench_predict as bp
from benchmarks import predict_contenders as contenders
from benchmarks import predict_report as report

from conftest import REPO

START, END = "<!-- bench:predict:start -->", "<!-- bench:predict:end -->"
CONTENDERS = ("predict", "plain loop", "posting, sequential", "posting, 4 threads")

# The benchmark as `make bench-predict` runs it; then proof that its own process never
# imported torch (the models are exported in a child process).
RUNNER = """
import runpy, sys
sys.argv = ["benchmarks.bench_predict", *sys.argv[1:]]
runpy.run_module("benchmarks.bench_predict", run_name="__main__")
assert "torch" not in sys.modules, "the benchmark imported torch"
"""


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("bench_predict")
    docs = tmp / "benchmarks.md"
    docs.write_text("# Benchmarks\n\n## Serving\nkept as is\n")
    out = tmp / "bench-predict.json"
    cmd = [sys.executable, "-c", RUNNER, "--quick", "--work", str(tmp / "work")]
    cmd += ["--out", str(out), "--docs", str(docs)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"result": json.loads(out.read_text()), "docs": docs, "out": out, "log": proc.stdout}


@pytest.mark.slow
def test_every_contender_measured_with_ratios(quick: dict[str, Any]) -> None:
    result = quick["result"]
    (run,) = result["runs"]
    assert run["model"]["arch"] == "cnn" and run["model"]["input"] == "3x64x64"
    assert tuple(run["rows"]) == CONTENDERS
    for name, row in run["rows"].items():
        assert row["images"] == 40, name
        assert row["img_per_s"] > 0 and row["seconds"] > 0, name
    mine = run["rows"]["predict"]
    assert mine["batch_size"] in (1, 4, 16, 64) and mine["workers"] >= 1  # the CPU probe's
    assert mine["wall_s"] > mine["seconds"]
    for name in CONTENDERS[1:]:
        assert run["ratios"][name] == pytest.approx(
            mine["img_per_s"] / run["rows"][name]["img_per_s"]
        )
        assert run["ratios"][name + report.WALL] == pytest.approx(
            mine["wall_img_per_s"] / run["rows"][name]["img_per_s"]
        )
        assert run["ceiling_ratios"][name] > 0
    assert run["costs"]["decode_ms"] > 0 and run["costs"]["ceiling_img_per_s"] > 0
    targets = {t["target"]: t for t in run["targets"]}
    assert "predict / plain loop >= 4x" in targets
    assert "predict / posting, sequential >= 3x" in targets
    assert result["machine"]["cores"] >= 1 and "loadavg_end" in result["machine"]


@pytest.mark.slow
def test_bulk_probabilities_are_the_services(quick: dict[str, Any]) -> None:
    check = quick["result"]["runs"][0]["check"]
    assert check["files"] == 12
    assert check["max_abs_diff"] <= 1e-6 and check["within"] is True
    assert check["top1_agree"] == 12


@pytest.mark.slow
def test_memory_sampled_over_the_process_tree(quick: dict[str, Any]) -> None:
    m = quick["result"]["memory"]
    assert m["images"] == m["scored"] == 400
    assert m["processes"] >= 3  # the command, its forkserver, decode workers
    assert 0 < m["start_rss"] <= m["peak_rss"]
    assert m["growth_rss"] == m["peak_rss"] - m["start_rss"]
    assert m["model"]["input"] == "1x28x28" and m["dataset"]["size_px"] == 28


@pytest.mark.slow
def test_the_folder_is_real_photo_jpegs(quick: dict[str, Any]) -> None:
    ds = quick["result"]["dataset"]
    assert ds["images"] == 40 and ds["reused"] is False
    assert any(Path(s["path"]).name == "china.jpg" for s in ds["sources"])
    photos = Path(quick["result"]["work"]) / "photos-40-s0" / "photos"
    files = sorted(photos.rglob("*.jpg"))
    assert len(files) == 40 and len({f.parent for f in files}) == 10
    for f in files[:8]:
        with Image.open(f) as im:
            assert im.format == "JPEG" and im.mode == "RGB"
            assert all(200 <= side <= 640 for side in im.size)


@pytest.mark.slow
def test_small_images_side_by_side(quick: dict[str, Any]) -> None:
    """200 Fashion-MNIST PNGs: the console script, python -m trainyard.bulk and the plain
    loop on the same files, the ratios from their seconds, predict's first row and place."""
    small = quick["result"]["fashion"]
    assert small["dataset"]["images"] == 200 and small["dataset"]["size_px"] == 28
    rows = small["rows"]
    assert tuple(rows) == ("predict", "python -m trainyard.bulk", "plain loop")
    plain = rows["plain loop"]["seconds"]
    assert small["ratios"]["whole command"] == pytest.approx(plain / rows["predict"]["wall_s"])
    bulk = rows["python -m trainyard.bulk"]
    assert small["ratios"]["python -m trainyard.bulk, whole command"] == pytest.approx(
        plain / bulk["wall_s"]
    )
    for row in (rows["predict"], bulk):
        assert row["images"] == 200 and 0 < row["first_row_s"] < row["wall_s"]
        assert row["scoring"] and row["place"]
    section = quick["docs"].read_text()
    assert "Small images (`--fashion 200`)" in section
    assert "| python -m trainyard.bulk, whole command | 200 |" in section


@pytest.mark.slow
def test_docs_section_replaced_and_rendered(quick: dict[str, Any], tmp_path: Path) -> None:
    text = quick["docs"].read_text()
    assert text.count(START) == 1 and text.count(END) == 1
    assert "## Serving\nkept as is" in text
    section = text[text.index(START) : text.index(END)]
    assert "## Bulk scoring" in section
    assert "python -m benchmarks.bench_predict --quick" in section
    assert "| cnn 3x64x64 | plain loop | 40 |" in section
    # --render: the same section again, from the JSON alone
    again = tmp_path / "benchmarks.md"
    again.write_text(text)
    bp.main(["--render", "--out", str(quick["out"]), "--docs", str(again)])
    assert again.read_text() == text


def test_memory_figures_window_and_growth() -> None:
    mib = 2**20
    # (seconds, tree RSS, tree PSS, processes, own RSS): start-up, then 3 workers up
    samples = [(0.0, 50 * mib, 40 * mib, 1, 50 * mib)]
    samples += [(0.5 * i, (200 + i) * mib, 150 * mib, 5, 120 * mib) for i in range(1, 9)]
    samples += [(5.0, 400 * mib, 300 * mib, 3, 390 * mib)]  # the table written at the end
    summary = {"scored": 10, "speed": {"img_per_s": 5.0, "seconds": 2.0}}
    m = contenders.memory_figures(samples, summary, 6.0, 10)
    assert m["processes"] == 5
    assert m["start_rss"] == 201 * mib and m["peak_rss"] == 400 * mib
    assert m["growth_rss"] == 199 * mib and m["within"]
    assert m["late_growth_rss"] == (208 - 203) * mib  # a quarter in (sample 3) to the end


def test_check_files_spread_over_the_folder() -> None:
    assert bp.check_files(100, 5) == [0, 25, 50, 74, 99]
    assert bp.check_files(3, 50) == [0, 1, 2]
