"""`make soak`: a bounded load test of the service on 127.0.0.1, good and bad requests mixed.

``bentoml serve bento.service:ImageClassifier`` with params.yaml as it is (what
``make serve`` runs, on a free port) takes wrk's load for ``--seconds`` (default 60) at
``--clients`` connections (default 64) after a warm-up. wrk cycles through a fixed mix:
Fashion-MNIST PNGs as multipart uploads, raw JPEG bodies, batches of 4, and requests the
service must refuse with their 4xx (a corrupt image, a wrong content type, a JSON batch
over ``serve.max_batch_images``, a decompression bomb, an empty body, an unknown route).

Pass: 0 errors, i.e. no 5xx and no socket error (connect, read, write, timeout), every
answer a 2xx or one of the mix's expected 4xx; and each worker's RSS at the end within
10% of its RSS after the warm-up (both sampled idle; sampled every ``--interval`` s
meanwhile for the peak). wrk's own error count lumps every non-2xx/3xx together, so the
Lua script counts each status code exactly in its ``response`` callback.

Writes reports/soak.json and the "## Soak" section of docs/benchmarks.md (other sections
are left as they are); ``--render`` rewrites that section from the JSON alone. Exits 1
when the run fails. Not part of `make test`.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from benchmarks.harness.host_facts import load_facts
from benchmarks.harness.publish import replace_section
from benchmarks.harness.rss import RssSampler, worker_pids
from benchmarks.serve_load import (
    BOUNDARY,
    REPO,
    multipart_body,
    photo_jpegs,
    png_images,
    preflight,
    start_server,
    stop_server,
    test_images,
    wrk_summary,
)

SECTION = "## Soak"
RSS_LIMIT = 0.10  # growth per worker, end vs after warm-up
# (name, copies in each cycle of the mix, statuses that count as right)
MIX: tuple[tuple[str, int, tuple[int, ...]], ...] = (
    ("png_multipart", 4, (200,)),
    ("jpeg_raw", 2, (200,)),
    ("batch_4", 1, (200,)),
    ("corrupt_image", 1, (400,)),
    ("wrong_content_type", 1, (415,)),
    ("json_too_many_images", 1, (413,)),
    ("bomb_png", 1, (413,)),
    ("empty_body", 1, (400,)),
    ("unknown_route", 1, (404,)),
)

LUA = """
local specs = {%(specs)s}
local requests = {}
local n = 0
statuses = {}
local threads = {}
setup = function(thread)
  table.insert(threads, thread)
end
init = function(args)
  for i, s in ipairs(specs) do
    local body = nil
    if s.path_body ~= "" then
      local f = assert(io.open(s.path_body, "rb"))
      body = f:read("*all")
      f:close()
    end
    local headers = {}
    if s.ctype ~= "" then headers["Content-Type"] = s.ctype end
    if s.method == "POST" and body == nil then body = "" end
    requests[i] = wrk.format(s.method, s.path, headers, body)
  end
end
request = function()
  n = n + 1
  return requests[((n - 1) %% #requests) + 1]
end
response = function(status, headers, body)
  statuses[status] = (statuses[status] or 0) + 1
end
done = function(summary, latency, reqs)
  local total = {}
  for _, t in ipairs(threads) do
    for code, count in pairs(t:get("statuses")) do
      total[code] = (total[code] or 0) + count
    end
  end
  local parts = {}
  for code, count in pairs(total) do
    table.insert(parts, string.format('"%%d": %%d', code, count))
  end
  local e = summary.errors
  io.write(string.format(
    'SOAKJSON {"requests": %%d, "duration_us": %%d, "p50_us": %%d, "p99_us": %%d, ' ..
    '"max_us": %%d, "socket": {"connect": %%d, "read": %%d, "write": %%d, "timeout": %%d}, ' ..
    '"statuses": {%%s}}\\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    latency.max, e.connect, e.read, e.write, e.timeout, table.concat(parts, ", ")))
end
"""


# ---------------------------------------------------------------------------- the mix


def mix_bodies(max_batch_images: int) -> dict[str, tuple[str, str, str, bytes | None]]:
    """name -> (method, path, Content-Type, body) for each kind of request in the mix."""
    from PIL import Image

    pngs = png_images(test_images(4))
    jpeg = photo_jpegs(1)[0]
    batch = (
        b"".join(
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="images"; '
            f'filename="{i}.png"\r\nContent-Type: image/png\r\n\r\n'.encode()
            + data
            + b"\r\n"
            for i, data in enumerate(pngs)
        )
        + f"--{BOUNDARY}--\r\n".encode()
    )
    bomb = io.BytesIO()
    Image.new("1", (30_000, 30_000)).save(bomb, "PNG")  # 900 megapixels in ~110 kB
    zeros = [[0] * 28] * 28
    too_many = json.dumps({"images": [zeros] * (max_batch_images + 1)}, separators=(",", ":"))
    form = f"multipart/form-data; boundary={BOUNDARY}"
    return {
        "png_multipart": ("POST", "/classify", form, multipart_body(pngs[0], "0.png", "image/png")),
        "jpeg_raw": ("POST", "/classify", "image/jpeg", jpeg),
        "batch_4": ("POST", "/classify_batch", form, batch),
        "corrupt_image": ("POST", "/classify", "image/png", b"\x89PNG\r\n\x1a\n" + b"junk" * 64),
        "wrong_content_type": ("POST", "/classify", "text/plain", b"not an image"),
        "json_too_many_images": ("POST", "/classify_batch", "application/json", too_many.encode()),
        "bomb_png": ("POST", "/classify", "image/png", bomb.getvalue()),
        "empty_body": ("POST", "/classify", "image/png", b""),
        "unknown_route": ("GET", "/no-such-route", "", None),
    }


def lua_script(folder: Path, bodies: dict[str, tuple[str, str, str, bytes | None]]) -> Path:
    """The wrk script: the mix in a fixed interleaved order, cycled by every connection."""
    specs = []
    for name in interleave(MIX):
        method, path, ctype, body = bodies[name]
        body_path = ""
        if body:
            file = folder / f"{name}.bin"
            if not file.exists():
                file.write_bytes(body)
            body_path = str(file)
        m, pa, ct, bp = (json.dumps(v) for v in (method, path, ctype, body_path))
        specs.append(f"{{method={m}, path={pa}, ctype={ct}, path_body={bp}}}")
    script = folder / "soak.lua"
    script.write_text(LUA % {"specs": ", ".join(specs)})
    return script


def interleave(mix: Iterable[tuple[str, int, tuple[int, ...]]]) -> list[str]:
    """One cycle of the mix, copies spread out: [a, b, c, a, b, a, ...]."""
    mix = list(mix)
    out: list[str] = []
    for round_ in range(max(copies for _, copies, _ in mix)):
        out += [name for name, copies, _ in mix if copies > round_]
    return out


# ---------------------------------------------------------------------------- figures


def classify_statuses(
    statuses: dict[int, int], socket_errors: dict[str, int], mix=MIX
) -> dict[str, Any]:
    """Exact counts: 2xx, the expected 4xx, 5xx, anything else (unexpected), socket errors.
    Errors = 5xx + socket errors; a run passes with 0 errors and 0 unexpected."""
    expected_4xx = {s for _, _, codes in mix for s in codes if s >= 400}
    ok = sum(n for s, n in statuses.items() if 200 <= s < 300)
    refused = sum(n for s, n in statuses.items() if s in expected_4xx)
    server = sum(n for s, n in statuses.items() if s >= 500)
    unexpected = {s: n for s, n in statuses.items() if not (200 <= s < 300) and s < 500}
    unexpected = {s: n for s, n in unexpected.items() if s not in expected_4xx}
    sockets = sum(socket_errors.values())
    return {
        "2xx": ok,
        "expected_4xx": refused,
        "5xx": server,
        "unexpected": {str(s): n for s, n in sorted(unexpected.items())},
        "socket_errors": sockets,
        "errors": server + sockets,
    }


def rss_growth(samples: dict[str, list[tuple[float, int]]]) -> dict[str, dict[str, Any]]:
    """Per worker, from its (seconds, RSS bytes) samples, first = after warm-up and last =
    at the end: start, end and peak MiB and the growth end / start - 1."""
    out = {}
    for pid, rows in samples.items():
        if not rows:
            continue
        start, end = rows[0][1], rows[-1][1]
        out[pid] = {
            "start_mib": start / 2**20,
            "end_mib": end / 2**20,
            "peak_mib": max(r for _, r in rows) / 2**20,
            "growth": end / start - 1 if start else None,
            "samples": len(rows),
        }
    return out


def verdict(result: dict[str, Any]) -> dict[str, Any]:
    """Pass: no errors, no unexpected status, RSS growth under the limit, no worker lost."""
    counts, rss = result["counts"], result["rss"]
    growth = [w["growth"] for w in rss.values() if w["growth"] is not None]
    worst = max(growth) if growth else None
    checks = {
        "errors": counts["errors"] == 0,
        "unexpected": not counts["unexpected"],
        "rss": worst is not None and worst < RSS_LIMIT,
        "workers_stable": not result.get("workers_lost"),
    }
    return {"max_growth": worst, "checks": checks, "passed": all(checks.values())}


def markdown(result: dict[str, Any]) -> str:
    """The "## Soak" section of docs/benchmarks.md."""
    c, v, w = result["counts"], result["verdict"], result["wrk"]
    mark = "**pass**" if v["passed"] else "**FAIL**"
    share = {name: copies for name, copies, _ in MIX}
    cycle = sum(share.values())
    lines = [
        SECTION,
        "",
        f"`{result['command']}` on {result['date']}: {result['machine']['cpu']}, "
        f"{result['machine']['cores']} cores, load average {result['machine']['loadavg']:.2f} "
        f"at the start. `bentoml serve` with params.yaml as it is ({result['workers']} "
        f"worker(s), `serve.access_log` = {str(result['access_log']).lower()}), wrk on "
        f"127.0.0.1 (one thread, keep-alive, 10 s timeout) at {result['clients']} clients "
        f"for {result['seconds']} s after a {result['warmup']} s warm-up. Each connection "
        f"cycles through a mix of {cycle} requests; wrk's Lua `response` callback counts "
        "every status code exactly. Errors are 5xx answers and socket errors; the refusals "
        "the mix asks for are expected.",
        "",
        f"Result: {mark}. {c['errors']} errors ({c['5xx']} 5xx, {c['socket_errors']} socket), "
        f"{len(c['unexpected'])} unexpected status codes; worst RSS growth per worker "
        f"{_pct(v['max_growth'])} (limit {RSS_LIMIT:.0%}).",
        "",
        "| requests | req/s | 2xx | expected 4xx | 5xx | socket errors | p50 | p99 | max |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {w['requests']:,} | {w['req_per_s']:,.0f} | {c['2xx']:,} | {c['expected_4xx']:,} "
        f"| {c['5xx']} | {c['socket_errors']} | {w['p50_ms']:.1f} ms | {w['p99_ms']:.1f} ms "
        f"| {w['max_ms']:.0f} ms |",
        "",
        "Status codes: "
        + ", ".join(f"{s}: {n:,}" for s, n in sorted(result["statuses"].items()))
        + ". Socket errors: "
        + ", ".join(f"{k} {n}" for k, n in result["socket"].items())
        + ".",
        "",
        "| request in the mix | share | expected |",
        "|---|---:|---|",
        *(
            f"| {name} | {copies}/{cycle} | {', '.join(map(str, codes))} |"
            for name, copies, codes in MIX
        ),
        "",
        f"RSS per worker, sampled every {result['interval']} s: after the warm-up (idle), "
        "peak under load, at the end (idle).",
        "",
        "| worker pid | after warm-up | peak | end | growth |",
        "|---|---:|---:|---:|---:|",
        *(
            f"| {pid} | {r['start_mib']:.0f} MiB | {r['peak_mib']:.0f} MiB "
            f"| {r['end_mib']:.0f} MiB | {_pct(r['growth'])} |"
            for pid, r in result["rss"].items()
        ),
        "",
    ]
    if result.get("workers_lost"):
        lines += [f"Workers gone during the run (crashed and respawned): {result['workers_lost']}"]
        lines.append("")
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


# ---------------------------------------------------------------------------- the run


def run_wrk(url: str, script: Path, clients: int, seconds: int) -> dict[str, Any]:
    """One wrk run of the mix: rates, latencies, socket errors and each status code's count."""
    r = wrk_summary(url, script, clients, seconds, "SOAKJSON")
    secs = max(r["duration_us"] / 1e6, 1e-9)
    return {
        "requests": r["requests"],
        "seconds": round(secs, 3),
        "req_per_s": r["requests"] / secs,
        "p50_ms": r["p50_us"] / 1000,
        "p99_ms": r["p99_us"] / 1000,
        "max_ms": r["max_us"] / 1000,
        "socket": r["socket"],
        "statuses": {int(k): v for k, v in r["statuses"].items()},
    }


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line of ``python -m benchmarks.soak``."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.soak", description=__doc__.splitlines()[0]
    )
    p.add_argument("--seconds", type=int, default=60, help="load, s (after the warm-up)")
    p.add_argument("--clients", type=int, default=64, help="wrk connections")
    p.add_argument("--warmup", type=int, default=10, help="load before the first RSS sample, s")
    p.add_argument("--interval", type=float, default=5.0, help="RSS sampling period, s")
    p.add_argument("--docs", default=str(REPO / "docs/benchmarks.md"))
    p.add_argument("--json", default=str(REPO / "reports/soak.json"))
    p.add_argument("--render", action="store_true", help="only rewrite the docs from --json")
    return p.parse_args(argv)


def soak_run(args: argparse.Namespace, settings: Any, tmp: Path) -> dict[str, Any]:
    """The service started, warmed up, then loaded while each worker's RSS is sampled:
    wrk's figures, the workers, their samples, those lost, and the server log's tail."""
    script = lua_script(tmp, mix_bodies(settings.max_batch_images))
    model = REPO / "models/model.onnx"
    proc, url, ready_s = start_server(REPO / "params.yaml", model, tmp / "serve.log")
    try:
        pids = worker_pids(proc.pid)
        print(f"ready in {ready_s:.1f} s, workers {pids}; warm-up {args.warmup} s", flush=True)
        run_wrk(url, script, args.clients, args.warmup)
        time.sleep(1)  # idle: what the warm-up left, not what is in flight
        sampler = RssSampler(pids, args.interval)
        sampler.sample()
        sampler.start()
        print(f"soak: {args.clients} clients for {args.seconds} s", flush=True)
        load = run_wrk(url, script, args.clients, args.seconds)
        time.sleep(1)
        sampler.stop()
        sampler.sample()
        lost = sorted(set(sampler.lost) | (set(pids) - set(worker_pids(proc.pid))))
    finally:
        stop_server(proc)
        log_tail = (tmp / "serve.log").read_text(errors="replace")[-2000:]
    return {"load": load, "pids": pids, "samples": sampler.samples, "lost": lost, "log": log_tail}


def main(argv: list[str] | None = None) -> int:
    """`make soak`; ``--render`` only rewrites the docs section from the JSON."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.render:
        result = json.loads(Path(args.json).read_text())
        replace_section(Path(args.docs), markdown(result), SECTION)
        return 0 if result["verdict"]["passed"] else 1
    ready = preflight("soak", "benchmarks.soak", argv)
    if ready is None:
        return 2
    settings, command = ready
    from trainyard.core.io import atomic_write_json

    machine = load_facts()
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp_name:
        run = soak_run(args, settings, Path(tmp_name))
    load = run["load"]
    statuses = load.pop("statuses")
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": command,
        "machine": machine,
        "workers": len(run["pids"]),
        "access_log": settings.access_log,
        "clients": args.clients,
        "seconds": args.seconds,
        "warmup": args.warmup,
        "interval": args.interval,
        "mix": [{"name": n, "copies": c, "expected": list(e)} for n, c, e in MIX],
        "wrk": {k: v for k, v in load.items() if k != "socket"},
        "statuses": {str(s): n for s, n in sorted(statuses.items())},
        "socket": load["socket"],
        "counts": classify_statuses(statuses, load["socket"]),
        "rss": rss_growth(run["samples"]),
        "rss_samples": run["samples"],
        "workers_lost": run["lost"],
    }
    result["verdict"] = verdict(result)
    atomic_write_json(args.json, result)
    replace_section(Path(args.docs), markdown(result), SECTION)
    c, v = result["counts"], result["verdict"]
    print(
        f"{load['requests']:,} requests ({load['req_per_s']:,.0f}/s): {c['2xx']:,} 2xx, "
        f"{c['expected_4xx']:,} expected 4xx, {c['5xx']} 5xx, {c['socket_errors']} socket "
        f"errors, unexpected {c['unexpected'] or 'none'}; worst RSS growth "
        f"{_pct(v['max_growth'])}: {'pass' if v['passed'] else 'FAIL'}"
    )
    print(f"wrote {args.json} and the '{SECTION}' section of {args.docs}")
    if not v["passed"]:
        print(f"server log tail:\n{run['log']}", file=sys.stderr)
    return 0 if v["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
