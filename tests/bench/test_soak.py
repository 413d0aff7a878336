"""`python -m benchmarks.soak`'s pure parts: statuses, RSS growth, verdict, the docs section.

The soak itself (a server, wrk, 60 s) is not run here: `make soak` is the check.
"""

from __future__ import annotations

from benchmarks import soak

MIB = 2**20


def test_statuses_are_counted_exactly_expected_4xx_are_not_errors():
    counts = soak.classify_statuses(
        {200: 700, 400: 200, 404: 100, 413: 200, 415: 100, 503: 3, 429: 2},
        {"connect": 1, "read": 0, "write": 0, "timeout": 2},
    )
    assert counts["2xx"] == 700
    assert counts["expected_4xx"] == 600
    assert counts["5xx"] == 3
    assert counts["socket_errors"] == 3
    assert counts["errors"] == 6  # 5xx + socket errors, nothing else
    assert counts["unexpected"] == {"429": 2}


def test_a_clean_run_has_no_errors():
    counts = soak.classify_statuses({200: 10, 400: 2}, {"connect": 0, "read": 0})
    assert counts["errors"] == 0 and counts["unexpected"] == {}


def test_rss_growth_is_end_over_first_sample_per_worker():
    growth = soak.rss_growth(
        {
            "11": [(0.0, 100 * MIB), (5.0, 130 * MIB), (10.0, 105 * MIB)],
            "12": [(0.0, 200 * MIB), (10.0, 230 * MIB)],
            "13": [],
        }
    )
    assert set(growth) == {"11", "12"}
    assert growth["11"]["start_mib"] == 100 and growth["11"]["end_mib"] == 105
    assert growth["11"]["peak_mib"] == 130
    assert abs(growth["11"]["growth"] - 0.05) < 1e-12
    assert abs(growth["12"]["growth"] - 0.15) < 1e-12
    assert growth["12"]["samples"] == 2


def result(growth_end: int = 105, statuses: dict | None = None, lost=()) -> dict:
    statuses = {200: 700, 400: 200, 404: 50, 413: 100, 415: 50} if statuses is None else statuses
    socket = {"connect": 0, "read": 0, "write": 0, "timeout": 0}
    r = {
        "date": "2026-12-03 08:00",
        "command": ".venv/bin/python -m benchmarks.soak",
        "machine": {"cpu": "Test CPU", "cores": 2, "loadavg": 0.5},
        "workers": 2,
        "access_log": True,
        "clients": 64,
        "seconds": 60,
        "warmup": 10,
        "interval": 5.0,
        "wrk": {
            "requests": 1100,
            "seconds": 60.0,
            "req_per_s": 18.3,
            "p50_ms": 12.0,
            "p99_ms": 80.0,
            "max_ms": 140.0,
        },
        "statuses": {str(s): n for s, n in statuses.items()},
        "socket": socket,
        "counts": soak.classify_statuses(statuses, socket),
        "rss": soak.rss_growth(
            {"11": [(0, 100 * MIB), (60, growth_end * MIB)], "12": [(0, 100 * MIB)] * 2}
        ),
        "workers_lost": list(lost),
    }
    r["verdict"] = soak.verdict(r)
    return r


def test_verdict_passes_only_without_errors_and_under_10_percent_growth():
    assert soak.verdict(result())["passed"]
    assert not soak.verdict(result(growth_end=110))["checks"]["rss"]  # 10% is over
    assert not soak.verdict(result(statuses={200: 10, 500: 1}))["checks"]["errors"]
    assert not soak.verdict(result(statuses={200: 10, 429: 1}))["checks"]["unexpected"]
    assert not soak.verdict(result(lost=[11]))["passed"]


def test_markdown_has_the_figures():
    md = soak.markdown(result())
    assert md.startswith("## Soak\n")
    assert "`.venv/bin/python -m benchmarks.soak` on 2026-12-03 08:00: Test CPU, 2 cores" in md
    assert "Result: **pass**. 0 errors (0 5xx, 0 socket)" in md
    assert "worst RSS growth per worker +5.0% (limit 10%)" in md
    assert "| 1,100 | 18 | 700 | 400 | 0 | 0 | 12.0 ms | 80.0 ms | 140 ms |" in md
    assert "| 11 | 100 MiB | 105 MiB | 105 MiB | +5.0% |" in md
    assert "| bomb_png | 1/13 | 413 |" in md
    assert "**FAIL**" in soak.markdown(result(statuses={200: 10, 502: 2}))


def test_soak_section_replaces_only_itself(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text(
        "# Benchmarks\n\n## Serving\n\nserving figures\n\n## Soak\n\nold soak\n\n"
        "<!-- bench:prepare:start -->\n## Prepare\n\nprepare figures\n<!-- bench:prepare:end -->\n"
    )
    soak.replace_section(doc, soak.markdown(result()), soak.SECTION)
    text = doc.read_text()
    assert "old soak" not in text and "Result: **pass**" in text
    assert "## Serving\n\nserving figures\n" in text
    assert "<!-- bench:prepare:start -->\n## Prepare\n\nprepare figures\n" in text
    assert text.count("## Soak") == 1


def test_the_mix_interleaves_every_request_kind():
    cycle = soak.interleave(soak.MIX)
    assert len(cycle) == sum(copies for _, copies, _ in soak.MIX)
    assert cycle[: len(soak.MIX)] == [name for name, _, _ in soak.MIX]
    assert cycle.count("png_multipart") == 4
