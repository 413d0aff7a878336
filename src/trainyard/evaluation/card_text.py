"""The model card as Markdown (``card_markdown``): what reports/model_card.md, the
registry version's description, the bento's ``model.card.md`` and ``trainyard card`` show.
The card itself (the facts, as JSON) is built in ``model_card``; this only renders it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainyard.evaluation.deletion import ceiling_verdict


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
    code_state = " (with uncommitted changes)" if d["git_dirty"] == "true" else ""
    if d.get("dvc_experiment"):  # DVC keeps the experiment's workspace, params and code
        exp = d["dvc_experiment"]
        code_state = (
            f", run as DVC experiment `{exp}` (`dvc exp apply {exp}` restores its workspace)"
        )
    out = [
        "## What it learned from",
        "",
        f"Data source `{d['source']}`, {len(d['classes'])} classes; DVC data version "
        f"`{d['data_version'] or 'not in dvc.lock'}`, prepared arrays sha256 "
        f"`{d['data_sha256'][:12]}…`; code at git commit `{d['git_commit']}`{code_state}."
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
