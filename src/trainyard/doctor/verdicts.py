"""The verdicts: pure functions of the collected facts (nothing is read from the machine), so
they are tested on crafted facts for machines we do not have; and ``report``, the JSON
document of facts and verdicts."""

from __future__ import annotations

from typing import Any

from trainyard.doctor.memory import placement, ram_vs_gpu
from trainyard.doctor.terms import (
    CPU_EP,
    CUDA_EP,
    ERROR,
    OK,
    TRT_EP,
    WARN,
    human_bytes,
    load_word,
    make_verdict,
    short_name,
)

MIN_FREE_DISK = 2**30  # room for checkpoints, the ONNX model and MLflow artifacts


def _cuda_verdict(facts: dict[str, Any]) -> dict[str, Any]:
    t = facts.get("torch") or {}
    if "version" not in t:
        return make_verdict(
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
        return make_verdict(
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
        return make_verdict(
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
        return make_verdict(
            "torch/CUDA",
            level,
            f"torch {version} is a CPU-only build but the driver sees {seen} GPU(s)",
            "training would run on the CPU and leave the GPU idle; install a CUDA build of "
            "torch (pip install torch --index-url https://download.pytorch.org/whl/cu126), "
            "or set train.accelerator: cpu to mean it",
        )
    return make_verdict(
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
        return make_verdict(
            "ONNX Runtime",
            ERROR,
            "onnxruntime is not usable",
            f"{o.get('error', '?')}; export, evaluate and the service need it: make venv",
        )
    loads = o.get("loads") or {}
    cpu = loads.get(CPU_EP) or {}
    if not cpu.get("loads"):
        return make_verdict(
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
        return make_verdict(
            "ONNX Runtime",
            ERROR,
            "a requested ONNX Runtime provider cannot be loaded",
            "; ".join(problems)
            + ". Fix: install the CUDA/cuDNN libraries this onnxruntime-gpu needs (pip install "
            "'onnxruntime-gpu[cuda,cudnn]'), or set evaluate.device and serve.device to cpu",
        )
    chosen = (o.get("requested") or {}).get("evaluate", {}).get("providers") or [CPU_EP]
    why = [o.get("package") or o["version"]]
    why += [f"{short_name(name)} {load_word(v)} ({v.get('why')})" for name, v in loads.items()]
    if (
        TRT_EP in loads
        and loads[TRT_EP].get("loads") is False
        and TRT_EP in o.get("build_providers", [])
    ):
        why.append("TensorRT is optional: trainyard asks only for CUDA or CPU")
    return make_verdict(
        "ONNX Runtime",
        OK,
        f"evaluate and the service run on the {short_name(chosen[0])} provider",
        "; ".join(why),
    )


def _disk_verdict(facts: dict[str, Any]) -> dict[str, Any]:
    disks = facts.get("disk") or []
    if not disks:
        return make_verdict(
            "disk", WARN, "free disk unknown", "the data folder could not be checked"
        )
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
        return make_verdict(
            "disk",
            ERROR,
            f"not enough disk to prepare the dataset ({human_bytes(free)} free, "
            f"{human_bytes(need)} needed)",
            f"{text}. Free some space, or point data at a larger disk",
        )
    if free < MIN_FREE_DISK or (not prepared and free < copies * need):
        return make_verdict(
            "disk",
            WARN,
            f"little free disk ({human_bytes(free)})",
            f"{text}; prepare needs {human_bytes(need)} and the DVC cache a copy, and "
            "checkpoints, ONNX models and MLflow artifacts need room too",
        )
    return make_verdict(
        "disk",
        OK,
        f"{human_bytes(free)} free",
        text + (f"; the dataset needs {human_bytes(need)}" if need else ""),
    )


def _dataset_verdict(facts: dict[str, Any]) -> dict[str, Any]:
    d = facts.get("dataset") or {}
    if "splits" not in d:
        return make_verdict(
            "dataset", ERROR, "the configured dataset cannot be sized", str(d.get("error"))
        )
    counts = ", ".join(f"{s} {v['images']:,}" for s, v in d["splits"].items())
    shape = f"{d['channels']}x{d['height']}x{d['width']}"
    test = d["splits"].get("test", {}).get("bytes", 0)
    return make_verdict(
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
        return make_verdict(
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
    return make_verdict(
        "precision",
        level,
        f"train on {p['device']} (accelerator {acc}) in {precision}",
        why,
    )


def _batch_verdict(facts: dict[str, Any]) -> dict[str, Any]:
    b = facts.get("batch") or {}
    if b.get("error") or not b.get("batch_size"):
        return make_verdict(
            "batch", WARN, "the batch the recipe will take is unknown", str(b.get("error"))
        )
    return make_verdict(
        "batch", OK, f"train at batch {b['batch_size']:,} ({b['by']})", str(b["why"])
    )


def _params_verdict(facts: dict[str, Any]) -> dict[str, Any] | None:
    p = facts.get("params") or {}
    if p.get("loaded"):
        return None
    if p.get("missing"):
        return make_verdict(
            "params",
            WARN,
            f"{p['path']} not found: the defaults are used",
            "run the doctor from the repository root, or pass --params",
        )
    return make_verdict(
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
        _batch_verdict(facts),
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
    "batch",
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
    doc["batch"] = {**(facts.get("batch") or {}), **by_check["batch"]}
    doc["verdicts"] = found
    doc["ok"] = not any(v["level"] == ERROR for v in found)
    doc.update({k: v for k, v in facts.items() if k not in doc})
    return doc
