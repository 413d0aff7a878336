"""Benchmark: the labelling round trip on a real folder. Does fixing the labels a person
reviewed bring the retrained model back to the clean folder's accuracy?

    python -m benchmarks.bench_label                 # make bench-label: emoji, 10% flipped
    python -m benchmarks.bench_label --quick         # 12 images a class: about a minute

``benchmarks.audit_planted`` lays Google's emoji (``benchmarks.recipe_folders``, as
``make bench-audit``) out in train/val/test twice with the same seeded split: clean, and
with 10% of the labels flipped (no copies planted). Then, as a user does, each a fresh
process: ``trainyard audit`` on the flipped tree; ``trainyard label push`` of its label
suspects to a real Label Studio (``.venv-labelstudio``, a free loopback port); a scripted
reviewer answers every pushed task through the API with the image's true label (it reviews
only what was pushed, as a person would); ``trainyard label pull``.

The retraining is the smallest real one that still means something on 2 shared cores: the
frozen pretrained EfficientNet-Lite0 and a logistic regression on its pooled features
(``benchmarks.recipe_probe``'s probe, fitted on train + val as the folder files them),
scored on the same test images against their true labels; the three trees share one
embedding cache (the audit's), so each retrain is the fit alone. A fine-tune (``dvc exp
run``) would learn from the same labels; it is not what this measures.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from sklearn.linear_model import LogisticRegression

from benchmarks.audit_planted import planted_tree, read_suspects, score
from benchmarks.harness.host_facts import cpu_facts, load_facts
from benchmarks.harness.procs import child_env, free_port, run_timed
from benchmarks.harness.publish import REPO, bench_parser, outputs, provenance, publish
from benchmarks.recipe_folders import emoji_folder
from benchmarks.recipe_probe import MAX_ITER
from trainyard.core.config import load_params
from trainyard.review.label_files import MANIFEST
from trainyard.stages.label_audit import embed_folder
from trainyard.track import label_studio_server as server
from trainyard.track.label_studio import LabelStudio

DOCS_KEY = "label"
FLIP = 0.10
TOKEN = "bench-label-token"
PARAMS = REPO / "params.yaml"


def index_of(rel: str) -> str:
    """The file's number in the planted tree (``split/class/00042-name``): the same image in
    the clean tree, the flipped one and after the pull."""
    return Path(rel).name.split("-", 1)[0]


def retrain(tree: Path, cache: Path, truth: dict[str, str]) -> dict[str, Any]:
    """The probe fitted on ``tree``'s train + val labels, scored against the true labels."""
    got = embed_folder(load_params(PARAMS), tree, cache)
    splits = np.array([f.split for f in got.files], dtype=object)
    given = np.array([f.label for f in got.files])
    true = np.array([got.classes.index(truth[index_of(f.rel)]) for f in got.files])
    fit, test = splits != "test", splits == "test"
    start = time.perf_counter()
    clf = LogisticRegression(max_iter=MAX_ITER).fit(got.x[fit], given[fit])
    accuracy = float((clf.predict(got.x[test]) == true[test]).mean())
    return {
        "test_accuracy": round(accuracy, 4),
        "wrong_labels_trained_on": int((given[fit] != true[fit]).sum()),
        "fit_s": round(time.perf_counter() - start, 2),
        "test_images": int(test.sum()),
    }


def _files(root: Path) -> list[str]:
    return [p.relative_to(root).as_posix() for p in root.rglob("*") if not p.is_dir()]


def trainyard(*args: str, work: Path, what: str) -> tuple[float, str]:
    cmd = [sys.executable, "-m", "trainyard.cli", *args, "--params", str(PARAMS)]
    env = child_env() | {"LABEL_STUDIO_USER_TOKEN": TOKEN}
    seconds, proc = run_timed(cmd, cwd=work, env=env, what=what)
    print(f"{what}: {seconds:.1f} s", flush=True)
    return seconds, proc.stdout


def review(client: LabelStudio, title: str, truth: dict[str, str]) -> dict[str, int]:
    """The scripted reviewer: each pushed task answered with its image's true label."""
    project = client.project(title)
    assert project is not None, title
    tasks = list(client.tasks(project["id"]))
    for task in tasks:
        client.annotate(task["id"], truth[index_of(task["data"]["file"])])
    flips = sum(truth[index_of(t["data"]["file"])] != t["data"]["given_label"] for t in tasks)
    return {"reviewed": len(tasks), "flipped_among_them": flips}


def in_label_studio(
    work: Path, tree: Path, suspects: Path, truth: dict[str, str], venv: Path
) -> dict[str, Any]:
    """A real Label Studio on a free port: push, the scripted review, pull; then stopped."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = server.start(venv, port, work / "label-studio", TOKEN, log=work / "ls.log")
    seconds: dict[str, float] = {}
    try:
        started = time.perf_counter()
        server.wait_up(url, proc, timeout=600)
        seconds["label_studio_start"] = round(time.perf_counter() - started, 1)
        common = ("--url", url, "--project", "bench")
        push = ("label", "push", str(tree), *common, "--suspects", str(suspects), "--served", "0")
        seconds["push"] = trainyard(*push, work=work, what="trainyard label push")[0]
        started = time.perf_counter()
        reviewed = review(LabelStudio(url, TOKEN), "bench", truth)
        seconds["review"] = round(time.perf_counter() - started, 1)
        pull = ("label", "pull", str(tree), *common)
        seconds["pull"], text = trainyard(*pull, work=work, what="trainyard label pull")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    pulled = json.JSONDecoder().raw_decode(text)[0]
    return {"review": reviewed, "pull": pulled, "label_seconds": seconds}


def round_trip(work: Path, seed: int, per_class: int, venv: Path) -> dict[str, Any]:
    source = emoji_folder(work / "sources")
    clean = planted_tree(source, work / "clean", 0.0, 0, seed, per_class)
    flipped = planted_tree(source, work / "emoji", FLIP, 0, seed, per_class)
    truth = {index_of(rel): Path(rel).parent.name for rel in _files(clean.root)}
    cache, out = work / "cache", work / "audit"
    result: dict[str, Any] = {"images": flipped.images, "flipped": len(flipped.flipped)}
    audit = ("audit", str(flipped.root), "--out", str(out), "--cache", str(cache), "--no-track")
    result["seconds"] = {
        "audit": trainyard(*audit, work=work, what="trainyard audit (uncached)")[0]
    }
    found = score(flipped, read_suspects(out / "suspects.csv"))
    result["audit"] = {k: found[k] for k in ("precision_at_k", "recall_at_k")}
    labels = [r for r in read_suspects(out / "suspects.csv") if r["reason"] == "label"]
    result["label_suspects"] = len(labels)
    result["flips_among_suspects"] = sum(r["file"] in flipped.flipped for r in labels)
    result["before"] = {"clean": retrain(clean.root, cache, truth)}
    result["before"]["flipped"] = retrain(flipped.root, cache, truth)

    result |= in_label_studio(work, flipped.root, out / "suspects.csv", truth, venv)
    result["manifest_lines"] = len((flipped.root / MANIFEST).read_text().splitlines())
    result["after"] = retrain(flipped.root, cache, truth)
    return result


def table(r: dict[str, Any]) -> str:
    b, a = r["before"], r["after"]
    rows = [
        ("clean folder", b["clean"]),
        (f"{round(FLIP * 100)}% flipped", b["flipped"]),
        ("flipped, after audit -> push -> review -> pull", a),
    ]
    lines = [
        "| the model learnt from | wrong labels in train + val | test accuracy (true labels) |",
        "|---|---|---|",
    ]
    lines += [
        f"| {n} | {x['wrong_labels_trained_on']} | {x['test_accuracy']:.4f} |" for n, x in rows
    ]
    s = r["seconds"] | r["label_seconds"]
    gap = a["test_accuracy"] - b["clean"]["test_accuracy"]
    return "\n".join(lines) + (
        f"\n\n{r['images']} images, {r['flipped']} flipped; the audit listed "
        f"{r['label_suspects']} label suspects ({r['flips_among_suspects']} of the flips; "
        f"precision = recall of its first k = {r['flipped']}: {r['audit']['precision_at_k']}), all "
        f"pushed; the reviewer answered {r['review']['reviewed']} tasks; the pull moved "
        f"{r['pull']['moved']} files and kept {r['pull']['kept']} ({r['manifest_lines']} "
        f"manifest lines). After the round trip: {gap:+.4f} against the clean folder's "
        f"accuracy. Seconds: audit {s['audit']:.0f} (uncached), Label Studio's "
        f"first start {s['label_studio_start']:.0f}, push {s['push']:.1f}, scripted review "
        f"{s['review']:.1f}, pull {s['pull']:.1f}."
    )


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser("benchmarks.bench_label", __doc__ or "", "bench-label")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="12 images a class: a minute")
    parser.add_argument("--venv", default=str(REPO / ".venv-labelstudio"), help="label-studio's")
    parser.add_argument("--work", help="keep the trees, cache and server data here")
    args = parser.parse_args(argv)
    out, docs = outputs("bench-label", args.out, args.docs, args.quick)
    with tempfile.TemporaryDirectory(prefix="bench-label-") as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        r = round_trip(work, args.seed, 12 if args.quick else 0, Path(args.venv))
    facts = cpu_facts() | load_facts()
    run = provenance("benchmarks.bench_label", argv)
    header = (
        f"{run['date']}, `{run['command']}`, {facts.get('cores', '?')} cores (load "
        f"{facts['loadavg']:.1f} at the end: a shared machine), Google's emoji, the three rows "
        "in one run. Retraining: the frozen EfficientNet-Lite0 + logistic regression probe "
        "(train + val as filed, the test images scored against their true labels)."
    )
    text = f"## Labelling round trip\n\n{header}\n\n{table(r)}"
    result = {**run, "result": r, "host": facts}
    publish(result, text, out, docs, DOCS_KEY)


if __name__ == "__main__":
    main()
