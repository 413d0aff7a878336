"""Temperature scaling (Guo et al., "On Calibration of Modern Neural Networks", 2017): one
scalar T, fitted on the validation split by the negative log-likelihood, that divides the
logits. A network trained to low loss is over-confident (its 0.95 is right less often than
95 times in 100); T > 1 softens every answer alike, so the argmax, and every accuracy
figure, stays exactly as it was. The export stage bakes 1/T into the ONNX graph, so the
service, ``trainyard predict``, drift and evaluate all read the calibrated numbers.
"""

from __future__ import annotations

import math

import numpy as np

# The search interval for T, and how finely it is found (golden-section on log T).
T_MIN, T_MAX, T_TOLERANCE = 0.05, 20.0, 1e-4


def nll(logits: np.ndarray, labels: np.ndarray, temperature: float = 1.0) -> float:
    """Mean negative log-likelihood of ``labels`` under softmax(logits / temperature)."""
    z = np.asarray(logits, np.float64) / temperature
    z -= z.max(axis=1, keepdims=True)
    log_norm = np.log(np.exp(z).sum(axis=1))
    return float((log_norm - z[np.arange(len(z)), labels]).mean())


def fit_temperature(logits: np.ndarray, labels: np.ndarray) -> float:
    """The T in [T_MIN, T_MAX] that minimises the validation NLL. The NLL is convex in 1/T,
    hence unimodal in log T: a golden-section search finds it without a gradient."""
    if len(labels) == 0:
        return 1.0
    lo, hi = math.log(T_MIN), math.log(T_MAX)
    ratio = (math.sqrt(5) - 1) / 2
    a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    fa, fb = nll(logits, labels, math.exp(a)), nll(logits, labels, math.exp(b))
    while hi - lo > T_TOLERANCE:
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - ratio * (hi - lo)
            fa = nll(logits, labels, math.exp(a))
        else:
            lo, a, fa = a, b, fb
            b = lo + ratio * (hi - lo)
            fb = nll(logits, labels, math.exp(b))
    return round(math.exp((lo + hi) / 2), 4)
