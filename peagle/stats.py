"""Statistics every package may use (the bottom tier, beside ``peagle.io``): the 95% interval of an acceptance
length measured over requests, and the two-sample test that checks a sampled decoder against the target alone.

Acceptance length is a ratio of sums, tokens over verifications, and the verifications of one request (or one text)
are not independent: a hard prompt lowers all of them. :func:`ratio_interval` therefore treats each request as one
cluster (the delta method for a ratio of cluster totals), which is wider, and honest, where rounds of one request
move together.

:func:`two_sample_test` is Pearson's chi-square test of homogeneity between two samples of categories (tokens),
summed over independent strata (prompts, positions): rare categories are pooled so that every expected count is at
least 5, and the p-value comes from the chi-square survival function (``torch.special.gammaincc``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Sequence
from typing import NamedTuple

import torch

__all__ = ["Interval", "TwoSampleTest", "chi2_survival", "ratio_interval", "two_sample_test"]

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile


class Interval(NamedTuple):
    """An estimate and the half width of its 95% interval (``value`` +- ``half_width``)."""

    value: float
    half_width: float

    @property
    def width(self) -> float:
        return 2 * self.half_width

    def __str__(self) -> str:
        return f"{self.value:.3f} +- {self.half_width:.3f}"


def ratio_interval(numerators: Sequence[float], denominators: Sequence[float]) -> Interval:
    """sum(numerators) / sum(denominators) and its 95% interval, the pairs being independent clusters (requests):
    the delta method, var = n / (n - 1) * sum((y_i - R x_i)^2) / (sum x_i)^2. One cluster (or none) gives an infinite
    half width: a single request says nothing about how the next one varies."""
    if len(numerators) != len(denominators):
        raise ValueError(f"numerators and denominators differ in length: {len(numerators)} != {len(denominators)}")
    total = float(sum(denominators))
    if total <= 0:
        raise ValueError("the denominators must sum to more than 0")
    ratio = float(sum(numerators)) / total
    n = len(numerators)
    if n < 2:
        return Interval(ratio, math.inf)
    spread = sum((y - ratio * x) ** 2 for y, x in zip(numerators, denominators, strict=True))
    return Interval(ratio, Z95 * math.sqrt(n / (n - 1) * spread) / total)


def chi2_survival(statistic: float, df: int) -> float:
    """P(X >= statistic) for X ~ chi-square with ``df`` degrees of freedom."""
    if df < 1:
        return 1.0
    value = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(statistic / 2))
    return float(value)


class TwoSampleTest(NamedTuple):
    statistic: float
    df: int
    p_value: float


def _stratum(a: Sequence[Hashable], b: Sequence[Hashable], min_expected: float) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom of one stratum's 2 x C table, rare categories pooled."""
    ca, cb = Counter(a), Counter(b)
    na, nb = len(a), len(b)
    if na == 0 or nb == 0:
        return 0.0, 0
    share = min(na, nb) / (na + nb)
    # Categories whose smaller expected count would fall below min_expected go into one pooled category.
    cells, pooled = [], [0, 0]
    for key in sorted(set(ca) | set(cb), key=repr):
        pair = (ca[key], cb[key])
        if sum(pair) * share >= min_expected:
            cells.append(pair)
        else:
            pooled = [pooled[0] + pair[0], pooled[1] + pair[1]]
    if sum(pooled) * share >= min_expected or (sum(pooled) and not cells):
        cells.append(tuple(pooled))
    elif sum(pooled) and cells:  # too few to stand alone: merge into the smallest kept category
        i = min(range(len(cells)), key=lambda j: sum(cells[j]))
        cells[i] = (cells[i][0] + pooled[0], cells[i][1] + pooled[1])
    if len(cells) < 2:
        return 0.0, 0
    statistic = 0.0
    for x, y in cells:
        total = x + y
        for observed, n in ((x, na), (y, nb)):
            expected = total * n / (na + nb)
            statistic += (observed - expected) ** 2 / expected
    return statistic, len(cells) - 1


def two_sample_test(
    samples_a: Sequence[Sequence[Hashable]], samples_b: Sequence[Sequence[Hashable]], min_expected: float = 5.0
) -> TwoSampleTest:
    """Do two samplers draw from the same distributions? ``samples_a[s]`` and ``samples_b[s]``: the draws of stratum
    s (say, the token at one position after one prompt) by each sampler. The strata's chi-square statistics and
    degrees of freedom add up (independent strata); a small p-value says the samplers differ."""
    if len(samples_a) != len(samples_b):
        raise ValueError(f"the samples have {len(samples_a)} and {len(samples_b)} strata; they must match")
    statistic, df = 0.0, 0
    for a, b in zip(samples_a, samples_b, strict=True):
        s, d = _stratum(a, b, min_expected)
        statistic, df = statistic + s, df + d
    return TwoSampleTest(statistic, df, chi2_survival(statistic, df))
