"""The input-bound verdict: is a fit input-bound, and which of trainyard's knobs fixes it.

``training.perf.InputBoundMeter`` measures each training step as data wait, host->device
copy and compute; ``verdict`` judges its means with TensorFlow's profiler thresholds: >= 20%
of the step waiting for input is input-bound, 5-20% moderately input-bound, < 5% not, and
names the fix in trainyard's own knobs (the data path, where the splits live, the batch).
On a GPU that kept up with its data but was busy less than ``UNDERFED`` % of the training
steps (``training.gpu_busy.GpuBusyMeter``'s NVML figure) the verdict is "GPU underfed": it
waits on the host between steps (launch overhead, small steps), and the levers are the
step's size and cost, not the input. Plain numbers in, a dict out: no torch here.
"""

from __future__ import annotations

from typing import Any

from trainyard.core.nvml_sampler import UNDERFED_PCT

INPUT_BOUND = 0.20  # >= this fraction of the step waiting for the batch: input-bound
MODERATE = 0.05  # >= this: moderately input-bound; below: not input-bound
UNDERFED = UNDERFED_PCT  # GPU busy below this % with the data keeping up: "GPU underfed"
LEVELS = ("input-bound", "moderately input-bound", "GPU underfed", "not input-bound")


def level_of(data_wait_fraction: float) -> str:
    """input-bound, moderately input-bound or not input-bound, by TensorFlow's thresholds."""
    if data_wait_fraction >= INPUT_BOUND:
        return "input-bound"
    if data_wait_fraction >= MODERATE:
        return "moderately input-bound"
    return "not input-bound"


def _fix(
    data_path: str | None,
    device: str,
    placement: str | None,
    device_resident: bool | None,
    workers: int | None,
) -> str:
    """The knob that shortens the data wait, for this data path and placement."""
    gpu = device == "cuda"
    if data_path == "naive":
        return (
            "set train.data_path: fast (whole-batch gathers from the prepared arrays instead "
            "of a per-sample __getitem__ + collate per image)"
        )
    if data_path != "fast":
        # A per-sample loader outside trainyard's data module (files decoded every step).
        return (
            "prepare the images once (`dvc repro prepare`: decoded, resized uint8 arrays) and "
            "train from them with train.data_path: fast; a loader that must decode every step "
            f"needs DataLoader workers (num_workers is {workers if workers is not None else '?'})"
        )
    if placement == "mmap":
        if gpu:
            return (
                "batches are read from the memory-mapped files: set train.device_resident: true "
                "and raise train.memory_budget so the splits fit on the GPU (or at least in RAM), "
                "or put data/prepared on a faster disk"
            )
        return (
            "batches are read from the memory-mapped files: raise train.memory_budget so the "
            "splits load into RAM, or put data/prepared on a faster disk"
        )
    if placement == "ram" and gpu:
        if device_resident:
            return (
                "the splits did not fit on the GPU: raise train.memory_budget so they go there "
                "(train.device_resident is already true); no per-batch gather and copy on the host"
            )
        return (
            "set train.device_resident: true (the splits copied to the GPU once; batches "
            "gathered there, none crosses the bus)"
        )
    return (
        "raise train.batch_size: the per-step gather and Python overhead is fixed, a larger "
        "batch gives compute more of each step"
    )


def _underfed_fix(placement: str | None, precision: str | None) -> str:
    """The levers of a GPU that waits on the host: more work per step, cheaper steps."""
    levers = [
        "raise train.batch_size (the same per-step launch overhead buys more images; on a "
        "GPU the recipe's batch is measured)"
    ]
    if placement != "device":
        levers.append(
            "keep the splits on the GPU (train.device_resident: true, train.memory_budget)"
        )
    if precision is None or not precision.startswith("bf16"):
        levers.append("train.precision: bf16-mixed")
    levers.append("train.compile (fewer, fused kernels a step)")
    return "the GPU waits on the host between steps, not on the data: " + "; ".join(levers)


def verdict(
    data_wait_fraction: float,
    *,
    h2d_fraction: float = 0.0,
    data_path: str | None = None,
    device: str = "cpu",
    placement: str | None = None,
    device_resident: bool | None = None,
    workers: int | None = None,
    step_ms: float | None = None,
    steps: int | None = None,
    gpu_busy_pct: float | None = None,
    precision: str | None = None,
) -> dict[str, Any]:
    """{level, data_wait_fraction, h2d_fraction, why, fix} from the measured fractions.

    ``data_path``: ``fast`` | ``naive`` (trainyard's data module) or None (any other
    loader); ``device``: ``cuda`` | ``cpu``; ``placement``: ``device`` | ``ram`` |
    ``mmap`` (``datamodule.choose_placement``); ``workers``: the DataLoader's num_workers;
    ``gpu_busy_pct``: NVML's mean utilisation over the training steps (None: not
    measured, e.g. on a CPU); ``precision``: Lightning's (for the underfed GPU's levers).
    """
    frac = max(0.0, min(1.0, float(data_wait_fraction)))
    level = level_of(frac)
    where = f"data path {data_path or 'custom loader'}"
    if placement:
        where += f", data {placement}"
    where += f", {device}"
    per_step = f" of a {step_ms:.1f} ms step" if step_ms is not None else " of each step"
    over = f" over {steps} steps" if steps is not None else ""
    why = f"{frac:.0%}{per_step} waits for the next batch{over} ({where})"
    if h2d_fraction >= MODERATE:
        why += f"; the host->device copy takes {h2d_fraction:.0%}"
    if gpu_busy_pct is not None:
        why += f"; the GPU was busy {gpu_busy_pct:.0f}% of the training steps"
    if level == "not input-bound" and gpu_busy_pct is not None and gpu_busy_pct < UNDERFED:
        level, fix = "GPU underfed", _underfed_fix(placement, precision)
    elif level == "not input-bound":
        if device == "cuda" and h2d_fraction >= MODERATE and placement in ("ram", "mmap"):
            fix = (
                "the input keeps up, but the per-batch copy is not free: "
                "train.device_resident: true / raise train.memory_budget puts the splits on the GPU"
            )
        else:
            fix = (
                "none on the input side: the step is compute (train.precision, "
                "train.channels_last, train.compile and train.batch_size are the levers)"
            )
    else:
        fix = _fix(data_path, device, placement, device_resident, workers)
    return {
        "level": level,
        "data_wait_fraction": round(frac, 4),
        "h2d_fraction": round(float(h2d_fraction), 4),
        "why": why,
        "fix": fix,
    }
