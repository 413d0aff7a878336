"""A trained net as its checkpoint holds it, without Lightning: what export reads.

The export stage rebuilds the net from ``torch.load(..., weights_only=True)``. Building the
``Classifier`` (a LightningModule) for that would import Lightning, about 1.7 CPU-s of every
export's start-up for nothing: the state dict's keys are the net's own (``net.*``), and the
card, arch and provenance in the checkpoint's hyperparameters are all that rebuilds it.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from trainyard.core.card import Card
from trainyard.model.networks import net_for_card


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
