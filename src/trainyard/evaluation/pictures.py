"""The evaluate stage's pictures (``reports/*.png``): what a person looks at after a run.

- ``learning_curves.png``: train and val loss, val accuracy, learning rate and epoch time per
  epoch, from the fit's ``models/history.csv`` (``trainyard.core.fit_history``);
- ``confusion_matrix.png`` (image counts) and ``confusion_matrix_normalized.png`` (the share
  of each actual class: the diagonal is the recall);
- ``per_class.png``: precision and recall of each class;
- ``mistakes.png``: the test images the model gets wrong most confidently, each with the
  heatmap of the class it predicted;
- ``reliability.png``: confidence against accuracy, with and without the graph's temperature.

Each is drawn on a private ``Figure`` with an Agg canvas, not pyplot: no global backend
switch, no figure left open if anything fails, safe beside other threads' plots. Sizes grow
with the class count up to ``MAX_FIGURE_INCHES`` and ``MAX_FIGURE_PIXELS`` a side.
"""

from __future__ import annotations

import contextlib
import io
import math
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import matplotlib
import numpy as np
from matplotlib import font_manager
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from trainyard.runtime.explain import overlay

TICK_LABEL_CHARS = 24
MAX_FIGURE_INCHES = 30.0
MAX_FIGURE_PIXELS = 3000  # per side: a 30 in figure at 100 dpi, a PNG of a few MB at most
ANNOTATE_MAX_CLASSES = 30  # above this, numbers in the cells are unreadable
MIN_TICK_POINTS = 5.0  # 7 px at 100 dpi; below this, label every n-th class instead
MAX_MISTAKES = 25
# Fonts tried after DejaVu Sans for glyphs it lacks (CJK, mostly), used where installed.
_FALLBACK_FONTS = (
    "Noto Sans CJK JP",
    "Noto Sans CJK SC",
    "Noto Sans CJK TC",
    "Noto Sans CJK KR",
    "Source Han Sans",
    "WenQuanYi Zen Hei",
    "WenQuanYi Micro Hei",
    "Droid Sans Fallback",
    "IPAGothic",
    "Noto Sans",
    "Arial Unicode MS",
)
WRONG = "#c62828"


def tick_label(name: str, limit: int = TICK_LABEL_CHARS) -> str:
    """A class name fit for an axis: one line, at most ``limit`` characters."""
    # Newlines and tabs would make multi-line ticks that overlap their neighbours.
    text = " ".join(name.split())
    text = "".join(c if c.isprintable() else " " for c in text)
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"


def _font_families() -> list[str]:
    installed = {f.name for f in font_manager.fontManager.ttflist}
    # Only installed ones: naming a missing family makes matplotlib log a warning per text.
    return ["DejaVu Sans", *(f for f in _FALLBACK_FONTS if f in installed)]


@contextlib.contextmanager
def _figure(width: float, height: float, dpi: float) -> Iterator[Figure]:
    """A constrained-layout figure with trainyard's fonts; its PNG via ``_png``."""
    rc = {"text.usetex": False, "font.family": _font_families()}
    with matplotlib.rc_context(rc), warnings.catch_warnings():
        # A glyph no installed font has (CJK without a CJK font) is drawn as a box; the
        # per-glyph warning would only repeat that for every class name.
        warnings.filterwarnings("ignore", message=r"Glyph .* missing from", category=UserWarning)
        fig = Figure(figsize=(width, height), dpi=dpi, layout="constrained")
        FigureCanvasAgg(fig)
        yield fig


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _dpi(*inches: float, most: float = 110.0) -> float:
    return min(most, MAX_FIGURE_PIXELS / max(inches))


def _class_ticks(k: int, cell_pt: float) -> tuple[list[int], float, int]:
    """Which classes get a tick label, at what font size, and the stride between them."""
    tick_pt = min(9.0, 0.7 * cell_pt)
    stride = 1 if tick_pt >= MIN_TICK_POINTS else math.ceil(MIN_TICK_POINTS / tick_pt)
    return list(range(0, k, stride)), max(tick_pt, MIN_TICK_POINTS), stride


# ---------------------------------------------------------------------------- confusion


def confusion_png(
    matrix: list[list[int]], classes: list[str], title: str, normalize: bool = False
) -> bytes:
    """The confusion matrix as a PNG (``draw_confusion``), legible from 2 to a few hundred
    classes: the figure grows with the class count up to ``MAX_FIGURE_INCHES``."""
    side = min(MAX_FIGURE_INCHES, max(8.0, 3.5 + 0.25 * len(classes)))
    with _figure(side, side, _dpi(side)) as fig:
        draw_confusion(fig, matrix, classes, title, normalize)
        return _png(fig)


def draw_confusion(
    fig: Figure, matrix: list[list[int]], classes: list[str], title: str, normalize: bool
) -> Axes:
    """The confusion matrix (rows: actual class, columns: predicted) on ``fig``.

    Counts (``normalize=False``): colour and numbers are image counts. Normalised: colour and
    numbers are the share of each actual class's images (rows sum to 1, the diagonal is the
    recall), which keeps small and large classes on one scale. Numbers are written in the
    cells up to ``ANNOTATE_MAX_CLASSES`` classes.
    """
    cm = np.asarray(matrix, dtype=np.int64)
    k = len(classes)
    if cm.shape != (k, k):
        raise ValueError(f"confusion matrix is {cm.shape}, expected ({k}, {k}) for the classes")
    support = cm.sum(axis=1, keepdims=True)
    share = np.divide(cm, support, out=np.zeros(cm.shape), where=support > 0)
    shown = share if normalize else cm.astype(np.float64)
    top = 1.0 if normalize else max(float(cm.max(initial=0)), 1.0)
    # ~3.5 in of the figure go to the tick labels, the colour bar and the title.
    side = float(min(fig.get_size_inches()))
    cell_pt = (side - 3.5) * 72 / k
    ticks, tick_pt, stride = _class_ticks(k, cell_pt)
    labels = [tick_label(classes[i]) for i in ticks]
    what = "share of each actual class (rows sum to 1; diagonal = recall)"
    what = what if normalize else "image counts"
    if stride > 1:
        what += f"; one class in {stride} labelled"
    ax = fig.add_subplot()
    im = ax.imshow(shown, cmap="Blues", vmin=0.0, vmax=top, interpolation="nearest")
    # parse_math=False: a "$" in a class name must stay a dollar sign, not start TeX.
    xrot = {"rotation": 90, "ha": "center"} if k > 12 else {"rotation": 45, "ha": "right"}
    ax.set_xticks(ticks, labels, fontsize=tick_pt, parse_math=False, **xrot)
    ax.set_yticks(ticks, labels, fontsize=tick_pt, parse_math=False)
    # Title and axis names grow a little with the figure so they stay findable.
    head_pt = min(16.0, 10.0 * math.sqrt(side / 8.0))
    ax.set_xlabel("predicted", fontsize=head_pt)
    ax.set_ylabel("actual", fontsize=head_pt)
    ax.set_title(f"{title}\n{what}", parse_math=False, fontsize=head_pt)
    if k <= ANNOTATE_MAX_CLASSES:
        _annotate_cells(ax, cell_texts(cm, share, normalize), shown / top, cell_pt)
    # About 0.4 in wide at any figure size (a fixed fraction would be 1.4 in at 30 in).
    bar = fig.colorbar(
        im, ax=ax, fraction=min(0.046, 0.4 / side), pad=0.01, aspect=max(20.0, 2.5 * side)
    )
    bar.set_label("share of the actual class" if normalize else "images", fontsize=head_pt)
    return ax


def cell_texts(cm: np.ndarray, share: np.ndarray, normalize: bool) -> np.ndarray:
    """What each cell says: its count, or its share as ``.93`` (``1`` from .995 up, ``0``
    only for no image at all, so a rare confusion never reads as none)."""
    texts = np.empty(cm.shape, dtype=object)
    for i, j in np.ndindex(cm.shape):
        if not normalize:
            texts[i, j] = str(cm[i, j])
        elif cm[i, j] == 0:
            texts[i, j] = "0"
        elif share[i, j] >= 0.995:
            texts[i, j] = "1"
        else:
            texts[i, j] = f"{max(share[i, j], 0.01):.2f}".lstrip("0")
    return texts


def _annotate_cells(ax: Axes, texts: np.ndarray, shade: np.ndarray, cell_pt: float) -> None:
    digits = max(len(t) for t in texts.flat)
    number_pt = max(4.0, min(8.0, cell_pt / (0.65 * max(digits, 2) + 0.6)))
    for i, j in np.ndindex(texts.shape):
        colour = "white" if shade[i, j] > 0.5 else "black"  # readable on the dark cells
        ax.text(j, i, texts[i, j], ha="center", va="center", fontsize=number_pt, color=colour)


# ---------------------------------------------------------------------------- per class


def per_class_png(per_class: dict[str, dict[str, Any]], classes: list[str], title: str) -> bytes:
    """Precision and recall of each class as a PNG (``draw_per_class``); the figure grows
    with the class count up to ``MAX_FIGURE_INCHES``."""
    height = min(MAX_FIGURE_INCHES, max(4.5, 2.0 + 0.32 * len(classes)))
    with _figure(9.0, height, _dpi(9.0, height)) as fig:
        draw_per_class(fig, per_class, classes, title)
        return _png(fig)


def draw_per_class(
    fig: Figure, per_class: dict[str, dict[str, Any]], classes: list[str], title: str
) -> Axes:
    """Precision and recall of each class as paired horizontal bars in class order (the
    confusion matrix's order, first on top), each label with the class's test images."""
    missing = [c for c in classes if c not in per_class]
    if missing:
        raise ValueError(f"no precision/recall for class {missing[0]!r}")
    k = len(classes)
    precision = np.array([per_class[c]["precision"] for c in classes], dtype=np.float64)
    recall = np.array([per_class[c]["recall"] for c in classes], dtype=np.float64)
    row_pt = (float(fig.get_size_inches()[1]) - 2.0) * 72 / k
    ticks, tick_pt, stride = _class_ticks(k, row_pt)
    labels = [f"{tick_label(classes[i])} (n={per_class[classes[i]]['support']})" for i in ticks]
    y = np.arange(k)
    ax = fig.add_subplot()
    ax.barh(y - 0.2, precision, height=0.4, color="#1f77b4", label="precision")
    ax.barh(y + 0.2, recall, height=0.4, color="#ff7f0e", label="recall")
    ax.set_yticks(ticks, labels, fontsize=tick_pt, parse_math=False)
    ax.set_ylim(k - 0.5, -0.5)
    annotate = k <= ANNOTATE_MAX_CLASSES
    ax.set_xlim(0.0, 1.12 if annotate else 1.0)  # room for the numbers right of a full bar
    ax.set_xticks(np.linspace(0.0, 1.0, 6))
    ax.grid(axis="x", alpha=0.3)
    ax.set_xlabel(
        "precision: share of the images predicted as the class that are it; "
        "recall: share of its images found"
    )
    if annotate:
        number_pt = min(8.0, max(5.0, 0.35 * row_pt))
        for offset, values in ((-0.2, precision), (0.2, recall)):
            for i, v in enumerate(values):
                ax.text(v + 0.01, i + offset, f"{v:.3f}", va="center", fontsize=number_pt)
    note = f"; one class in {stride} labelled" if stride > 1 else ""
    ax.set_title(
        f"{title}\nmacro precision {precision.mean():.4f}, macro recall {recall.mean():.4f}{note}",
        parse_math=False,
    )
    # Outside the axes: inside, it would hide the bars of the last classes.
    fig.legend(loc="outside lower center", ncols=2)
    return ax


# ---------------------------------------------------------------------------- mistakes


def worst_mistakes(
    labels: np.ndarray, preds: np.ndarray, confidence: np.ndarray, limit: int = MAX_MISTAKES
) -> np.ndarray:
    """Indices of up to ``limit`` wrong predictions, the most confident first (ties: the
    lower index first, so the grid is the same on every run)."""
    labels, preds = np.asarray(labels), np.asarray(preds)
    confidence = np.asarray(confidence)
    if not labels.shape == preds.shape == confidence.shape:
        raise ValueError(
            f"labels {labels.shape}, predictions {preds.shape} and confidences "
            f"{confidence.shape} must have one entry per test image"
        )
    wrong = np.flatnonzero(labels != preds)
    order = np.argsort(-confidence[wrong], kind="stable")
    return wrong[order[:limit]]


def _as_picture(image: np.ndarray) -> tuple[np.ndarray, str | None]:
    """A ``[C, H, W]`` uint8 image as imshow takes it: RGB ``[H, W, 3]`` or grey ``[H, W]``."""
    if image.shape[0] == 3:
        return np.transpose(image, (1, 2, 0)), None
    if image.shape[0] == 4:  # RGBA: the colour, not the transparency
        return np.transpose(image[:3], (1, 2, 0)), None
    return image[0], "gray"


def _grid(n: int) -> tuple[int, int]:
    cols = max(1, min(5, n))
    return max(1, math.ceil(n / cols)), cols


def mistakes_png(
    images: np.ndarray,
    labels: np.ndarray,
    preds: np.ndarray,
    confidence: np.ndarray,
    classes: Sequence[str],
    limit: int = MAX_MISTAKES,
    heatmaps: Mapping[int, np.ndarray] | None = None,
    note: str | None = None,
) -> bytes:
    """The grid of the most confident wrong predictions as a PNG (``draw_mistakes``)."""
    rows, cols = _grid(len(worst_mistakes(labels, preds, confidence, limit)))
    width, height = max(cols * 2.3, 6.0), rows * 2.75 + 0.9
    with _figure(width, height, _dpi(width, height, most=100.0)) as fig:
        draw_mistakes(fig, images, labels, preds, confidence, classes, limit, heatmaps, note)
        return _png(fig)


def draw_mistakes(
    fig: Figure,
    images: np.ndarray,
    labels: np.ndarray,
    preds: np.ndarray,
    confidence: np.ndarray,
    classes: Sequence[str],
    limit: int = MAX_MISTAKES,
    heatmaps: Mapping[int, np.ndarray] | None = None,
    note: str | None = None,
) -> list[Axes]:
    """Up to ``limit`` most confident wrong predictions on ``images`` (uint8 ``[N, C, H,
    W]``; only those shown are read, so a memmap stays on disk), most confident first, each
    titled with its true class, the predicted one and the model's probability for it, and
    overlaid with its heatmap (``heatmaps``: image index -> the predicted class's map,
    0..1 at the image's size; ``runtime.explain.overlay``, what the service draws) where
    one is given, and ``note`` (how far to trust the heatmaps: the deletion test) under the
    title. Returns the image cells in that order."""
    chosen = worst_mistakes(labels, preds, confidence, limit)
    wrong = int((np.asarray(labels) != np.asarray(preds)).sum())
    n = len(chosen)
    heatmaps = heatmaps or {}
    fig.suptitle(
        f"The {n} most confident of {wrong} wrong predictions on {len(labels)} test images"
        + ("\nheatmap: the region behind the predicted class" if heatmaps else "")
        + (f"\n{note}" if heatmaps and note else "")
        if n
        else f"No wrong predictions on {len(labels)} test images",
        parse_math=False,
    )
    if not n:
        return []
    rows, cols = _grid(n)
    axes = list(fig.subplots(rows, cols, squeeze=False).flat)
    for ax in axes:
        ax.set_axis_off()
    # Fancy indexing of a memmap reads just these images (in file order: sorted).
    in_file_order = np.sort(chosen)
    pixels = dict(zip(in_file_order.tolist(), images[in_file_order], strict=True))
    for ax, index in zip(axes, chosen.tolist(), strict=False):
        picture, cmap = _as_picture(np.asarray(pixels[index]))
        if index in heatmaps:
            picture, cmap = overlay(picture, heatmaps[index]), None
        ax.imshow(picture, cmap=cmap, vmin=0, vmax=255, interpolation="nearest")
        ax.set_title(
            f"true: {tick_label(classes[labels[index]], 20)}\n"
            f"pred: {tick_label(classes[preds[index]], 20)} {confidence[index]:.2f}",
            fontsize=8,
            color=WRONG,
            parse_math=False,
        )
    return axes[:n]


# ---------------------------------------------------------------------------- history


def _series(rows: list[dict[str, Any]], key: str) -> np.ndarray:
    return np.array([np.nan if r.get(key) is None else r[key] for r in rows], dtype=np.float64)


def learning_curves_png(rows: list[dict[str, Any]] | None, title: str) -> bytes:
    """The fit's history as a PNG (``draw_learning_curves``)."""
    with _figure(11.0, 7.5, 100.0) as fig:
        draw_learning_curves(fig, rows, title)
        return _png(fig)


def draw_learning_curves(fig: Figure, rows: list[dict[str, Any]] | None, title: str) -> list[Axes]:
    """Loss (train and val), val accuracy, learning rate and epoch time against the epoch,
    from history rows (``trainyard.core.fit_history.read_history``), the best val/acc epoch
    marked in each panel; returns the four panels. ``None`` or no rows: a text that says
    there is no history, and no panels."""
    if not rows:
        fig.suptitle(title, parse_math=False)
        fig.text(
            0.5,
            0.5,
            "no training history (models/history.csv): retrain with `dvc repro train`",
            ha="center",
            va="center",
            parse_math=False,
        )
        return []
    epoch = _series(rows, "epoch")
    acc = _series(rows, "val/acc")
    best = None if np.isnan(acc).all() else int(np.nanargmax(acc))
    if best is not None:
        title += f"\nbest val/acc {acc[best]:.4f} at epoch {int(epoch[best])} (dashed line)"
    fig.suptitle(title, parse_math=False)
    (loss_ax, acc_ax), (lr_ax, time_ax) = fig.subplots(2, 2, sharex=True)
    panels = (
        (loss_ax, "loss", (("train/loss", "train"), ("val/loss", "val"))),
        (acc_ax, "val accuracy", (("val/acc", "val"),)),
        (lr_ax, "learning rate (last step of the epoch)", (("lr", "lr"),)),
        (time_ax, "epoch time (s)", (("epoch_time_s", "time"),)),
    )
    for ax, name, lines in panels:
        for key, label in lines:
            ax.plot(epoch, _series(rows, key), "o-", markersize=3, label=label)
        if best is not None:
            ax.axvline(epoch[best], color="grey", linestyle="--", linewidth=1)
        ax.set_title(name)
        ax.grid(alpha=0.3)
    loss_ax.legend()
    # Each tick as 0.0004 or 1e-05: a shared "1e-3" offset would sit on the panel's title.
    lr_ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.2g}"))
    for ax in (lr_ax, time_ax):
        ax.set_xlabel("epoch")
    # Whole epochs only: a 3-epoch run must not show ticks at 1.5 and 2.5.
    loss_ax.xaxis.get_major_locator().set_params(integer=True)
    return [loss_ax, acc_ax, lr_ax, time_ax]


# ---------------------------------------------------------------------------- calibration


def reliability_png(curves: dict[str, dict[str, Any]], title: str) -> bytes:
    """The reliability diagram: per confidence bin, how often the top class was right,
    against the diagonal of perfect calibration; one line per ``curves`` entry (label ->
    ``core.reliability.reliability``'s dict), its ECE in the legend, the image counts below."""
    with _figure(7.0, 7.5, _dpi(7.5)) as fig:
        draw_reliability(fig, curves, title)
        return _png(fig)


def draw_reliability(fig: Figure, curves: dict[str, dict[str, Any]], title: str) -> list[Axes]:
    top, counts = fig.subplots(2, 1, sharex=True, height_ratios=(3, 1))
    top.plot([0, 1], [0, 1], color="0.6", linestyle="--", label="perfectly calibrated")
    for label, curve in curves.items():
        seen = np.asarray(curve["count"]) > 0
        conf, acc = np.asarray(curve["confidence"])[seen], np.asarray(curve["accuracy"])[seen]
        top.plot(conf, acc, marker="o", label=f"{label} (ECE {curve['ece']:.4f})")
    top.set(xlim=(0, 1), ylim=(0, 1.02), ylabel="accuracy of the top class")
    top.legend(loc="upper left")
    edges = np.linspace(0, 1, len(next(iter(curves.values()))["count"]) + 1)
    last = list(curves.values())[-1]
    counts.bar(edges[:-1], last["count"], width=np.diff(edges), align="edge", color="C1")
    counts.set(xlabel="confidence (top-class probability)", ylabel="images")
    fig.suptitle(title, parse_math=False)
    return [top, counts]
