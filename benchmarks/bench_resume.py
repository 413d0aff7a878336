"""Benchmark: what a resume saves on the real pipeline, one run.

    python -m benchmarks.bench_resume                  # make bench-resume: 4 epochs, kill after 2
    python -m benchmarks.bench_resume --epochs 6 --kill-after 3 --limit 20000

In a temporary clone of this repository (committed files only, as a teammate has them),
with ``train.max_epochs`` set to ``--epochs`` (and ``data.limit`` to ``--limit`` if given):

1. ``dvc repro prepare`` (fetch + prepare, not timed);
2. ``dvc repro train`` in its own process group, SIGKILLed (a lost machine, the OOM killer:
   no clean-up at all) as soon as the resume checkpoint holds epoch ``--kill-after``;
3. ``dvc repro train`` again: it resumes from that checkpoint (checked in its output);
4. ``dvc repro -f train``: the same training, uninterrupted, from scratch.

Printed and written to ``reports/bench-resume.json`` (+ docs/benchmarks.md "Resume"): the
seconds of 2, 3 and 4, the resumed rerun / uninterrupted ratio (about the share of epochs
left, (epochs - kill_after) / epochs: the rerun adds its start-up, while the uninterrupted
run's first epoch also pays one-off warm-up costs), and the best
val/acc of both trainings: a resume that changed what is learned would show here.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.host_facts import cpu_facts
from benchmarks.harness.procs import child_env, clone, run_timed
from benchmarks.harness.publish import bench_parser, outputs, publish
from benchmarks.harness.stopwatch import Timer
from trainyard.training.resume import LAST_CKPT, RESUME_ROOT

DOCS_KEY = "resume"


def _run(cmd: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, str]:
    seconds, proc = run_timed(cmd, cwd, env)
    return seconds, proc.stdout + proc.stderr


def _checkpoint_epoch(path: Path) -> int | None:
    """Epochs finished in a resume checkpoint (Lightning stores the 0-based epoch index of
    the epoch that ended), or None while it is absent or being replaced."""
    import torch

    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception:  # absent, or caught mid-rename
        return None
    return int(ckpt["epoch"]) + 1


def _kill_after(repo: Path, env: dict[str, str], epochs_done: int) -> float:
    """``dvc repro train``, SIGKILLed once its checkpoint holds ``epochs_done`` epochs."""
    clock = Timer()
    clock.start()
    log = repo / "killed.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            ["dvc", "repro", "train"],
            cwd=repo,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    seen: float | None = None
    deadline = time.monotonic() + 3600
    while True:
        if proc.poll() is not None:  # the clone is deleted on exit: show its log now
            raise SystemExit(
                f"training ended before epoch {epochs_done}:\n{log.read_text()[-3000:]}"
            )
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise SystemExit("no checkpoint within an hour")
        ckpts = list((repo / RESUME_ROOT).glob(f"*/{LAST_CKPT}"))
        if ckpts and ckpts[0].stat().st_mtime != seen:
            seen = ckpts[0].stat().st_mtime
            done = _checkpoint_epoch(ckpts[0])
            if done is not None and done >= epochs_done:
                break
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return clock.stop()


def _best(repo: Path) -> float:
    return float(json.loads((repo / "models/train.json").read_text())["best_val_acc"])


def measure(source: Path, work: Path, epochs: int, kill_after: int, limit: int | None) -> dict:
    """Steps 1-4 above, in a clone of ``source`` under ``work``: their seconds and best val/acc."""
    repo = work / "trainyard"
    clone(
        source, repo, {"train": {"max_epochs": epochs}, "data": {"limit": limit} if limit else {}}
    )
    env = child_env()
    _run(["dvc", "repro", "prepare"], repo, env)
    killed_s = _kill_after(repo, env, kill_after)
    resumed_s, out = _run(["dvc", "repro", "train"], repo, env)
    match = re.search(r"trainyard: resuming from epoch (\d+)", out)
    if not match:
        raise SystemExit(f"the rerun did not resume:\n{out[-3000:]}")
    resumed_best = _best(repo)
    full_s, _ = _run(["dvc", "repro", "-f", "train"], repo, env)
    return {
        "epochs": epochs,
        "killed_after_epochs": kill_after,
        "resumed_from_epoch": int(match.group(1)),
        "limit": limit,
        "killed_run_s": round(killed_s, 1),
        "resumed_rerun_s": round(resumed_s, 1),
        "uninterrupted_s": round(full_s, 1),
        "resumed_over_uninterrupted": round(resumed_s / full_s, 3),
        "epochs_left_share": round((epochs - kill_after) / epochs, 3),
        "saved_s": round(full_s - resumed_s, 1),
        "best_val_acc_resumed": resumed_best,
        "best_val_acc_uninterrupted": _best(repo),
        **cpu_facts(),
    }


def markdown(r: dict[str, Any]) -> str:
    """The "Resume after a SIGKILL" section of docs/benchmarks.md."""
    data = f"{r['limit']:,} images" if r["limit"] else "full Fashion-MNIST"
    return "\n".join(
        [
            f"## Resume after a SIGKILL ({r['cpu']}, {r['cores']} cores)",
            "",
            f"`make bench-resume`: {data}, {r['epochs']} epochs, `dvc repro train` SIGKILLed"
            f" once the resume checkpoint held epoch {r['killed_after_epochs']}, then rerun.",
            "",
            "| run | seconds |",
            "|---|---:|",
            f"| killed run (until the SIGKILL) | {r['killed_run_s']:,.1f} |",
            f"| resumed rerun (from epoch {r['resumed_from_epoch']})"
            f" | {r['resumed_rerun_s']:,.1f} |",
            f"| uninterrupted run, from scratch | {r['uninterrupted_s']:,.1f} |",
            "",
            f"Resumed / uninterrupted: **{r['resumed_over_uninterrupted']:.2f}** (epochs left:"
            f" {r['epochs_left_share']:.2f}), "
            f"{r['saved_s']:,.1f} s saved. Best val/acc: resumed {r['best_val_acc_resumed']:.4f},"
            f" uninterrupted {r['best_val_acc_uninterrupted']:.4f}.",
        ]
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """``python -m benchmarks.bench_resume``: measure, print, write the JSON and docs section."""
    parser = bench_parser("benchmarks.bench_resume", __doc__ or "", "bench-resume", repo=True)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--kill-after", type=int, default=2, help="epochs done at the SIGKILL")
    parser.add_argument("--limit", type=int, default=None, help="data.limit (default: all)")
    args = parser.parse_args(argv)
    if not 0 < args.kill_after < args.epochs:
        parser.error("--kill-after must be between 0 and --epochs, exclusive")
    with tempfile.TemporaryDirectory(prefix="trainyard-bench-resume-") as work:
        result = measure(
            Path(args.repo).resolve(), Path(work), args.epochs, args.kill_after, args.limit
        )
    publish(
        result, markdown(result), *outputs("bench-resume", args.out, args.docs, False), DOCS_KEY
    )
    return result


if __name__ == "__main__":
    main()
