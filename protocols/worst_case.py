"""Worst-case privacy loss of a memoized device's whole transcript against ANY other device.

Ding, Kulkarni, Yekhanin (NIPS 2017) charge a memoized device pattern width x eps (Theorem 4): a guarantee
against devices with the same behavior pattern (Definition 2) only. Two devices in different patterns are
told apart with certainty without output perturbation, and with it (each sent bit flipped with fresh
probability gamma, Theorems 5-6) the loss grows with the number of rounds. This module computes that second
figure: max over outputs o and input sequences g, g' of ln P(o | g) / P(o | g'). Pure math (numpy only).

Model (1BitRRPM). Rounds with the same rounded value g form a block sharing one memo bit B ~ Bern(p_g); the
sent bit is B xor Bern(gamma). With a = 1 - gamma, b = gamma, lam = ln(a/b)/2 and s_B = (ones - zeros of o in
block B),

    P(o | g) = (ab)^(T/2) prod_B exp H(p_B, s_B),   H(p, s) = ln(p e^(lam s) + (1 - p) e^(-lam s)).

So only the blocks' p and imbalance s matter: a block with as many ones as zeros costs nothing whatever its p.
Write n1, n0 for the ones and zeros of o, q = e^eps/(e^eps + 1) (so p is in [1 - q, q]).

Facts used (proved here, and checked against brute-force enumeration in tests/test_worst_case.py):
(a) H(p, .) is convex (log-sum-exp of linear functions) with H(p, 0) = 0, hence superadditive on s >= 0;
    H(p, s) is increasing in p for s > 0 and, for p >= 1/2, increasing in s >= 0; H(1 - p, s) = H(p, -s).
(b) Merge lemma: H(p, u) + H(p, -v) >= H(p, u - v) for u, v >= 0. With x = e^(lam u), y = e^(lam v):
    (p x + (1-p)/x)(p/y + (1-p) y) - (p x/y + (1-p) y/x) = p(1-p)(x^2 - 1)(y^2 - 1)/(xy) >= 0.
Maximum (numerator). Each positive block has H <= H(q, s_B); by superadditivity and monotonicity the sum over
    positive blocks is <= H(q, n1), likewise negative blocks <= H(q, n0). Both are attained at once: all ones
    in one block at p = q (grid value m), all zeros in another at p = 1 - q (grid value 0). So
    max_g ln P(o | g) = const + H(q, n1) + H(q, n0), exact on every grid (|G| >= 2).
Minimum (denominator). By (b) we may give each grid value j a positive part u_j and a negative part v_j
    separately (merging them never costs more and uses fewer rounds). Leftover rounds pair a one with a zero
    (cost 0) and join any block. So min = min over k (balanced pairs) of Phi(n1 - k) + Psi(n0 - k), where
    Phi(P) = min sum_j H(p_j, u_j) over sum u_j = P and Psi likewise with H(1 - p_j, .). Each H(p_j, .) is
    convex, so Phi(P) is the sum of the P smallest increments H(p_j, u + 1) - H(p_j, u) over all j and u
    (separable convex allocation); only the T smallest p_j can matter (a block moves to a smaller p for free).
    Continuous grid (any number of blocks at p = 1 - q, the limit s -> 0): Phi(P) = P H(1 - q, 1), i.e. the
    minimum uses single-round blocks at the extreme p: all T rounds when H(1 - q, 1) < 0 (iff
    (1 - gamma)/gamma < e^(2 eps)), else |n1 - n0| rounds, the others paired. A finite grid has only one
    value at each extreme, so its loss can be smaller; the exact finite-grid value is computed in O(T^2) time.
"""

from __future__ import annotations

import functools
import heapq
import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class WorstCase:
    """A worst-case transcript loss: ``value`` (math.inf when unbounded), ``exact`` (False: an upper bound)
    and ``method``, how it was computed."""

    value: float
    exact: bool
    method: str


# ------------------------------------------------------------------------------------------- helpers
def _check(epsilon: float, gamma: float, rounds: int) -> None:
    if not (math.isfinite(epsilon) and epsilon > 0):
        raise ValueError(f"epsilon must be a positive number, got {epsilon}")
    if not 0.0 <= gamma < 0.5:
        raise ValueError(f"gamma must be in [0, 0.5), got {gamma}")
    if int(rounds) != rounds or rounds < 0:
        raise ValueError(f"rounds must be a non-negative integer, got {rounds}")


def one_report_loss(epsilon: float, gamma: float) -> float:
    """Loss of one 1BitMean bit with output perturbation (Ding et al. 2017, Theorem 6):
    eps' = ln(((1 - 2g) q + g)/((1 - 2g)(1 - q) + g)), q = e^eps/(e^eps + 1); eps when gamma = 0."""
    q = 1.0 / (1.0 + math.exp(-epsilon))
    return math.log(((1 - 2 * gamma) * q + gamma) / ((1 - 2 * gamma) * (1 - q) + gamma))


def _h(lam: float, p: np.ndarray, s: np.ndarray) -> np.ndarray:
    """H(p, s) = ln(p e^(lam s) + (1 - p) e^(-lam s)), stable for large lam s."""
    return np.logaddexp(np.log(p) + lam * s, np.log1p(-p) - lam * s)


def _min_spend(lam: float, ps: np.ndarray, rounds: int) -> np.ndarray:
    """Phi(P) for P = 0..rounds: min sum_j H(p_j, u_j) over u_j >= 0 with sum u_j = P (one block per p_j):
    the sum of the P smallest increments H(p_j, u + 1) - H(p_j, u), merged with a heap because each row's
    increments increase along u (convexity). O((len(ps) + rounds) log) time, O(len(ps) + rounds) memory."""
    ps = np.sort(np.asarray(ps, dtype=np.float64))[:rounds]  # only the `rounds` smallest p can be used
    logp, logq = np.log(ps), np.log1p(-ps)

    def h(j: int, s: int) -> float:
        a, b = logp[j] + lam * s, logq[j] - lam * s
        return max(a, b) + math.log1p(math.exp(-abs(a - b)))

    heap = [(h(j, 1), j, 1) for j in range(ps.size)]  # H(p, 0) = 0: the first increment is H(p, 1)
    heapq.heapify(heap)
    steps = np.empty(rounds)
    for i in range(rounds):
        step, j, u = heapq.heappop(heap)
        steps[i] = step
        heapq.heappush(heap, (h(j, u + 1) - h(j, u), j, u + 1))
    return np.concatenate(([0.0], np.cumsum(steps)))


def _multiset_loss(lam: float, ps: np.ndarray, rounds: int) -> float:
    """Exact max over o, g, g' of ln P(o|g)/P(o|g') when the blocks of a device take distinct entries of
    the multiset ``ps`` (p-values of the memo inputs; needs min(ps) <= 1/2 <= max(ps), two entries or more)."""
    ps = np.asarray(ps, dtype=np.float64)
    t = rounds
    n1 = np.arange(t + 1)
    n0 = t - n1
    top = _h(lam, ps.max(), n1) + _h(lam, 1.0 - ps.min(), n0)  # ones block at max p, zeros block at min p
    phi, psi = _min_spend(lam, ps, t), _min_spend(lam, 1.0 - ps, t)
    low = phi[n1] + psi[n0]  # k = 0 balanced pairs
    for k in range(1, t // 2 + 1):
        ok = np.minimum(n1, n0) >= k
        low[ok] = np.minimum(low[ok], phi[n1[ok] - k] + psi[n0[ok] - k])
    return float(max((top - low).max(), 0.0))


def _grid_p(epsilon: float, count: int, grid_size: int) -> np.ndarray:
    """The ``count`` smallest memo-bit probabilities p(g) of a grid of ``grid_size`` values."""
    q = 1.0 / (1.0 + math.exp(-epsilon))
    j = np.arange(min(count, grid_size), dtype=np.float64)
    return (1.0 - q) + j / (grid_size - 1) * (2.0 * q - 1.0)


# ------------------------------------------------------------------------------------------- public API
@functools.lru_cache(maxsize=256)  # a pure function of its numbers; a run's summary and plot both ask
def memo_bit_worst_case(epsilon: float, gamma: float, rounds: int, grid_size: int | None = None) -> WorstCase:
    """Worst-case loss of a 1BitRRPM device's ``rounds``-round transcript against any other device's input
    sequence (max over outputs and pairs of rounded input sequences; for inputs off the grid the alpha-point
    rounding mixes over grid sequences, which cannot increase the ratio).

    ``grid_size`` |G| = m/s + 1 gives the exact value for that grid; None gives the continuous-grid relaxation
    (any number of memo inputs at any p in [1 - q, q]): an upper bound for every grid, tight as s -> 0.
    gamma = 0 and rounds >= 2: unbounded (a constant device never changes its bit, a device with two grid
    values may). rounds = 1: eps' of Theorem 6. See the module docstring for the derivation.
    """
    _check(epsilon, gamma, rounds)
    if grid_size is not None and (int(grid_size) != grid_size or grid_size < 2):
        raise ValueError(f"grid_size must be an integer >= 2, got {grid_size}")
    rounds = int(rounds)
    if rounds == 0:
        return WorstCase(0.0, True, "no reports")
    if rounds == 1:
        return WorstCase(one_report_loss(epsilon, gamma), True, "one report: eps' of Theorem 6")
    if gamma == 0.0:
        return WorstCase(math.inf, True, "unbounded: no output perturbation (a change of bit is certain "
                                         "evidence of two memo inputs)")
    lam = 0.5 * math.log((1.0 - gamma) / gamma)
    q = 1.0 / (1.0 + math.exp(-epsilon))
    if grid_size is None:
        # As many blocks at each extreme as there are rounds: the supremum over grids. Every grid holds the
        # two extremes (grid values 0 and m), so when two values already reach it, it is every grid's value.
        relaxed = _multiset_loss(lam, np.array([1.0 - q, q]).repeat(rounds), rounds)
        if relaxed <= _multiset_loss(lam, np.array([1.0 - q, q]), rounds) * (1 + 1e-12):
            return WorstCase(relaxed, True, "exact for every grid (attained with grid values 0 and m)")
        return WorstCase(relaxed, False, "upper bound: continuous grid relaxation (any number of memo inputs "
                                         "at each p; tight as s -> 0)")
    grid_size = int(grid_size)
    if grid_size <= 2 * rounds:
        ps = _grid_p(epsilon, grid_size, grid_size)
    else:  # only the `rounds` smallest and `rounds` largest p can be used; the grid is symmetric
        low = _grid_p(epsilon, rounds, grid_size)
        ps = np.concatenate((low, 1.0 - low))
    return WorstCase(_multiset_loss(lam, ps, rounds), True,
                     f"exact: two-block maximum and convex min-spend over behavior patterns "
                     f"(grid of {grid_size} values)")


@functools.lru_cache(maxsize=256)
def dbitflippm_worst_case(epsilon: float, gamma: float, rounds: int, bits: int, buckets: int) -> WorstCase:
    """Worst-case loss of a dBitFlipPM device's ``rounds``-round transcript against any other device.

    The memo input is s = (position of the device's bucket in J) + 1, or 0 when it is not in J (impossible
    when d = k), so there are d + 1 inputs (d when d = k); bit p of input s is Bern(e^(eps/2)/(e^(eps/2) + 1))
    if p = s - 1 else Bern(1/(e^(eps/2) + 1)), independent over (s, p) (Ding et al. 2017, section 3).
    J is drawn independently of the data, so it cancels from the ratio. Given the input sequence the d bit
    positions are independent and position p is a one-bit memo sequence whose blocks take distinct p-values
    from {1 one at e^(eps/2)/(e^(eps/2)+1), the rest at 1/(e^(eps/2)+1)}; summing the exact per-position loss
    over the d positions is an upper bound (the positions share the partition, which the bound ignores).
    Exact for d = 1 (1BitRRPM with two grid values at eps/2) and for one report (min(d, 2) eps'(eps/2)).
    gamma = 0 and rounds >= 2: unbounded.
    """
    _check(epsilon, gamma, rounds)
    if not 2 <= buckets or not 1 <= bits <= buckets:
        raise ValueError(f"need 1 <= bits <= buckets and buckets >= 2, got bits={bits}, buckets={buckets}")
    rounds = int(rounds)
    if rounds == 0:
        return WorstCase(0.0, True, "no reports")
    if rounds == 1:
        return WorstCase(min(bits, 2) * one_report_loss(epsilon / 2, gamma), True,
                         "one report: two inputs differ in at most min(d, 2) bits, eps'(eps/2) each")
    if gamma == 0.0:
        return WorstCase(math.inf, True, "unbounded: no output perturbation")
    lam = 0.5 * math.log((1.0 - gamma) / gamma)
    q = 1.0 / (1.0 + math.exp(-epsilon / 2))
    inputs = bits + 1 if bits < buckets else bits
    ps = np.array([1.0 - q] * (inputs - 1) + [q])
    per_position = _multiset_loss(lam, ps, rounds)
    if bits == 1:
        return WorstCase(per_position, True, "exact: one bit, 1BitRRPM with two grid values at eps/2")
    return WorstCase(bits * per_position, False,
                     f"upper bound: sum over the {bits} positions of the exact one-bit loss at eps/2 "
                     f"({inputs} memo inputs)")


def within_pattern_bound(epsilon: float, rounds: int, memo_inputs: int) -> float:
    """Theorem 4's figure for the worst device: pattern width x eps, the width being at most
    min(rounds, memo_inputs) (|G| for 1BitRRPM, d + 1 for dBitFlipPM). A guarantee only against devices
    with the same behavior pattern (Definition 2), not against every other device."""
    if int(rounds) != rounds or rounds < 0 or int(memo_inputs) != memo_inputs or memo_inputs < 1:
        raise ValueError("rounds must be >= 0 and memo_inputs >= 1 (integers)")
    return min(int(rounds), int(memo_inputs)) * float(epsilon)
