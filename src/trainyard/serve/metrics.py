"""The service's Prometheus series: predictions, confidence, refusals, input sizes, batches.

Created once per process on first use (``metrics()``), never on import: a worker makes them
after BentoML has set up Prometheus' multiprocess mode, and a test process may import the
serve layer without registering anything.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import bentoml


@dataclass(frozen=True)
class Metrics:
    """The series the service writes (prometheus_client Counter / Histogram objects)."""

    predictions: Any
    confidence: Any
    refused: Any
    image_pixels: Any
    batch_size: Any
    model_latency: Any
    log_rows: Any
    shadow_predictions: Any
    shadow_skipped: Any


@functools.cache
def metrics() -> Metrics:
    """This process's series, created on the first call."""
    # bentoml.metrics, not prometheus_client: BentoML sets up the multiprocess registry that
    # merges every worker's series into its /metrics, beside its own request series.
    return Metrics(
        predictions=bentoml.metrics.Counter(
            name="trainyard_predictions",
            documentation="Images classified, by predicted class (top-1 label)",
            labelnames=["label"],
        ),
        confidence=bentoml.metrics.Histogram(
            name="trainyard_top1_confidence",
            documentation="Top-1 softmax probability of each prediction (drift: it falls)",
            buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0),
        ),
        refused=bentoml.metrics.Counter(
            name="trainyard_requests_refused",
            documentation="Requests answered 4xx/503 by the service, by reason",
            labelnames=["reason"],
        ),
        image_pixels=bentoml.metrics.Histogram(
            name="trainyard_input_image_pixels",
            documentation="Width x height of each uploaded image, before any resize",
            buckets=(1e3, 1e4, 5e4, 1e5, 3e5, 1e6, 3e6, 1e7, 3e7, 1e8),
        ),
        batch_size=bentoml.metrics.Histogram(
            name="trainyard_batch_size",
            documentation="Images per ONNX Runtime run (adaptive batches and /classify_batch)",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096),
        ),
        model_latency=bentoml.metrics.Histogram(
            name="trainyard_model_seconds",
            documentation="Decode + inference per image; role: answer (served model) or shadow",
            labelnames=["role"],
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0),
        ),
        log_rows=bentoml.metrics.Counter(
            name="trainyard_prediction_log_rows",
            documentation="Prediction log rows, by outcome: written, or dropped (writer behind)",
            labelnames=["outcome"],
        ),
        shadow_predictions=bentoml.metrics.Counter(
            name="trainyard_shadow_predictions",
            documentation="Requests the shadow scored, by agreement of its top-1 with the answer",
            labelnames=["agreement"],
        ),
        shadow_skipped=bentoml.metrics.Counter(
            name="trainyard_shadow_skipped",
            documentation="Requests the shadow skipped because its queue was full",
        ),
    )


def count_refusal(reason: str) -> None:
    """One more request answered 4xx/503 for ``reason`` (a label on /metrics)."""
    metrics().refused.labels(reason=reason).inc()
