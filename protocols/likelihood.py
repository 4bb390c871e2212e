"""Transcript likelihoods: the building blocks of the optimal attacker's test (docs/privacy_audit.md).

A privacy audit (scenarios/privacy_audit.py) runs canary devices through the real device side with one of two
inputs and asks, for each canary's whole transcript, which input produced it. By the Neyman-Pearson lemma
the most powerful test thresholds the likelihood ratio P[transcript | input 1] / P[transcript | input 0]. A
protocol that can write that likelihood down in closed form provides ``log_likelihood(values, reports,
present)`` on its parameter class, built from the pieces here; the others are audited with an empirical
test. The likelihoods are the attacker's model, written from the papers' formulas: they share nothing with
the device kernels, so a device that misbehaves (say, uses 1.3 eps while charging eps) is measured, not
assumed away.

Conventions: ``reports`` is one dict per collection round, column name -> (devices, width) array (zeros where
nothing arrived); ``present`` is (devices, rounds) bool. Rounds without a report contribute nothing: in an
audit, whether a report arrives does not depend on the input.
"""

from __future__ import annotations

import numpy as np


def _xlog(k: np.ndarray, p: float | np.ndarray) -> np.ndarray:
    """k log p with 0 log 0 = 0 (a count of zero events of probability zero costs nothing)."""
    k = np.asarray(k, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = k * np.log(p)
    return np.where(k == 0, 0.0, out)


def bernoulli_loglik(ones: np.ndarray, zeros: np.ndarray, p_one: float | np.ndarray) -> np.ndarray:
    """log P of ``ones`` ones and ``zeros`` zeros, each an independent Bernoulli(p_one) draw."""
    return _xlog(ones, p_one) + _xlog(zeros, 1.0 - np.asarray(p_one, dtype=np.float64))


def flipped_loglik(ones: np.ndarray, zeros: np.ndarray, bit: int, gamma: float) -> np.ndarray:
    """log P of the observed counts when every report repeats the memoized ``bit``, each copy flipped with
    probability gamma afresh (output perturbation, Ding et al. 2017 section 3.2)."""
    keep = 1.0 - gamma
    return (_xlog(ones, keep) + _xlog(zeros, gamma)) if bit else (_xlog(ones, gamma) + _xlog(zeros, keep))


def memo_bit_loglik(ones: np.ndarray, zeros: np.ndarray, p_one: float | np.ndarray, gamma: float) -> np.ndarray:
    """log P of the reports that all come from one memoized bit b ~ Bernoulli(p_one), each report b flipped
    with probability gamma: log( p_one (1-g)^ones g^zeros + (1 - p_one) g^ones (1-g)^zeros )."""
    p = np.asarray(p_one, dtype=np.float64)
    with np.errstate(divide="ignore"):
        one = np.log(p) + flipped_loglik(ones, zeros, 1, gamma)
        zero = np.log1p(-p) + flipped_loglik(ones, zeros, 0, gamma)
    return np.logaddexp(one, zero)


def sent_one_probability(p_one: float | np.ndarray, gamma: float) -> np.ndarray:
    """P[a sent bit is 1] when the mechanism's bit is 1 with p_one and then flips with gamma."""
    return gamma + (1.0 - 2.0 * gamma) * np.asarray(p_one, dtype=np.float64)


def column(reports: list[dict[str, np.ndarray]], name: str) -> np.ndarray:
    """Column ``name`` of every round stacked as (devices, rounds, width)."""
    return np.stack([np.asarray(r[name]).reshape(np.asarray(r[name]).shape[0], -1) for r in reports], axis=1)
