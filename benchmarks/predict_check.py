"""The probabilities check of ``benchmarks.bench_predict`` (its step 4): ``--check`` files
spread over the folder, scored by ``python -m trainyard.bulk`` with ``--top-k`` = the class
count, against the service's answers and the plain loop's top-1."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.predict_contenders import run_predict
from benchmarks.predict_report import PROB_LIMIT


def check_files(count: int, n: int) -> list[int]:
    """``n`` indices spread evenly over the folder's sorted files."""
    n = min(n, count)
    return sorted({round(k * (count - 1) / max(n - 1, 1)) for k in range(n)})


def bulk_probabilities(table: Path, classes: list[str]) -> dict[str, np.ndarray]:
    """path -> the full probability vector in class order, from a table with top_k = classes."""
    import pyarrow.parquet as pq

    cols = pq.read_table(table, columns=["path", "top_labels", "top_probabilities"]).to_pydict()
    index = {c: i for i, c in enumerate(classes)}
    out = {}
    for path, labels, probs in zip(
        cols["path"], cols["top_labels"], cols["top_probabilities"], strict=True
    ):
        vec = np.full(len(classes), np.nan)
        for label, p in zip(labels, probs, strict=True):
            vec[index[label]] = p
        out[path] = vec
    return out


def compare(
    files: list[Path],
    check: list[int],
    bulk: dict[str, np.ndarray],
    answers: dict[int, dict[str, Any]],
    plain: dict[int, list[float]],
) -> dict[str, Any]:
    """The bulk table against the service's answers (and the plain loop's top-1)."""
    diffs, same_label, plain_same = [], 0, 0
    for i in check:
        served = np.asarray(answers[i]["probabilities"], dtype=np.float64)
        mine = bulk[str(files[i])]
        if np.isnan(mine).any():
            raise SystemExit(f"bench-predict: {files[i]}: the table lacks some classes")
        diffs.append(float(np.abs(served - mine).max()))
        same_label += int(np.argmax(mine)) == answers[i]["class_id"]
        plain_same += int(np.argmax(plain[i])) == answers[i]["class_id"]
    worst = max(diffs)
    return {
        "files": len(check),
        "max_abs_diff": worst,
        "mean_max_abs_diff": float(np.mean(diffs)),
        "limit": PROB_LIMIT,
        "within": worst <= PROB_LIMIT,
        "top1_agree": same_label,
        "plain_loop_top1_agree": plain_same,
    }


def run_check(
    files: list[Path], check: list[int], model: Path, classes: int, work: Path
) -> dict[str, Any]:
    """``python -m trainyard.bulk`` on a list file of the check files, top_k = classes."""
    work.mkdir(parents=True, exist_ok=True)
    listing = work / "check.txt"
    listing.write_text("".join(f"{files[i]}\n" for i in check))
    out = work / "check.parquet"
    run = run_predict(listing, out, model, "--top-k", str(classes))
    return {"table": out, "summary": run["summary"]}
