"""The two-sample tests drift uses, in numpy alone (the bento ships no scipy).

tests/watch/test_drift.py checks each against scipy on random data. Every test here compares a
*sample* of the reference with a sample of the current window, so each accounts for the
noise on both sides (a goodness-of-fit test against the reference's proportions as if they
were exact would flag a reference that was itself a sample).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

PSI_EPSILON = 1e-4  # a class absent from one side: log(p/q) stays finite
_GAMMA_EPS = 1e-14
_GAMMA_ITER = 1000


@dataclass(frozen=True)
class TestResult:
    """A test's statistic and its p-value (small: the two samples differ)."""

    statistic: float
    p_value: float


# ------------------------------------------------------------------------- chi-square


def gamma_q(a: float, x: float) -> float:
    """The regularized upper incomplete gamma function Q(a, x) = Gamma(a, x) / Gamma(a)."""
    if a <= 0:
        raise ValueError(f"gamma_q needs a > 0, got {a}")
    if x <= 0:
        return 1.0
    log_front = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1:  # the series for P converges fast here; Q = 1 - P
        term = total = 1.0 / a
        ap = a
        for _ in range(_GAMMA_ITER):
            ap += 1
            term *= x / ap
            total += term
            if abs(term) < abs(total) * _GAMMA_EPS:
                break
        return max(0.0, 1.0 - total * math.exp(log_front))
    # Lentz's continued fraction for Q (Numerical Recipes 6.2), fast for x >= a + 1.
    tiny = 1e-300
    b = x + 1 - a
    c = 1 / tiny
    d = 1 / b
    h = d
    for i in range(1, _GAMMA_ITER):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < _GAMMA_EPS:
            break
    return min(1.0, math.exp(log_front) * h)


def chi2_sf(x: float, dof: int) -> float:
    """P(X >= x) for a chi-square variable with ``dof`` degrees of freedom."""
    if dof < 1:
        raise ValueError(f"chi2_sf needs dof >= 1, got {dof}")
    return gamma_q(dof / 2, x / 2)


def chi2_two_sample(reference: np.ndarray, current: np.ndarray) -> tuple[TestResult, int]:
    """Chi-square test of homogeneity on two vectors of class counts (a 2 x K table);
    returns the result and its degrees of freedom.

    A class that neither side holds has no expected count and is left out (its column
    says nothing); a class only one side holds has a positive expected count on both, so
    it counts fully. Fewer than two classes seen: nothing to compare (p = 1).
    """
    table = np.stack([np.asarray(reference, float), np.asarray(current, float)])
    if table.ndim != 2 or (table < 0).any():
        raise ValueError("class counts must be two non-negative vectors of one length")
    table = table[:, table.sum(axis=0) > 0]
    rows, cols = table.sum(axis=1), table.sum(axis=0)
    if table.shape[1] < 2 or (rows == 0).any():
        return TestResult(0.0, 1.0), 0
    expected = np.outer(rows, cols) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    dof = table.shape[1] - 1
    return TestResult(stat, chi2_sf(stat, dof)), dof


def psi(reference: np.ndarray, current: np.ndarray, epsilon: float = PSI_EPSILON) -> float:
    """Population stability index of two count (or proportion) vectors:
    sum((q - p) * ln(q / p)), with each proportion floored at ``epsilon``."""
    p = np.asarray(reference, float)
    q = np.asarray(current, float)
    if p.shape != q.shape or p.sum() <= 0 or q.sum() <= 0:
        raise ValueError("psi needs two non-empty count vectors of one length")
    p = np.maximum(p / p.sum(), epsilon)
    q = np.maximum(q / q.sum(), epsilon)
    return float(((q - p) * np.log(q / p)).sum())


# ------------------------------------------------------------------------- KS


def kolmogorov_sf(z: float) -> float:
    """P(K >= z) for the Kolmogorov distribution (the KS statistic's limit, scaled)."""
    if z <= 0:
        return 1.0
    if z < 1.18:  # the theta-function form converges where the alternating sum does not
        y = math.exp(-(math.pi**2) / (8 * z * z))
        cdf = math.sqrt(2 * math.pi) / z * (y + y**9 + y**25 + y**49)
        return min(1.0, max(0.0, 1.0 - cdf))
    k = np.arange(1, 101)
    terms = 2 * (-1.0) ** (k - 1) * np.exp(-2 * k * k * z * z)
    return float(min(1.0, max(0.0, terms.sum())))


def ks_two_sample(a: np.ndarray, b: np.ndarray) -> TestResult:
    """Two-sample Kolmogorov-Smirnov: the largest gap between the two empirical CDFs, and
    its asymptotic p-value (Kolmogorov's limit at n*m/(n+m))."""
    a = np.sort(np.asarray(a, float).ravel())
    b = np.sort(np.asarray(b, float).ravel())
    if a.size == 0 or b.size == 0:
        raise ValueError("ks_two_sample needs two non-empty samples")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError("ks_two_sample: a sample holds NaN or infinity")
    grid = np.concatenate([a, b])
    # side="right": at a tie the CDF already counts the tied values (ties in both samples).
    gap = np.abs(
        np.searchsorted(a, grid, side="right") / a.size
        - np.searchsorted(b, grid, side="right") / b.size
    )
    d = float(gap.max())
    en = a.size * b.size / (a.size + b.size)
    return TestResult(d, kolmogorov_sf(math.sqrt(en) * d))


# ------------------------------------------------------------------------- MMD


def _subsample(x: np.ndarray, limit: int, rng: np.random.Generator) -> np.ndarray:
    if x.shape[0] <= limit:
        return x
    return x[np.sort(rng.choice(x.shape[0], limit, replace=False))]


def rbf_kernel(z: np.ndarray) -> tuple[np.ndarray, float]:
    """The RBF kernel matrix of the rows of ``z``, exp(-d^2 / h), with the bandwidth h the
    median squared distance between distinct rows (the median heuristic); and h."""
    sq = np.einsum("ij,ij->i", z, z)
    d2 = np.maximum(sq[:, None] + sq[None, :] - 2 * (z @ z.T), 0.0)
    upper = d2[np.triu_indices(z.shape[0], k=1)]
    h = float(np.median(upper)) if upper.size else 1.0
    h = h if h > 0 else 1.0  # all rows equal: any bandwidth gives the same (zero) MMD
    return np.exp(-d2 / h), h


def mmd_permutation(
    x: np.ndarray,
    y: np.ndarray,
    *,
    permutations: int = 200,
    max_rows: int = 500,
    seed: int = 0,
) -> TestResult:
    """Squared maximum mean discrepancy (the biased V-statistic) between the rows of ``x``
    and ``y`` under an RBF kernel, and a permutation p-value: the share of ``permutations``
    random relabellings of the pooled rows whose MMD^2 is at least as large ((1 + hits) /
    (1 + permutations), never 0). Each side is first subsampled to ``max_rows`` (seeded),
    which keeps the kernel matrix at most 1000 x 1000."""
    if x.ndim != 2 or y.ndim != 2 or x.shape[1] != y.shape[1]:
        raise ValueError(f"mmd needs two [N, D] arrays of one D, got {x.shape} and {y.shape}")
    if x.shape[0] < 2 or y.shape[0] < 2:
        raise ValueError("mmd needs at least two rows on each side")
    rng = np.random.default_rng(seed)
    x = _subsample(np.asarray(x, np.float64), max_rows, rng)
    y = _subsample(np.asarray(y, np.float64), max_rows, rng)
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise ValueError("mmd: an embedding holds NaN or infinity")
    kernel, _ = rbf_kernel(np.concatenate([x, y]))
    n, m = x.shape[0], y.shape[0]
    # MMD^2 = w' K w with w = 1/n on x's rows and -1/m on y's: every permutation's weights
    # as one [n+m, P] matrix make all of them a single matrix product.
    base = np.concatenate([np.full(n, 1 / n), np.full(m, -1 / m)])
    weights = np.empty((n + m, permutations + 1))
    weights[:, 0] = base
    for j in range(1, permutations + 1):
        weights[:, j] = rng.permutation(base)
    stats = np.einsum("ij,ij->j", weights, kernel @ weights)
    observed = float(stats[0])
    hits = int((stats[1:] >= observed - 1e-12).sum())
    return TestResult(observed, (1 + hits) / (1 + permutations))
