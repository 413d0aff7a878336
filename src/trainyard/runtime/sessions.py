"""ONNX Runtime sessions: the provider is chosen from what is present, then reported.

Shared by export (parity), evaluate and the serving layer. CUDA is asked for only when a
GPU and the CUDA provider are both there: onnxruntime-gpu logs a loud error and falls back
to CPU when asked for CUDA without a GPU, which is exactly the silent fallback we refuse.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import onnxruntime as ort

from trainyard.core.errors import ProviderError

log = logging.getLogger(__name__)

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
Device = Literal["auto", "cpu", "cuda"]


def cuda_device_count() -> int:
    """GPUs the CUDA driver sees (0 without a driver), without importing torch."""
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        count = ctypes.c_int(0)
        if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return 0
        return int(count.value)
    return 0


def choose_providers(device: Device = "auto") -> list[str]:
    """Providers to ask ONNX Runtime for, given what is installed and present."""

    available = ort.get_available_providers()
    cuda_ok = CUDA in available and cuda_device_count() > 0
    if device == "cuda" and not cuda_ok:
        why = (
            "onnxruntime has no CUDA provider (install onnxruntime-gpu)"
            if CUDA not in available
            else "no CUDA GPU is visible"
        )
        raise ProviderError(f"device 'cuda' asked for, but {why}; use 'auto' or 'cpu'")
    if device != "cpu" and cuda_ok:
        return [CUDA, CPU]
    return [CPU]


@dataclass
class OnnxModel:
    """An ONNX Runtime session plus the model's own metadata (classes, normalisation...)."""

    session: Any
    provider: str
    metadata: dict[str, str]
    input_name: str

    @property
    def classes(self) -> list[str]:
        return json.loads(self.metadata["classes"])

    def run(self, x: np.ndarray) -> np.ndarray:
        """Logits for a normalised float32 batch [B,1,H,W]."""
        return self.session.run(None, {self.input_name: np.ascontiguousarray(x, np.float32)})[0]

    def predict_logits(self, x: np.ndarray, batch_size: int = 1024) -> np.ndarray:
        return np.concatenate(
            [self.run(x[i : i + batch_size]) for i in range(0, x.shape[0], batch_size)]
        )


def load_onnx(
    path: str | os.PathLike[str],
    device: Device = "auto",
    intra_op_threads: int = 0,
    say: bool = True,
) -> OnnxModel:
    """Open ``path`` on the best allowed provider and say which one actually runs
    (``say=False``: a second opening of a model the stage already reported)."""

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: ONNX model not found; run `dvc repro export` first")
    providers = choose_providers(device)
    opts = ort.SessionOptions()
    # ORT_ENABLE_ALL: Conv+BatchNorm folding and layout optimisations for this machine.
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = intra_op_threads  # 0 = one per physical core
    opts.log_severity_level = 3
    session = ort.InferenceSession(str(path), sess_options=opts, providers=providers)
    running = session.get_providers()[0]
    if running != providers[0]:
        raise ProviderError(f"{path}: asked ONNX Runtime for {providers[0]}, got {running}")
    if say:
        log.info("ONNX Runtime on %s for %s", running, path)
    meta = dict(session.get_modelmeta().custom_metadata_map)
    return OnnxModel(session, running, meta, session.get_inputs()[0].name)
