"""What every benchmark shares: the Fashion-MNIST arrays, the hardware, the docs section."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from trainyard.core.card import Card
from trainyard.core.host import cpu_name

DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
DOCS_START = "<!-- bench:{key}:start -->"
DOCS_END = "<!-- bench:{key}:end -->"


def load_data(raw_dir: Path, limit: int | None, seed: int = 42) -> dict[str, Any]:
    """Train/val/test uint8 [N,1,28,28] splits + card straight from the raw IDX files
    (no DVC needed)."""
    from trainyard.data.arrays import channel_stats, split_train_val
    from trainyard.data.sources.fashion_mnist import fashion_card, load_raw

    raw = load_raw(raw_dir)
    images, labels = raw["train"]
    images = images[:, None]
    val_size = 5000 if limit is None else max(10, limit // 10)
    train_idx, val_idx = split_train_val(labels, val_size, limit, seed)
    train_x = images[train_idx]
    (mean,), (std,) = channel_stats(train_x)
    card = fashion_card(mean, std)
    return {
        "arrays": {
            "train": (train_x, labels[train_idx]),
            "val": (images[val_idx], labels[val_idx]),
            "test": (raw["test"][0][:, None], raw["test"][1]),
        },
        "card": card,
    }


def find_raw_dir(given: str | None) -> Path:
    """The first folder with the Fashion-MNIST IDX files: ``given``, data/raw, Debian's."""
    for candidate in (given, "data/raw", str(DEBIAN_DIR)):
        if candidate and (Path(candidate) / "train-images-idx3-ubyte.gz").is_file():
            return Path(candidate)
    raise SystemExit(
        "bench: no Fashion-MNIST files found (tried --raw, data/raw, "
        f"{DEBIAN_DIR}); run `make run` first or pass --raw DIR"
    )


def classifier(arch: str, card: Card, **kw: Any) -> Any:
    """trainyard's LightningModule for ``card`` (what the train stage fits)."""
    from trainyard.model.classifier import Classifier

    return Classifier(card=card.contract(), arch=arch, **kw)


def hardware() -> dict[str, Any]:
    """The CPU, GPU and library versions the figures were measured with."""
    import torch

    info: dict[str, Any] = {
        "cpu": cpu_name(),
        "cpu_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu": None,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["cuda"] = torch.version.cuda
    try:
        import onnxruntime as ort

        info["onnxruntime"] = ort.__version__
        info["ort_providers"] = ort.get_available_providers()
    except ImportError:
        info["onnxruntime"] = None
    return info


def hardware_label(hw: dict[str, Any]) -> str:
    """The hardware in a few words: GPU + CPU, or the CPU alone."""
    cpu = f"{hw['cpu']} ({hw['cpu_threads']} threads)"
    return f"{hw['gpu']} + {cpu}" if hw.get("gpu") else cpu


def provenance(module: str, argv: list[str] | None) -> dict[str, str]:
    """Date, the command as typed, and the git commit: the header of every result."""
    args = argv if argv is not None else sys.argv[1:]
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    return {
        "date": time.strftime("%Y-%m-%d"),
        "command": f"python -m {module} {' '.join(args)}".strip(),
        "commit": commit or "unknown",
    }


def update_docs(path: Path, key: str, body: str) -> None:
    """Replace this hardware's section of docs/benchmarks.md (other sections untouched)."""
    start, end = DOCS_START.format(key=key), DOCS_END.format(key=key)
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    block = f"{start}\n{body}\n{end}"
    if start in text and end in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


def publish(result: dict[str, Any], text: str, out: str, docs: str, key: str) -> None:
    """A benchmark's ending: print its Markdown ``text``, write ``result`` as JSON to
    ``out``, and replace its section ``key`` of ``docs`` ('' leaves the docs alone)."""
    print(text)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    if docs:
        update_docs(Path(docs), key, text)


def bars(ax: Any, labels: list[str], series: dict[str, list[float]], xlabel: str) -> None:
    """Horizontal bars with their values written on them; log scale only when the values
    span more than 20x (CPU vs GPU), and then from a tenth of the smallest, so bar lengths
    are not exaggerated by a clipped axis."""
    values = [v for vs in series.values() for v in vs if v > 0]
    ypos = np.arange(len(labels))
    height = 0.8 / max(len(series), 1)
    for i, (name, vs) in enumerate(series.items()):
        offs = ypos - 0.4 + height * (i + 0.5)
        drawn = ax.barh(offs, vs, height, label=name)
        ax.bar_label(drawn, labels=[f"{v:,.0f}" if v else "n/a" for v in vs], fontsize=7, padding=2)
    ax.set_yticks(ypos, labels)
    if values and max(values) / min(values) > 20:
        ax.set_xscale("log")
        ax.set_xlim(left=min(values) / 10)
        xlabel += " (log)"
    ax.set_xlim(right=max(values or [1]) * 1.25)
    ax.set_xlabel(xlabel)
    ax.invert_yaxis()
