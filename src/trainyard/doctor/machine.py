"""Facts about this machine: CPU, RAM, the GPUs as the driver and torch see them, and which
ONNX Runtime providers actually load. torch and onnxruntime are imported by probes: a broken
install becomes a reported fact, not a doctor that cannot start."""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import re
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from trainyard.core.config import Params
from trainyard.core.errors import TrainyardError
from trainyard.core.host import available_ram, cpu_has_bf16, cpu_name
from trainyard.doctor.terms import CPU_EP, CUDA_EP, TRT_EP, safely

# The colour codes of ONNX Runtime's terminal log: not part of what it said.
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
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


def _flush_c_stdio() -> None:
    """Flush C's stdio buffers (C++ iostreams write through them): what native code printed
    lands in the capture, not on the terminal after it."""
    # No libc to ask (not Linux/macOS): nothing of C's is buffered then.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).fflush(None)


@contextlib.contextmanager
def captured_output() -> Iterator[list[str]]:
    """Everything written to stdout and stderr inside the block, by Python or by native
    code on file descriptors 1 and 2, as lines; none of it reaches the terminal (nor the
    ``--json`` document). ONNX Runtime says why a provider failed both ways: its C++ log
    on fd 2, its Python ``EP Error ... Falling back to ['CPUExecutionProvider']`` block
    with print(). The descriptors are restored also when the block raises."""
    lines: list[str] = []
    sys.stdout.flush()
    sys.stderr.flush()
    _flush_c_stdio()  # what was printed before stays out of the capture
    saved = [os.dup(1), os.dup(2)]
    text = io.StringIO()
    with tempfile.TemporaryFile() as tmp:
        try:
            os.dup2(tmp.fileno(), 1)
            os.dup2(tmp.fileno(), 2)
            with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
                yield lines
        finally:
            _flush_c_stdio()
            for fd, dup in zip((1, 2), saved, strict=True):
                os.dup2(dup, fd)
                os.close(dup)
            tmp.seek(0)
            said = _ANSI.sub("", text.getvalue() + tmp.read().decode(errors="replace"))
            lines.extend(line.strip() for line in said.splitlines() if line.strip())


def _ort_reason(lines: list[str]) -> str:
    """The most telling line of what ONNX Runtime said: its own error log line (without the
    timestamp prefix), else its EP Error line; the banner and retry notice are left out."""
    said = [line for line in lines if line.strip("* ") not in ("", "EP Error")]
    logged = [line for line in said if "[E:" in line]
    errors = [line for line in said if "error" in line.lower()]
    line = (logged or errors or said or [""])[0]
    return line.split("] ", 1)[-1].strip()[:400]


def probe(provider: str, attempt: Callable[[], list[str]]) -> dict[str, Any]:
    """Whether ``provider`` runs: ``attempt`` makes a session and returns the providers it
    got, with all it prints captured (``captured_output``); when ``provider`` is not among
    them, ONNX Runtime's own words are the reason, and everything it said is kept."""
    t0 = time.perf_counter()
    with captured_output() as lines:
        try:
            running = attempt()
        except Exception as err:
            running, failure = [], str(err).strip().splitlines()[0][:400]
        else:
            failure = None
    ms = (time.perf_counter() - t0) * 1000
    if provider in running:
        return {"loads": True, "why": f"a session on it ran the probe model in {ms:.0f} ms"}
    why = failure or _ort_reason(lines) or f"ONNX Runtime fell back to {running[:1]}"
    out: dict[str, Any] = {"loads": False, "why": why}
    if lines:
        out["said"] = [line[:400] for line in lines[:20]]
    return out


def probe_provider(ort: Any, provider: str) -> dict[str, Any]:
    """Whether ``provider`` loads and runs the probe model, and if not, ONNX Runtime's why."""
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    providers = [provider] if provider == CPU_EP else [provider, CPU_EP]

    def attempt() -> list[str]:
        session = ort.InferenceSession(PROBE_MODEL, sess_options=opts, providers=providers)
        session.run(None, {"x": np.zeros(1, np.float32)})
        return list(session.get_providers())

    return probe(provider, attempt)


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
