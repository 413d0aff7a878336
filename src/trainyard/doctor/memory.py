"""The memory verdicts: RAM against GPU memory (the 2x rule), and where training will put
the data (GPU, RAM or the memory map). Pure functions of the collected facts, like the rest of
``doctor.verdicts``."""

from __future__ import annotations

from typing import Any

from trainyard.doctor.terms import OK, WARN, human_bytes, make_verdict


def effective_ram(ram: dict[str, Any]) -> int | None:
    """Total RAM this process may use: MemTotal, or the container's limit when lower."""
    total, limit = ram.get("total_bytes"), ram.get("cgroup_limit_bytes")
    if total is None:
        return limit
    return min(total, limit) if limit else total


def ram_vs_gpu(facts: dict[str, Any]) -> dict[str, Any]:
    """RAM against total GPU memory: at least 1x, ideally 2x (the 2x rule)."""
    ram = effective_ram(facts.get("ram") or {})
    gpus = facts.get("gpus") or []
    gpu = sum(int(g.get("memory_bytes") or 0) for g in gpus)
    out: dict[str, Any] = {"ram_bytes": ram, "gpu_bytes": gpu, "ratio": None}
    rule = "RAM should be at least the GPU memory, ideally twice"
    if not gpus:
        return {**out, **make_verdict("RAM vs GPU", OK, "no GPU: the 2x rule does not apply", rule)}
    if not ram:
        return {
            **out,
            **make_verdict("RAM vs GPU", WARN, "RAM size unknown", "/proc/meminfo unread"),
        }
    ratio = ram / gpu
    out["ratio"] = round(ratio, 2)
    sizes = f"{human_bytes(ram)} RAM vs {human_bytes(gpu)} GPU memory ({ratio:.2f}x)"
    if ratio < 1:
        return {
            **out,
            **make_verdict(
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
            **make_verdict(
                "RAM vs GPU",
                OK,
                f"RAM meets the minimum ({ratio:.2f}x), below the ideal 2x",
                f"{sizes}: {rule}; enough to stage what the GPU holds, with little room for "
                "the page cache and data loading beside it",
            ),
        }
    return {
        **out,
        **make_verdict("RAM vs GPU", OK, f"RAM is {ratio:.1f}x GPU memory", f"{sizes}: {rule}"),
    }


def _unknown_placement(what: str, why: str) -> dict[str, Any]:
    return make_verdict("placement", WARN, f"unknown: {what}", why, where=None, fits=None)


def _why_not_on_gpu(train: dict[str, Any]) -> str:
    """The setting that keeps data that would fit the GPU off it."""
    if not train["device_resident"]:
        return "train.device_resident is false"
    if train["data_path"] != "fast":
        return "train.data_path is naive"
    return "training runs on the CPU"


def placement(facts: dict[str, Any]) -> dict[str, Any]:
    """Where training will put train+val, by ``training.placement.choose_placement`` itself, with
    whether the data fits GPU memory, fits RAM, or must stream from the memory map."""
    try:  # probe: training.placement imports torch; a broken torch is the torch/CUDA check's error
        import torch

        from trainyard.training.placement import choose_placement
    except Exception as err:
        return _unknown_placement("torch cannot be imported", f"{type(err).__name__}: {err}")
    dataset = facts.get("dataset") or {}
    nbytes = dataset.get("placed_bytes")
    if nbytes is None:
        return _unknown_placement(
            "the dataset's size could not be found", dataset.get("error", "no dataset facts")
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
        notes.append(f"it would fit the GPU, but {_why_not_on_gpu(train)}")
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
    return make_verdict(
        "placement",
        level,
        f"fits {fits}; trainyard will train {does}",
        f"{sizes} (uint8): {why}" + "".join(f"; {n}" for n in notes),
        where=where,
        fits="gpu" if fits_gpu else "ram" if fits_ram else "stream",
        bytes=nbytes,
        budget=budget,
    )
