"""The input-bound verdict: its thresholds and fixes, and two real short CPU trainings: per-
sample JPEG decoding from a folder is input-bound, the fast path over prepared arrays is not.
How busy the GPU was (NVML): "GPU underfed" from the figure, and the figure's absence on a
CPU or without NVML; measured for real on a GPU."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from trainyard.core.card import Card
from trainyard.core.handoffs import GpuBusy, InputBound
from trainyard.model.classifier import Classifier
from trainyard.training.builder import build_trainer
from trainyard.training.datamodule import TensorBatches
from trainyard.training.gpu_busy import GpuBusyMeter, NvmlSampler, busy_figures, gpu_busy_of
from trainyard.training.perf import InputBoundMeter, StepTotals
from trainyard.training.perf_verdict import LEVELS, level_of, verdict

from conftest import has_cuda, make_card

# ------------------------------------------------------------------ verdict (pure)


@pytest.mark.parametrize(
    ("fraction", "level"),
    [
        (0.0, "not input-bound"),
        (0.049, "not input-bound"),
        (0.05, "moderately input-bound"),
        (0.19, "moderately input-bound"),
        (0.20, "input-bound"),
        (0.93, "input-bound"),
    ],
)
def test_levels_follow_tensorflows_thresholds(fraction, level):
    assert level_of(fraction) == level
    v = verdict(fraction, data_path="fast", device="cuda", placement="device")
    assert v["level"] == level and v["data_wait_fraction"] == pytest.approx(fraction)
    assert f"{fraction:.0%}" in v["why"]


def test_naive_path_fix_is_the_fast_path():
    v = verdict(0.6, data_path="naive", device="cuda", placement="ram")
    assert v["level"] == "input-bound"
    assert "train.data_path: fast" in v["fix"]


def test_custom_per_sample_loader_fix_is_preparing_the_images_or_workers():
    v = verdict(0.4, data_path=None, device="cpu", workers=0)
    assert "dvc repro prepare" in v["fix"] and "train.data_path: fast" in v["fix"]
    assert "num_workers is 0" in v["fix"]


def test_memory_mapped_fast_path_fix_is_residency_and_budget():
    gpu = verdict(0.3, data_path="fast", device="cuda", placement="mmap", device_resident=True)
    assert "train.device_resident: true" in gpu["fix"] and "train.memory_budget" in gpu["fix"]
    cpu = verdict(0.1, data_path="fast", device="cpu", placement="mmap")
    assert cpu["level"] == "moderately input-bound"
    assert "train.memory_budget" in cpu["fix"] and "device_resident" not in cpu["fix"]


def test_fast_path_in_ram_on_a_gpu_fix_is_device_resident():
    off = verdict(0.25, data_path="fast", device="cuda", placement="ram", device_resident=False)
    assert "set train.device_resident: true" in off["fix"]
    on = verdict(0.25, data_path="fast", device="cuda", placement="ram", device_resident=True)
    assert "raise train.memory_budget" in on["fix"]


def test_fast_path_already_resident_fix_is_batch_size():
    v = verdict(0.3, data_path="fast", device="cuda", placement="device")
    assert "train.batch_size" in v["fix"]


def test_not_input_bound_names_no_input_fix_but_flags_a_costly_copy():
    v = verdict(0.01, data_path="fast", device="cpu", placement="ram")
    assert v["level"] == "not input-bound" and v["fix"].startswith("none on the input side")
    copy = verdict(0.01, h2d_fraction=0.3, data_path="fast", device="cuda", placement="ram")
    assert "train.device_resident: true" in copy["fix"] and "30%" in copy["why"]


def test_step_totals_fraction():
    t = StepTotals()
    t.add(3.0, 1.0, 6.0)
    t.add(1.0, 0.0, 9.0)
    m = t.means()
    assert m["data_wait_fraction"] == pytest.approx(4 / 20)
    assert (m["step_ms"], m["compute_ms"]) == (pytest.approx(10.0), pytest.approx(7.5))


# ------------------------------------------------------------------ real trainings


def card(channels: int, size: int, classes: int = 4) -> dict:
    return make_card(classes, (channels, size, size)).contract()


class JpegFolder(Dataset):
    """The textbook loader: open, decode and resize one JPEG per ``__getitem__``."""

    def __init__(self, files: list[Path], labels: list[int], size: int) -> None:
        self.files, self.labels, self.size = files, labels, size

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        with Image.open(self.files[i]) as im:
            im = im.convert("RGB").resize((self.size, self.size), Image.BILINEAR)
            x = torch.from_numpy(np.asarray(im).copy()).permute(2, 0, 1)
        return x, self.labels[i]


class Linear(L.LightningModule):
    """A model whose step costs about a millisecond, like a small net's step on a GPU."""

    def __init__(self, pixels: int, classes: int = 4) -> None:
        super().__init__()
        self.net = torch.nn.Linear(pixels, classes)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x.flatten(1).float() / 255)
        return torch.nn.functional.cross_entropy(logits, y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.fixture
def one_thread():
    """One torch thread: on a busy shared 2-core machine two OpenMP threads contending with
    other processes stretch even a 1 ms step to tens of ms, which says nothing about input."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def fit(model: L.LightningModule, loader: DataLoader, root: Path, data_path: str | None = None):
    meter = InputBoundMeter(data_path=data_path)
    L.seed_everything(0, verbose=False)
    trainer = build_trainer(max_epochs=1, root=root, callbacks=[meter])
    trainer.fit(model, loader)
    return meter


def test_per_sample_jpeg_decoding_from_a_folder_is_input_bound(tmp_path, caplog, one_thread):
    caplog.set_level(logging.INFO, logger="trainyard")
    rng = np.random.default_rng(0)
    files, labels = [], []
    for i in range(256):
        # Smooth noise: a realistic JPEG (pure noise would be an unusually slow decode).
        small = rng.integers(0, 256, size=(20, 20, 3), dtype=np.uint8)
        im = Image.fromarray(small).resize((160, 160), Image.BICUBIC)
        path = tmp_path / f"c{i % 4}" / f"img_{i:03d}.jpg"
        path.parent.mkdir(exist_ok=True)
        im.save(path, quality=90)
        files.append(path)
        labels.append(i % 4)
    loader = DataLoader(JpegFolder(files, labels, 32), batch_size=32, shuffle=True, num_workers=0)
    # Decoding 32 JPEGs of 160 px costs ~10 ms a batch; the step's compute ~1 ms (a GPU's
    # share, on a CPU): the step waits for the batch most of the time.
    meter = fit(Linear(3 * 32 * 32), loader, tmp_path)
    r = meter.result
    assert r is not None, "no verdict"
    assert r["level"] == "input-bound", r
    assert r["data_wait_fraction"] >= 0.5
    assert r["steps"] == 8 - r["warmup_steps_excluded"] and r["warmup_steps_excluded"] == 3
    assert "dvc repro prepare" in r["fix"] and "num_workers is 0" in r["fix"]
    assert r["timer"] == "perf_counter" and r["device"] == "cpu"
    verdicts = [m for m in caplog.messages if m.startswith("input-bound verdict: ")]
    assert len(verdicts) == 1 and verdicts[0].startswith("input-bound verdict: input-bound: ")
    assert meter.epochs and meter.epochs[0]["data_wait_fraction"] >= 0.2


def test_fast_path_over_prepared_arrays_is_not_input_bound(tmp_path, caplog, one_thread):
    caplog.set_level(logging.INFO, logger="trainyard")
    rng = np.random.default_rng(0)
    n, size = 512, 64
    x = torch.from_numpy(rng.integers(0, 256, size=(n, 3, size, size), dtype=np.uint8))
    y = torch.from_numpy(rng.integers(0, 4, size=n).astype(np.int64))
    loader = DataLoader(TensorBatches(x, y, 32, shuffle=True), batch_size=None)
    # The CNN at 64 px: compute is tens of ms a step, the whole-batch gather well under one.
    model = Classifier(card=card(3, size), arch="cnn", augment=True)
    meter = fit(model, loader, tmp_path, data_path="fast")
    r = meter.result
    assert r is not None, "no verdict"
    # Typically < 1%; a busy shared machine may push a few scheduler stalls into the
    # gaps, so at most moderately input-bound is accepted.
    assert r["level"] != "input-bound" and r["data_wait_fraction"] < 0.2, r
    assert "data path fast" in r["why"]
    assert "transfer_batch_to_device" not in vars(model)  # the timing wrapper is gone
    assert r["steps"] == 16 - 3, r
    # The verdict printed is the one computed (moderately, on a stalled machine).
    verdicts = [m for m in caplog.messages if m.startswith("input-bound verdict: ")]
    assert verdicts == [f"input-bound verdict: {r['level']}: {r['why']}; fix: {r['fix']}"]


def test_data_path_and_placement_come_from_trainyards_datamodule(tmp_path, one_thread):
    from trainyard.training.datamodule import ImageDataModule

    rng = np.random.default_rng(0)
    arrays = {
        split: (
            rng.integers(0, 256, size=(n, 3, 16, 16), dtype=np.uint8),
            rng.integers(0, 4, size=n).astype(np.int64),
        )
        for split, n in (("train", 128), ("val", 32), ("test", 32))
    }
    dm = ImageDataModule(
        arrays=arrays,
        card=Card.from_dict(card(3, 16)),
        batch_size=16,
        eval_batch_size=32,
        data_path="naive",
    )
    meter = InputBoundMeter()
    trainer = build_trainer(max_epochs=1, root=tmp_path, callbacks=[meter])
    trainer.fit(Classifier(card=card(3, 16), arch="cnn"), datamodule=dm)
    r = meter.result
    assert (r["data_path"], r["placement"], r["steps"]) == ("naive", "ram", 8 - 3)
    assert set(r) == set(InputBound.model_fields)  # what train.json's record holds
    assert "data path naive, data ram, cpu" in r["why"]
    if r["level"] != "not input-bound":
        assert "train.data_path: fast" in r["fix"]
    assert "transfer_batch_to_device" not in vars(dm)


# ------------------------------------------------------------------ GPU busy (NVML)


@pytest.mark.parametrize("busy", [11.0, 59.9])
def test_a_gpu_that_keeps_up_with_its_data_but_idles_is_underfed(busy):
    v = verdict(
        0.01,
        data_path="fast",
        device="cuda",
        placement="device",
        gpu_busy_pct=busy,
        precision="32-true",
    )
    assert v["level"] == "GPU underfed"
    assert f"the GPU was busy {busy:.0f}% of the training steps" in v["why"]
    assert v["fix"].startswith("the GPU waits on the host between steps, not on the data")
    assert "train.batch_size" in v["fix"] and "train.precision: bf16-mixed" in v["fix"]
    assert "train.compile" in v["fix"]
    assert "device_resident" not in v["fix"]  # already there: not a lever


def test_the_underfed_levers_are_the_ones_not_pulled_yet():
    ram = verdict(0.0, device="cuda", placement="ram", gpu_busy_pct=30, precision="bf16-mixed")
    assert ram["level"] == "GPU underfed"
    assert "train.device_resident: true" in ram["fix"] and "bf16" not in ram["fix"]


def test_a_busy_gpu_or_an_input_bound_one_is_not_underfed():
    busy = verdict(0.01, data_path="fast", device="cuda", placement="device", gpu_busy_pct=85)
    assert busy["level"] == "not input-bound" and "busy 85%" in busy["why"]
    assert busy["fix"].startswith("none on the input side")
    # Waiting for data is the first thing to fix, however idle the GPU.
    fed = verdict(0.4, data_path="naive", device="cuda", placement="ram", gpu_busy_pct=20)
    assert fed["level"] == "input-bound" and "train.data_path: fast" in fed["fix"]
    assert "busy 20%" in fed["why"]
    assert "GPU underfed" in LEVELS


def test_without_a_busy_figure_the_verdict_is_unchanged():
    args = {"data_path": "fast", "device": "cpu", "placement": "ram"}
    assert verdict(0.01, **args, gpu_busy_pct=None) == verdict(0.01, **args)
    assert "busy" not in verdict(0.01, **args)["why"]


def test_nvml_sampler_without_a_gpu_or_its_package_says_why(monkeypatch):
    if has_cuda():
        pytest.skip("a GPU here: NVML works")
    with pytest.raises(Exception, match=r"(?i)nvml|driver|library|shared"):
        NvmlSampler()  # nvidia-ml-py is installed; the driver's library is not
    monkeypatch.setitem(sys.modules, "pynvml", None)  # a bare image without nvidia-ml-py
    with pytest.raises(RuntimeError, match="nvidia-ml-py is not installed"):
        NvmlSampler()
    assert busy_figures([]) == {"samples": 0, "mean_pct": None, "median_pct": None}
    assert busy_figures([10, 20, 60]) == {"samples": 3, "mean_pct": 30.0, "median_pct": 20}


def test_on_a_cpu_the_busy_figure_is_none_and_why(tmp_path, one_thread):
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.integers(0, 256, size=(64, 3, 16, 16), dtype=np.uint8))
    y = torch.from_numpy(rng.integers(0, 4, size=64).astype(np.int64))
    busy, meter = GpuBusyMeter(), InputBoundMeter(data_path="fast")
    logger = CSVLogger(tmp_path)
    trainer = build_trainer(max_epochs=1, root=tmp_path, callbacks=[busy, meter], logger=logger)
    trainer.fit(Classifier(card=card(3, 16)), DataLoader(TensorBatches(x, y, 8, True), None))
    assert busy.result == {
        "mean_pct": None,
        "median_pct": None,
        "samples": 0,
        "device": None,
        "reason": "no CUDA device",
    }
    assert gpu_busy_of(trainer) == busy.result and busy.sampler is None
    assert GpuBusy.model_validate(busy.result).reason == "no CUDA device"  # train.json's
    assert "busy" not in meter.result["why"] and meter.result["level"] != "GPU underfed"
    assert "perf/gpu_busy_pct" not in (Path(logger.log_dir) / "metrics.csv").read_text()


@pytest.mark.gpu
def test_on_a_gpu_the_training_steps_busy_figure_is_measured(tmp_path):
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.integers(0, 256, size=(8192, 3, 32, 32), dtype=np.uint8)).cuda()
    y = torch.from_numpy(rng.integers(0, 4, size=8192).astype(np.int64)).cuda()
    busy, meter = GpuBusyMeter(period_s=0.005), InputBoundMeter(data_path="fast")
    logger = CSVLogger(tmp_path)
    trainer = build_trainer(
        accelerator="cuda", max_epochs=2, root=tmp_path, callbacks=[busy, meter], logger=logger
    )
    trainer.fit(Classifier(card=card(3, 32)), DataLoader(TensorBatches(x, y, 256, True), None))
    r = busy.result
    assert r["reason"] is None and r["samples"] > 0 and 0 <= r["mean_pct"] <= 100, r
    assert r["device"] and len(busy.epochs) == 2
    assert f"the GPU was busy {r['mean_pct']:.0f}%" in meter.result["why"]
    assert meter.result["level"] in LEVELS
    assert "perf/gpu_busy_pct" in (Path(logger.log_dir) / "metrics.csv").read_text()
