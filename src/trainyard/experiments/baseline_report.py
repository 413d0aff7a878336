"""``reports/report.md``: this workspace against a baseline revision (``trainyard report``,
trainyard.commands.pr_report).

Offline, for a pull-request comment (``gh pr comment --body-file reports/report.md``): the
params that changed and the metrics with their deltas (DVC's own ``params diff`` and
``metrics diff``), the evaluate stage's pictures of both sides next to each other, and the
registry's decision. The baseline's files are read from git and the DVC cache with
``dvc.api.open`` (DVC's API is trainyard.experiments.dvc_repo's); the pictures are copied
into ``reports/report/`` beside the report, so the Markdown links are relative and the
folder can be attached or committed as it is.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from trainyard.core.errors import TrainyardError
from trainyard.core.handoffs import REGISTRY_RECORD, TRAIN_RECORD
from trainyard.core.io import atomic_dir, atomic_write_text
from trainyard.experiments import DEFAULT_BASELINE, DEFAULT_OUT
from trainyard.experiments.dvc_repo import diffs_against, read_at_revision

# name in reports/ -> heading; the evaluate stage writes them (trainyard.evaluation.pictures).
PICTURES = {
    "confusion_matrix.png": "Confusion matrix",
    "confusion_matrix_normalized.png": "Confusion matrix, normalized",
    "learning_curves.png": "Learning curves",
}
HEADLINE = ("reports/metrics.json", "test.accuracy")  # the metric the registry decides on
METRIC_GROUPS = ("test", "train", "export")
MISSING = "—"
_ABSENT = object()  # a key absent from one side (None is a real value)


class NoSuchRevision(TrainyardError):
    """``--baseline`` names no git revision (bad usage: exit 2)."""


@dataclass(frozen=True)
class Baseline:
    """The revision compared against: what the user named, its commit, and why if chosen."""

    name: str
    sha: str
    note: str = ""


def write_report(cwd: Path, baseline: str | None, out: Path | None) -> Path:
    """Write the report (and its pictures) for the repository holding ``cwd``; its path."""
    root = repo_root(cwd)
    base = resolve_baseline(root, baseline)
    out = root / DEFAULT_OUT if out is None else (cwd / out)
    pictures = pictures_folder(out)
    params, metrics = diffs_against(root, base.sha)
    with atomic_dir(pictures) as tmp:
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide the pictures from a web server, others
        cells = copy_pictures(root, base, tmp, pictures.name)
    parts = [
        header(root, base),
        summary(params, metrics),
        stale_warning(root),
        params_section(params, base),
        metrics_section(metrics, base),
        registry_section(root, base),
        pictures_section(cells, base),
    ]
    text = "\n".join(p for p in parts if p)
    atomic_write_text(out, text)
    return out


def pictures_folder(out: Path) -> Path:
    """The folder beside ``out`` named after it: replaced whole by each report, so it must
    hold nothing but an earlier report's pictures (``--out models.md`` must not wipe models/)."""
    folder = out.parent / out.stem
    if folder.exists():
        own = {f"{side}-{name}" for side in ("baseline", "workspace") for name in PICTURES}
        if not folder.is_dir() or any(p.name not in own for p in folder.iterdir()):
            raise TrainyardError(
                f"--out {out}: {folder} exists and is not an earlier report's pictures "
                "folder (it would be replaced); choose another --out"
            )
    return folder


def git(root: Path, *args: str) -> str | None:
    """``git args`` in ``root``: its stripped stdout, None when it fails."""
    try:
        proc = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    except FileNotFoundError as err:
        raise TrainyardError("git is not installed: the baseline is a git revision") from err
    return proc.stdout.strip() if proc.returncode == 0 else None


def repo_root(cwd: Path) -> Path:
    """The git repository holding ``cwd``, which must also be a DVC repository."""
    top = git(cwd, "rev-parse", "--show-toplevel")
    if top is None:
        raise TrainyardError(
            f"{cwd}: not inside a git repository; run trainyard report in a clone of the project"
        )
    root = Path(top)
    if not (root / ".dvc").is_dir():
        raise TrainyardError(f"{root}: not a DVC repository (no .dvc folder); run `dvc init`")
    if git(root, "rev-parse", "--verify", "--quiet", "HEAD^{commit}") is None:
        raise TrainyardError(f"{root}: the repository has no commit yet to compare with")
    return root


def resolve_baseline(root: Path, rev: str | None) -> Baseline:
    """``rev`` as a commit; with none, ``main``, or HEAD when there is no ``main``."""
    if rev is None:
        sha = git(root, "rev-parse", "--verify", "--quiet", f"{DEFAULT_BASELINE}^{{commit}}")
        if sha is not None:
            return Baseline(DEFAULT_BASELINE, sha)
        sha = git(root, "rev-parse", "--verify", "HEAD^{commit}") or ""
        return Baseline(
            "HEAD", sha, f"no `{DEFAULT_BASELINE}` branch here: the baseline is HEAD instead"
        )
    sha = git(root, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    if sha is None:
        raise NoSuchRevision(f"--baseline {rev}: no such revision")
    return Baseline(rev, sha)


def experiment_name(root: Path, head: str) -> str | None:
    """The DVC experiment the workspace holds: one of HEAD's experiments whose dvc.lock is
    the workspace's (``dvc exp run`` leaves its results in the workspace, uncommitted)."""
    lock = root / "dvc.lock"
    refs = git(root, "for-each-ref", "--format=%(refname)", f"refs/exps/{head[:2]}/{head[2:]}/")
    if not refs or not lock.is_file():
        return None
    ours = git(root, "hash-object", "dvc.lock")
    for ref in refs.splitlines():
        if ours is not None and git(root, "rev-parse", f"{ref}:dvc.lock") == ours:
            return ref.rsplit("/", 1)[-1]
    return None


def read_side(root: Path, path: Path, rev: str | None) -> bytes | None:
    """``path``'s bytes at ``rev`` (git or DVC cache), or in the workspace (``rev`` None);
    None when it is not there."""
    if rev is None:
        return (root / path).read_bytes() if (root / path).is_file() else None
    return read_at_revision(root, path, rev)


def read_json(root: Path, path: Path, rev: str | None) -> dict[str, Any] | None:
    """A JSON object file of one side; None when missing or not a JSON object."""
    raw = read_side(root, path, rev)
    try:
        data = json.loads(raw) if raw is not None else None
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def header(root: Path, base: Baseline) -> str:
    """Title, both sides' revisions and MLflow runs."""
    head = git(root, "rev-parse", "HEAD") or ""
    dirty = bool(git(root, "status", "--porcelain", "--untracked-files=no"))
    work = f"HEAD `{head[:7]}`" + (" with uncommitted changes" if dirty else "")
    exp = experiment_name(root, head)
    if exp:
        work += f" (DVC experiment `{exp}`)"
    runs = [read_json(root, TRAIN_RECORD, rev) or {} for rev in (base.sha, None)]
    run_cells = [
        f"`{r['run_id'][:8]}` in `{r.get('experiment', '?')}`, {r.get('epochs_run', '?')} "
        + ("epoch" if r.get("epochs_run") == 1 else "epochs")
        if r.get("run_id")
        else MISSING
        for r in runs
    ]
    lines = [
        f"# trainyard report: workspace vs `{base.name}`",
        "",
        "| | baseline | workspace |",
        "|---|---|---|",
        f"| revision | `{base.name}` `{base.sha[:7]}` | {work} |",
        f"| MLflow run ({TRAIN_RECORD}) | {run_cells[0]} | {run_cells[1]} |",
        "",
    ]
    if base.note:
        lines += [f"> {base.note}.", ""]
    return "\n".join(lines)


def summary(params: dict[str, Any], metrics: dict[str, Any]) -> str:
    """The headline: the test accuracy's change, and how many params differ."""
    file, key = HEADLINE
    acc = (metrics.get("diff") or {}).get(file, {}).get(key, {})
    changed = sum(len(keys) for keys in (params.get("diff") or {}).values())
    text = f"{changed} param{'' if changed == 1 else 's'} changed"
    old, new = acc.get("old"), acc.get("new")
    if isinstance(old, (int, float)) and isinstance(new, (int, float)):
        text = f"**{key}: {cell(old)} → {cell(new)}** ({change(old, new)}); {text}"
    return f"{text}.\n"


def flatten(value: Any, prefix: str) -> dict[str, Any]:
    """Nested dicts as dotted keys (``train.lr``); a non-dict is its own single key."""
    if not isinstance(value, dict):
        return {prefix: value}
    flat: dict[str, Any] = {}
    for key, sub in value.items():
        flat.update(flatten(sub, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def stale_params(root: Path) -> dict[str, tuple[Any, Any]]:
    """Params whose value in dvc.lock (the run that made the workspace's outputs) is not the
    one in the params file now: key -> (locked, current)."""
    lock = root / "dvc.lock"
    if not lock.is_file():
        return {}
    stages = (yaml.safe_load(lock.read_text(encoding="utf-8")) or {}).get("stages", {})
    current: dict[str, dict[str, Any]] = {}  # params file -> its values, flattened
    stale: dict[str, tuple[Any, Any]] = {}
    for stage in stages.values():
        for file, recorded in (stage.get("params") or {}).items():
            if file not in current:
                path = root / file
                text = path.read_text(encoding="utf-8") if path.is_file() else ""
                current[file] = flatten(yaml.safe_load(text) or {}, "")
            for key, locked in recorded.items():
                old = flatten(locked, key)
                new = {
                    k: v for k, v in current[file].items() if k == key or k.startswith(f"{key}.")
                }
                for leaf in old.keys() | new.keys():
                    if old.get(leaf, _ABSENT) != new.get(leaf, _ABSENT):
                        stale[leaf] = (old.get(leaf, _ABSENT), new.get(leaf, _ABSENT))
    return dict(sorted(stale.items()))


def stale_warning(root: Path) -> str:
    """A warning when the workspace's results were not made with its params."""
    stale = stale_params(root)
    if not stale:
        return ""
    shown = [
        f"`{k}` ({param_cell(a)} in dvc.lock, {param_cell(b)} now)"
        for k, (a, b) in list(stale.items())[:6]
    ]
    more = f" and {len(stale) - 6} more" if len(stale) > 6 else ""
    return (
        "> **Warning: the workspace's metrics and pictures are not from its params.** "
        f"dvc.lock records the run that made them, with other values: {', '.join(shown)}{more}. "
        "Run `dvc exp run` (or `dvc repro`), then `trainyard report` again.\n"
    )


def cell(value: Any) -> str:
    """A value in a Markdown table cell: numbers short, absent as ``—``, pipes escaped."""
    if value is _ABSENT:
        return MISSING
    if isinstance(value, float):
        if value != 0 and abs(value) < 1e-3:
            return f"{value:.3g}"
        # accuracies to the 4 digits the registry decides on; seconds to hundredths
        return f"{value:.4f}" if abs(value) < 10 else f"{value:.2f}"
    return param_cell(value)


def param_cell(value: Any) -> str:
    """A params value as params.yaml spells it (0.05, null, true); absent as ``—``."""
    if value is _ABSENT:
        return MISSING
    text = value if isinstance(value, str) else json.dumps(value)
    return text.replace("|", "\\|")


def change(old: Any, new: Any) -> str:
    """The change column: an arrow, the signed delta and the relative change."""
    if old is _ABSENT or new is _ABSENT:
        return MISSING
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (old, new))
    if not numbers:
        return "=" if old == new else "changed"
    delta = new - old
    if delta == 0:
        return "="
    arrow, sign = ("▲", "+") if delta > 0 else ("▼", "−")
    text = f"{arrow} {sign}{cell(abs(delta))}"
    if old:
        text += f" ({sign}{abs(delta) / abs(old):.1%})"
    return text


def diff_errors(result: dict[str, Any], base: Baseline) -> list[str]:
    """DVC's per-revision read errors of a diff, as Markdown notes."""
    notes = []
    for rev, errors in (result.get("errors") or {}).items():
        side = f"`{base.name}`" if rev == base.sha else "workspace"
        items = errors.items() if isinstance(errors, dict) else [("", errors)]
        notes += [f"> {side}: {name} could not be read: {err}" for name, err in items]
    return notes


def params_section(result: dict[str, Any], base: Baseline) -> str:
    """The params that differ (``dvc params diff``): baseline -> workspace."""
    lines = ["## Params", ""]
    rows = [
        (key if file == "params.yaml" else f"{file}:{key}", v.get("old"), v.get("new"))
        for file, keys in sorted((result.get("diff") or {}).items())
        for key, v in sorted(keys.items())
    ]
    if not rows:
        lines.append(f"No param differs from `{base.name}`.")
    else:
        lines += [f"| param | `{base.name}` | workspace |", "|---|---|---|"]
        # None is a null, or a key one side lacks: DVC's diff says None for both
        lines += [f"| `{k}` | {param_cell(old)} | **{param_cell(new)}** |" for k, old, new in rows]
    return "\n".join([*lines, *diff_errors(result, base), ""])


def metric_order(key: str) -> tuple[int, str]:
    """Test metrics first (what the registry decides on), then train's, then the rest."""
    group = key.split(".", 1)[0]
    return (METRIC_GROUPS.index(group) if group in METRIC_GROUPS else len(METRIC_GROUPS), key)


def metrics_section(result: dict[str, Any], base: Baseline) -> str:
    """Every metric of both sides (``dvc metrics diff --all``) with its change."""
    lines = ["## Metrics", ""]
    rows = []
    for file, keys in sorted((result.get("diff") or {}).items()):
        for key, v in sorted(keys.items(), key=lambda kv: metric_order(kv[0])):
            name = key if file == "reports/metrics.json" else f"{file}:{key}"
            old, new = (_ABSENT if v.get(side) is None else v[side] for side in ("old", "new"))
            rows.append(f"| `{name}` | {cell(old)} | {cell(new)} | {change(old, new)} |")
    if rows:
        lines += [f"| metric | `{base.name}` | workspace | change |", "|---|---:|---:|---:|"]
        lines += rows
    else:
        lines.append("No metrics on either side (dvc.yaml's `metrics:` files).")
    return "\n".join([*lines, *diff_errors(result, base), ""])


def decision(reg: dict[str, Any] | None) -> str:
    """One sentence for a reports/registry.json."""
    if reg is None:
        return f"no {REGISTRY_RECORD}"
    if not reg.get("enabled", True):
        return "registry disabled (`registry.enabled: false`): nothing registered"
    what = f"**{reg.get('model_name', '?')} v{reg.get('version', '?')}**"
    verb = "was already registered as" if reg.get("already_registered") else "became"
    return f"{what} {verb} **{reg.get('alias', '?')}**: {reg.get('reason', '')}".rstrip(": ")


def registry_section(root: Path, base: Baseline) -> str:
    """The registry decision of the workspace's evaluate, and the baseline's."""
    old, new = (read_json(root, REGISTRY_RECORD, rev) for rev in (base.sha, None))
    work = decision(new)
    if new is not None and new == old:
        work += f" (the same registration as `{base.name}`: evaluate has not run since)"
    return f"## Registry\n\n- workspace: {work}\n- `{base.name}`: {decision(old)}\n"


def copy_pictures(root: Path, base: Baseline, folder: Path, link: str) -> dict[str, list[str]]:
    """Each picture of both sides copied into ``folder``; picture -> its two table cells
    (an image linked as ``link/<side>-<name>``, or why there is none)."""
    cells: dict[str, list[str]] = {}
    for name, title in PICTURES.items():
        cells[name] = []
        for side, rev in (("baseline", base.sha), ("workspace", None)):
            data = read_side(root, Path("reports") / name, rev)
            where = f"`{base.name}`" if rev else "the workspace"
            if data is None:
                cells[name].append(f"_no reports/{name} in {where}_")
                continue
            (folder / f"{side}-{name}").write_bytes(data)
            cells[name].append(f"![{side}: {title.lower()}]({link}/{side}-{name})")
    return cells


def pictures_section(cells: dict[str, list[str]], base: Baseline) -> str:
    """One two-column table per picture: baseline left, workspace right."""
    lines = ["## Pictures", ""]
    for name, (old, new) in cells.items():
        lines += [f"### {PICTURES[name]}", "", f"| `{base.name}` | workspace |", "|---|---|"]
        lines += [f"| {old} | {new} |", ""]
    return "\n".join(lines)
