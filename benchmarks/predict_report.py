"""`make bench-predict`'s report: targets and verdicts, the tables, the docs section
("Bulk scoring", between the ``bench:predict`` markers) and the console summary. Works
from the result JSON alone (``python -m benchmarks.bench_predict --render``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

TARGETS = {"plain loop": 4.0, "posting, sequential": 3.0}  # predict's img/s over theirs
SMALL_TARGET = 1.5  # small images: the plain loop's seconds over predict's whole command
FIRST_ROW_S = 2.0  # start-up to the first row scored
PROB_LIMIT = 1e-6
GROWTH_LIMIT = 2**30  # bytes: peak RSS of predict's process tree over its start of scoring
WALL = " (predict's wall time)"  # the ratios on predict's whole process time
PREDICT = "predict"


def ratios_of(rows: dict[str, dict[str, Any]]) -> dict[str, float]:
    """predict's img/s over each other contender's; then the same on predict's wall time."""
    mine = rows[PREDICT]
    others = {k: v for k, v in rows.items() if k != PREDICT}
    out = {k: mine["img_per_s"] / v["img_per_s"] for k, v in others.items()}
    out |= {k + WALL: mine["wall_img_per_s"] / v["img_per_s"] for k, v in others.items()}
    return out


def _target(target: str, measured: str, met: bool, ceiling: str = "-") -> dict[str, Any]:
    """One row of the targets table: {target, measured, ceiling (the most here), met}."""
    return {"target": target, "measured": measured, "ceiling": ceiling, "met": met}


def targets(run: dict[str, Any]) -> list[dict[str, Any]]:
    """One model's targets: predict's ratios over the contenders, the probabilities check."""
    out = []
    ceiling = run.get("ceiling_ratios", {})
    for name, want in TARGETS.items():
        got = run["ratios"].get(name)
        if got is not None:
            best = f"{ceiling[name]:.2f}x" if name in ceiling else "-"
            out.append(_target(f"predict / {name} >= {want:g}x", f"{got:.2f}x", got >= want, best))
    c = run["check"]
    prob = f"max abs probability diff vs /classify <= {PROB_LIMIT:g}"
    return [*out, _target(prob, f"{c['max_abs_diff']:.1e}", c["within"])]


def memory_target(memory: dict[str, Any]) -> dict[str, Any]:
    """The memory check's target: peak RSS of predict's tree within 1 GiB of its start."""
    growth = f"{memory['growth_rss'] / 2**20:+,.0f} MiB"
    return _target("peak RSS <= start + 1 GiB", growth, memory["within"])


def small_targets(small: dict[str, Any]) -> list[dict[str, Any]]:
    """The small-image workload's targets: the whole command against the plain loop, and
    the start-up to the first row."""
    whole = small["ratios"]["whole command"]
    first = small["rows"][PREDICT].get("first_row_s")
    return [
        _target(
            f"predict (whole command) / plain loop >= {SMALL_TARGET:g}x",
            f"{whole:.2f}x",
            whole >= SMALL_TARGET,
        ),
        _target(
            f"start-up to the first row scored <= {FIRST_ROW_S:g} s",
            "-" if first is None else f"{first:.2f} s",
            first is not None and first <= FIRST_ROW_S,
        ),
    ]


def all_targets(result: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(model, target) for every model's targets, then the small images', then the memory
    check's."""
    out = [(model_name(r["model"]), t) for r in result["runs"] for t in targets(r)]
    small = result.get("fashion")
    if small:
        out += [(f"Fashion-MNIST PNGs, {small['model']}", t) for t in small_targets(small)]
    m = result.get("memory")
    if m:
        out.append((f"{model_name(m['model'])} (`--million`)", memory_target(m)))
    return out


def model_name(info: dict[str, Any]) -> str:
    return f"{info['arch']} {info['input']}"


def table(runs: list[dict[str, Any]]) -> str:
    """Every contender of every model: images, seconds, img/s, and predict's ratio."""
    lines = [
        "| model | contender | images | seconds | img/s | predict's img/s is | load average |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for run in runs:
        name = model_name(run["model"])
        for who, row in run["rows"].items():
            if who == PREDICT:
                label = "trainyard predict (defaults)"
                secs = f"{row['seconds']:.1f} (wall {row['wall_s']:.1f})"
                ratio = "1.00x"
            else:
                label, secs = who, f"{row['seconds']:.1f}"
                ratio = f"**{run['ratios'][who]:.2f}x**"
            load = row.get("loadavg")
            load_text = f"{load[0]:.2f} -> {load[1]:.2f}" if load else "-"
            lines.append(
                f"| {name} | {label} | {row['images']:,} | {secs} | {row['img_per_s']:,.1f} "
                f"| {ratio} | {load_text} |"
            )
    return "\n".join(lines)


def _where(p: dict[str, Any]) -> str:
    """Where predict's time went: scored in its workers (a CPU), or batched in its process."""
    if p.get("inference_share") is None:
        return (
            f"predict scored in its {p['workers']} decode workers, one ONNX Runtime thread "
            f"each, {p['batch_size']} image(s) a call"
        )
    return (
        f"predict waited on decode {p['decode_wait_share']:.0%} of its scoring time and ran "
        f"ONNX Runtime {p['inference_share']:.0%}"
    )


def _costs(run: dict[str, Any]) -> str:
    k, p = run["costs"], run["rows"][PREDICT]
    ceil = ", ".join(f"{v:.2f}x {n}" for n, v in run["ceiling_ratios"].items())
    return (
        f"{model_name(run['model'])}: {_where(p)} ({p['verdict']}). "
        f"Each part alone (in the benchmark's process, on {k['files']} of the files): "
        f"predict's decode (`decode_image`: JPEG draft, box reduce) {k['decode_ms']:.2f} ms "
        f"per image, the plain loop's PIL calls {k['plain_decode_ms']:.2f} ms; ONNX Runtime "
        f"on one intra-op thread {k.get('infer_b1_1thread_ms', float('nan')):.2f} ms per "
        f"image at batch 1 and {k['infer_b64_1thread_ms']:.2f} ms at batch 64 "
        f"({k['infer_b64_ms']:.2f} ms at batch 64 with one thread per core), the plain "
        f"loop's session at batch 1 {k['infer_b1_default_ms']:.2f} ms. Sharing the "
        f"{k['cores']} cores perfectly, predict would score {k['cores']} / "
        f"({k['decode_ms']:.2f} + {k.get('infer_1thread_ms', k['infer_b64_1thread_ms']):.2f} "
        "ms) = "
        f"**{k['ceiling_img_per_s']:,.0f} img/s** ({ceil}): the most any scorer of this "
        "model can gain here."
    )


def _check(run: dict[str, Any]) -> str:
    c = run["check"]
    return (
        f"{model_name(run['model'])}: max abs diff **{c['max_abs_diff']:.1e}** (mean of the "
        f"per-file maxima {c['mean_max_abs_diff']:.1e}; limit {c['limit']:g}), top-1 the "
        f"same on {c['top1_agree']} of {c['files']}; the plain loop (its own resize) picks "
        f"the service's top-1 on {c['plain_loop_top1_agree']} of {c['files']}."
    )


def _small(small: dict[str, Any] | None) -> list[str]:
    """The small-image workload: the whole command and the plain loop, side by side."""
    if not small:
        return []
    ds, mine, plain = small["dataset"], small["rows"][PREDICT], small["rows"]["plain loop"]
    made = "reused" if ds.get("reused") else f"made in {ds['generation_s']:.0f} s"
    return [
        f"Small images (`--fashion {ds['images']}`): {ds['images']:,} Fashion-MNIST 28x28 "
        f"PNGs ({ds['content']}: the test set's 10,000, then the training set's; "
        f"{ds['bytes'] / 2**20:,.0f} MiB, {made}) in class folders, scored with "
        f"{small['model']}. **trainyard predict** = the console script `trainyard predict "
        "FOLDER --out F.parquet --model M --no-track` (the whole command, start-up included; "
        "no MLflow run, which would write into the repository's tracking store); **the "
        "plain loop** as above, in the benchmark's process, one after the other.",
        "",
        "| contender | images | seconds | img/s | first row scored | where it scored |",
        "|---|---:|---:|---:|---:|---|",
        _whole_row("trainyard predict, whole command", mine),
        *_bulk_row(small["rows"].get("python -m trainyard.bulk")),
        f"| plain loop | {plain['images']:,} | {plain['seconds']:.1f} | "
        f"{plain['img_per_s']:,.0f} | - | one process |",
        "",
        f"The whole command against the plain loop: **{small['ratios']['whole command']:.2f}x**"
        f"; its scoring part alone: {small['ratios']['scoring']:.2f}x"
        + _bulk_ratio(small["ratios"].get("python -m trainyard.bulk, whole command"))
        + _repeats(small.get("repeats", []))
        + ". The time outside the scoring is start-up (the first row's time: Python, NumPy, "
        "ONNX Runtime, PyArrow and Pillow, and the probes that choose where to score) and "
        "the final table; the console script imports no command's library before its own "
        "(tests/house/test_cli.py).",
        "",
    ]


def _repeats(repeats: list[dict[str, float]]) -> str:
    """The whole command's ratio in each side-by-side run, when there were several."""
    if len(repeats) < 2:
        return ""
    each = ", ".join(f"{r['whole command']:.2f}x" for r in repeats)
    return (
        f" (whole command in each of {len(repeats)} runs side by side: {each}; the table "
        "is the median run)"
    )


def _bulk_row(row: dict[str, Any] | None) -> list[str]:
    """``python -m trainyard.bulk`` on the same files, when it was measured."""
    return [_whole_row("python -m trainyard.bulk, whole command", row)] if row else []


def _whole_row(label: str, row: dict[str, Any]) -> str:
    """A whole command's row of the small-images table: wall and scoring time, img/s."""
    return (
        f"| {label} | {row['images']:,} | {row['wall_s']:.1f} (scoring {row['seconds']:.1f}) | "
        f"{row['wall_img_per_s']:,.0f} (scoring {row['img_per_s']:,.0f}) | "
        f"{seconds_or_dash(row.get('first_row_s'))} | {row.get('place') or row.get('scoring')} |"
    )


def _bulk_ratio(value: float | None) -> str:
    return "" if value is None else f"; `python -m trainyard.bulk`, whole command: **{value:.2f}x**"


def seconds_or_dash(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def _memory(m: dict[str, Any] | None) -> list[str]:
    if not m:
        return [
            "Memory: not measured in this run (`--million 0`; `--million N` scores N "
            "generated 28x28 PNGs while sampling the RSS of predict's process tree).",
            "",
        ]
    ds, info = m["dataset"], m["model"]
    made = "reused" if ds.get("reused") else f"made in {ds['generation_s']:.0f} s"
    points = m["curve"][:: max(1, len(m["curve"]) // 12)] + m["curve"][-1:]
    curve = ", ".join(f"{t:g}: {v:,.0f}" for t, v in points)
    return [
        f"Memory (`--million {m['images']}`): {m['images']:,} {ds['size_px']}x{ds['size_px']} "
        f"greyscale PNGs ({ds['content']}; {ds['bytes'] / 2**20:,.0f} MiB, {made}), "
        "scored by `python -m trainyard.bulk --workers N` (N: one decode worker per core; "
        "`auto` would score such small images in its own process) with "
        f"{model_name(info)} at "
        f"{m['img_per_s']:,.0f} img/s ({m['seconds']:.0f} s scoring, {m['wall_s']:.0f} s "
        f"wall). The RSS of its process tree (the command, its forkserver and decode "
        f"workers: {m['processes']} processes, summed: shared pages count in each) every "
        f"{m['sample_every_s']} s: start of scoring **{m['start_rss'] / 2**20:,.0f} MiB**, "
        f"peak **{m['peak_rss'] / 2**20:,.0f} MiB**, growth "
        f"**{m['growth_rss'] / 2**20:+,.0f} MiB** (limit +1,024 MiB); from a quarter of the "
        f"scoring to its end {m['late_growth_rss'] / 2**20:+,.0f} MiB. Proportional (PSS) "
        f"peak {m['peak_pss'] / 2**20:,.0f} MiB; the command's own process "
        f"{m['main_start_rss'] / 2**20:,.0f} -> {m['main_peak_rss'] / 2**20:,.0f} MiB. The "
        f"tree's RSS over time (s: MiB): {curve}.",
        "",
    ]


def _intro(result: dict[str, Any]) -> list[str]:
    """The section's heading and what was measured: the machine, the folder, the models
    and the contenders."""
    hw, ds, runs = result["machine"], result["dataset"], result["runs"]
    sources = ", ".join(Path(s["path"]).name for s in ds.get("sources", []))
    first = runs[0]["rows"][PREDICT]
    made = "reused" if ds.get("reused") else f"made in {ds['generation_s']:.0f} s"
    return [
        "## Bulk scoring: `trainyard predict` vs a plain loop vs posting to the service",
        "",
        f"`{result['command']}` on {result['date']} (commit {result['commit']}): "
        f"{hw['cpu']}, {hw['cores']} cores ({hw['cores_usable']} usable), load average "
        f"{hw['loadavg_start'][0]:.2f} at the start and {hw['loadavg_end'][0]:.2f} at the end "
        "(1 minute; the benchmark's own processes count in it: above 2, other work on this "
        "shared machine competed for its cores, so read the ratios, measured side by side "
        f"in one run, rather than the times); Python {hw['python']}, "
        f"Pillow {hw['pillow']}, ONNX "
        f"Runtime {hw['onnxruntime']} (CPU); {result['wall_s']:.0f} s in all. "
        "`make bench-predict` runs it (`BENCH_PREDICT_ARGS`).",
        "",
        f"The folder: {ds['images']:,} JPEGs of real photographs "
        f"({ds['bytes'] / 2**20:,.0f} MiB, {made}): random crops and scales of "
        f"{sources or 'the sample photos'} (the photos scikit-learn's `load_sample_images` "
        "and matplotlib ship, and any JPEG of 20 kB+ under /usr/share), each side uniform in "
        f"{ds['sides_px'][0]}-{ds['sides_px'][1]} px, JPEG quality {ds['jpeg_quality'][0]}-"
        f"{ds['jpeg_quality'][1]}, in 10 class folders, seeded, made once under the temp "
        "dir. Every file was read once before the runs (page cache warm for all).",
        "",
        "The models, built by trainyard's `Classifier` and exported by its export code with "
        "the `.sha256` the service checks (no training: speed and agreement are measured, "
        "not accuracy): "
        + "; ".join(
            f"{model_name(r['model'])} ({r['model']['classes']} classes, resize "
            f"`{r['model']['resize']}`, {r['model']['weights']})"
            for r in runs
        )
        + ".",
        "",
        "The contenders: **trainyard predict** = `python -m trainyard.bulk FOLDER --out "
        "F.parquet --model M` as a subprocess with params.yaml's defaults (batch "
        f"{first['batch_size']}, {first['workers']} decode workers); img/s from its summary "
        "(`speed.img_per_s`, the scoring), its wall time includes start-up, listing and "
        "writing the table. **A plain loop** = in one process, per file `Image.open(f)"
        ".convert(mode).resize((W, H))`, normalised by the card's mean/std, `session.run` "
        "at batch 1 (an `InferenceSession` with default options). **Posting** = `bentoml "
        f"serve` with params.yaml as it is (`make serve`: serve.workers "
        f"{result['service']['workers']}, batching off) and `TRAINYARD_MODEL` = the model, "
        "a client posting each file to /classify (multipart, one keep-alive `http.client` "
        "connection per client thread, each waiting for its answer). Load average: the "
        "1-minute figure before -> after each contender (the contender's own processes count "
        "in it; more is other work on this shared machine, which slows whoever runs then).",
        "",
    ]


def markdown(result: dict[str, Any]) -> str:
    """The "Bulk scoring" section of docs/benchmarks.md."""
    runs = result["runs"]
    lines = [
        *_intro(result),
        table(runs),
        "",
        "On predict's wall time instead of its scoring time: "
        + "; ".join(
            f"{model_name(r['model'])}: "
            + ", ".join(
                f"{k.removesuffix(WALL)} {v:.2f}x"
                for k, v in r["ratios"].items()
                if k.endswith(WALL)
            )
            + f" (wall {r['rows'][PREDICT]['wall_s']:.1f} s)"
            for r in runs
        )
        + ".",
        "",
        "Where the time went:",
        "",
        *[f"- {_costs(r)}" for r in runs],
        "",
        "Probabilities: on files spread over the folder, predict's table (`--top-k` = the "
        "class count, so every probability) against /classify's `probabilities` for the same "
        "file:",
        "",
        *[f"- {_check(r)}" for r in runs],
        "",
        *_small(result.get("fashion")),
        *_memory(result.get("memory")),
        "| model | target | measured | ceiling here | |",
        "|---|---|---:|---:|---|",
    ]
    for name, t in all_targets(result):
        verdict = "met" if t["met"] else "**not met**"
        lines.append(f"| {name} | {t['target']} | {t['measured']} | {t['ceiling']} | {verdict} |")
    lines.append("")
    return "\n".join(lines)


def print_summary(result: dict[str, Any]) -> None:
    """The tables, the ratios and the verdicts, on the console."""
    print(f"\n{table(result['runs'])}\n")
    for run in result["runs"]:
        name = model_name(run["model"])
        for who, value in run["ratios"].items():
            print(f"{name}: predict / {who}: {value:.2f}x")
        first = seconds_or_dash(run["rows"][PREDICT].get("first_row_s"))
        print(f"{name}: predict's first row at {first}")
    small = result.get("fashion")
    if small:
        for who, value in small["ratios"].items():
            each = ", ".join(f"{r[who]:.2f}x" for r in small.get("repeats", []))
            print(
                f"Fashion-MNIST PNGs: predict's speed / the plain loop's, {who}: "
                f"{value:.2f}x (each run: {each})"
            )
    print()
    for name, t in all_targets(result):
        ceiling = f" (ceiling here {t['ceiling']})" if t["ceiling"] != "-" else ""
        verdict = "met" if t["met"] else "NOT MET"
        print(f"{name}: {t['target']}: {t['measured']} {verdict}{ceiling}")
