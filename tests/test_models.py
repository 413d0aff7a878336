"""Model behaviour: forward/backward for both architectures, batch augmentation."""

from __future__ import annotations

import pytest
import torch

from trainyard.models import augment_batch, build_model


@pytest.mark.parametrize("arch", ["cnn", "resnet"])
def test_forward_backward(arch):
    torch.manual_seed(0)
    model = build_model(arch)
    x = torch.randn(4, 1, 28, 28)
    logits = model(x)
    assert logits.shape == (4, 10)
    logits.logsumexp(1).sum().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_unknown_arch():
    with pytest.raises(ValueError, match="unknown arch 'vgg'"):
        build_model("vgg")


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
