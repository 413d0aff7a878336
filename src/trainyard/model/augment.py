"""Normalisation and batch augmentation, done on whole batches on the device."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def normalize_on_device(
    images_u8: torch.Tensor,
    mean: float | Sequence[float] | torch.Tensor,
    std: float | Sequence[float] | torch.Tensor,
) -> torch.Tensor:
    """uint8 ``[B, C, H, W]`` in 0..255 -> float32 ``(x / 255 - mean[c]) / std[c]``: the
    model's input contract (``trainyard.core.card.normalize_pixels`` is its numpy twin).

    ``mean``/``std``: C values (a sequence or tensor), or one float for every channel.
    """
    x = images_u8.float() / 255.0

    def per_channel(v: float | Sequence[float] | torch.Tensor) -> torch.Tensor | float:
        if isinstance(v, int | float):
            return float(v)
        if isinstance(v, torch.Tensor):  # a module's buffer: already on the device
            return v.to(device=x.device, dtype=torch.float32).reshape(1, -1, 1, 1)
        # Filled on the device: a host list would cross with a blocking copy (the host
        # waits for the GPU) at every call, i.e. every step of a loop.
        values = [torch.full((), float(c), dtype=torch.float32, device=x.device) for c in v]
        return torch.stack(values).reshape(1, -1, 1, 1)

    return (x - per_channel(mean)) / per_channel(std)


def augment_batch(
    x: torch.Tensor,
    generator: torch.Generator | None = None,
    pad: int | None = None,
    flip: bool = True,
) -> torch.Tensor:
    """Random translate (zero pad + crop) and, with ``flip``, horizontal flip on a whole
    batch, on its device.

    One gather for the whole batch instead of per-sample PIL ops: cost is a few
    elementwise kernels regardless of batch size. Any channel count and size; ``pad``
    (the largest shift, px) defaults to ``max(2, round(min(H, W) / 14))``: 2 px at 28 px,
    the same fraction of the image at larger sizes.
    """
    b, _, h, w = x.shape
    if pad is None:
        pad = max(2, round(min(h, w) / 14))
    dev = x.device
    shifts = torch.randint(0, 2 * pad + 1, (2, b), generator=generator, device=dev)
    # Drawn either way: the translation stream does not depend on the flip setting.
    flips = (torch.rand(b, generator=generator, device=dev) < 0.5) & flip
    padded = F.pad(x, (pad, pad, pad, pad))
    rows = (shifts[0][:, None] + torch.arange(h, device=dev))[:, :, None]  # [B,H,1]
    cols = shifts[1][:, None] + torch.arange(w, device=dev)  # [B,W]
    cols = torch.where(flips[:, None], cols.flip(1), cols)[:, None, :]  # [B,1,W]
    bidx = torch.arange(b, device=dev)[:, None, None]
    out = padded.permute(0, 2, 3, 1)[bidx, rows, cols]  # [B,H,W,C]
    return out.permute(0, 3, 1, 2).contiguous()
