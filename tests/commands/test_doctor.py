"""`trainyard doctor`: the collectors run for real on this machine (through the console
script); the verdicts are judged on crafted facts for machines we do not have (GPUs with
too little RAM, broken CUDA, datasets larger than memory)."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from PIL import Image

from trainyard import cli
from trainyard.commands.doctor import main as doctor_main
from trainyard.core.card import SPLITS, Card
from trainyard.core.config import parse_params
from trainyard.data.sources import prepare_source
from trainyard.doctor.collect import collect
from trainyard.doctor.dataset import collect_dataset
from trainyard.doctor.machine import PROBE_MODEL, probe, probe_provider
from trainyard.doctor.render import emit, render_table
from trainyard.doctor.verdicts import KEYS, report, verdicts

from conftest import REPO, VENV_BIN, has_cuda, run_ok

GiB = 2**30
HEAVY = ("mlflow", "dvc", "bentoml")


def meminfo_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemTotal in /proc/meminfo")


@pytest.fixture(scope="module")
def doctor_json() -> dict[str, Any]:
    """`trainyard doctor --json` as a person runs it: the console script, from the repo.
    Its "runs in seconds" is not timed here (a loaded machine would fail it): what keeps it
    quick is checked instead, that it never imports mlflow, dvc or bentoml
    (test_module_run_never_imports_mlflow_dvc_or_bentoml) and sizes the dataset from its card
    or the expected counts, not by reading it (``dataset["from"]`` below)."""
    proc = run_ok([str(VENV_BIN / "trainyard"), "doctor", "--json"], timeout=120)
    return json.loads(proc.stdout)


def test_console_script_json_describes_this_machine(doctor_json):
    doc = doctor_json
    assert list(doc)[: len(KEYS)] == list(KEYS)
    assert doc["ok"] is True
    assert doc["cpu"]["logical_cores"] == os.cpu_count()
    assert doc["cpu"]["model"]
    assert doc["ram"]["total_bytes"] == meminfo_total()
    assert 0 < doc["ram"]["available_bytes"] <= doc["ram"]["total_bytes"]
    ort = doc["onnxruntime"]
    assert ort["loads"]["CPUExecutionProvider"]["loads"] is True
    assert doc["torch"]["version"]
    assert doc["disk"] and all(d["free_bytes"] > 0 for d in doc["disk"])
    for v in doc["verdicts"]:
        assert v["level"] in ("ok", "warn", "error") and v["verdict"] and v["why"], v
    checks = {v["check"] for v in doc["verdicts"]}
    assert {"torch/CUDA", "RAM vs GPU", "ONNX Runtime", "disk", "dataset"} <= checks
    assert {"placement", "precision"} <= checks
    dataset = doc["dataset"]
    assert dataset["from"] in ("card", "expected") and dataset["placed_bytes"] > 0
    assert doc["placement"]["where"] in ("device", "ram", "mmap")
    assert "GiB" in doc["placement"]["why"]  # choose_placement's own reason
    assert doc["precision"]["precision"] and doc["precision"]["why"]
    # the batch the recipe will take, named before training (a GPU measures its ladder)
    assert "batch" in checks and doc["batch"]["by"] == "recipe"
    if not has_cuda():  # the repo's Fashion-MNIST params on a CPU: the data's rule
        assert doc["batch"]["batch_size"] == 256, doc["batch"]
        assert doc["batch"]["verdict"] == "train at batch 256 (recipe)"


@pytest.mark.skipif(has_cuda(), reason="describes a machine without a GPU")
def test_without_a_gpu_nothing_claims_cuda(doctor_json):
    doc = doctor_json
    assert doc["gpus"] == []
    assert doc["torch"]["cuda_available"] is False
    ort = doc["onnxruntime"]
    for provider in ("CUDAExecutionProvider", "TensorrtExecutionProvider"):
        assert ort["loads"].get(provider, {}).get("loads") is not True
    assert ort["requested"]["evaluate"]["providers"] == ["CPUExecutionProvider"]
    assert doc["ram_vs_gpu"]["verdict"].startswith("no GPU")
    assert doc["placement"]["where"] != "device"
    assert doc["precision"]["accelerator"] == "cpu"


@pytest.mark.gpu
def test_on_a_gpu_machine_every_gpu_is_described(doctor_json):
    doc = doctor_json
    assert doc["gpus"], "torch sees a GPU but the doctor lists none"
    for g in doc["gpus"]:
        assert g["name"] and g["memory_bytes"] > 0 and g["free_bytes"] > 0
        assert g["compute_capability"] and g["driver"] and g["cuda_runtime"]
        assert isinstance(g["bf16"], bool)
    assert doc["ram_vs_gpu"]["ratio"] > 0
    assert doc["precision"]["accelerator"] == "gpu"
    assert doc["onnxruntime"]["loads"]["CUDAExecutionProvider"]["loads"] is True


def test_table_is_readable_and_exits_zero():
    out = run_ok([str(VENV_BIN / "trainyard"), "doctor"], timeout=120).stdout
    for label in ("CPU", "RAM", "torch", "ONNX Runtime", "disk", "verdicts", "why:"):
        assert label in out, label
    assert "placement" in out and "precision" in out


@pytest.mark.skipif(has_cuda(), reason="asks for a GPU this machine lacks")
def test_asking_for_a_gpu_this_machine_lacks_exits_1_with_what_to_do(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text(
        yaml.safe_dump({"train": {"accelerator": "gpu"}, "evaluate": {"device": "cuda"}})
    )
    proc = subprocess.run(
        [str(VENV_BIN / "trainyard"), "doctor", "--params", str(params), "--data", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "FAIL" in proc.stdout and "BROKEN" in proc.stdout
    err = proc.stderr
    assert "broken: precision" in err and "torch sees no CUDA GPU" in err  # resolve_device
    assert "broken: ONNX Runtime" in err and "evaluate.device cuda" in err  # choose_providers
    assert "use 'auto' or 'cpu'" in err


def test_module_run_never_imports_mlflow_dvc_or_bentoml():
    code = (
        "import sys, trainyard.commands.doctor as d\n"
        "code = d.main(['--json'])\n"
        f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "sys.exit(code)\n"
    )
    assert json.loads(run_ok([sys.executable, "-c", code], timeout=120).stdout)["ok"] is True


def test_bad_usage_exits_2(capsys, tmp_path):
    assert cli.main([]) == 2  # no subcommand
    assert cli.main(["doctor", "--no-such-flag"]) == 2
    assert doctor_main(["--params", str(tmp_path / "missing.yaml")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert cli.main(["doctor", "--help"]) == 0


def test_probe_model_is_a_valid_identity_model():
    import onnx
    import onnx.helper as h

    model = onnx.load_model_from_string(PROBE_MODEL)
    onnx.checker.check_model(model)
    assert [n.op_type for n in model.graph.node] == ["Identity"]
    graph = h.make_graph(
        [h.make_node("Identity", ["x"], ["y"])],
        "probe",
        [h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
        [h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
    )
    rebuilt = h.make_model(graph, opset_imports=[h.make_opsetid("", 13)], ir_version=8)
    assert rebuilt.SerializeToString() == PROBE_MODEL


# ----------------------------------------------------------------- provider probes

# What onnxruntime-gpu prints without the TensorRT libraries (its Python print()), before
# the session falls back to the CPU.
EP_ERROR = (
    b"*************** EP Error ***************\n"
    b"EP Error ... Please install TensorRT libraries (libnvinfer.so.10) when using "
    b"['TensorrtExecutionProvider', 'CPUExecutionProvider']\n"
    b"Falling back to ['CPUExecutionProvider'] and retrying.\n"
    b"****************************************\n"
)


def test_what_a_probe_prints_natively_is_its_reason_not_stdout(capfd):
    def attempt() -> list[str]:
        os.write(1, EP_ERROR)  # fd 1, under Python's sys.stdout, as native code writes
        ctypes.CDLL(None).printf(b"buffered by C's stdio\n")  # flushed into the capture
        print("and through Python's print()")
        return ["CPUExecutionProvider"]  # the session fell back

    result = probe("TensorrtExecutionProvider", attempt)
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")
    assert result["loads"] is False
    assert result["why"].startswith("EP Error") and "libnvinfer.so.10" in result["why"]
    said = "\n".join(result["said"])
    assert "Falling back" in said and "buffered by C" in said and "print()" in said
    # the descriptors are back: what is written now reaches stdout
    os.write(1, b"after\n")
    assert capfd.readouterr().out == "after\n"


def test_a_probe_that_raises_restores_stdout_and_prefers_ort_s_error_log(capfd):
    log = b"\x1b[1;31m2026-01-01 [E:onnxruntime:Default, bridge.cc:1 Get()] libcudnn missing\n"

    def logs_then_falls_back() -> list[str]:
        os.write(2, EP_ERROR + log)  # the C++ log line says more than the EP Error banner
        return ["CPUExecutionProvider"]

    def raises() -> list[str]:
        os.write(1, b"half a line")
        raise RuntimeError("session failed\nsecond line")

    assert probe("CUDAExecutionProvider", logs_then_falls_back)["why"] == "libcudnn missing"
    result = probe("CUDAExecutionProvider", raises)
    assert result == {"loads": False, "why": "session failed", "said": ["half a line"]}
    print("after", flush=True)
    assert capfd.readouterr() == ("after\n", "")


def test_tensorrt_probe_of_a_gpu_build_without_tensorrt_prints_nothing(capfd):
    ort = pytest.importorskip("onnxruntime")
    if "TensorrtExecutionProvider" not in ort.get_available_providers():
        pytest.skip("this onnxruntime build has no TensorRT provider to fail loading")
    result = probe_provider(ort, "TensorrtExecutionProvider")
    out, _ = capfd.readouterr()
    assert out == ""  # ORT's EP Error block went into the probe, not before a JSON document
    if not result["loads"]:  # a machine with TensorRT installed loads it
        assert result["why"] and result["said"]


# ----------------------------------------------------------------- crafted machines


def gpu(name: str = "NVIDIA H100", memory: float = 80, free: float = 79, cc: str = "9.0"):
    return {
        "index": 0,
        "name": name,
        "memory_bytes": int(memory * GiB),
        "free_bytes": int(free * GiB),
        "compute_capability": cc,
        "bf16": float(cc) >= 8,
        "torch_bf16": True,
        "usable_by_torch": True,
        "driver": "550.54.15",
        "driver_cuda": "12.4",
        "cuda_runtime": "12.4",
    }


def machine(
    *,
    ram: float = 256,
    ram_free: float = 240,
    gpus: list[dict[str, Any]] | None = None,
    placed: float = 0.05,
    resident: bool = True,
    cuda_available: bool | None = None,
    torch_cuda: str | None = "12.4",
    driver_gpus: int | None = None,
    driver_cuda: str = "12.4",
    accelerator: str = "auto",
    precision: str | None = None,
    cuda_loads: bool | None = None,
    evaluate_providers: list[str] | None = None,
) -> dict[str, Any]:
    """Facts as `collect` would gather them, for a machine described by keywords."""
    gpus = [] if gpus is None else gpus
    on_gpu = bool(gpus) if cuda_available is None else cuda_available
    driver_gpus = len(gpus) if driver_gpus is None else driver_gpus
    if cuda_loads is None:
        cuda_loads = bool(driver_gpus)
    if evaluate_providers is None:
        evaluate_providers = (
            ["CUDAExecutionProvider", "CPUExecutionProvider"]
            if driver_gpus
            else ["CPUExecutionProvider"]
        )
    placed_bytes = int(placed * GiB)
    precision = precision or ("bf16-mixed" if on_gpu else "32-true")
    return {
        "params": {"path": "params.yaml", "loaded": True, "error": None},
        "cpu": {"model": "x", "logical_cores": 8, "bf16": False, "flags": ["avx2"]},
        "ram": {
            "total_bytes": int(ram * GiB),
            "available_bytes": int(ram_free * GiB),
            "cgroup_limit_bytes": None,
        },
        "gpus": gpus,
        "torch": {
            "version": "2.6.0",
            "cuda": torch_cuda,
            "cuda_available": on_gpu,
            "cuda_error": None,
            "driver": {"gpus": driver_gpus, "version": "550.54.15", "cuda": driver_cuda},
        },
        "onnxruntime": {
            "version": "1.20.1",
            "build_providers": ["CUDAExecutionProvider", "CPUExecutionProvider"],
            "loads": {
                "CPUExecutionProvider": {"loads": True, "why": "ran"},
                "CUDAExecutionProvider": {
                    "loads": cuda_loads if driver_gpus else None,
                    "why": "ran" if cuda_loads else "libcudnn.so.9: cannot open shared object",
                },
            },
            "requested": {
                "evaluate": {"device": "auto", "providers": evaluate_providers},
                "serve": {"device": "auto", "providers": evaluate_providers},
            },
        },
        "disk": [
            {
                "what": "data",
                "path": "data/prepared",
                "free_bytes": 500 * GiB,
                "total_bytes": 1000 * GiB,
                "filesystem": 1,
            }
        ],
        "dataset": {
            "source": "folder",
            "from": "card",
            "channels": 3,
            "height": 224,
            "width": 224,
            "splits": {
                "train": {"images": 1, "bytes": placed_bytes},
                "val": {"images": 1, "bytes": 0},
                "test": {"images": 1, "bytes": 0},
            },
            "placed_bytes": placed_bytes,
            "total_bytes": placed_bytes,
            "note": "prepared",
        },
        "train": {
            "accelerator": accelerator,
            "devices": "auto",
            "precision": "auto",
            "device_resident": resident,
            "data_path": "fast",
            "memory_budget": 0.5,
        },
        "precision": {
            "setting": "auto",
            "accelerator": "gpu" if on_gpu else "cpu",
            "precision": precision,
            "device": gpus[0]["name"] if on_gpu and gpus else "cpu",
            "error": None,
        },
    }


def by_check(facts: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["check"]: v for v in verdicts(facts)}


def test_dataset_over_the_ram_budget_is_memory_mapped():
    v = by_check(machine(ram=64, ram_free=60, placed=40))["placement"]
    assert v["where"] == "mmap" and v["fits"] == "stream"
    assert "must stream" in v["verdict"] and "memory-mapped" in v["verdict"]
    assert "over 50% of 60.0 GiB available RAM" in v["why"]
    assert v["level"] == "ok"


def test_dataset_that_fits_the_gpu_is_device_resident():
    v = by_check(machine(gpus=[gpu()], placed=20))["placement"]
    assert v["where"] == "device" and v["fits"] == "gpu"
    assert "device-resident" in v["verdict"]
    assert "fits 50% of the GPU's 79.0 GiB free" in v["why"]


def test_too_big_for_the_gpu_but_fits_ram_goes_to_ram_and_says_why():
    v = by_check(machine(gpus=[gpu(memory=24, free=23)], placed=20))["placement"]
    assert v["where"] == "ram" and v["fits"] == "ram"
    assert "over 50% of the GPU's 23.0 GiB free" in v["why"]
    assert "fits 50% of 240.0 GiB available RAM" in v["why"]


def test_fits_the_gpu_but_device_resident_off_is_named():
    v = by_check(machine(gpus=[gpu()], placed=1, resident=False))["placement"]
    assert v["where"] == "ram" and v["fits"] == "gpu"
    assert "train.device_resident is false" in v["why"]


def test_container_limit_below_memavailable_warns():
    facts = machine(ram=256, ram_free=240, placed=50)
    facts["ram"]["cgroup_limit_bytes"] = 32 * GiB
    v = by_check(facts)["placement"]
    assert v["where"] == "ram" and v["level"] == "warn"
    assert "limited to 32.0 GiB" in v["why"]


def test_ram_below_gpu_memory_breaks_the_2x_rule():
    v = by_check(machine(ram=64, ram_free=60, gpus=[gpu(memory=80)]))["RAM vs GPU"]
    assert v["level"] == "warn"
    assert "below GPU memory" in v["verdict"] and "2x" in v["verdict"]
    assert "64.0 GiB RAM vs 80.0 GiB GPU memory (0.80x)" in v["why"]
    assert v["ratio"] == 0.8


def test_ram_between_1x_and_2x_is_ok_but_below_the_ideal():
    v = by_check(machine(ram=120, ram_free=100, gpus=[gpu(memory=80)]))["RAM vs GPU"]
    assert v["level"] == "ok" and "below the ideal 2x" in v["verdict"]
    v = by_check(machine(ram=256, gpus=[gpu(memory=80)]))["RAM vs GPU"]
    assert v["level"] == "ok" and "3.2x" in v["verdict"]


def test_two_gpus_count_together_against_ram():
    gpus = [gpu(memory=80), {**gpu(memory=80), "index": 1}]
    v = by_check(machine(ram=128, gpus=gpus))["RAM vs GPU"]
    assert v["level"] == "warn" and v["gpu_bytes"] == 160 * GiB


def test_cuda_build_with_a_gpu_but_unusable_cuda_is_broken(capsys):
    facts = machine(
        gpus=[],
        cuda_available=False,
        torch_cuda="12.4",
        driver_gpus=1,
        driver_cuda="11.4",
        cuda_loads=True,
    )
    facts["torch"]["cuda_error"] = "The NVIDIA driver on your system is too old"
    doc = report(facts)
    v = {v["check"]: v for v in doc["verdicts"]}["torch/CUDA"]
    assert v["level"] == "error" and doc["ok"] is False
    assert "built for CUDA 12.4" in v["verdict"] and "CUDA is unusable" in v["verdict"]
    assert "NVIDIA driver on your system is too old" in v["why"]  # torch's own reason
    assert "supports CUDA up to 11.4" in v["why"] and "update the NVIDIA driver" in v["why"]
    assert emit(doc, as_json=True) == 1
    out, err = capsys.readouterr()
    assert json.loads(out)["ok"] is False
    assert "trainyard doctor: broken: torch/CUDA" in err and "update the NVIDIA driver" in err


def test_cpu_only_torch_on_a_gpu_machine_is_broken_unless_cpu_is_asked_for():
    facts = machine(cuda_available=False, torch_cuda=None, driver_gpus=1)
    assert by_check(facts)["torch/CUDA"]["level"] == "error"
    facts = machine(cuda_available=False, torch_cuda=None, driver_gpus=1, accelerator="cpu")
    assert by_check(facts)["torch/CUDA"]["level"] == "warn"


def test_requested_cuda_provider_that_does_not_load_is_broken(capsys):
    facts = machine(gpus=[gpu()], cuda_loads=False)
    doc = report(facts)
    v = {v["check"]: v for v in doc["verdicts"]}["ONNX Runtime"]
    assert v["level"] == "error" and not doc["ok"]
    assert "libcudnn.so.9" in v["why"] and "evaluate.device auto" in v["why"]
    assert "set evaluate.device and serve.device to cpu" in v["why"]
    assert emit(doc) == 1
    assert "broken: ONNX Runtime" in capsys.readouterr().err


def test_cuda_device_asked_for_without_a_gpu_is_broken():
    facts = machine()
    facts["onnxruntime"]["requested"]["evaluate"] = {
        "device": "cuda",
        "providers": None,
        "error": "device 'cuda' asked for, but no CUDA GPU is visible; use 'auto' or 'cpu'",
    }
    v = by_check(facts)["ONNX Runtime"]
    assert v["level"] == "error" and "evaluate.device cuda" in v["why"]


def test_a_healthy_gpu_machine_is_ok_and_the_table_renders():
    doc = report(machine(gpus=[gpu()], placed=10))
    assert doc["ok"] is True, [v for v in doc["verdicts"] if v["level"] != "ok"]
    checks = {v["check"]: v for v in doc["verdicts"]}
    assert "compute capability 9.0" in checks["precision"]["why"]
    assert checks["ONNX Runtime"]["verdict"].endswith("the CUDA provider")
    text = render_table(doc)
    assert "GPU 0" in text and "NVIDIA H100" in text and "device-resident" in text


def test_emulated_bf16_on_an_old_gpu_warns():
    facts = machine(gpus=[gpu(name="Tesla T4", memory=16, free=15, cc="7.5")])
    v = by_check(facts)["precision"]
    assert v["level"] == "warn" and "emulated" in v["why"] and "16-mixed" in v["why"]


def test_precision_error_from_resolve_device_is_broken():
    facts = machine()
    facts["precision"] = {
        "setting": "auto",
        "accelerator": None,
        "precision": None,
        "device": None,
        "error": "train.accelerator: 'gpu' asked for, but torch sees no CUDA GPU",
    }
    v = by_check(facts)["precision"]
    assert v["level"] == "error" and "torch sees no CUDA GPU" in v["why"]


def test_unprepared_dataset_without_disk_room_is_broken():
    facts = machine(placed=100)
    facts["dataset"]["from"] = "expected"
    facts["disk"][0]["free_bytes"] = 50 * GiB
    v = by_check(facts)["disk"]
    assert v["level"] == "error" and "not enough disk" in v["verdict"]


# ----------------------------------------------------------------- real dataset collectors


def write_params(path: Path, **data: Any) -> Path:
    path.write_text(yaml.safe_dump({"data": data}))
    return path


def shapes_card(size: int = 64, counts: tuple[int, int, int] = (300, 40, 40)) -> Card:
    return Card(
        source="folder",
        classes=("circle", "square", "triangle"),
        channels=3,
        height=size,
        width=size,
        mean=(0.5, 0.5, 0.5),
        std=(0.25, 0.25, 0.25),
        resize="crop",
        counts={s: {"total": n, "per_class": {}} for s, n in zip(SPLITS, counts, strict=True)},
    )


def test_prepared_folder_card_drives_the_dataset_and_placement(tmp_path):
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    (prepared / "card.json").write_text(shapes_card().to_json())
    params = write_params(tmp_path / "params.yaml", source="folder", folder="photos")
    facts = collect(params, prepared)
    ds = facts["dataset"]
    assert ds["from"] == "card" and ds["source"] == "folder"
    assert (ds["channels"], ds["height"], ds["width"]) == (3, 64, 64)
    per_image = 3 * 64 * 64
    assert ds["splits"]["train"] == {"images": 300, "bytes": 300 * per_image}
    assert ds["placed_bytes"] == (300 + 40) * per_image
    doc = report(facts)
    checks = {v["check"]: v for v in doc["verdicts"]}
    assert "train 300, val 40, test 40 images of 3x64x64 (card)" in checks["dataset"]["verdict"]
    assert doc["placement"]["bytes"] == ds["placed_bytes"]
    assert doc["placement"]["where"] in ("device", "ram")


def test_stale_card_falls_back_to_the_expected_size_with_a_warning(tmp_path):
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    (prepared / "card.json").write_text(shapes_card(size=32).to_json())
    photos = tmp_path / "photos"
    for cls, n in (("a", 8), ("b", 12)):
        (photos / cls).mkdir(parents=True)
        for i in range(n):
            (photos / cls / f"{i}.PNG").write_bytes(b"not decoded, only counted")
        (photos / cls / "notes.txt").write_text("ignored")
    params = parse_params({"data": {"source": "folder", "folder": "photos", "image_size": 16}})
    ds = collect_dataset(params, tmp_path, prepared)
    assert ds["from"] == "expected" and ds["stale_card"] is True
    assert "does not match params" in ds["note"]
    counts = {s: v["images"] for s, v in ds["splits"].items()}
    assert sum(counts.values()) == 20 and counts["val"] == counts["test"] == 2
    assert ds["channels"] == 3 and ds["splits"]["train"]["bytes"] == 16 * 3 * 16 * 16
    assert by_check({**machine(), "dataset": ds})["dataset"]["level"] == "warn"


def test_unprepared_fashion_mnist_uses_its_known_size(tmp_path):
    params = parse_params({"data": {"source": "fashion-mnist", "limit": 10000, "val_size": 1000}})
    ds = collect_dataset(params, tmp_path, tmp_path / "nothing")
    counts = {s: v["images"] for s, v in ds["splits"].items()}
    assert counts == {"train": 9000, "val": 1000, "test": 10000}
    assert ds["placed_bytes"] == 10000 * 28 * 28 and ds["from"] == "expected"


def test_missing_folder_source_is_a_broken_dataset(tmp_path):
    params = write_params(tmp_path / "params.yaml", source="folder", folder="nope")
    facts = collect(params, tmp_path / "prepared")
    v = by_check(facts)["dataset"]
    assert v["level"] == "error" and "nope" in v["why"]


def tricky_split_tree(photos: Path) -> None:
    """A train/val/test tree with what trips a folder walk: __MACOSX (in both cases) and
    $RECYCLE.BIN folders of real images, .DS_Store, an AppleDouble ``._`` file, Thumbs.db,
    desktop.ini, uppercase extensions, and a sidecar that is no image."""
    n = 0

    def image(path: Path, fmt: str = "PNG") -> None:
        nonlocal n
        n += 1  # a colour per image: no duplicates across splits
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (12, 10), (n % 256, 7 * n % 256, 50)).save(path, format=fmt)

    for split, per_class in (("train", 4), ("val", 2), ("test", 1)):
        for cls in ("cat", "dog"):
            folder = photos / split / cls
            for i in range(per_class):
                image(folder / f"{i}.png")
            image(folder / "SHOUTED.JPG", "JPEG")
            image(folder / "Also.PNG")
            image(folder / "__macosx" / "ghost.png")  # litter in any case
            image(folder / "$RECYCLE.BIN" / "deleted.png")
            (folder / "._1.png").write_bytes(b"\x00\x05\x16\x07 AppleDouble, not a PNG")
            (folder / "Thumbs.db").write_bytes(b"\xd0\xcf\x11\xe0")
            (folder / "desktop.ini").write_text("[.ShellClassInfo]\n")
            (folder / "notes.txt").write_text("not an image\n")
    image(photos / "__MACOSX" / "train" / "cat" / "resource.png")  # not a 4th top folder
    (photos / ".DS_Store").write_bytes(b"Bud1")
    (photos / "train" / ".DS_Store").write_bytes(b"Bud1")


def test_doctor_and_prepare_see_the_same_files_in_a_tricky_tree(tmp_path):
    """One set of folder rules (trainyard.data.walk): the doctor's expected split sizes
    are exactly what prepare then writes, litter and case included."""
    photos = tmp_path / "photos"
    tricky_split_tree(photos)
    params = parse_params(
        {"data": {"source": "folder", "folder": "photos", "image_size": 8, "workers": 1}}
    )
    ds = collect_dataset(params, tmp_path, tmp_path / "prepared")
    assert ds["from"] == "expected" and "train/val/test folders" in ds["note"]
    doctor_counts = {s: v["images"] for s, v in ds["splits"].items()}
    assert doctor_counts == {"train": 12, "val": 8, "test": 6}  # per class: n + .JPG + .PNG

    data = params.data.model_copy(update={"folder": str(photos)})
    card = prepare_source("unused", tmp_path / "prepared", data, seed=0)
    assert {s: card.counts[s]["total"] for s in SPLITS} == doctor_counts
    assert card.extra["layout"] == "splits" and card.skipped == ()
    assert card.ignored == 6  # the notes.txt files; litter is not even counted
