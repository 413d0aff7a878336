"""Class activation maps as a graph output: ``cam`` [N, K, h, w], one map per class over
the net's last feature maps, computed by the exported graph itself (no autograd at run
time: ONNX Runtime only, in the service as in evaluate).

Every net ``build_model`` makes is a *trunk* (convolutions: input -> feature maps F,
[N, C, h, w]), a pooling (the mean over positions, or the cnn's flatten) and a *tail* of
Linear layers and elementwise activations (the last Linear is the classifier head).

- Global average pooling then one Linear (EfficientNet-Lite0, the resnet, torchvision's
  resnets and EfficientNet-B0): CAM (Zhou et al., 2016), ``cam_k = sum_c W[k, c] F_c``. The
  logit is linear in F, so its gradient is W[k]/(h w) everywhere: Grad-CAM *is* CAM, and the
  spatial mean of ``cam_k`` is ``logit_k - b_k`` exactly. Metadata ``explain: cam``.
- Any other tail (the cnn: flatten, Linear, ReLU, Linear; MobileNetV3: pooling, Linear,
  Hardswish, Linear): Grad-CAM (Selvaraju et al., 2017). The gradient of logit k with respect
  to the pooled vector v is the chain ``W_L diag(act'(z)) ... W_1``, a few matrix products
  the graph carries; the weights ``alpha_k,c`` are its spatial mean over F's positions (after
  the mean pooling the gradient is the same at every position: alpha is the row itself, up to
  the 1/(h w) the heatmap's normalisation removes), and ``cam_k = sum_c alpha_k,c F_c``.
  Metadata ``explain: gradcam``.

The maps are in the exported logits' units (divided by the temperature, like the logits)
and not rectified: a reader keeps the positive part (``trainyard.runtime.explain``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from trainyard.core.errors import ExportError
from trainyard.model.lite import LiteNet
from trainyard.model.networks import ResNet, SmallCNN

# Elementwise activations a tail may hold: (the function, its derivative at the input).
ACTIVATIONS: dict[type[nn.Module], tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]]
ACTIVATIONS = {
    nn.ReLU: (F.relu, lambda z: (z > 0).to(z.dtype)),
    # torch's hardswish_backward: 0 below -3, z/3 + 1/2 up to 3, 1 above.
    nn.Hardswish: (
        F.hardswish,
        lambda z: torch.where(z < -3, 0.0, torch.where(z <= 3, z / 3 + 0.5, 1.0)),
    ),
}
# Modules of a tail that are the identity in eval mode (what export traces).
PASS_THROUGH = (nn.Dropout, nn.Flatten, nn.Identity)


def split_net(net: nn.Module) -> tuple[nn.Module, str, list[nn.Module]]:
    """(trunk, pooling ``"mean"`` or ``"flatten"``, tail modules) of a net ``build_model``
    makes, its own modules (shared, not copied): trunk -> pooling -> tail is its forward."""
    if isinstance(net, SmallCNN):
        return nn.Sequential(net.features, net.pool), "flatten", list(net.head)
    if isinstance(net, ResNet):
        return net.features[:-1], "mean", list(net.head)  # features[-1]: AdaptiveAvgPool2d(1)
    if isinstance(net, LiteNet):
        b = net.body  # LiteBody.forward; its dropout before the head is off in eval
        trunk = nn.Sequential(net.adapt, b.conv_stem, b.bn1, b.blocks, b.conv_head, b.bn2)
        return trunk, "mean", [b.classifier]
    if isinstance(net, torchvision.models.ResNet):
        n = net
        trunk = nn.Sequential(
            n.conv1, n.bn1, n.relu, n.maxpool, n.layer1, n.layer2, n.layer3, n.layer4
        )
        return trunk, "mean", [n.fc]
    if isinstance(net, torchvision.models.MobileNetV3 | torchvision.models.EfficientNet):
        return net.features, "mean", list(net.classifier)
    raise ExportError(f"{type(net).__name__}: no known split into feature maps and a head")


def explain_kind(pooling: str, tail: list[nn.Module]) -> str:
    """``cam`` for global average pooling then one Linear (CAM is exact), else ``gradcam``."""
    linears = [m for m in tail if isinstance(m, nn.Linear)]
    only_linear = all(isinstance(m, (nn.Linear, *PASS_THROUGH)) for m in tail)
    return "cam" if pooling == "mean" and len(linears) == 1 and only_linear else "gradcam"


class ExplainedNet(nn.Module):
    """``forward(x) -> (logits, embedding, cam)`` of ``net`` by its split (``split_net``):
    the embedding is the last Linear's input, cam [N, K, h, w] as the module doc says.
    ``temperature`` divides the logits and the maps alike."""

    def __init__(self, net: nn.Module, temperature: float = 1.0) -> None:
        super().__init__()
        trunk, self.pooling, tail = split_net(net)
        for m in tail:
            if not isinstance(m, (nn.Linear, *PASS_THROUGH)) and type(m) not in ACTIVATIONS:
                raise ExportError(f"{type(net).__name__}: no gradient rule for {m!r}")
        self.trunk = trunk
        self.tail = nn.ModuleList(tail)
        self.kind = explain_kind(self.pooling, tail)
        self.temperature = float(temperature)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        maps = self.trunk(x)
        v = maps.mean((2, 3)) if self.pooling == "mean" else maps.flatten(1)
        logits, embedding, steps = self._tail(v)
        alpha = _weights(steps, maps.shape[1:], self.pooling)  # [K, C] or [N, K, C]
        cam = (alpha @ maps.flatten(2)).unflatten(2, tuple(maps.shape[2:]))
        if self.temperature != 1.0:
            logits, cam = logits / self.temperature, cam / self.temperature
        return logits, embedding, cam

    def _tail(
        self, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[str, torch.Tensor]]]:
        """(logits, embedding, the chain's factors in order: ``("linear", W)`` or
        ``("act", act'(z))``) of the tail on the pooled vector ``v``."""
        h, embedding, steps = v, v, []
        for m in self.tail:
            if isinstance(m, nn.Linear):
                embedding, h = h, m(h)
                steps.append(("linear", m.weight))
            elif type(m) in ACTIVATIONS:
                act, derivative = ACTIVATIONS[type(m)]
                steps.append(("act", derivative(h)))
                h = act(h)  # not the module: an in-place ReLU would overwrite z
        return h, embedding, steps


def _weights(
    steps: list[tuple[str, torch.Tensor]], feature_shape: torch.Size, pooling: str
) -> torch.Tensor:
    """alpha: d logits / d v by the chain rule, back to front ([K, C] when the tail is
    linear, [N, K, C] once an activation's derivative enters); for the cnn's flatten, its
    mean over each channel's positions (Grad-CAM's weights), taken on the first Linear's
    weight before the products (the mean is linear): [H, C] instead of [H, C*h*w], so the
    per-image product is h*w times smaller (on the Fashion cnn, 49x: the maps' cost stays
    small beside the net's own)."""
    if pooling == "flatten":
        kind, first = steps[0]
        assert kind == "linear", "the cnn's tail begins with its first Linear"
        steps = [("linear", first.unflatten(1, tuple(feature_shape)).mean((2, 3))), *steps[1:]]
    grad: torch.Tensor | None = None
    for kind, factor in reversed(steps):
        if kind == "linear":
            grad = factor if grad is None else grad @ factor
        else:
            assert grad is not None, "a tail ends in its Linear head"
            grad = grad * factor.unsqueeze(1)  # [K, H] * [N, 1, H] -> [N, K, H]
    assert grad is not None
    return grad
