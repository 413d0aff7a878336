"""A model's reference: what it predicted on the test split, the baseline drift compares to.

The evaluate stage builds it from the ONNX model's outputs on the whole test split and saves
it beside the model (``models/model.reference.npz``) and with the registered version. It
holds the predicted-class counts over every test image, a seeded sample of the top-1
probabilities, and a seeded sample of the embeddings (None for a model exported without its
embedding output). One ``.npz`` file: numpy arrays and a small JSON header, read without
pickle.
"""

from __future__ import annotations

import io
import json
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainyard.core.errors import DataError
from trainyard.core.io import atomic_write_bytes

FORMAT = "trainyard.reference"
VERSION = 1
DEFAULT_PATH = Path("models/model.reference.npz")
DEFAULT_SAMPLE = 2000


@dataclass(frozen=True)
class Reference:
    """The baseline of one model: ``class_counts[k]`` test images predicted as
    ``classes[k]`` (all ``n`` of them); ``confidence`` a sample of their top-1
    probabilities; ``embeddings`` a sample of their embeddings [S, D] (None: the model has
    no embedding output); ``model_sha256`` the ONNX file it came from; ``seed`` the
    sample's seed."""

    classes: tuple[str, ...]
    class_counts: np.ndarray
    confidence: np.ndarray
    embeddings: np.ndarray | None
    model_sha256: str
    n: int
    seed: int

    @property
    def has_embeddings(self) -> bool:
        return self.embeddings is not None


def sample_rows(n: int, sample: int, seed: int) -> np.ndarray:
    """The rows (sorted) a reference of ``n`` test images keeps in its samples: all of them
    up to ``sample``, else ``sample`` drawn with ``seed``. Evaluate keeps only these rows'
    embeddings while it scores, so a large test split's embeddings never sit in memory."""
    if n <= sample:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).choice(n, sample, replace=False))


def reference_from_predictions(
    classes: list[str] | tuple[str, ...],
    predicted: np.ndarray,
    confidence: np.ndarray,
    embeddings: np.ndarray | None,
    *,
    model_sha256: str,
    sample: int = DEFAULT_SAMPLE,
    seed: int = 0,
) -> Reference:
    """The reference from each test image's predicted class index [N] and top-1
    probability [N]; ``embeddings`` [N, D], or already only the ``sample_rows`` [S, D]."""
    classes = tuple(str(c) for c in classes)
    predicted = np.asarray(predicted)
    confidence = np.asarray(confidence, np.float32)
    n = predicted.shape[0]
    if not classes or len(set(classes)) != len(classes):
        raise ValueError("a reference needs distinct class names")
    if n == 0 or predicted.ndim != 1 or confidence.shape != (n,):
        raise ValueError(f"predictions {predicted.shape} and confidence {confidence.shape} [N]")
    if predicted.min() < 0 or predicted.max() >= len(classes):
        raise ValueError(f"predicted class indices outside 0..{len(classes) - 1}")
    rows = sample_rows(n, sample, seed)
    kept = None
    if embeddings is not None:
        embeddings = np.asarray(embeddings, np.float32)
        if embeddings.ndim != 2 or embeddings.shape[0] not in (n, rows.size):
            raise ValueError(
                f"embeddings {embeddings.shape}: expected [{n}, D] or the sampled [{rows.size}, D]"
            )
        kept = embeddings[rows] if embeddings.shape[0] == n and n != rows.size else embeddings
    return Reference(
        classes=classes,
        class_counts=np.bincount(predicted, minlength=len(classes)).astype(np.int64),
        confidence=confidence[rows],
        embeddings=kept,
        model_sha256=model_sha256,
        n=int(n),
        seed=int(seed),
    )


def build_reference(
    classes: list[str] | tuple[str, ...],
    probs: np.ndarray,
    embeddings: np.ndarray | None,
    **options: Any,
) -> Reference:
    """The reference from the model's softmax probabilities [N, K] on the test split (and
    its embeddings [N, D] or None); ``options``: ``reference_from_predictions``'s
    (``model_sha256``, ``sample``, ``seed``)."""
    probs = np.asarray(probs)
    if probs.ndim != 2 or probs.shape[1] != len(classes):
        raise ValueError(f"probs {probs.shape}: expected [N, {len(classes)}]")
    top1 = probs.argmax(axis=1), probs.max(axis=1)
    return reference_from_predictions(classes, *top1, embeddings, **options)


def save_reference(ref: Reference, path: str | os.PathLike[str]) -> Path:
    """Write ``ref`` to ``path`` (one .npz, atomically)."""
    header = {
        "format": FORMAT,
        "version": VERSION,
        "classes": list(ref.classes),
        "model_sha256": ref.model_sha256,
        "n": ref.n,
        "seed": ref.seed,
        "has_embeddings": ref.has_embeddings,
    }
    arrays: dict[str, Any] = {
        "header": np.frombuffer(json.dumps(header).encode("utf-8"), np.uint8),
        "class_counts": ref.class_counts.astype(np.int64),
        "confidence": ref.confidence.astype(np.float32),
    }
    if ref.embeddings is not None:
        arrays["embeddings"] = ref.embeddings.astype(np.float32)
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    return atomic_write_bytes(path, buf.getvalue())


def load_reference(path: str | os.PathLike[str]) -> Reference:
    """Read a reference ``save_reference`` wrote; a DataError naming the file when it is
    missing, not a reference, or inconsistent."""
    path = Path(path)
    if not path.is_file():
        raise DataError(
            f"{path}: no model reference there (the evaluate stage writes "
            "models/model.reference.npz: `dvc repro evaluate`; or pass --reference)"
        )
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
        header = json.loads(bytes(arrays["header"]).decode("utf-8"))
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, UnicodeDecodeError) as err:
        raise DataError(f"{path}: not a readable model reference ({err})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise DataError(f"{path}: not a trainyard model reference (no {FORMAT} header)")
    if header.get("version") != VERSION:
        raise DataError(
            f"{path}: reference format version {header.get('version')}, this trainyard reads "
            f"{VERSION}: rebuild it with `dvc repro evaluate`"
        )
    return _checked(path, header, arrays)


def _checked(path: Path, header: dict[str, Any], arrays: dict[str, np.ndarray]) -> Reference:
    classes = header.get("classes")
    counts = arrays.get("class_counts")
    confidence = arrays.get("confidence")
    embeddings = arrays.get("embeddings")
    problems = []
    if not isinstance(classes, list) or not classes or not all(isinstance(c, str) for c in classes):
        problems.append("its class names are missing")
    elif counts is None or counts.shape != (len(classes),) or (counts < 0).any():
        problems.append(f"its class counts do not match its {len(classes)} classes")
    if confidence is None or confidence.ndim != 1 or confidence.size == 0:
        problems.append("its confidence sample is missing")
    elif not np.isfinite(confidence).all() or confidence.min() < 0 or confidence.max() > 1:
        problems.append("its confidence sample holds values outside 0..1")
    if bool(header.get("has_embeddings")) != (embeddings is not None):
        problems.append("its header and its embeddings disagree")
    elif embeddings is not None and (embeddings.ndim != 2 or not np.isfinite(embeddings).all()):
        problems.append("its embeddings are not a finite [S, D] array")
    if problems:
        raise DataError(f"{path}: a damaged model reference: {'; '.join(problems)}")
    return Reference(
        classes=tuple(classes),
        class_counts=counts.astype(np.int64),
        confidence=confidence.astype(np.float32),
        embeddings=None if embeddings is None else embeddings.astype(np.float32),
        model_sha256=str(header.get("model_sha256", "")),
        n=int(header.get("n", int(counts.sum()))),
        seed=int(header.get("seed", 0)),
    )
