"""What a figure was measured on: the CPU and its cores, the load, the library versions.
torch and onnxruntime are imported only by ``torch_facts``, where they are measured."""

from __future__ import annotations

import os
import platform
from typing import Any

from trainyard.core.host import cpu_name


def usable_cores() -> int:
    """The cores this process may run on (its affinity), else all of them."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_facts() -> dict[str, Any]:
    """The CPU, its cores (all, and usable here) and the Python version."""
    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "cores_usable": usable_cores(),
        "python": platform.python_version(),
    }


def load_facts() -> dict[str, Any]:
    """The CPU, its cores and the 1-minute load average now: what a load test starts on."""
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "loadavg": os.getloadavg()[0]}


def torch_facts() -> dict[str, Any]:
    """The CPU, GPU and library versions the training and inference figures use."""
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


def hardware_label(hw: dict[str, Any]) -> str:
    """The hardware in a few words: GPU + CPU, or the CPU alone."""
    cpu = f"{hw['cpu']} ({hw['cpu_threads']} threads)"
    return f"{hw['gpu']} + {cpu}" if hw.get("gpu") else cpu
