"""The drift report's pictures, as PNG bytes. Here, not in watch/, because matplotlib is
heavy: the bento ships watch/ whole, and nothing it imports reaches this.

Each is drawn on a private ``Figure`` with an Agg canvas (no pyplot, no global backend).
"""

from __future__ import annotations

import io

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

REFERENCE_COLOUR, CURRENT_COLOUR = "#1565c0", "#ef6c00"
MAX_TICK_CLASSES = 40  # more classes: no names on the axis, they would overlap


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def class_mix_png(classes: list[str], reference: np.ndarray, current: np.ndarray) -> bytes:
    """Each class's share of the predictions, reference beside current."""
    k = len(classes)
    fig = _figure(min(20.0, max(6.0, 0.5 * k + 2)), 4.0)
    ax = fig.add_subplot()
    x = np.arange(k)
    for shift, counts, name, colour in (
        (-0.2, reference, "reference", REFERENCE_COLOUR),
        (0.2, current, "current", CURRENT_COLOUR),
    ):
        ax.bar(x + shift, counts / max(counts.sum(), 1), 0.4, label=name, color=colour)
    if k <= MAX_TICK_CLASSES:
        ax.set_xticks(x, [" ".join(c.split())[:16] for c in classes], rotation=45, ha="right")
    ax.set(ylabel="share of predictions", title="Predicted class mix")
    ax.legend()
    return _png(fig)


def confidence_png(reference: np.ndarray, current: np.ndarray) -> bytes:
    """Histograms (as densities) of the top-1 probability, reference and current."""
    fig = _figure(6.0, 4.0)
    ax = fig.add_subplot()
    bins = np.linspace(0, 1, 41)
    ax.hist(reference, bins, density=True, alpha=0.6, label="reference", color=REFERENCE_COLOUR)
    ax.hist(current, bins, density=True, alpha=0.6, label="current", color=CURRENT_COLOUR)
    ax.set(xlabel="top-1 probability", ylabel="density", title="Confidence")
    ax.legend()
    return _png(fig)


def embedding_png(reference_2d: np.ndarray, current_2d: np.ndarray) -> bytes:
    """The two samples of embeddings on their first two principal components."""
    fig = _figure(6.0, 5.0)
    ax = fig.add_subplot()
    ax.scatter(*reference_2d.T, s=4, alpha=0.4, label="reference", color=REFERENCE_COLOUR)
    ax.scatter(*current_2d.T, s=4, alpha=0.4, label="current", color=CURRENT_COLOUR)
    ax.set(xlabel="PC 1", ylabel="PC 2", title="Embeddings (PCA of the reference)")
    ax.legend(markerscale=3)
    return _png(fig)
