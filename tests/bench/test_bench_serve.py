"""`python -m benchmarks.bench_serve`'s pure parts: figures, verdicts, markdown, docs section.

The load test itself (servers, wrk) is not run here: `make bench-serve` is the check.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import bench_serve as bs
from benchmarks import serve_figures as fig
from benchmarks import serve_load as load
from benchmarks import serve_report as report
from benchmarks.harness.publish import load_words, splice_subsection


def row(section: str, model: str, server: str, workers: int, batching: bool | None, **kw: Any):
    r = {
        "run": f"{section}-{model}-{server}-{workers}-{batching}",
        "section": section,
        "model": model,
        "server": server,
        "workers": workers,
        "batching": batching,
        "phase": "warm",
        "clients": 16,
        "seconds": 6.0,
        "requests": 600,
        "req_per_s": 100.0,
        "ok_per_s": 100.0,
        "p50_ms": 10.0,
        "p99_ms": 40.0,
        "non_2xx": 0,
        "socket_errors": 0,
        "mean_batch": None if server != "service" else 1.0,
        "shed": None if server != "service" else 0,
    }
    r.update(kw)
    return r


def result(
    svc16: float = 420.0,
    ref16: float = 500.0,
    p99: float = 20.0,
    first: float = 400.0,
    large_on64: float = 60.0,
    watched_p99: float = 21.0,
    again: float = 760.0,
    inline16: float = 560.0,
    inline_p99: float = 16.0,
) -> dict[str, Any]:
    """A fixed run: every figure is chosen, so each ratio and verdict is known."""
    F, L = fig.FASHION, fig.LARGE
    rows = []
    for c, svc, ref, inline in (
        (1, 200.0, 400.0, 500.0),
        (16, svc16, ref16, inline16),
        (64, 250.0, 450.0, 480.0),
    ):
        rows.append(row("throughput", F, "service", 1, False, clients=c, ok_per_s=svc))
        rows.append(row("throughput", F, "reference", 1, None, clients=c, ok_per_s=ref))
        rows.append(
            row("throughput", F, "inline", 1, None, clients=c, ok_per_s=inline, p99_ms=inline_p99)
        )
    cold = row("latency", F, "service", 2, False, run="cold", ok_per_s=800.0, p99_ms=p99)
    rows.append({**cold, "section": "cold", "phase": "first", "ok_per_s": first})
    rows.append(cold)
    rows.append(row("repeat", F, "service", 2, False, ok_per_s=again, p99_ms=p99))
    rows.append(row("latency", F, "reference", 2, None, ok_per_s=1500.0, p99_ms=25.0))
    rows.append(row("latency", F, "inline", 2, None, ok_per_s=1600.0, p99_ms=99.0))
    # Section 5: the log and shadow off / on (the "log" row is not the target's).
    for label, ms in (("off", 20.0), ("log", 99.0), ("log+shadow", watched_p99)):
        rows.append(row("watching", F, "service", 2, False, watching=label, p99_ms=ms))
    for c, on in ((16, 450.0), (64, 500.0)):
        rows.append(row("batching", F, "service", 1, True, clients=c, ok_per_s=on, mean_batch=8))
    for c, off, on in ((16, 50.0, 45.0), (64, 40.0, large_on64)):
        rows.append(row("batching", L, "service", 1, False, clients=c, ok_per_s=off))
        rows.append(
            row(
                "batching",
                L,
                "service",
                1,
                True,
                clients=c,
                ok_per_s=on,
                req_per_s=on + 5,
                non_2xx=c,
                shed=c,
                mean_batch=12.5,
            )
        )
    ort = {
        F: [
            {"batch": b, "img_per_s": b / t, "ms_per_batch": t * 1e3, "ms_per_image": t * 1e3 / b}
            for b, t in ((1, 1e-4), (8, 6e-4), (32, 2.4e-3))
        ],
        L: [
            {"batch": b, "img_per_s": b / t, "ms_per_batch": t * 1e3, "ms_per_image": t * 1e3 / b}
            for b, t in ((1, 0.010), (8, 0.072), (32, 0.28))
        ],
    }
    # Batch 1 from 2 threads at once, and batch 32 on one intra-op thread per core.
    ort[L].append({"batch": 1, "threads": 1, "callers": 2, "img_per_s": 190.0})
    ort[L].append({"batch": 32, "threads": 0, "callers": 1, "img_per_s": 210.0})
    for r in ort[L][-2:]:
        r["ms_per_image"] = 1000 / r["img_per_s"]
        r["ms_per_batch"] = r["ms_per_image"] * r["batch"] * r["callers"]
    return {
        "date": "2026-12-03 07:00",
        "command": ".venv/bin/python -m benchmarks.bench_serve",
        "machine": {"cpu": "Test CPU", "cores": 2, "loadavg": 0.5},
        "provider": "CPUExecutionProvider",
        "threads": 1,
        "seconds": 6,
        "warmup": 3,
        "first_seconds": 5,
        "models": {
            F: {"sha256": "ab" * 32, "input": "1x28x28", "requests": "PNGs"},
            L: {
                "description": "resnet18, random init",
                "sha256": "cd" * 32,
                "input": "3x160x160",
                "size_mb": 45.0,
                "build_s": 9.0,
                "requests": "JPEGs",
            },
        },
        "servers": [],
        "cold_start": {
            "run": "cold",
            "model": F,
            "server": "service",
            "workers": 2,
            "workers_param": "cpu_count",
            "batching": False,
            "ready_s": 4.25,
        },
        "rows": rows,
        "onnx_runtime": ort,
        "decode_ms": {F: 0.05, L: 1.5},
    }


def test_summary_ratios_compare_2xx_answers():
    s = fig.summary(result())
    assert s["throughput"][16] == pytest.approx(420 / 500)
    assert s["throughput"][1] == pytest.approx(200 / 400)
    assert s["throughput_inline"] == {1: 0.4, 16: 0.75, 64: pytest.approx(250 / 480)}
    assert s["latency_p99_ms"] == [20.0, 25.0] and s["latency_inline_p99_ms"] == 16.0
    assert s["starts_per_s"] == [760.0, 800.0]
    assert s["cold_ready_s"] == 4.25
    assert s["cold_ratio"] == pytest.approx(400 / 800)
    assert s["batching"][fig.FASHION] == {16: pytest.approx(450 / 420), 64: pytest.approx(2.0)}
    # 503s are not service: the larger model's "on" rows served ok_per_s, not req_per_s.
    assert s["batching"][fig.LARGE] == {16: pytest.approx(0.9), 64: pytest.approx(1.5)}
    assert s["non_2xx"] == 16 + 64 and s["shed"] == 16 + 64
    assert {k: (t["value"], t["met"]) for k, t in s["targets"].items()} == {
        "throughput": (pytest.approx(0.84), True),
        "throughput_inline": (pytest.approx(0.75), True),  # 420 / 560 req/s
        "latency": (pytest.approx(0.8), True),  # p99 20 / 25 ms
        "latency_inline": (pytest.approx(1.25), True),  # p99 20 / 16 ms
        "two_starts": (pytest.approx(0.95), True),  # 760 / 800 req/s
        "cold_start": (pytest.approx(0.5), True),
        "batching": (pytest.approx(1.5), True),
        "batching_cnn": (pytest.approx(450 / 420), True),
        "watching": (pytest.approx(1.05), True),  # 21 / 20 ms
    }
    assert s["watching_p99_ms"] == [21.0, 20.0]


def test_verdicts_follow_the_figures():
    s = fig.summary(
        result(svc16=390.0, p99=26.0, first=390.0, large_on64=40.0, watched_p99=23.0, again=700)
    )
    assert {k: t["met"] for k, t in s["targets"].items()} == {
        "throughput": False,  # 0.78x
        "throughput_inline": False,  # 390 / 560 = 0.70x
        "latency": False,  # 26 / 25 ms
        "latency_inline": False,  # 26 / 16 ms = 1.63x
        "two_starts": False,  # 700 / 800
        "cold_start": False,  # 390 / 800
        "batching": False,  # 1.0x
        "batching_cnn": True,  # 450 / 390
        "watching": False,  # 23 / 20 ms = 1.15x
    }


def test_missing_figures_are_not_verdicts():
    r = result()
    r["rows"] = [x for x in r["rows"] if x["model"] != fig.LARGE]
    s = fig.summary(r)
    assert s["targets"]["batching"] == {
        "value": None,
        "met": None,
        "text": fig.TARGETS["batching"]["text"],
    }
    assert "not measured" in report.markdown(r)


def test_markdown_states_targets_and_verdicts():
    md = report.markdown(result())
    assert md.startswith(report.SECTION + "\n")
    assert (
        "`.venv/bin/python -m benchmarks.bench_serve` on 2026-12-03 07:00: Test CPU, 2 cores" in md
    )
    for text in (">= 0.8x of reference", "p99 <= 1.0x of reference", "within 10%"):
        assert text in md
    assert ">= 0.75x of the inline bare server" in md and "p99 <= 1.3x of the inline" in md
    assert "| 0.75x | **met** |" in md and "| 1.25x | **met** |" in md
    assert "| Starlette + ORT, inline | 1 | – | 16 | 100 | 560 |" in md
    assert "Service / Starlette + ORT, inline, 2xx req/s: 1 clients 0.40x, 16 clients 0.75x" in md
    assert (
        "p99 service / thread-hop server: 0.80x, / inline server (1 worker, section 1): 1.25x" in md
    )
    assert "batching on / off >= 1.5x on the larger model (resnet18)" in md
    assert "| 0.84x | **met** |" in md and "| 0.80x | **met** |" in md
    assert "| 1.50x | **met** |" in md and "**not met**" not in md
    assert "**4.2 s**" in md and "Batching won on resnet18 here. With" in md
    assert "64 clients **1.50x**" in md  # resnet18 on / off
    assert "64 requests shed with 503" in md

    bad = report.markdown(result(svc16=200.0, p99=80.0, large_on64=30.0))
    assert "| 0.40x | **not met** |" in bad and "| 3.20x | **not met** |" in bad
    assert "| 0.75x | **not met** |" in bad
    # The explanation comes with the figures it rests on: ONNX Runtime's own batch gain,
    # one call at a time (batching on) vs calls side by side (off), and every core.
    assert "Batching did not win on resnet18 here. With `serve.intra_op_threads` = 1" in bad
    assert "gains 1.14x img/s from batch 1 to batch 32 (100 -> 114 img/s)" in bad
    assert "batch 1 from 2 threads at once gives 190 img/s" in bad
    assert "(`serve.intra_op_threads: 0`) gives 210 img/s" in bad
    assert "| resnet18 | 32 | one per core | 1 | 210 |" in bad
    assert "| resnet18 | 1 | 1 | 2 | 190 |" in bad


DOC = """# Benchmarks

intro

## Training and inference

train text

## Serving

old serving text

<!-- bench:prepare:start -->
## Prepare

prepare text
<!-- bench:prepare:end -->

History after the marker.
"""


def test_replace_section_keeps_the_other_sections(tmp_path: Path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text(DOC)
    report.replace_section(doc, "## Serving\n\nnew text\n")
    want = DOC.replace("old serving text", "new text")
    assert doc.read_text() == want
    report.replace_section(doc, "## Serving\n\nnew text\n")  # idempotent
    assert doc.read_text() == want

    doc.write_text("# Benchmarks\n\n## Training\n\nx\n")
    report.replace_section(doc, "## Serving\n\nappended\n")
    assert doc.read_text() == "# Benchmarks\n\n## Training\n\nx\n\n## Serving\n\nappended\n"

    fresh = tmp_path / "new" / "benchmarks.md"
    report.replace_section(fresh, "## Serving\n\nonly\n")
    assert fresh.read_text() == "# Benchmarks\n\n## Serving\n\nonly\n"


def test_render_rewrites_the_section_from_the_json(tmp_path: Path, capsys):
    doc, js = tmp_path / "benchmarks.md", tmp_path / "bench-serve.json"
    doc.write_text(DOC)
    # Through JSON as the bench writes it: integer keys come back as strings, tuples as lists.
    js.write_text(json.dumps(result()))
    assert bs.main(["--render", "--json", str(js), "--docs", str(doc)]) == 0
    text = doc.read_text()
    assert "### Targets" in text and "old serving text" not in text
    assert "## Training and inference\n\ntrain text" in text
    assert "<!-- bench:prepare:start -->\n## Prepare" in text
    out = capsys.readouterr().out
    assert "service / thread-hop / inline server, 1 worker, 16 clients: 0.84x / 0.75x" in out


def test_a_parts_header_says_quiet_or_shared_by_the_load_at_its_start():
    assert load_words(0.9, 2) == "(quiet cores)"
    assert "shared machine" in load_words(4.6, 2) and "shared" in load_words(1.1, 2)


def test_parse_metrics_sums_over_workers():
    text = "\n".join(
        [
            "# HELP trainyard_batch_size Images per ONNX Runtime run",
            'trainyard_batch_size_bucket{le="1.0"} 3.0',
            "trainyard_batch_size_sum 40.0",
            "trainyard_batch_size_count 4.0",
            "trainyard_batch_size_sum 10.0",
            "trainyard_batch_size_count 1.0",
            'trainyard_requests_refused_total{reason="overloaded"} 7.0',
            'trainyard_requests_refused_total{reason="bad_image"} 2.0',
        ]
    )
    assert load.parse_metrics(text) == {"batch_sum": 50.0, "batch_count": 5.0, "shed": 7.0}


def test_photos_are_rgb_jpegs_of_mixed_sizes():
    import io

    from PIL import Image

    sizes = set()
    for data in load.photo_jpegs(6):
        im = Image.open(io.BytesIO(data))
        assert im.format == "JPEG" and im.mode == "RGB"
        assert 320 <= im.width <= 640 and 240 <= im.height <= 480
        sizes.add(im.size)
    assert len(sizes) > 1
    body = load.multipart_body(b"xyz", "0.jpg", "image/jpeg")
    assert body.startswith(b"--trainyardbench\r\n") and body.endswith(b"\r\n--trainyardbench--\r\n")


def test_the_recorded_command_is_the_module_run():
    cmd = load.command_line("benchmarks.bench_serve", ["--quick", "--seconds", "3"])
    assert cmd.endswith(" -m benchmarks.bench_serve --quick --seconds 3")
    assert "bench_serve.py" not in cmd


def test_int8_section_puts_int8_and_fp32_side_by_side():
    from benchmarks import serve_int8 as si

    figures = {
        name: {
            "agreement": 0.996,
            "accuracy_fp32": 0.923,
            "accuracy_int8": 0.921,
            "accuracy_drop": 0.2,
            "samples": 2000,
            "fp32_mb": 1.9,
            "int8_mb": 0.5,
        }
        for name in si.INT8_MODELS
    } | {"resnet_train_steps": 300}
    rows = [
        {"section": "int8", "model": m, "precision": p, "ok_per_s": v}
        for m in si.INT8_MODELS
        for p, v in (("fp32", 100.0), ("int8", 150.0))
    ]
    ort = [
        {"model": m, "precision": p, "batch": b, "ms_per_batch": ms * b}
        for m in si.INT8_MODELS
        for p, ms in (("fp32", 1.0), ("int8", 0.5))
        for b in si.INT8_BATCHES
    ]
    lines = si.int8_lines({"int8": {"figures": figures, "rows": rows, "ort": ort}})
    fashion = next(line for line in lines if line.startswith(f"| {fig.FASHION} |"))
    assert "99.60%" in fashion and "92.30% -> 92.10% (+0.20)" in fashion
    assert "100 / 150 (1.50x)" in fashion and "64.00 / 32.00 (0.50x)" in fashion
    assert any(line.startswith(f"| {si.INT8_RESNET} |") for line in lines)
    assert si.int8_lines({}) == []  # a result from before the section: nothing


def test_a_run_without_int8_keeps_the_docs_int8_table(tmp_path: Path):
    from benchmarks import serve_int8 as si

    doc = tmp_path / "benchmarks.md"
    table = f"{si.INT8_HEAD}\n\n| model | agreement |\n|---|---|\n| fashion | 99.80% |\n\nNotes."
    doc.write_text(DOC.replace("old serving text", f"old serving text\n\n{table}\n"))
    kept = report.kept_int8(doc)
    assert kept == ["", *table.splitlines(), "", report.KEPT_NOTE, ""]
    report.replace_section(doc, "\n".join(["## Serving", "", "new", *kept]))
    assert report.kept_int8(doc) == kept  # kept again: the note once
    doc.write_text(DOC)
    assert report.kept_int8(doc) == []


def test_explain_section_is_the_ratio_of_medians_and_replaces_its_own_table(tmp_path):
    from benchmarks import serve_explain as ex

    rows = [
        {
            "model": m,
            "clients": c,
            "explain": e,
            "round": n,
            "p50_ms": p,
            "p99_ms": 2 * p,
            "ok_per_s": 100 / p,
        }
        for m in ex.EXPLAIN_MODELS
        for c in ex.EXPLAIN_LEVELS
        for e in (False, True)
        for n, p in enumerate((2.0, 4.0, 3.0) if e else (2.0, 2.0, 9.0))
    ]
    explain = {"rows": rows, "rounds": 3, "target": ex.TARGET}
    ratios = ex.explain_ratios(explain)
    assert len(ratios) == len(ex.EXPLAIN_MODELS) * len(ex.EXPLAIN_LEVELS)
    assert ratios[0]["p50_ms"] == (2.0, 3.0, 1.5)  # medians 2 and 3
    lines = ex.explain_lines({"explain": explain})
    assert lines[1] == ex.EXPLAIN_HEAD and "| Fashion CNN | 1 | 2.00 / 3.00 | 1.50x |" in lines[5]
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# B\n\n## Serving\n\ntext\n\n### int8 vs fp32\n\nint8\n\n## Next\n\nmore\n")
    splice_subsection(docs, ex.EXPLAIN_HEAD, lines)
    splice_subsection(docs, ex.EXPLAIN_HEAD, lines)  # again: replaced, not repeated
    text = docs.read_text()
    assert text.count(ex.EXPLAIN_HEAD) == 1
    assert text.index("int8") < text.index(ex.EXPLAIN_HEAD) < text.index("## Next")
    assert text.endswith("## Next\n\nmore\n")


def test_a_wrk_script_posts_to_its_path(tmp_path):
    script = load.wrk_script([b"png"], "image/png", tmp_path, "x", "/classify?explain=1")
    assert 'wrk.format("POST", "/classify?explain=1",' in script.read_text()
    plain = load.wrk_script([b"png"], "image/png", tmp_path, "y")
    assert 'wrk.format("POST", "/classify",' in plain.read_text()


def rounds_section(per_round: list[dict[str, tuple[float, float]]]) -> dict[str, Any]:
    """Section 0 with each round's (2xx/s, p99 ms) per role."""
    rows = []
    for n, roles in enumerate(per_round):
        for role, (ok, p99) in roles.items():
            server = role if role in (*load.BARE, *load.BENTOS) else "service"
            workers = 2 if role.startswith("start") else 1
            rows.append(
                row("rounds", fig.FASHION, server, workers, None, ok_per_s=ok, p99_ms=p99)
                | {"round": n, "role": role}
            )
    return {"rows": rows, "rounds": len(per_round), "seconds": 10, "warmup": 3}


ROUND_1 = {
    "service": (600.0, 30.0),
    "inline": (800.0, 20.0),
    "reference": (750.0, 40.0),
    "start-a": (900.0, 24.0),
    "start-b": (990.0, 26.0),
}
ROUND_2 = {
    "service": (400.0, 50.0),
    "inline": (800.0, 25.0),
    "reference": (500.0, 60.0),
    "start-a": (700.0, 40.0),
    "start-b": (500.0, 45.0),
}


def test_rounds_ratios_are_taken_within_each_round_and_read_by_their_median(tmp_path):
    """Section 0: each ratio within its round (p99: the worse start), the targets read
    the median over the rounds with its spread; the table lists every round and goes
    first among the Serving section's subsections, replacing its own on a rerun."""
    from benchmarks import serve_rounds as sr

    section = rounds_section([ROUND_1, ROUND_2, ROUND_1])
    got = sr.round_figures(section["rows"])
    assert [f["throughput_inline"] for f in got] == [0.75, 0.5, 0.75]
    assert got[1]["throughput"] == pytest.approx(0.8)
    assert got[0]["latency_inline"] == pytest.approx(26 / 20)
    assert got[1]["two_starts"] == pytest.approx(500 / 700)
    s = fig.summary({**result(), "rounds": section})
    t = s["targets"]
    assert t["throughput_inline"]["value"] == 0.75 and t["throughput_inline"]["met"] is True
    assert "median of 3 rounds (section 0), 0.50x-0.75x" in t["throughput_inline"]["text"]
    assert t["two_starts"]["value"] == pytest.approx(900 / 990)
    assert t["latency_inline"]["value"] == pytest.approx(1.3) and t["latency_inline"]["met"]
    assert t["latency"]["value"] == pytest.approx(0.8)  # not a rounds figure: as before
    lines = sr.rounds_lines({"rounds": section})
    assert lines[1] == sr.ROUNDS_HEAD and len([x for x in lines if x.startswith("| ")]) == 4
    assert "service / inline median **0.75x** (0.50-0.75)" in "\n".join(lines)
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# B\n\n## Serving\n\nintro\n\n### Targets\n\nt\n\n## Next\n\nkept\n")
    for _ in range(2):
        splice_subsection(docs, sr.ROUNDS_HEAD, lines, first=True)
    text = docs.read_text()
    assert text.count(sr.ROUNDS_HEAD) == 1 and text.index(sr.ROUNDS_HEAD) < text.index("### T")
    assert text.endswith("## Next\n\nkept\n")
    assert sr.ROUNDS_HEAD in report.markdown({**result(), "rounds": section})


def test_the_plain_bentoml_services_are_their_own_ratios_and_optional_in_a_round():
    """BentoML's share: lean BentoML / inline, the service / plain BentoML, per round and
    as medians; a round without the two BentoML services (older runs) keeps its figures."""
    from benchmarks import serve_rounds as sr

    bentos = {"bento-plain": (300.0, 90.0), "bento-lean": (560.0, 80.0)}
    section = rounds_section([ROUND_1 | bentos, ROUND_2])
    got = sr.round_figures(section["rows"])
    assert got[0]["lean_inline"] == pytest.approx(0.7) and got[0]["plain"] == 2.0
    assert "plain" not in got[1] and got[1]["throughput_inline"] == 0.5
    summary = sr.rounds_summary(section)
    assert summary["plain"]["rounds"] == [2.0] and summary["throughput_inline"]["median"] == 0.625
    table = "\n".join(sr.rounds_lines({"rounds": section}))
    assert "| 0.75x | 0.80x | 1.30x | 0.91x | 300 | 560 | 0.70x | 2.00x |" in table
    assert "| - | - | - | - |" in table
    assert "lean BentoML / inline median **0.70x**" in table
    targets = fig.summary({**result(), "rounds": section})["targets"]  # a full run's
    assert "lean_inline" not in targets and "plain" not in targets
    assert targets["throughput_inline"]["value"] == 0.625
    assert load.server_command("bento-lean", 1, 8)[1:3] == [
        "serve",
        "benchmarks.reference_bento:LeanClassifier",
    ]
    with pytest.raises(ValueError, match="one worker"):
        load.server_command("bento-plain", 2, 8)


def test_a_round_missing_a_server_is_left_out():
    from benchmarks import serve_rounds as sr

    partial = {k: v for k, v in ROUND_2.items() if k != "start-b"}
    section = rounds_section([ROUND_1, partial])
    assert [f["round"] for f in sr.round_figures(section["rows"])] == [0]
    assert sr.rounds_summary(None) == {} and sr.rounds_lines({}) == []
