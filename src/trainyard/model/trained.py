"""A trained net as its checkpoint holds it, without Lightning: what export reads.

The export stage rebuilds the net from ``torch.load(..., weights_only=True)``. Building the
``Classifier`` (a LightningModule) for that would import Lightning, about 1.7 CPU-s of every
export's start-up for nothing: the state dict's keys are the net's own (``net.*``), and the
card, arch and provenance in the checkpoint's hyperparameters are all that rebuilds it.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from torch import nn

from trainyard.core.card import Card
from trainyard.model.augment import normalize_on_device
from trainyard.model.networks import net_for_card

BATCH = 256  # images a forward: bounds the activations' memory on a large val split


class TrainedNet(nn.Module):
    """The ``Classifier``'s net, card and provenance from its saved hyperparameters
    (``TrainedNet(**ckpt["hyper_parameters"])``, then the checkpoint's state dict), in eval
    mode: ``forward`` maps normalised float [B, C, H, W] to logits, as the Classifier's does.
    ``hparams.arch``, ``card`` and ``pretrained_info`` are read as on a Classifier; the
    training-only hyperparameters (lr, augment, compile ...) are accepted and ignored."""

    def __init__(
        self,
        card: dict[str, Any] | Card,
        arch: str = "cnn",
        pretrained_info: dict[str, str] | None = None,
        **training: Any,
    ) -> None:
        super().__init__()
        self.card = card if isinstance(card, Card) else Card.from_dict(card, "checkpoint card")
        self.net = net_for_card(self.card, arch)
        self.hparams = SimpleNamespace(arch=arch, **training)
        self.pretrained_info: dict[str, str] = dict(pretrained_info or {})
        self.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def pixel_logits(net: nn.Module, card: Card, images: np.ndarray) -> torch.Tensor:
    """float32 logits of ``net`` (a Classifier or a TrainedNet, in eval mode: forward takes
    normalised input) on uint8 ``images`` [N, C, H, W], normalised as ``card`` says (the
    training's own formula), ``BATCH`` at a time, on the net's device; returned on the CPU.
    The refit keeps these for the val-chosen model; export fits its temperature on them."""
    net.eval()
    device = next(net.parameters()).device
    out = []
    with torch.no_grad():  # not inference_mode: the refit saves these in its checkpoint
        for i in range(0, len(images), BATCH):
            # np.array: a writable copy (the split is a read-only memmap: torch warns)
            u8 = torch.from_numpy(np.array(images[i : i + BATCH])).to(device)
            out.append(net(normalize_on_device(u8, card.mean, card.std)).float().cpu())
    return torch.cat(out)
