"""`make bench-prepare`'s report: the tables and the "Prepare" section of docs/benchmarks.md,
from the run's result."""

from __future__ import annotations

from typing import Any

import trainyard.data.arrays as arrays_module
from benchmarks.harness.ratios import ratio_bullets

STATS_BYTES = getattr(arrays_module, "_STATS_BYTES", 16 << 20)


def table(result: dict[str, Any]) -> str:
    """Every configuration: images, wall time, images/s, peak RSS, output size."""
    lines = [
        "| configuration | images | wall s | images/s | peak RSS MiB | output MiB |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in result["runs"]:
        lines.append(
            f"| {r['name']} | {r['images']:,} | {r['wall_s']:.1f} | "
            f"{r['images_per_s']:,.0f} | {r['peak_rss_mib']:,.0f} | {r['output_mib']:,.0f} |"
        )
    return "\n".join(lines)


def phases_table(result: dict[str, Any]) -> str:
    """Where each configuration's time and memory went."""
    lines = [
        "| configuration | pool | header pass s | decode pass s | stats s | hash s | "
        "rest s | RSS main, passes MiB | RSS main MiB | RSS worker MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["runs"]:
        p = r["phases_s"]
        rest = r["wall_s"] - sum(p.values())
        lines.append(
            f"| {r['name']} | {r['pool_workers']} | {p['header_pass_s']:.1f} | "
            f"{p['decode_pass_s']:.1f} | {p['stats_s']:.1f} | {p['hash_s']:.1f} | "
            f"{rest:.1f} | {r['rss_main_passes_mib']:,.0f} | {r['rss_main_mib']:,.0f} | "
            f"{r['rss_worker_mib']:,.0f} |"
        )
    return "\n".join(lines)


def markdown(result: dict[str, Any]) -> str:
    """The "Prepare" section of docs/benchmarks.md."""
    hw, ds = result["hardware"], result["dataset"]
    gen = f"{ds['how']} in {ds['generation_s']:.1f} s" + (
        ", reused from an earlier run" if ds["reused"] else ""
    )
    lines = [
        "## Prepare: image folder -> memory-mapped arrays",
        "",
        f"Measured {result['date']} on {hw['cpu']}, {hw['cores']} cores "
        f"({hw['cores_usable']} usable), Python {hw['python']}, Pillow {hw['pillow']}, "
        f"with `{result['command']}`.",
        "",
        f"The folder: {ds['images']:,} RGB JPEGs ({ds['bytes'] / 2**20:,.0f} MiB, {gen}), "
        f"JPEG quality {ds['jpeg_quality']}, width and height each uniform in "
        f"{ds['size_range_px'][0]}-{ds['size_range_px'][1]} px, in {ds['classes']} class "
        f"folders; image i is drawn with `numpy.random.default_rng([seed={ds['seed']}, i])` "
        f"by {ds['drawn_with']} (shape kind cycling circle/square/triangle over the "
        f"classes) plus Gaussian noise of sigma {ds['noise_sigma']:g} grey levels. "
        f"The N/4 row runs on the first {result['subset']['images']:,} of the same files. "
        "Every file was read once before the runs (page cache warm for all). Each row is "
        "one `prepare` (source `folder`, resize `crop`, val/test fractions 0.1) in a "
        "fresh process; wall time excludes interpreter start-up; images/s = images "
        "prepared / wall time; peak RSS is the largest single process (the stage's own "
        "process or its largest pool worker; `VmHWM` or `ru_maxrss`, which include "
        "resident pages of the memory-mapped output); output = the prepared folder's size.",
        "",
        table(result),
        "",
    ]
    lines += ratio_bullets(result["ratios"])
    runs = result["runs"]
    passes = [r["rss_main_passes_mib"] for r in runs]
    workers = [r["rss_worker_mib"] for r in runs if r["pool_workers"] > 1]
    lines += [
        "",
        f"While streaming (both passes) the prepare process peaks at {min(passes):,.0f}-"
        f"{max(passes):,.0f} MiB in every row"
        + (f" and each pool worker at {max(workers):,.0f} MiB at most" if workers else "")
        + ", whatever the image count. The statistics pass after it (`channel_stats`) reads "
        f"the train array in {STATS_BYTES / 2**20:,.0f} MiB blocks with plain reads (not a "
        "memory map, whose touched pages would count as resident), so it adds about three "
        "blocks: one read, its uint16 squares.",
    ]
    lines += [
        "",
        "Where the time and memory went (pool: the worker processes prepare started; "
        "header/decode pass: its two passes over the files; stats: the train split's "
        "per-channel mean/std; hash: sha256 of the arrays; RSS main, passes: the prepare "
        "process's peak before the statistics, i.e. while streaming into the memory maps):",
        "",
        phases_table(result),
        "",
    ]
    return "\n".join(lines)


def print_summary(result: dict[str, Any]) -> None:
    """The tables and the ratios, on the console."""
    ratios = "".join(f"{k}: {v:.2f}x\n" for k, v in result["ratios"].items())
    print(f"\n{table(result)}\n\n{ratios}\n{phases_table(result)}")
