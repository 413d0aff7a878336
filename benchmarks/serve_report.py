"""`make bench-serve`'s report: the "## Serving" section of docs/benchmarks.md from the run's
JSON, the console summary, and the section swap that leaves other sections as they are."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from benchmarks.harness.publish import replace_section
from benchmarks.serve_explain import EXPLAIN_HEAD
from benchmarks.serve_figures import (
    FASHION,
    LARGE,
    LATENCY_CLIENTS,
    TARGETS,
    TOP,
    batching_pair,
    ort_rows,
    pick,
    ratio,
    summary,
)
from benchmarks.serve_int8 import INT8_HEAD
from benchmarks.serve_rounds import rounds_lines

SECTION = "## Serving"
__all__ = ["SECTION", "markdown", "print_summary", "replace_section", "summary"]


def _num(value: float | None, fmt: str, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{fmt}}{unit}"


def _verdict(ok: bool | None) -> str:
    return {True: "**met**", False: "**not met**", None: "not measured"}[ok]


def _row_cells(r: dict[str, Any]) -> str:
    batching = {True: "on", False: "off", None: "–"}[r["batching"]]
    server = SERVER_NAMES[r["server"]]
    mean = _num(r.get("mean_batch"), ".1f") if r.get("mean_batch") else "–"
    shed = "–" if r.get("shed") is None else str(r["shed"])
    return (
        f"| {server} | {r['workers']} | {batching} | {r['clients']} | {r['req_per_s']:.0f} | "
        f"{r['ok_per_s']:.0f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['non_2xx']} | "
        f"{r['socket_errors']} | {shed} | {mean} |"
    )


SERVER_NAMES = {
    "service": "BentoML service",
    "reference": "Starlette + ORT, thread hop",
    "inline": "Starlette + ORT, inline",
    "bento-plain": "plain BentoML service",
    "bento-lean": "lean BentoML service",
}
TABLE_HEAD = [
    "| server | workers | batching | clients | req/s | 2xx/s | p50 ms | p99 ms | non-2xx "
    "| socket errors | 503 shed | mean batch |",
    "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
]


def _table(rows: Iterable[dict[str, Any]]) -> list[str]:
    return [*TABLE_HEAD, *(_row_cells(r) for r in rows)]


def ort_story(result: dict[str, Any], model: str) -> str:
    """Why batching wins or not, in ONNX Runtime's own figures: the batcher runs one call
    at a time, the thread pool without batching runs several."""
    single = ort_rows(result, model)
    if not single:
        return ""
    cores, threads = result["machine"]["cores"], result["threads"]
    best = max(single, key=lambda r: r["img_per_s"])
    text = (
        f"With `serve.intra_op_threads` = {threads}, ONNX Runtime gains "
        f"{best['img_per_s'] / single[0]['img_per_s']:.2f}x img/s from batch 1 to batch "
        f"{best['batch']} ({single[0]['img_per_s']:.0f} -> {best['img_per_s']:.0f} img/s), "
        "and with batching on a worker runs one ONNX Runtime call at a time"
    )
    together = ort_rows(result, model, callers=cores)
    if together:
        text += (
            f"; with batching off its thread pool runs calls side by side: batch 1 from "
            f"{cores} threads at once gives {together[0]['img_per_s']:.0f} img/s"
        )
    wide = ort_rows(result, model, threads=0)
    if wide:
        text += (
            f". Batch {wide[0]['batch']} with one intra-op thread per core "
            f"(`serve.intra_op_threads: 0`) gives {wide[0]['img_per_s']:.0f} img/s"
        )
    return text + ". Decoding and HTTP work stay per request either way."


def why_batching(result: dict[str, Any], model: str, rows: list[dict[str, Any]]) -> str:
    """What batching can save for ``model``, from ONNX Runtime alone and the decode time."""
    ort = ort_rows(result, model)
    on_rows, off_rows = batching_pair(rows, model)
    on, off = pick(on_rows, clients=TOP), pick(off_rows, clients=TOP)
    if not ort or off is None or not off["ok_per_s"]:
        return ""
    one = ort[0]
    best = min(ort, key=lambda r: r["ms_per_image"])
    per_request = 1000 / off["ok_per_s"]
    saving = one["ms_per_image"] - best["ms_per_image"]
    decode = result.get("decode_ms", {}).get(model)
    text = (
        f"{model}: with batching off, 1 worker answers a request every {per_request:.2f} ms "
        f"at {TOP} clients. ONNX Runtime alone takes {one['ms_per_image']:.2f} ms per image "
        f"at batch 1 and {best['ms_per_image']:.2f} ms at batch {best['batch']} "
        f"({best['img_per_s'] / one['img_per_s']:.2f}x img/s)"
    )
    if decode is not None:
        text += f"; decoding and resizing one upload takes {decode:.2f} ms, batched or not"
    text += (
        f". Merging requests saves at most {saving:.2f} ms of model time per image "
        f"({saving / per_request:.0%} of a request's {per_request:.2f} ms), plus the "
        "service's fixed work per ONNX Runtime call (a thread-pool hop, normalisation, "
        "softmax, metrics), done once per batch instead of once per request"
    )
    if on is not None:
        text += (
            f". Measured: **{_num(ratio(on, off), '.2f', 'x')}** 2xx req/s, mean batch "
            f"{_num(on.get('mean_batch'), '.1f')}, p99 {on['p99_ms']:.0f} ms with batching "
            f"on vs {off['p99_ms']:.0f} ms off"
        )
        if on.get("shed"):
            text += (
                f", {on['shed']} requests shed with 503 (the batcher's estimate of their "
                "latency passed `serve.max_latency_ms`)"
            )
    return text + "."


def _intro(result: dict[str, Any]) -> list[str]:
    """The heading, how the run was made, and the two models."""
    m, models = result["machine"], result["models"]
    fashion, large = models[FASHION], models[LARGE]
    return [
        SECTION,
        "",
        f"`{result['command']}` on {result['date']}: {m['cpu']}, {m['cores']} cores, load "
        f"average {m['loadavg']:.2f} at the start; ONNX Runtime on {result['provider']}, "
        f"`serve.intra_op_threads` = {result['threads']} (the reference server too)"
        + (
            f", `serve.access_log` = {str(result['access_log']).lower()} (the reference "
            "server logs no requests)"
            if result.get("access_log") is not None
            else ""
        )
        + ". wrk on "
        f"127.0.0.1 (one thread, keep-alive, 10 s timeout), {result['seconds']:g} s per level "
        f"after a {result['warmup']:g} s warm-up at {LATENCY_CLIENTS} clients; every request "
        "is one image as a multipart `image` upload to `/classify`. Each server is started "
        "fresh on a free port with params.yaml plus the overrides named (and "
        "`serve.max_concurrency` >= 256, so no 429s). 2xx/s counts successful answers only; "
        "every ratio below compares 2xx/s."
        + (f" The whole run took {result['wall_s']:.0f} s." if result.get("wall_s") else ""),
        "",
        f"- Fashion CNN: `models/model.onnx` ({fashion['sha256'][:12]}), input "
        f"{fashion['input']}; requests: {fashion['requests']}.",
        f"- Larger model: {large['description']}, input {large['input']}, "
        f"{large['size_mb']:.0f} MB, built and exported by the bench in "
        f"{large['build_s']:.0f} s; requests: {large['requests']}.",
        "",
    ]


def _targets(s: dict[str, Any]) -> list[str]:
    """Each target with its measured value and verdict, then the error counts."""
    lines = ["### Targets", "", "| target | measured | verdict |", "|---|---:|---|"]
    for key, t in s["targets"].items():
        unit = TARGETS[key]["unit"]
        lines.append(f"| {t['text']} | {_num(t['value'], '.2f', unit)} | {_verdict(t['met'])} |")
    return [
        *lines,
        "",
        f"Across all runs the service answered {s['non_2xx']} requests with a non-2xx "
        f"status ({s['shed']} of them 503s shed by the adaptive batcher); wrk saw "
        f"{s['socket_errors']} socket errors (connect, read, write, timeout).",
        "",
    ]


def _throughput_latency(result: dict[str, Any], s: dict[str, Any]) -> list[str]:
    """Sections 1 (service vs reference, 1 worker) and 2 (workers cpu_count)."""
    rows, cores = result["rows"], result["machine"]["cores"]
    return [
        "### 1. Throughput: service vs the two bare servers, 1 worker, Fashion CNN",
        "",
        "The bare servers (benchmarks/reference_server.py) are Starlette + ONNX Runtime as a "
        "person would write them: the decode and the model call on a worker thread "
        '(`run_in_threadpool`, "thread hop"), or inline on the event loop ("inline", the '
        "fastest plain design for a sub-millisecond model).",
        "",
        *_table(r for r in rows if r["section"] == "throughput"),
        "",
        *(
            f"Service / {SERVER_NAMES[bare]}, 2xx req/s: "
            + ", ".join(f"{c} clients {_num(v, '.2f', 'x')}" for c, v in s[key].items())
            + "."
            for key, bare in (("throughput", "reference"), ("throughput_inline", "inline"))
        ),
        "The difference is BentoML's own per-request work (its ASGI stack, traffic limits, "
        "metrics and access log, the api method's call) and the service's guard, trace "
        'headers and metrics (docs/serving.md, "What BentoML costs per request").',
        "",
        f"### 2. Latency: `make serve`'s configuration (params.yaml as it is) and both bare "
        f"servers with as many workers ({cores} cores), Fashion CNN; the service started twice",
        "",
        *_table(r for r in rows if r["section"] in ("latency", "repeat")),
        "",
        "p99 service / thread-hop server: "
        + _num(s["targets"]["latency"]["value"], ".2f", "x")
        + ", / inline server (1 worker, section 1): "
        + _num(s["targets"]["latency_inline"]["value"], ".2f", "x")
        + "; the two starts, lower / higher 2xx req/s: "
        + _num(s["targets"]["two_starts"]["value"], ".2f", "x")
        + ".",
        "",
        f"{LATENCY_CLIENTS} closed-loop clients queue behind each other: by Little's law the "
        f"mean latency is about {LATENCY_CLIENTS} / req/s, so p99 <= 50 ms needs well over "
        f"{LATENCY_CLIENTS / 0.05:.0f} req/s.",
        "",
    ]


def _cold_start(result: dict[str, Any], s: dict[str, Any]) -> list[str]:
    """Section 3, when the run has a cold start: time to ready, first seconds vs warm."""
    rows, cold = result["rows"], result.get("cold_start")
    first = pick(rows, phase="first")
    if not (cold and first):
        return []
    warm = pick(rows, run=cold.get("run"))
    return [
        "### 3. Cold start: `make serve`'s configuration (params.yaml as it is)",
        "",
        f"`bentoml serve bento.service:ImageClassifier` with `serve.workers` = "
        f"{cold.get('workers_param', cold['workers'])} ({cold['workers']} processes), batching "
        f"{'on' if cold['batching'] else 'off'}: **{cold['ready_s']:.1f} s** from the "
        "command's start until `/readyz` answered 200 (polled every 50 ms; Python's "
        "files were already in the page cache from the servers started before). Then, "
        f"with no warm-up, wrk for the first {result['first_seconds']:g} s, and after a "
        f"warm-up the same server warm, {LATENCY_CLIENTS} clients each:",
        "",
        *TABLE_HEAD,
        _row_cells(first).replace("| BentoML service |", "| BentoML service, first s |"),
        *([_row_cells(warm).replace("| BentoML service |", "| same, warm |")] if warm else []),
        "",
        f"First {result['first_seconds']:g} s / warm, 2xx req/s: "
        f"**{_num(s['cold_ratio'], '.2f', 'x')}**.",
        "",
    ]


def _batching(result: dict[str, Any], s: dict[str, Any]) -> list[str]:
    """Section 4's tables: batching on and off for each model, with their ratios."""
    rows, large = result["rows"], result["models"][LARGE]
    lines = ["### 4. Adaptive batching, 1 worker: Fashion CNN and resnet18", ""]
    for model, title in ((FASHION, "Fashion CNN"), (LARGE, f"{LARGE} {large['input']}")):
        batching_rows = [r for pair in batching_pair(rows, model) for r in pair]
        batching_rows.sort(key=lambda r: (r["clients"], not r["batching"]))
        ratios = s["batching"][model]
        lines += [
            f"{title}:",
            "",
            *_table(batching_rows),
            "",
            "Batching on / off, 2xx req/s: "
            + ", ".join(f"{c} clients **{_num(v, '.2f', 'x')}**" for c, v in ratios.items())
            + ".",
            "",
        ]
    return lines


def _onnx_runtime(result: dict[str, Any], s: dict[str, Any]) -> list[str]:
    """Section 4's ONNX Runtime table, and why batching won or not."""
    lines = [
        "ONNX Runtime alone, in process, no HTTP, no decode: the service's session options "
        "one call at a time (with batching on, BentoML's batcher runs one batch at a time "
        f"per worker), batch 1 from {result['machine']['cores']} threads at once (with "
        "batching off the thread pool runs several requests' calls at once), and the largest "
        "batch with one intra-op thread per core (`serve.intra_op_threads: 0`). ms per image "
        "= wall time / images.",
        "",
        "| model | batch | intra-op threads | calls at once | img/s | ms per call | ms per image |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for model in (FASHION, LARGE):
        for r in result["onnx_runtime"].get(model, []):
            threads = r.get("threads", result["threads"])
            lines.append(
                f"| {model} | {r['batch']} | {threads or 'one per core'} | "
                f"{r.get('callers', 1)} | {r['img_per_s']:.0f} | {r['ms_per_batch']:.2f} | "
                f"{r['ms_per_image']:.3f} |"
            )
    lines.append("")
    rows = result["rows"]
    lines += [f"- {t}" for t in (why_batching(result, x, rows) for x in (FASHION, LARGE)) if t]
    won = s["targets"]["batching"]["met"]
    if won is not None:
        verdict = "won" if won else "did not win"
        lines += ["", f"Batching {verdict} on {LARGE} here. " + ort_story(result, LARGE)]
    lines.append("")
    return lines


def markdown(result: dict[str, Any]) -> str:
    """The "## Serving" section of docs/benchmarks.md, from the run's result."""
    s = summary(result)
    rounds = rounds_lines(result)
    lines = [*_intro(result), *_targets(s), *([*rounds[1:], ""] if rounds else [])]
    lines += _throughput_latency(result, s)
    lines += [*_cold_start(result, s), *_batching(result, s), *_onnx_runtime(result, s)]
    return "\n".join(lines)


def print_summary(result: dict[str, Any]) -> None:
    """The run's figures and verdicts on the console."""
    s, rows = summary(result), result["rows"]
    print("\nSummary")
    for c, v in s["throughput"].items():
        svc = pick(rows, section="throughput", server="service", clients=c)
        ref = pick(rows, section="throughput", server="reference", clients=c)
        inline = pick(rows, section="throughput", server="inline", clients=c)
        lat = "".join(
            f"; {n} p50 {r['p50_ms']:.1f} ms p99 {r['p99_ms']:.1f} ms"
            for n, r in (("service", svc), ("thread hop", ref), ("inline", inline))
            if r
        )
        both = f"{_num(v, '.2f', 'x')} / {_num(s['throughput_inline'][c], '.2f', 'x')}"
        print(f"  service / thread-hop / inline server, 1 worker, {c:>2} clients: {both}{lat}")
    for key, t in s["targets"].items():
        unit = TARGETS[key]["unit"]
        value = _num(t["value"], ".2f", unit)
        print(f"  {t['text']}: {value} -> {_verdict(t['met']).strip('*')}")
    for model, ratios in s["batching"].items():
        text = ", ".join(f"{c} clients {_num(v, '.2f', 'x')}" for c, v in ratios.items())
        print(f"  batching on / off, {model}: {text}")
    print(f"  cold start: ready in {_num(s['cold_ready_s'], '.1f', ' s')}")
    print(
        f"  service non-2xx: {s['non_2xx']} (503 shed: {s['shed']}); "
        f"socket errors: {s['socket_errors']}"
    )


KEPT_NOTE = "(From an earlier run: this one had `--no-int8`; `--int8-only` measures it.)"


def kept_int8(docs: Path) -> list[str]:
    """The int8 table the docs' serving section has now, for a run with ``--no-int8``."""
    text = docs.read_text() if docs.is_file() else ""
    head = text.find(INT8_HEAD)
    if head < 0:
        return []
    marks = ("\n## ", "\n<!--", f"\n{EXPLAIN_HEAD}\n")
    end = min([i for i in (text.find(m, head) for m in marks) if i >= 0] + [len(text)])
    kept = text[head:end].rstrip("\n").splitlines()
    return ["", *kept, *([] if KEPT_NOTE in kept else ["", KEPT_NOTE]), ""]
