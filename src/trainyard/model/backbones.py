"""torchvision backbones (``BACKBONES``), random or pretrained (``"imagenet"`` or a local
state-dict file), with the stem adapted to the channel count and a new head."""

from __future__ import annotations

import hashlib
import logging
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.hub
from torch import nn

from trainyard.core.errors import ParamsError
from trainyard.core.io import sha256_file
from trainyard.model.weights import PRETRAINED_KEY, read_state_file

log = logging.getLogger(__name__)


# torchvision backbones: name -> (first conv, classification Linear), as submodule paths.
# Explicit paths rather than a search: a new name is added only once its layout is known
# (then to TrainParams.arch too; tests/model/test_backbones.py exports each one). A small and a
# large of each family: resnet34, mobilenet_v2 and efficientnet_b1 were near neighbours of
# these that params never accepted, so they went.
BACKBONES: dict[str, tuple[str, str]] = {
    "resnet18": ("conv1", "fc"),
    "resnet50": ("conv1", "fc"),
    "mobilenet_v3_small": ("features.0.0", "classifier.3"),
    "mobilenet_v3_large": ("features.0.0", "classifier.3"),
    "efficientnet_b0": ("features.0.0", "classifier.1"),
}


def tv_models() -> Any:
    """``torchvision.models``, imported on first use: the import (its models, torch._dynamo)
    costs 2.6 CPU-s on 2 cores, which the stages that build only trainyard's own nets
    (export, evaluate) and the networks module's importers need not pay."""
    import torchvision.models

    return torchvision.models


def build_backbone(
    arch: str, in_channels: int, num_classes: int, pretrained: str | None
) -> tuple[nn.Module, dict[str, str]]:
    """torchvision's ``arch`` with its stem adapted to ``in_channels`` and a new head."""
    stem_path, head_path = BACKBONES[arch]
    # Built as torchvision defines it (3-channel stem, 1000-class head) so that torchvision
    # state dicts load strictly; the stem and head are adapted afterwards.
    model = tv_models().get_model(arch, weights=None)
    info: dict[str, str] = {}
    if pretrained is not None:
        state, info = _pretrained_state_dict(arch, pretrained)
        _load_backbone_state(model, state, arch, head_path, info["source"])
    old_head = model.get_submodule(head_path)
    assert isinstance(old_head, nn.Linear), f"{arch}: {head_path} is not a Linear"
    _set_submodule(model, head_path, nn.Linear(old_head.in_features, num_classes))
    if in_channels != 3:
        _set_submodule(model, stem_path, _adapt_conv(model.get_submodule(stem_path), in_channels))
    return model, info


def _set_submodule(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)


def _adapt_conv(conv: nn.Module, in_channels: int) -> nn.Conv2d:
    """The RGB stem conv for ``in_channels`` inputs, keeping what its kernels learnt.

    1 channel: the RGB kernels summed (a grey image is R = G = B, so the summed kernel
    gives exactly the response the RGB kernels gave to that grey image in colour). Other
    counts: the mean kernel repeated, scaled by 3 / C to keep the activation scale.
    """
    assert isinstance(conv, nn.Conv2d) and conv.in_channels == 3 and conv.groups == 1
    new = nn.Conv2d(
        in_channels,
        conv.out_channels,
        conv.kernel_size,  # type: ignore[arg-type]
        stride=conv.stride,  # type: ignore[arg-type]
        padding=conv.padding,  # type: ignore[arg-type]
        dilation=conv.dilation,  # type: ignore[arg-type]
        bias=conv.bias is not None,
    )
    with torch.no_grad():
        w = conv.weight
        if in_channels == 1:
            new.weight.copy_(w.sum(1, keepdim=True))
        else:
            new.weight.copy_(w.mean(1, keepdim=True).repeat(1, in_channels, 1, 1) * 3 / in_channels)
        if conv.bias is not None:
            new.bias.copy_(conv.bias)
    return new


def _pretrained_state_dict(arch: str, pretrained: str) -> tuple[Mapping[str, Any], dict[str, str]]:
    """(state dict, {source, sha256}) for ``pretrained``; ParamsError when unusable."""
    if pretrained == "imagenet":
        return _imagenet_state_dict(arch)
    return read_state_file(Path(pretrained), arch)


def torchvision_weights(arch: str, timeout_s: float = 15.0) -> tuple[Path | None, str]:
    """(torchvision's ImageNet weights file for ``arch`` in torch's hub cache, "") -
    downloaded there first when missing, within ``timeout_s`` - or (None, why not)."""
    if arch not in BACKBONES:
        return None, f"torchvision has no {arch}"
    weights = tv_models().get_model_weights(arch).DEFAULT
    cached = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(weights.url)
    if cached.is_file():
        return cached, ""
    old = socket.getdefaulttimeout()
    socket.setdefaulttimeout(timeout_s)  # an offline machine must not wait minutes
    try:
        torch.hub.load_state_dict_from_url(
            weights.url, progress=False, check_hash=True, map_location="cpu", weights_only=True
        )
    except Exception as err:  # URLError, timeouts, HTTP and hash errors: all "no weights"
        return None, f"{weights.url}: {type(err).__name__}: {err}"
    finally:
        socket.setdefaulttimeout(old)
    return (cached, "") if cached.is_file() else (None, f"{cached} was not written")


def _imagenet_state_dict(arch: str) -> tuple[Mapping[str, Any], dict[str, str]]:

    weights = tv_models().get_model_weights(arch).DEFAULT
    try:
        # check_hash: the file name carries its sha256 prefix; a truncated download fails.
        state = weights.get_state_dict(
            progress=False, map_location="cpu", check_hash=True, weights_only=True
        )
    except Exception as err:  # URLError, timeouts, HTTP and hash errors: all "no weights"
        raise ParamsError(
            f"{PRETRAINED_KEY}: 'imagenet' weights for {arch} could not be downloaded from "
            f"{weights.url} ({type(err).__name__}: {err}); this machine likely has no "
            f"internet. Download that file elsewhere and set {PRETRAINED_KEY} to the local "
            ".pth or .safetensors state-dict file (or to null for random weights)"
        ) from None
    # load_state_dict_from_url keeps the file in torch hub's cache: hash the bytes loaded.
    cached = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(weights.url)
    sha = sha256_file(cached) if cached.is_file() else _sha256_tensors(state)
    return state, {"source": f"torchvision:{type(weights).__name__}.{weights.name}", "sha256": sha}


def _sha256_tensors(state: Mapping[str, torch.Tensor]) -> str:
    """A content hash of a state dict (names, dtypes, shapes, bytes), for when no file is."""
    h = hashlib.sha256()
    for k in sorted(state):
        t = state[k].detach().cpu().contiguous()
        h.update(f"{k}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _load_backbone_state(
    model: nn.Module, state: Mapping[str, Any], arch: str, head_path: str, source: str
) -> None:
    """Load ``state`` into torchvision's ``arch`` strictly, except the head (replaced next,
    so its weights, of any class count, are dropped)."""
    prefix = head_path + "."
    head_keys = [k for k in state if k.startswith(prefix)]
    if head_keys:
        shapes = ", ".join(f"{k} {tuple(state[k].shape)}" for k in head_keys)
        log.info("pretrained %s: head weights dropped for a new head (%s)", source, shapes)
    body = {k: v for k, v in state.items() if not k.startswith(prefix)}
    expected = [k for k in model.state_dict() if not k.startswith(prefix)]
    missing = [k for k in expected if k not in body]
    unexpected = [k for k in body if k not in set(expected)]
    if missing or unexpected:
        raise ParamsError(
            f"{PRETRAINED_KEY}: {source} is not a torchvision {arch} state dict: "
            f"{len(missing)} missing keys (e.g. {missing[:3]}), {len(unexpected)} unexpected "
            f"keys (e.g. {unexpected[:3]}); point it at weights saved from "
            f"torchvision.models.{arch}() or change train.arch"
        )
    try:
        model.load_state_dict(body, strict=False)
    except RuntimeError as err:  # same names, other shapes (e.g. a width variant)
        raise ParamsError(
            f"{PRETRAINED_KEY}: {source} does not fit torchvision's {arch}: {err}"
        ) from None
