"""Side-by-side ratios: each benchmark measures rows in one run, then divides them in pairs
(named ``label: (numerator row, denominator row)``), and prints the ratios beside the
absolutes, as a table or as bullets."""

from __future__ import annotations

from typing import Any


def ratios_of(
    rows: dict[Any, dict[str, Any]], pairs: dict[str, tuple[Any, Any]], key: str = "median"
) -> dict[str, float]:
    """``{label: rows[a][key] / rows[b][key]}`` for the pairs whose two rows were measured."""
    return {
        label: rows[a][key] / rows[b][key]
        for label, (a, b) in pairs.items()
        if a in rows and b in rows
    }


def ratio_table(ratios: dict[str, float]) -> list[str]:
    """The ratios as a Markdown table: ``| ratio | value |``."""
    return ["| ratio | value |", "|---|---:|", *(f"| {k} | {v:.2f}x |" for k, v in ratios.items())]


def ratio_bullets(ratios: dict[str, float]) -> list[str]:
    """The ratios as Markdown bullets, the value in bold."""
    return [f"- {k}: **{v:.2f}x**" for k, v in ratios.items()]
