"""One round of a fresh-report protocol, described so that a privacy-loss-distribution (PLD) accountant can
compose it (docs/privacy_accounting.md, "(eps, delta) accounting beside pure eps").

An accountant needs, for each round, a *dominating pair*: two output distributions P and Q such that for
every pair of inputs x, x' and every alpha >= 0

    H_alpha(M(x) || M(x')) <= H_alpha(P || Q),    H_alpha(P || Q) = sum_o (P(o) - alpha Q(o))_+

(the hockey-stick divergence; delta(eps) of the pair is H at alpha = e^eps). Dominating pairs compose: if
(P_t, Q_t) dominates round t for every history, the product of the pairs dominates the adaptive composition of
the rounds (Zhu, Dong, Wang, "Optimal Accounting of Differential Privacy via Characteristic Function",
AISTATS 2022, section 3). So the per-round descriptions here are pairs, each with the argument why it
dominates, and ``attained`` says whether the pair is the output law of a real input pair (then the bound is
tight for that round) or only an upper bound built from other bounds.

Two facts used throughout:
- Binary randomized response at eps dominates every eps-DP mechanism (Kairouz, Oh, Viswanath, "The
  Composition Theorem for Differential Privacy", ICML 2015, section 2: its privacy region contains every
  eps-DP mechanism's). A two-output mechanism whose output probabilities lie between RR's is a
  post-processing of it, so such pairs are dominated by the extreme pair.
- A convex function below H_alpha of two dominating pairs is itself the H-curve of a pair (any convex,
  non-increasing curve with H_0 = 1 and H_alpha >= (1 - alpha)_+ is one): :func:`lower_envelope` builds the
  tightest pair implied by two valid bounds, :func:`upper_envelope` one pair that dominates two mechanisms
  (for a round that runs one or the other).

This module is sans-IO and numpy-only, like the rest of ``protocols/``; ``scenarios/accounting.py`` turns the
descriptions into dp-accounting PLDs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

_SUM_TOL = 1e-9  # a probability vector must sum to 1 within this
_JUMP_TOL = 1e-13  # a rebuilt curve's outputs with P and Q both below this are rounding noise (merged upward)


@dataclass(frozen=True)
class DiscretePair:
    """P and Q over the same finite set of ``outputs``: the round's output law under input x (P) and x' (Q).

    ``inputs`` names x and x'; ``derivation`` cites the paper and equation and says why the pair dominates
    every input pair; ``attained`` is True when P and Q are the real output laws of x and x' (the bound is then
    exact for one round), False for a dominating pair built from bounds."""

    outputs: tuple[str, ...]
    p: tuple[float, ...]
    q: tuple[float, ...]
    inputs: str
    derivation: str
    attained: bool = True

    def __post_init__(self) -> None:
        if not (len(self.outputs) == len(self.p) == len(self.q)) or not self.outputs:
            raise ValueError("outputs, p and q must have the same non-zero length")
        for name, v in (("p", self.p), ("q", self.q)):
            a = np.asarray(v, dtype=np.float64)
            if not np.all(np.isfinite(a)) or np.any(a < 0) or abs(float(a.sum()) - 1.0) > _SUM_TOL:
                raise ValueError(f"{name} must be a probability vector, got {v}")

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(self.p, dtype=np.float64), np.asarray(self.q, dtype=np.float64)

    def losses(self) -> np.ndarray:
        """ln(P(o)/Q(o)) per output: +inf where only P has mass, -inf where only Q has, nan where neither."""
        p, q = self.arrays()
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where((p > 0) & (q > 0), np.log(np.where(p > 0, p, 1.0) / np.where(q > 0, q, 1.0)),
                            np.where(p > 0, np.inf, np.where(q > 0, -np.inf, np.nan)))

    @property
    def max_loss(self) -> float:
        """The pair's pure epsilon: the largest |ln P(o)/Q(o)| over outputs either side can produce."""
        ell = self.losses()
        ell = ell[~np.isnan(ell)]
        return float(np.max(np.abs(ell))) if ell.size else 0.0

    @property
    def symmetric(self) -> bool:
        """Whether (Q, P) is (P, Q) with the outputs renamed (up to 1e-9 relative): then H(P||Q) = H(Q||P) and
        one direction suffices. Compared on the privacy loss distribution: the mass of P at loss l equals the
        mass of Q at loss -l, outputs with equal losses merged."""
        p, q = self.arrays()
        if not np.isclose(p[q == 0].sum(), q[p == 0].sum(), rtol=1e-9, atol=1e-15):
            return False
        both = (p > 0) & (q > 0)
        ell = np.log(p[both]) - np.log(q[both])
        key = np.round(ell, 9)
        levels = np.unique(np.abs(key))
        for level in levels:
            up, down = key == level, key == -level
            if not (np.isclose(p[both][up].sum(), q[both][down].sum(), rtol=1e-9, atol=1e-15)
                    and np.isclose(q[both][up].sum(), p[both][down].sum(), rtol=1e-9, atol=1e-15)):
                return False
        return True

    def hockey_stick(self, alpha: np.ndarray | float) -> np.ndarray:
        """H_alpha(P || Q) = sum_o (P(o) - alpha Q(o))_+ for each alpha."""
        p, q = self.arrays()
        a = np.atleast_1d(np.asarray(alpha, dtype=np.float64))
        return np.maximum(p[None, :] - a[:, None] * q[None, :], 0.0).sum(axis=1)

    def swapped(self) -> "DiscretePair":
        return DiscretePair(self.outputs, self.q, self.p, f"swapped: {self.inputs}", self.derivation, self.attained)

    def describe(self) -> str:
        kind = "attained by " if self.attained else "dominating pair (upper bound), "
        return f"{len(self.outputs)} outputs, pure eps {self.max_loss:.6g}, {kind}{self.inputs}"


@dataclass(frozen=True)
class LaplacePair:
    """The Laplace mechanism: output x + Laplace(``scale``) with |x - x'| <= ``sensitivity``; the pair
    Laplace(0, b) against Laplace(sensitivity, b) dominates every input pair (a smaller shift is a
    post-processing of the largest one, the loss being monotone in the output).

    With ``step`` the noise is discrete on the grid of that step: P[Z = z step] proportional to
    e^(-|z| step/scale) (a two-sided geometric, the discrete Laplace with parameter step/scale), and the
    sensitivity must be a whole number of steps. The pure epsilon is sensitivity/scale either way."""

    scale: float
    sensitivity: float
    inputs: str
    derivation: str
    attained: bool = True
    step: float | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.scale) and self.scale > 0 and math.isfinite(self.sensitivity)
                and self.sensitivity > 0):
            raise ValueError(f"Laplace scale and sensitivity must be positive, got {self.scale}, {self.sensitivity}")
        if self.step is not None:
            n = self.sensitivity / self.step
            if not (self.step > 0 and abs(n - round(n)) <= 1e-9 * n):
                raise ValueError(f"the sensitivity {self.sensitivity} must be a whole number of steps {self.step}")

    @property
    def max_loss(self) -> float:
        return self.sensitivity / self.scale

    @property
    def discrete(self) -> tuple[float, int] | None:
        """(parameter, sensitivity in steps) of the discrete Laplace, or None for the continuous one."""
        if self.step is None:
            return None
        return self.step / self.scale, int(round(self.sensitivity / self.step))

    def describe(self) -> str:
        kind = "Laplace" if self.step is None else f"discrete Laplace (step {self.step:.6g})"
        how = "attained by " if self.attained else "dominating pair (upper bound), "
        return (f"{kind}, scale {self.scale:.6g}, sensitivity {self.sensitivity:.6g}, pure eps {self.max_loss:.6g}, "
                f"{how}{self.inputs}")


@dataclass(frozen=True)
class NoRoundMechanism:
    """The protocol's reports are not a fresh, independent mechanism every round (memoized, or accounted for
    as a whole transcript): round-by-round composition does not apply. ``why`` says so for the run summary."""

    why: str


RoundMechanism = DiscretePair | LaplacePair


# ------------------------------------------------------------------------------------------- building blocks
def bernoulli_pair(p1: float, q1: float, inputs: str, derivation: str, attained: bool = True) -> DiscretePair:
    """One bit, 1 with probability ``p1`` under x and ``q1`` under x'."""
    return DiscretePair(("1", "0"), (p1, 1.0 - p1), (q1, 1.0 - q1), inputs, derivation, attained)


def randomized_response(epsilon: float, inputs: str, derivation: str, attained: bool = True) -> DiscretePair:
    """Binary randomized response at ``epsilon``: 1 with probability e^eps/(e^eps + 1) under x, 1/(e^eps + 1)
    under x'. Dominates every epsilon-DP mechanism (Kairouz, Oh, Viswanath 2015)."""
    hi = 1.0 / (1.0 + math.exp(-epsilon))
    return bernoulli_pair(hi, 1.0 - hi, inputs, derivation, attained)


def product(a: DiscretePair, b: DiscretePair, inputs: str, derivation: str) -> DiscretePair:
    """Two independent parts of one report: the product of the pairs (outputs ``"a|b"``)."""
    pa, qa = a.arrays()
    pb, qb = b.arrays()
    outs = tuple(f"{x}|{y}" for x in a.outputs for y in b.outputs)
    return DiscretePair(outs, tuple(np.outer(pa, pb).ravel().tolist()), tuple(np.outer(qa, qb).ravel().tolist()),
                        inputs, derivation, a.attained and b.attained)


def rr_power(epsilon: float, count: int, inputs: str, derivation: str, attained: bool = True) -> DiscretePair:
    """``count`` independent randomized-response bits at ``epsilon``, each favouring x under P and x' under Q,
    reduced to a sufficient statistic: the number k of bits that point to x (loss (2k - count) eps). Binomial
    probabilities C(count, k) h^k (1 - h)^(count - k) under P, h = e^eps/(e^eps + 1); reversed under Q."""
    h = 1.0 / (1.0 + math.exp(-epsilon))
    k = np.arange(count + 1)
    logc = np.array([math.lgamma(count + 1) - math.lgamma(i + 1) - math.lgamma(count - i + 1) for i in k])
    p = np.exp(logc + k * math.log(h) + (count - k) * math.log1p(-h))
    p = p / p.sum()
    return DiscretePair(tuple(f"{i} of {count}" for i in k), tuple(p.tolist()), tuple(p[::-1].tolist()),
                        inputs, derivation, attained)


# ------------------------------------------------------------------------------------------- curves to pairs
def _vertices(pair: DiscretePair) -> np.ndarray:
    """The alphas where H_alpha(P||Q) can bend: the finite positive likelihood ratios P(o)/Q(o)."""
    p, q = pair.arrays()
    ok = (p > 0) & (q > 0)
    return np.unique(p[ok] / q[ok])


def _grid(*parts: np.ndarray | list[float]) -> np.ndarray:
    """Sorted alphas with 0 first and points closer than 1e-12 (relative) merged: two pairs' likelihood ratios
    that agree up to rounding are one vertex, not a near-vertical segment."""
    x = np.sort(np.concatenate([np.asarray(v, dtype=np.float64).ravel() for v in ([0.0], *parts)]))
    keep = np.append(True, np.diff(x) > 1e-12 * np.maximum(1.0, x[1:]))
    return x[keep]


def _check_bounded(*pairs: DiscretePair) -> None:
    for pair in pairs:
        if not math.isfinite(pair.max_loss):
            raise ValueError("envelopes need pairs without infinite privacy loss")


def pair_from_curve(alphas: np.ndarray, values: np.ndarray, inputs: str, derivation: str,
                    q_only: float | None = None) -> DiscretePair:
    """The discrete pair whose H_alpha(P||Q) is the piecewise-linear convex curve through (alphas, values).

    ``alphas`` start at 0 with value 1 and end where the curve reaches 0 (it stays 0 after). If the slope
    jumps by j at alpha_k, the pair has an output with Q = j and P = alpha_k j (likelihood ratio alpha_k);
    the rest of Q, 1 + (slope at 0), sits on an output P cannot produce. Then
    H_alpha = sum_k j_k (alpha_k - alpha)_+ is the given curve, sum P = H_0 = 1 and sum Q = 1. ``q_only``:
    that rest when the caller knows it exactly (the slope at 0 of a curve whose first segment is 1e-9 long
    is rounding noise of 1e-8)."""
    x = np.asarray(alphas, dtype=np.float64)
    h = np.asarray(values, dtype=np.float64)
    if x[0] != 0.0 or abs(h[0] - 1.0) > _SUM_TOL or abs(h[-1]) > 1e-12 or np.any(np.diff(x) <= 0):
        raise ValueError("a curve must start at (0, 1), increase in alpha and end at value 0")
    dx = np.diff(x)
    slopes = np.append(np.diff(h) / dx, 0.0)
    jumps = np.diff(slopes)  # at x[1:]
    # a slope over a short segment carries the rounding of its two values (<= 1) divided by its length: at
    # eps = 10 segments of 1e-5 give slopes off by 1e-11, and the jump between two of them by as much
    noise = 8 * np.finfo(np.float64).eps / dx
    if np.any(jumps < -(1e-12 + noise + np.append(noise[1:], 0.0))):
        raise ValueError("the curve is not convex")
    jumps = np.maximum(jumps, 0.0)
    keep = jumps > 0
    ratios = x[1:][keep]
    qs, ps = jumps[keep], ratios * jumps[keep]
    q0 = 1.0 + slopes[0] if q_only is None else q_only
    # Rounding noise at (nearly) collinear points leaves outputs with P and Q both below _JUMP_TOL. Each is
    # merged into the output with the next larger ratio r': (P, Q) -> (P, P/r') there, and Q - P/r' to the
    # output P cannot produce. Its term P (1 - alpha/r')_+ is at least (P - alpha Q)_+: still dominating.
    drop = np.zeros(ratios.size, dtype=bool)
    for i in range(ratios.size - 1):
        if ps[i] < _JUMP_TOL and qs[i] < _JUMP_TOL:
            moved = ps[i] / ratios[i + 1]
            ps[i + 1] += ps[i]
            qs[i + 1] += moved
            q0 += qs[i] - moved
            drop[i] = True
    ratios, ps, qs = ratios[~drop], ps[~drop], qs[~drop]
    losses = np.log(ratios)
    outs = [f"loss {v:+.9g}" for v in losses]
    if abs(float(ps.sum()) - 1.0) > 1e-6:
        raise ValueError(f"the curve's P mass is {ps.sum()}, not 1: not the curve of a pair")
    p_out, q_out = list(ps / ps.sum()), list(qs)  # sum ps is H_0 = 1 up to rounding
    if q0 > 1e-12:  # below that, rounding noise of a slope that is exactly -1 (P produces whatever Q does)
        outs.append("only under x'")
        p_out.append(0.0)
        q_out.append(q0)
    q_arr = np.asarray(q_out)
    return DiscretePair(tuple(outs), tuple(float(v) for v in p_out), tuple((q_arr / q_arr.sum()).tolist()),
                        inputs, derivation, attained=False)


def _lower_hull(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Lower convex hull of points sorted by x (Andrew's monotone chain)."""
    hx: list[float] = []
    hy: list[float] = []
    for xi, yi in zip(x, y):
        while len(hx) >= 2 and (hx[-1] - hx[-2]) * (yi - hy[-2]) - (hy[-1] - hy[-2]) * (xi - hx[-2]) <= 1e-15:
            hx.pop()
            hy.pop()
        hx.append(float(xi))
        hy.append(float(yi))
    return np.array(hx), np.array(hy)


def lower_envelope(a: DiscretePair, b: DiscretePair, inputs: str, derivation: str) -> DiscretePair:
    """The tightest pair implied by two pairs that *both* dominate one mechanism: its curve is the convex
    envelope of min(H^a, H^b). The mechanism's own curve (a supremum of convex curves) is convex and below
    both, hence below the envelope, so the result still dominates. Both curves are linear between their
    vertices, and the minimum of two lines is concave, so the envelope's vertices are among theirs."""
    _check_bounded(a, b)
    x = _grid(_vertices(a), _vertices(b))
    y = np.minimum(a.hockey_stick(x), b.hockey_stick(x))
    y[0] = 1.0
    # min(H^a, H^b) is exactly 0 from the smaller of the two largest ratios on (no output has a larger one)
    end = int(np.searchsorted(x, min(_vertices(a)[-1], _vertices(b)[-1]) * (1 - 1e-12)))
    y = y[: end + 1]
    y[-1] = 0.0
    hx, hy = _lower_hull(x[: end + 1], y)
    return pair_from_curve(hx, hy, inputs, derivation)


def upper_envelope(a: DiscretePair, b: DiscretePair, inputs: str, derivation: str) -> DiscretePair:
    """One pair that dominates both ``a`` and ``b`` (a round that runs one mechanism or the other): its curve
    is max(H^a, H^b), convex as a maximum of convex curves. Between consecutive vertices both curves are
    linear, so the maximum bends only at their vertices and where the two lines cross."""
    _check_bounded(a, b)
    x = _grid(_vertices(a), _vertices(b))
    ya, yb = a.hockey_stick(x), b.hockey_stick(x)
    d = ya - yb
    cross = [x[i] + (x[i + 1] - x[i]) * d[i] / (d[i] - d[i + 1])
             for i in range(x.size - 1) if d[i] * d[i + 1] < 0]
    x = _grid(x[1:], cross)
    y = np.maximum(a.hockey_stick(x), b.hockey_stick(x))
    y[0] = 1.0
    y[-1] = 0.0  # the largest ratio of either pair: both curves are exactly 0 there
    # near alpha = 0, H = 1 - alpha (1 - Q(P = 0)): the maximum follows the pair with more Q where P is 0
    return pair_from_curve(x, y, inputs, derivation, q_only=max(_q_only(a), _q_only(b)))


def _q_only(pair: DiscretePair) -> float:
    """Q's mass on the outputs P cannot produce."""
    p, q = pair.arrays()
    return float(q[p == 0].sum())
