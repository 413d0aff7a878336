"""Model behaviour: both architectures at any size, ONNX parity, normalisation, batch
augmentation, and the Classifier's checkpoint contract (the dataset card)."""

from __future__ import annotations

import typing

import numpy as np
import pytest
import torch
from torch import nn

from trainyard.core.card import Card, normalize_pixels
from trainyard.core.config import TrainParams
from trainyard.core.errors import ParamsError
from trainyard.export.onnx_export import export_onnx
from trainyard.model.augment import augment_batch, normalize_on_device
from trainyard.model.classifier import Classifier
from trainyard.model.networks import ARCH_NAMES, SmallCNN, _pooled_side, build_model
from trainyard.model.trained import TrainedNet

# (C, H, W, classes): Fashion-MNIST, a small RGB set, ImageNet-sized RGB, and sizes whose
# maps do not divide evenly or are not square.
SHAPES = [(1, 28, 28, 10), (3, 64, 64, 5), (3, 224, 224, 100)]
ODD_SHAPES = [(3, 100, 100, 7), (3, 96, 128, 3)]


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def card_dict(channels: int = 1, size: tuple[int, int] = (28, 28), classes: int = 10) -> dict:
    return Card(
        source="folder",
        classes=tuple(f"c{i}" for i in range(classes)),
        channels=channels,
        height=size[0],
        width=size[1],
        mean=tuple(0.2 + 0.1 * c for c in range(channels)),
        std=tuple(0.3 + 0.05 * c for c in range(channels)),
    ).contract()


@pytest.mark.parametrize("arch", ["cnn", "resnet"])
@pytest.mark.parametrize(("c", "h", "w", "k"), SHAPES + ODD_SHAPES)
def test_forward_backward(arch, c, h, w, k):
    torch.manual_seed(0)
    model = build_model(arch, in_channels=c, num_classes=k, image_size=(h, w))
    logits = model(torch.randn(2, c, h, w))
    assert logits.shape == (2, k)
    logits.logsumexp(1).sum().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert model.pretrained_info == {}


def test_fashion_cnn_is_unchanged():
    # The 28x28 SmallCNN reached the required 0.918 test accuracy; its graph must not drift:
    # no stem, no pooling before the 7x7 flatten, Linear(64*7*7, 128), 458,730 parameters
    # (counted on the pre-generalisation code).
    model = build_model("cnn")
    assert n_params(model) == 458_730
    assert isinstance(model.pool, nn.Identity)
    assert model.head[2].in_features == 64 * 7 * 7
    assert not any(m.stride == (2, 2) for m in model.modules() if isinstance(m, nn.Conv2d))
    assert n_params(build_model("resnet")) == 2_776_522


def test_only_conv_and_batchnorm2d():
    # ONNX Runtime fuses Conv+BatchNorm2d; BatchNorm1d would stay a separate op.
    for arch in ("cnn", "resnet"):
        model = build_model(arch, 3, 5, (224, 224))
        assert not any(isinstance(m, nn.BatchNorm1d) for m in model.modules())


@pytest.mark.parametrize(
    ("side", "pooled"), [(7, 7), (3, 3), (8, 4), (12, 6), (14, 7), (16, 4), (11, 1), (13, 1)]
)
def test_pooled_side_is_an_exact_divisor(side, pooled):
    assert _pooled_side(side) == pooled


def test_large_images_get_a_stem_and_a_small_head():
    model = build_model("cnn", 3, 10, (224, 224))
    # 224 -> /4 stem 56 -> 28 -> 14, pooled to 7x7: the dense head is Fashion-sized.
    assert model.head[2].in_features == 64 * 7 * 7
    assert isinstance(model.features[1], nn.MaxPool2d)  # stem: stride-2 conv + pool
    nonsquare = build_model("cnn", 3, 10, (96, 128))  # map 6x8 -> pooled 6x4
    assert nonsquare.head[2].in_features == 64 * 6 * 4


def test_too_small_image_is_a_clear_error():
    with pytest.raises(ValueError, match=r"cannot take 3x3 images"):
        SmallCNN(image_size=(3, 3))


def test_unknown_arch():
    with pytest.raises(ValueError, match="unknown arch 'vgg'") as err:
        build_model("vgg")
    for name in ("cnn", "resnet", "resnet18", "mobilenet_v3_small", "efficientnet_b0"):
        assert repr(name) in str(err.value)
    assert set(ARCH_NAMES) >= {"cnn", "resnet", "resnet18"}


def test_params_accept_exactly_the_defined_archs():
    # A defined arch params refuse is dead code; a name params accept that is not defined
    # fails only at train time. TrainParams.arch lists them by hand (core imports no model).
    accepted = typing.get_args(TrainParams.model_fields["arch"].annotation)
    names = {v for member in accepted for v in typing.get_args(member)} - {"auto"}
    assert names == set(ARCH_NAMES)


def test_own_archs_refuse_pretrained_weights():
    with pytest.raises(ParamsError, match=r"train\.pretrained.*'cnn' has no pretrained"):
        build_model("cnn", pretrained="imagenet")


@pytest.mark.parametrize(("c", "h", "w"), [(1, 28, 28), (3, 96, 128)])
def test_cnn_onnx_matches_torch(tmp_path, c, h, w):
    import onnxruntime as ort

    torch.manual_seed(0)
    model = TrainedNet(card_dict(c, (h, w), 7), arch="cnn")
    # trained-looking BatchNorm statistics, so the fused Conv+BN is actually exercised
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    path = tmp_path / "m.onnx"
    export_onnx(model, path, opset=18, metadata={})  # the export stage's own exporter
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = torch.randn(5, c, h, w)  # another batch size than the example: the dim is dynamic
    with torch.no_grad():
        ref = model(x).numpy()
    got = sess.run(["logits"], {sess.get_inputs()[0].name: x.numpy()})[0]
    assert got.shape == (5, 7)
    assert np.abs(got - ref).max() <= 1e-4


@pytest.mark.parametrize("channels", [1, 3])
def test_normalize_matches_the_card_formula(channels):
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (4, channels, 9, 7), dtype=np.uint8)
    mean, std = [0.2860, 0.41, 0.5][:channels], [0.3530, 0.27, 0.2][:channels]
    got = normalize_on_device(torch.from_numpy(pixels), mean, std)
    assert got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), normalize_pixels(pixels, mean, std), atol=1e-6)
    # scalars still work (the old single-channel signature)
    scalar = normalize_on_device(torch.from_numpy(pixels), 0.3, 0.4)
    np.testing.assert_allclose(scalar.numpy(), normalize_pixels(pixels, 0.3, 0.4), atol=1e-6)


def test_augment_keeps_shape_range_and_content():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(256, 1, 28, 28)
    out = augment_batch(x, g)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert out.min() >= 0 and out.max() <= x.max()
    # a translate by ≤2 px and a flip keep the centre region's pixels within the image
    assert not torch.equal(out, x)


def test_augment_is_translation_or_flip_of_the_input():
    g = torch.Generator().manual_seed(1)
    x = torch.zeros(64, 1, 28, 28)
    x[:, 0, 10, 5] = 1.0  # one lit pixel, left of centre
    out = augment_batch(x, g)
    for i in range(64):
        ((r, c),) = (out[i, 0] == 1).nonzero().tolist()
        assert abs(r - 10) <= 2
        assert abs(c - 5) <= 2 or abs(c - (27 - 5)) <= 2  # shifted, or flipped then shifted
    flipped = sum(int((out[i, 0] == 1).nonzero()[0, 1] > 13) for i in range(64))
    assert 10 < flipped < 54  # about half are flipped


def test_augment_scales_the_shift_with_the_image_and_moves_channels_together():
    g = torch.Generator().manual_seed(2)
    h, w, r0, c0 = 64, 96, 30, 20
    x = torch.zeros(128, 3, h, w)
    x[:, :, r0, c0] = torch.tensor([1.0, 2.0, 3.0])  # one lit pixel, 3 colours
    out = augment_batch(x, g)  # pad = round(64 / 14) = 5
    rows, cols = [], []
    for i in range(128):
        ((r, c),) = (out[i, 0] == 1).nonzero().tolist()
        assert out[i, 1, r, c] == 2 and out[i, 2, r, c] == 3  # channels move as one
        rows.append(r - r0)
        cols.append(min(abs(c - c0), abs(c - (w - 1 - c0))))
    assert max(abs(d) for d in rows) == 5 and max(cols) <= 5


def test_classifier_checkpoint_rebuilds_from_the_card_alone(tmp_path):
    from torch.utils.data import DataLoader, TensorDataset

    from trainyard.training.builder import build_trainer

    card = card_dict(channels=3, size=(32, 40), classes=4)
    images = torch.randint(0, 256, (8, 3, 32, 40), dtype=torch.uint8)
    labels = torch.randint(0, 4, (8,))
    model = Classifier(card, arch="cnn", augment=False)
    assert isinstance(model.card, Card) and model.card.num_classes == 4
    assert model.pretrained_info == {}
    trainer = build_trainer(fast_dev_run=True, root=tmp_path)
    trainer.fit(model, DataLoader(TensorDataset(images, labels), batch_size=4))

    # the device-side normalisation is the card's per-channel formula
    x, _ = model.on_after_batch_transfer((images, labels), 0)
    want = normalize_pixels(images.numpy(), card["mean"], card["std"])
    np.testing.assert_allclose(x.numpy(), want, atol=1e-6)

    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    ckpt = torch.load(path, map_location="cpu", weights_only=True)  # plain types only
    hparams = ckpt["hyper_parameters"]
    assert hparams["card"] == card and "pretrained" not in hparams
    rebuilt = Classifier(**hparams)
    rebuilt.load_state_dict(ckpt["state_dict"])
    rebuilt.eval()
    model.eval()
    x = torch.randn(2, 3, 32, 40)
    assert torch.equal(rebuilt(x), model(x))


def test_classifier_rejects_an_invalid_card():
    bad = card_dict() | {"mean": [0.1, 0.2]}  # 2 means for 1 channel
    with pytest.raises(ValueError, match="mean/std need 1 values"):
        Classifier(bad)
