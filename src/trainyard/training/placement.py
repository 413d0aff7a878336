"""Where the training splits live (the GPU, RAM or a memory map), with no Lightning import,
so `trainyard doctor` asks the very same function in about two seconds instead of seven.
"""

from __future__ import annotations

from typing import Literal

import torch

from trainyard.core.host import available_ram

Placement = Literal["device", "ram", "mmap"]


def choose_placement(
    nbytes: int,
    device: torch.device,
    device_resident: bool,
    budget: float,
    ram_bytes: int | None = None,
    gpu_free_bytes: int | None = None,
) -> tuple[Placement, str]:
    """Where the training splits go, and why: the GPU, RAM, or a memory map.

    ``budget`` is the fraction of free GPU memory (or available RAM) the splits may take;
    the rest is the model's, the optimizer's and everyone else's.
    """
    gib = nbytes / 2**30
    if device.type == "cuda" and device_resident:
        if gpu_free_bytes is None:
            gpu_free_bytes = torch.cuda.mem_get_info(device)[0]
        if nbytes <= budget * gpu_free_bytes:
            return "device", (
                f"{gib:.2f} GiB fits {budget:.0%} of the GPU's {gpu_free_bytes / 2**30:.1f} GiB "
                "free: device-resident, no batch crosses the bus"
            )
        why_not_gpu = (
            f"{gib:.2f} GiB is over {budget:.0%} of the GPU's {gpu_free_bytes / 2**30:.1f} GiB "
            "free; "
        )
    else:
        why_not_gpu = ""
    ram = available_ram() if ram_bytes is None else ram_bytes
    if nbytes <= budget * ram:
        return "ram", (
            f"{why_not_gpu}{gib:.2f} GiB fits {budget:.0%} of {ram / 2**30:.1f} GiB available "
            "RAM: loaded whole, batches gathered in memory"
        )
    return "mmap", (
        f"{why_not_gpu}{gib:.2f} GiB is over {budget:.0%} of {ram / 2**30:.1f} GiB available "
        "RAM: batches are gathered from the memory-mapped files"
    )
