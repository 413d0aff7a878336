"""A windowed drift score on /metrics: the service's last answers against the model's
reference, the same measures and thresholds as ``trainyard drift`` (watch.drift_score).

The answer path only appends (label, probability, embedding) to a bounded deque. A
thread of its own compares the window with the reference every ``serve.drift_every_s``
seconds and sets three gauges per measure, for a Prometheus alert on
``trainyard_drift{measure=...} == 1``. Each worker holds its own window (its share of
the traffic); the gauges keep the largest value of any worker.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from pathlib import Path
from typing import Any

import bentoml
import numpy as np

from trainyard.core.config import DriftParams
from trainyard.core.errors import TrainyardError
from trainyard.watch.drift_score import DriftResult, Window, compare
from trainyard.watch.reference import Reference, load_reference

log = logging.getLogger("bentoml.serve.trainyard")

REFERENCE_SUFFIX = ".reference.npz"  # models/model.onnx -> models/model.reference.npz


def reference_beside(model: Path) -> Path:
    """Where evaluate writes the reference of ``model``: beside it, same stem."""
    return model.with_name(model.stem + REFERENCE_SUFFIX)


class DriftWatch:
    """The window of recent answers, its comparing thread and its gauges."""

    def __init__(
        self, reference: Reference, drift: DriftParams, window: int, every_s: float
    ) -> None:
        self.reference, self.drift, self.every_s = reference, drift, every_s
        self.rows: deque[tuple[str, float, np.ndarray | None]] = deque(maxlen=window)
        self.gauges = _gauges()
        self.last: DriftResult | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="drift-watch", daemon=True)
        self._thread.start()

    @classmethod
    def load(
        cls, path: Path, model_sha256: str, drift: DriftParams, window: int, every_s: float
    ) -> DriftWatch | None:
        """From the reference file at ``path``; None (said once) when there is none, or
        when it is another model's (evaluate not rerun since the export)."""
        if not path.is_file():
            log.info("trainyard: no reference at %s: no drift score on /metrics", path)
            return None
        reference = load_reference(path)
        if reference.model_sha256 != model_sha256:
            log.warning(
                "trainyard: %s is the reference of model %s, not of the served %s (run "
                "`dvc repro evaluate`): no drift score on /metrics",
                path,
                reference.model_sha256[:12],
                model_sha256[:12],
            )
            return None
        return cls(reference, drift, window, every_s)

    def add(self, label: str, probability: float, embedding: np.ndarray | None) -> None:
        """On the answer path: one append to a bounded deque."""
        self.rows.append((label, probability, embedding))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def check(self) -> DriftResult | None:
        """The window against the reference now, gauges set; None with too few rows."""
        rows = list(self.rows)
        if len(rows) < self.drift.min_rows:
            return None
        embeddings = [r[2] for r in rows]
        # Rows answered without an embedding (batching on) leave the measure out.
        full = self.reference.has_embeddings and all(e is not None for e in embeddings)
        window = Window(
            labels=np.array([r[0] for r in rows]),
            probabilities=np.array([r[1] for r in rows], dtype=np.float32),
            embeddings=np.stack(embeddings).astype(np.float32) if full else None,  # type: ignore[arg-type]
            source=f"the service's last {len(rows)} answers",
        )
        result = compare(self.reference, window, self.drift)
        for m in result.measures:
            effect = m.effect if m.effect is not None else m.statistic  # PSI, D, MMD^2
            self.gauges["statistic"].labels(measure=m.name).set(effect)
            self.gauges["p_value"].labels(measure=m.name).set(m.p_value)
            self.gauges["drifted"].labels(measure=m.name).set(1.0 if m.drifted else 0.0)
        self.last = result
        return result

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.check()
            except (TrainyardError, ValueError) as err:  # e.g. a label the reference lacks
                log.warning("trainyard: drift window not compared: %s", err)


_GAUGES: dict[str, Any] = {}


def _gauges() -> dict[str, Any]:
    """This process's drift gauges, made once (a second service in one test process
    reuses them)."""
    if not _GAUGES:
        common = {"labelnames": ["measure"], "multiprocess_mode": "max"}
        _GAUGES.update(
            statistic=bentoml.metrics.Gauge(
                name="trainyard_drift_statistic",
                documentation="The last window's drift statistic: PSI, KS D or MMD^2",
                **common,
            ),
            p_value=bentoml.metrics.Gauge(
                name="trainyard_drift_p_value",
                documentation="The last window's p-value per measure (chi2, KS, MMD permutation)",
                **common,
            ),
            drifted=bentoml.metrics.Gauge(
                name="trainyard_drift",
                documentation="1 when the last window drifted by this measure (trainyard drift)",
                **common,
            ),
        )
    return _GAUGES
