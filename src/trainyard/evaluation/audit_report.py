"""``trainyard audit``'s outputs: ``suspects.csv`` (every suspect, most likely first),
``report.html`` (what a person reads: the counts, the classes, and each suspect's
thumbnail, with its pair's for a duplicate; one self-contained file) and ``summary.json``
(the counts MLflow gets)."""

from __future__ import annotations

import base64
import csv
import html
import io
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from trainyard.core.errors import InputError
from trainyard.core.imaging import image_to_pixels
from trainyard.core.io import atomic_file, atomic_write_bytes, atomic_write_json, atomic_write_text
from trainyard.evaluation.audit_findings import Findings, Suspect

log = logging.getLogger(__name__)

THUMB = 96  # px: a thumbnail's side
SHOWN = 60  # suspects of each reason with thumbnails (every one is in the CSV)
COLUMNS = ("file", "reason", "given_label", "suggested_label", "score", "split", "other_file")


@dataclass
class Audited:
    """The images audited, row for row with the embeddings."""

    root: Path
    rels: list[str]  # paths relative to ``root``, as the CSV names them
    paths: list[Path]
    labels: np.ndarray
    splits: np.ndarray
    classes: tuple[str, ...]
    bad: list[tuple[str, str]]  # (rel, why): files that could not be read or decoded
    hashes: list[str] | None = None  # each file's sha256: the thumbnails' cache keys
    thumbs: Path | None = None  # the thumbnails' cache (a 100 MP PNG decodes in seconds)


def _reason(s: Suspect, images: Audited) -> str:
    if s.other < 0:
        return s.reason
    where = f"{images.splits[s.other]} -> {images.splits[s.index]}"
    return f"{s.reason} across splits ({where})" if s.across_splits else f"{s.reason} ({where})"


def suspect_rows(findings: Findings, images: Audited) -> list[dict[str, Any]]:
    """The CSV's rows: every suspect, then every unreadable file."""
    rows = []
    for s in findings.suspects:
        i = s.index
        rows.append(
            {
                "file": images.rels[i],
                "reason": _reason(s, images),
                "given_label": images.classes[images.labels[i]],
                "suggested_label": images.classes[int(findings.probs[i].argmax())],
                "score": round(s.score, 4),
                "split": images.splits[i],
                "other_file": images.rels[s.other] if s.other >= 0 else "",
            }
        )
    rows += [
        dict.fromkeys(COLUMNS, "") | {"file": r, "reason": f"unreadable: {why}"}
        for r, why in images.bad
    ]
    return rows


def write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    with atomic_file(path) as tmp, open(tmp, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def thumbnail(path: Path, cached: Path | None = None) -> str:
    """A ``data:`` URI of the image at ``THUMB`` px (the prepare decoder, padded), or "";
    kept as ``cached`` (a PNG file) when given, and read from there the next time."""
    if cached is not None and cached.is_file():
        return "data:image/png;base64," + base64.b64encode(cached.read_bytes()).decode()
    try:
        pixels = image_to_pixels(
            path.read_bytes(), channels=3, height=THUMB, width=THUMB, resize="pad", fill=255
        )
    except (InputError, OSError) as err:
        log.info("no thumbnail of %s: %s", path, err)
        return ""
    buf = io.BytesIO()
    Image.fromarray(pixels.transpose(1, 2, 0)).save(buf, format="PNG")
    if cached is not None:
        atomic_write_bytes(cached, buf.getvalue())
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _img(images: Audited, i: int) -> str:
    cached = None
    if images.thumbs is not None and images.hashes is not None:
        cached = images.thumbs / f"{images.hashes[i]}.png"
    uri = thumbnail(images.paths[i], cached)
    alt = html.escape(images.paths[i].name)
    return f'<img src="{uri}" alt="{alt}" width="{THUMB}">' if uri else f"[{alt}]"


def _card(s: Suspect, row: dict[str, Any], images: Audited) -> str:
    pics = _img(images, s.index)
    if s.other >= 0:
        pics = _img(images, s.other) + pics
    label = html.escape(row["given_label"])
    if row["suggested_label"] != row["given_label"]:
        label += " &rarr; " + html.escape(row["suggested_label"]) + "?"
    return (
        f"<figure>{pics}<figcaption><b>{label}</b><br>{html.escape(row['file'])}"
        f"<br>{html.escape(row['reason'])} · {row['score']}</figcaption></figure>"
    )


STYLE = (
    "body{font-family:sans-serif;margin:1.5em}figure{display:inline-block;width:220px;"
    "vertical-align:top;margin:.4em;font-size:12px}figure img{margin-right:2px;"
    "background:#eee}table{border-collapse:collapse}td,th{border:1px solid #ccc;"
    "padding:2px 8px;text-align:right}"
)


def write_html(path: Path, findings: Findings, images: Audited, rows: list[dict[str, Any]]) -> None:
    """The page a person reads; each reason's first ``SHOWN`` suspects with thumbnails."""
    summary = summary_counts(findings, images)
    parts = [
        f"<!doctype html><meta charset='utf-8'><title>audit of {html.escape(str(images.root))}"
        f"</title><style>{STYLE}</style><h1>Audit of {html.escape(str(images.root))}</h1>",
        "<p>" + ", ".join(f"{k.replace('_', ' ')}: {v}" for k, v in summary.items()) + "</p>",
        "<h2>Classes</h2><table><tr><th>class</th><th>images</th></tr>",
    ]
    for c, n in findings.class_counts.items():
        flag = " (imbalanced)" if c in findings.imbalanced else ""
        parts.append(f"<tr><td>{html.escape(c)}{flag}</td><td>{n}</td></tr>")
    parts.append("</table>")
    groups: dict[str, list[str]] = {}
    for s, row in zip(findings.suspects, rows, strict=False):
        title = s.reason + (" across splits" if s.across_splits else "")
        shown = groups.setdefault(title, [])
        if len(shown) < SHOWN:
            shown.append(_card(s, row, images))
    for title, cards in groups.items():
        total = sum(
            s.reason + (" across splits" if s.across_splits else "") == title
            for s in findings.suspects
        )
        parts.append(f"<h2>{html.escape(title)}: {total}</h2>" + "".join(cards))
    atomic_write_text(path, "\n".join(parts) + "\n")


def summary_counts(findings: Findings, images: Audited) -> dict[str, Any]:
    return {
        "images": len(images.rels),
        "classes": len(images.classes),
        "label_issues": findings.count("label"),
        "exact_duplicates": findings.count("exact duplicate"),
        "exact_duplicates_across_splits": findings.count("exact duplicate", True),
        "near_duplicates": findings.count("near duplicate"),
        "near_duplicates_across_splits": findings.count("near duplicate", True),
        "outliers": findings.count("outlier"),
        "imbalanced_classes": len(findings.imbalanced),
        "unreadable": len(images.bad),
        "cv_accuracy": round(findings.cv_accuracy, 4),
    }


def write_outputs(
    out: Path, findings: Findings, images: Audited, extra: dict[str, Any]
) -> dict[str, Any]:
    """suspects.csv, report.html, summary.json (the counts and ``extra``) in ``out``; the
    summary."""
    rows = suspect_rows(findings, images)
    write_csv(out / "suspects.csv", rows)
    write_html(out / "report.html", findings, images, rows)
    summary = summary_counts(findings, images) | {
        "folder": str(images.root),
        "imbalanced": findings.imbalanced,
        "class_counts": findings.class_counts,
        **extra,
    }
    atomic_write_json(out / "summary.json", summary)
    return summary
