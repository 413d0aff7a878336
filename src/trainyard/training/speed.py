"""What a training step costs: priced from nominal figures (``train.plan: fixed``) or timed
on this machine (``train.plan: timed``, and the GPU's batch ladder).

The recipe (trainyard.training.recipe) plans with these. A *nominal* price is a function of
the model, the image size and the kind of device only: the forward FLOPs of the real
network, counted by torch's FlopCounterMode (no clock), over the FLOP/s that arch trains
at on the reference device of that kind (``NOMINAL``). A *timed* price runs a few real
optimizer steps, so it moves with whatever else the machine is doing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from trainyard.core.card import Card
from trainyard.model.augment import augment_batch, normalize_on_device
from trainyard.model.networks import build_model

# Nominal speed of each kind of device: forward GFLOP/s of training work by arch (a
# training step costs about 3 forwards; the figures fold that in, and an arch's own
# efficiency: the small cnn's convolutions use a CPU far worse than a resnet's), plus a
# fixed cost per step (Lightning's loop, the optimizer's launch). "cpu" is this project's
# reference machine, 2 cores of the CI class (probe_step_s, fp32, quiet; docs/benchmarks.md
# "Nominal speeds"), whatever CPU runs the plan: a faster one finishes sooner, with the
# same model. GPUs by the name torch gives them.
NOMINAL: dict[str, dict[str, float]] = {
    "cpu": {
        "step_s": 0.005,
        "cnn": 45.0,
        "resnet": 130.0,
        "resnet18": 100.0,
        "mobilenet_v3_small": 10.0,
        "efficientnet_b0": 19.0,
        # The CPU fine-tune (recipe.CPU_FROZEN_STAGES): the frozen front is a forward pass,
        # so a step costs little more than one forward: 126 img/s at 160 px (0.39 GFLOPs an
        # image) in the quiet epochs of a clip art run, 11 s an epoch of 1,196 + 152 val.
        "efficientnet_lite0": 12.0,  # a full fine-tune: also the whole backward (estimate)
        "efficientnet_lite0/frozen": 45.0,
    },
    # One H200, bf16, data on the device (issue 25's figures at batch 4,096): cnn
    # 409k img/s, resnet 98k img/s.
    "NVIDIA H200": {"step_s": 0.002, "cnn": 4950.0, "resnet": 63000.0},
}


@dataclass(frozen=True)
class Facts:
    """What the recipe reads: the data (from the card) and the hardware."""

    train_images: int
    val_images: int
    classes: int
    channels: int
    height: int
    width: int
    accelerator: str  # "cpu" | "gpu"
    precision: str
    device: str = "cpu"  # "cpu", or the GPU's name as torch gives it ("NVIDIA H200")


def facts_from(card: Card, accelerator: str, precision: str, device: str = "cpu") -> Facts:
    counts = card.counts
    return Facts(
        train_images=int(counts["train"]["total"]),
        val_images=int(counts["val"]["total"]),
        classes=card.num_classes,
        channels=card.channels,
        height=card.height,
        width=card.width,
        accelerator=accelerator,
        precision=precision,
        device=device if accelerator == "gpu" else "cpu",
    )


@lru_cache(maxsize=64)
def forward_flops(arch: str, channels: int, classes: int, height: int, width: int) -> int:
    """FLOPs of one image's forward pass through ``arch``, counted (not timed)."""
    net = build_model(arch, channels, classes, (height, width)).eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        net(torch.zeros(1, channels, height, width))
    return int(counter.get_total_flops())


def nominal_step_s(arch: str, facts: Facts, batch: int, frozen: bool = False) -> float | None:
    """Seconds per optimizer step of ``arch`` at ``batch`` on the reference device of this
    kind (``NOMINAL``; ``frozen``: the fine-tune whose front stages are frozen), or None
    where there is no figure for the device or the arch."""
    speeds = NOMINAL.get(facts.device)
    key = f"{arch}/frozen" if frozen else arch
    if speeds is None or key not in speeds:
        return None
    flops = forward_flops(arch, facts.channels, facts.classes, facts.height, facts.width)
    return speeds["step_s"] + batch * flops / (speeds[key] * 1e9)


def probe_step_s(
    arch: str,
    facts: Facts,
    batch: int,
    augment: str,
    steps: int = 3,
) -> float:
    """Seconds per optimizer step of ``arch`` at ``batch``, timed on a few real steps on the
    training device and precision (after one warm-up step): uint8 batches gathered from a
    pool on the device, normalised and augmented there, as the fast data path does."""
    device = "cuda" if facts.accelerator == "gpu" else "cpu"
    net = build_model(arch, facts.channels, facts.classes, (facts.height, facts.width))
    net = net.to(device).train()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    shape = (min(2 * batch, 65536), facts.channels, facts.height, facts.width)
    pool = torch.randint(0, 256, shape, dtype=torch.uint8, device=device)
    labels = torch.randint(0, facts.classes, (shape[0],), device=device)
    mean = torch.full((1, facts.channels, 1, 1), 0.5, device=device)
    std = torch.full((1, facts.channels, 1, 1), 0.25, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if "bf16" in facts.precision else None
    times = []
    for i in range(steps + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        idx = torch.randint(0, shape[0], (batch,), device=device, generator=gen)
        x = normalize_on_device(pool[idx], mean, std)
        if augment != "none":
            x = augment_batch(x, gen, flip=augment == "flip")
        with torch.autocast(device, dtype=dtype, enabled=dtype is not None):
            loss = F.cross_entropy(net(x), labels[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    return float(np.median(times))


Measure = Callable[[int], float]  # batch -> training img/s; raises on out-of-memory


def is_out_of_memory(error: BaseException) -> bool:
    """torch's CUDA out-of-memory error (or its older RuntimeError form)."""
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error)


def batch_ladder(start: int, cap: int, measure: Measure, pays: float) -> tuple[int, str]:
    """The largest batch on start, 2*start, ... (at most ``cap``) whose doubling still paid:
    each rung must train ``pays`` times the img/s of the one below. Stops at the first rung
    that does not pay, or that runs out of memory; the reason lists every rung measured."""
    batch, rate = start, measure(start)
    seen = [f"{start:,}: {rate:,.0f}"]
    why = f"{cap:,} is the data's cap"
    while batch * 2 <= cap:
        try:
            higher = measure(batch * 2)
        except RuntimeError as e:  # torch.cuda.OutOfMemoryError is one
            if not is_out_of_memory(e):
                raise
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            why = f"{batch * 2:,} ran out of memory"
            break
        seen.append(f"{batch * 2:,}: {higher:,.0f}")
        if higher < rate * pays:
            why = f"{batch * 2:,} gained {higher / rate - 1:+.0%}, under the {pays - 1:.0%} it must"
            break
        batch, rate = batch * 2, higher
    return batch, f"img/s measured at batch {'; '.join(seen)}; {why}"
