"""The report for people: a table of facts and verdicts (stdout), what is broken (stderr)."""

from __future__ import annotations

import json
import sys
import textwrap
from typing import Any

from trainyard.doctor.terms import ERROR, OK, WARN, human_bytes, load_word, short_name


def _rows(doc: dict[str, Any]) -> list[tuple[str, str]]:
    cpu, ram, t, o = doc["cpu"] or {}, doc["ram"] or {}, doc["torch"] or {}, doc["onnxruntime"]
    rows = [
        (
            "CPU",
            f"{cpu.get('model')}: {cpu.get('logical_cores')} cores ({cpu.get('usable_cores')} "
            f"usable, {cpu.get('physical_cores')} physical); bf16: "
            f"{'yes' if cpu.get('bf16') else 'no'} ({', '.join(cpu.get('flags') or []) or '-'})",
        ),
        (
            "RAM",
            f"{human_bytes(ram.get('total_bytes'))} total, "
            f"{human_bytes(ram.get('available_bytes'))} available"
            + (
                f", container limit {human_bytes(ram['cgroup_limit_bytes'])}"
                if ram.get("cgroup_limit_bytes")
                else ""
            ),
        ),
    ]
    gpus = doc.get("gpus") or []
    driver = t.get("driver") or {}
    if not gpus:
        rows.append(("GPU", "none visible to the driver" if not driver.get("gpus") else "?"))
    for g in gpus:
        rows.append(
            (
                f"GPU {g['index']}",
                f"{g['name']}: {human_bytes(g.get('memory_bytes'))}"
                + (f" ({human_bytes(g['free_bytes'])} free)" if g.get("free_bytes") else "")
                + f", compute capability {g.get('compute_capability')}, bf16 "
                f"{'native' if g.get('bf16') else 'no'}, driver {g.get('driver')} (CUDA "
                f"{g.get('driver_cuda')}), torch CUDA runtime {g.get('cuda_runtime')}"
                + ("" if g.get("usable_by_torch") else "; NOT usable by torch"),
            )
        )
    if "version" in t:
        rows.append(
            (
                "torch",
                f"{t['version']}: "
                + (f"CUDA {t['cuda']} build" if t.get("cuda") else "CPU-only build")
                + (f", cuDNN {t['cudnn']}" if t.get("cudnn") else "")
                + f"; CUDA usable: {'yes' if t.get('cuda_available') else 'no'}",
            )
        )
    if o.get("version"):
        loads = "; ".join(f"{short_name(k)} {load_word(v)}" for k, v in o["loads"].items())
        build = ", ".join(short_name(p) for p in o["build_providers"])
        rows.append(("ONNX Runtime", f"{o.get('package') or o['version']}: build has {build}"))
        rows.append(("  loads", loads))
    for d in doc.get("disk") or []:
        rows.append(
            (
                f"disk ({d['what']})",
                f"{d['path']}: {human_bytes(d['free_bytes'])} free of "
                f"{human_bytes(d['total_bytes'])}",
            )
        )
    return rows


def render_table(doc: dict[str, Any], width: int = 100) -> str:
    """The readable report: facts, then every verdict with its why."""
    lines = [f"trainyard doctor (params {doc['params']['path']}, data {doc.get('data_dir')})", ""]
    rows = _rows(doc)
    key_w = max(len(k) for k, _ in rows) + 2
    for key, value in rows:
        wrapped = textwrap.wrap(value, width - key_w) or [""]
        lines.append(f"{key:<{key_w}}{wrapped[0]}")
        lines.extend(" " * key_w + w for w in wrapped[1:])
    lines += ["", "verdicts"]
    marks = {OK: "ok  ", WARN: "WARN", ERROR: "FAIL"}
    check_w = max(len(v["check"]) for v in doc["verdicts"]) + 2
    indent = " " * (8 + check_w)
    for v in doc["verdicts"]:
        head = textwrap.wrap(v["verdict"], width - len(indent)) or [""]
        lines.append(f"  {marks[v['level']]}  {v['check']:<{check_w}}{head[0]}")
        lines.extend(indent + h for h in head[1:])
        lines.extend(
            textwrap.wrap(
                "why: " + v["why"], width, initial_indent=indent, subsequent_indent=indent + "  "
            )
        )
    status = "ok" if doc["ok"] else "BROKEN"
    warned = sum(v["level"] == WARN for v in doc["verdicts"])
    lines += ["", f"{status}: {warned} warning(s), {doc.get('collect_s')} s"]
    return "\n".join(lines)


def emit(doc: dict[str, Any], as_json: bool = False) -> int:
    """Print the report (stdout) and what is broken (stderr); the exit status: 0 or 1."""
    print(json.dumps(doc, indent=2, default=str) if as_json else render_table(doc))
    broken = [v for v in doc["verdicts"] if v["level"] == ERROR]
    for v in broken:
        print(
            f"trainyard doctor: broken: {v['check']}: {v['verdict']}: {v['why']}",
            file=sys.stderr,
        )
    return 1 if broken else 0
