"""The model card: what a registered model is, what it learned from, how good it is, where
it is weak and how to call it, as JSON (``build_card``) and as Markdown (``card_markdown``).

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
from trainyard.evaluation.deletion import ceiling_verdict
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
    git_dirty, data_version; ``recipe``: ``recipe_choices``; ``params``: ``changed_params``."""
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


# ---------------------------------------------------------------------------- Markdown


def _cell(value: Any) -> str:
    """A table cell: pipes escaped, line breaks flattened (class names may hold either)."""
    text = "—" if value is None or value == "" else str(value)
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\r", " ").replace("\n", " ")


def _table(head: list[str], rows: list[list[Any]]) -> list[str]:
    lines = [
        "| " + " | ".join(_cell(h) if h else "" for h in head) + " |",
        "|" + "---|" * len(head),
    ]
    return lines + ["| " + " | ".join(_cell(v) for v in r) + " |" for r in rows] + [""]


def _pct(x: Any) -> str:
    return "—" if x is None else f"{100 * float(x):.1f}%"


def _what_it_is(card: Mapping[str, Any]) -> list[str]:
    m, reg = card["model"], card.get("registry")
    w = m["weights"]
    weights = (
        f"fine-tuned from {w.get('source')} (sha256 {str(w.get('sha256', ''))[:12]}…); "
        f"licence: {w.get('license')}"
        if w
        else "trained from scratch (no pretrained weights)"
    )
    t, inp = m["training"], m["input"]
    rows = [
        ["architecture", m["arch"]],
        ["weights", weights],
        ["input", f"{'x'.join(map(str, inp['shape']))} (C×H×W), resize {inp['resize']}"],
        [
            "training",
            f"{t['epochs_run']} epochs (best {t['best_epoch']}, stopped by {t['stopped_by']}), "
            f"{t['fit_time_s']} s on {t['device']}, {t['precision']}"
            + (
                f"; the shipped model refitted on train + val ({r['images']:,} images, "
                f"{r['epochs']} epochs)"
                if (r := t.get("refit") or {}).get("epochs")
                else ""
            ),
        ],
        [
            "registry",
            f"{reg['model']} v{reg['version']}, {reg['alias_at_registration']} at registration"
            if reg
            else "not registered",
        ],
        ["MLflow run", f"{m['run_id']} (experiment {m['experiment']})"],
        ["ONNX sha256", m["onnx_sha256"]],
        ["trainyard", m["trainyard_version"]],
    ]
    out = ["## What the model is", "", *_table(["", ""], rows)]
    if m["params"]:
        out += ["Params that differ from the defaults:", ""]
        out += _table(
            ["param", "value", "default"],
            [[k, v["value"], v["default"]] for k, v in m["params"].items()],
        )
    else:
        out += ["Every data, train and export param at its default.", ""]
    if m["recipe"]:
        out += ["The recipe's choices (`train.recipe`):", ""]
        out += _table(["train key", "value (who: why)"], [[k, v] for k, v in m["recipe"].items()])
    return out


def _what_it_learned(card: Mapping[str, Any]) -> list[str]:
    d = card["data"]
    splits = [s for s in ("train", "val", "test") if s in d["counts"]]
    dirty = " (with uncommitted changes)" if d["git_dirty"] == "true" else ""
    out = [
        "## What it learned from",
        "",
        f"Data source `{d['source']}`, {len(d['classes'])} classes; DVC data version "
        f"`{d['data_version'] or 'not in dvc.lock'}`, prepared arrays sha256 "
        f"`{d['data_sha256'][:12]}…`; code at git commit `{d['git_commit']}`{dirty}."
        + (
            f" {d['skipped_files']} source files were skipped (unreadable)."
            if d["skipped_files"]
            else ""
        ),
        "",
    ]
    rows = [
        [c, *(d["counts"][s].get("per_class", {}).get(c, "—") for s in splits)]
        for c in d["classes"]
    ]
    rows.append(["**all**", *(d["counts"][s].get("total", "—") for s in splits)])
    return out + _table(["class", *splits], rows)


def _calibration(cal: Mapping[str, Any]) -> str:
    """The calibration row: the ECE with the graph's temperature and as trained, or why the
    fitted temperature was not applied (the validation split was not sure it helps)."""
    if cal.get("applied") is False:
        return (
            f"{cal['ece']:.4f}, as trained: the fitted temperature "
            f"{cal['fitted_temperature']:g} was not applied (validation ECE "
            f"{cal['val_ece_before']:.4f} -> {cal['val_ece_after']:.4f}, lower in "
            f"{cal['val_ece_improved_share']:.0%} of bootstrap resamples; 95% needed)"
        )
    return (
        f"{cal['ece']:.4f} with temperature {cal['temperature']:g} "
        f"({cal['ece_uncalibrated']:.4f} as trained)"
    )


def _how_good(card: Mapping[str, Any]) -> list[str]:
    q = card["quality"]
    test, cal = q["test"], q["calibration"]
    rows = [
        ["test accuracy", f"{test['accuracy']:.4f} on {test['samples']} images"],
        ["macro F1", f"{test['macro_f1']:.4f}"],
        ["calibration (ECE, 15 bins)", _calibration(cal)],
    ]
    if "explain" in q:
        e = q["explain"]
        verdict = "passed" if e.get("passed") else "FAILED: its heatmaps mean little"
        rows.append(
            [
                "heatmap deletion test",
                f"top-20% pixels removed: -{_pct(e.get('deletion_drop_top20'))}, random 20%: "
                f"-{_pct(e.get('deletion_drop_random20'))} (ratio {e.get('deletion_ratio')}; "
                f"{verdict})",
            ]
        )
        ceiling = ceiling_verdict(e)
        if ceiling:  # a card from before the ceiling has none
            rows.append(["best map at its grid (occlusion ceiling)", ceiling])
    if "int8" in q:
        i = q["int8"]
        rows.append(
            [
                "int8 model",
                f"agrees with fp32 on {_pct(i.get('agreement'))} of {i.get('samples')} test "
                f"images; accuracy {i.get('accuracy_int8')} ({i.get('accuracy_drop')} points "
                "lower)",
            ]
        )
    if q["export"]:
        x = q["export"]
        rows.append(
            [
                "ONNX vs PyTorch",
                f"top-1 agreement {_pct(x.get('argmax_agreement'))}, max |logit diff| "
                f"{x.get('max_abs_diff'):.2g} on {x.get('samples')} images",
            ]
        )
    per_class = [
        [r["class"], f"{r['precision']:.3f}", f"{r['recall']:.3f}", f"{r['f1']:.3f}", r["support"]]
        for r in q["per_class"]
    ]
    return [
        "## How good it is",
        "",
        *_table(["", ""], rows),
        "Per class, on the test split:",
        "",
        *_table(["class", "precision", "recall", "F1", "test images"], per_class),
    ]


def _where_weak(card: Mapping[str, Any]) -> list[str]:
    w = card["weak"]
    worst = ", ".join(
        f"**{_cell(c['class'])}** (F1 {c['f1']:.3f}, recall {c['recall']:.3f})"
        for c in w["worst_classes"]
    )
    out = ["## Where it is weak", "", f"Lowest F1: {worst}.", ""]
    if w["confused_pairs"]:
        out += ["Most confused (rows of the test confusion matrix):", ""]
        out += _table(
            ["true class", "taken for", "images", "share of the true class"],
            [
                [p["true"], p["predicted"], p["images"], _pct(p["share_of_true"])]
                for p in w["confused_pairs"]
            ],
        )
    else:
        out += ["No test image was taken for another class.", ""]
    return out


def _how_to_call(card: Mapping[str, Any]) -> list[str]:
    u = card["usage"]
    return [
        "## How to call it",
        "",
        "The service (`make serve`, or the bento), then:",
        "",
        "```bash",
        u["curl"],
        u["card"],
        "```",
        "",
        "```python",
        u["python"],
        "```",
        "",
        "Bulk scoring of a folder, CSV or glob:",
        "",
        "```bash",
        u["predict"],
        "```",
        "",
    ]


def card_markdown(card: Mapping[str, Any]) -> str:
    """The card as Markdown: headings, tables and code blocks only (the demo page and the
    MLflow UI render those)."""
    q, d = card["quality"], card["data"]
    names = ", ".join(d["classes"][:12]) + (", …" if len(d["classes"]) > 12 else "")
    shape = "x".join(map(str, card["model"]["input"]["shape"]))
    lines = [
        f"# Model card: {card['name']}",
        "",
        f"Image classifier (`{card['model']['arch']}`) of {shape} images into "
        f"{len(d['classes'])} classes ({names}); test accuracy "
        f"{q['test']['accuracy']:.4f}, macro F1 {q['test']['macro_f1']:.4f}.",
        "",
        *_what_it_is(card),
        *_what_it_learned(card),
        *_how_good(card),
        *_where_weak(card),
        *_how_to_call(card),
    ]
    return "\n".join(lines).rstrip() + "\n"
