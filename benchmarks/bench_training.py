"""Training throughput: a plain PyTorch loop vs trainyard's Lightning training, the naive
per-sample DataLoader vs the fast path, fp32 vs mixed, CPU vs GPU; GPU utilisation (NVML)
while the fast path trains; the `fast` preset's time to a target test accuracy."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import lightning as L
import numpy as np

from benchmarks.common import Data, classifier
from benchmarks.harness.fit_window import Steps, StepWindow, window_trainer
from benchmarks.harness.ratios import ratios_of
from benchmarks.harness.stopwatch import Timer, round_robin
from trainyard.training.gpu_busy import NvmlSampler  # the one NVML sampler, training's too


def plain_loop_throughput(
    data: Data, arch: str, run: Steps, loader: str = "textbook", precision: str = "32-true"
) -> float:
    """img/s of a hand-written PyTorch loop: same model, optimiser, augmentation, batch.

    ``loader="textbook"``: the usual per-sample Dataset + DataLoader(shuffle=True) with the
    batch copied to the device each step; ``"tensor"``: the same in-memory batches the
    fast path uses, so the difference to Lightning is framework overhead alone;
    ``"device"``: those batches gathered from splits already on the device, as the fast
    path's device-resident placement does on a GPU (the like-for-like baseline there).
    ``precision``: ``bf16-mixed`` runs the step under bf16 autocast, as Lightning's does.
    """
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    device, batch_size, steps, warmup = run
    from trainyard.model.augment import augment_batch, normalize_on_device
    from trainyard.model.networks import build_model
    from trainyard.training.datamodule import PerSampleDataset, TensorBatches

    torch.manual_seed(0)
    images, labels = data["arrays"]["train"]
    x_all = torch.from_numpy(np.ascontiguousarray(images))
    y_all = torch.from_numpy(labels.astype(np.int64))
    if loader == "device":
        x_all, y_all = x_all.to(device), y_all.to(device)
    if loader == "textbook":
        batches = DataLoader(
            PerSampleDataset(x_all, y_all),
            batch_size=batch_size,
            shuffle=True,
            num_workers=0,
            drop_last=True,
        )
    else:
        batches = TensorBatches(x_all, y_all, batch_size, shuffle=True, drop_last=True)
    card = data["card"]
    mean, std = card.mean, card.std
    model = build_model(arch, card.channels, card.num_classes, (card.height, card.width))
    model = model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=5e-4)
    gen = torch.Generator(device=device).manual_seed(0)
    timer = Timer(device)
    bf16 = precision.startswith("bf16")
    done = 0
    while True:
        for xb, yb in batches:
            if done == warmup:
                timer.start()
            xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            x = augment_batch(normalize_on_device(xb, mean, std), gen)
            with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
                loss = F.cross_entropy(model(x), yb, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            done += 1
            if done == warmup + steps:
                return steps * batch_size / timer.stop()


def lightning_throughput(
    data: Data,
    arch: str,
    run: Steps,
    data_path: str = "fast",
    precision: str = "32-true",
    channels_last: bool = False,
    on_window: Callable[[bool], None] | None = None,
) -> float:
    """img/s of trainyard's own training (ImageDataModule + Classifier + Lightning)."""
    from trainyard.training.datamodule import ImageDataModule

    device, batch_size, steps, warmup = run
    L.seed_everything(0, verbose=False)
    dm = ImageDataModule(
        arrays=data["arrays"],
        card=data["card"],
        batch_size=batch_size,
        seed=0,
        data_path=data_path,
    )  # type: ignore[arg-type]
    model = classifier(arch, data["card"], channels_last=channels_last)
    window = StepWindow(device, warmup, steps, batch_size, on_window)
    trainer = window_trainer(device, warmup + steps, [window], precision)
    trainer.fit(model, datamodule=dm)
    return window.img_per_s


def training_benchmarks(
    data: dict[str, Any],
    cfg: dict[str, Any],
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Training img/s, plain loop vs Lightning, CPU and (where present) GPU; ratios, GPU use."""
    import torch

    arch, bs, steps, warm, reps = (
        cfg[k] for k in ("arch", "batch_size", "steps", "warmup", "repeats")
    )
    out: dict[str, Any] = {
        "arch": arch,
        "batch_size": bs,
        "steps": steps,
        "warmup": warm,
        "repeats": reps,
    }
    # (row, function, data path or loader, precision, channels_last): one table for both
    # devices, so CPU and GPU rows are the same measurements.
    specs = [
        ("plain_loop_textbook", plain_loop_throughput, "textbook", None, False),
        ("plain_loop_tensor", plain_loop_throughput, "tensor", None, False),
        ("lightning_naive_fp32", lightning_throughput, "naive", "32-true", False),
        ("lightning_fast_fp32", lightning_throughput, "fast", "32-true", False),
        ("lightning_fast_bf16", lightning_throughput, "fast", "bf16-mixed", True),
    ]
    devices = {"cpu": steps}
    if torch.cuda.is_available():
        devices["cuda"] = cfg["gpu_steps"]
    rows: dict[str, Callable[[], float]] = {}
    for device, n in devices.items():
        for name, fn, path, precision, nhwc in specs:
            kw: dict[str, Any] = {}
            if precision is not None:
                # channels_last only where it pays: tensor-core convolutions on the GPU.
                kw = {"precision": precision, "channels_last": nhwc and device == "cuda"}
            rows[f"{device}/{name}"] = functools.partial(
                fn, data, arch, Steps(device, bs, n, warm), path, **kw
            )
    if not torch.cuda.is_available():
        log("bench: no CUDA GPU here: GPU training rows skipped")
    out["img_per_s"] = round_robin(rows, reps, log, "img/s")

    out["gpu_utilisation"] = _gpu_utilisation(data, arch, bs, warm, cfg["gpu_util_steps"], log)
    out["ratios"] = training_ratios(out["img_per_s"])
    return out


def _gpu_utilisation(
    data: dict[str, Any], arch: str, bs: int, warm: int, steps: int, log: Callable[[str], None]
) -> dict[str, Any]:
    """NVML's GPU busy samples over one more fast-path (bf16, channels_last) run on the GPU;
    why not, where there is no GPU or no NVML."""
    import torch

    if not torch.cuda.is_available():
        return {"skipped": "no CUDA GPU"}
    try:
        sampler = NvmlSampler()
    except Exception as err:  # no nvidia-ml-py or no NVML: say so, keep the rest
        return {"skipped": f"NVML unavailable: {err}"}
    lightning_throughput(
        data,
        arch,
        Steps("cuda", bs, steps, warm),
        "fast",
        "bf16-mixed",
        channels_last=True,
        on_window=sampler.window,
    )
    util = {"run": "cuda/lightning_fast_bf16"} | sampler.close()
    log(f"bench: GPU utilisation during the fast path: {util['mean_pct']}% (mean of NVML samples)")
    return util


def training_ratios(r: dict[str, Any]) -> dict[str, float]:
    """The named ratios between training rows, where both rows ran."""
    pairs = {
        "cpu: trainyard (Lightning fast) / plain loop (textbook DataLoader)": (
            "cpu/lightning_fast_fp32",
            "cpu/plain_loop_textbook",
        ),
        "cpu: trainyard (Lightning fast) / plain loop (same tensor batches)": (
            "cpu/lightning_fast_fp32",
            "cpu/plain_loop_tensor",
        ),
        "cpu: fast path / naive DataLoader (both Lightning, fp32)": (
            "cpu/lightning_fast_fp32",
            "cpu/lightning_naive_fp32",
        ),
        "cpu: bf16-mixed / fp32 (fast path)": (
            "cpu/lightning_fast_bf16",
            "cpu/lightning_fast_fp32",
        ),
        "gpu: trainyard (fast, bf16) / plain loop (textbook)": (
            "cuda/lightning_fast_bf16",
            "cuda/plain_loop_textbook",
        ),
        "gpu: fast path / naive DataLoader (fp32)": (
            "cuda/lightning_fast_fp32",
            "cuda/lightning_naive_fp32",
        ),
        "gpu: bf16-mixed / fp32 (fast path)": (
            "cuda/lightning_fast_bf16",
            "cuda/lightning_fast_fp32",
        ),
        "gpu / cpu: best trainyard training": (
            "cuda/lightning_fast_bf16",
            "cpu/lightning_fast_fp32",
        ),
    }
    return ratios_of(r, pairs)


class TargetClock(L.Callback):
    """Seconds of training steps per epoch (evaluation excluded), the test accuracy after
    each epoch, and a stop once it reaches ``target``."""

    def __init__(
        self,
        device: str,
        target: float,
        log: Callable[[str], None],
        on_window: Callable[[bool], None] | None = None,
    ) -> None:
        self.timer = Timer(device)  # accumulates the training part of every epoch
        self.on_window = on_window  # e.g. the NVML sampler: open over training steps only
        self.target, self._log = target, log  # not .log: Lightning sets that to the module's
        self.history: list[dict[str, Any]] = []
        self.reached: dict[str, Any] | None = None

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self.timer.start()
        if self.on_window:
            self.on_window(True)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        if trainer.is_last_batch:
            self.timer.stop()
            if self.on_window:
                self.on_window(False)

    def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.sanity_checking:
            return
        acc = float(trainer.callback_metrics["val/acc"])
        train_s = self.timer.seconds
        self.history.append(
            {"epoch": trainer.current_epoch + 1, "train_s": round(train_s, 3), "test_acc": acc}
        )
        self._log(
            f"bench: epoch {trainer.current_epoch + 1}: test acc {acc:.4f} "
            f"after {train_s:.2f} s of training"
        )
        if acc >= self.target and self.reached is None:
            self.reached = self.history[-1]
            trainer.should_stop = True


def fit_to_target(
    data: Data,
    make_model: Callable[[], Any],
    run: tuple[str, str, int],
    target: float,
    log: Callable[[str], None],
    on_window: Callable[[bool], None] | None = None,
    **datamodule: Any,
) -> TargetClock:
    """Fit the model ``make_model`` builds (``run``: device, precision, max epochs) on the
    train split, checking *test* accuracy after each epoch, until it reaches ``target``;
    the clock: seconds of training steps, the history, the epoch that reached it."""
    from trainyard.training.builder import build_trainer
    from trainyard.training.datamodule import ImageDataModule

    device, precision, max_epochs = run
    arrays = dict(data["arrays"])
    arrays["val"] = arrays["test"]  # the target is *test* accuracy, checked each epoch
    L.seed_everything(0, verbose=False)
    dm = ImageDataModule(arrays=arrays, card=data["card"], seed=0, **datamodule)
    clock = TargetClock(device, target, log, on_window=on_window)
    trainer = build_trainer(
        accelerator="gpu" if device == "cuda" else "cpu",
        precision=precision,
        max_epochs=max_epochs,
        num_sanity_val_steps=0,
        callbacks=[clock],
    )
    trainer.fit(make_model(), datamodule=dm)
    return clock


def time_to_target(
    data: Data,
    preset: dict[str, Any],
    target: float,
    max_epochs: int,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Train with ``preset``; stop when test accuracy >= target. Seconds count training
    steps only (evaluation after each epoch is excluded, as airbench does)."""
    import torch

    tp = preset["train"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    precision = tp.get("precision", "32-true") if device == "cuda" else "32-true"

    def model() -> Any:
        return classifier(
            tp["arch"],
            data["card"],
            lr=tp["lr"],
            weight_decay=tp.get("weight_decay", 5e-4),
            label_smoothing=tp.get("label_smoothing", 0.1),
            augment=tp.get("augment", True),
            channels_last=tp.get("channels_last", False) and device == "cuda",
            compile=tp.get("compile", False),
        )

    clock = fit_to_target(
        data,
        model,
        (device, precision, max_epochs),
        target,
        log,
        batch_size=tp["batch_size"],
        eval_batch_size=2048,
        data_path=tp.get("data_path", "fast"),
        device_resident=tp.get("device_resident", True),
    )
    return {
        "device": device,
        "precision": precision,
        "target": target,
        "preset": tp,
        "reached": clock.reached,
        "history": clock.history,
    }
