"""The ``cam`` output: class activation maps computed by the exported graph.

For a head of global average pooling and one Linear the graph's map is CAM from the last
feature maps (caught by a hook on the model itself), and its spatial mean is the logit less
the bias; for the cnn's dense head (and MobileNetV3's MLP) it is autograd's Grad-CAM; ONNX
Runtime's ``cam`` equals PyTorch's. Random models made here: what is checked is arithmetic.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from trainyard.core.card import normalize_pixels
from trainyard.core.config import ExportParams
from trainyard.export.onnx_export import (
    LogitsAndEmbedding,
    check_parity,
    export_onnx,
    parity_failures,
)
from trainyard.model.classifier import Classifier
from trainyard.runtime.sessions import load_onnx

from conftest import make_card

# arch -> the module whose output is the last feature maps, named here (not searched for).
GAP_MAPS = {
    "resnet": lambda net: net.features[-2],
    "efficientnet_lite0": lambda net: net.body.bn2,
    "resnet18": lambda net: net.layer4,
    "efficientnet_b0": lambda net: net.features,
}
GRAD_MAPS = {
    "cnn": lambda net: net.pool,
    "mobilenet_v3_small": lambda net: net.features,
}


def random_model(arch: str, shape=(1, 32, 32), classes: int = 4) -> Classifier:
    """A randomly initialised classifier with BatchNorm statistics that are not the
    identity (a fresh BatchNorm would hide a map taken before or after it)."""
    torch.manual_seed(0)
    model = Classifier(make_card(classes, shape), arch=arch)
    gen = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=gen) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
    return model.eval()


def maps_and_logits(model: Classifier, module, x: torch.Tensor):
    """(feature maps caught by a forward hook on ``module``, the model's own logits)."""
    seen = []
    hook = module.register_forward_hook(lambda _m, _args, out: seen.append(out))
    try:
        logits = model(x)
    finally:
        hook.remove()
    return seen[-1], logits


@pytest.mark.parametrize("arch", sorted(GAP_MAPS))
def test_gap_heads_give_cam_whose_mean_is_the_logit_less_the_bias(arch):
    model = random_model(arch)
    x = torch.randn(3, 1, 32, 32)
    view = LogitsAndEmbedding(model)
    with torch.inference_mode():
        logits, _, cam = view(x)
        maps, own_logits = maps_and_logits(model, GAP_MAPS[arch](model.net), x)
        head = view.tail[-1]  # the last Linear: torchvision's efficientnet has Dropout first
        want = torch.einsum("kc,nchw->nkhw", head.weight, maps)
    assert view.kind == "cam" and cam.shape == (3, 4, *maps.shape[2:])
    torch.testing.assert_close(cam, want, rtol=1e-4, atol=1e-5)
    # CAM's identity: the logit is the head on the mean of the maps, so the mean of cam_k
    # is logit_k - b_k, whatever the weights.
    torch.testing.assert_close(cam.mean((2, 3)) + head.bias, own_logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits, own_logits, rtol=1e-5, atol=1e-6)


def autograd_maps(
    model: Classifier, module, x: torch.Tensor, classes: int, hires: bool
) -> torch.Tensor:
    """By autograd, with G = d logit_k / d F: Grad-CAM (alpha_k,c = mean over positions of
    G, map sum_c alpha_k,c F_c) or, ``hires``, HiResCAM (map sum_c G_c F_c)."""
    with torch.enable_grad():
        maps, logits = maps_and_logits(model, module, x)
        maps.retain_grad()
        cams = []
        for k in range(classes):
            maps.grad = None
            logits[:, k].sum().backward(retain_graph=True)  # images are independent
            weight = maps.grad if hires else maps.grad.mean((2, 3), keepdim=True)
            cams.append((weight * maps).sum(1))
    return torch.stack(cams, 1).detach()


@pytest.mark.parametrize(
    ("arch", "shape", "kind"),
    [
        ("cnn", (1, 28, 28), "hirescam"),
        ("cnn", (3, 160, 160), "hirescam"),
        ("mobilenet_v3_small", (1, 32, 32), "gradcam"),
    ],
)
def test_other_heads_give_autograds_hirescam_or_gradcam(arch, shape, kind):
    model = random_model(arch, shape)
    x = torch.randn(3, *shape)
    module = GRAD_MAPS[arch](model.net)
    want = autograd_maps(model, module, x, 4, hires=kind == "hirescam")
    view = LogitsAndEmbedding(model, temperature=2.0)
    with torch.inference_mode():
        logits, _, cam = view(x)
        own_logits = model(x)
    assert view.kind == kind and cam.shape == want.shape
    # The graph divides by the temperature; after mean pooling its weights are the
    # gradient at the pooled vector, h*w times the gradient at each position.
    scale = 2.0 if arch == "cnn" else 2.0 / (want.shape[2] * want.shape[3])
    assert want.abs().max() > 1e-3  # the maps are not all zero: the check has teeth
    torch.testing.assert_close(cam * scale, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits * 2.0, own_logits, rtol=1e-5, atol=1e-5)
    if kind == "hirescam":  # not Grad-CAM: the flatten head weighs each position its own way
        gradcam = autograd_maps(model, module, x, 4, hires=False)
        assert (cam * scale - gradcam).abs().max() > 1e-2 * gradcam.abs().max()


def test_hirescam_sums_to_the_logit_less_the_biases_share():
    model = random_model("cnn", (1, 28, 28))
    x = torch.randn(5, 1, 28, 28)
    view = LogitsAndEmbedding(model)
    first, last = view.tail[2], view.tail[5]  # Flatten, Dropout, Linear, ReLU, Dropout, Linear
    with torch.inference_mode():
        logits, embedding, cam = view(x)
        # The head is linear in F for the ReLU's pattern: logit_k = sum over positions of
        # cam_k + g_k . b_1 + b_2[k], g_k = W_2[k] * relu'(z), z the hidden layer's input.
        relu_on = (first(model.net.features(x).flatten(1)) > 0).float()
        g = last.weight[None] * relu_on[:, None]
        bias_share = (g @ first.bias) + last.bias
    assert embedding.abs().max() > 0  # the check has teeth: the hidden layer is not all off
    torch.testing.assert_close(cam.sum((2, 3)) + bias_share, logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("arch", "kind"), [("cnn", "hirescam"), ("resnet", "cam")])
def test_onnx_runtime_cam_equals_pytorchs_and_the_gate_checks_it(tmp_path, arch, kind):
    model = random_model(arch, (1, 28, 28), classes=3)
    path = tmp_path / "model.onnx"
    export_onnx(model, path, ExportParams().opset, {"arch": arch}, temperature=0.5)
    onnx_model = load_onnx(path, "cpu", say=False)
    assert onnx_model.metadata["explain"] == kind
    outputs = [o.name for o in onnx_model.session.get_outputs()]
    assert outputs == ["logits", "embedding", "cam"]

    images = np.random.default_rng(0).integers(0, 256, (9, 1, 28, 28), dtype=np.uint8)
    x = normalize_pixels(images, model.card.mean, model.card.std)
    got = onnx_model.session.run(["cam"], {"image": x})[0]
    with torch.inference_mode():
        want = LogitsAndEmbedding(model, 0.5)(torch.from_numpy(x))[2].numpy()
    assert got.shape == want.shape == (9, 3, 7, 7)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * max(1, np.abs(want).max()))

    report = check_parity(model, path, images, ExportParams().max_abs_diff, temperature=0.5)
    assert report["passed"] and report["cam_max_abs_diff"] <= report["threshold_cam_max_abs_diff"]

    # A weight the graph reshapes is reshaped by constants, which ONNX Runtime folds at load.
    # By the feature maps' Shape (as the tracer once recorded hirescam's) it was reshaped
    # and transposed on every call: 3.4 of the Fashion CNN's 3.6 ms at batch 1.
    proto = onnx.load(str(path))
    weights = {i.name for i in proto.graph.initializer}
    reshaped = [n for n in proto.graph.node if n.op_type == "Reshape" and n.input[0] in weights]
    assert (kind == "hirescam") <= bool(reshaped)
    assert all(set(n.input) <= weights for n in reshaped), [n.name for n in reshaped]

    # A model without the output (an export before it): the gate names it.
    keep = [o for o in proto.graph.output if o.name != "cam"]
    del proto.graph.output[:]
    proto.graph.output.extend(keep)
    onnx.save(proto, str(tmp_path / "no_cam.onnx"))
    report = check_parity(model, tmp_path / "no_cam.onnx", images, 1e-4, temperature=0.5)
    assert not report["passed"]
    assert parity_failures(report) == ["cam: no 'cam' output of the class maps' shape"]
