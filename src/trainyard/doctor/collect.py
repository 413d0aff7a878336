"""``collect``: every fact the verdicts need, read from this machine and the configuration."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from trainyard.core.config import DEFAULT_PARAMS, Params, load_params
from trainyard.core.errors import TrainyardError
from trainyard.doctor.dataset import collect_dataset, collect_disk
from trainyard.doctor.machine import (
    collect_cpu,
    collect_gpus,
    collect_onnxruntime,
    collect_ram,
    collect_torch,
)
from trainyard.doctor.terms import DEFAULT_DATA, safely


def collect_precision(params: Params) -> dict[str, Any]:
    """Training's own choice (training.device.resolve_device): accelerator, precision, device."""
    try:  # probe: training.device imports torch, which may be the broken install
        from trainyard.training.device import resolve_device
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}"}
    out: dict[str, Any] = {"setting": params.train.precision, "error": None}
    try:
        train = params.train
        accelerator, precision, device = resolve_device(train.accelerator, train.precision)
    except TrainyardError as err:
        return {**out, "accelerator": None, "precision": None, "device": None, "error": str(err)}
    return {**out, "accelerator": accelerator, "precision": precision, "device": device}


def collect_batch(
    params: Params, dataset: dict[str, Any], precision: dict[str, Any]
) -> dict[str, Any]:
    """The batch training will take (the recipe's ``forecast_batch``); on a GPU its
    ladder is measured now, as the train stage will."""
    if precision.get("error") or not precision.get("accelerator"):
        return {"error": f"no training device: {precision.get('error') or 'unknown'}"}
    if dataset.get("error"):
        return {"error": f"no dataset size: {dataset['error']}"}
    try:  # probe: train.recipe imports Lightning, which may be the broken install
        from trainyard.training.recipe import forecast_batch
        from trainyard.training.speed import Facts
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}"}

    facts = Facts(
        train_images=dataset["splits"]["train"]["images"],
        val_images=dataset["splits"]["val"]["images"],
        classes=10,  # not known before prepare; only the head's width, nothing to the batch
        channels=dataset["channels"],
        height=dataset["height"],
        width=dataset["width"],
        accelerator=precision["accelerator"],
        precision=precision["precision"],
        device=precision["device"],
    )
    batch, by, why = forecast_batch(params.train, facts)
    return {"batch_size": batch, "by": by, "why": why, "error": None}


def _load_params(path: Path, missing_ok: bool) -> tuple[Params, dict[str, Any]]:
    """The params at ``path`` and the facts about them; the defaults when the file is
    missing (``missing_ok``: none was named) or invalid, and the facts say so."""
    facts: dict[str, Any] = {"path": str(path), "loaded": False, "error": None}
    if missing_ok and not path.is_file():
        facts["error"] = f"{path}: not found; the defaults are used"
        facts["missing"] = True
        return Params(), facts
    try:
        params = load_params(path)
    except TrainyardError as err:
        facts["error"] = str(err)
        return Params(), facts
    facts["loaded"] = True
    return params, facts


def collect(
    params_path: str | os.PathLike[str] | None = None,
    data_dir: str | os.PathLike[str] = DEFAULT_DATA,
) -> dict[str, Any]:
    """Every fact the verdicts need, read from this machine and the configuration.

    ``params_path`` None: ./params.yaml if there is one, else the defaults (said so).
    """
    t0 = time.perf_counter()
    path = Path(params_path) if params_path is not None else DEFAULT_PARAMS
    params, params_facts = _load_params(path, missing_ok=params_path is None)
    root = path.absolute().parent
    data_dir = Path(data_dir)
    torch_facts = safely(collect_torch)
    driver_gpus = int((torch_facts.get("driver") or {}).get("gpus") or 0)
    try:
        gpus = collect_gpus(torch_facts)
    except Exception as err:
        torch_facts["gpu_error"] = f"{type(err).__name__}: {err}"
        gpus = []
    tp = params.train
    dataset = safely(collect_dataset, params, root, data_dir)
    precision = safely(collect_precision, params)
    return {
        "params": params_facts,
        "cpu": safely(collect_cpu),
        "ram": safely(collect_ram),
        "gpus": gpus,
        "torch": torch_facts,
        "onnxruntime": safely(collect_onnxruntime, params, driver_gpus),
        "disk": safely(lambda: {"places": collect_disk(root, data_dir)}).get("places", []),
        "dataset": dataset,
        "train": {
            "accelerator": tp.accelerator,
            "devices": tp.devices,
            "precision": tp.precision,
            "device_resident": tp.device_resident,
            "data_path": tp.data_path,
            "memory_budget": tp.memory_budget,
        },
        "precision": precision,
        "batch": safely(collect_batch, params, dataset, precision),
        "data_dir": str(data_dir),
        "collect_s": round(time.perf_counter() - t0, 2),
    }
