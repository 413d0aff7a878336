"""Params of the model's life after training: ``serve`` (the BentoML service), ``predict``
(bulk scoring) and ``drift`` (watching the served model). None of them shapes a training
(``Params.flat`` leaves them out of the MLflow params); ``trainyard.core.config.Params``
holds them beside the pipeline's sections and is the one reader of params.yaml.
"""

from __future__ import annotations

import os
from typing import Annotated, Literal

from pydantic import Field, model_validator

from trainyard.core.strict import Strict


class ServeParams(Strict):
    """The BentoML service (bento/service.py); read when the service module is imported."""

    model: str = Field("models/model.onnx", min_length=1)
    # int8: the export's models/model.int8.onnx beside serve.model (export.quantize: int8)
    precision: Literal["fp32", "int8"] = "fp32"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    intra_op_threads: Annotated[int, Field(ge=0, le=256)] | Literal["auto"] = "auto"
    workers: Annotated[int, Field(ge=1, le=64)] | Literal["cpu_count"] = "cpu_count"
    batching: bool | Literal["auto"] = "auto"
    max_batch_size: int = Field(64, ge=2, le=4096)
    max_latency_ms: int = Field(1000, ge=1, le=60_000)
    max_batch_images: int = Field(256, ge=1, le=4096)
    top_k: int = Field(5, ge=1, le=100_000)
    access_log: bool = True
    tracing: bool = False

    def workers_count(self) -> int:
        return (os.cpu_count() or 1) if self.workers == "cpu_count" else self.workers

    def model_threads(self) -> int:
        """ONNX Runtime intra-op threads per inference. ``auto`` is 1: a worker runs up to
        ``concurrent_inferences`` model calls side by side, one core each, which beat one
        call on every core on these CPUs. Also with batching, where BentoML's batcher runs
        one batch at a time per worker: batching is on by default only for models whose call
        is cheap (serve.batching auto), where ONNX Runtime's second thread spinning for work
        cost more CPU per request than it saved (2.1 vs 3.5 ms, make bench-serve's CNN)."""
        return 1 if self.intra_op_threads == "auto" else self.intra_op_threads

    def concurrent_inferences(self) -> int:
        """Model calls (decode + inference, or a batch) a worker runs at once: its share of
        the cores. More only queue inside ONNX Runtime and stretch everyone's latency
        (p99 4 s at 64 clients on resnet18 with the default thread pool of 40)."""
        return max(1, (os.cpu_count() or 1) // self.workers_count())

    max_image_pixels: int = Field(25_000_000, ge=1, le=500_000_000)
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024, le=1024**3)
    max_concurrency: int = Field(256, ge=2, le=100_000)
    timeout_s: float = Field(10.0, gt=0, le=3600)
    # Hostile input limits (tests/serve/test_serve_limits.py): each a 4xx that names it.
    max_aspect_ratio: float = Field(100, ge=1, le=100_000)
    max_json_depth: int = Field(8, ge=5, le=100)
    max_json_values: int = Field(1_048_576, ge=1, le=1_000_000_000)
    max_json_int_digits: int = Field(20, ge=3, le=4000)
    max_header_bytes: int = Field(16_384, ge=1024, le=1024**2)
    header_timeout_s: float = Field(10.0, gt=0, le=3600)
    body_timeout_s: float = Field(8.0, gt=0, le=3600)
    # Watching the served model (docs/monitoring.md): the prediction log and the shadow.
    log_predictions: bool = False
    log_dir: str = Field("logs/predictions", min_length=1)  # relative: to the params file
    log_images: bool = False
    log_image_max_bytes: int = Field(262_144, ge=0, le=64 * 1024**2)
    log_max_bytes: int = Field(1024**3, ge=1024**2, le=1024**5)
    log_rotate_rows: int = Field(5000, ge=1, le=10_000_000)
    log_rotate_s: float = Field(60.0, gt=0, le=86_400)
    log_queue_rows: int = Field(10_000, ge=1, le=10_000_000)
    shadow: str | None = Field(None, min_length=1)  # an alias, models:/ URI or .onnx path
    shadow_share: float = Field(1.0, gt=0, le=1)
    shadow_queue: int = Field(256, ge=1, le=1_000_000)
    reload_s: float = Field(10.0, ge=0, le=86_400)  # models:/NAME@ALIAS re-read; 0: never
    drift_window: int = Field(1000, ge=0, le=1_000_000)  # answers compared; 0: no drift score
    drift_every_s: float = Field(60.0, gt=0, le=86_400)

    @model_validator(mode="after")
    def _body_timeout_first(self) -> ServeParams:
        # Otherwise BentoML's 504 (timeout_s) answers a stalled body before the guard's 408.
        if self.body_timeout_s >= self.timeout_s:
            raise ValueError(
                f"body_timeout_s ({self.body_timeout_s:g}) must be less than timeout_s "
                f"({self.timeout_s:g}), so that a stalled body gets its 408"
            )
        return self


class PredictParams(Strict):
    """Bulk scoring: ``trainyard predict`` and the predict stage (docs/predict.md)."""

    # stage name -> source (a folder, a CSV, a text file of paths, a glob): one stage
    # predict@NAME each, writing predictions/NAME.parquet; {} = no predict stage.
    sources: dict[
        Annotated[str, Field(pattern=r"^[\w.-]+$")], Annotated[str, Field(min_length=1)]
    ] = Field(default_factory=dict)
    model: str = Field("auto", min_length=1)  # auto = serve.model (what `make serve` serves)
    top_k: int = Field(5, ge=1, le=100_000)
    min_confidence: float = Field(0.5, ge=0, le=1)
    batch_size: Annotated[int, Field(ge=1, le=65536)] | Literal["auto"] = "auto"
    workers: Annotated[int, Field(ge=1, le=256)] | Literal["auto"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    chunk_rows: int = Field(4096, ge=16, le=1_000_000)


class DriftParams(Strict):
    """``trainyard drift`` and the model's reference (docs/drift.md). The thresholds were
    calibrated by measurement (tests/watch/test_drift.py holds them to it): a window of the test
    distribution is flagged at most once in 20, every shift the tests make always."""

    # p-value below which a measure's test says "differs"; one per measure, Bonferroni-like
    # for the three measures (a window of unchanged inputs: ~3 x alpha false alarms).
    alpha: float = Field(0.001, gt=0, lt=0.5)
    # class mix drifts only when its chi-square says so AND its PSI is above this: chi-square
    # alone flags a 1% change in a class's share once the window holds ten thousand rows.
    psi: float = Field(0.1, gt=0, le=10)
    # confidence drifts only when KS says so AND its statistic (the CDFs' gap) is above this.
    ks_statistic: float = Field(0.1, gt=0, lt=1)
    min_rows: int = Field(50, ge=10, le=10_000_000)  # fewer rows in a window: no verdict
    permutations: int = Field(2000, ge=20, le=1_000_000)  # the embedding test's p-value
    mmd_rows: int = Field(500, ge=20, le=5000)  # rows of each side the embedding test uses
    reference_sample: int = Field(2000, ge=100, le=1_000_000)  # evaluate keeps this many
    seed: int = Field(0, ge=0, le=2**32 - 1)  # the samples' and permutations' seed

    @model_validator(mode="after")
    def _permutations_reach_alpha(self) -> DriftParams:
        # A permutation p-value is never below 1 / (permutations + 1): fewer could not
        # ever flag the embedding measure.
        if 1 / (self.permutations + 1) >= self.alpha:
            raise ValueError(
                f"permutations ({self.permutations}) must exceed 1 / alpha - 1 "
                f"({1 / self.alpha - 1:g}): the embedding test's smallest p-value is "
                "1 / (permutations + 1)"
            )
        return self
