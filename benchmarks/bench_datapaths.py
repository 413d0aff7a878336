"""Data paths on real image files: one model, one batch size, a folder of JPEGs read four ways,
side by side in one run.

- (a) the textbook: torchvision ``ImageFolder`` + ``DataLoader``, every JPEG opened, decoded,
  resized and centre-cropped every epoch, with ``num_workers`` 0 and = the cores;
- (b) trainyard's prepared uint8 arrays (the prepare stage's output), memory-mapped;
- (c) the same arrays loaded whole into RAM;
- (d) on a GPU, the same arrays device-resident (no batch crosses the bus).

Every row is a Lightning fit of trainyard's ``Classifier`` (normalisation on the device, no
augmentation: the comparison is the input path), timed over the same steps by
``timing.StepWindow``; ``perf.InputBoundMeter`` gives each row's data-wait fraction. (b), (c)
and (d) are trainyard's own ``ImageDataModule`` with the placement forced by its public
knobs: ``memory_budget`` near 0 streams from the memory map (as a dataset larger than RAM
would), ``device_resident`` decides RAM vs GPU.

The folder is ``benchmarks.bench_prepare``'s generator (N RGB JPEGs of 128-224 px, 10
classes; see its docstring), made once under the temp dir and reused. prepare itself runs
first, in a fresh process on all cores (``benchmarks.bench_prepare.run_prepare``): its
images/s and peak RSS are reported.

Why a small model on the CPU: on a GPU the network's step is cheap and the input path is what
is left; a CPU network of the same size is not, so the CPU stand-in is the default CNN's
layout at a quarter of its width (``tiny``, ``width=8``), and the targets are its ratios.
The default CNN (``cnn``) runs too: with its CPU compute per image above the decode cost,
the paths come much closer together. On a GPU only ``cnn`` runs, with the config's
``gpu_*`` settings (batch, steps, repeats), and the rows are sampled for GPU utilisation
(NVML).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.bench_training import NvmlSampler
from benchmarks.common import classifier
from benchmarks.harness.fit_window import StepWindow, window_trainer
from benchmarks.harness.host_facts import usable_cores
from benchmarks.harness.ratios import ratios_of
from benchmarks.harness.stopwatch import round_robin

WORK = Path(tempfile.gettempdir()) / "trainyard-bench-datapaths"
SEED = 0
# The CPU stand-in for a network whose step a GPU makes cheap; "cnn" = the default CNN.
MODELS = {"tiny": 8, "cnn": 32}  # name -> SmallCNN width
# ratio label -> (numerator row, denominator row, target); {w} = the cores' worker count.
TARGETS = {
    "prepared memmap / ImageFolder 0 workers": ("prepared_mmap", "imagefolder_w0", 3.0),
    "prepared memmap / ImageFolder {w} workers": ("prepared_mmap", "imagefolder_w{w}", 1.5),
    "prepared memmap / prepared in RAM": ("prepared_mmap", "prepared_ram", 0.9),
    "device-resident / ImageFolder 0 workers": ("prepared_device", "imagefolder_w0", 5.0),
    "device-resident / ImageFolder {w} workers": ("prepared_device", "imagefolder_w{w}", None),
}


def textbook_loader(
    photos: Path, size: int, batch_size: int, workers: int, pin: bool
) -> tuple[Any, str]:
    """The tutorial loader: ``ImageFolder`` with Resize + CenterCrop (the same crop policy
    as prepare's default) and ``PILToTensor`` (uint8, so the model's own normalisation
    applies, as for the other rows). Where torchvision is missing (a bare GPU machine) a
    PIL ``Dataset`` doing the same per-file work stands in, and the row says so."""
    from torch.utils.data import DataLoader

    try:
        from torchvision import datasets, transforms

        tf = transforms.Compose(
            [transforms.Resize(size), transforms.CenterCrop(size), transforms.PILToTensor()]
        )
        dataset: Any = datasets.ImageFolder(str(photos), transform=tf)
        how = "torchvision ImageFolder"
    except ImportError:
        dataset = _PilFolder(photos, size)
        how = "PIL Dataset (torchvision not installed)"
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        num_workers=workers,
        drop_last=True,
        pin_memory=pin,
    )
    return loader, how


class _PilFolder:
    """ImageFolder's per-item work without torchvision: open, RGB, resize, centre-crop."""

    def __init__(self, root: Path, size: int) -> None:
        classes = sorted(p.name for p in root.iterdir() if p.is_dir())
        self.items = [
            (f, k) for k, c in enumerate(classes) for f in sorted((root / c).glob("*.jpg"))
        ]
        self.size = size

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        import numpy as np
        import torch
        from PIL import Image

        path, label = self.items[i]
        with Image.open(path) as im:
            im = im.convert("RGB")
            w, h = im.size
            scale = self.size / min(w, h)
            im = im.resize((max(self.size, round(w * scale)), max(self.size, round(h * scale))))
            left, top = (im.width - self.size) // 2, (im.height - self.size) // 2
            im = im.crop((left, top, left + self.size, top + self.size))
            x = torch.from_numpy(np.asarray(im).copy()).permute(2, 0, 1)
        return x, label


def fit_row(
    source: Any,
    card: Any,
    width: int,
    device: str,
    cfg: dict[str, Any],
    data_path: str | None,
    sampler: NvmlSampler | None,
) -> dict[str, Any]:
    """One timed fit; ``source`` is a DataLoader (textbook) or an ImageDataModule."""
    import lightning as L

    from trainyard.model.networks import SmallCNN
    from trainyard.training.perf import InputBoundMeter

    L.seed_everything(0, verbose=False)
    model = classifier("cnn", card, augment=False)
    if width != 32:  # the default CNN's layout at another width (the CPU's stand-in)
        model.net = SmallCNN(card.channels, card.num_classes, (card.height, card.width), width)
    warm, steps, bs = cfg["warmup"], cfg["steps"], cfg["batch_size"]
    samples: list[int] = []

    def window(on: bool) -> None:
        if sampler is not None:
            if on:
                sampler.samples = []
            sampler.window(on)
            if not on:
                samples.extend(sampler.samples)

    clock = StepWindow(device, warm, steps, bs, window)
    meter = InputBoundMeter(data_path=data_path, warmup_steps=warm, verbose=False)
    trainer = window_trainer(device, warm + steps, [clock, meter])
    if isinstance(source, L.LightningDataModule):
        trainer.fit(model, datamodule=source)
    else:
        trainer.fit(model, train_dataloaders=source)
    r = meter.result or {}
    row = {
        "img_per_s": clock.img_per_s,
        "data_wait_fraction": r.get("data_wait_fraction"),
        "level": r.get("level"),
    }
    if samples:
        row["gpu_util_pct"] = sum(samples) / len(samples)
    return row


def folder_photos(cfg: dict[str, Any], log: Callable[[str], None]) -> tuple[Path, dict, Path]:
    """(the image folder, what it holds, the work folder): the user's own images as they
    are, or bench_prepare's generated JPEGs, made once and reused."""
    from benchmarks.prepare_photos import ensure_photos

    if cfg.get("photos"):  # the user's own class-per-folder images, used as they are
        photos = Path(cfg["photos"])
        files = [p for p in photos.rglob("*") if p.is_file()]
        made = {
            "images": len(files),
            "bytes": sum(p.stat().st_size for p in files),
            "size_range_px": None,
            "jpeg_quality": None,
            "classes": sum(1 for p in photos.iterdir() if p.is_dir()),
            "how": f"the folder {photos}",
        }
        return photos, made, Path(cfg.get("work") or WORK / "own")
    work = Path(cfg.get("work") or WORK / str(cfg["images"]))
    made = ensure_photos(
        work / "full", cfg["images"], SEED, lambda m: log(m.replace("bench-prepare", "bench"))
    )
    return work / "full" / "photos", made, work


def prepare_figures(prep: dict[str, Any], workers: int) -> dict[str, Any]:
    """prepare's images/s and peak RSS (its own process or its workers', the larger)."""
    images = prep["images"]
    return {
        "images": images,
        "workers": workers,
        "wall_s": round(prep["wall_s"], 3),
        "images_per_s": images / prep["wall_s"],
        "peak_rss_mib": max(prep["rss_self_bytes"], prep["rss_children_bytes"]) / 2**20,
    }


def data_paths(
    prepared: Path, photos: Path, size: int, bs: int, workers: int, gpu: bool
) -> list[tuple[str, str | None, Callable[[], Any], str | None]]:
    """(row, placement the datamodule must report or None, source factory, data path) for
    rows (a)-(d): ImageFolder with 0 and ``workers`` workers, the prepared arrays
    memory-mapped and in RAM, and device-resident on a GPU only."""
    from trainyard.training.datamodule import ImageDataModule

    def module(resident: bool, budget: float) -> ImageDataModule:
        return ImageDataModule(
            prepared,
            batch_size=bs,
            eval_batch_size=bs,
            seed=0,
            device_resident=resident,
            memory_budget=budget,
        )

    paths: list[tuple[str, str | None, Callable[[], Any], str | None]] = [
        (f"imagefolder_w{k}", None, lambda k=k: textbook_loader(photos, size, bs, k, gpu)[0], None)
        for k in sorted({0, workers})
    ]
    paths += [
        ("prepared_mmap", "mmap", lambda: module(False, 1e-9), "fast"),
        ("prepared_ram", "ram", lambda: module(False, 0.5), "fast"),
    ]
    if gpu:
        paths.append(("prepared_device", "device", lambda: module(True, 0.5), "fast"))
    return paths


def open_sampler(gpu: bool, log: Callable[[str], None]) -> NvmlSampler | None:
    """An NVML sampler on a GPU; None on a CPU or where NVML is unavailable."""
    if not gpu:
        return None
    try:
        return NvmlSampler()
    except Exception as err:  # no NVML: rows without utilisation
        log(f"bench: folder: NVML unavailable ({err}): no GPU utilisation per row")
        return None


def measure_rows(
    paths: list[tuple[str, str | None, Callable[[], Any], str | None]],
    models: dict[str, int],
    fit: Callable[[Any, int, str | None], dict[str, Any]],
    repeats: int,
    log: Callable[[str], None],
) -> dict[str, dict[str, Any]]:
    """Every model x data path, round robin ``repeats`` times: median img/s, and the
    median data-wait fraction and GPU utilisation of each row."""
    details: dict[str, dict[str, Any]] = {}

    def runner(name: str, want: str | None, make: Callable[[], Any], path: str | None, width: int):
        def run() -> float:
            source = make()
            row = fit(source, width, path)
            got = getattr(source, "placement", None)
            if want is not None and got != want:  # the row must measure what it says
                raise SystemExit(f"bench: folder row {name}: placement {got}, expected {want}")
            details.setdefault(name, {"waits": [], "gpu_util": []})
            details[name]["waits"].append(row["data_wait_fraction"])
            if "gpu_util_pct" in row:
                details[name]["gpu_util"].append(row["gpu_util_pct"])
            return row["img_per_s"]

        return run

    rows = {
        f"{m}/{name}": runner(f"{m}/{name}", want, make, path, width)
        for m, width in models.items()
        for name, want, make, path in paths
    }
    measured = round_robin(rows, repeats, log, "img/s")
    for name, r in measured.items():
        waits = sorted(v for v in details[name]["waits"] if v is not None)
        r["data_wait_fraction"] = waits[len(waits) // 2] if waits else None
        if details[name]["gpu_util"]:
            util = sorted(details[name]["gpu_util"])
            r["gpu_util_pct"] = util[len(util) // 2]
    return measured


def folder_ratios(
    measured: dict[str, dict[str, Any]], models: list[str], w: int
) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
    """(every TARGETS ratio per model, the first model's targets with their verdicts)."""
    ratios: dict[str, float] = {}
    targets: dict[str, dict[str, Any]] = {}
    for m in models:
        for label, (a, b, target) in TARGETS.items():
            key = f"folder [{m}]: {label.format(w=w)}"
            pair = {key: (f"{m}/{a}", f"{m}/{b.format(w=w)}")}
            for k, v in ratios_of(measured, pair).items():
                ratios[k] = v
                if target is not None and m == models[0]:  # the targets are the first model's
                    targets[k] = {"target": target, "met": v >= target}
    return ratios, targets


def device_config(cfg: dict[str, Any], gpu: bool) -> dict[str, Any]:
    """The folder settings for this device: on a GPU each ``gpu_<key>`` replaces ``<key>``
    (the real CNN at a GPU-sized batch, fewer steps and repeats: the textbook rows decode
    every JPEG on the CPU, and `make gpu-check` must stay within its minutes)."""
    if not gpu:
        return cfg
    return cfg | {k.removeprefix("gpu_"): v for k, v in cfg.items() if k.startswith("gpu_")}


def folder_benchmarks(cfg: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    """The image-folder comparison: prepare's figures, then rows (a)-(d) for each model."""
    import torch

    from benchmarks.bench_prepare import run_prepare
    from benchmarks.harness.made_once import warm_cache
    from trainyard.core.card import load_card

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gpu = device == "cuda"
    cfg = device_config(cfg, gpu)
    size, bs = cfg["image_size"], cfg["batch_size"]
    names = cfg["folder_models"]
    w = usable_cores()
    photos, made, work = folder_photos(cfg, log)
    work.mkdir(parents=True, exist_ok=True)
    warm_cache(photos)  # every path then reads from the page cache alike
    prepared = work / "prepared"
    log(f"bench: folder: prepare {photos} -> {size} px uint8 arrays on {w} workers ...")
    try:
        prep = run_prepare(photos, prepared, w, size, SEED, keep=True)
    except SystemExit as err:  # e.g. a bare GPU machine without pydantic: say so, go on
        log(f"bench: folder data paths skipped: {err}")
        return {"skipped": str(err)}
    keys = ("images", "bytes", "size_range_px", "jpeg_quality", "classes", "how")
    out: dict[str, Any] = {
        "dataset": {k: made[k] for k in keys},
        "image_size": size,
        "batch_size": bs,
        **{k: cfg[k] for k in ("warmup", "steps", "repeats")},
        "device": device,
        "cores": w,
        "prepare": prepare_figures(prep, w),
    }
    log(
        f"bench: folder: prepare {out['prepare']['images_per_s']:,.0f} images/s, "
        f"peak RSS {out['prepare']['peak_rss_mib']:,.0f} MiB"
    )
    card = load_card(prepared)
    paths = data_paths(prepared, photos, size, bs, w, gpu)
    out["textbook"] = textbook_loader(photos, size, bs, 0, False)[1]
    sampler = open_sampler(gpu, log)
    models = {m: MODELS[m] for m in names}
    out["models"] = list(models)

    def fit(source: Any, width: int, path: str | None) -> dict[str, Any]:
        return fit_row(source, card, width, device, cfg, path, sampler)

    measured = measure_rows(paths, models, fit, cfg["repeats"], log)
    if sampler is not None:
        sampler.close()
    out["img_per_s"] = measured
    out["ratios"], out["targets"] = folder_ratios(measured, names, w)
    shutil.rmtree(prepared, ignore_errors=True)
    return out


def markdown(fd: dict[str, Any]) -> list[str]:
    """The image-folder part of the docs section, or why it was skipped."""
    if "skipped" in fd:
        return [f"**Data paths on an image folder**: skipped ({fd['skipped']})", ""]
    ds, p = fd["dataset"], fd["prepare"]
    what = (
        f"{ds['images']:,} RGB JPEGs of {ds['size_range_px'][0]}-{ds['size_range_px'][1]} px, "
        f"{ds['classes']} classes, {ds['bytes'] / 2**20:,.0f} MiB, from "
        "`python -m benchmarks.bench_prepare`'s generator"
        if ds["size_range_px"]
        else f"{ds['how']}: {ds['images']:,} files, {ds['classes']} classes, "
        f"{ds['bytes'] / 2**20:,.0f} MiB"
    )
    lines = [
        f"**Data paths on an image folder** ({what}; "
        f"trained at {fd['image_size']} px, batch {fd['batch_size']}, {fd['steps']} timed "
        f"steps after {fd['warmup']} warm-up, median of {fd['repeats']}, on {fd['device']}; "
        f"`tiny` = the default CNN at width 8, `cnn` = the default CNN). "
        f"Textbook rows: {fd['textbook']} + DataLoader, decoding every image file each epoch.",
        "",
        f"prepare (the stage, {p['workers']} workers): {p['images']:,} images in "
        f"{p['wall_s']:.2f} s = **{p['images_per_s']:,.0f} images/s**, peak RSS "
        f"**{p['peak_rss_mib']:,.0f} MiB**.",
        "",
        "| model / data path | img/s | waiting for data | GPU util |",
        "|---|---:|---:|---:|",
    ]
    for name, r in fd["img_per_s"].items():
        wait = r.get("data_wait_fraction")
        util = r.get("gpu_util_pct")
        lines.append(
            f"| {name} | {r['median']:,.0f} | "
            f"{'n/a' if wait is None else f'{wait:.0%}'} | "
            f"{'n/a' if util is None else f'{util:.0f}%'} |"
        )
    lines += ["", "| ratio | value | target |", "|---|---:|---|"]
    for k, v in fd["ratios"].items():
        t = fd["targets"].get(k)
        mark = f">= {t['target']:g}x: {'met' if t['met'] else 'NOT met'}" if t else ""
        lines.append(f"| {k} | {v:.2f}x | {mark} |")
    lines.append("")
    return lines
