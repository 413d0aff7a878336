"""Bulk scoring's command line, read by both of its programs: ``trainyard predict`` and
``predict-merge`` (trainyard.commands.predict_files and .predict_merge, which add registry
models and the MLflow run) and ``python -m trainyard.bulk`` (``__main__``: the bento's and a
Kubernetes Job's, with neither). The flags, the typed options they make, and the exit
status of each outcome.

Here, not in trainyard.commands, because the bento ships the bulk package and none of the
commands (their modules import MLflow, Optuna, DVC): what it runs imports only light layers.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

from trainyard.bulk.predict_job import PredictOptions, merge, predict
from trainyard.bulk.summary import summary_line
from trainyard.core.config import DEFAULT_PARAMS
from trainyard.core.errors import TrainyardError
from trainyard.core.model_ref import ModelRegistry

log = logging.getLogger("trainyard.bulk")

# What a finished job's summary is also given to (trainyard predict: its MLflow run).
Record = Callable[[PredictOptions, dict[str, Any]], None]


def add_predict_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``SOURCE [--out FILE] [...]``; unset options read params.yaml (PredictOptions)."""
    p.add_argument("source", help="a folder, a CSV (.csv/.tsv), a text file of paths, or a glob")
    p.add_argument(
        "--out", help="the table, .parquet or .csv (default: predictions/<source name>.parquet)"
    )
    p.add_argument(
        "--model",
        help="an exported .onnx, models:/NAME@ALIAS, models:/NAME/N or runs:/RUN_ID "
        "(default: predict.model, whose auto is serve.model)",
    )
    p.add_argument("--params", default=str(DEFAULT_PARAMS), help="params file")
    p.add_argument("--top-k", type=int, help="labels per row (predict.top_k)")
    p.add_argument(
        "--min-confidence",
        type=float,
        help="flag rows whose top-1 probability is below this (predict.min_confidence)",
    )
    p.add_argument("--batch-size", type=int, help="images per model call (predict.batch_size)")
    p.add_argument("--workers", type=int, help="decode processes (predict.workers)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="predict.device")
    p.add_argument("--chunk-rows", type=int, help="rows per resumable chunk (predict.chunk_rows)")
    p.add_argument(
        "--shard", default="0/1", help="K/N: score the K-th of N slices (0-based), N machines"
    )
    p.add_argument("--strict", action="store_true", help="stop at the first unreadable file")
    p.add_argument(
        "--explain",
        action="store_true",
        help="also write each image's heatmap of its top label, a PNG of the image's size, "
        "in <out>.heatmaps/ beside the table (its path: the heatmap column)",
    )
    return p


def predict_options(args: argparse.Namespace) -> PredictOptions:
    """The job that ``add_predict_arguments``'s parsed flags ask for."""
    return PredictOptions(**{f.name: getattr(args, f.name) for f in fields(PredictOptions)})


def add_merge_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``trainyard predict-merge SHARD... --out FILE``."""
    p.add_argument(
        "shards", nargs="+", type=Path, help="the shards' tables (their .summary.json beside them)"
    )
    p.add_argument("--out", required=True, type=Path, help="the merged table: .parquet or .csv")
    return p


def run_predict(
    options: PredictOptions,
    registry: ModelRegistry | None = None,
    record: Record | None = None,
) -> int:
    """Score: 0; 1 with the reason; 130 on Ctrl-C (the chunks written are kept: the same
    command continues). ``registry``: gets a registry model; ``record``: logs the finished
    job (MLflow)."""
    t0 = time.monotonic()
    try:
        summary = predict(options, registry)
        if record is not None:
            record(options, summary)
    except TrainyardError as err:
        print(f"trainyard predict: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(
            f"trainyard predict: interrupted after {math.floor(time.monotonic() - t0)} s; the "
            "chunks scored so far are kept: rerun the same command to continue",
            file=sys.stderr,
        )
        return 130
    return 0


def run_merge(shards: list[Path], out: Path) -> int:
    """Merge a job's shards into ``out``: exit 0, or 1 with the reason."""
    try:
        merged = merge(shards, out)
    except TrainyardError as err:
        print(f"trainyard predict-merge: error: {err}", file=sys.stderr)
        return 1
    log.info("%d shard(s) -> %s: %s", len(shards), out, summary_line(merged))
    return 0
