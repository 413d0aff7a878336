"""The training benchmark's docs section and chart, from its JSON result."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import bench_datapaths as datapaths
from benchmarks import bench_finetune as finetune
from benchmarks import bench_predict_gpu as predict_gpu
from benchmarks.harness.host_facts import hardware_label
from benchmarks.harness.ratios import ratio_table


def markdown(result: dict[str, Any]) -> str:
    """This hardware's section of docs/benchmarks.md, from the result."""
    hw = result["hardware"]
    lines = [
        f"### {hardware_label(hw)}",
        "",
        f"Measured {result['date']} at commit {result['commit']} with "
        f"`{result['command']}`; torch {hw['torch']}, "
        f"onnxruntime {hw.get('onnxruntime')}.",
        "",
    ]
    lines += _training_lines(result.get("training"))
    if result.get("folder_data_paths"):
        lines += datapaths.markdown(result["folder_data_paths"])
    lines += _inference_lines(result.get("inference"))
    lines += default_plan_markdown(result.get("default_plan"))
    lines += finetune.markdown(result.get("finetune"))
    lines += predict_gpu.markdown(result.get("predict"))
    ttt = result.get("time_to_target")
    if ttt:
        reached = ttt["reached"]
        lines += [
            f"**Time to {ttt['target']:.0%} test accuracy** (`fast` preset, "
            f"{ttt['device']}, {ttt['precision']}): "
            + (
                f"{reached['train_s']:.2f} s of training, epoch {reached['epoch']}"
                if reached
                else f"not reached in {len(ttt['history'])} epochs"
            ),
            "",
        ]
    return "\n".join(lines)


def _training_lines(tr: dict[str, Any] | None) -> list[str]:
    """The training throughput table, its ratios and the GPU's utilisation (none: [])."""
    if not tr:
        return []
    lines = [
        f"**Training throughput** ({tr['arch']}, batch {tr['batch_size']}, "
        f"{tr['steps']} timed steps after {tr['warmup']} warm-up, median of "
        f"{tr['repeats']})",
        "",
        "| configuration | img/s |",
        "|---|---:|",
    ]
    lines += [f"| {k} | {v['median']:,.0f} |" for k, v in tr["img_per_s"].items()]
    lines += ["", *ratio_table(tr["ratios"])]
    util = tr.get("gpu_utilisation", {})
    lines += [
        "",
        "GPU utilisation during the fast path: "
        + (
            f"{util['mean_pct']:.0f}% mean, {util['median_pct']:.0f}% median "
            f"({util['samples']} NVML samples)"
            if util.get("mean_pct") is not None
            else util.get("skipped", "n/a")
        ),
        "",
    ]
    return lines


def _inference_lines(inf: dict[str, Any] | None) -> list[str]:
    """The torch vs ONNX Runtime latency table (none: [])."""
    if not inf:
        return []
    lines = [
        f"**Inference** ({inf['arch']}; latency = median per call)",
        "",
        "| device | batch | torch eager ms | ORT ms | ORT/torch latency | "
        "torch img/s | ORT img/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in inf["rows"]:
        ort_ms = f"{r['ort_s'] * 1e3:.3f}" if "ort_s" in r else "n/a"
        ratio = f"{r['ort_over_torch_latency']:.2f}x" if "ort_s" in r else "n/a"
        ort_ips = f"{r['ort_img_per_s']:,.0f}" if "ort_s" in r else "n/a"
        lines.append(
            f"| {r['device']} | {r['batch']} | {r['torch_s'] * 1e3:.3f} | {ort_ms} "
            f"| {ratio} | {r['torch_img_per_s']:,.0f} | {ort_ips} |"
        )
    lines.append("")
    return lines


def chart(result: dict[str, Any], path: Path) -> None:
    """The result's img/s bar charts (training, inference, image folder) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = result.get("folder_data_paths", {}).get("img_per_s", {})
    panels = 3 if folder else 2
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.5), dpi=100)
    tr = result.get("training", {}).get("img_per_s", {})
    bars(axes[0], list(tr), {"median": [tr[n]["median"] for n in tr]}, "training img/s")
    if folder:
        bars(
            axes[2],
            list(folder),
            {"median": [folder[n]["median"] for n in folder]},
            "training img/s from an image folder",
        )
    rows = result.get("inference", {}).get("rows", [])
    bars(
        axes[1],
        [f"{r['device']} batch {r['batch']}" for r in rows],
        {
            "torch eager": [r["torch_img_per_s"] for r in rows],
            "ONNX Runtime": [r.get("ort_img_per_s", 0) for r in rows],
        },
        "inference img/s",
    )
    axes[1].legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)
    fig.suptitle(f"trainyard benchmark — {hardware_label(result['hardware'])}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def default_plan_markdown(dp: dict[str, Any] | None) -> list[str]:
    """The default plan's rows (benchmarks/bench_default_plan.py) as Markdown lines."""
    if not dp or "plan" not in dp:
        return [f"**Default plan**: {dp['skipped']}", ""] if dp else []
    choices = dp["plan"]["choices"]
    loop, run, cpu = dp["loop"], dp["to_target"], dp["cpu_default"]
    busy = run["gpu_busy"]
    busy_text = f"{busy['mean_pct']:.0f}%" if busy.get("mean_pct") is not None else "n/a"
    reached = run["reached"]
    ratio = dp.get("gpu_over_cpu_time_to_target")
    plan = ", ".join(f"{k} {choices[k]['value']}" for k in ("arch", "batch_size", "lr"))
    return [
        f"**Default plan** (params.yaml's recipe on {dp['plan']['device']}, "
        f"{dp['plan']['precision']}: {plan}, {choices['max_epochs']['value']} epochs)",
        "",
        "| figure | value |",
        "|---|---:|",
        f"| trainyard / plain loop, same batches, batch {loop['batch_size']:,} "
        f"| {loop['trainyard_over_plain']:.2f}x ({loop['trainyard_img_per_s']:,} vs "
        f"{loop['plain_loop_img_per_s']:,} img/s) |",
        f"| training img/s over the plan's steps | {run['img_per_s'] or 0:,} |",
        f"| GPU busy over the training steps (NVML) | {busy_text} |",
        f"| seconds of training to {dp['target']:.4f} test accuracy "
        f"| {reached['train_s'] if reached else 'not reached'} "
        f"({run['epochs_run']} epochs run) |",
        f"| CPU default ({cpu['arch']}, batch {cpu['batch_size']}, {cpu['max_epochs']} epochs) "
        f"on {cpu['cores']} threads | {cpu['train_s']} s ({cpu['img_per_s']:,} img/s) |",
        f"| GPU vs CPU, time to that accuracy | {f'{ratio:.0f}x' if ratio else 'n/a'} |",
        "",
        f"Target {dp['target']:.4f}: {dp['target_from']}.",
        "",
    ]


def bars(ax: Any, labels: list[str], series: dict[str, list[float]], xlabel: str) -> None:
    """Horizontal bars with their values written on them; log scale only when the values
    span more than 20x (CPU vs GPU), and then from a tenth of the smallest, so bar lengths
    are not exaggerated by a clipped axis."""
    values = [v for vs in series.values() for v in vs if v > 0]
    ypos = np.arange(len(labels))
    height = 0.8 / max(len(series), 1)
    for i, (name, vs) in enumerate(series.items()):
        offs = ypos - 0.4 + height * (i + 0.5)
        drawn = ax.barh(offs, vs, height, label=name)
        ax.bar_label(drawn, labels=[f"{v:,.0f}" if v else "n/a" for v in vs], fontsize=7, padding=2)
    ax.set_yticks(ypos, labels)
    if values and max(values) / min(values) > 20:
        ax.set_xscale("log")
        ax.set_xlim(left=min(values) / 10)
        xlabel += " (log)"
    ax.set_xlim(right=max(values or [1]) * 1.25)
    ax.set_xlabel(xlabel)
    ax.invert_yaxis()
