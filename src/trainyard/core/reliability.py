"""The expected calibration error, in one place: export's temperature guard and evaluate's
report both judge confidences by it, so they must bin and weigh alike.

Equal-width confidence bins (15, as Guo et al., "On Calibration of Modern Neural
Networks", 2017, and most papers report); each bin's |accuracy - mean confidence| weighted
by its share of the images.
"""

from __future__ import annotations

from typing import Any

import numpy as np

ECE_BINS = 15


def _bins(confidence: np.ndarray, bins: int) -> np.ndarray:
    return np.minimum((np.asarray(confidence, np.float64) * bins).astype(np.int64), bins - 1)


def calibration_error(confidence: np.ndarray, correct: np.ndarray, bins: int = ECE_BINS) -> float:
    """The ECE of top-class ``confidence`` against ``correct`` (0/1), unrounded: the
    temperature guard computes it on 1,000 bootstrap resamples, so it skips the diagram."""
    which = _bins(confidence, bins)
    # n_b / N * |acc_b - conf_b| = |sum over the bin of (correct - confidence)| / N
    gap = np.bincount(which, np.asarray(correct, np.float64) - confidence, minlength=bins)
    return float(np.abs(gap).sum() / max(len(which), 1))


def reliability(
    confidence: np.ndarray, correct: np.ndarray, bins: int = ECE_BINS
) -> dict[str, Any]:
    """The ECE (rounded to 6 places) and the per-bin mean confidence, accuracy and count a
    reliability diagram draws."""
    which = _bins(confidence, bins)
    count = np.bincount(which, minlength=bins)
    seen = np.maximum(count, 1)
    conf = np.bincount(which, confidence, minlength=bins) / seen
    acc = np.bincount(which, np.asarray(correct, np.float64), minlength=bins) / seen
    return {
        "ece": round(calibration_error(confidence, correct, bins), 6),
        "confidence": np.round(conf, 6).tolist(),
        "accuracy": np.round(acc, 6).tolist(),
        "count": count.tolist(),
    }
