"""peagle.stats: the clustered 95% interval of a ratio (coverage on simulated requests whose rounds move together)
and the two-sample chi-square test (against scipy, its false-alarm rate on equal samplers, its power on a biased
one), on fresh random inputs."""

from __future__ import annotations

import math
import random

import pytest
import torch

from peagle.stats import chi2_survival, ratio_interval, two_sample_test

scipy_stats = pytest.importorskip("scipy.stats")


def test_chi2_survival_is_scipys(generator):
    for _ in range(20):
        df = int(torch.randint(1, 400, (), generator=generator))
        x = float(torch.rand((), generator=generator)) * 3 * df
        # torch.special.gammaincc is accurate to about 1e-6 (relative).
        assert chi2_survival(x, df) == pytest.approx(scipy_stats.chi2.sf(x, df), rel=1e-5, abs=1e-12)
    assert chi2_survival(3.0, 0) == 1.0


def test_two_sample_statistic_is_scipys_contingency_test_without_pooling(generator):
    # Large counts: nothing pooled, so the statistic is Pearson's on the whole 2 x C table.
    probs = torch.rand(6, generator=generator) + 0.5
    a = torch.multinomial(probs, 3000, replacement=True, generator=generator).tolist()
    b = torch.multinomial(probs, 2000, replacement=True, generator=generator).tolist()
    table = [[a.count(c) for c in range(6)], [b.count(c) for c in range(6)]]
    chi2, p, dof, _ = scipy_stats.chi2_contingency(table, correction=False)
    result = two_sample_test([a], [b])
    assert result.statistic == pytest.approx(chi2, rel=1e-9) and result.df == dof and result.p_value == pytest.approx(p)


def test_strata_add_up_and_rare_tokens_are_pooled(generator):
    probs = torch.rand(40, generator=generator) ** 3  # many rare tokens
    a = [torch.multinomial(probs, 200, replacement=True, generator=generator).tolist() for _ in range(3)]
    b = [torch.multinomial(probs, 200, replacement=True, generator=generator).tolist() for _ in range(3)]
    whole = two_sample_test(a, b)
    parts = [two_sample_test([x], [y]) for x, y in zip(a, b, strict=True)]
    assert whole.statistic == pytest.approx(sum(p.statistic for p in parts))
    assert whole.df == sum(p.df for p in parts) and whole.df < 3 * 39  # pooled
    with pytest.raises(ValueError, match="strata"):
        two_sample_test(a, b[:2])


def test_equal_samplers_are_rarely_rejected_and_a_biased_one_always(generator):
    """False alarms near the level on equal samplers; power against a sampler that sharpens the distribution (as a
    verifier at half the temperature would)."""
    logits = torch.randn(4, 50, generator=generator)
    sharp = (2 * logits).softmax(-1)
    rejected_equal, rejected_biased = 0, 0
    trials = 200
    for _ in range(trials):
        a = [torch.multinomial(row, 300, replacement=True, generator=generator).tolist() for row in logits.softmax(-1)]
        b = [torch.multinomial(row, 300, replacement=True, generator=generator).tolist() for row in logits.softmax(-1)]
        c = [torch.multinomial(row, 300, replacement=True, generator=generator).tolist() for row in sharp]
        rejected_equal += two_sample_test(a, b).p_value < 0.05
        rejected_biased += two_sample_test(a, c).p_value < 0.001
    assert rejected_equal / trials < 0.10  # level 0.05, with room for the chi-square approximation
    assert rejected_biased == trials


def test_ratio_interval_covers_the_true_ratio_of_clustered_rounds(generator):
    """Requests with their own acceptance rate (rounds of one request move together): the clustered interval covers
    the true mean about 95% of the time; one that treated rounds as independent would be too narrow."""
    rng = random.Random(int(torch.randint(0, 2**31, (), generator=generator)))
    truth = 1 + 0.5 * 5  # per-request rate ~ U(0, 1): E[accepted of 5 per round] = 2.5, AL 3.5
    covered, trials = 0, 300
    for _ in range(trials):
        emitted, rounds = [], []
        for _ in range(20):
            rate, n = rng.random(), rng.randint(5, 40)
            emitted.append(sum(1 + sum(rng.random() < rate for _ in range(5)) for _ in range(n)))
            rounds.append(n)
        interval = ratio_interval(emitted, rounds)
        covered += abs(interval.value - truth) <= interval.half_width
    assert 0.89 <= covered / trials <= 0.99
    assert ratio_interval([7], [2]).value == 3.5 and math.isinf(ratio_interval([7], [2]).half_width)
    assert ratio_interval([2, 4], [1, 2]).half_width == 0.0  # every cluster at the same ratio
    with pytest.raises(ValueError, match="sum to more than 0"):
        ratio_interval([1], [0])
