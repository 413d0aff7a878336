"""Benchmark: a DVC sweep's wall time with one worker against two, on this machine.

    python -m benchmarks.bench_sweep                 # make bench-sweep: 4 experiments, -j 1 vs -j 2
    python -m benchmarks.bench_sweep --lrs 0.002,0.004 --limit 8000

In each of two temporary clones of this repository (committed files only), with
``data.limit`` and ``train.max_epochs`` set and committed as the baseline:

1. ``dvc repro prepare`` (fetch + prepare, not timed: every experiment shares it);
2. ``dvc exp run --queue -S 'train.lr=a,b,...'``: one queued experiment per learning rate;
3. ``dvc queue start -j N`` (N = 1 in the first clone, 2 in the second), timed until
   ``dvc queue status`` shows nothing queued or running.

Each clone has its own DVC run cache, so the second sweep trains as much as the first.
Printed and written to ``reports/bench-sweep.json`` (+ docs/benchmarks.md "Sweep"): each
sweep's seconds, the -j 2 / -j 1 ratio, each experiment's test accuracy, and how many of its
runs the repository's MLflow store holds (they run in copies DVC deletes).
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.host_facts import cpu_facts
from benchmarks.harness.procs import child_env, clone, run_timed
from benchmarks.harness.publish import bench_parser, outputs, publish
from benchmarks.harness.stopwatch import Timer
from trainyard.track.store import count_runs

DOCS_KEY = "sweep"


def _dvc(repo: Path, *args: str) -> str:
    _, proc = run_timed(["dvc", *args], repo, child_env())
    return proc.stdout


def baseline_clone(source: Path, dest: Path, limit: int, epochs: int) -> Path:
    """A clone of ``source`` with the sweep's baseline params committed, data prepared."""
    clone(source, dest, {"data": {"limit": limit}, "train": {"max_epochs": epochs}})
    git = ["git", "-c", "user.name=bench", "-c", "user.email=bench@localhost"]
    subprocess.run([*git, "commit", "-qam", "sweep baseline"], cwd=dest, check=True)
    _dvc(dest, "repro", "prepare")
    return dest


def sweep(repo: Path, lrs: list[str], jobs: int) -> dict[str, Any]:
    """Queue one experiment per learning rate, run them ``jobs`` at a time; timed."""
    _dvc(repo, "exp", "run", "--queue", "-S", f"train.lr={','.join(lrs)}")
    with Timer() as clock:
        _dvc(repo, "queue", "start", "-j", str(jobs))
        while True:
            status = _dvc(repo, "queue", "status")
            if "Queued" not in status and "Running" not in status:
                break
            time.sleep(2)
    seconds = clock.seconds
    shown = json.loads(_dvc(repo, "exp", "show", "--json"))
    accuracy = {
        exp["name"]: rev["data"]["metrics"]["reports/metrics.json"]["data"]["test"]["accuracy"]
        for baseline in shown
        for exp in baseline.get("experiments") or []
        for rev in exp["revs"]
        if rev.get("data") and rev["data"].get("metrics")
    }
    # The runs of experiments that ran in DVC's temporary copies, in the clone's own store.
    runs = count_runs(f"sqlite:///{repo / 'mlflow.db'}", "tags.`dvc.workspace` = 'temp'")
    return {
        "jobs": jobs,
        "seconds": round(seconds, 1),
        "succeeded": status.count("Success"),
        "failed": status.count("Failed"),
        "test_accuracy": {k: round(v, 4) for k, v in accuracy.items()},
        "runs_in_store": runs,
    }


def markdown(r: dict[str, Any]) -> str:
    """The "Sweep" section of docs/benchmarks.md."""
    one, two = r["sweeps"]
    lines = [
        f"## Sweep: `dvc queue start -j 1` vs `-j 2` ({r['cpu']}, {r['cores']} cores)",
        "",
        f"`make bench-sweep`: {len(r['lrs'])} queued experiments (`train.lr` ="
        f" {', '.join(r['lrs'])}), Fashion-MNIST `data.limit` {r['limit']:,},"
        f" `train.max_epochs` {r['epochs']}; train, export and evaluate in each.",
        "",
        "| workers | wall s | experiments ok | runs in the repo's MLflow store |",
        "|---:|---:|---:|---:|",
    ]
    for s in (one, two):
        lines.append(
            f"| {s['jobs']} | {s['seconds']:,.1f} | {s['succeeded']} | {s['runs_in_store']} |"
        )
    lines += [
        "",
        f"-j 2 / -j 1 wall time: **{r['ratio']:.2f}**. Test accuracy by experiment: "
        + "; ".join(
            f"-j {s['jobs']}: " + ", ".join(f"{v:.4f}" for v in sorted(s["test_accuracy"].values()))
            for s in (one, two)
        )
        + ".",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """``python -m benchmarks.bench_sweep``: measure, print, write the JSON and docs section."""
    parser = bench_parser("benchmarks.bench_sweep", __doc__ or "", "bench-sweep", repo=True)
    parser.add_argument("--lrs", default="0.001,0.002,0.004,0.008", help="the grid of train.lr")
    parser.add_argument("--limit", type=int, default=8000, help="data.limit")
    parser.add_argument("--epochs", type=int, default=1, help="train.max_epochs")
    args = parser.parse_args(argv)
    lrs = [v.strip() for v in args.lrs.split(",") if v.strip()]
    source = Path(args.repo).resolve()
    sweeps = []
    with tempfile.TemporaryDirectory(prefix="trainyard-bench-sweep-") as work:
        for jobs in (1, 2):
            repo = baseline_clone(source, Path(work) / f"j{jobs}", args.limit, args.epochs)
            sweeps.append(sweep(repo, lrs, jobs))
            print(f"-j {jobs}: {sweeps[-1]}", flush=True)
    result = {
        "lrs": lrs,
        "limit": args.limit,
        "epochs": args.epochs,
        "sweeps": sweeps,
        "ratio": round(sweeps[1]["seconds"] / sweeps[0]["seconds"], 3),
        **cpu_facts(),
    }
    out, docs = outputs("bench-sweep", args.out, args.docs, quick=False)
    publish(result, markdown(result), out, docs, DOCS_KEY)
    return result


if __name__ == "__main__":
    main()
