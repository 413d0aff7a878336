"""The models the benchmarks score: trainyard's ``Classifier`` on a dataset card made up
for the run, exported as the export stage exports (ONNX with the card and provenance in
its metadata, and the ``<model>.sha256`` sidecar the service checks). No training: the
benchmarks that use them measure speed and agreement, not accuracy. torch is imported
only when a model is built (in the benchmarks' child processes, or on the GPU machine)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def image_card(classes: tuple[str, ...], side: int, channels: int = 3, **fields: Any) -> Any:
    """A square RGB (or grey) card, ``crop`` resize; mean/std 0.5/0.25 unless given."""
    from trainyard.core.card import Card

    base: dict[str, Any] = {
        "source": "generated",
        "mean": (0.5,) * channels,
        "std": (0.25,) * channels,
        "resize": "crop",
    }
    return Card(classes=classes, channels=channels, height=side, width=side, **(base | fields))


def export_classifier(
    card: Any, arch: str, path: Path, opset: int, tag: str, pretrained: str | None = None
) -> Any:
    """``Classifier(arch)`` for ``card``, exported to ``path`` with its ``.sha256``
    (``tag``: the run name its metadata records); the torch model, in eval mode."""
    from trainyard.core.io import atomic_write_text, sha256_file
    from trainyard.export.onnx_export import export_onnx, model_metadata
    from trainyard.model.classifier import Classifier

    model = Classifier(card=card.contract(), arch=arch, pretrained=pretrained).eval()
    path.parent.mkdir(parents=True, exist_ok=True)
    export_onnx(model, path, opset, model_metadata(model, tag, "", ""))
    atomic_write_text(path.with_name(path.name + ".sha256"), f"{sha256_file(path)}  {path.name}\n")
    return model
