"""``trainyard exps`` (``make exps``): the DVC experiments table with only the columns people
compare: the experiment, its state, the metrics, and the params whose values differ.

``dvc exp show`` prints every param and the hash of every dependency, over 100 columns, and
shrinks them to "…" on a terminal of any width. This reads DVC's own ``dvc exp show --json``
(the same experiments, queued, running, failed and done) and keeps what a person compares.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

from trainyard.commands import Command, Subparsers, command_parser
from trainyard.core.config import flatten

HELP = "the DVC experiments table with only the columns people compare"

# Metrics always shown when present (others only when they differ between rows);
# reports/metrics.json's sample counts and provider describe the run, not its quality, and
# the calibration's temperature, uncalibrated ECE and guard how it was reached (calibration.ece,
# the quality, stays), as do the deletion test's two drops (explain.deletion_ratio stays)
# and the occlusion ceiling's figures (its ratio is the data's and the grid's more than a
# run's: the deletion ratio is what runs differ by);
# the parity gate's figures are a pass/fail check (a run past export is within its limit),
# not something experiments are compared by.
KEY_METRICS = ("test.accuracy", "test.macro_f1", "train.best_val_acc", "train.fit_time_s")
HIDDEN_METRICS = (
    "test.samples",
    "test.provider",
    "export.samples",
    "export.max_abs_diff",
    "export.argmax_agreement",
    "calibration.temperature",
    "calibration.ece_uncalibrated",
    "calibration.fitted_temperature",
    "calibration.applied",
    "calibration.val_ece_before",
    "calibration.val_ece_after",
    "calibration.val_ece_improved_share",
    "explain.deletion_drop_top20",
    "explain.deletion_drop_random20",
    "explain.passed",
    "explain.occlusion_ceiling_ratio",  # the data's and the grid's more than the run's
    "explain.occlusion_ceiling_drop_top20",
    "explain.occlusion_map_ratio",
    "explain.occlusion_samples",
    "explain.occlusion_grid",
)
HIDDEN_PARAMS = ("tune.",)  # the search space shapes no single experiment
CELL = 28  # widest cell in the plain table; longer values (folder paths) are cut in the middle


def add_parser(subparsers: Subparsers) -> None:
    """``trainyard exps``'s options: those of ``dvc exp show`` that choose the rows."""
    parser = command_parser(subparsers, "exps", HELP, CmdExps)
    parser.add_argument("-A", "--all-commits", action="store_true", help="all commits' experiments")
    parser.add_argument("--rev", default=None, help="experiments of this baseline (default HEAD)")
    parser.add_argument("-n", "--num", type=int, default=None, help="the last N baseline commits")
    parser.add_argument(
        "--sort-by", default=None, help="a metric or param column, best first (test.accuracy)"
    )
    parser.add_argument("--md", action="store_true", help="a Markdown table (pull requests)")
    parser.add_argument("--all-params", action="store_true", help="every param, also unchanged")


class CmdExps(Command):
    def run(self) -> int:
        """Print the table; 1 when DVC cannot list the experiments (its message says why),
        2 for a --sort-by column that is not in it."""
        a = self.args
        show = exp_show(a.all_commits, a.rev, a.num)
        if show is None:
            return 1
        rows = table_rows(show)
        if not rows:
            print("no experiments (dvc exp run, or dvc exp run --queue then dvc queue start)")
            return 0
        columns = choose_columns(rows, a.all_params)
        if a.sort_by:
            found = [c for c in columns if _header(c) == a.sort_by]
            if not found:
                shown = ", ".join(_header(c) for c in columns[3:])
                print(
                    f"trainyard exps: --sort-by {a.sort_by}: no such column ({shown})",
                    file=sys.stderr,
                )
                return 2
            rows = sort_rows(rows, found[0])
        print(render_md(rows, columns) if a.md else render_plain(rows, columns))
        return 0


def exp_show(all_commits: bool, rev: str | None, num: int | None) -> list[dict[str, Any]] | None:
    """``dvc exp show --json``'s experiments; None when DVC fails (its message printed)."""
    cmd = [sys.executable, "-m", "dvc", "exp", "show", "--json"]
    if all_commits:
        cmd.append("-A")
    if rev:
        cmd += ["--rev", rev]
    if num is not None:
        cmd += ["-n", str(num)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"trainyard exps: dvc exp show failed: {proc.stderr.strip()}", file=sys.stderr)
        return None
    return json.loads(proc.stdout or "[]")


def _entries(show: list[dict[str, Any]]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(label, state, data) for each baseline row and each experiment under it, in DVC's
    order; an experiment's state is its executor's (queued, running, failed) or done."""
    for baseline in show:
        rev = str(baseline.get("rev", ""))
        label = "workspace" if rev == "workspace" else (baseline.get("name") or rev[:7])
        yield str(label), "", baseline.get("data") or {}
        for exp in baseline.get("experiments") or []:
            executor = exp.get("executor") or {}
            for rev_entry in exp.get("revs") or []:
                name = exp.get("name") or rev_entry.get("name") or str(rev_entry.get("rev"))[:7]
                failed = rev_entry.get("error") is not None
                state = executor.get("state") or ("failed" if failed else "done")
                yield f"  {name}", str(state), rev_entry.get("data") or {}


def _files_data(section: dict[str, Any] | None) -> dict[str, Any]:
    """A params or metrics section ({file: {data: {...}}}) flattened to dotted keys."""
    out: dict[str, Any] = {}
    for entry in (section or {}).values():
        out.update(flatten((entry or {}).get("data") or {}))
    return out


def table_rows(show: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One dict per row: ``Experiment``, ``State``, ``Created``, metrics (``m:`` prefix)
    and params (``p:`` prefix)."""
    rows = []
    for label, state, data in _entries(show):
        row: dict[str, Any] = {
            "Experiment": label,
            "State": state,
            "Created": str(data.get("timestamp") or "")[:16].replace("T", " "),
        }
        for key, value in _files_data(data.get("metrics")).items():
            row[f"m:{key}"] = value
        for key, value in _files_data(data.get("params")).items():
            if not key.startswith(HIDDEN_PARAMS):
                row[f"p:{key}"] = value
        rows.append(row)
    return rows


def choose_columns(rows: list[dict[str, Any]], all_params: bool = False) -> list[str]:
    """Experiment, State, Created; the key metrics, other metrics that differ; the params
    that differ between rows (a param missing from a row, as in a queued one, is no
    difference)."""

    def differs(col: str) -> bool:
        values = {json.dumps(r[col], sort_keys=True, default=str) for r in rows if col in r}
        return len(values) > 1

    keys = list(dict.fromkeys(k for r in rows for k in r))
    metrics = [k for k in keys if k.startswith("m:") and k[2:] not in HIDDEN_METRICS]
    shown = [k for k in metrics if k[2:] in KEY_METRICS or differs(k)]
    shown.sort(key=lambda k: KEY_METRICS.index(k[2:]) if k[2:] in KEY_METRICS else 99)
    params = [k for k in keys if k.startswith("p:") and (all_params or differs(k))]
    return ["Experiment", "State", "Created", *shown, *params]


def sort_rows(rows: list[dict[str, Any]], column: str) -> list[dict[str, Any]]:
    """Experiment rows by ``column``, best (largest) first; baseline rows stay on top."""
    base = [r for r in rows if not r["Experiment"].startswith(" ")]
    exps = [r for r in rows if r["Experiment"].startswith(" ")]
    numeric = [r for r in exps if isinstance(r.get(column), (int, float))]
    rest = [r for r in exps if r not in numeric]
    return base + sorted(numeric, key=lambda r: -r[column]) + rest


def _cell(value: Any, limit: int | None) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, float) and value and abs(value) < 1e-3:
        text = f"{value:.1e}"  # export.max_abs_diff: 1.9e-06, not 0
    elif isinstance(value, float):
        text = f"{value:.4f}".rstrip("0").rstrip(".")
    else:
        text = str(value)
    if limit and len(text) > limit:
        half = (limit - 1) // 2
        text = text[:half] + "…" + text[-(limit - 1 - half) :]
    return text


def _header(col: str) -> str:
    return col.split(":", 1)[1] if ":" in col else col


def render_plain(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """An aligned text table, numbers right-aligned."""
    cells = [[_header(c) for c in columns]] + [
        [_cell(r.get(c), CELL) for c in columns] for r in rows
    ]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    numeric = [all(isinstance(r.get(c), (int, float)) or c not in r for r in rows) for c in columns]
    lines = []
    for n, line in enumerate(cells):
        parts = [
            text.rjust(w) if num and i > 0 else text.ljust(w)
            for i, (text, w, num) in enumerate(zip(line, widths, numeric, strict=True))
        ]
        lines.append("  ".join(parts).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def render_md(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """A GitHub-flavoured Markdown table (whole values: no cell limit)."""
    head = "| " + " | ".join(_header(c) for c in columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    body = [
        "| " + " | ".join(_cell(r.get(c), None).strip().replace("|", "\\|") for c in columns) + " |"
        for r in rows
    ]
    return "\n".join([head, rule, *body])
