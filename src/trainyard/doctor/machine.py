"""Facts about this machine: CPU, RAM, the GPUs as the driver and torch see them, and which
ONNX Runtime providers actually load. torch and onnxruntime are imported by probes: a broken
install becomes a reported fact, not a doctor that cannot start."""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from trainyard.core.config import Params
from trainyard.core.errors import TrainyardError
from trainyard.core.host import available_ram, cpu_has_bf16, cpu_name
from trainyard.doctor.base import CPU_EP, CUDA_EP, TRT_EP, safely

# A one-node ONNX model (Identity on float[1], opset 13, IR 8): what a provider must run to
# count as loading. Built once with onnx.helper (tests check it still is); embedded because
# importing onnx costs a second.
PROBE_MODEL = (
    b'\x08\x08:;\n\x10\n\x01x\x12\x01y"\x08Identity\x12\x05probeZ\x0f\n\x01x\x12\n\n\x08\x08'
    b"\x01\x12\x04\n\x02\x08\x01b\x0f\n\x01y\x12\n\n\x08\x08\x01\x12\x04\n\x02\x08\x01B\x04\n"
    b"\x00\x10\r"
)


# ----------------------------------------------------------------------------- CPU and RAM


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def collect_cpu() -> dict[str, Any]:
    """Model, logical/usable/physical cores, and the SIMD flags that decide bf16."""
    info = _cpuinfo()
    flags = set()
    cores = set()
    phys = core = None
    for line in info.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "flags" and not flags:
            flags = set(value.split())
        elif key == "physical id":
            phys = value.strip()
        elif key == "core id":
            core = value.strip()
            cores.add((phys, core))
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count() or 1
    return {
        "model": cpu_name(),
        "logical_cores": os.cpu_count(),
        "usable_cores": usable,
        "physical_cores": len(cores) or None,
        "bf16": cpu_has_bf16(),
        "flags": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}),
    }


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (``MemTotal``, ``MemAvailable``...); empty if unreadable."""
    out: dict[str, int] = {}
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def cgroup_memory_limit() -> int | None:
    """This container's memory limit (cgroup v2 or v1), or None when unlimited."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text == "max" or not text.isdigit():
            return None
        value = int(text)
        return value if value < 2**60 else None
    return None


def collect_ram() -> dict[str, Any]:
    """Total RAM, what training's placement reads as available, and the container's limit."""
    mem = meminfo()
    total = mem.get("MemTotal")
    if total is None:
        try:
            total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            total = None
    return {
        "total_bytes": total,
        # What training's placement reads (hardware.available_ram: MemAvailable).
        "available_bytes": available_ram(),
        "cgroup_limit_bytes": cgroup_memory_limit(),
    }


# ----------------------------------------------------------------------------- GPUs, torch


def _libcuda() -> Any:
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def _nvml_str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def collect_driver() -> dict[str, Any]:
    """What the NVIDIA driver sees, without torch: GPU count, driver version, the newest
    CUDA it supports, and per GPU name/memory/compute capability (NVML)."""
    try:  # probe: runtime.sessions imports onnxruntime, which may be the broken install
        from trainyard.runtime.sessions import cuda_device_count
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}"}
    out: dict[str, Any] = {"gpus": 0, "version": None, "cuda": None, "devices": []}
    lib = _libcuda()
    if lib is not None:
        version = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(version)) == 0 and version.value:
            out["cuda"] = f"{version.value // 1000}.{version.value % 1000 // 10}"
        out["gpus"] = cuda_device_count()
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
    except Exception:  # no NVML library: no NVIDIA driver
        pynvml = None
    if pynvml is not None:
        try:
            out["version"] = _nvml_str(pynvml.nvmlSystemGetDriverVersion())
            for i in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
                mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
                out["devices"].append(
                    {
                        "name": _nvml_str(pynvml.nvmlDeviceGetName(handle)),
                        "memory_bytes": int(mem.total),
                        "free_bytes": int(mem.free),
                        "compute_capability": f"{major}.{minor}",
                    }
                )
        finally:
            pynvml.nvmlShutdown()
    proc_gpus = Path("/proc/driver/nvidia/gpus")
    seen = len(list(proc_gpus.iterdir())) if proc_gpus.is_dir() else 0
    out["gpus"] = max(out["gpus"], len(out["devices"]), seen)
    return out


def _import_torch() -> tuple[Any, Exception | None]:
    """(torch, None), or (None, why it cannot be imported): a broken torch is reported."""
    try:  # probe: a torch that fails to import is the torch/CUDA check's finding
        import torch
    except Exception as err:
        return None, err
    return torch, None


def collect_torch() -> dict[str, Any]:
    """torch's build, whether CUDA works in it, and (if it does not) torch's own reason."""
    torch, failure = _import_torch()
    if failure is not None:
        return {"error": f"{type(failure).__name__}: {failure}"}
    driver = safely(collect_driver)
    info: dict[str, Any] = {
        "version": torch.__version__,
        "cuda": torch.version.cuda,  # the CUDA runtime torch was built with; None: CPU build
        "cudnn": None,
        "cuda_available": False,
        "cuda_error": None,
        "driver": driver,
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info["cuda_available"] = bool(torch.cuda.is_available())
    if info["cuda_available"]:
        info["cudnn"] = torch.backends.cudnn.version()
    elif torch.version.cuda and driver.get("gpus"):
        # is_available() only says False; init() says why (driver too old, no device...).
        try:
            torch.cuda.init()
        except Exception as err:
            info["cuda_error"] = str(err).strip()
        if not info["cuda_error"] and caught:
            info["cuda_error"] = str(caught[0].message).strip()
    return info


def collect_gpus(torch_facts: dict[str, Any]) -> list[dict[str, Any]]:
    """Each GPU: through torch when it can use CUDA, else as the driver lists them."""
    driver = torch_facts.get("driver") or {}
    if not torch_facts.get("cuda_available"):
        return [
            {
                "index": i,
                **d,
                "bf16": float(d["compute_capability"]) >= 8.0,
                "torch_bf16": None,
                "usable_by_torch": False,
                "driver": driver.get("version"),
                "driver_cuda": driver.get("cuda"),
                "cuda_runtime": torch_facts.get("cuda"),
            }
            for i, d in enumerate(driver.get("devices", []))
        ]
    torch, failure = _import_torch()  # imported already: collect_torch found CUDA usable
    if failure is not None:
        raise failure
    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        with torch.cuda.device(i):
            torch_bf16 = bool(torch.cuda.is_bf16_supported())
        gpus.append(
            {
                "index": i,
                "name": props.name,
                "memory_bytes": int(total),
                "free_bytes": int(free),
                "compute_capability": f"{props.major}.{props.minor}",
                # Native bf16 (tensor cores): Ampere, compute capability 8.0, and later.
                "bf16": props.major >= 8,
                # torch's is_bf16_supported(), which training's precision `auto` asks; it
                # also says True where bf16 is only emulated.
                "torch_bf16": torch_bf16,
                "usable_by_torch": True,
                "driver": driver.get("version"),
                "driver_cuda": driver.get("cuda"),
                "cuda_runtime": torch.version.cuda,
            }
        )
    return gpus


# ----------------------------------------------------------------------------- ONNX Runtime


@contextlib.contextmanager
def _captured_stderr() -> Iterator[list[str]]:
    """Capture what C++ code writes to fd 2 (ONNX Runtime's provider errors) as lines."""
    lines: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield lines
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            lines.extend(tmp.read().decode(errors="replace").splitlines())


def _ort_reason(lines: list[str]) -> str:
    """The most telling line of ONNX Runtime's log, without its timestamp prefix."""
    errors = [line for line in lines if "[E:" in line or "Error" in line or "error" in line]
    line = (errors or lines or [""])[0]
    return line.split("] ", 1)[-1].strip()[:400]


def probe_provider(ort: Any, provider: str) -> dict[str, Any]:
    """Whether ``provider`` loads and runs the probe model, and if not, ONNX Runtime's why."""
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    providers = [provider] if provider == CPU_EP else [provider, CPU_EP]
    t0 = time.perf_counter()
    with _captured_stderr() as lines:
        try:
            session = ort.InferenceSession(PROBE_MODEL, sess_options=opts, providers=providers)
            running = session.get_providers()
            session.run(None, {"x": np.zeros(1, np.float32)})
        except Exception as err:
            running, failure = [], str(err).strip().splitlines()[0][:400]
        else:
            failure = None
    ms = (time.perf_counter() - t0) * 1000
    if provider in running:
        return {"loads": True, "why": f"a session on it ran the probe model in {ms:.0f} ms"}
    why = failure or _ort_reason(lines) or f"ONNX Runtime fell back to {running[:1]}"
    return {"loads": False, "why": why}


def collect_onnxruntime(params: Params, driver_gpus: int) -> dict[str, Any]:
    """The build, its providers, which of CPU/CUDA/TensorRT actually load here, and what
    evaluate and the service will ask for (``inference.choose_providers``)."""
    try:  # probe: a broken onnxruntime is reported (runtime.sessions imports it too)
        import onnxruntime as ort

        from trainyard.runtime.sessions import choose_providers
    except ImportError as err:
        return {"version": None, "error": f"onnxruntime cannot be imported ({err})"}
    # Provider-load failures are logged at ERROR: captured by the probe, no other noise.
    ort.set_default_logger_severity(3)
    build = list(ort.get_available_providers())
    loads: dict[str, dict[str, Any]] = {CPU_EP: probe_provider(ort, CPU_EP)}
    for provider in (CUDA_EP, TRT_EP):
        if provider not in build:
            loads[provider] = {"loads": False, "why": "not in this onnxruntime build"}
        elif driver_gpus == 0:
            # onnxruntime-gpu logs a loud error when asked for CUDA without a GPU.
            loads[provider] = {"loads": None, "why": "no GPU visible to the driver"}
        else:
            loads[provider] = probe_provider(ort, provider)
    requested: dict[str, Any] = {}
    for who, device in (("evaluate", params.evaluate.device), ("serve", params.serve.device)):
        try:
            requested[who] = {"device": device, "providers": choose_providers(device)}
        except TrainyardError as err:
            requested[who] = {"device": device, "providers": None, "error": str(err)}
    return {
        "version": ort.__version__,
        "package": _ort_package(),
        "build_providers": build,
        "loads": loads,
        "requested": requested,
    }


def _ort_package() -> str | None:
    for name in ("onnxruntime-gpu", "onnxruntime"):
        try:
            return f"{name} {metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    return None
