"""Inference latency and throughput at several batch sizes: torch eager vs ONNX Runtime, on
the CPU and, where present, CUDA."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import classifier
from benchmarks.harness.stopwatch import median_call_s


def export_for_bench(model: Any, path: Path) -> str:
    """ONNX for the inference rows, by the pipeline's exporter (its name returned: the
    TorchScript exporter, or torch.export where that one fails)."""
    from trainyard.export.onnx_export import export_onnx

    return export_onnx(model, path, opset=18, metadata={"bench": "1"})


def _ort_session(onnx_path: Path, provider: str, log: Callable[[str], None]) -> Any | None:
    """An ONNX Runtime session on exactly ``provider``, or None (said why) when it cannot be
    had: CUDA is asked for only where a GPU is, as ORT logs a loud error otherwise."""
    from trainyard.runtime.sessions import CPU, cuda_device_count

    try:
        import onnxruntime as ort
    except ImportError:
        log("bench: onnxruntime not installed: ORT rows skipped")
        return None
    if provider not in ort.get_available_providers() or (
        provider != CPU and cuda_device_count() == 0
    ):
        log(f"bench: ONNX Runtime {provider} unavailable: its ORT rows skipped")
        return None
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3
    session = ort.InferenceSession(str(onnx_path), opts, providers=[provider])
    if session.get_providers()[0] != provider:
        log(f"bench: ONNX Runtime fell back from {provider}: its ORT rows skipped")
        return None
    return session


def _ort_timings(
    session: Any, x_np: Any, torch_s: float, budget: float, device: str
) -> dict[str, Any]:
    """ORT's figures for one batch, on the path the pipeline takes on this session's provider
    (``binding_device``): bound on CUDA, plain ``session.run`` on the CPU.

    Fair to torch eager, whose input tensor is on the device before the clock starts and
    whose logits stay there: the bound row makes its input OrtValue on the device before
    timing too, binds the output on the device and never copies it back, and both are timed
    by the same clock (device synchronised at both ends; ORT also synchronises its stream
    at the end of each run). The unbound row is what a plain ``session.run`` costs
    on CUDA: numpy in, numpy out, the copies over the bus inside the timed call.
    """
    import onnxruntime as ort

    from trainyard.runtime.sessions import LOGITS_OUTPUT, binding_device, run_bound

    name = session.get_inputs()[0].name
    # The logits only, as torch returns and the pipeline's OnnxModel.run asks for: the
    # exporter's embedding output is neither copied back nor bound.
    out = [LOGITS_OUTPUT]
    row: dict[str, Any] = {"ort_provider": session.get_providers()[0]}
    bind = binding_device(session.get_providers())
    # ORT's run() returns host arrays: it has synchronised already.
    plain_s = median_call_s(lambda: session.run(out, {name: x_np}), budget, device=device)
    row["ort_io_binding"] = bind is not None
    if bind is None:
        row["ort_s"] = plain_s
    else:
        x_ort = ort.OrtValue.ortvalue_from_numpy(x_np, bind, 0)
        row["ort_s"] = median_call_s(
            lambda: run_bound(session, {name: x_ort}, bind, outputs=out), budget, device=device
        )
        row["ort_unbound_s"] = plain_s
        row["ort_unbound_over_torch_latency"] = plain_s / torch_s
    row["ort_over_torch_latency"] = row["ort_s"] / torch_s
    return row


def _row_text(row: dict[str, Any]) -> str:
    """One log line: torch, ORT on the pipeline's path and, on CUDA, ORT unbound."""
    text = f"bench: infer {row['device']:4s} batch {row['batch']:5d}: "
    text += f"torch {row['torch_s'] * 1e3:8.3f} ms"
    if "ort_s" not in row:
        return text
    how = "bound" if row["ort_io_binding"] else "run"
    text += (
        f"  ORT {how} {row['ort_s'] * 1e3:8.3f} ms  "
        f"(ORT-{how}/torch {row['ort_over_torch_latency']:.2f}x)"
    )
    if "ort_unbound_s" in row:
        text += (
            f"  ORT unbound {row['ort_unbound_s'] * 1e3:8.3f} ms  "
            f"(ORT-unbound/torch {row['ort_unbound_over_torch_latency']:.2f}x)"
        )
    return text


def inference_benchmarks(
    data: dict[str, Any], cfg: dict[str, Any], log: Callable[[str], None]
) -> dict[str, Any]:
    """Latency per batch size: torch eager vs ONNX Runtime, on the CPU and, where present,
    CUDA (there ORT is timed through IO binding, as evaluate and the service run it, with
    the plain ``session.run`` beside it as ``ort_unbound_s``)."""
    import torch

    from trainyard.model.augment import normalize_on_device
    from trainyard.runtime.sessions import CPU, CUDA

    model = classifier(cfg["arch"], data["card"]).eval()
    images = data["arrays"]["test"][0]
    out: dict[str, Any] = {"arch": cfg["arch"], "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        onnx_path = Path(tmp) / "bench.onnx"
        out["exporter"] = export_for_bench(model, onnx_path)
        targets = [("cpu", CPU)]
        if torch.cuda.is_available():
            targets.append(("cuda", CUDA))
        for device, provider in targets:
            torch_model = model.to(device)
            session = _ort_session(onnx_path, provider, log)
            for bs in cfg["inference_batches"]:
                x = normalize_on_device(
                    torch.from_numpy(images[:bs]), model.card.mean, model.card.std
                )
                x_dev, x_np = x.to(device), x.numpy()
                row: dict[str, Any] = {"device": device, "batch": bs}

                def run_torch(xd: torch.Tensor = x_dev, m: Any = torch_model) -> None:
                    with torch.inference_mode():
                        m(xd)

                budget = cfg["inference_budget_s"]
                row["torch_s"] = median_call_s(run_torch, budget, device=device)
                if session is not None:
                    row |= _ort_timings(session, x_np, row["torch_s"], budget, device)
                for k in ("torch", "ort", "ort_unbound"):
                    if f"{k}_s" in row:
                        row[f"{k}_img_per_s"] = bs / row[f"{k}_s"]
                out["rows"].append(row)
                log(_row_text(row))
        model.to("cpu")
    return out
