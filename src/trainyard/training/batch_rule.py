"""The recipe's batch (``train.batch_size: auto``): the data's rule on a CPU, the measured
ladder on a GPU.

On a CPU the batch is the power of two nearest to an epoch of ``STEPS_PER_EPOCH`` steps,
within ``MIN_BATCH``..``MAX_BATCH`` (at most ``FINETUNE_MAX_BATCH`` for a fine-tune). On a
GPU it is measured, not capped: training img/s of the real model, its data path and
precision at batches doubling from the CPU rule's (or ``LR_BATCH``), stopping where doubling
gains less than ``GPU_PAYS``, memory runs out, or an epoch would keep fewer than
``GPU_MIN_STEPS`` steps (``speed.batch_ladder``: a coarse ladder with a margin, so the same
GPU model takes the same batch run after run). ``training.recipe`` takes it in ``plan`` and
in the doctor's forecast (``forecast_batch``).
"""

from __future__ import annotations

import math

from trainyard.training.speed import Facts, Measure, batch_ladder, probe_step_s

STEPS_PER_EPOCH = 32  # batch: the power of two nearest to an epoch of this many steps
MIN_BATCH, MAX_BATCH = 16, 256
FINETUNE_MAX_BATCH = 32  # a fine-tune learns from few images: more steps, not larger ones
LR_BATCH = 256  # the batch the LR table measured at (the recipe scales larger ones' LR by sqrt)
# On a GPU: the batch ladder (see the module doc); the ladder starts at LR_BATCH or above.
GPU_PAYS = 1.15  # a doubled batch must train this much faster (img/s) to be taken
GPU_MIN_STEPS = 8  # an epoch keeps at least this many optimizer steps
GPU_MAX_BATCH = 8192
GPU_LADDER_STEPS = 5  # timed steps per rung (after one warm-up step)


def choose_batch(n_train: int) -> tuple[int, str]:
    batch = 2 ** max(0, round(math.log2(max(1.0, n_train / STEPS_PER_EPOCH))))
    batch = min(MAX_BATCH, max(MIN_BATCH, batch))
    steps = -(-n_train // batch)
    return batch, f"{n_train:,} train images: {steps:,} optimizer steps an epoch"


def gpu_batch_cap(n_train: int) -> int:
    """The largest power of two that leaves an epoch ``GPU_MIN_STEPS`` steps (at most
    ``GPU_MAX_BATCH``): the data's cap on the GPU's batch."""
    fits = max(1, n_train // GPU_MIN_STEPS)
    return min(GPU_MAX_BATCH, 2 ** int(math.log2(fits)))


def choose_gpu_batch(n_train: int, measure: Measure) -> tuple[int, str]:
    """The GPU's batch: the ladder of ``batch_ladder`` from the CPU rule's batch (or 256,
    whichever is larger) up to the data's cap, each rung timed by ``measure``."""
    cap = gpu_batch_cap(n_train)
    start = min(cap, max(choose_batch(n_train)[0], LR_BATCH))
    batch, why = batch_ladder(start, cap, measure, GPU_PAYS)
    steps = -(-n_train // batch)
    return batch, f"the GPU's throughput ({why}): {steps:,} optimizer steps an epoch"


def choose_device_batch(
    facts: Facts, arch: str, augment: str, measure: Measure | None = None, finetune: bool = False
) -> tuple[int, str]:
    """The batch for this device: the data's rule on a CPU (at most ``FINETUNE_MAX_BATCH``
    for a fine-tune); on a GPU the ladder, each rung timed by ``measure`` (default: real
    steps of ``arch`` with ``augment``)."""
    if facts.accelerator != "gpu":
        batch, why = choose_batch(facts.train_images)
        if finetune and batch > FINETUNE_MAX_BATCH:
            steps = -(-facts.train_images // FINETUNE_MAX_BATCH)
            return FINETUNE_MAX_BATCH, (
                f"a fine-tune: at most {FINETUNE_MAX_BATCH} a step ({steps:,} optimizer steps an "
                "epoch): pretrained features learn a new head from more, smaller steps"
            )
        return batch, why
    timed = measure or (lambda b: b / probe_step_s(arch, facts, b, augment, GPU_LADDER_STEPS))
    return choose_gpu_batch(facts.train_images, timed)
