"""Benchmark: does ``trainyard audit`` find the faults planted in a real folder, and how
long does it take?

    python -m benchmarks.bench_audit                     # make bench-audit: emoji, clipart
    python -m benchmarks.bench_audit --folders emoji --quick

Folders (``benchmarks.recipe_folders``): ``emoji`` (Google's Noto emoji, 1,906 images in 9
categories, the npm package) is where the thresholds were tuned; ``clipart`` (Debian's
openclipart-png, 1,500 images in 7 categories) checks them; ``digits`` (scikit-learn) too,
or a path of your own. In each, ``benchmarks.audit_planted`` flips 5% and then 10% of the
labels (seeded) and plants exact and near (resized, re-encoded) copies of train images in
val and test. ``trainyard audit`` runs as a user runs it (a fresh process, an MLflow run in
a scratch store): on the 10% tree first with an empty embedding cache, then again (cached),
then on the 5% tree (cached: the same files). Reported: precision and recall of its first
k label suspects at k = the number flipped, the planted copies found, the wall times.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.audit_planted import planted_tree, read_suspects, score
from benchmarks.harness.host_facts import cpu_facts, load_facts
from benchmarks.harness.procs import child_env, run_timed
from benchmarks.harness.publish import REPO, bench_parser, outputs, provenance, publish
from benchmarks.recipe_folders import clipart_folder, digits_folder, emoji_folder

DOCS_KEY = "audit"
BUILDERS = {"emoji": emoji_folder, "clipart": clipart_folder, "digits": digits_folder}
DUPS = 10  # exact and near copies planted each


def audit_run(tree: Path, work: Path, cache: Path, what: str) -> tuple[float, list[dict]]:
    """``trainyard audit TREE`` in a fresh process: (wall seconds, its suspects)."""
    out = work / f"out-{tree.name}"
    cmd = [sys.executable, "-m", "trainyard.cli", "audit", str(tree), "--out", str(out)]
    cmd += ["--cache", str(cache), "--params", str(REPO / "params.yaml")]
    seconds, _ = run_timed(cmd, cwd=work, env=child_env(), what=what)
    return seconds, read_suspects(out / "suspects.csv")


def one_folder(name: str, work: Path, seed: int, per_class: int) -> dict[str, Any]:
    builder = BUILDERS.get(name)
    source = builder(work / "sources") if builder else Path(name)
    cache = work / f"cache-{Path(name).name}"
    result: dict[str, Any] = {"folder": name}
    for flip, timings in ((0.10, ("uncached", "cached")), (0.05, ("cached 5%",))):
        tree = planted_tree(
            source, work / f"{Path(name).name}-{round(flip * 100)}", flip, DUPS, seed, per_class
        )
        found: dict[str, Any] = {}
        for label in timings:
            seconds, rows = audit_run(tree.root, work, cache, f"trainyard audit ({label})")
            found = score(tree, rows)
            result.setdefault("seconds", {})[label] = round(seconds, 1)
            print(f"{name} {round(flip * 100)}% flipped, {label}: {seconds:.1f} s", flush=True)
        result[f"flip_{round(flip * 100)}"] = found
    return result


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| folder | images | flipped | label suspects | precision@k | recall@k "
        "| recall at precision 0.7 | exact found | near found | other pairs across splits "
        "| audit s (uncached / cached) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        s = r["seconds"]
        for key in ("flip_5", "flip_10"):
            f = r[key]
            lines.append(
                f"| {r['folder']} | {f['images']} | {f['flipped']} ({key[5:]}%) "
                f"| {f['label_suspects']} | {f['precision_at_k']} | {f['recall_at_k']} "
                f"| {f['recall_at_precision_70']} (first {f['suspects_read_at_precision_70']}) "
                f"| {f['exact_found']}/{f['exact_planted']} "
                f"| {f['near_found']}/{f['near_planted']} "
                f"| {f['other_pairs_across_splits']} "
                f"| {s['uncached'] if key == 'flip_10' else '-'} / "
                f"{s['cached'] if key == 'flip_10' else s['cached 5%']} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser("benchmarks.bench_audit", __doc__ or "", "bench-audit")
    parser.add_argument("--folders", default="emoji,clipart", help="emoji, clipart, digits, paths")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="12 images a class: seconds")
    parser.add_argument(
        "--work", help="keep the trees, caches and reports here (default: a temp dir)"
    )
    args = parser.parse_args(argv)
    out, docs = outputs("bench-audit", args.out, args.docs, args.quick)
    with tempfile.TemporaryDirectory(prefix="bench-audit-") as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        results = [
            one_folder(name, work, args.seed, 12 if args.quick else 0)
            for name in args.folders.split(",")
        ]
    text = (
        f"## Audit\n\n{provenance('benchmarks.bench_audit', argv)['date']}, "
        f"`python -m benchmarks.bench_audit {' '.join(argv or sys.argv[1:])}`, "
        f"{cpu_facts().get('cores', '?')} cores (load {load_facts()['loadavg']:.1f} at the "
        "end: a shared machine). k = the number flipped; a planted copy is found when a row "
        "of suspects.csv across splits names it.\n\n" + table(results)
    )
    result = {**provenance("benchmarks.bench_audit", argv), "results": results}
    result["host"] = cpu_facts() | load_facts()
    publish(result, text, out, docs, DOCS_KEY)


if __name__ == "__main__":
    main()
