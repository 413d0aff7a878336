"""Drift: a window of a model's predictions against the model's reference.

Three measures, each a two-sample test with its own threshold (params.yaml ``drift``):

- ``class_mix``: the predicted classes' counts, chi-square homogeneity p-value AND the PSI
  (chi-square alone calls a one-point change in a class's share significant on a large
  window; PSI says whether the change is large enough to matter);
- ``confidence``: the top-1 probabilities, two-sample KS (p-value AND the statistic);
- ``embedding``: the model's embeddings, MMD^2 with a permutation p-value; left out when
  the window or the reference has none (a model exported before the embedding output).

The window drifted when any measure did; the one-line summary names which.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from trainyard.core.config import DriftParams
from trainyard.core.errors import DataError
from trainyard.watch import stats
from trainyard.watch.reference import Reference

CLASS_MIX, CONFIDENCE, EMBEDDING = "class_mix", "confidence", "embedding"
# The skip reason of a window's rows that another model than the reference's answered
# (trainyard.watch.current writes it, with the model's sha256 prefix after it).
OTHER_MODEL = "another model than the reference's"


@dataclass(frozen=True)
class Window:
    """The current predictions: top-1 ``labels`` [n] (str), their ``probabilities`` [n],
    and ``embeddings`` [n, D] or None; ``source`` says where they came from, ``skipped``
    how many rows were left out (an unreadable file's row, another model's rows) and why."""

    labels: np.ndarray
    probabilities: np.ndarray
    embeddings: np.ndarray | None
    source: str
    skipped: dict[str, int] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return int(self.labels.shape[0])


@dataclass(frozen=True)
class Measure:
    """One measure's test: ``statistic`` and ``p_value`` of ``test``; ``drifted`` when the
    p-value is below ``alpha`` and (where there is one) the effect size ``effect`` is above
    ``effect_threshold``."""

    name: str
    test: str
    statistic: float
    p_value: float
    alpha: float
    drifted: bool
    effect_name: str | None = None
    effect: float | None = None
    effect_threshold: float | None = None

    def describe(self) -> str:
        """``confidence (KS p=1.2e-05, D=0.21)``."""
        text = f"{self.name} ({self.test} p={self.p_value:.2g}"
        if self.effect_name is not None and self.effect is not None:
            text += f", {self.effect_name}={self.effect:.3g}"
        return text + ")"


@dataclass(frozen=True)
class DriftResult:
    """Every measure's result, the verdict, and the one-line ``summary``; ``notes`` say
    once what was left out (no embeddings, skipped rows)."""

    measures: list[Measure]
    drifted: bool
    n: int
    reference_n: int
    source: str
    notes: list[str]
    summary: str

    @property
    def drifted_measures(self) -> list[str]:
        return [m.name for m in self.measures if m.drifted]

    def to_json(self) -> dict[str, Any]:
        return {
            "drifted": self.drifted,
            "drifted_measures": self.drifted_measures,
            "summary": self.summary,
            "n": self.n,
            "reference_n": self.reference_n,
            "source": self.source,
            "notes": list(self.notes),
            "measures": {m.name: asdict(m) for m in self.measures},
        }


def class_counts(reference: Reference, labels: np.ndarray) -> np.ndarray:
    """The window's count per reference class; a DataError naming labels it does not know
    (the window comes from a model with other classes than the reference's)."""
    names, counts = np.unique(labels.astype(str), return_counts=True)
    index = {c: i for i, c in enumerate(reference.classes)}
    unknown = [str(n) for n in names if n not in index]
    if unknown:
        shown = ", ".join(repr(u) for u in unknown[:5]) + (" ..." if len(unknown) > 5 else "")
        raise DataError(
            f"the predictions hold {len(unknown)} label(s) the reference's model does not "
            f"have: {shown}; compare them with the reference of the model that made them "
            "(--reference)"
        )
    out = np.zeros(len(reference.classes), np.int64)
    for name, count in zip(names, counts, strict=True):
        out[index[str(name)]] = count
    return out


def compare(
    reference: Reference, current: Window, params: DriftParams | None = None
) -> DriftResult:
    """The window against the reference, by every measure both sides allow. A window with
    fewer than ``min_rows`` rows is a DataError: too few to tell, never a verdict."""
    p = params or DriftParams()
    notes = [f"{count} rows skipped: {why}" for why, count in current.skipped.items() if count]
    if current.n < p.min_rows:
        # Rows another model answered want that model's reference, not a wider window.
        other = any(why.startswith(OTHER_MODEL) for why in current.skipped)
        widen = [] if other else ["widen the window"]
        raise DataError(
            f"{current.source}: {current.n} usable rows, drift needs at least "
            f"{p.min_rows} (drift.min_rows) to tell a shift from noise: "
            + "; ".join([*widen, *notes])
        )
    counts = class_counts(reference, current.labels)
    chi2, _ = stats.chi2_two_sample(reference.class_counts, counts)
    psi = stats.psi(reference.class_counts, counts)
    ks = stats.ks_two_sample(reference.confidence, current.probabilities)
    measures = [
        _gated(CLASS_MIX, "chi2", chi2, p.alpha, "PSI", psi, p.psi),
        _gated(CONFIDENCE, "KS", ks, p.alpha, "D", ks.statistic, p.ks_statistic),
    ]
    embedding, why_not = _embedding_measure(reference, current, p)
    if embedding is not None:
        measures.append(embedding)
    else:
        notes.append(f"class mix and confidence only: {why_not}")
    drifted = any(m.drifted for m in measures)
    return DriftResult(
        measures=measures,
        drifted=drifted,
        n=current.n,
        reference_n=reference.n,
        source=current.source,
        notes=notes,
        summary=_summary(measures, current.n, notes),
    )


def _gated(
    name: str,
    test: str,
    result: stats.TestResult,
    alpha: float,
    effect_name: str,
    effect: float,
    threshold: float,
) -> Measure:
    """A measure that drifts only when its p-value is below ``alpha`` and its effect size is
    above ``threshold``: on a large window the p-value alone flags shifts too small to
    matter."""
    return Measure(
        name=name,
        test=test,
        statistic=result.statistic,
        p_value=result.p_value,
        alpha=alpha,
        drifted=result.p_value < alpha and effect > threshold,
        effect_name=effect_name,
        effect=effect,
        effect_threshold=threshold,
    )


def _embedding_measure(
    reference: Reference, current: Window, p: DriftParams
) -> tuple[Measure | None, str]:
    """The MMD measure, or None and why it cannot be taken."""
    if reference.embeddings is None:
        return None, "the reference has no embeddings (a model exported without them)"
    if current.embeddings is None:
        return None, (
            "the predictions hold no embeddings (a model exported without them, a trainyard "
            "predict table, or a service with serve.batching on)"
        )
    if current.embeddings.shape[1] != reference.embeddings.shape[1]:
        raise DataError(
            f"{current.source}: embeddings of {current.embeddings.shape[1]} values, the "
            f"reference's have {reference.embeddings.shape[1]}: they come from another model"
        )
    mmd = stats.mmd_permutation(
        reference.embeddings,
        current.embeddings,
        permutations=p.permutations,
        max_rows=p.mmd_rows,
        seed=p.seed,
    )
    drifted = mmd.p_value < p.alpha
    return Measure(EMBEDDING, "MMD", mmd.statistic, mmd.p_value, p.alpha, drifted), ""


def _summary(measures: list[Measure], n: int, notes: list[str]) -> str:
    drifted = [m for m in measures if m.drifted]
    if drifted:
        line = "drift: " + ", ".join(m.describe() for m in drifted) + f" (n={n})"
    else:
        names = ", ".join(m.name.replace("_", " ") for m in measures)
        line = f"no drift in {names} (n={n})"
    only = [note for note in notes if note.startswith("class mix and confidence only")]
    return line + (f"; {only[0]}" if only else "")
