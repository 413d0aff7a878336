"""The drift report: ``report.md`` with its pictures, and ``report.json`` with every figure,
each written atomically into one folder (a cron job's reader never sees half a file)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from trainyard.core.io import atomic_write_bytes, atomic_write_json, atomic_write_text
from trainyard.evaluation import drift_plots
from trainyard.watch.drift_score import DriftResult, Window, class_counts
from trainyard.watch.reference import Reference

SCATTER_ROWS = 1000  # per side: enough to see a shift, few enough to see the points


def pca_2d(reference: np.ndarray, current: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Both samples on the reference's first two principal components (so a shifted window
    shows where it left the reference's cloud)."""
    rng = np.random.default_rng(0)
    ref = reference[rng.permutation(reference.shape[0])[:SCATTER_ROWS]].astype(np.float64)
    cur = current[rng.permutation(current.shape[0])[:SCATTER_ROWS]].astype(np.float64)
    mean = ref.mean(axis=0)
    _, _, vt = np.linalg.svd(ref - mean, full_matrices=False)
    axes = vt[:2].T
    if axes.shape[1] < 2:  # a one-dimensional embedding: a zero second axis
        axes = np.pad(axes, ((0, 0), (0, 2 - axes.shape[1])))
    return (ref - mean) @ axes, (cur - mean) @ axes


def report_json(result: DriftResult, reference: Reference, window: Window) -> dict[str, Any]:
    """Every figure of the report: the verdict, each measure, both class mixes, the
    confidence quantiles."""
    counts = class_counts(reference, window.labels)
    quantiles = [0.05, 0.25, 0.5, 0.75, 0.95]
    return result.to_json() | {
        "reference": {"model_sha256": reference.model_sha256, "n": reference.n},
        "skipped": dict(window.skipped),
        "class_mix": {
            c: {"reference": int(r), "current": int(k)}
            for c, r, k in zip(reference.classes, reference.class_counts, counts, strict=True)
        },
        "confidence_quantiles": {
            "q": quantiles,
            "reference": np.quantile(reference.confidence, quantiles).round(6).tolist(),
            "current": np.quantile(window.probabilities, quantiles).round(6).tolist(),
        },
    }


def write_report(
    result: DriftResult, reference: Reference, window: Window, out: str | os.PathLike[str]
) -> dict[str, Path]:
    """``report.md``, ``report.json`` and the PNGs into ``out``; their paths by name."""
    out = Path(out)
    counts = class_counts(reference, window.labels)
    pictures = {
        "class_mix.png": drift_plots.class_mix_png(
            list(reference.classes), reference.class_counts, counts
        ),
        "confidence.png": drift_plots.confidence_png(reference.confidence, window.probabilities),
    }
    if reference.embeddings is not None and window.embeddings is not None:
        pictures["embedding.png"] = drift_plots.embedding_png(
            *pca_2d(reference.embeddings, window.embeddings)
        )
    paths = {name: atomic_write_bytes(out / name, png) for name, png in pictures.items()}
    paths["report.json"] = atomic_write_json(
        out / "report.json", report_json(result, reference, window)
    )
    paths["report.md"] = atomic_write_text(out / "report.md", markdown(result, list(pictures)))
    return paths


def markdown(result: DriftResult, pictures: list[str]) -> str:
    """The report's text: the verdict, a table of the measures, the notes, the pictures."""
    lines = [
        "# Drift report",
        "",
        f"**{result.summary}**",
        "",
        f"Current: {result.source}, {result.n} rows. Reference: {result.reference_n} test images.",
        "",
        "| measure | test | statistic | p-value | alpha | effect | threshold | drifted |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in result.measures:
        effect = "" if m.effect is None else f"{m.effect_name} {m.effect:.4g}"
        threshold = "" if m.effect_threshold is None else f"{m.effect_threshold:g}"
        lines.append(
            f"| {m.name} | {m.test} | {m.statistic:.4g} | {m.p_value:.3g} | {m.alpha:g} "
            f"| {effect} | {threshold} | {'**yes**' if m.drifted else 'no'} |"
        )
    lines.append("")
    lines += [f"- {note}" for note in result.notes]
    lines += ["", *(f"![{Path(p).stem}]({p})" for p in pictures), ""]
    return "\n".join(lines)
