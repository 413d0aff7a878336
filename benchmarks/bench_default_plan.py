"""What a user gets: the recipe's default plan (params.yaml as it is) on this machine's GPU,
against the same plan's run on this machine's CPU cores.

Rows (``python -m benchmarks --gpu-check``):
- the plan the recipe makes here (batch measured up its ladder, lr, epochs), its lines;
- trainyard vs a plain PyTorch loop on the same batches, gathered from splits on the
  device as the fast path's, at the plan's batch and precision (the loop's cost at the
  batch users get);
- the plan trained to the CPU default's test accuracy (``target``): seconds of training
  steps, img/s, GPU busy % (NVML, over the training steps only);
- the CPU default plan's time to that accuracy on this machine's cores: its planned epochs
  (the committed ``make run`` reached ``target`` with them) x images / the img/s measured
  here for that plan's arch and batch, training steps only like the GPU figure;
- the ratio of the two times.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from benchmarks.bench_training import fit_to_target, lightning_throughput, plain_loop_throughput
from benchmarks.harness.fit_window import Steps

METRICS = Path("reports/metrics.json")  # make run's test accuracy (the CPU default, committed)
FALLBACK_TARGET = 0.92


def cpu_default_accuracy(metrics: Path = METRICS) -> tuple[float, str]:
    """The committed ``make run``'s test accuracy (a CPU run of the default plan), or 0.92."""
    try:
        acc = float(json.loads(metrics.read_text())["test"]["accuracy"])
    except (OSError, ValueError, KeyError, TypeError):
        return FALLBACK_TARGET, f"{FALLBACK_TARGET} (no {metrics})"
    return round(acc, 4), f"{metrics}: the committed make run (CPU default plan)"


def write_prepared(data: dict[str, Any], out: Path) -> Any:
    """The benchmark's arrays as a prepared folder (the recipe reads its splits); its card,
    with the split counts the recipe plans from."""
    from trainyard.data.prepared_writer import open_prepared

    with open_prepared(out) as w:
        for split, (x, y) in data["arrays"].items():
            w.write_images(split, x)
            w.write_labels(split, y)
        return w.finish(data["card"])


def repo_params() -> Any:
    """params.yaml as the pipeline reads it (validated)."""
    from trainyard.core.config import parse_params

    return parse_params(yaml.safe_load(Path("params.yaml").read_text()))


def train_to_target(
    data: dict[str, Any], tp: Any, device: str, precision: str, target: float, log: Any
) -> dict[str, Any]:
    """The plan's training (its arch, batch, lr, augment, epochs) until test accuracy reaches
    ``target``; seconds of training steps, img/s and GPU busy % over those steps."""
    from trainyard.model.classifier import classifier_for
    from trainyard.training.gpu_busy import NvmlSampler

    sampler = None
    busy: dict[str, Any]
    if device == "cuda":
        try:
            sampler = NvmlSampler()
        except Exception as err:
            busy = {"skipped": f"NVML unavailable: {err}"}
    clock = fit_to_target(
        data,
        lambda: classifier_for(tp, data["card"]),
        (device, precision, tp.max_epochs),
        target,
        log,
        sampler.window if sampler else None,
        batch_size=tp.batch_size,
        eval_batch_size=4096,
    )
    if sampler is not None:
        busy = sampler.close()
    elif device != "cuda":
        busy = {"skipped": "no CUDA GPU"}
    epochs = len(clock.history)
    images = epochs * len(data["arrays"]["train"][1])
    train_s = clock.timer.seconds
    return {
        "reached": clock.reached,
        "epochs_run": epochs,
        "train_s": round(train_s, 3),
        "img_per_s": round(images / train_s) if train_s else None,
        "gpu_busy": busy,
    }


def default_plan_benchmark(
    data: dict[str, Any], cfg: dict[str, Any], log: Callable[[str], None]
) -> dict[str, Any]:
    """The rows of the module doc; on a CPU-only machine (``--quick`` in the tests) the
    same code on the CPU plan, with 1 epoch."""
    import torch

    from trainyard.training.recipe import describe, plan

    target, target_from = cpu_default_accuracy()
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    out: dict[str, Any] = {"target": target, "target_from": target_from}
    with tempfile.TemporaryDirectory(prefix="trainyard-plan-") as tmp:
        prepared = Path(tmp) / "prepared"
        card = write_prepared(data, prepared)
        precision = "bf16-mixed" if gpu and torch.cuda.is_bf16_supported() else "32-true"
        name = torch.cuda.get_device_name(0) if gpu else "cpu"
        params = repo_params()
        gpu_plan = plan(params.train, card, prepared, "gpu" if gpu else "cpu", precision, name)
        cpu_plan = plan(params.train, card, prepared, "cpu", "32-true", "cpu")
    for line in describe(gpu_plan):
        log(f"bench: {device} plan: {line}")
    tp = gpu_plan.train
    if cfg.get("plan_epochs"):  # --quick: the code path, not the figure
        tp = tp.model_copy(update={"max_epochs": cfg["plan_epochs"]})
    out["plan"] = {"device": name, "precision": precision, **gpu_plan.to_dict()}
    steps, warm = cfg["gpu_steps"] if gpu else cfg["steps"], cfg["warmup"]
    run = Steps(device, tp.batch_size, steps, warm)
    plain = plain_loop_throughput(data, tp.arch, run, "device", precision=precision)
    ours = lightning_throughput(data, tp.arch, run, "fast", precision, tp.channels_last)
    out["loop"] = {
        "batch_size": tp.batch_size,
        "plain_loop_img_per_s": round(plain),
        "trainyard_img_per_s": round(ours),
        "trainyard_over_plain": round(ours / plain, 3),
    }
    log(f"bench: at the plan's batch {tp.batch_size}: trainyard / plain loop {ours / plain:.2f}x")
    out["to_target"] = train_to_target(data, tp, device, precision, target, log)
    # The CPU default plan on this machine's cores: its epochs at the img/s measured here.
    ctp = cpu_plan.train
    cpu_run = Steps("cpu", ctp.batch_size, cfg["steps"], cfg["warmup"])
    cpu_rate = lightning_throughput(data, ctp.arch, cpu_run, "fast", "32-true")
    cpu_s = ctp.max_epochs * len(data["arrays"]["train"][1]) / cpu_rate
    out["cpu_default"] = {
        "arch": ctp.arch,
        "batch_size": ctp.batch_size,
        "max_epochs": ctp.max_epochs,
        "img_per_s": round(cpu_rate),
        "train_s": round(cpu_s, 1),
        "cores": torch.get_num_threads(),
    }
    reached = out["to_target"]["reached"]
    out["gpu_over_cpu_time_to_target"] = (
        round(cpu_s / reached["train_s"], 1) if gpu and reached else None
    )
    return out
