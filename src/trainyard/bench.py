"""Benchmark: how much faster is the GPU, and is it fed? Measured side by side, one run.

    python -m trainyard.bench            # make bench: CPU parts here, GPU parts where present
    python -m trainyard.bench --quick    # seconds; what the tests run
    python -m trainyard.bench --gpu-check --out $OUT/bench.json   # make gpu-check

Measures (warm-up excluded, medians of repeats, ratios printed beside absolutes):
1. training img/s for the same model and batch: a plain PyTorch loop vs trainyard's
   Lightning training; the naive per-sample DataLoader vs the fast path; fp32 vs mixed;
2. the same on the GPU (if any) and the GPU/CPU speed-up;
3. GPU utilisation sampled with NVML while the fast path trains;
4. inference latency/throughput at batch 1, 64, 1024: torch eager vs ONNX Runtime, on
   CPU and, where present, CUDA;
5. with --time-to-target (on by --gpu-check): the `fast` preset's seconds to 93% test
   accuracy.

Only torch, lightning, numpy, onnx, onnxruntime (and matplotlib, yaml) are imported: this
must run on a bare GPU machine with no mlflow, dvc, bentoml or pydantic.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from trainyard.card import Card
from trainyard.prepare import channel_stats, split_train_val
from trainyard.sources.fashion_mnist import fashion_card, load_raw

DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
DOCS_START = "<!-- bench:{key}:start -->"
DOCS_END = "<!-- bench:{key}:end -->"


# ----------------------------------------------------------------------------- data


def load_data(raw_dir: Path, limit: int | None, seed: int = 42) -> dict[str, Any]:
    """Train/val/test uint8 [N,1,28,28] splits + card straight from the raw IDX files
    (no DVC needed)."""
    raw = load_raw(raw_dir)
    images, labels = raw["train"]
    images = images[:, None]
    val_size = 5000 if limit is None else max(10, limit // 10)
    train_idx, val_idx = split_train_val(labels, val_size, limit, seed)
    train_x = images[train_idx]
    (mean,), (std,) = channel_stats(train_x)
    card = fashion_card(mean, std)
    return {
        "arrays": {
            "train": (train_x, labels[train_idx]),
            "val": (images[val_idx], labels[val_idx]),
            "test": (raw["test"][0][:, None], raw["test"][1]),
        },
        "card": card,
    }


def find_raw_dir(given: str | None) -> Path:
    for candidate in (given, "data/raw", str(DEBIAN_DIR)):
        if candidate and (Path(candidate) / "train-images-idx3-ubyte.gz").is_file():
            return Path(candidate)
    raise SystemExit(
        "bench: no Fashion-MNIST files found (tried --raw, data/raw, "
        f"{DEBIAN_DIR}); run `make run` first or pass --raw DIR"
    )


# ----------------------------------------------------------------------------- hardware


def hardware() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "cpu": cpu_name(),
        "cpu_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu": None,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["cuda"] = torch.version.cuda
    try:
        import onnxruntime as ort

        info["onnxruntime"] = ort.__version__
        info["ort_providers"] = ort.get_available_providers()
    except ImportError:
        info["onnxruntime"] = None
    return info


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- training


def _classifier(arch: str, card: Card, **kw: Any) -> Any:
    from trainyard.models import Classifier

    return Classifier(card=card.contract(), arch=arch, **kw)


def plain_loop_throughput(
    data: dict[str, Any],
    arch: str,
    device: str,
    batch_size: int,
    steps: int,
    warmup: int,
    loader: str = "textbook",
) -> float:
    """img/s of a hand-written PyTorch loop: same model, optimiser, augmentation, batch.

    ``loader="textbook"``: the usual per-sample Dataset + DataLoader(shuffle=True) with the
    batch copied to the device each step; ``"tensor"``: the same in-memory batches the
    fast path uses, so the difference to Lightning is framework overhead alone.
    """
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from trainyard.datamodule import PerSampleDataset, TensorBatches
    from trainyard.models import augment_batch, build_model, normalize

    torch.manual_seed(0)
    images, labels = data["arrays"]["train"]
    x_all = torch.from_numpy(np.ascontiguousarray(images))
    y_all = torch.from_numpy(labels.astype(np.int64))
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
    done, t0 = 0, 0.0
    while True:
        for xb, yb in batches:
            if done == warmup:
                _sync(device)
                t0 = time.perf_counter()
            xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            x = augment_batch(normalize(xb, mean, std), gen)
            loss = F.cross_entropy(model(x), yb, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            done += 1
            if done == warmup + steps:
                _sync(device)
                return steps * batch_size / (time.perf_counter() - t0)


def lightning_throughput(
    data: dict[str, Any],
    arch: str,
    device: str,
    batch_size: int,
    steps: int,
    warmup: int,
    data_path: str = "fast",
    precision: str = "32-true",
    channels_last: bool = False,
    on_window: Callable[[bool], None] | None = None,
) -> float:
    """img/s of trainyard's own training (ImageDataModule + Classifier + Lightning)."""
    import lightning as L

    from trainyard.datamodule import ImageDataModule

    class Window(L.Callback):
        """Times steps [warmup, warmup+steps) with the device synchronised at both ends."""

        t0 = t1 = 0.0

        def on_train_batch_start(
            self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
        ) -> None:
            if trainer.global_step == warmup:
                _sync(device)
                self.t0 = time.perf_counter()
                if on_window:
                    on_window(True)

        def on_train_batch_end(
            self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            if trainer.global_step == warmup + steps:
                _sync(device)
                self.t1 = time.perf_counter()
                if on_window:
                    on_window(False)

    L.seed_everything(0, verbose=False)
    dm = ImageDataModule(
        arrays=data["arrays"],
        card=data["card"],
        batch_size=batch_size,
        seed=0,
        data_path=data_path,
    )  # type: ignore[arg-type]
    model = _classifier(arch, data["card"], channels_last=channels_last)
    window = Window()
    trainer = L.Trainer(
        accelerator="gpu" if device == "cuda" else "cpu",
        devices=1,
        precision=precision,
        max_steps=warmup + steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[window],
    )
    trainer.fit(model, datamodule=dm)
    return steps * batch_size / (window.t1 - window.t0)


class NvmlSampler:
    """GPU utilisation (%) sampled every ``period`` s by NVML while ``active``."""

    def __init__(self, period: float = 0.02) -> None:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        self.period, self.samples, self.active = period, [], False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.active:
                rates = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
                self.samples.append(int(rates.gpu))
            time.sleep(self.period)

    def window(self, on: bool) -> None:
        self.active = on

    def close(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        s = self.samples
        return {
            "samples": len(s),
            "mean_pct": statistics.fmean(s) if s else None,
            "median_pct": statistics.median(s) if s else None,
        }


def training_benchmarks(
    data: dict[str, Any],
    cfg: dict[str, Any],
    log: Callable[[str], None],
) -> dict[str, Any]:
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
        "img_per_s": {},
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
                fn, data, arch, device, bs, n, warm, path, **kw
            )
    if not torch.cuda.is_available():
        log("bench: no CUDA GPU here: GPU training rows skipped")
    # Round-robin over configurations, repeat by repeat: drift in machine load (shared,
    # noisy hosts) then spreads over all rows instead of biasing whichever ran last.
    runs: dict[str, list[float]] = {name: [] for name in rows}
    for rep in range(reps):
        for name, fn in rows.items():
            runs[name].append(fn())
            log(f"bench: [{rep + 1}/{reps}] {name:28s} {runs[name][-1]:>12,.0f} img/s")
    for name, values in runs.items():
        out["img_per_s"][name] = {"median": statistics.median(values), "runs": values}

    if torch.cuda.is_available():
        try:
            sampler = NvmlSampler()
        except Exception as err:  # no nvidia-ml-py or no NVML: say so, keep the rest
            out["gpu_utilisation"] = {"skipped": f"NVML unavailable: {err}"}
        else:
            lightning_throughput(
                data,
                arch,
                "cuda",
                bs,
                cfg["gpu_util_steps"],
                warm,
                "fast",
                "bf16-mixed",
                channels_last=True,
                on_window=sampler.window,
            )
            out["gpu_utilisation"] = {"run": "cuda/lightning_fast_bf16"} | sampler.close()
            log(
                f"bench: GPU utilisation during the fast path: "
                f"{out['gpu_utilisation']['mean_pct']}% (mean of NVML samples)"
            )
    else:
        out["gpu_utilisation"] = {"skipped": "no CUDA GPU"}
    out["ratios"] = training_ratios(out["img_per_s"])
    return out


def training_ratios(r: dict[str, Any]) -> dict[str, float]:
    def ratio(a: str, b: str) -> float | None:
        if a in r and b in r:
            return r[a]["median"] / r[b]["median"]
        return None

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
    return {k: v for k, (a, b) in pairs.items() if (v := ratio(a, b)) is not None}


# ----------------------------------------------------------------------------- inference


def _export_for_bench(model: Any, path: Path) -> str:
    """ONNX for the inference rows: the pipeline's exporter, else TorchScript's (bare GPU box)."""
    import torch

    from trainyard.export import export_onnx

    try:
        export_onnx(model, path, opset=18, metadata={"bench": "1"})
        return "dynamo"
    except Exception:  # e.g. onnxscript missing: the legacy exporter needs only torch
        torch.onnx.export(
            model,
            (torch.zeros(1, *model.card.input_shape),),
            str(path),
            dynamo=False,
            input_names=["image"],
            output_names=["logits"],
            opset_version=18,
            dynamic_axes={"image": {0: "batch"}, "logits": {0: "batch"}},
        )
        return "torchscript"


def _time_calls(
    fn: Callable[[], Any], budget_s: float, min_calls: int, max_calls: int, sync: Callable[[], None]
) -> float:
    """Median seconds per call, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    sync()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_calls and (
        len(times) < min_calls or time.perf_counter() - start < budget_s
    ):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def inference_benchmarks(
    data: dict[str, Any], cfg: dict[str, Any], log: Callable[[str], None]
) -> dict[str, Any]:
    import torch

    from trainyard.inference import CPU, CUDA, cuda_device_count
    from trainyard.models import normalize

    model = _classifier(cfg["arch"], data["card"]).eval()
    images = data["arrays"]["test"][0]
    out: dict[str, Any] = {"arch": cfg["arch"], "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        onnx_path = Path(tmp) / "bench.onnx"
        out["exporter"] = _export_for_bench(model, onnx_path)
        try:
            import onnxruntime as ort
        except ImportError:
            ort = None
            log("bench: onnxruntime not installed: ORT rows skipped")
        targets = [("cpu", CPU)]
        if torch.cuda.is_available():
            targets.append(("cuda", CUDA))
        for device, provider in targets:
            torch_model = model.to(device)
            session = None
            if (
                ort is not None
                and provider in ort.get_available_providers()
                and (provider == CPU or cuda_device_count() > 0)
            ):
                opts = ort.SessionOptions()
                opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
                opts.log_severity_level = 3
                session = ort.InferenceSession(str(onnx_path), opts, providers=[provider])
                if session.get_providers()[0] != provider:
                    session = None
            if session is None:
                log(f"bench: ONNX Runtime {provider} unavailable: ORT {device} rows skipped")
            sync = (lambda: torch.cuda.synchronize()) if device == "cuda" else (lambda: None)
            for bs in cfg["inference_batches"]:
                x = normalize(torch.from_numpy(images[:bs]), model.card.mean, model.card.std)
                x_dev, x_np = x.to(device), x.numpy()
                row: dict[str, Any] = {"device": device, "batch": bs}

                def run_torch(xd: torch.Tensor = x_dev, m: Any = torch_model) -> None:
                    with torch.inference_mode():
                        m(xd)

                row["torch_s"] = _time_calls(run_torch, cfg["inference_budget_s"], 5, 2000, sync)
                if session is not None:
                    row["ort_s"] = _time_calls(
                        lambda s=session, xn=x_np: s.run(None, {"image": xn}),
                        cfg["inference_budget_s"],
                        5,
                        2000,
                        lambda: None,
                    )
                    row["ort_over_torch_latency"] = row["ort_s"] / row["torch_s"]
                    row["ort_provider"] = session.get_providers()[0]
                for k in ("torch", "ort"):
                    if f"{k}_s" in row:
                        row[f"{k}_img_per_s"] = bs / row[f"{k}_s"]
                out["rows"].append(row)
                log(
                    f"bench: infer {device:4s} batch {bs:5d}: torch {row['torch_s'] * 1e3:8.3f} ms"
                    + (
                        f"  ORT {row['ort_s'] * 1e3:8.3f} ms  (ORT/torch "
                        f"{row['ort_over_torch_latency']:.2f}x)"
                        if "ort_s" in row
                        else ""
                    )
                )
        model.to("cpu")
    return out


# ----------------------------------------------------------------------------- time to target


def time_to_target(
    data: dict[str, Any],
    preset: dict[str, Any],
    target: float,
    max_epochs: int,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Train with ``preset``; stop when test accuracy >= target. Seconds count training
    steps only (evaluation after each epoch is excluded, as airbench does)."""
    import lightning as L
    import torch

    from trainyard.datamodule import ImageDataModule

    tp = preset["train"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    precision = tp.get("precision", "32-true") if device == "cuda" else "32-true"

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.train_s, self.history, self.reached = 0.0, [], None

        def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            _sync(device)
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            if trainer.is_last_batch:
                _sync(device)
                self.train_s += time.perf_counter() - self.t0

        def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            if trainer.sanity_checking:
                return
            acc = float(trainer.callback_metrics["val/acc"])
            self.history.append(
                {
                    "epoch": trainer.current_epoch + 1,
                    "train_s": round(self.train_s, 3),
                    "test_acc": acc,
                }
            )
            log(
                f"bench: epoch {trainer.current_epoch + 1}: test acc {acc:.4f} "
                f"after {self.train_s:.2f} s of training"
            )
            if acc >= target and self.reached is None:
                self.reached = self.history[-1]
                trainer.should_stop = True

    arrays = dict(data["arrays"])
    arrays["val"] = arrays["test"]  # the target is *test* accuracy, checked each epoch
    L.seed_everything(0, verbose=False)
    dm = ImageDataModule(
        arrays=arrays,
        card=data["card"],
        batch_size=tp["batch_size"],
        eval_batch_size=2048,
        seed=0,
        data_path=tp.get("data_path", "fast"),
        device_resident=tp.get("device_resident", True),
    )
    model = _classifier(
        tp["arch"],
        data["card"],
        lr=tp["lr"],
        weight_decay=tp.get("weight_decay", 5e-4),
        label_smoothing=tp.get("label_smoothing", 0.1),
        augment=tp.get("augment", True),
        channels_last=tp.get("channels_last", False) and device == "cuda",
        compile=tp.get("compile", False),
    )
    clock = Clock()
    trainer = L.Trainer(
        accelerator="gpu" if device == "cuda" else "cpu",
        devices=1,
        precision=precision,
        max_epochs=max_epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        callbacks=[clock],
    )
    trainer.fit(model, datamodule=dm)
    return {
        "device": device,
        "precision": precision,
        "target": target,
        "preset": tp,
        "reached": clock.reached,
        "history": clock.history,
    }


# ----------------------------------------------------------------------------- reporting


def hardware_label(hw: dict[str, Any]) -> str:
    cpu = f"{hw['cpu']} ({hw['cpu_threads']} threads)"
    return f"{hw['gpu']} + {cpu}" if hw.get("gpu") else cpu


def markdown(result: dict[str, Any]) -> str:
    hw, tr, inf = result["hardware"], result.get("training"), result.get("inference")
    lines = [
        f"### {hardware_label(hw)}",
        "",
        f"Measured {result['date']} at commit {result['commit']} with "
        f"`{result['command']}`; torch {hw['torch']}, "
        f"onnxruntime {hw.get('onnxruntime')}.",
        "",
    ]
    if tr:
        lines += [
            f"**Training throughput** ({tr['arch']}, batch {tr['batch_size']}, "
            f"{tr['steps']} timed steps after {tr['warmup']} warm-up, median of "
            f"{tr['repeats']})",
            "",
            "| configuration | img/s |",
            "|---|---:|",
        ]
        lines += [f"| {k} | {v['median']:,.0f} |" for k, v in tr["img_per_s"].items()]
        lines += ["", "| ratio | value |", "|---|---:|"]
        lines += [f"| {k} | {v:.2f}x |" for k, v in tr["ratios"].items()]
        util = tr.get("gpu_utilisation", {})
        lines += [
            "",
            "GPU utilisation during the fast path: "
            + (
                f"{util['mean_pct']:.0f}% mean, {util['median_pct']:.0f}% median "
                f"({util['samples']} NVML samples)"
                if util.get("mean_pct") is not None
                else util.get("skipped", "n/a")
            ),
            "",
        ]
    if inf:
        lines += [
            f"**Inference** ({inf['arch']}; latency = median per call)",
            "",
            "| device | batch | torch eager ms | ORT ms | ORT/torch latency | "
            "torch img/s | ORT img/s |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in inf["rows"]:
            ort_ms = f"{r['ort_s'] * 1e3:.3f}" if "ort_s" in r else "n/a"
            ratio = f"{r['ort_over_torch_latency']:.2f}x" if "ort_s" in r else "n/a"
            ort_ips = f"{r['ort_img_per_s']:,.0f}" if "ort_s" in r else "n/a"
            lines.append(
                f"| {r['device']} | {r['batch']} | {r['torch_s'] * 1e3:.3f} | {ort_ms} "
                f"| {ratio} | {r['torch_img_per_s']:,.0f} | {ort_ips} |"
            )
        lines.append("")
    ttt = result.get("time_to_target")
    if ttt:
        reached = ttt["reached"]
        lines += [
            f"**Time to {ttt['target']:.0%} test accuracy** (`fast` preset, "
            f"{ttt['device']}, {ttt['precision']}): "
            + (
                f"{reached['train_s']:.2f} s of training, epoch {reached['epoch']}"
                if reached
                else f"not reached in {len(ttt['history'])} epochs"
            ),
            "",
        ]
    return "\n".join(lines)


def update_docs(path: Path, key: str, body: str) -> None:
    """Replace this hardware's section of docs/benchmarks.md (other sections untouched)."""
    start, end = DOCS_START.format(key=key), DOCS_END.format(key=key)
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    block = f"{start}\n{body}\n{end}"
    if start in text and end in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


def _bars(ax: Any, labels: list[str], series: dict[str, list[float]], xlabel: str) -> None:
    """Horizontal bars with their values written on them; log scale only when the values
    span more than 20x (CPU vs GPU), and then from a tenth of the smallest, so bar lengths
    are not exaggerated by a clipped axis."""
    values = [v for vs in series.values() for v in vs if v > 0]
    ypos = np.arange(len(labels))
    height = 0.8 / max(len(series), 1)
    for i, (name, vs) in enumerate(series.items()):
        offs = ypos - 0.4 + height * (i + 0.5)
        bars = ax.barh(offs, vs, height, label=name)
        ax.bar_label(bars, labels=[f"{v:,.0f}" if v else "n/a" for v in vs], fontsize=7, padding=2)
    ax.set_yticks(ypos, labels)
    if values and max(values) / min(values) > 20:
        ax.set_xscale("log")
        ax.set_xlim(left=min(values) / 10)
        xlabel += " (log)"
    ax.set_xlim(right=max(values or [1]) * 1.25)
    ax.set_xlabel(xlabel)
    ax.invert_yaxis()


def chart(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), dpi=100)
    tr = result.get("training", {}).get("img_per_s", {})
    _bars(axes[0], list(tr), {"median": [tr[n]["median"] for n in tr]}, "training img/s")
    rows = result.get("inference", {}).get("rows", [])
    _bars(
        axes[1],
        [f"{r['device']} batch {r['batch']}" for r in rows],
        {
            "torch eager": [r["torch_img_per_s"] for r in rows],
            "ONNX Runtime": [r.get("ort_img_per_s", 0) for r in rows],
        },
        "inference img/s",
    )
    axes[1].legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)
    fig.suptitle(f"trainyard benchmark — {hardware_label(result['hardware'])}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ----------------------------------------------------------------------------- main

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
}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        prog="python -m trainyard.bench",
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
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--skip-inference", action="store_true")
    args = parser.parse_args(argv)

    import torch
    import yaml

    cfg = dict(QUICK if args.quick else FULL)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    hw = hardware()
    log(f"bench: hardware: {hardware_label(hw)}")
    data = load_data(find_raw_dir(args.raw), cfg["limit"])
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "command": "python -m trainyard.bench "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
        or "unknown",
        "hardware": hw,
        "config": cfg,
        "classes": fashion_card().num_classes,
    }
    t0 = time.perf_counter()
    if not args.skip_training:
        result["training"] = training_benchmarks(data, cfg, log)
    if not args.skip_inference:
        result["inference"] = inference_benchmarks(data, cfg, log)
    if args.time_to_target or args.gpu_check:
        if torch.cuda.is_available() or args.quick:
            preset = yaml.safe_load(Path(args.preset).read_text())
            result["time_to_target"] = time_to_target(
                data, preset, args.target, 1 if args.quick else args.max_epochs, log
            )
        else:
            result["time_to_target"] = None
            log("bench: no CUDA GPU here: time-to-target skipped (it is a GPU figure)")
    result["elapsed_s"] = round(time.perf_counter() - t0, 1)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    log(f"bench: wrote {out}")
    if args.chart:
        chart(result, Path(args.chart))
        log(f"bench: wrote {args.chart}")
    if args.docs:
        key = "gpu" if hw.get("gpu") else "cpu"
        update_docs(Path(args.docs), f"{key}{'-quick' if args.quick else ''}", markdown(result))
        log(f"bench: updated {args.docs}")
    print()
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
