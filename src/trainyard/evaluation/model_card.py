"""The model card: what a registered model is, what it learned from, how good it is, where
it is weak and how to call it, as JSON (``build_card``); ``card_text.card_markdown``
renders it as Markdown.

Evaluate writes both (``reports/model_card.{json,md}``, and beside ``model.onnx`` as
``model.card.{json,md}``, which the bento ships and ``GET /card`` serves), logs them to the
train run and puts the Markdown on the registry version (docs/pipeline.md, "The model card").
Everything here is pure: the stage gathers the facts (the ONNX metadata, the dataset card,
the scores, metrics.json, train.json, the run's recipe and lineage) and hands them in, so a
card is a function of its inputs and a test builds one from made-up numbers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainyard.core.card import Card
from trainyard.core.io import atomic_write_text
from trainyard.evaluation.card_text import card_markdown
from trainyard.runtime.model_file import CARD_FILES, card_beside

CARD_SCHEMA = 1
WORST_CLASSES = 3
CONFUSED_PAIRS = 5
SERVICE_URL = "http://127.0.0.1:3000"  # make serve's default (serve.host, serve.port)


# The params sections that shape the model (serve, registry and mlflow say where it goes).
MODEL_SECTIONS = ("seed", "data.", "train.", "export.", "evaluate.")


def changed_params(flat: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """``{key: {"value", "default"}}`` for each dotted params key of ``MODEL_SECTIONS`` whose
    value is not the default (``Params().flat()``): what this model's params.yaml chose."""
    return {
        key: {"value": value, "default": defaults.get(key)}
        for key, value in sorted(flat.items())
        if key.startswith(MODEL_SECTIONS) and (key not in defaults or defaults[key] != value)
    }


def recipe_choices(run_tags: Mapping[str, str]) -> dict[str, str]:
    """The recipe's choices from the train run's ``recipe.<key>`` tags (training.recipe:
    ``"<value> (<params or recipe>: <why>)"``), by train key."""
    prefix = "recipe."
    return {k[len(prefix) :]: v for k, v in sorted(run_tags.items()) if k.startswith(prefix)}


def weak_spots(scores: Mapping[str, Any], classes: list[str]) -> dict[str, Any]:
    """The classes with the lowest F1 and the most frequent confusions (true -> predicted,
    with the share of the true class's test images they took)."""
    per_class = scores["per_class"]
    ranked = sorted(classes, key=lambda c: (per_class[c]["f1"], per_class[c]["recall"]))
    worst = [
        {"class": c, **{m: per_class[c][m] for m in ("f1", "precision", "recall", "support")}}
        for c in ranked[: min(WORST_CLASSES, max(1, len(classes) // 2))]
    ]
    cm = scores["confusion_matrix"]
    pairs = [
        (cm[i][j], i, j)
        for i in range(len(classes))
        for j in range(len(classes))
        if i != j and cm[i][j] > 0
    ]
    pairs.sort(key=lambda p: (-p[0], p[1], p[2]))
    confused = [
        {
            "true": classes[i],
            "predicted": classes[j],
            "images": int(n),
            "share_of_true": round(n / max(sum(cm[i]), 1), 4),
        }
        for n, i, j in pairs[:CONFUSED_PAIRS]
    ]
    return {"worst_classes": worst, "confused_pairs": confused}


def usage(name: str, version: int | None) -> dict[str, str]:
    """How to call the model: the service (curl, BentoML's client) and bulk scoring."""
    model = f"models:/{name}/{version}" if version is not None else "models/model.onnx"
    return {
        "curl": f"curl -F image=@photo.jpg {SERVICE_URL}/classify",
        "python": (
            # As ruff formats it: the card is Markdown in the repo, and ruff formats its code.
            "import bentoml\nfrom pathlib import Path\n\n"
            f'bentoml.SyncHTTPClient("{SERVICE_URL}").classify(image=Path("photo.jpg"))'
        ),
        "predict": f"trainyard predict photos/ --model {model}",
        "card": f"curl {SERVICE_URL}/card   # this card; ?format=json for JSON",
    }


def _weights(metadata: Mapping[str, str]) -> dict[str, Any] | None:
    """The pretrained weights the fit started from (source, sha256, licence), None from
    scratch: export writes them into the ONNX metadata as JSON ({} from scratch)."""
    try:
        raw = json.loads(metadata.get("pretrained") or "{}")
    except ValueError:  # not JSON: said as it is
        return {"source": metadata["pretrained"], "sha256": "", "license": "unknown"}
    return dict(raw) if isinstance(raw, dict) and raw else None


def build_card(
    *,
    name: str,
    metadata: Mapping[str, str],
    dataset: Card,
    scores: Mapping[str, Any],
    metrics: Mapping[str, Any],
    train: Mapping[str, Any],
    onnx_sha256: str,
    lineage: Mapping[str, str],
    recipe: Mapping[str, str],
    params: Mapping[str, Any],
) -> dict[str, Any]:
    """The card as JSON-ready data. ``metadata``: the ONNX model's; ``scores``: evaluate's
    metrics (per class, confusion matrix); ``metrics``: reports/metrics.json (its ``explain``
    and ``int8`` sections only when present); ``train``: train.json; ``lineage``: git_commit,
    git_dirty, data_version, dvc_experiment (the run's `dvc exp run` name, or "");
    ``recipe``: ``recipe_choices``; ``params``: ``changed_params``."""
    classes = list(dataset.classes)
    return {
        "schema": CARD_SCHEMA,
        "name": name,
        "model": {
            "arch": metadata.get("arch"),
            "weights": _weights(metadata),
            "input": {
                "shape": list(dataset.input_shape),
                "resize": dataset.resize,
                "mean": list(dataset.mean),
                "std": list(dataset.std),
            },
            "onnx_sha256": onnx_sha256,
            "trainyard_version": metadata.get("trainyard_version"),
            "run_id": train.get("run_id"),
            "experiment": train.get("experiment"),
            "training": {
                k: train.get(k)
                for k in ("epochs_run", "best_epoch", "stopped_by", "fit_time_s", "device")
            }
            | {"precision": train.get("precision")}
            # train.refit: which images trained the shipped model (absent before it)
            | ({"refit": train["refit"]} if train.get("refit") else {}),
            "params": dict(params),
            "recipe": dict(recipe),
        },
        "data": _data(dataset, lineage),
        "quality": _quality(scores, metrics, classes),
        "weak": weak_spots(scores, classes),
        "registry": None,
        "usage": usage(name, None),
    }


def _quality(
    scores: Mapping[str, Any], metrics: Mapping[str, Any], classes: list[str]
) -> dict[str, Any]:
    """The card's quality section: test metrics, per class, calibration, export (and the
    deletion test and int8 gate when the metrics have them)."""
    quality: dict[str, Any] = {
        "test": dict(metrics["test"]),
        "per_class": [{"class": c, **scores["per_class"][c]} for c in classes],
        "calibration": dict(metrics["calibration"]),
        "export": dict(metrics.get("export", {})),
    }
    for optional in ("explain", "int8"):  # the deletion test; the int8 model's gate
        if optional in metrics:
            quality[optional] = dict(metrics[optional])
    return quality


def _data(dataset: Card, lineage: Mapping[str, str]) -> dict[str, Any]:
    """The card's data section: where the images came from and which version."""
    return {
        "source": dataset.source,
        "classes": list(dataset.classes),
        "counts": {s: dict(c) for s, c in dataset.counts.items()},
        "data_version": lineage.get("data_version", ""),
        "data_sha256": dataset.data_sha256,
        "git_commit": lineage.get("git_commit", ""),
        "git_dirty": lineage.get("git_dirty", ""),
        "dvc_experiment": lineage.get("dvc_experiment", ""),
        "skipped_files": len(dataset.skipped),
    }


def with_registration(card: Mapping[str, Any], registration: Mapping[str, Any]) -> dict[str, Any]:
    """The card with the registry version evaluate registered (its alias at registration),
    and calls naming that version."""
    version = int(registration["version"])
    return dict(card) | {
        "registry": {
            "model": registration["model_name"],
            "version": version,
            "alias_at_registration": registration["alias"],
            "reason": registration["reason"],
        },
        "usage": usage(registration["model_name"], version),
    }


def write_card(
    card: Mapping[str, Any],
    reports: str | os.PathLike[str],
    model: str | os.PathLike[str],
) -> dict[str, Path]:
    """The card as ``reports/model_card.{json,md}`` and beside ``model`` (``model.onnx`` ->
    ``model.card.{json,md}``: what the bento ships and GET /card serves); returns the
    reports' paths by kind."""
    texts = {
        "json": json.dumps(card, indent=2, ensure_ascii=False) + "\n",
        "md": card_markdown(card),
    }
    paths = {}
    for kind, text in texts.items():
        paths[kind] = atomic_write_text(Path(reports, CARD_FILES[kind]), text)
        atomic_write_text(card_beside(Path(model), kind), text)
    return paths
