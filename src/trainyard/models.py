"""Networks and the LightningModule that trains them.

Two kinds of network, both built by ``build_model`` for any channel count, image size and
class count (the dataset card's ``channels``, ``height``, ``width`` and ``classes``):

- trainyard's own ``cnn`` and ``resnet``: Conv -> BatchNorm2d -> ReLU blocks throughout;
  ONNX Runtime folds BatchNorm2d into the conv at inference, so the exported graph is as
  lean as the trained one;
- torchvision backbones (``BACKBONES``: ``resnet18``, ``mobilenet_v3_small``,
  ``efficientnet_b0``, ...), random or pretrained (``pretrained``: ``"imagenet"`` or a
  local state-dict file), with the stem adapted to the channels and a new head.

Every model ``build_model`` returns carries ``model.pretrained_info``: ``{}`` for random
initialisation, else ``{"source": ..., "sha256": ...}`` (what training logs to MLflow as
``pretrained.source`` / ``pretrained.sha256``).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from trainyard.card import Card
from trainyard.errors import ParamsError

log = logging.getLogger(__name__)

# Images larger than this (either side) get a /4 downsampling stem before the blocks: the
# blocks were sized for 28 px, and running them at 224 px would cost ~64x the compute.
STEM_ABOVE = 64
# The cnn's dense head sees at most this many positions per side (7: Fashion-MNIST's map).
HEAD_MAX_SIDE = 7
PRETRAINED_KEY = "train.pretrained"  # the params.yaml key errors name
STATE_DICT_SUFFIXES = (".pth", ".pt", ".safetensors")


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
# torchvision backbones: name -> (first conv, classification Linear), as submodule paths.
# Explicit paths rather than a search: a new name is added only once its layout is known.
BACKBONES: dict[str, tuple[str, str]] = {
    "resnet18": ("conv1", "fc"),
    "resnet34": ("conv1", "fc"),
    "resnet50": ("conv1", "fc"),
    "mobilenet_v2": ("features.0.0", "classifier.1"),
    "mobilenet_v3_small": ("features.0.0", "classifier.3"),
    "mobilenet_v3_large": ("features.0.0", "classifier.3"),
    "efficientnet_b0": ("features.0.0", "classifier.1"),
    "efficientnet_b1": ("features.0.0", "classifier.1"),
}
ARCH_NAMES: tuple[str, ...] = tuple(sorted([*ARCHITECTURES, *BACKBONES]))


def build_model(
    arch: str,
    in_channels: int = 1,
    num_classes: int = 10,
    image_size: tuple[int, int] = (28, 28),
    pretrained: str | None = None,
) -> nn.Module:
    """The network ``arch`` for ``in_channels`` x ``image_size`` (H, W) images and
    ``num_classes`` classes; it maps normalised float ``[B, C, H, W]`` to logits.

    ``pretrained`` (torchvision backbones only): ``None`` for random weights,
    ``"imagenet"`` for torchvision's default weights (downloaded, so online machines
    only), or a ``.pth``/``.pt``/``.safetensors`` state-dict file of the same torchvision
    architecture. The returned module's ``pretrained_info`` says which weights were used:
    ``{}`` or ``{"source": path or "torchvision:<Weights>.<NAME>", "sha256": hex}``.
    Bad ``pretrained`` values or files raise ``ParamsError``; an unknown ``arch`` or an
    image too small for the arch raises ``ValueError``.
    """
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
        model, info = _build_backbone(arch, in_channels, num_classes, pretrained)
    model.pretrained_info = info
    return model


def _build_backbone(
    arch: str, in_channels: int, num_classes: int, pretrained: str | None
) -> tuple[nn.Module, dict[str, str]]:
    import torchvision  # lazy: only torchvision backbones need it (and its import is slow)

    stem_path, head_path = BACKBONES[arch]
    # Built as torchvision defines it (3-channel stem, 1000-class head) so that torchvision
    # state dicts load strictly; the stem and head are adapted afterwards.
    model = torchvision.models.get_model(arch, weights=None)
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


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _pretrained_state_dict(arch: str, pretrained: str) -> tuple[Mapping[str, Any], dict[str, str]]:
    """(state dict, {source, sha256}) for ``pretrained``; ParamsError when unusable."""
    if pretrained == "imagenet":
        return _imagenet_state_dict(arch)
    path = Path(pretrained)
    if path.suffix.lower() not in STATE_DICT_SUFFIXES:
        raise ParamsError(
            f"{PRETRAINED_KEY}: {pretrained!r} is neither 'imagenet' nor a state-dict file "
            f"({', '.join(STATE_DICT_SUFFIXES)}); set it to null, 'imagenet', or a file "
            f"holding the state_dict() of torchvision's {arch}"
        )
    if not path.is_file():
        raise ParamsError(
            f"{PRETRAINED_KEY}: {path} does not exist (cwd {os.getcwd()}); set it to an "
            f"existing {arch} state-dict file, or to null for random weights"
        )
    try:
        if path.suffix.lower() == ".safetensors":
            from safetensors.torch import load_file

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
    return state, {"source": str(path), "sha256": _sha256_file(path)}


def _imagenet_state_dict(arch: str) -> tuple[Mapping[str, Any], dict[str, str]]:
    import torch.hub
    import torchvision

    weights = torchvision.models.get_model_weights(arch).DEFAULT
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
    sha = _sha256_file(cached) if cached.is_file() else _sha256_tensors(state)
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


def normalize(
    images_u8: torch.Tensor,
    mean: float | Sequence[float] | torch.Tensor,
    std: float | Sequence[float] | torch.Tensor,
) -> torch.Tensor:
    """uint8 ``[B, C, H, W]`` in 0..255 -> float32 ``(x / 255 - mean[c]) / std[c]``: the
    model's input contract (``trainyard.card.normalize_pixels`` is its numpy twin).

    ``mean``/``std``: C values (a sequence or tensor), or one float for every channel.
    """
    x = images_u8.float() / 255.0

    def per_channel(v: float | Sequence[float] | torch.Tensor) -> torch.Tensor | float:
        if isinstance(v, int | float):
            return float(v)
        return torch.as_tensor(v, dtype=torch.float32, device=x.device).reshape(1, -1, 1, 1)

    return (x - per_channel(mean)) / per_channel(std)


def augment_batch(
    x: torch.Tensor, generator: torch.Generator | None = None, pad: int | None = None
) -> torch.Tensor:
    """Random translate (zero pad + crop) and horizontal flip on a whole batch, on its device.

    One gather for the whole batch instead of per-sample PIL ops: cost is a few
    elementwise kernels regardless of batch size. Any channel count and size; ``pad``
    (the largest shift, px) defaults to ``max(2, round(min(H, W) / 14))``: 2 px at 28 px,
    the same fraction of the image at larger sizes.
    """
    b, _, h, w = x.shape
    if pad is None:
        pad = max(2, round(min(h, w) / 14))
    dev = x.device
    shifts = torch.randint(0, 2 * pad + 1, (2, b), generator=generator, device=dev)
    flips = torch.rand(b, generator=generator, device=dev) < 0.5
    padded = F.pad(x, (pad, pad, pad, pad))
    rows = (shifts[0][:, None] + torch.arange(h, device=dev))[:, :, None]  # [B,H,1]
    cols = shifts[1][:, None] + torch.arange(w, device=dev)  # [B,W]
    cols = torch.where(flips[:, None], cols.flip(1), cols)[:, None, :]  # [B,1,W]
    bidx = torch.arange(b, device=dev)[:, None, None]
    out = padded.permute(0, 2, 3, 1)[bidx, rows, cols]  # [B,H,W,C]
    return out.permute(0, 3, 1, 2).contiguous()


class Classifier(L.LightningModule):
    """Trains any ``build_model`` net on uint8 batches, normalising them on the device.

    ``card``: the dataset card's contract (``Card.contract()``, a plain dict) - classes,
    channels, size and per-channel mean/std. It is saved in the checkpoint's
    hyperparameters (plain types only, so ``torch.load(..., weights_only=True)`` reads it)
    and is all that is needed to rebuild the net: ``Classifier(**ckpt["hyper_parameters"])``.
    ``pretrained`` is deliberately *not* saved: it only initialises the weights, which the
    checkpoint's state dict then replaces, and the file may not exist where the checkpoint
    is exported. ``self.pretrained_info`` says which weights were used (see ``build_model``).
    """

    def __init__(
        self,
        card: dict[str, Any] | Card,
        arch: str = "cnn",
        lr: float = 3e-3,
        weight_decay: float = 5e-4,
        label_smoothing: float = 0.1,
        augment: bool = True,
        seed: int = 0,
        channels_last: bool = False,
        compile: bool = False,
        pretrained: str | None = None,
    ) -> None:
        super().__init__()
        parsed = card if isinstance(card, Card) else Card.from_dict(card, "Classifier card")
        # Stored as the contract's plain dict (lists, not tuples or a Card): checkpoints
        # stay loadable with weights_only=True. save_hyperparameters reads this local.
        card = parsed.contract()
        self.save_hyperparameters(ignore=["pretrained"])
        self.card = parsed
        self.net = build_model(
            arch,
            in_channels=parsed.channels,
            num_classes=parsed.num_classes,
            image_size=(parsed.height, parsed.width),
            pretrained=pretrained,
        )
        self.pretrained_info: dict[str, str] = dict(self.net.pretrained_info)
        # Buffers follow the module to the device (no host->device copy per batch); not
        # persistent, so the state dict holds only the net and the card stays the truth.
        self.register_buffer(
            "pixel_mean", torch.tensor(parsed.mean).reshape(1, -1, 1, 1), persistent=False
        )
        self.register_buffer(
            "pixel_std", torch.tensor(parsed.std).reshape(1, -1, 1, 1), persistent=False
        )
        if channels_last:  # NHWC: what cuDNN's tensor-core convolutions want
            self.net = self.net.to(memory_format=torch.channels_last)
        self._aug_gen: torch.Generator | None = None

    def configure_model(self) -> None:
        # nn.Module.compile() compiles in place: state_dict keys (and export) are unchanged.
        if self.hparams.compile:
            self.net.compile()

    def _generator(self, device: torch.device) -> torch.Generator:
        # Random numbers drawn on the batch's own device: no host round-trip per batch.
        if self._aug_gen is None or self._aug_gen.device != device:
            self._aug_gen = torch.Generator(device=device).manual_seed(self.hparams.seed)
        return self._aug_gen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for *normalised* float input [B,C,H,W] (the exported ONNX contract)."""
        return self.net(x)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        # Runs on the device: uint8 crosses the bus (4x fewer bytes), floats are made there.
        images, labels = batch
        x = normalize(images, self.pixel_mean, self.pixel_std)
        if self.trainer.training and self.hparams.augment:
            x = augment_batch(x, self._generator(x.device))
        if self.hparams.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x, labels

    def _step(self, batch: Any, stage: str) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y, label_smoothing=self.hparams.label_smoothing)
        acc = (logits.argmax(1) == y).float().mean()
        on_step = stage == "train"
        # Under DDP each rank sees its own shard: epoch metrics of val/test (what checkpoints
        # and early stopping watch) are averaged over ranks; per-step train loss is not
        # (a sync every step would cost more than it tells).
        sync = stage != "train"
        self.log(
            f"{stage}/loss",
            loss,
            on_step=on_step,
            on_epoch=True,
            prog_bar=True,
            batch_size=y.shape[0],
            sync_dist=sync,
        )
        self.log(
            f"{stage}/acc",
            acc,
            on_step=False,
            on_epoch=True,
            prog_bar=True,
            batch_size=y.shape[0],
            sync_dist=sync,
        )
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._step(batch, "val")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._step(batch, "test")

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(
            self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay
        )
        sched = torch.optim.lr_scheduler.OneCycleLR(
            opt,
            max_lr=self.hparams.lr,
            # OneCycle needs a few steps per phase; tiny runs (tests, benchmarks) get a floor.
            total_steps=max(int(self.trainer.estimated_stepping_batches), 8),
            pct_start=0.25,
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
