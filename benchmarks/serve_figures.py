"""`make bench-serve`'s plan and verdicts: the load levels, the two models, the targets of
the serving issue, and the figures computed from the measured rows (pure, no I/O)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

LEVELS = (1, 16, 64)  # throughput: wrk connections
BATCH_LEVELS = (16, 64)  # batching on/off
LATENCY_CLIENTS = 16  # latency, cold start and the throughput ratio
TOP = max(LEVELS)
FASHION, LARGE = "fashion", "resnet18"
# The targets of the serving issue. ``op`` compares the measured value with ``limit``.
TARGETS: dict[str, dict[str, Any]] = {
    "throughput": {
        "text": ">= 0.8x of reference: service (1 worker, params.yaml's batching) / reference "
        f"(1 worker), req/s at {LATENCY_CLIENTS} clients",
        "op": ">=",
        "limit": 0.8,
        "unit": "x",
    },
    "throughput_inline": {
        "text": ">= 0.75x of the inline bare server: service (1 worker, params.yaml's "
        f"batching) / Starlette + ORT with the model inline (1 worker), req/s at {LATENCY_CLIENTS} "
        "clients",
        "op": ">=",
        "limit": 0.75,
        "unit": "x",
    },
    "latency": {
        "text": f"p99 <= 1.0x of reference: `make serve`'s configuration / reference (as many "
        f"workers), {LATENCY_CLIENTS} clients",
        "op": "<=",
        "limit": 1.0,
        "unit": "x",
    },
    "latency_inline": {
        "text": f"p99 <= 1.3x of the inline bare server: `make serve`'s configuration / "
        f"Starlette + ORT with the model inline (1 worker, as in 1.), {LATENCY_CLIENTS} clients",
        "op": "<=",
        "limit": 1.3,
        "unit": "x",
    },
    "two_starts": {
        "text": "two starts of `make serve`'s configuration within 10%: lower / higher req/s, "
        f"{LATENCY_CLIENTS} clients",
        "op": ">=",
        "limit": 0.9,
        "unit": "x",
    },
    "cold_start": {
        "text": "first 5 s not at half speed: req/s in the first seconds after ready / "
        f"warm req/s, same server, {LATENCY_CLIENTS} clients",
        "op": ">=",
        "limit": 0.5,
        "unit": "x",
    },
    "batching": {
        "text": f"batching on / off >= 1.5x on the larger model ({LARGE}), 1 worker, {TOP} "
        "clients: 2xx req/s",
        "op": ">=",
        "limit": 1.5,
        "unit": "x",
    },
    "batching_cnn": {
        "text": f"batching on / off >= 1.0x on the Fashion CNN, 1 worker, {LATENCY_CLIENTS} "
        "clients: 2xx req/s",
        "op": ">=",
        "limit": 1.0,
        "unit": "x",
    },
    "watching": {
        "text": "p99 with the prediction log and a shadow on / off: service, workers "
        f"cpu_count, batching off, {LATENCY_CLIENTS} clients",
        "op": "<=",
        "limit": 1.1,
        "unit": "x",
    },
}


def pick(rows: Iterable[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    """The first row whose fields equal ``match`` (``phase`` defaults to "warm")."""
    match.setdefault("phase", "warm")
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


def pick_all(rows: Iterable[dict[str, Any]], **match: Any) -> list[dict[str, Any]]:
    """Every row whose fields equal ``match``."""
    return [r for r in rows if all(r.get(k) == v for k, v in match.items())]


def ratio(num: dict[str, Any] | None, den: dict[str, Any] | None) -> float | None:
    """2xx req/s of ``num`` / ``den``; None if either is missing or ``den`` served none."""
    if num is None or den is None or not den["ok_per_s"]:
        return None
    return num["ok_per_s"] / den["ok_per_s"]


def met(key: str, value: float | None) -> bool | None:
    """Whether ``value`` meets the target ``key``; None when it was not measured."""
    if value is None:
        return None
    t = TARGETS[key]
    return {">=": value >= t["limit"], "<=": value <= t["limit"], ">": value > t["limit"]}[t["op"]]


def batching_pair(
    rows: Iterable[dict[str, Any]], model: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(batching on, off) rows of ``model``: the service, 1 worker, warm; for the Fashion
    CNN the "off" rows are the throughput run's."""
    on, off = [], []
    for r in rows:
        if (
            r["model"] == model
            and r["server"] == "service"
            and r["workers"] == 1
            and r["phase"] == "warm"
            and r["section"] in ("throughput", "batching")
            and r["clients"] in BATCH_LEVELS
        ):
            (on if r["batching"] else off).append(r)
    return on, off


def in_rounds(section: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """Section 0's figures (benchmarks.serve_rounds), when the run has them."""
    from benchmarks.serve_rounds import rounds_summary  # it imports this module's levels

    return rounds_summary(section) if section else {}


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The figures the serving issue asks for, and each target's verdict."""
    rows = result["rows"]
    out: dict[str, Any] = {}
    svc1 = pick_all(rows, section="throughput", server="service")
    for key, bare in (("throughput", "reference"), ("throughput_inline", "inline")):
        ref1 = pick_all(rows, section="throughput", server=bare)
        out[key] = {c: ratio(pick(svc1, clients=c), pick(ref1, clients=c)) for c in LEVELS}
    lat = pick(rows, section="latency", server="service")
    ref = pick(rows, section="latency", server="reference")
    out["latency_p99_ms"] = [r["p99_ms"] if r else None for r in (lat, ref)]
    # The yardstick: the one-worker inline server (2 uvicorn workers split wrk's
    # connections unevenly, as the service's did before trainyard.serve.balance).
    inline = pick(rows, section="throughput", server="inline", clients=LATENCY_CLIENTS)
    out["latency_inline_p99_ms"] = inline["p99_ms"] if inline else None
    again = pick(rows, section="repeat", server="service")
    starts = sorted(r["ok_per_s"] for r in (lat, again) if r)
    out["starts_per_s"] = starts
    cold = result.get("cold_start") or {}
    first = pick(rows, phase="first")
    warm = pick(rows, run=cold.get("run"))
    out["cold_ready_s"] = cold.get("ready_s")
    out["cold_ratio"] = ratio(first, warm) if first else None
    out["batching"] = {}
    for model in (FASHION, LARGE):
        on, off = batching_pair(rows, model)
        out["batching"][model] = {
            c: ratio(pick(on, clients=c), pick(off, clients=c)) for c in BATCH_LEVELS
        }
    watched = [pick(rows, section="watching", watching=on) for on in ("log+shadow", "off")]
    out["watching_p99_ms"] = [r["p99_ms"] if r else None for r in watched]
    values = _target_values(out, starts)
    texts = {k: TARGETS[k]["text"] for k in values}
    out["rounds"] = in_rounds(result.get("rounds"))
    for key, figure in out["rounds"].items():  # section 0's medians: interleaved, longer
        if key not in texts:  # BentoML's own share (lean, plain): reported, not a target
            continue
        values[key] = figure["median"]
        texts[key] += (
            f"; median of {len(figure['rounds'])} rounds (section 0), "
            f"{figure['low']:.2f}x-{figure['high']:.2f}x"
        )
    out["targets"] = {
        k: {"value": v, "met": met(k, v), "text": texts[k]} for k, v in values.items()
    }
    service_rows = [r for r in rows if r["server"] == "service"]
    out["non_2xx"] = sum(r["non_2xx"] for r in service_rows)
    out["socket_errors"] = sum(r["socket_errors"] for r in rows)
    out["shed"] = sum(r["shed"] or 0 for r in service_rows)
    return out


def _target_values(out: dict[str, Any], starts: list[float]) -> dict[str, float | None]:
    """Each target's figure from the summary so far (None where a row is missing)."""
    on_ms, off_ms = out["watching_p99_ms"]
    svc_ms, ref_ms = out["latency_p99_ms"]
    inline_ms = out["latency_inline_p99_ms"]
    return {
        "throughput": out["throughput"][LATENCY_CLIENTS],
        "throughput_inline": out["throughput_inline"][LATENCY_CLIENTS],
        "latency": svc_ms / ref_ms if svc_ms and ref_ms else None,
        "latency_inline": svc_ms / inline_ms if svc_ms and inline_ms else None,
        "two_starts": starts[0] / starts[1] if len(starts) == 2 and starts[1] else None,
        "cold_start": out["cold_ratio"],
        "batching": out["batching"][LARGE][TOP],
        "batching_cnn": out["batching"][FASHION][LATENCY_CLIENTS],
        "watching": on_ms / off_ms if on_ms and off_ms else None,
    }


def ort_rows(
    result: dict[str, Any], model: str, callers: int = 1, threads: int | None = None
) -> list[dict[str, Any]]:
    """ONNX Runtime rows of ``model`` with ``callers`` threads calling at once and
    ``threads`` intra-op threads (default: the service's)."""
    want = result["threads"] if threads is None else threads
    return [
        r
        for r in result["onnx_runtime"].get(model) or []
        if r.get("callers", 1) == callers and r.get("threads", result["threads"]) == want
    ]
