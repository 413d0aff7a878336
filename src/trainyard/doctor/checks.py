"""``trainyard doctor``: what this machine is, and what trainyard will do on it.

    trainyard doctor            # a readable table (also: make doctor)
    trainyard doctor --json     # one JSON document
    python -m trainyard.doctor.checks  # the same, without the console script

Reports the CPU and RAM; each GPU (memory, compute capability, bf16, driver, torch's CUDA
runtime); RAM against GPU memory (the 2x rule); the torch and ONNX Runtime builds and which
ONNX Runtime providers actually load; free disk for the data and the DVC cache; and for the
configured dataset where training will put it and which precision ``auto`` picks. Every
verdict says why, and the verdicts are the pipeline's own decisions: placement is
``hardware.choose_placement``, precision ``hardware.resolve_device``, the ONNX Runtime
providers ``inference.choose_providers``.

Exit status: 0 fine (warnings allowed), 1 a broken setup (the message says what is broken
and what to do), 2 bad usage. Never imports mlflow, dvc or bentoml.

Layout: ``collect`` gathers facts (reads the machine); ``verdicts`` and ``report`` are pure
functions of those facts, so they are tested on crafted facts for machines we do not have.
"""

from __future__ import annotations

import argparse
import configparser
import contextlib
import ctypes
import json
import os
import shutil
import sys
import tempfile
import textwrap
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from trainyard.core.card import CARD_FILE, SPLITS, load_card
from trainyard.core.config import DEFAULT_PARAMS, Params, load_params
from trainyard.core.errors import TrainyardError

DEFAULT_DATA = Path("data/prepared")
OK, WARN, ERROR = "ok", "warn", "error"
CUDA_EP = "CUDAExecutionProvider"
TRT_EP = "TensorrtExecutionProvider"
CPU_EP = "CPUExecutionProvider"
SHORT = {CUDA_EP: "CUDA", TRT_EP: "TensorRT", CPU_EP: "CPU"}
MIN_FREE_DISK = 2**30  # room for checkpoints, the ONNX model and MLflow artifacts

# A one-node ONNX model (Identity on float[1], opset 13, IR 8): what a provider must run to
# count as loading. Built once with onnx.helper (tests check it still is); embedded because
# importing onnx costs a second.
PROBE_MODEL = (
    b'\x08\x08:;\n\x10\n\x01x\x12\x01y"\x08Identity\x12\x05probeZ\x0f\n\x01x\x12\n\n\x08\x08'
    b"\x01\x12\x04\n\x02\x08\x01b\x0f\n\x01y\x12\n\n\x08\x08\x01\x12\x04\n\x02\x08\x01B\x04\n"
    b"\x00\x10\r"
)


# ----------------------------------------------------------------------------- formatting


def human_bytes(n: float | None) -> str:
    """``1.5 GiB``, ``44.9 MiB``; ``?`` when unknown."""
    if n is None:
        return "?"
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def _verdict(check: str, level: str, verdict: str, why: str, **extra: Any) -> dict[str, Any]:
    return {"check": check, "level": level, "verdict": verdict, "why": why, **extra}


def _safely(fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """A collector's facts, or ``{"error": ...}``: one unreadable fact never hides the rest."""
    try:
        return fn(*args)
    except Exception as err:  # the doctor reports a failure; it must not become one
        return {"error": f"{type(err).__name__}: {err}"}


# ----------------------------------------------------------------------------- CPU and RAM


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def collect_cpu() -> dict[str, Any]:
    """Model, logical/usable/physical cores, and the SIMD flags that decide bf16."""
    from trainyard.core.host import cpu_has_bf16, cpu_name

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
    from trainyard.core.host import available_ram

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


def effective_ram(ram: dict[str, Any]) -> int | None:
    """Total RAM this process may use: MemTotal, or the container's limit when lower."""
    total, limit = ram.get("total_bytes"), ram.get("cgroup_limit_bytes")
    if total is None:
        return limit
    return min(total, limit) if limit else total


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
    from trainyard.runtime.sessions import cuda_device_count

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


def collect_torch() -> dict[str, Any]:
    """torch's build, whether CUDA works in it, and (if it does not) torch's own reason."""
    import torch

    driver = _safely(collect_driver)
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
    import torch

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
    import numpy as np

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
    from trainyard.runtime.sessions import choose_providers

    try:
        import onnxruntime as ort
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
    from importlib import metadata

    for name in ("onnxruntime-gpu", "onnxruntime"):
        try:
            return f"{name} {metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    return None


# ----------------------------------------------------------------------------- disk


def _shown(path: Path) -> str:
    """``path`` relative to the working directory when it is under it."""
    try:
        return str(path.absolute().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def dvc_cache_dir(root: Path) -> Path | None:
    """The DVC cache of the repository at ``root`` (``[cache] dir`` in .dvc/config or
    config.local, relative to .dvc/), read without importing dvc; None: not a DVC repo."""
    dvc_dir = root / ".dvc"
    if not dvc_dir.is_dir():
        return None
    cache = dvc_dir / "cache"
    for name in ("config", "config.local"):
        parser = configparser.ConfigParser()
        try:
            parser.read(dvc_dir / name)
        except configparser.Error:
            continue
        if parser.has_option("cache", "dir"):
            cache = dvc_dir / parser.get("cache", "dir").strip("'\"")
    return Path(os.path.normpath(cache))


def collect_disk(root: Path, data_dir: Path) -> list[dict[str, Any]]:
    """Free space on the filesystems holding the data and the DVC cache."""
    places = [("data", data_dir)]
    cache = dvc_cache_dir(root)
    if cache is not None:
        places.append(("dvc cache", cache))
    out = []
    for what, path in places:
        checked = _existing(path)
        usage = shutil.disk_usage(checked)
        out.append(
            {
                "what": what,
                "path": _shown(path),
                "checked": str(checked),
                "free_bytes": int(usage.free),
                "total_bytes": int(usage.total),
                "filesystem": os.stat(checked).st_dev,
            }
        )
    return out


# ----------------------------------------------------------------------------- dataset


def _split_sizes(counts: dict[str, int], c: int, h: int, w: int) -> dict[str, dict[str, int]]:
    return {s: {"images": int(n), "bytes": int(n) * c * h * w} for s, n in counts.items()}


def _dataset(
    source: str, origin: str, c: int, h: int, w: int, counts: dict[str, int], note: str
) -> dict[str, Any]:
    splits = _split_sizes({s: counts.get(s, 0) for s in SPLITS}, c, h, w)
    return {
        "source": source,
        "from": origin,
        "channels": c,
        "height": h,
        "width": w,
        "splits": splits,
        # What training places (train + val); test is read in batches by evaluate.
        "placed_bytes": splits["train"]["bytes"] + splits["val"]["bytes"],
        "total_bytes": sum(s["bytes"] for s in splits.values()),
        "note": note,
    }


def expected_fashion(params: Params) -> dict[str, Any]:
    """Fashion-MNIST's size before prepare: the 60,000-image train file (or data.limit)
    less data.val_size for train, data.val_size for val, the 10,000-image test file."""
    from trainyard.data.sources.fashion_mnist import IMAGE_SIZE, RAW_BY_NAME, SOURCE

    pool = params.data.limit or RAW_BY_NAME["train-images-idx3-ubyte.gz"].count
    test = RAW_BY_NAME["t10k-images-idx3-ubyte.gz"].count
    val = params.data.val_size
    counts = {"train": pool - val, "val": val, "test": test}
    note = (
        f"expected: {pool:,} train-file images ({pool - val:,} train + {val:,} val, "
        f"data.val_size) and {test:,} test, 1x{IMAGE_SIZE}x{IMAGE_SIZE}; nothing prepared yet"
    )
    return _dataset(SOURCE, "expected", 1, IMAGE_SIZE, IMAGE_SIZE, counts, note)


def _count_images(folder: Path) -> int:
    from trainyard.core.imaging import IMAGE_EXTENSIONS

    n = 0
    for _, dirs, files in os.walk(folder, followlinks=True):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__MACOSX"]
        n += sum(
            1
            for f in files
            if not f.startswith(".") and os.path.splitext(f)[1].lower() in IMAGE_EXTENSIONS
        )
    return n


def expected_folder(params: Params, root: Path) -> dict[str, Any]:
    """A folder source's size before prepare: its image files counted, times C*H*W of
    data.image_size (channels ``auto`` counted as 3, the larger case)."""
    data = params.data
    folder = Path(data.folder or "").expanduser()
    if not folder.is_absolute():
        folder = root / folder
    if not folder.is_dir():
        raise TrainyardError(
            f"data.folder: {folder} is not a folder; set data.folder to your image tree "
            "(photos/<class>/*.jpg)"
        )
    top = {p.name: p for p in folder.iterdir() if p.is_dir()}
    if set(top) & set(SPLITS):
        counts = {s: _count_images(top[s]) if s in top else 0 for s in SPLITS}
        layout = "train/val/test folders"
        if "val" not in top:
            counts["val"] = round(counts["train"] * data.val_fraction)
            counts["train"] -= counts["val"]
        if "test" not in top:
            counts["test"] = round(counts["train"] * data.test_fraction)
            counts["train"] -= counts["test"]
    else:
        total = _count_images(folder)
        layout = "class folders"
        val, test = round(total * data.val_fraction), round(total * data.test_fraction)
        counts = {"train": total - val - test, "val": val, "test": test}
    c = 3 if data.channels == "auto" else int(data.channels)
    h, w = data.size_hw
    note = (
        f"estimated: {sum(counts.values()):,} image files in {folder} ({layout}) at "
        f"data.image_size {h}x{w}, {c} channel(s)"
        + (
            " (channels auto: counted as 3; an all-grayscale folder prepares as 1)"
            if data.channels == "auto"
            else ""
        )
        + "; nothing prepared yet"
    )
    return _dataset("folder", "expected", c, h, w, counts, note)


def collect_dataset(params: Params, root: Path, data_dir: Path) -> dict[str, Any]:
    """The prepared dataset's card when it matches params, else the expected size."""
    stale = ""
    if (data_dir / CARD_FILE).is_file():
        try:
            card = load_card(data_dir)
        except TrainyardError as err:
            stale = f"the prepared card is unusable ({err}); "
        else:
            counts = {s: int(card.counts.get(s, {}).get("total", 0)) for s in SPLITS}
            mismatch = _card_mismatch(card, counts, params)
            if not mismatch:
                note = f"prepared: {data_dir / CARD_FILE}"
                return _dataset(
                    card.source, "card", card.channels, card.height, card.width, counts, note
                )
            stale = f"the prepared card does not match params ({mismatch}); `dvc repro` redoes it; "
    if params.data.source == "folder":
        expected = expected_folder(params, root)
    else:
        expected = expected_fashion(params)
    expected["note"] = stale + expected["note"]
    expected["stale_card"] = bool(stale)
    return expected


def _card_mismatch(card: Any, counts: dict[str, int], params: Params) -> str:
    data = params.data
    if card.source != data.source:
        return f"card source {card.source}, data.source {data.source}"
    if data.source == "folder":
        if (card.height, card.width) != data.size_hw:
            return f"card {card.height}x{card.width}, data.image_size {data.size_hw}"
        if data.channels != "auto" and card.channels != data.channels:
            return f"card {card.channels} channel(s), data.channels {data.channels}"
        return ""
    expected = expected_fashion(params)["splits"]
    if (
        counts["train"] + counts["val"] != (expected["train"]["images"] + expected["val"]["images"])
        or counts["val"] != expected["val"]["images"]
    ):
        return (
            f"card train+val {counts['train'] + counts['val']:,} (val {counts['val']:,}), "
            f"params {expected['train']['images'] + expected['val']['images']:,} "
            f"(val {expected['val']['images']:,})"
        )
    return ""


# ----------------------------------------------------------------------------- precision


def collect_precision(params: Params) -> dict[str, Any]:
    """Training's own choice (hardware.resolve_device): accelerator, precision, device."""
    from trainyard.data.hardware import resolve_device

    out: dict[str, Any] = {"setting": params.train.precision, "error": None}
    try:
        accelerator, precision, device = resolve_device(params.train)
    except TrainyardError as err:
        return {**out, "accelerator": None, "precision": None, "device": None, "error": str(err)}
    return {**out, "accelerator": accelerator, "precision": precision, "device": device}


# ----------------------------------------------------------------------------- collect


def collect(
    params_path: str | os.PathLike[str] | None = None,
    data_dir: str | os.PathLike[str] = DEFAULT_DATA,
) -> dict[str, Any]:
    """Every fact the verdicts need, read from this machine and the configuration.

    ``params_path`` None: ./params.yaml if there is one, else the defaults (said so).
    """
    t0 = time.perf_counter()
    path = Path(params_path) if params_path is not None else DEFAULT_PARAMS
    params_facts: dict[str, Any] = {"path": str(path), "loaded": False, "error": None}
    if params_path is None and not path.is_file():
        params, params_facts["error"] = Params(), f"{path}: not found; the defaults are used"
        params_facts["missing"] = True
    else:
        try:
            params = load_params(path)
            params_facts["loaded"] = True
        except TrainyardError as err:
            params, params_facts["error"] = Params(), str(err)
    root = path.absolute().parent
    data_dir = Path(data_dir)
    torch_facts = _safely(collect_torch)
    driver_gpus = int((torch_facts.get("driver") or {}).get("gpus") or 0)
    try:
        gpus = collect_gpus(torch_facts)
    except Exception as err:
        torch_facts["gpu_error"] = f"{type(err).__name__}: {err}"
        gpus = []
    tp = params.train
    return {
        "params": params_facts,
        "cpu": _safely(collect_cpu),
        "ram": _safely(collect_ram),
        "gpus": gpus,
        "torch": torch_facts,
        "onnxruntime": _safely(collect_onnxruntime, params, driver_gpus),
        "disk": _safely(lambda: {"places": collect_disk(root, data_dir)}).get("places", []),
        "dataset": _safely(collect_dataset, params, root, data_dir),
        "train": {
            "accelerator": tp.accelerator,
            "devices": tp.devices,
            "precision": tp.precision,
            "device_resident": tp.device_resident,
            "data_path": tp.data_path,
            "memory_budget": tp.memory_budget,
        },
        "precision": _safely(collect_precision, params),
        "data_dir": str(data_dir),
        "collect_s": round(time.perf_counter() - t0, 2),
    }


# ----------------------------------------------------------------------------- verdicts


def ram_vs_gpu(facts: dict[str, Any]) -> dict[str, Any]:
    """RAM against total GPU memory: at least 1x, ideally 2x (the 2x rule)."""
    ram = effective_ram(facts.get("ram") or {})
    gpus = facts.get("gpus") or []
    gpu = sum(int(g.get("memory_bytes") or 0) for g in gpus)
    out: dict[str, Any] = {"ram_bytes": ram, "gpu_bytes": gpu, "ratio": None}
    rule = "RAM should be at least the GPU memory, ideally twice"
    if not gpus:
        return {**out, **_verdict("RAM vs GPU", OK, "no GPU: the 2x rule does not apply", rule)}
    if not ram:
        return {**out, **_verdict("RAM vs GPU", WARN, "RAM size unknown", "/proc/meminfo unread")}
    ratio = ram / gpu
    out["ratio"] = round(ratio, 2)
    sizes = f"{human_bytes(ram)} RAM vs {human_bytes(gpu)} GPU memory ({ratio:.2f}x)"
    if ratio < 1:
        return {
            **out,
            **_verdict(
                "RAM vs GPU",
                WARN,
                f"RAM is below GPU memory ({ratio:.2f}x; the 2x rule wants 2x)",
                f"{sizes}: {rule}. Everything on the GPU passes through host memory first "
                "(splits on their way to the device, pinned batches, checkpoints), so less RAM "
                "than GPU memory means the GPU cannot be filled, or the host swaps. Use a "
                "machine with more RAM, or keep data memory-mapped (train.device_resident: "
                "false)",
            ),
        }
    if ratio < 2:
        return {
            **out,
            **_verdict(
                "RAM vs GPU",
                OK,
                f"RAM meets the minimum ({ratio:.2f}x), below the ideal 2x",
                f"{sizes}: {rule}; enough to stage what the GPU holds, with little room for "
                "the page cache and data loading beside it",
            ),
        }
    return {
        **out,
        **_verdict("RAM vs GPU", OK, f"RAM is {ratio:.1f}x GPU memory", f"{sizes}: {rule}"),
    }


def placement(facts: dict[str, Any]) -> dict[str, Any]:
    """Where training will put train+val, by ``hardware.choose_placement`` itself, with
    whether the data fits GPU memory, fits RAM, or must stream from the memory map."""
    import torch

    from trainyard.data.hardware import choose_placement

    dataset = facts.get("dataset") or {}
    nbytes = dataset.get("placed_bytes")
    if nbytes is None:
        return _verdict(
            "placement",
            WARN,
            "unknown: the dataset's size could not be found",
            dataset.get("error", "no dataset facts"),
            where=None,
            fits=None,
        )
    train = facts["train"]
    budget = float(train["memory_budget"])
    ram = int((facts.get("ram") or {}).get("available_bytes") or 0)
    gpus = [g for g in facts.get("gpus") or [] if g.get("usable_by_torch")]
    gpu_free = gpus[0].get("free_bytes") if gpus else None
    on_gpu = (facts.get("precision") or {}).get("accelerator") == "gpu" and gpu_free is not None
    resident = bool(train["device_resident"]) and train["data_path"] == "fast"
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    fits_gpu = (
        gpu_free is not None
        and choose_placement(nbytes, cuda, True, budget, ram, gpu_free)[0] == "device"
    )
    fits_ram = choose_placement(nbytes, cpu, False, budget, ram)[0] == "ram"
    where, why = choose_placement(nbytes, cuda if on_gpu else cpu, resident, budget, ram, gpu_free)
    fits = "GPU memory" if fits_gpu else "RAM" if fits_ram else "neither: must stream"
    does = {
        "device": "device-resident (on the GPU)",
        "ram": "in RAM",
        "mmap": "memory-mapped from disk",
    }[where]
    notes = []
    if fits_gpu and where != "device":
        notes.append(
            "it would fit the GPU, but "
            + (
                "train.device_resident is false"
                if not train["device_resident"]
                else "train.data_path is naive"
                if train["data_path"] != "fast"
                else "training runs on the CPU"
            )
        )
    limit = (facts.get("ram") or {}).get("cgroup_limit_bytes")
    level = OK
    if where == "ram" and limit and nbytes > budget * limit:
        level = WARN
        notes.append(
            f"this container is limited to {human_bytes(limit)}, less than the "
            f"{human_bytes(ram)} MemAvailable the budget reads: loading in RAM may be OOM-killed"
        )
    split_text = dataset.get("splits") or {}
    sizes = " + ".join(
        f"{s} {human_bytes(split_text[s]['bytes'])}" for s in ("train", "val") if s in split_text
    )
    return _verdict(
        "placement",
        level,
        f"fits {fits}; trainyard will train {does}",
        f"{sizes} (uint8): {why}" + "".join(f"; {n}" for n in notes),
        where=where,
        fits="gpu" if fits_gpu else "ram" if fits_ram else "stream",
        bytes=nbytes,
        budget=budget,
    )


def _cuda_verdict(facts: dict[str, Any]) -> dict[str, Any]:
    t = facts.get("torch") or {}
    if "version" not in t:
        return _verdict(
            "torch/CUDA",
            ERROR,
            "torch cannot be imported",
            f"{t.get('error', '?')}; reinstall the environment (make venv)",
        )
    driver = t.get("driver") or {}
    seen = int(driver.get("gpus") or 0)
    build, version = t.get("cuda"), t.get("version")
    gpus = facts.get("gpus") or []
    if t.get("cuda_available"):
        names = ", ".join(f"{g['name']} ({human_bytes(g.get('memory_bytes'))})" for g in gpus)
        return _verdict(
            "torch/CUDA",
            OK,
            f"{len(gpus)} GPU(s) usable: {names}",
            f"torch {version} with CUDA runtime {build}, driver {driver.get('version')} "
            f"(supports CUDA up to {driver.get('cuda')})",
        )
    if seen and build:
        why = t.get("cuda_error") or "torch.cuda.is_available() is False"
        hint = ""
        drv = driver.get("cuda")
        if drv and _version_tuple(drv) < _version_tuple(build):
            hint = (
                f" The driver supports CUDA up to {drv} but torch was built for {build}: "
                f"update the NVIDIA driver, or install a torch built for CUDA <= {drv}."
            )
        return _verdict(
            "torch/CUDA",
            ERROR,
            f"torch was built for CUDA {build} and the driver sees {seen} GPU(s), but CUDA "
            "is unusable",
            f"torch {version}: {why}."
            + (hint or " Check nvidia-smi, the driver version and CUDA_VISIBLE_DEVICES.")
            + " Until then training runs on the CPU (train.accelerator: cpu to mean it)",
        )
    if seen:
        level = WARN if facts.get("train", {}).get("accelerator") == "cpu" else ERROR
        return _verdict(
            "torch/CUDA",
            level,
            f"torch {version} is a CPU-only build but the driver sees {seen} GPU(s)",
            "training would run on the CPU and leave the GPU idle; install a CUDA build of "
            "torch (pip install torch --index-url https://download.pytorch.org/whl/cu126), "
            "or set train.accelerator: cpu to mean it",
        )
    return _verdict(
        "torch/CUDA",
        OK,
        "no GPU: training and inference run on the CPU",
        f"no NVIDIA GPU visible to the driver; torch {version}"
        + (f" (a CUDA {build} build: it would use a GPU)" if build else " (CPU-only build)"),
    )


def _version_tuple(v: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in str(v).split(".")[:2])
    except ValueError:
        return (0,)


def _ort_verdict(facts: dict[str, Any]) -> dict[str, Any]:
    o = facts.get("onnxruntime") or {}
    if not o.get("version"):
        return _verdict(
            "ONNX Runtime",
            ERROR,
            "onnxruntime is not usable",
            f"{o.get('error', '?')}; export, evaluate and the service need it: make venv",
        )
    loads = o.get("loads") or {}
    cpu = loads.get(CPU_EP) or {}
    if not cpu.get("loads"):
        return _verdict(
            "ONNX Runtime",
            ERROR,
            "the CPU provider does not run a model",
            f"{cpu.get('why')}; reinstall onnxruntime (make venv)",
        )
    problems = []
    for who, req in (o.get("requested") or {}).items():
        key = f"{who}.device {req['device']}"
        if req.get("error"):
            problems.append(f"{key}: {req['error']}")
        elif req.get("providers") and req["providers"][0] == CUDA_EP:
            cuda = loads.get(CUDA_EP) or {}
            if not cuda.get("loads"):
                problems.append(
                    f"{key} asks for the CUDA provider (a GPU and the provider are present) "
                    f"but it does not load: {cuda.get('why')}. ONNX Runtime would fall back "
                    "to CPU, which trainyard refuses (load_onnx raises)"
                )
    if problems:
        return _verdict(
            "ONNX Runtime",
            ERROR,
            "a requested ONNX Runtime provider cannot be loaded",
            "; ".join(problems)
            + ". Fix: install the CUDA/cuDNN libraries this onnxruntime-gpu needs (pip install "
            "'onnxruntime-gpu[cuda,cudnn]'), or set evaluate.device and serve.device to cpu",
        )
    chosen = (o.get("requested") or {}).get("evaluate", {}).get("providers") or [CPU_EP]
    why = [o.get("package") or o["version"]]
    why += [f"{_short(name)} {_load_word(v)} ({v.get('why')})" for name, v in loads.items()]
    if (
        TRT_EP in loads
        and loads[TRT_EP].get("loads") is False
        and TRT_EP in o.get("build_providers", [])
    ):
        why.append("TensorRT is optional: trainyard asks only for CUDA or CPU")
    return _verdict(
        "ONNX Runtime",
        OK,
        f"evaluate and the service run on the {_short(chosen[0])} provider",
        "; ".join(why),
    )


def _short(provider: str) -> str:
    return SHORT.get(provider, provider.removesuffix("ExecutionProvider"))


def _load_word(probe: dict[str, Any]) -> str:
    loads = probe.get("loads")
    return "loads" if loads else "not tried" if loads is None else "does not load"


def _disk_verdict(facts: dict[str, Any]) -> dict[str, Any]:
    disks = facts.get("disk") or []
    if not disks:
        return _verdict("disk", WARN, "free disk unknown", "the data folder could not be checked")
    dataset = facts.get("dataset") or {}
    need = int(dataset.get("total_bytes") or 0)
    prepared = dataset.get("from") == "card"
    same = len({d["filesystem"] for d in disks}) == 1
    parts = [
        f"{d['what']} {d['path']}: {human_bytes(d['free_bytes'])} free of "
        f"{human_bytes(d['total_bytes'])}"
        for d in disks
    ]
    if len(disks) > 1:
        parts.append("same filesystem" if same else "separate filesystems")
    free = min(d["free_bytes"] for d in disks)
    # Prepare writes the arrays, and DVC caches a copy of them (a second one where it
    # cannot reflink): 2x on one filesystem.
    copies = 2 if (same and len(disks) > 1) else 1
    text = ", ".join(parts)
    if not prepared and need and free < need:
        return _verdict(
            "disk",
            ERROR,
            f"not enough disk to prepare the dataset ({human_bytes(free)} free, "
            f"{human_bytes(need)} needed)",
            f"{text}. Free some space, or point data at a larger disk",
        )
    if free < MIN_FREE_DISK or (not prepared and free < copies * need):
        return _verdict(
            "disk",
            WARN,
            f"little free disk ({human_bytes(free)})",
            f"{text}; prepare needs {human_bytes(need)} and the DVC cache a copy, and "
            "checkpoints, ONNX models and MLflow artifacts need room too",
        )
    return _verdict(
        "disk",
        OK,
        f"{human_bytes(free)} free",
        text + (f"; the dataset needs {human_bytes(need)}" if need else ""),
    )


def _dataset_verdict(facts: dict[str, Any]) -> dict[str, Any]:
    d = facts.get("dataset") or {}
    if "splits" not in d:
        return _verdict(
            "dataset", ERROR, "the configured dataset cannot be sized", str(d.get("error"))
        )
    counts = ", ".join(f"{s} {v['images']:,}" for s, v in d["splits"].items())
    shape = f"{d['channels']}x{d['height']}x{d['width']}"
    test = d["splits"].get("test", {}).get("bytes", 0)
    return _verdict(
        "dataset",
        WARN if d.get("stale_card") else OK,
        f"{d['source']}: {counts} images of {shape} ({d['from']}), train+val "
        f"{human_bytes(d['placed_bytes'])}",
        f"{d['note']}; uint8 N*C*H*W bytes; test ({human_bytes(test)}) is read in batches "
        "by evaluate, never placed",
    )


def _precision_verdict(facts: dict[str, Any]) -> dict[str, Any]:
    p = facts.get("precision") or {}
    if p.get("error") or not p.get("precision"):
        return _verdict(
            "precision",
            ERROR,
            "training cannot start with these settings",
            str(p.get("error") or "unknown"),
        )
    precision, acc = p["precision"], p["accelerator"]
    gpus = [g for g in facts.get("gpus") or [] if g.get("usable_by_torch")]
    cpu = facts.get("cpu") or {}
    bf16_flags = [f for f in cpu.get("flags") or [] if f in ("avx512_bf16", "amx_bf16")]
    level = OK
    if p.get("setting") != "auto":
        why = f"set in params: train.precision {p['setting']}"
    elif acc == "gpu":
        g = gpus[0] if gpus else {}
        cc = g.get("compute_capability", "?")
        if precision == "bf16-mixed" and g.get("bf16"):
            why = (
                f"auto: {g.get('name')} has compute capability {cc} (>= 8.0): native bf16 "
                "tensor cores at half the bytes, fp32 master weights"
            )
        elif precision == "bf16-mixed":
            level = WARN
            why = (
                f"auto: torch reports bf16 on {g.get('name')} (compute capability {cc}), but "
                "it is only emulated below 8.0 and slower than fp32; set train.precision: "
                "16-mixed (fp16 tensor cores) or 32-true"
            )
        else:
            why = (
                f"auto: {g.get('name')} (compute capability {cc}) has no bf16; fp32. "
                "train.precision: 16-mixed would use its fp16 tensor cores"
            )
    elif precision == "bf16-mixed":
        why = (
            f"auto on the CPU: it has {'/'.join(bf16_flags) or 'bf16'} "
            "(native bf16: measured 1.5x the fp32 img/s, same accuracy)"
        )
    else:
        why = "auto on the CPU: no AVX512-BF16/AMX, so autocast would only add conversions"
    return _verdict(
        "precision",
        level,
        f"train on {p['device']} (accelerator {acc}) in {precision}",
        why,
    )


def _params_verdict(facts: dict[str, Any]) -> dict[str, Any] | None:
    p = facts.get("params") or {}
    if p.get("loaded"):
        return None
    if p.get("missing"):
        return _verdict(
            "params",
            WARN,
            f"{p['path']} not found: the defaults are used",
            "run the doctor from the repository root, or pass --params",
        )
    return _verdict(
        "params",
        ERROR,
        f"{p.get('path')} is invalid (the defaults were used for the rest)",
        str(p.get("error")),
    )


def verdicts(facts: dict[str, Any]) -> list[dict[str, Any]]:
    """Every verdict on ``facts``: ``{check, level (ok|warn|error), verdict, why}``.

    Pure: only ``facts`` is read (placement goes through ``choose_placement``, given the
    collected free memory), so any machine can be described by hand and judged.
    """
    out = [
        _params_verdict(facts),
        _cuda_verdict(facts),
        ram_vs_gpu(facts),
        _ort_verdict(facts),
        _disk_verdict(facts),
        _dataset_verdict(facts),
        placement(facts),
        _precision_verdict(facts),
    ]
    return [v for v in out if v is not None]


KEYS = (
    "cpu",
    "ram",
    "gpus",
    "ram_vs_gpu",
    "torch",
    "onnxruntime",
    "disk",
    "dataset",
    "placement",
    "precision",
    "verdicts",
    "ok",
)


def report(facts: dict[str, Any]) -> dict[str, Any]:
    """The JSON document: ``KEYS`` first (stable), then the rest of the facts."""
    found = verdicts(facts)
    by_check = {v["check"]: v for v in found}
    doc: dict[str, Any] = {}
    for key in KEYS:
        doc[key] = facts.get(key)
    doc["ram_vs_gpu"] = by_check["RAM vs GPU"]
    doc["placement"] = by_check["placement"]
    doc["precision"] = {**(facts.get("precision") or {}), **by_check["precision"]}
    doc["verdicts"] = found
    doc["ok"] = not any(v["level"] == ERROR for v in found)
    doc.update({k: v for k, v in facts.items() if k not in doc})
    return doc


# ----------------------------------------------------------------------------- output


def _rows(doc: dict[str, Any]) -> list[tuple[str, str]]:
    cpu, ram, t, o = doc["cpu"] or {}, doc["ram"] or {}, doc["torch"] or {}, doc["onnxruntime"]
    rows = [
        (
            "CPU",
            f"{cpu.get('model')}: {cpu.get('logical_cores')} cores ({cpu.get('usable_cores')} "
            f"usable, {cpu.get('physical_cores')} physical); bf16: "
            f"{'yes' if cpu.get('bf16') else 'no'} ({', '.join(cpu.get('flags') or []) or '-'})",
        ),
        (
            "RAM",
            f"{human_bytes(ram.get('total_bytes'))} total, "
            f"{human_bytes(ram.get('available_bytes'))} available"
            + (
                f", container limit {human_bytes(ram['cgroup_limit_bytes'])}"
                if ram.get("cgroup_limit_bytes")
                else ""
            ),
        ),
    ]
    gpus = doc.get("gpus") or []
    driver = t.get("driver") or {}
    if not gpus:
        rows.append(("GPU", "none visible to the driver" if not driver.get("gpus") else "?"))
    for g in gpus:
        rows.append(
            (
                f"GPU {g['index']}",
                f"{g['name']}: {human_bytes(g.get('memory_bytes'))}"
                + (f" ({human_bytes(g['free_bytes'])} free)" if g.get("free_bytes") else "")
                + f", compute capability {g.get('compute_capability')}, bf16 "
                f"{'native' if g.get('bf16') else 'no'}, driver {g.get('driver')} (CUDA "
                f"{g.get('driver_cuda')}), torch CUDA runtime {g.get('cuda_runtime')}"
                + ("" if g.get("usable_by_torch") else "; NOT usable by torch"),
            )
        )
    if "version" in t:
        rows.append(
            (
                "torch",
                f"{t['version']}: "
                + (f"CUDA {t['cuda']} build" if t.get("cuda") else "CPU-only build")
                + (f", cuDNN {t['cudnn']}" if t.get("cudnn") else "")
                + f"; CUDA usable: {'yes' if t.get('cuda_available') else 'no'}",
            )
        )
    if o.get("version"):
        loads = "; ".join(f"{_short(k)} {_load_word(v)}" for k, v in o["loads"].items())
        build = ", ".join(_short(p) for p in o["build_providers"])
        rows.append(("ONNX Runtime", f"{o.get('package') or o['version']}: build has {build}"))
        rows.append(("  loads", loads))
    for d in doc.get("disk") or []:
        rows.append(
            (
                f"disk ({d['what']})",
                f"{d['path']}: {human_bytes(d['free_bytes'])} free of "
                f"{human_bytes(d['total_bytes'])}",
            )
        )
    return rows


def render_table(doc: dict[str, Any], width: int = 100) -> str:
    """The readable report: facts, then every verdict with its why."""
    lines = [f"trainyard doctor (params {doc['params']['path']}, data {doc.get('data_dir')})", ""]
    rows = _rows(doc)
    key_w = max(len(k) for k, _ in rows) + 2
    for key, value in rows:
        wrapped = textwrap.wrap(value, width - key_w) or [""]
        lines.append(f"{key:<{key_w}}{wrapped[0]}")
        lines.extend(" " * key_w + w for w in wrapped[1:])
    lines += ["", "verdicts"]
    marks = {OK: "ok  ", WARN: "WARN", ERROR: "FAIL"}
    check_w = max(len(v["check"]) for v in doc["verdicts"]) + 2
    indent = " " * (8 + check_w)
    for v in doc["verdicts"]:
        head = textwrap.wrap(v["verdict"], width - len(indent)) or [""]
        lines.append(f"  {marks[v['level']]}  {v['check']:<{check_w}}{head[0]}")
        lines.extend(indent + h for h in head[1:])
        lines.extend(
            textwrap.wrap(
                "why: " + v["why"], width, initial_indent=indent, subsequent_indent=indent + "  "
            )
        )
    status = "ok" if doc["ok"] else "BROKEN"
    warned = sum(v["level"] == WARN for v in doc["verdicts"])
    lines += ["", f"{status}: {warned} warning(s), {doc.get('collect_s')} s"]
    return "\n".join(lines)


def emit(doc: dict[str, Any], as_json: bool = False) -> int:
    """Print the report (stdout) and what is broken (stderr); the exit status: 0 or 1."""
    print(json.dumps(doc, indent=2, default=str) if as_json else render_table(doc))
    broken = [v for v in doc["verdicts"] if v["level"] == ERROR]
    for v in broken:
        print(
            f"trainyard doctor: broken: {v['check']}: {v['verdict']}: {v['why']}",
            file=sys.stderr,
        )
    return 1 if broken else 0


# ----------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "--params", default=None, help=f"params file (default: ./{DEFAULT_PARAMS}, if present)"
    )
    parser.add_argument(
        "--data",
        default=str(DEFAULT_DATA),
        help=f"prepared data folder with {CARD_FILE} (default: {DEFAULT_DATA})",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    return parser


def run(args: argparse.Namespace) -> int:
    """``trainyard doctor`` with parsed arguments: 0 fine, 1 broken, 2 bad usage."""
    if args.params is not None and not Path(args.params).is_file():
        print(f"trainyard doctor: error: --params {args.params}: no such file", file=sys.stderr)
        return 2
    return emit(report(collect(args.params, args.data)), args.json)


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace | int:
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:  # argparse: 2 for bad usage, 0 for --help
        return exc.code if isinstance(exc.code, int) else 2


def main(argv: list[str] | None = None) -> int:
    """``python -m trainyard.doctor.checks [--json] [--params P] [--data D]``."""
    parser = add_arguments(
        argparse.ArgumentParser(prog="trainyard doctor", description=__doc__.splitlines()[0])
    )
    args = parse(parser, argv)
    return args if isinstance(args, int) else run(args)


if __name__ == "__main__":
    sys.exit(main())
