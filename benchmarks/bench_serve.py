"""`make bench-serve`: the service under load on 127.0.0.1, side by side, in one run.

Every server is started on a free port and loaded by wrk (C, one thread, keep-alive); each
request is one image as a multipart ``image`` upload to ``/classify``. The parts, each a
subsection of docs/benchmarks.md's "Serving" that says what it loads and how: 0. the small
model in rounds, every ratio taken within its round (``serve_rounds``); 1. throughput of
the service against the two bare Starlette + ONNX Runtime servers (``reference_server``:
the model on a worker thread, and inline on the event loop); 2. latency of `make serve`'s
configuration, started twice; 3. cold start until /readyz, then the first seconds' req/s;
4. adaptive batching on and off, the Fashion CNN and a random 160 px resnet18 built here
(``serve_models``), with ONNX Runtime alone and the uploads' decode time; 6. int8 vs fp32
(``serve_int8``); 7. ``/classify?explain=1`` vs the plain answer (``serve_explain``).

About 13-15 minutes with the defaults on 2 cores, 37 server starts (``--quick``: about 4
minutes, a smoke run whose figures mean little). Writes reports/bench-serve.json and replaces the
"## Serving" section of docs/benchmarks.md (other sections are left as they are);
``--render`` rewrites that section from the JSON alone. Run from the repository root as
``python -m benchmarks.bench_serve``; ``serve_load`` holds the request bodies, servers and
wrk, ``serve_figures`` the levels, targets and verdicts, ``serve_report`` the docs section
and the console summary.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.host_facts import load_facts
from benchmarks.harness.publish import publish_part
from benchmarks.harness.stopwatch import Timer
from benchmarks.serve_explain import EXPLAIN_HEAD, explain_lines, load_explain
from benchmarks.serve_figures import BATCH_LEVELS, FASHION, LARGE, LATENCY_CLIENTS, LEVELS
from benchmarks.serve_int8 import (
    FIGURES,
    INT8_MODELS,
    build_int8_models,
    int8_lines,
    ort_single_thread,
)
from benchmarks.serve_load import (
    BARE,
    REPO,
    Bench,
    photo_jpegs,
    png_images,
    preflight,
    test_images,
    wrk_script,
)
from benchmarks.serve_models import (
    LARGE_CLASSES,
    LARGE_SIZE,
    build_large_model,
    decode_ms,
    raw_onnx,
)
from benchmarks.serve_report import (
    SECTION,
    kept_int8,
    markdown,
    print_summary,
    replace_section,
    summary,
)
from benchmarks.serve_rounds import ROUNDS, load_rounds, publish_rounds

MODULE = "benchmarks.bench_serve"


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line; ``--quick`` already applied to the durations and image count."""
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    # Whole seconds: wrk's -d takes nothing finer.
    p.add_argument("--seconds", type=int, default=6, help="load per concurrency level, s")
    p.add_argument("--warmup", type=int, default=3, help="load before measuring, s")
    p.add_argument(
        "--first-seconds", type=int, default=5, help="cold start: load right after ready, s"
    )
    p.add_argument("--ort-seconds", type=float, default=1.5, help="ONNX Runtime, per batch")
    p.add_argument("--images", type=int, default=32, help="distinct images sent per model")
    p.add_argument(
        "--quick", action="store_true", help="smoke run: 2 s per level, 1 s warm-up, 8 images"
    )
    p.add_argument("--docs", default=str(REPO / "docs/benchmarks.md"))
    p.add_argument("--json", default=str(REPO / "reports/bench-serve.json"))
    p.add_argument("--render", action="store_true", help="only rewrite the docs from --json")
    p.add_argument(
        "--watching-only",
        action="store_true",
        help="only section 5 (log + shadow off/on), printed; the docs and JSON are left alone",
    )
    p.add_argument(
        "--int8-only",
        action="store_true",
        help="only section 6 (int8 vs fp32), printed; the docs and JSON are left alone",
    )
    p.add_argument(
        "--explain-only",
        action="store_true",
        help="only section 7 (explain=1 vs plain): printed, reports/bench-serve-explain.json, "
        "and its table in the docs' Serving section",
    )
    p.add_argument("--no-explain", action="store_true", help="skip section 7")
    p.add_argument("--rounds", type=int, default=ROUNDS, help="section 0: rounds (0: skip it)")
    p.add_argument(
        "--round-seconds", type=int, default=10, help="section 0: load per server and round, s"
    )
    p.add_argument(
        "--rounds-only",
        action="store_true",
        help="only section 0 (the small model in rounds): printed, reports/bench-serve-rounds"
        ".json, and its table in the docs' Serving section",
    )
    p.add_argument("--int8-steps", type=int, default=200, help="section 6: resnet18 steps")
    p.add_argument(
        "--no-int8",
        action="store_true",
        help="skip section 6 (minutes of training); the docs keep the int8 table they have",
    )
    p.add_argument("--build-large", metavar="PATH", help=argparse.SUPPRESS)
    p.add_argument("--build-int8", metavar="DIR", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.seconds, args.warmup, args.first_seconds = 2, 1, 2
        args.ort_seconds, args.images, args.int8_steps = 0.3, 8, 10
        args.round_seconds, args.rounds = 2, min(args.rounds, 1)
    return args


def build_large(path: Path) -> float:
    """Build and export the larger model to ``path`` in a child process; its seconds."""
    print(f"building {path.name} (random init) and exporting it to ONNX", flush=True)
    with Timer() as clock:
        command = [sys.executable, "-m", MODULE, "--build-large", str(path)]
        subprocess.run(command, cwd=REPO, check=True)
    return clock.seconds


def load_cold_and_latency(bench: Bench, settings: Any, fashion: dict[str, Any]) -> None:
    """Sections 2 and 3: `make serve`'s configuration (params.yaml as it is) from cold, then
    warm at 16 clients; started a second time, the same; the reference with as many workers."""
    print("2. latency and 3. cold start: params.yaml as it is, started twice", flush=True)
    n_default = settings.workers_count()
    as_is = {"workers": settings.workers, "batching": settings.batching}
    as_is["params"] = REPO / "params.yaml"
    bench.run("latency", **fashion, levels=(LATENCY_CLIENTS,), **as_is, first=True)
    bench.cold["workers_param"] = settings.workers
    bench.run("repeat", **fashion, levels=(LATENCY_CLIENTS,), **as_is)
    for server in BARE:
        bench.run("latency", **fashion, levels=(LATENCY_CLIENTS,), workers=n_default, server=server)


def load_servers(
    bench: Bench, settings: Any, fashion: dict[str, Any], large: dict[str, Any]
) -> None:
    """Every server configuration under wrk, in the order of the run (11 server starts)."""
    print("1. throughput, 1 worker", flush=True)
    bench.run("throughput", **fashion, levels=LEVELS, batching=settings.batching)
    for server in BARE:
        bench.run("throughput", **fashion, levels=LEVELS, server=server)
    load_cold_and_latency(bench, settings, fashion)
    print("4. adaptive batching, 1 worker", flush=True)
    bench.run("batching", **fashion, levels=BATCH_LEVELS, batching=not settings.batching)
    for batching in (False, True):
        bench.run("batching", **large, levels=BATCH_LEVELS, batching=batching)


WATCHING = {  # section 5's servers: what each turns on
    "off": {"drift_window": 0},
    "drift": {},  # params.yaml's: the windowed drift score, with the model's reference
    "log": {"log_predictions": True},
    "log+shadow": {"log_predictions": True, "shadow": "SAME"},
    "log+shadow-25%": {"log_predictions": True, "shadow": "SAME", "shadow_share": 0.25},
}


def load_watching(bench: Bench, fashion: dict[str, Any], tmp: Path) -> None:
    """5. the prediction log, and a shadow (the same model, so it does the full work) on
    all or a quarter of the requests, vs neither: what they cost the answer path."""
    print("5. prediction log and shadow, workers cpu_count", flush=True)
    for label, serve in WATCHING.items():
        serve = {k: str(fashion["model"]) if v == "SAME" else v for k, v in serve.items()}
        serve["log_dir"] = str(tmp / f"prediction-log-{len(bench.servers)}")
        params = bench.params(f"watching-{label}", workers="cpu_count", batching=False, **serve)
        bench.run(
            "watching",
            **fashion,
            levels=(LATENCY_CLIENTS,),
            workers="cpu_count",
            params=params,
            label={"watching": label},
        )


def load_int8(bench: Bench, args: argparse.Namespace, fashion: dict[str, Any]) -> dict[str, Any]:
    """6. int8 vs fp32 (serve.precision), 1 worker, batching off, 16 clients, on the
    Fashion CNN and a resnet18 at 64 px (built and quantized in a child process), then ONNX
    Runtime alone on one thread at batch 1 and 64; the gate's figures beside them."""
    print("6. int8 vs fp32, 1 worker", flush=True)
    folder = bench.tmp / "int8"
    command = [sys.executable, "-m", MODULE, "--build-int8", str(folder)]
    subprocess.run([*command, "--int8-steps", str(args.int8_steps)], cwd=REPO, check=True)
    for name in INT8_MODELS:
        for precision in ("fp32", "int8"):
            params = bench.params(f"int8-{name}-{precision}", workers=1, precision=precision)
            load = {**fashion, "model_name": name, "model": folder / name / "model.onnx"}
            label = {"precision": precision}
            bench.run("int8", **load, levels=(LATENCY_CLIENTS,), params=params, label=label)
    rows = [r for r in bench.rows if r["section"] == "int8"]
    figures = json.loads((folder / FIGURES).read_text())
    return {"figures": figures, "rows": rows, "ort": ort_single_thread(folder, args.ort_seconds)}


def in_process(
    settings: Any, models: list[tuple[str, Path, list[bytes]]], seconds: float
) -> tuple[dict[str, Any], dict[str, float], str]:
    """ONNX Runtime alone and the decode of one upload, per model: (ort, decode, provider)."""
    print("ONNX Runtime alone, and the decode of one upload", flush=True)
    ort, decode, provider = {}, {}, ""
    for name, path, images in models:
        ort[name], provider = raw_onnx(path, settings.device, settings.model_threads(), seconds)
        decode[name] = decode_ms(path, images, seconds)
        print(f"  decode + resize, {name}: {decode[name]:.3f} ms per image", flush=True)
    return ort, decode, provider


def measure_all(args: argparse.Namespace, settings: Any, tmp: Path) -> dict[str, Any]:
    """The whole run in ``tmp``: the larger model built, every server loaded, ONNX Runtime
    alone; what the result records of it."""
    from trainyard.core.io import sha256_file

    fashion, large = REPO / "models/model.onnx", tmp / f"{LARGE}-{LARGE_SIZE}.onnx"
    pngs = png_images(test_images(args.images))
    fashion_load = {
        "model_name": FASHION,
        "model": fashion,
        "script": wrk_script(pngs, "image/png", tmp, FASHION),
    }
    bench = Bench(tmp, args.seconds, args.warmup, args.first_seconds)
    if args.watching_only:
        load_watching(bench, fashion_load, tmp)
        return {"bench": bench}
    if args.int8_only:
        return {"bench": bench, "int8": load_int8(bench, args, fashion_load)}
    if args.explain_only:
        return {"bench": bench, "explain": load_explain(bench, args.images)}
    # Section 0 at its own length: each side of a ratio long enough on a shared machine.
    in_rounds = Bench(tmp, args.round_seconds, args.warmup, args.first_seconds)
    rounds = (
        load_rounds(in_rounds, fashion_load, settings.batching, args.rounds)
        if args.rounds
        else None
    )
    if args.rounds_only:
        return {"bench": bench, "rounds": rounds}
    build_s = build_large(large)
    photos = photo_jpegs(args.images)
    large_script = wrk_script(photos, "image/jpeg", tmp, LARGE)
    load_servers(
        bench, settings, fashion_load, {"model_name": LARGE, "model": large, "script": large_script}
    )
    load_watching(bench, fashion_load, tmp)
    int8 = None if args.no_int8 else load_int8(bench, args, fashion_load)
    explain = None if args.no_explain else load_explain(bench, args.images)
    ort, decode, provider = in_process(
        settings, [(FASHION, fashion, pngs), (LARGE, large, photos)], args.ort_seconds
    )
    return {
        "bench": bench,
        "onnx_runtime": ort,
        "decode_ms": decode,
        "provider": provider,
        "build_s": build_s,
        "large_mb": large.stat().st_size / 1e6,
        "large_sha": sha256_file(large),
        "int8": int8,
        "explain": explain,
        "rounds": rounds,
    }


def models_record(args: argparse.Namespace, run: dict[str, Any]) -> dict[str, Any]:
    """What the result says about the two models and the requests sent to them."""
    from trainyard.core.io import sha256_file

    return {
        FASHION: {
            "path": "models/model.onnx",
            "sha256": sha256_file(REPO / "models/model.onnx"),
            "input": "1x28x28",
            "requests": f"{args.images} Fashion-MNIST test images as PNG (28x28 grey)",
        },
        LARGE: {
            "description": f"torchvision {LARGE} through trainyard.model.classifier."
            "Classifier, random initialisation (speed only, no training), exported with "
            "trainyard.export.onnx_export (dataset card and metadata as the pipeline "
            "writes them)",
            "sha256": run["large_sha"],
            "input": f"3x{LARGE_SIZE}x{LARGE_SIZE} (resize crop, {len(LARGE_CLASSES)} classes)",
            "size_mb": run["large_mb"],
            "build_s": run["build_s"],
            "requests": f"{args.images} generated RGB JPEG photos (quality 85), "
            "320x240 to 640x480 px",
        },
    }


def one_section(args: argparse.Namespace, run: dict[str, Any], command: str, machine: Any) -> None:
    """``--rounds-only``, ``--int8-only``, ``--explain-only`` or ``--watching-only``:
    printed; the rounds' and the explain table also to their JSON under reports/ and into
    the docs' Serving section."""
    facts = {"command": command, "machine": machine}
    if args.rounds_only:
        publish_rounds(Path(args.docs), run["rounds"], facts)
    elif args.int8_only:
        print("\n".join(int8_lines({"int8": run["int8"]})))
    elif args.explain_only:
        lines = explain_lines({"explain": run["explain"]})
        facts["said"] = ""
        publish_part(
            Path(args.docs), "bench-serve-explain", EXPLAIN_HEAD, lines, run["explain"], facts
        )
    else:
        rows = run["bench"].rows
        for row in rows[1:]:
            print(
                f"{row['watching']:>13} / off: p99 {row['p99_ms'] / rows[0]['p99_ms']:.2f}x, "
                f"2xx/s {row['ok_per_s'] / rows[0]['ok_per_s']:.2f}x"
            )


def _side_job(args: argparse.Namespace) -> bool:
    """``--build-large``, ``--build-int8`` (the child processes' model builds) or ``--render``
    (the docs section from the JSON): done here, True; else False."""
    if args.build_large:
        from trainyard.core.config import load_params

        build_large_model(Path(args.build_large), load_params(REPO / "params.yaml").export.opset)
        return True
    if args.build_int8:
        build_int8_models(Path(args.build_int8), REPO, args.int8_steps)
        return True
    if args.render:
        result = json.loads(Path(args.json).read_text())
        int8 = int8_lines(result) or kept_int8(Path(args.docs))
        replace_section(Path(args.docs), "\n".join([markdown(result), *int8]))
        print_summary(result)
        print("\n".join(int8_lines(result)))
        return True
    return False


def main(argv: list[str] | None = None) -> int:
    """`make bench-serve`; ``--render`` only rewrites the docs section from the JSON."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if _side_job(args):
        return 0
    ready = preflight("bench-serve", MODULE, argv)
    if ready is None:
        return 2
    settings, command = ready
    from trainyard.core.io import atomic_write_json

    machine = load_facts()
    with Timer() as clock, tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp_name:
        run = measure_all(args, settings, Path(tmp_name))
    bench = run["bench"]
    if args.int8_only or args.explain_only or args.watching_only or args.rounds_only:
        one_section(args, run, command, machine)
        return 0
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": command,
        "machine": machine,
        "provider": run["provider"],
        "threads": settings.model_threads(),
        "access_log": getattr(settings, "access_log", None),
        "seconds": args.seconds,
        "warmup": args.warmup,
        "first_seconds": args.first_seconds,
        "wall_s": round(clock.seconds, 1),
        "models": models_record(args, run),
        "servers": bench.servers,
        "cold_start": bench.cold,
        "rows": bench.rows,
        "onnx_runtime": run["onnx_runtime"],
        "decode_ms": run["decode_ms"],
        "int8": run["int8"],
        "explain": run["explain"],
        "rounds": run["rounds"],
    }
    result["summary"] = summary(result)
    atomic_write_json(args.json, result)
    int8 = int8_lines(result) or kept_int8(Path(args.docs))
    replace_section(Path(args.docs), "\n".join([markdown(result), *int8, *explain_lines(result)]))
    print_summary(result)
    print("\n".join(int8_lines(result)))
    print("\n".join(explain_lines(result)))
    print(f"wrote {args.json} and the '{SECTION}' section of {args.docs} in {result['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
