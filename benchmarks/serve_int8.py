"""`make bench-serve`'s section 6: int8 (``export.quantize: int8``) against fp32, side by
side in one run, on the Fashion CNN (models/model.onnx) and a resnet18 at 64 px.

The resnet18 is trained here for a few hundred steps on the prepared Fashion-MNIST
(data/prepared, upsampled to 64x64 as the service resizes an upload by its card): a random
network's near-tied logits would make the agreement meaningless. Both models are quantized
by the export's own code (trainyard.export.quantize: calibration on a seeded train sample,
the gate's figures on the test split; here with thresholds that never fail, the figures
are what is wanted). Built in a child process (torch); the bench's own process only serves
them and runs ONNX Runtime on one thread at batch 1 and 64.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness.publish import subsection
from benchmarks.serve_figures import FASHION, LARGE

INT8_SIZE = 64  # the resnet18's input side
INT8_RESNET = f"{LARGE}-{INT8_SIZE}"
INT8_MODELS = (FASHION, INT8_RESNET)
INT8_BATCHES = (1, 64)
GATE_IMAGES = 2000  # test images the figures are computed on (the stage uses all of them)
FIGURES = "int8.json"


def _upsample(images: np.ndarray, size: int) -> np.ndarray:
    """uint8 [N,1,28,28] -> [N,1,size,size], bilinear (the card's interpolation)."""
    from PIL import Image

    out = np.empty((images.shape[0], 1, size, size), dtype=np.uint8)
    for i, image in enumerate(images):
        out[i, 0] = np.asarray(Image.fromarray(image[0]).resize((size, size), Image.BILINEAR))
    return out


def _train_resnet(root: Path, data: Path, steps: int) -> Path:
    """models/model.onnx of a resnet18 at 64 px after ``steps`` CPU steps (batch 64)."""
    import dataclasses

    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from trainyard.core.card import load_card
    from trainyard.core.io import atomic_write_text, sha256_file
    from trainyard.data.arrays import load_split
    from trainyard.export.onnx_export import export_onnx, model_metadata
    from trainyard.model.classifier import Classifier
    from trainyard.training.builder import build_trainer
    from trainyard.training.datamodule import TensorBatches

    images, labels = load_split(data, "train")
    rows = np.random.default_rng(0).choice(images.shape[0], steps * 64, replace=True)
    x = torch.from_numpy(_upsample(np.asarray(images[np.sort(rows)]), INT8_SIZE))
    y = torch.from_numpy(labels[np.sort(rows)].astype(np.int64))
    card = dataclasses.replace(load_card(data), height=INT8_SIZE, width=INT8_SIZE)
    L.seed_everything(0, verbose=False)
    model = Classifier(card=card.contract(), arch=LARGE, pretrained=None)
    trainer = build_trainer(max_steps=steps, root=root)
    trainer.fit(model, DataLoader(TensorBatches(x, y, 64, shuffle=True), batch_size=None))
    path = root / "model.onnx"
    export_onnx(model.eval(), path, 18, model_metadata(model, "bench", "", ""))
    atomic_write_text(path.with_name(path.name + ".sha256"), f"{sha256_file(path)}  {path.name}\n")
    return path


def build_int8_models(out: Path, repo: Path, steps: int) -> None:
    """``out/<model>/model.onnx`` and ``model.int8.onnx`` for both models, and their gate
    figures in ``out/int8.json``. Run as ``python -m benchmarks.bench_serve --build-int8``."""
    from trainyard.core.config import load_params
    from trainyard.data.arrays import load_split
    from trainyard.export.quantize import calibration_sample, export_int8

    params = load_params(repo / "params.yaml")
    data = repo / "data/prepared"
    (out / FASHION).mkdir(parents=True, exist_ok=True)
    (out / INT8_RESNET).mkdir(parents=True, exist_ok=True)
    for name in ("model.onnx", "model.onnx.sha256"):
        shutil.copy(repo / "models" / name, out / FASHION / name)
    t0 = time.monotonic()
    resnet = _train_resnet(out / INT8_RESNET, data, steps)
    train_s = time.monotonic() - t0
    train, _ = load_split(data, "train")
    test, labels = load_split(data, "test")
    rows = np.sort(np.random.default_rng(0).choice(test.shape[0], GATE_IMAGES, replace=False))
    test, labels = np.asarray(test[rows]), labels[rows]
    calibration = calibration_sample(train, params.export.calibration_samples, params.seed)
    figures: dict[str, Any] = {"resnet_train_steps": steps, "resnet_train_s": train_s}
    for name, model in ((FASHION, out / FASHION / "model.onnx"), (INT8_RESNET, resnet)):
        big = name == INT8_RESNET  # fed upsampled, as the service resizes an upload
        calib, images = (_upsample(a, INT8_SIZE) if big else a for a in (calibration, test))
        gate = export_int8(model, calib, images, labels, 0.0, 100.0)
        figures[name] = {k: gate[k] for k in ("agreement", "accuracy_fp32", "accuracy_int8")}
        figures[name] |= {"accuracy_drop": gate["accuracy_drop"], "samples": gate["samples"]}
        figures[name] |= {
            "fp32_mb": model.stat().st_size / 1e6,
            "int8_mb": model.with_name("model.int8.onnx").stat().st_size / 1e6,
        }
    (out / FIGURES).write_text(json.dumps(figures, indent=2))


def ort_single_thread(folder: Path, seconds: float) -> list[dict[str, Any]]:
    """fp32 and int8 of each model on ONNX Runtime, 1 intra-op thread, batch 1 and 64:
    ms per batch and img/s (the ``serve.intra_op_threads: auto`` setting)."""
    from benchmarks.serve_models import ort_rate
    from trainyard.core.card import card_from_metadata
    from trainyard.runtime.sessions import load_onnx

    rows = []
    for name in INT8_MODELS:
        for precision, file in (("fp32", "model.onnx"), ("int8", "model.int8.onnx")):
            session = load_onnx(folder / name / file, device="cpu", intra_op_threads=1, say=False)
            shape = card_from_metadata(session.metadata, file).input_shape
            for batch in INT8_BATCHES:
                x = np.random.default_rng(0).standard_normal((batch, *shape), dtype=np.float32)
                rate = ort_rate(session, x, seconds)
                rows.append({"model": name, "precision": precision, **rate})
                print(
                    f"  ONNX Runtime 1 thread, {name} {precision} batch {batch:>2}: "
                    f"{rate['ms_per_batch']:7.3f} ms, {rate['img_per_s']:7.0f} img/s",
                    flush=True,
                )
    return rows


INT8_HEAD = "### int8 vs fp32 (export.quantize: int8, serve.precision: int8)"
INT8_COLUMNS = (  # the table's header cells
    "model | agreement | accuracy fp32 -> int8 (drop, points) | MB fp32 / int8 | "
    "req/s 16 clients fp32 / int8 | ORT 1 thread ms, batch 1 fp32 / int8 | "
    "batch 64 fp32 / int8"
)


def _int8_table(int8: dict[str, Any]) -> list[str]:
    """Section 6's rows, one per model, and the note under them."""
    lines: list[str] = []
    for name in INT8_MODELS:
        f = int8["figures"][name]
        req = {p: _pick(int8["rows"], model=name, precision=p) for p in ("fp32", "int8")}
        ort = {
            (p, b): _pick(int8["ort"], model=name, precision=p, batch=b)
            for p in ("fp32", "int8")
            for b in INT8_BATCHES
        }
        cells = [
            f"{f['agreement']:.2%}",
            f"{f['accuracy_fp32']:.2%} -> {f['accuracy_int8']:.2%} ({f['accuracy_drop']:+.2f})",
            f"{f['fp32_mb']:.1f} / {f['int8_mb']:.1f}",
            _pair(req["fp32"], req["int8"], "ok_per_s", ".0f"),
            *(_pair(ort[("fp32", b)], ort[("int8", b)], "ms_per_batch", ".2f") for b in (1, 64)),
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Agreement and accuracy on {int8['figures'][FASHION]['samples']} test images; the "
        f"resnet18 trained {int8['figures']['resnet_train_steps']} steps here. Ratios are int8 "
        "/ fp32; below 1x on ms is faster.",
    ]
    return lines


def int8_lines(result: dict[str, Any]) -> list[str]:
    """Section 6 side by side: per model, the figures and int8 / fp32 ratios (markdown)."""
    return subsection(result, "int8", INT8_HEAD, INT8_COLUMNS, _int8_table)


def _pick(rows: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    found = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    return found[-1] if found else None


def _pair(a: dict[str, Any] | None, b: dict[str, Any] | None, key: str, fmt: str) -> str:
    if a is None or b is None:
        return "n/a"
    return f"{a[key]:{fmt}} / {b[key]:{fmt}} ({b[key] / a[key]:.2f}x)"
