"""The dataset card: the one contract between the data, the model and the service.

prepare writes it beside the arrays (``data/prepared/card.json``); training copies it into
the checkpoint's hyperparameters; export writes it into the ONNX metadata; evaluate, the
registry and the service read it from there. Nothing downstream re-derives class names,
channels, size, normalisation or the resize policy from anything else.

The prepared format it describes, for each split in ``SPLITS``:

- ``{split}_images.npy``: uint8 ``[N, C, H, W]``, pixels 0..255;
- ``{split}_labels.npy``: int32 ``[N]``, indices into ``classes`` (int32: any class count).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trainyard.core.errors import DataError, ModelError

CARD_FILE = "card.json"
CARD_VERSION = 1
SPLITS = ("train", "val", "test")
# crop: shorter side to the size, centre crop (torchvision's Resize + CenterCrop);
# pad: pad to the target aspect with ``fill``, centred, then resize (keeps every pixel);
# stretch: resize to the size, aspect ignored.
RESIZE_POLICIES: tuple[str, ...] = ("crop", "pad", "stretch")


@dataclass(frozen=True)
class Card:
    """What a prepared dataset is and how any image becomes model input.

    Model input for pixels ``p`` (uint8, channel ``c``): ``(p / 255 - mean[c]) / std[c]``.
    An image of any size and mode becomes pixels by ``trainyard.core.imaging.image_to_pixels``
    with ``channels``, ``height``, ``width``, ``resize`` and ``fill``.
    """

    source: str  # the data.source that prepared it: "fashion-mnist", "folder", "csv", ...
    classes: tuple[str, ...]
    channels: int
    height: int
    width: int
    mean: tuple[float, ...]  # per channel, 0..1 scale, from the train split only
    std: tuple[float, ...]
    resize: str = "pad"
    fill: int = 0  # padding and transparent areas become this grey level (0 = black)
    interpolation: str = "bilinear"
    counts: dict[str, Any] = field(default_factory=dict)  # {split: {total, per_class}}
    source_sha256: str = ""  # hash of the source files (paths + bytes)
    data_sha256: str = ""  # hash of the prepared arrays
    skipped: tuple[dict[str, str], ...] = ()  # [{file, reason}] left out (on_bad_file: skip)
    ignored: int = 0  # non-image files and OS litter passed over silently
    duplicates: dict[str, Any] = field(default_factory=dict)  # exact duplicates across splits
    extra: dict[str, Any] = field(default_factory=dict)  # source-specific facts (seed, layout)
    version: int = CARD_VERSION

    def __post_init__(self) -> None:
        problems = []
        if len(self.classes) < 2:
            problems.append(f"needs at least 2 classes, has {len(self.classes)}")
        if len(set(self.classes)) != len(self.classes):
            problems.append("class names repeat")
        if self.channels not in (1, 3):
            problems.append(f"channels must be 1 or 3, got {self.channels}")
        if self.height < 1 or self.width < 1:
            problems.append(f"size {self.height}x{self.width} is not positive")
        if len(self.mean) != self.channels or len(self.std) != self.channels:
            problems.append(f"mean/std need {self.channels} values each")
        if any(s <= 0 for s in self.std):
            problems.append(f"std must be positive, got {list(self.std)}")
        if self.resize not in RESIZE_POLICIES:
            problems.append(f"resize {self.resize!r} is not one of {RESIZE_POLICIES}")
        if problems:
            raise ValueError("invalid dataset card: " + "; ".join(problems))

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of one image; the batch dimension is dynamic."""
        return (self.channels, self.height, self.width)

    def summary(self) -> str:
        """What the logs call the data: ``csv, 3 classes, 3x16x16``."""
        return f"{self.source}, {self.num_classes} classes, {'x'.join(map(str, self.input_shape))}"

    def pixel_options(self) -> dict[str, Any]:
        """The ``image_to_pixels`` keywords that make any image this card's pixels."""
        keys = ("channels", "height", "width", "resize", "fill", "interpolation")
        return {k: getattr(self, k) for k in keys}

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["classes"], d["mean"], d["std"] = list(self.classes), list(self.mean), list(self.std)
        d["skipped"] = [dict(s) for s in self.skipped]
        return d

    def contract(self) -> dict[str, Any]:
        """The part of the card a model needs at inference (no counts, no skipped list):
        what the checkpoint and the ONNX metadata carry."""
        d = self.to_dict()
        for key in ("counts", "skipped", "duplicates", "extra"):
            d.pop(key)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "card") -> Card:
        try:
            return cls(
                source=str(d["source"]),
                classes=tuple(str(c) for c in d["classes"]),
                channels=int(d["channels"]),
                height=int(d["height"]),
                width=int(d["width"]),
                mean=tuple(float(m) for m in d["mean"]),
                std=tuple(float(s) for s in d["std"]),
                resize=str(d.get("resize", "pad")),
                fill=int(d.get("fill", 0)),
                interpolation=str(d.get("interpolation", "bilinear")),
                counts=dict(d.get("counts", {})),
                source_sha256=str(d.get("source_sha256", "")),
                data_sha256=str(d.get("data_sha256", "")),
                skipped=tuple(dict(s) for s in d.get("skipped", ())),
                ignored=int(d.get("ignored", 0)),
                duplicates=dict(d.get("duplicates", {})),
                extra=dict(d.get("extra", {})),
                version=int(d.get("version", CARD_VERSION)),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{source}: not a valid dataset card ({err})") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def load_card(data_dir: str | os.PathLike[str]) -> Card:
    """The card of a prepared dataset folder; a DataError naming the file if unusable."""
    path = Path(data_dir) / CARD_FILE
    if not path.is_file():
        raise DataError(f"{path}: missing; run `dvc repro prepare` first")
    try:
        return Card.from_dict(json.loads(path.read_text(encoding="utf-8")), str(path))
    except (ValueError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: {err}; rerun `dvc repro prepare`") from None


METADATA_KEY = "dataset_card"


def card_from_metadata(meta: dict[str, str], source: str = "model") -> Card:
    """The card an exported ONNX model carries in its metadata (``dataset_card``)."""
    raw = meta.get(METADATA_KEY)
    if raw is None:
        raise ModelError(
            f"{source}: the model's metadata has no {METADATA_KEY}; it was exported by an "
            "older trainyard. Re-export it with `dvc repro export`"
        )
    try:
        return Card.from_dict(json.loads(raw), source)
    except ValueError as err:
        raise ModelError(f"{source}: {err}; re-export it with `dvc repro export`") from None


def normalize_pixels(pixels: Any, mean: Any, std: Any) -> Any:
    """uint8 pixels ``[N, C, H, W]`` (numpy) -> float32 model input, per channel.

    ``(p / 255 - mean[c]) / std[c]``: the one formula training (on the device, in
    ``model.augment.normalize_on_device``), export, evaluate and the service apply.
    """

    m = np.asarray(mean, dtype=np.float32).reshape(1, -1, 1, 1)
    s = np.asarray(std, dtype=np.float32).reshape(1, -1, 1, 1)
    x = np.asarray(pixels).astype(np.float32) / np.float32(255.0)
    return np.ascontiguousarray((x - m) / s, dtype=np.float32)
