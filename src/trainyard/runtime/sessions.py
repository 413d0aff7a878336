"""ONNX Runtime sessions: the provider is chosen from what is present, then reported.

Shared by export (parity), evaluate and the serving layer. CUDA is asked for only when a
GPU and the CUDA provider are both there: onnxruntime-gpu logs a loud error and falls back
to CPU when asked for CUDA without a GPU, which is exactly the silent fallback we refuse.

On CUDA a session runs through IO binding (``run_bound``): a plain ``session.run`` takes
host arrays and returns host arrays, so every call pays its own copies and synchronisations
around the kernels; bound, the input crosses the bus once, the outputs are allocated on the
device by ORT's arena, and the caller decides whether (and when) they come back.

A trainyard model's outputs are ``logits`` and, from the export that added it,
``embedding`` (the classifier head's input, for drift and the prediction log), then
``cam`` (the class activation maps, trainyard.runtime.explain). Readers ask for an output
by name, so a model exported before them (logits only) runs everywhere.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import onnxruntime as ort

from trainyard.core.errors import ProviderError
from trainyard.runtime.explain import CAM_OUTPUT

log = logging.getLogger(__name__)

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
Device = Literal["auto", "cpu", "cuda"]
# The exported model's output names (trainyard.export writes them, every reader asks by them).
LOGITS_OUTPUT = "logits"
EMBEDDING_OUTPUT = "embedding"


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


def binding_device(providers: Sequence[str]) -> str | None:
    """Where a session running on ``providers`` (``session.get_providers()``: the one that
    runs first) binds its inputs and outputs: 'cuda' on CUDA, None (plain ``session.run``)
    otherwise. On the CPU binding gains nothing: ``run`` already reads the numpy input in
    place, and its outputs are host arrays either way."""
    return "cuda" if providers and providers[0] == CUDA else None


def run_bound(
    session: Any,
    feeds: Mapping[str, np.ndarray | ort.OrtValue],
    device: str,
    device_id: int = 0,
    outputs: Sequence[str] | None = None,
) -> Any:
    """Run ``session`` once through IO binding on ``device`` ('cuda', or 'cpu' for tests);
    returns the ``IOBinding``: ``.get_outputs()`` leaves the outputs on the device,
    ``.copy_outputs_to_cpu()`` brings them back as numpy arrays, in ``outputs``' order.
    ``outputs``: the output names to bind (None: all); ORT neither allocates nor returns
    an output left unbound.

    A numpy feed is copied to the device once; an ``OrtValue`` already there is bound as
    is (no copy). Outputs are bound by device only, so ORT allocates them from its arena
    at the shape the batch gives: reusing a buffer per shape would save only that arena
    lookup, and a buffer shared between the service's concurrent inferences would need a
    lock. One binding per call keeps concurrent calls independent. ORT synchronises the
    provider's stream at the end of a run (RunOptions left at their default), so the
    outputs are complete when this returns.
    """
    binding = session.io_binding()
    for name, value in feeds.items():
        if not isinstance(value, ort.OrtValue):
            value = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(value), device, device_id)
        binding.bind_ortvalue_input(name, value)
    names = [out.name for out in session.get_outputs()] if outputs is None else outputs
    for name in names:
        binding.bind_output(name, device, device_id)
    session.run_with_iobinding(binding)
    return binding


@dataclass
class OnnxModel:
    """An ONNX Runtime session plus the model's own metadata (classes, normalisation...).

    ``bind_device`` ('cuda', from ``binding_device``): ``run`` goes through IO binding
    there; None: plain ``session.run``. ``logits_output`` is the output named ``logits``
    (else the first: any classifier); ``embedding_output`` the one named ``embedding``,
    None for a model exported without it."""

    session: Any
    provider: str
    metadata: dict[str, str]
    input_name: str
    bind_device: str | None = None
    logits_output: str = field(init=False)
    embedding_output: str | None = field(init=False)
    cam_output: str | None = field(init=False)

    def __post_init__(self) -> None:
        names = [out.name for out in self.session.get_outputs()]
        self.logits_output = LOGITS_OUTPUT if LOGITS_OUTPUT in names else names[0]
        self.embedding_output = EMBEDDING_OUTPUT if EMBEDDING_OUTPUT in names else None
        self.cam_output = CAM_OUTPUT if CAM_OUTPUT in names else None

    @property
    def classes(self) -> list[str]:
        return json.loads(self.metadata["classes"])

    @property
    def io_binding(self) -> bool:
        """Whether ``run`` binds inputs and outputs on the device (reported beside the provider)."""
        return self.bind_device is not None

    @property
    def has_embedding(self) -> bool:
        """Whether the model has the ``embedding`` output (models exported before it: no)."""
        return self.embedding_output is not None

    def run(self, x: np.ndarray) -> np.ndarray:
        """Logits for a normalised float32 batch [B,C,H,W], as a host array: bound, the
        batch goes to the device once and only the logits (B x classes) come back. Only
        the logits are asked for: an embedding output is neither copied nor returned."""
        return self._run(x, [self.logits_output])[0]

    def run_with_embedding(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """(logits, embedding [B, D] float32) for a normalised float32 batch, both host
        arrays from one run; the embedding is None for a model exported without it."""
        if self.embedding_output is None:
            return self.run(x), None
        logits, embedding = self._run(x, [self.logits_output, self.embedding_output])
        return logits, embedding

    @property
    def has_cam(self) -> bool:
        """Whether the model has the ``cam`` output (models exported before it: no)."""
        return self.cam_output is not None

    def run_with_cam(
        self, x: np.ndarray, embedding: bool = False
    ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """(logits, embedding or None, cam [B, classes, h, w]) from one run, host arrays;
        the embedding only when asked for and the model has it. Only an explaining caller
        asks: ``run`` neither copies nor returns the maps."""
        if self.cam_output is None:
            raise ValueError("the model has no 'cam' output (exported before it)")
        names = [self.logits_output, self.cam_output]
        if embedding and self.embedding_output is not None:
            logits, cam, emb = self._run(x, [*names, self.embedding_output])
            return logits, emb, cam
        logits, cam = self._run(x, names)
        return logits, None, cam

    def _run(self, x: np.ndarray, names: list[str]) -> list[np.ndarray]:
        x = np.ascontiguousarray(x, np.float32)
        if self.bind_device is not None:
            feeds = {self.input_name: x}
            return run_bound(
                self.session, feeds, self.bind_device, outputs=names
            ).copy_outputs_to_cpu()
        return self.session.run(names, {self.input_name: x})

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
    bind = binding_device(session.get_providers())
    if say:
        bound = " with IO binding" if bind is not None else ""
        log.info("ONNX Runtime on %s%s for %s", running, bound, path)
    meta = dict(session.get_modelmeta().custom_metadata_map)
    return OnnxModel(session, running, meta, session.get_inputs()[0].name, bind)
