"""Benchmark: bulk scoring (``trainyard predict``) vs what a user writes instead, one run.

    python -m benchmarks.bench_predict                    # make bench-predict: 10,000 JPEGs
    python -m benchmarks.bench_predict --count 2000       # a smaller folder
    python -m benchmarks.bench_predict --million 0        # without the memory check
    python -m benchmarks.bench_predict --sides 2000,4000 --count 300   # phone-size photos
    python -m benchmarks.bench_predict --quick            # seconds; what the tests run

On one folder of real-photo JPEGs (``benchmarks.predict_inputs``: random crops and scales of
the photographs this machine's packages ship, 200-640 px sides, JPEG quality 85-95, 10 class
folders; made once under the temp dir and reused) and one model (``--model``, default the
default fine-tune's network: EfficientNet-Lite0 at 160x160 RGB, built and exported by
trainyard's code without training), side by side:

1. **trainyard predict**: ``python -m trainyard.bulk FOLDER --out F.parquet --model M`` as a
   subprocess with params.yaml's ``predict`` defaults (batch 64 on a CPU, one decode worker
   per core); img/s from its summary (``speed.img_per_s``: the scoring, after start-up)
   and the process's wall time (start-up, listing and the final table included);
2. **a plain loop**, in this process: for each file ``Image.open``, ``.convert(mode)``,
   ``.resize((W, H))``, normalised by the card's mean/std, ``session.run`` on a batch of one
   (an ``onnxruntime.InferenceSession`` with default options, CPU provider);
3. **posting every file to the service**: ``bentoml serve bento.service:ImageClassifier``
   with params.yaml as it is (``make serve``'s configuration) and ``TRAINYARD_MODEL`` = M,
   then a client loop posting each file to /classify (multipart ``image``, one keep-alive
   connection, one request at a time); and the same from ``--threads`` client threads.

Then (4) the probabilities check: ``--check`` files spread over the folder, scored by
``python -m trainyard.bulk`` (a list file, ``--top-k`` = the model's class count) and by
the service (``?top_k=`` the same): the largest absolute difference between the two
probability vectors (limit 1e-6). And (5), ``--million N`` (default 200,000; 0 skips it),
memory: N 28x28 PNGs
scored by ``python -m trainyard.bulk`` with the small cnn while the RSS of its process tree
(the command, its forkserver and decode workers) is sampled every 0.5 s: start, peak and
growth (target: peak <= start + 1 GiB, flat).

Targets (printed, not asserted): predict / plain loop >= 4x, predict / posting >= 3x (the
sequential client). Writes reports/bench-predict.json and the "Bulk scoring" section of
docs/benchmarks.md (``--quick``: reports/bench-predict-quick.json, docs only with
``--docs``). Never imports torch (the models are exported in a child process).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.harness.host_facts import cpu_facts
from benchmarks.harness.made_once import warm_cache
from benchmarks.harness.publish import bench_parser, outputs, provenance, publish, update_docs
from benchmarks.harness.stopwatch import Timer
from benchmarks.predict_check import bulk_probabilities, check_files, compare, run_check
from benchmarks.predict_contenders import (
    SAMPLE_S,
    costs,
    log,
    memory_run,
    model_card,
    plain_loop,
    predict_row,
    run_predict,
    service_rows,
)
from benchmarks.predict_inputs import (
    MODELS,
    REPO,
    ensure_fashion,
    ensure_models,
    ensure_photos,
    ensure_tiny,
)
from benchmarks.predict_report import (
    PROB_LIMIT,
    markdown,
    memory_target,
    model_name,
    print_summary,
    ratios_of,
    seconds_or_dash,
    targets,
)

MODULE = "benchmarks.bench_predict"
DOCS_KEY = "predict"
FULL = {
    "count": 10_000,
    "models": "lite0-160,cnn-64",
    "threads": 8,
    "check": 50,
    "million": 200_000,
    "cost_seconds": 1.5,
    "fashion": 20_000,
    "repeat": 3,
}
QUICK = {
    "count": 40,
    "models": "cnn-64",
    "threads": 4,
    "check": 12,
    "million": 400,
    "cost_seconds": 0.2,
    "fashion": 200,
    "repeat": 1,
}
MILLION_MODEL = "cnn-28"
# ----------------------------------------------------------------------------- the run


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = bench_parser(MODULE, __doc__ or "", "bench-predict")
    p.add_argument("--count", type=int, help=f"JPEGs in the folder (default {FULL['count']:,})")
    p.add_argument(
        "--models",
        help=f"comma-separated, the models the JPEGs are scored with, each by every "
        f"contender: {', '.join(MODELS)} (default {FULL['models']})",
    )
    p.add_argument(
        "--threads", type=int, help="client threads for the concurrent posting; 1: skip it"
    )
    p.add_argument("--check", type=int, help="files in the probabilities check (default 50)")
    p.add_argument(
        "--million",
        type=int,
        metavar="N",
        help="the memory check: score N 28x28 PNGs with the small cnn, sampling RSS "
        "(default 200,000: about 1 min, 0.8 GB of small files in the temp dir; 0: skip)",
    )
    p.add_argument(
        "--fashion",
        type=int,
        metavar="N",
        help="small images: N Fashion-MNIST 28x28 PNGs scored by `trainyard predict` and the "
        "plain loop with models/model.onnx (`make run`'s; else the built cnn 1x28x28); "
        "default 20,000, 0: skip",
    )
    p.add_argument(
        "--repeat",
        type=int,
        metavar="N",
        help="the small images' contenders side by side N times, each time's ratios and their "
        f"spread reported (default {FULL['repeat']}; --quick {QUICK['repeat']})",
    )
    p.add_argument(
        "--sides",
        default="200,640",
        metavar="MIN,MAX",
        help="px range of each side of the JPEGs (default 200,640; 2000,4000: phone photos)",
    )
    p.add_argument("--cost-seconds", type=float, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="seconds: 40 JPEGs, small cnn, 400 PNGs")
    p.add_argument("--work", help="folder for the images, models and outputs (default: temp dir)")
    p.add_argument("--render", action="store_true", help="only rewrite the docs from --out")
    p.add_argument("--build-model", nargs="+", metavar="KIND=PATH", help=argparse.SUPPRESS)
    return _settled(p, p.parse_args(argv))


def _settled(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with --quick's or the full run's defaults filled in, --models and --sides
    parsed and checked (``p.error`` on a bad one)."""
    base = QUICK if args.quick else FULL
    for key, value in base.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown or not args.models:
        p.error(f"--models: {', '.join(unknown) or 'none'}; choose from {', '.join(MODELS)}")
    try:
        low, high = (int(v) for v in args.sides.split(","))
    except ValueError:
        low = high = 0
    if not 16 <= low <= high:
        p.error("--sides: MIN,MAX px with 16 <= MIN <= MAX")
    args.sides = (low, high)
    if args.count < 10:
        p.error("--count must be at least 10 (one per class folder)")
    return args


def machine() -> dict[str, Any]:
    """The CPU, Pillow's and ONNX Runtime's versions and the load average."""
    import onnxruntime as ort
    from PIL import __version__ as pillow

    versions = {"pillow": pillow, "onnxruntime": ort.__version__}
    return cpu_facts() | versions | {"loadavg_start": list(os.getloadavg())}


def measure_model(
    entry: dict[str, Any], files: list[Path], photos: Path, args: argparse.Namespace, tmp: Path
) -> dict[str, Any]:
    """Every contender on the folder with one model, then the probabilities check."""
    model = Path(entry["path"])
    info = entry["info"]
    card = model_card(model)
    classes = list(card.classes)
    check = check_files(len(files), args.check)
    log(f"== {info['arch']} {info['input']} ({info['weights']})")

    log(f"1. trainyard predict: python -m trainyard.bulk on {len(files):,} JPEGs")
    run = run_predict(photos, tmp / f"{info['kind']}.parquet", model)
    rows = {"predict": predict_row(run, len(files))}
    r = rows["predict"]
    log(
        f"   {r['img_per_s']:8.1f} img/s ({r['seconds']:.1f} s scoring, {r['wall_s']:.1f} s "
        f"wall: {r['wall_img_per_s']:.1f} img/s), batch {r['batch_size']}, {r['workers']} "
        f"decode workers; {r['verdict']}"
    )
    log(f"4. the check files: python -m trainyard.bulk on {len(check)}, --top-k {len(classes)}")
    checked = run_check(files, check, model, len(classes), tmp / info["kind"])

    log("2. a plain loop: PIL open/convert/resize, ONNX Runtime at batch 1")
    plain = plain_loop(files, model, card, set(check))
    rows["plain loop"] = plain["row"]
    log(f"   {plain['row']['img_per_s']:8.1f} img/s")
    log("   what one image costs here, each part alone (in this process)")
    cost = costs(files, model, card, args.cost_seconds)
    _log_costs(cost)

    service = service_rows(model, files, args.threads, check, len(classes), tmp)
    rows["posting, sequential"] = service["sequential"]
    if "threads" in service:
        rows[f"posting, {args.threads} threads"] = service["threads"]
    bulk = bulk_probabilities(checked["table"], classes)
    agreement = compare(files, check, bulk, service["answers"], plain["probabilities"])
    log(
        f"4. probabilities, {agreement['files']} files: bulk table vs /classify max |diff| "
        f"{agreement['max_abs_diff']:.2e} (limit {PROB_LIMIT:g}); top-1 agrees on "
        f"{agreement['top1_agree']}, the plain loop's on {agreement['plain_loop_top1_agree']}"
    )
    return {
        "model": info | {"reused": entry["reused"]},
        "service_ready_s": service["ready_s"],
        "rows": rows,
        "ratios": ratios_of(rows),
        "costs": cost,
        "ceiling_ratios": {
            name: cost["ceiling_img_per_s"] / row["img_per_s"]
            for name, row in rows.items()
            if name != "predict"
        },
        "check": agreement,
    }


def _log_costs(cost: dict[str, Any]) -> None:
    """What one image costs, each part alone: the line under the plain loop's."""
    log(
        f"   decode: predict's {cost['decode_ms']:.2f} ms, the plain loop's PIL calls "
        f"{cost['plain_decode_ms']:.2f} ms; ONNX Runtime batch 64: {cost['infer_b64_ms']:.2f} "
        f"ms/img ({cost['infer_b64_1thread_ms']:.2f} on one thread), batch 1 (default "
        f"options) {cost['infer_b1_default_ms']:.2f} ms; predict's ceiling on "
        f"{cost['cores']} cores {cost['ceiling_img_per_s']:.0f} img/s"
    )


def measure(args: argparse.Namespace, work: Path, tmp: Path) -> dict[str, Any]:
    """Every part of the run; what the result records."""
    small = [MILLION_MODEL] if args.million or args.fashion else []
    kinds = list(dict.fromkeys(args.models + small))
    models = ensure_models(work, kinds, MODULE, log)
    dataset = ensure_photos(work, args.count, args.seed, log, args.sides)
    photos = Path(dataset["folder"])
    files = sorted(photos.rglob("*.jpg"))
    if len(files) != args.count:
        raise SystemExit(f"bench-predict: {len(files)} JPEGs in {photos}, expected {args.count}")
    warm_cache(photos)
    runs = [measure_model(models[kind], files, photos, args, tmp) for kind in args.models]

    memory = None
    if args.million:
        tiny = ensure_tiny(work, args.million, args.seed, log)
        warm_cache(Path(tiny["folder"]))
        log(f"5. memory: python -m trainyard.bulk on {args.million:,} PNGs, RSS every {SAMPLE_S} s")
        memory = memory_run(
            Path(tiny["folder"]), args.million, Path(models[MILLION_MODEL]["path"]), tmp
        )
        memory["dataset"] = {k: v for k, v in tiny.items() if k != "folder"}
        memory["model"] = models[MILLION_MODEL]["info"]
        log(
            f"   start {memory['start_rss'] / 2**20:,.0f} MiB, peak "
            f"{memory['peak_rss'] / 2**20:,.0f} MiB (+{memory['growth_rss'] / 2**20:,.0f} MiB), "
            f"{memory['img_per_s']:,.0f} img/s"
        )
    small = measure_fashion(work, args.fashion, models, tmp, args.repeat) if args.fashion else None
    for run in runs:
        run["targets"] = targets(run)
    if memory:
        memory["target"] = memory_target(memory)
    return {
        "dataset": {k: v for k, v in dataset.items() if k != "folder"},
        "runs": runs,
        "memory": memory,
        "fashion": small,
    }


def measure_fashion(
    work: Path, count: int, models: dict[str, Any], tmp: Path, repeat: int = 1
) -> dict[str, Any] | None:
    """Small images: ``trainyard predict`` (the console script, the whole command), ``python
    -m trainyard.bulk`` and the plain loop on ``count`` Fashion-MNIST PNGs, one after the
    other, ``repeat`` times (a shared machine: the spread of the ratios says how far one
    run can be trusted), with the Fashion model of `make run` where it is there."""
    made = ensure_fashion(work, count, log)
    if not made:
        log("6. small images: skipped (no Fashion-MNIST under /usr/share/datasets)")
        return None
    folder = Path(made["folder"])
    files = sorted(folder.rglob("*.png"))
    local = REPO / "models" / "model.onnx"
    if local.is_file() and local.with_name("model.onnx.sha256").is_file():
        model, about = local, "models/model.onnx (`make run`'s Fashion-MNIST model)"
    else:
        model = Path(models[MILLION_MODEL]["path"])
        about = f"the built {model_name(models[MILLION_MODEL]['info'])} (no models/model.onnx)"
    warm_cache(folder)
    log(f"6. small images: trainyard predict on {len(files):,} Fashion-MNIST PNGs, {about}")
    reps = []
    for rep in range(repeat):  # each repetition: the three side by side, ratios of its own
        cli = run_predict(folder, tmp / "fashion.parquet", model, cli=True)
        row = predict_row(cli, len(files))
        bulk = predict_row(run_predict(folder, tmp / "fashion-bulk.parquet", model), len(files))
        plain = plain_loop(files, model, model_card(model), set())["row"]
        rows = {"predict": row, "python -m trainyard.bulk": bulk, "plain loop": plain}
        reps.append({"rows": rows, "ratios": _small_ratios(rows)})
        ratios = reps[-1]["ratios"]
        log(
            f"   {rep + 1}/{repeat}: predict {row['wall_s']:.1f} s whole command "
            f"({row['img_per_s']:,.0f} img/s scoring, first row at "
            f"{seconds_or_dash(row['first_row_s'])}; "
            f"{row['place']}); python -m trainyard.bulk {bulk['wall_s']:.1f} s; plain loop "
            f"{plain['seconds']:.1f} s ({plain['img_per_s']:,.0f} img/s): plain / predict "
            f"{ratios['whole command']:.2f}x whole command, {ratios['scoring']:.2f}x scoring"
        )
    # The rows shown are the repetition with the median whole-command ratio.
    middle = sorted(reps, key=lambda r: r["ratios"]["whole command"])[len(reps) // 2]
    return {
        "dataset": {k: v for k, v in made.items() if k != "folder"},
        "model": about,
        "rows": middle["rows"],
        "ratios": middle["ratios"],
        "repeats": [r["ratios"] for r in reps],
    }


def _small_ratios(rows: dict[str, Any]) -> dict[str, float]:
    plain, row, bulk = rows["plain loop"], rows["predict"], rows["python -m trainyard.bulk"]
    return {
        "whole command": plain["seconds"] / row["wall_s"],
        "scoring": row["img_per_s"] / plain["img_per_s"],
        "python -m trainyard.bulk, whole command": plain["seconds"] / bulk["wall_s"],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """``python -m benchmarks.bench_predict``: the run, its JSON and docs section; returns
    the result (``--render``: only the docs section, from the JSON)."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    out, docs = outputs("bench-predict", args.out, args.docs, args.quick)
    if args.build_model:
        from benchmarks.predict_inputs import build_model
        from trainyard.core.config import load_params

        opset = load_params(REPO / "params.yaml").export.opset
        for spec in args.build_model:
            kind, path = spec.split("=", 1)
            print(json.dumps(build_model(kind, Path(path), opset)), flush=True)
        return {}
    if args.render:
        result = json.loads(out.read_text())
        if docs:
            update_docs(Path(docs), DOCS_KEY, markdown(result))
        print_summary(result)
        return result  # type: ignore[no-any-return]
    from trainyard.core.config import load_params

    work = Path(args.work or Path(tempfile.gettempdir()) / "trainyard-bench-predict")
    work.mkdir(parents=True, exist_ok=True)
    hw = machine()
    log(f"bench-predict: {hw['cpu']}, {hw['cores']} cores, load {hw['loadavg_start'][0]:.2f}")
    with Timer() as clock, tempfile.TemporaryDirectory(prefix="bench-predict-", dir=work) as tmp:
        measured = measure(args, work, Path(tmp))
    hw["loadavg_end"] = list(os.getloadavg())
    result = {
        **provenance(MODULE, argv, "%Y-%m-%d %H:%M"),  # date, command, commit
        "machine": hw,
        "wall_s": round(clock.seconds, 1),
        "work": str(work),
        "service": {
            "params": "params.yaml",
            "workers": load_params(REPO / "params.yaml").serve.workers,
        },
        **measured,
    }
    publish(result, markdown(result), out, docs, DOCS_KEY, lambda m: log(f"bench-predict: {m}"))
    print_summary(result)
    return result


if __name__ == "__main__":
    main()
