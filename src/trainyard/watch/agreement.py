"""The shadow's figures from the prediction log: how often a shadow model agreed with the
answering one, over how many requests, and both models' latencies.

``trainyard promote`` records them on the version it moves to `champion`, and refuses a
version without enough of them (docs/serving.md, "Promote and roll back").
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from trainyard.core.prediction_columns import (
    LABEL,
    LATENCY_MS,
    REGISTRY_VERSION,
    SHADOW_LABEL,
    SHADOW_LATENCY_MS,
    SHADOW_REGISTRY_VERSION,
    TIME,
)


def shadow_figures(table: pa.Table, registry_version: str) -> dict[str, Any]:
    """What the log ``table`` (``watch.log.read_log``) says about ``registry_version``
    ("NAME/N") as the shadow: ``rows`` where it ran as the shadow, ``agreement`` (the share
    of those whose top-1 equals the answering model's; None without rows), ``shadow_p50_ms``
    / ``shadow_p99_ms`` and ``answer_p50_ms`` / ``answer_p99_ms`` (None where no latency
    was logged), the answering versions it ran beside (``against``, most rows first) and
    the time of the first and last such row (ISO 8601, UTC)."""
    mine = table.filter(pc.equal(table.column(SHADOW_REGISTRY_VERSION.name), registry_version))
    rows = mine.num_rows
    both = pc.and_(
        pc.is_valid(mine.column(LABEL.name)), pc.is_valid(mine.column(SHADOW_LABEL.name))
    )
    compared = mine.filter(both)
    agree = pc.equal(compared.column(LABEL.name), compared.column(SHADOW_LABEL.name))
    agreed = pc.sum(agree).as_py() or 0
    against = pc.value_counts(mine.column(REGISTRY_VERSION.name)).to_pylist() if rows else []
    against.sort(key=lambda c: (-c["counts"], str(c["values"])))
    times = mine.column(TIME.name)
    shadow_p50, shadow_p99 = _quantiles(mine.column(SHADOW_LATENCY_MS.name))
    answer_p50, answer_p99 = _quantiles(mine.column(LATENCY_MS.name))
    return {
        "registry_version": registry_version,
        "rows": rows,
        "compared": compared.num_rows,
        "agreement": agreed / compared.num_rows if compared.num_rows else None,
        "shadow_p50_ms": shadow_p50,
        "shadow_p99_ms": shadow_p99,
        "answer_p50_ms": answer_p50,
        "answer_p99_ms": answer_p99,
        "against": [c["values"] for c in against if c["values"] is not None],
        "first": _iso(pc.min(times).as_py()) if rows else None,
        "last": _iso(pc.max(times).as_py()) if rows else None,
    }


def _quantiles(column: pa.ChunkedArray) -> tuple[float | None, float | None]:
    """p50 and p99 of a latency column, nulls left out; (None, None) when all are null."""
    if column.null_count == len(column):
        return None, None
    p50, p99 = pc.quantile(column, q=[0.5, 0.99], interpolation="linear").to_pylist()
    return float(p50), float(p99)


def _iso(t: Any) -> str | None:
    return t.isoformat(timespec="seconds") if t is not None else None
