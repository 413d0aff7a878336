"""`make bench-serve`'s section 0: the service on the small model against the two bare
servers, and two starts of `make serve`, interleaved in rounds (issue 44's three figures).

One server at a time would give each its own moment of a shared machine: in each round
every configuration is started, warmed up and loaded at 16 clients one after the other
(the order turned by one each round), and each ratio is taken within its round; the
table lists every round, and the targets read the median with its spread. The
configurations, all on the Fashion CNN with 28 px PNG uploads:

- the service, 1 worker, params.yaml's serve settings (``batching: auto`` as it is);
- the bare Starlette + ONNX Runtime server with the model inline on its event loop, and
  the one that hops to a thread per request (benchmarks/reference_server.py), 1 worker;
- `make serve`'s configuration (params.yaml as it is, ``workers: cpu_count``), started
  twice: its p99 against the inline bare server's, and the two starts' req/s;
- the same inline work in two plain BentoML services (benchmarks/reference_bento.py), 1
  worker: as BentoML's documentation writes one, and lean (every per-request cost removed
  that can be without changing BentoML): what BentoML itself costs a request, so the
  service / inline ratio can be read as BentoML's share and the service's own.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from benchmarks.harness.publish import publish_part, subsection
from benchmarks.serve_figures import LATENCY_CLIENTS
from benchmarks.serve_load import BARE, REPO, Bench

ROUNDS = 3
ROUNDS_HEAD = "### 0. The small model in rounds: service vs the bare servers, two starts"
ROUNDS_COLUMNS = (  # the table's header cells
    "round | service, 1 worker: 2xx/s, p99 ms | inline bare: 2xx/s, p99 ms | "
    "thread-hop bare: 2xx/s, p99 ms | `make serve`, two starts: 2xx/s, p99 ms | "
    "service / inline | service / thread hop | p99 `make serve` / inline | two starts | "
    "plain BentoML: 2xx/s | lean BentoML: 2xx/s | lean BentoML / inline | "
    "service / plain BentoML"
)
ROLES = ("service", "inline", "reference", "start-a", "start-b")
BENTO_ROLES = ("bento-plain", "bento-lean")  # measured since 2026-12-07: older rounds lack them
BENTO_KEYS = ("lean_inline", "plain")  # their figures: lean / inline, service / plain


def load_rounds(
    bench: Bench, fashion: dict[str, Any], batching: bool, rounds: int = ROUNDS
) -> dict[str, Any]:
    """Section 0: ``rounds`` rounds of the five configurations (order turned each round);
    ``batching``: what the start-up chose for params.yaml's (the rows' label)."""
    print(f"0. the small model in {rounds} rounds, {LATENCY_CLIENTS} clients", flush=True)
    one_worker = bench.params("rounds-service", workers=1)
    roles = ROLES + BENTO_ROLES
    for n in range(rounds):
        turn = n % len(roles)
        for role in roles[turn:] + roles[:turn]:
            label = {"round": n, "role": role}
            if role == "service":
                run = {"params": one_worker, "batching": batching}
            elif role in (*BARE, *BENTO_ROLES):
                run = {"server": role}
            else:  # make serve: params.yaml as it is
                run = {"params": REPO / "params.yaml", "workers": "cpu_count", "batching": batching}
            bench.run("rounds", **fashion, levels=(LATENCY_CLIENTS,), label=label, **run)
    rows = [r for r in bench.rows if r["section"] == "rounds"]
    return {"rows": rows, "rounds": rounds, "seconds": bench.seconds, "warmup": bench.warmup}


def round_figures(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per round: each role's row and the ratios taken within the round."""
    out = []
    for n in sorted({r["round"] for r in rows}):
        got = {r["role"]: r for r in rows if r["round"] == n}
        if any(role not in got for role in ROLES):
            continue
        svc, inline, ref = got["service"], got["inline"], got["reference"]
        starts = sorted(got[s]["ok_per_s"] for s in ("start-a", "start-b"))
        out.append(
            {
                "round": n,
                "rows": got,
                "throughput_inline": svc["ok_per_s"] / inline["ok_per_s"],
                "throughput": svc["ok_per_s"] / ref["ok_per_s"],
                # Both starts are `make serve`: the worse p99 of the two counts.
                "latency_inline": max(got[s]["p99_ms"] for s in ("start-a", "start-b"))
                / inline["p99_ms"],
                "two_starts": starts[0] / starts[1],
                **_bento_ratios(got),
            }
        )
    return out


def _bento_ratios(got: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The lean BentoML service / the inline bare server (BentoML's own cost), the service
    / the plain BentoML service (what a BentoML user gains); none in rounds without them."""
    if any(role not in got for role in BENTO_ROLES):
        return {}
    ok = {role: got[role]["ok_per_s"] for role in ("service", "inline", *BENTO_ROLES)}
    lean, plain = ok["bento-lean"] / ok["inline"], ok["service"] / ok["bento-plain"]
    return {"lean_inline": lean, "plain": plain}


def rounds_summary(section: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """Per figure: the median over the rounds, the lowest and highest, every round's."""
    figures = round_figures(section["rows"]) if section else []
    out = {}
    for key in ("throughput_inline", "throughput", "latency_inline", "two_starts", *BENTO_KEYS):
        values = [f[key] for f in figures if key in f]
        if values:
            out[key] = {
                "median": statistics.median(values),
                "low": min(values),
                "high": max(values),
                "rounds": values,
            }
    return out


def _rounds_table(section: dict[str, Any]) -> list[str]:
    """Section 0's rows, one per round, the medians over them and the note under them."""
    lines: list[str] = []
    for f in round_figures(section["rows"]):
        got = f["rows"]
        cells = [f"{got[r]['ok_per_s']:.0f}, {got[r]['p99_ms']:.1f}" for r in ROLES[:3]]
        starts = " / ".join(
            f"{got[s]['ok_per_s']:.0f}, {got[s]['p99_ms']:.1f}" for s in ("start-a", "start-b")
        )
        bentos = (
            f"{got['bento-plain']['ok_per_s']:.0f} | {got['bento-lean']['ok_per_s']:.0f} | "
            f"{f['lean_inline']:.2f}x | {f['plain']:.2f}x"
            if "plain" in f
            else "- | - | - | -"
        )
        lines.append(
            f"| {f['round'] + 1} | {' | '.join(cells)} | {starts} | "
            f"{f['throughput_inline']:.2f}x | {f['throughput']:.2f}x | "
            f"{f['latency_inline']:.2f}x | {f['two_starts']:.2f}x | {bentos} |"
        )
    s = rounds_summary(section)
    if s:
        said = ", ".join(
            f"{name} median **{s[key]['median']:.2f}x** ({s[key]['low']:.2f}-{s[key]['high']:.2f})"
            for key, name in (
                ("throughput_inline", "service / inline"),
                ("throughput", "service / thread hop"),
                ("latency_inline", "p99 / inline"),
                ("two_starts", "two starts"),
                ("lean_inline", "lean BentoML / inline"),
                ("plain", "service / plain BentoML"),
            )
            if key in s
        )
        lines += ["", f"Over the rounds: {said}."]
    lines += [
        "",
        f"{section['rounds']} rounds; in each, every server started fresh, {section['warmup']} s "
        f"of warm-up, then {section['seconds']} s of wrk at {LATENCY_CLIENTS} connections, one "
        "after the other (the order turned by one each round); a ratio is taken within its "
        "round. The service with 1 worker and `make serve`'s configuration (params.yaml as "
        "it is) serve `batching: auto` as the start-up decides it; p99 `make serve` / inline "
        "takes the worse of its two starts; two starts: lower / higher 2xx/s. Plain and lean "
        "BentoML (benchmarks/reference_bento.py, 1 worker, no access log): the inline bare "
        "server's work in a BentoML service as its documentation writes one (a typed "
        "`PIL.Image` input, a `dict` answer), and with every per-request cost removed that "
        "can be without changing BentoML (the body left for the method, a Starlette "
        "response, tracing's middleware skipping every URL, request metrics off, the api "
        "caller built once, the start-up heap frozen): lean / inline is what BentoML's "
        "fixed cost leaves of the bare server.",
    ]
    return lines


def rounds_lines(result: dict[str, Any]) -> list[str]:
    """Section 0 as markdown: every round's req/s and p99, the ratios within each round."""
    return subsection(result, "rounds", ROUNDS_HEAD, ROUNDS_COLUMNS, _rounds_table)


def publish_rounds(docs: Path, section: dict[str, Any], facts: dict[str, Any]) -> None:
    """``--rounds-only``: ``publish_part`` of section 0, first among the subsections
    (``facts``: the command and the machine)."""
    said = (
        "This part alone: the Targets and the sections below are the full run's named above (a "
        "full run now reads these four figures from its own section 0)."
    )
    run = {**facts, "said": said, "first": True}
    lines = rounds_lines({"rounds": section})
    publish_part(docs, "bench-serve-rounds", ROUNDS_HEAD, lines, section, run)
