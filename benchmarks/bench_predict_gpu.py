"""Bulk scoring on a GPU (``make gpu-check``): ``trainyard predict``'s data path feeding the GPU.

Issue 34's target: on an H200, resnet18 at 224 px keeps the GPU busy >= 80% while
``trainyard predict`` scores a folder of JPEGs, with its img/s written to docs/. For each
model (resnet18 at 224 px, and the default fine-tune's EfficientNet-Lite0 at 160 px; random
weights: the arithmetic does not depend on them), on the same folder of generated
photo-sized JPEGs (decoded for real, every time):

- **trainyard predict** itself (``trainyard.bulk``, the real command's job): ONNX Runtime
  on the provider it finds (CUDA with IO binding where ``onnxruntime-gpu`` is installed,
  as trainyard's own environment has it; the CPU otherwise, e.g. the GPU image's CPU build),
  img/s, GPU busy % and the verdict from its summary;
- **torch on the GPU**, fed by the same decode workers (``trainyard.bulk.decode.DecodePool``,
  the same window): the checkpoint's network in bf16, channels-last, batch 256, pinned
  host buffers and non-blocking copies, img/s and GPU busy % (NVML) over the whole run.

The row says which is faster, for ``predict``'s choice of backend on a GPU. On a CPU it
runs only with ``--quick`` (tiny sizes: the code path, not a figure).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness.exported import export_classifier, image_card
from benchmarks.harness.stopwatch import Timer

TARGET_BUSY_PCT = 80.0  # issue 34: resnet18 at 224 px keeps an H200 >= 80% busy
MODELS = {"resnet18": 224, "efficientnet_lite0": 160}


def _write_jpegs(folder: str, start: int, count: int, size: tuple[int, int]) -> None:
    from PIL import Image

    rng = np.random.default_rng(start)
    w, h = size
    ramp = np.linspace(0, 255, w, dtype=np.float32)[None, :, None]
    for i in range(start, start + count):
        noise = rng.integers(0, 64, (h, w, 3), dtype=np.uint8).astype(np.float32)
        pixels = np.clip(noise + ramp * rng.uniform(0.3, 1.0, 3), 0, 255).astype(np.uint8)
        sub = Path(folder) / f"c{i % 4}"
        sub.mkdir(exist_ok=True)
        Image.fromarray(pixels).save(sub / f"{i:06d}.jpg", quality=90)


def make_folder(root: Path, images: int, size: tuple[int, int]) -> Path:
    """``images`` photo-sized JPEGs in 4 class folders, made once (in parallel)."""
    folder = root / f"jpegs-{images}-{size[0]}x{size[1]}"
    if (folder / ".done").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    workers = max(1, os.cpu_count() or 1)
    per = -(-images // workers)
    with ProcessPoolExecutor(workers) as pool:
        jobs = [
            pool.submit(_write_jpegs, str(folder), s, min(per, images - s), size)
            for s in range(0, images, per)
        ]
        for job in jobs:
            job.result()
    (folder / ".done").write_text("")
    return folder


def export_model(arch: str, side: int, folder: Path) -> tuple[Path, Any]:
    """The Classifier ``arch`` for ``side`` px RGB (random weights) as trainyard exports it
    (ONNX with its card + the .sha256 sidecar); (path, the torch model in eval mode)."""
    card = image_card(tuple(f"c{i}" for i in range(4)), side)
    path = folder / arch / "model.onnx"
    return path, export_classifier(card, arch, path, 18, "")


def bulk_row(source: Path, model: Path, out: Path, quick: bool) -> dict[str, Any]:
    """``trainyard predict SOURCE --model MODEL`` as a user runs it (its job, in process)."""
    from trainyard.bulk import command_line, predict_job

    parser = command_line.add_predict_arguments(argparse.ArgumentParser())
    argv = [
        str(source),
        "--out",
        str(out),
        "--model",
        str(model),
        "--params",
        str(Path(__file__).resolve().parents[1] / "params.yaml"),
    ]
    if quick:
        argv += ["--batch-size", "8"]
    with Timer() as clock:
        summary = predict_job.predict(command_line.predict_options(parser.parse_args(argv)))
    speed = summary["speed"]
    return {
        "backend": f"onnxruntime {speed['provider']}",
        "img_per_s": speed["img_per_s"],
        "wall_s": clock.seconds,
        "batch_size": speed["batch_size"],
        "workers": speed["workers"],
        "gpu_busy_pct": (speed.get("gpu_busy") or {}).get("mean_pct"),
        "decode_wait_share": speed["decode_wait_share"],
        "verdict": speed["verdict"],
        "rows": summary["rows"],
    }


def _tasks(inputs: Any) -> Iterator[tuple[list[Any], list[None]]]:
    """The listing in the decode pool's tasks: TASK_IMAGES locations each, no labels."""
    from trainyard.bulk.decode import TASK_IMAGES

    for a in range(0, len(inputs), TASK_IMAGES):
        end = min(a + TASK_IMAGES, len(inputs))
        yield [inputs.location(i) for i in range(a, end)], [None] * (end - a)


def torch_row(source: Path, net: Any, card: Any, batch: int) -> dict[str, Any]:
    """The same decode workers feeding ``net`` on the GPU (bf16, channels-last, pinned
    buffers, non-blocking copies); the CPU in fp32 where there is no GPU (--quick)."""
    import torch

    from trainyard.bulk.decode import DecodePool, DecodeSpec, worker_count
    from trainyard.bulk.listing import list_inputs
    from trainyard.core.nvml_sampler import NvmlSampler

    inputs = list_inputs(str(source))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    net = net.to(device).to(memory_format=torch.channels_last)
    mean = torch.tensor(card.mean, device=device).view(1, -1, 1, 1) * 255
    std = torch.tensor(card.std, device=device).view(1, -1, 1, 1) * 255
    sampler = NvmlSampler(0.05) if cuda else None
    pool = DecodePool(DecodeSpec(card, 10**9, 60.0, 10**8), worker_count("auto"))
    tasks = _tasks(inputs)
    pending: list[np.ndarray] = []
    done = wait = 0.0
    t0 = time.perf_counter()
    if sampler is not None:
        sampler.window(True)
    try:
        with torch.inference_mode(), torch.autocast(device.type, torch.bfloat16, enabled=cuda):
            results = pool.imap(tasks)
            while True:
                t = time.perf_counter()
                item = next(results, None)
                wait += time.perf_counter() - t
                if item is not None:
                    pending.append(item[0])
                if pending and (item is None or sum(len(p) for p in pending) >= batch):
                    host = torch.from_numpy(np.concatenate(pending))
                    host = host.pin_memory() if cuda else host
                    x = host.to(device, non_blocking=True).float()
                    x = ((x - mean) / std).contiguous(memory_format=torch.channels_last)
                    net(x).float().softmax(1).cpu()
                    done += len(host)
                    pending.clear()
                if item is None:
                    break
    finally:
        pool.close()
        busy = sampler.close() if sampler is not None else None
    seconds = time.perf_counter() - t0
    return {
        "backend": "torch cuda bf16" if cuda else "torch cpu fp32",
        "img_per_s": done / seconds,
        "batch_size": batch,
        "workers": pool.workers,
        "gpu_busy_pct": (busy or {}).get("mean_pct"),
        "decode_wait_share": wait / seconds,
        "rows": int(done),
    }


def predict_gpu_benchmark(cfg: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    """One row per model: trainyard predict (ONNX Runtime) and torch on the same workers."""
    import torch

    from trainyard.core.card import card_from_metadata
    from trainyard.runtime.sessions import load_onnx

    root = Path(tempfile.gettempdir()) / "trainyard-bench-predict-gpu"
    source = make_folder(root, cfg["images"], tuple(cfg["jpeg_size"]))
    log(f"bench predict: {cfg['images']:,} JPEGs of {cfg['jpeg_size']} px in {source}")
    rows = {}
    for arch in cfg["models"]:
        side = cfg["sides"][arch]
        path, net = export_model(arch, side, root / "models")
        card = card_from_metadata(load_onnx(path, "cpu", say=False).metadata, str(path))
        row = {"image_size": side}
        out = root / f"{arch}.parquet"
        row["trainyard_predict"] = bulk_row(source, path, out, cfg.get("quick", False))
        row["torch"] = torch_row(source, net, card, cfg["torch_batch"])
        fastest = max(("trainyard_predict", "torch"), key=lambda k: row[k]["img_per_s"] or 0)
        row["faster"] = fastest
        busy = row["torch"]["gpu_busy_pct"] if torch.cuda.is_available() else None
        row["target_busy_pct"] = TARGET_BUSY_PCT
        row["meets_target"] = None if busy is None else busy >= TARGET_BUSY_PCT
        for key in ("trainyard_predict", "torch"):
            r = row[key]
            log(
                f"bench predict: {arch} {side} px, {r['backend']}: {r['img_per_s']:,.0f} img/s, "
                f"GPU busy {r['gpu_busy_pct']}, waiting on decode {r['decode_wait_share']:.0%}"
            )
        rows[arch] = row
    return {"images": cfg["images"], "jpeg_size": cfg["jpeg_size"], "rows": rows}


def markdown(result: dict[str, Any] | None) -> list[str]:
    """The bulk scoring rows as Markdown lines (nothing when they did not run)."""
    if not result:
        return []
    if "skipped" in result:
        return [f"**Bulk scoring (trainyard predict)**: skipped ({result['skipped']})", ""]
    w, h = result["jpeg_size"]
    lines = [
        f"**Bulk scoring** (`trainyard predict` on {result['images']:,} generated {w}x{h} "
        "JPEGs, decoded for real; torch fed by the same decode workers)",
        "",
        "| model | backend | batch | decode workers | img/s | GPU busy | waiting on decode |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for arch, row in result["rows"].items():
        for key in ("trainyard_predict", "torch"):
            r = row[key]
            busy = "n/a" if r["gpu_busy_pct"] is None else f"{r['gpu_busy_pct']:.0f}%"
            lines.append(
                f"| {arch} {row['image_size']} px | {r['backend']} | {r['batch_size']} | "
                f"{r['workers']} | {r['img_per_s']:,.0f} | {busy} | "
                f"{r['decode_wait_share']:.0%} |"
            )
    lines.append("")
    for arch, row in result["rows"].items():
        target = row["meets_target"]
        verdict = "n/a (no GPU)" if target is None else ("met" if target else "missed")
        lines.append(
            f"- {arch}: faster backend {row['faster']}; GPU busy >= "
            f"{row['target_busy_pct']:.0f}% (torch): {verdict}"
        )
    return [*lines, ""]
