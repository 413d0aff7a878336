"""Image embeddings from the pretrained EfficientNet-Lite0: the 1,280 pooled features in
front of its ImageNet head, for ``trainyard audit`` (docs/audit.md).

The weights are the packaged ones (``trainyard.model.weights``, verified by sha256), the
network is ``LiteNet`` with its head removed, and the input is what prepare decodes (uint8
``[N, 3, H, W]``, ``trainyard.core.imaging.image_to_pixels``), read as card-normalised
pixels in [0, 1] so the ``InputAdapter`` maps them onto the weights' own normalisation.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from trainyard.model.lite import HEAD, LITE_ARCH, LiteNet
from trainyard.model.weights import PACKAGED

EMBED_SIZE = 224  # the side EfficientNet-Lite0 was trained at: its features are best there
BATCH = 32  # images a forward pass: a 224 px batch of 32 is ~20 MB of input, fast on a CPU


def embedding_key(size: int = EMBED_SIZE) -> str:
    """The model and input an embedding was made with (no weights loaded to know it)."""
    return f"{LITE_ARCH}-{PACKAGED[LITE_ARCH].sha256[:16]}-pooled-{size}px"


class Embedder:
    """``embed(pixels)`` -> float32 ``[N, 1280]`` (``embedding_key(size)`` names it, what an
    embedding cache is keyed by beside each file's content hash)."""

    dim = HEAD

    def __init__(self, size: int = EMBED_SIZE, batch: int = BATCH) -> None:
        net = LiteNet(1, card_mean=(0.0,) * 3, card_std=(1.0,) * 3, pretrained="imagenet")
        net.body.classifier = nn.Identity()  # the pooled features, not ImageNet's classes
        self.net = net.eval()  # eval: BatchNorm's running statistics, no dropout
        self.size, self.batch = size, batch
        self.calls = 0  # forward passes run: what a test counts to see the cache used

    def embed(self, pixels: np.ndarray) -> np.ndarray:
        """uint8 ``[N, 3, size, size]`` -> float32 ``[N, 1280]``."""
        out = np.empty((len(pixels), self.dim), np.float32)
        with torch.inference_mode():
            for start in range(0, len(pixels), self.batch):
                x = torch.from_numpy(np.asarray(pixels[start : start + self.batch]))
                out[start : start + len(x)] = self.net(x.float().div_(255.0)).numpy()
                self.calls += 1
        return out
