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
- Global average pooling then a hidden layer (MobileNetV3: pooling, Linear, Hardswish,
  Linear): Grad-CAM (Selvaraju et al., 2017). The gradient of logit k with respect to the
  pooled vector v is the chain ``W_L diag(act'(z)) ... W_1``, a few matrix products the graph
  carries; after the mean pooling it is the same at every position of F, so Grad-CAM's
  weights ``alpha_k,c`` are the chain's row (up to the 1/(h w) the heatmap's normalisation
  removes) and ``cam_k = sum_c alpha_k,c F_c``. Metadata ``explain: gradcam``.
- The cnn's flatten then Linear, ReLU, Linear: HiResCAM (Draelos & Carin, 2020),
  ``cam_k[i,j] = sum_c G_k[c,i,j] F[c,i,j]`` with G the gradient of logit k with respect to
  F at each position. A flatten head gives every position its own weights (the cnn keeps
  *where* a feature is: a collar, a sole); Grad-CAM would average G over the positions,
  which throws exactly that away (on the Fashion-MNIST cnn its maps correlate ~0.06 with
  the position-wise ones; the deletion test's figures are in ``docs/pipeline.md``).
  HiResCAM is exact: the head is linear in F once the ReLU's pattern is fixed, so the maps
  sum over the positions to ``logit_k`` less the biases' share. The graph computes it
  without the [K, C h w] gradient: ``P[h, i, j] = sum_c W_1[h, c, i, j] F[c, i, j]``, each
  position's share of the hidden layer's input (as many products as the first Linear
  itself), then ``cam_k = (W_2 diag(relu'(z)))[k] . P``. Metadata ``explain: hirescam``.

The maps are in the exported logits' units (divided by the temperature, like the logits)
and not rectified: a reader keeps the positive part (``trainyard.runtime.explain``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from trainyard.core.errors import ExportError
from trainyard.model.backbones import tv_models
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
    models = tv_models()  # not at the top: a torchvision net has paid the import, ours not
    if isinstance(net, models.ResNet):
        n = net
        trunk = nn.Sequential(
            n.conv1, n.bn1, n.relu, n.maxpool, n.layer1, n.layer2, n.layer3, n.layer4
        )
        return trunk, "mean", [n.fc]
    if isinstance(net, models.MobileNetV3 | models.EfficientNet):
        return net.features, "mean", list(net.classifier)
    raise ExportError(f"{type(net).__name__}: no known split into feature maps and a head")


def explain_kind(pooling: str, tail: list[nn.Module]) -> str:
    """``hirescam`` after a flatten; after global average pooling ``cam`` for one Linear
    (CAM is exact), else ``gradcam``."""
    if pooling == "flatten":
        return "hirescam"
    linears = [m for m in tail if isinstance(m, nn.Linear)]
    only_linear = all(isinstance(m, (nn.Linear, *PASS_THROUGH)) for m in tail)
    return "cam" if len(linears) == 1 and only_linear else "gradcam"


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
        if self.pooling == "flatten":
            cam = _hirescam(steps, maps)
        else:
            alpha = _chain(steps)  # [K, C] or [N, K, C]
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


def _chain(steps: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """d logits / d (the first step's input) by the chain rule, back to front: [K, C] when
    the steps are linear, [N, K, C] once an activation's derivative enters."""
    grad: torch.Tensor | None = None
    for kind, factor in reversed(steps):
        if kind == "linear":
            grad = factor if grad is None else grad @ factor
        else:
            assert grad is not None, "a tail ends in its Linear head"
            grad = grad * factor.unsqueeze(1)  # [K, H] * [N, 1, H] -> [N, K, H]
    assert grad is not None
    return grad


def _hirescam(steps: list[tuple[str, torch.Tensor]], maps: torch.Tensor) -> torch.Tensor:
    """HiResCAM [N, K, h, w] after a flatten (module doc): each position's share of the
    first Linear's input, weighted by the gradient at that Linear's output."""
    kind, first = steps[0]
    assert kind == "linear", "the cnn's tail begins with its first Linear"
    # Python ints, constants in the graph (only the batch is dynamic): the weight's reshape
    # and transpose then fold into one initializer. Read from maps.shape by the tracer they
    # were Shape ops, and ONNX Runtime transposed the 128 x 3,136 weight on every call: 3.4
    # of the Fashion CNN's 3.6 ms at batch 1 on an AVX2 EPYC.
    c, h, w = (int(d) for d in maps.shape[1:])
    # [h w, N, C] @ [h w, C, H] -> [h w, N, H]: one product per position, as ONNX MatMul.
    weight = first.unflatten(1, (c, h * w)).permute(2, 1, 0)
    shares = (maps.flatten(2).permute(2, 0, 1) @ weight).permute(1, 2, 0)  # [N, H, h w]
    cam = _chain(steps[1:]) @ shares if len(steps) > 1 else shares  # one Linear: H = K
    return cam.unflatten(2, (h, w))
