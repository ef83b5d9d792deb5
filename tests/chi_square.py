"""A chi-square goodness-of-fit check shared by the distribution tests."""

from __future__ import annotations

import numpy as np
from scipy.stats import chisquare

SIGNIFICANCE = 1e-3  # fixed seeds: a correct sampler passes deterministically; a biased one fails by far


def goodness_of_fit_pvalue(observed_counts, expected_probs, min_expected: float = 5.0) -> float:
    """p-value that ``observed_counts`` were drawn from ``expected_probs``.

    Cells with tiny expected counts are pooled into one (the chi-square approximation needs
    about 5 per cell). Observing any count where the expected probability is exactly zero is
    an outright failure (p = 0).
    """
    observed = np.asarray(observed_counts, dtype=np.float64).ravel()
    probs = np.asarray(expected_probs, dtype=np.float64).ravel()
    if observed[probs <= 0].sum() > 0:
        return 0.0
    expected = probs / probs.sum() * observed.sum()
    small = expected < min_expected
    if small.any():
        observed = np.append(observed[~small], observed[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
        if expected[-1] == 0:
            observed, expected = observed[:-1], expected[:-1]
    return float(chisquare(observed, expected).pvalue)
