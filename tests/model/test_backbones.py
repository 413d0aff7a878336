"""torchvision backbones: any channels and class count, and pretrained weights from a local
file (the offline machines' only source) or torchvision's download, with provenance."""

from __future__ import annotations

import hashlib
import logging
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from trainyard.core.config import ExportParams, parse_params
from trainyard.core.errors import ParamsError
from trainyard.export.onnx_export import check_parity, export_onnx
from trainyard.model.backbones import BACKBONES
from trainyard.model.classifier import Classifier
from trainyard.model.networks import build_model
from trainyard.runtime.sessions import load_onnx

from conftest import make_card

torchvision = pytest.importorskip("torchvision")
safetensors_torch = pytest.importorskip("safetensors.torch")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def stem_and_head(model: nn.Module, arch: str) -> tuple[nn.Conv2d, nn.Linear]:
    stem, head = BACKBONES[arch]
    return model.get_submodule(stem), model.get_submodule(head)


@pytest.fixture(scope="module")
def resnet18_state() -> dict[str, torch.Tensor]:
    """A torchvision resnet18's state dict with known (seeded, non-ImageNet) weights."""
    torch.manual_seed(1234)
    return torchvision.models.get_model("resnet18", weights=None).state_dict()


@pytest.mark.parametrize("arch", sorted(BACKBONES))
@pytest.mark.parametrize("channels", [1, 3])
def test_backbone_any_channels_and_classes(arch, channels):
    torch.manual_seed(0)
    model = build_model(arch, in_channels=channels, num_classes=7, image_size=(32, 32))
    stem, head = stem_and_head(model, arch)
    assert stem.in_channels == channels and head.out_features == 7
    logits = model(torch.randn(2, channels, 32, 32))
    assert logits.shape == (2, 7)
    logits.logsumexp(1).sum().backward()
    assert torch.isfinite(stem.weight.grad).all()
    assert model.pretrained_info == {}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", sorted(BACKBONES))
def test_every_backbone_exports_to_onnx_with_parity(tmp_path, arch):
    """Each backbone params accept, through the pipeline's own export and its parity gate
    (export.max_abs_diff), on 1-channel images: the stem trainyard adapts (a 3-channel
    stem is torchvision's own). Tiny images keep it quick (the export's trace dominates)."""
    assert parse_params({"train": {"arch": arch}}).train.arch == arch
    torch.manual_seed(0)
    card = make_card(("a", "b", "c"), (1, 32, 32))
    model = Classifier(card, arch=arch).eval()
    path = tmp_path / f"{arch}.onnx"
    export_onnx(model, path, ExportParams().opset, {"arch": arch})
    images = np.random.default_rng(0).integers(0, 256, (4, 1, 32, 32), dtype=np.uint8)
    report = check_parity(model, path, images, ExportParams().max_abs_diff)
    assert report["passed"], report  # the embedding's parity included
    # The embedding is what the new head (torchvision's classification Linear) sees.
    dim = model.net.get_submodule(BACKBONES[arch][1]).in_features
    outputs = [
        (o.name, o.shape[1]) for o in load_onnx(path, "cpu", say=False).session.get_outputs()
    ]
    assert outputs == [("logits", 3), ("embedding", dim), ("cam", 3)]


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
@pytest.mark.parametrize("channels", [1, 3])
def test_local_weights_are_the_ones_used(tmp_path, resnet18_state, suffix, channels):
    path = tmp_path / f"weights{suffix}"
    if suffix == ".pth":
        torch.save(resnet18_state, path)
    else:
        safetensors_torch.save_file(resnet18_state, str(path))

    torch.manual_seed(99)  # a different seed: random init would not reproduce the file
    model = build_model("resnet18", channels, 5, (64, 64), pretrained=str(path))

    got = model.state_dict()
    for key in ("layer4.1.conv2.weight", "layer1.0.bn1.running_var", "bn1.bias"):
        assert torch.equal(got[key], resnet18_state[key]), key
    rgb = resnet18_state["conv1.weight"]
    want = rgb if channels == 3 else rgb.sum(1, keepdim=True)  # grey: RGB kernels summed
    assert torch.equal(got["conv1.weight"], want)
    assert got["fc.weight"].shape == (5, 512)  # a new head for the 5 classes
    assert model.pretrained_info == {"source": str(path), "sha256": sha256(path)}


def test_head_of_another_class_count_is_dropped(tmp_path, resnet18_state, caplog):
    # e.g. weights fine-tuned on a 10-class set reused for a 4-class one
    state = dict(resnet18_state, **{"fc.weight": torch.zeros(10, 512), "fc.bias": torch.zeros(10)})
    path = tmp_path / "finetuned.pt"
    torch.save(state, path)
    with caplog.at_level(logging.INFO, logger="trainyard.model.backbones"):
        model = build_model("resnet18", 3, 4, (32, 32), pretrained=str(path))
    assert torch.equal(model.layer1[0].conv1.weight, resnet18_state["layer1.0.conv1.weight"])
    assert model.fc.out_features == 4
    assert "head weights dropped" in caplog.text and "fc.weight (10, 512)" in caplog.text


def test_weights_of_another_arch_are_refused(tmp_path):
    path = tmp_path / "mobilenet.pth"
    torch.save(torchvision.models.get_model("mobilenet_v3_small", weights=None).state_dict(), path)
    with pytest.raises(ParamsError, match=r"train\.pretrained.*mobilenet\.pth.*not a torchvision"):
        build_model("resnet18", 3, 5, (64, 64), pretrained=str(path))


def test_same_keys_other_shapes_are_refused(tmp_path, resnet18_state):
    # every key name matches, one tensor has another shape (as a width variant's would)
    state = dict(resnet18_state, **{"layer1.0.conv1.weight": torch.zeros(64, 64, 1, 1)})
    path = tmp_path / "reshaped.pth"
    torch.save(state, path)
    with pytest.raises(ParamsError, match=r"reshaped\.pth does not fit"):
        build_model("resnet18", 3, 5, (64, 64), pretrained=str(path))


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("absent.pth", None, r"absent\.pth does not exist"),
        ("weights.bin", b"x", r"'.*weights\.bin' is neither 'imagenet' nor a state-dict file"),
        ("garbage.pth", b"not a pickle", r"garbage\.pth cannot be loaded as a state dict"),
        ("garbage.safetensors", b"\x00" * 16, r"garbage\.safetensors cannot be loaded"),
    ],
)
def test_unusable_weight_files_are_params_errors(tmp_path, name, content, message):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ParamsError, match=rf"train\.pretrained.*{message}"):
        build_model("resnet18", 3, 5, (64, 64), pretrained=str(path))


def test_a_training_checkpoint_is_not_a_state_dict(tmp_path, resnet18_state):
    path = tmp_path / "last.pth"
    torch.save({"state_dict": resnet18_state, "epoch": 3}, path)
    with pytest.raises(ParamsError, match=r"last\.pth holds a dict.*training checkpoint"):
        build_model("resnet18", 3, 5, (64, 64), pretrained=str(path))


def test_imagenet_from_torchvision_cache(tmp_path, monkeypatch, resnet18_state):
    # torchvision's own loader finds a file already in torch hub's cache without any
    # network: stand one in (our seeded weights) and check the provenance names it.
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    weights = torchvision.models.get_model_weights("resnet18").DEFAULT
    cached = tmp_path / "hub" / "checkpoints" / Path(weights.url).name
    cached.parent.mkdir(parents=True)
    torch.save(resnet18_state, cached)
    model = build_model("resnet18", 1, 3, (32, 32), pretrained="imagenet")
    assert torch.equal(model.layer2[0].conv1.weight, resnet18_state["layer2.0.conv1.weight"])
    assert model.pretrained_info == {
        "source": f"torchvision:ResNet18_Weights.{weights.name}",
        "sha256": sha256(cached),
    }


def _reachable(host: str) -> bool:
    try:
        socket.create_connection((host, 443), timeout=3).close()
        return True
    except OSError:
        return False


@pytest.mark.timeout(120)
def test_imagenet_offline_asks_for_a_local_file(tmp_path, monkeypatch):
    if _reachable("download.pytorch.org"):
        pytest.skip("download.pytorch.org is reachable: the offline error cannot happen here")
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))  # an empty cache: a download is needed
    with pytest.raises(ParamsError, match=r"no internet.*local \.pth or \.safetensors"):
        build_model("mobilenet_v3_small", 3, 5, (64, 64), pretrained="imagenet")
