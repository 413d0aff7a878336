"""`make bench-serve`'s section 7: ``/classify?explain=1`` against the plain ``/classify``,
side by side on one server, on the Fashion CNN and EfficientNet-Lite0 at 160 px.

Both models are built and exported by bench-predict's code (``benchmarks.predict_inputs``:
the pipeline's ``Classifier`` and export, class maps included, no training; made once and
reused): ``cnn-28``, the Fashion CNN's network at 28x28 grey, loaded with real
Fashion-MNIST test PNGs, and ``lite0-160`` (ImageNet backbone where its wheel is
installed), loaded with RGB JPEG photos of 320x240 to 640x480 px (a heatmap the size of
the upload: up to 640x480). One ``bentoml serve`` per model with params.yaml's serve
settings and 1 worker; wrk alternates the plain and the explaining script on it, at 1
client (latency) and 16, ``ROUNDS`` times, so both see the same machine at the same
moments (the machine may be shared: the ratios are what to read). Target: explain p50 at
1 client <= 1.5x the plain one (issue 42).
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.harness.publish import subsection
from benchmarks.serve_load import (
    Bench,
    measure,
    photo_jpegs,
    png_images,
    start_server,
    stop_server,
    test_images,
    wrk,
    wrk_script,
)

EXPLAIN_MODELS = {"Fashion CNN": "cnn-28", "Lite0 160 px": "lite0-160"}
EXPLAIN_LEVELS = (1, 16)
ROUNDS = 2
TARGET = 1.5
EXPLAIN_HEAD = "### /classify?explain=1 vs the plain answer"
EXPLAIN_COLUMNS = (  # the table's header cells
    "model | clients | p50 ms plain / explain | ratio | p99 ms plain / explain | "
    "2xx/s plain / explain"
)


def build_explain_models() -> dict[str, Path]:
    """name -> the exported model (bench-predict's builder, in a child process, cached
    where bench-predict caches its models)."""
    from benchmarks.predict_inputs import ensure_models

    work = Path(tempfile.gettempdir()) / "trainyard-bench-predict"
    built = ensure_models(work, list(EXPLAIN_MODELS.values()), "benchmarks.bench_predict", print)
    return {name: Path(built[kind]["path"]) for name, kind in EXPLAIN_MODELS.items()}


def load_explain(bench: Bench, images: int) -> dict[str, Any]:
    """7. per model, one server; wrk alternating plain and explain at each level."""
    print("7. /classify?explain=1 vs /classify, 1 worker", flush=True)
    models = build_explain_models()
    uploads = {
        "Fashion CNN": (png_images(test_images(images)), "image/png"),
        "Lite0 160 px": (photo_jpegs(images), "image/jpeg"),
    }
    rows: list[dict[str, Any]] = []
    for name, model in models.items():
        data, kind = uploads[name]
        tag = name.split()[0].lower()
        scripts = {
            explain: wrk_script(data, kind, bench.tmp, f"{tag}-{explain}", path)
            for explain, path in ((False, "/classify"), (True, "/classify?explain=1"))
        }
        params = bench.params(f"explain-{tag}", workers=1)
        proc, url, ready_s = start_server(params, model, bench.tmp / f"explain-{tag}.log")
        print(f"  {name}: ready in {ready_s:.1f} s", flush=True)
        try:
            for script in scripts.values():
                wrk(url, script, 4, bench.warmup)
            for n in range(ROUNDS):
                for clients in EXPLAIN_LEVELS:
                    for explain, script in scripts.items():
                        row = measure(url, script, clients, bench.seconds, True)
                        row.update(model=name, explain=explain, round=n)
                        rows.append(row)
                        print(
                            f"  {name:12s} explain {'on ' if explain else 'off'} "
                            f"{clients:>2} clients: p50 {row['p50_ms']:7.2f} ms  "
                            f"p99 {row['p99_ms']:7.2f} ms  {row['ok_per_s']:7.1f} 2xx/s  "
                            f"non-2xx {row['non_2xx']}",
                            flush=True,
                        )
        finally:
            stop_server(proc)
    return {"rows": rows, "rounds": ROUNDS, "target": TARGET}


def _median(rows: list[dict[str, Any]], key: str, **match: Any) -> float | None:
    got = [r[key] for r in rows if all(r.get(k) == v for k, v in match.items())]
    return statistics.median(got) if got else None


def explain_ratios(explain: dict[str, Any]) -> list[dict[str, Any]]:
    """Per model and level: the medians over the rounds and explain / plain."""
    out = []
    for name in EXPLAIN_MODELS:
        for clients in EXPLAIN_LEVELS:
            one: dict[str, Any] = {"model": name, "clients": clients}
            for key in ("p50_ms", "p99_ms", "ok_per_s"):
                plain, on = (
                    _median(explain["rows"], key, model=name, clients=clients, explain=e)
                    for e in (False, True)
                )
                one[key] = (plain, on, on / plain if plain and on is not None else None)
            out.append(one)
    return out


def _explain_table(explain: dict[str, Any]) -> list[str]:
    """Section 7's rows, one per model and level, and the note under them."""
    lines: list[str] = []
    for r in explain_ratios(explain):
        (p50, e50, ratio), (p99, e99, _), (ok, eok, _) = r["p50_ms"], r["p99_ms"], r["ok_per_s"]
        lines.append(
            f"| {r['model']} | {r['clients']} | {p50:.2f} / {e50:.2f} | {ratio:.2f}x | "
            f"{p99:.2f} / {e99:.2f} | {ok:.0f} / {eok:.0f} |"
        )
    lines += [
        "",
        f"One server per model (1 worker, params.yaml's serve settings), wrk alternating the "
        f"plain and the explaining request, medians of {explain['rounds']} rounds; target: "
        f"p50 at 1 client <= {explain['target']}x the plain answer's. Fashion CNN: the "
        "pipeline's cnn at 28x28 grey (bench-predict's cnn-28: exported with its maps, "
        "hirescam, no training), Fashion-MNIST test PNGs; Lite0 160 px: bench-predict's "
        "lite0-160 (cam), RGB JPEGs of 320x240 to 640x480 px, each heatmap the upload's size.",
    ]
    return lines


def explain_lines(result: dict[str, Any]) -> list[str]:
    """Section 7 as markdown: explain / plain per model and level."""
    return subsection(result, "explain", EXPLAIN_HEAD, EXPLAIN_COLUMNS, _explain_table)
