"""What a curious collector learns about single devices from a finished run: attack metrics (docs/attacks.md).

The ledger says what each device was charged; these metrics show what the transcript gives away about one
device, read with the device's own reports and nothing else. They are what Ding, Kulkarni and Yekhanin
(NIPS 2017) warn about in sections 3.2 and 4:

- **Averaging attack.** The collector averages one device's debiased reports over its first t rounds. With
  fresh randomness every round (1BitMean, dBitFlip, Laplace) the estimate converges to the device's own mean
  value, its error falling like 1/sqrt(t); memoization (1BitRRPM, dBitFlipPM, section 3) stops that: repeats
  of one memoized response carry no new information, so the error stops falling (:func:`averaging_attack`).
- **Change detection.** A memoized device that changes its memo input may change its response, and then the
  collector knows for certain that its value changed (section 3.2.1); output perturbation gamma makes that a
  statistical question and blurs *when* (section 4, Theorem 5: change rounds t and t' give output
  probabilities within a factor ((1 - gamma)/gamma)^|t - t'|) (:func:`change_statistic`).
- **Behavior patterns** (Definition 2): a device's sequence of memo inputs up to renaming of the distinct
  values. Theorem 4 makes a device of pattern width w (w eps)-indistinguishable only from devices *with the same
  pattern*; a device alone in its pattern blends with nobody (:func:`first_occurrence`, :func:`pattern_support`).

The core functions are pure functions over numpy arrays; :func:`analyze` applies them to a run (its
transcript, the devices' true values the runner kept with ``[analysis] attacks``, the scripted changes) and
:func:`write` writes attacks.csv and attacks.png. Protocols read: 1bitmean, 1bitrrpm, dbitflip, dbitflippm,
binflip (bits) and laplace (values); :func:`not_applicable` says why not for the others.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from protocols.dbitflip import bucket_of
from protocols.onebit import p_one

if TYPE_CHECKING:
    from agents.world import World
    from scenarios.runner import RunResult

CSV = "attacks.csv"
PNG = "attacks.png"
CSV_HEADER = ("metric", "round", "x", "value", "devices", "theory")


def family(params: Any) -> str | None:
    """How the attacks read a protocol's reports (the report model, :class:`ReportModel`), as its parameter
    class declares (``report_family``): "onebit" (one debiasable bit about the value), "bitflip" (d bits about
    sampled buckets J), "value" (the value plus noise); None: the attacks do not read them."""
    return getattr(params, "report_family", None)


def _given(x: np.ndarray | None, what: str) -> np.ndarray:
    """``x``, which this report model needs (a ValueError naming ``what`` when it is missing)."""
    if x is None:
        raise ValueError(f"the attack metrics need {what} here")
    return x


_WHY_NOT = {
    "counters": "several counters per report (1bitmulti): the attacks here read one value per device and round",
    "epoch": "reports are about epoch means and global updates (THRESH, epochrr), not one value per round",
    "stream": "reports are truncated at a collector-chosen threshold (ToPL) or raw values to a trusted collector "
              "(ToPS): no per-device attack is implemented for them",
}


#: the transcript column each report family reads (a protocol declaring the family names its report column so)
FAMILY_COLUMNS = {"onebit": "bit", "bitflip": "b", "value": "y"}


def not_applicable(params: Any) -> str | None:
    """None when the attacks read this protocol's reports; otherwise why they do not."""
    kind = family(params)
    if kind is not None and kind not in FAMILY_COLUMNS:
        return (f"{params.name} declares report_family {kind!r}: the attacks read "
                f"{', '.join(repr(k) for k in FAMILY_COLUMNS)}")
    if kind is not None:
        return None
    return _WHY_NOT.get(params.kind, f"{params.name} declares no report_family (onebit, bitflip or value) on its "
                                     "parameter class: the attacks do not know how to read its reports")


# ------------------------------------------------------------------------------------------- report model
@dataclass(frozen=True)
class ReportModel:
    """How the attacks read one protocol's reports (docs/algorithms.md sections 1.1, 1.2, 1.4, 2.1-2.3).

    ``family`` "onebit": one bit, P[1] = p_one(x) (1BitMean eq. 1; 1BitRRPM: of the rounded x); "bitflip": d
    bits, bit p is 1 with E/(E + 1), E = e^(eps/2), when J_p is the value's bucket, else 1/(E + 1); "value":
    the Laplace report x + Laplace(m/eps). Bits flip with ``gamma`` (output perturbation), fresh each round.
    """

    family: str
    memoized: bool
    epsilon: float
    gamma: float
    max_value: float
    buckets: int = 0

    @classmethod
    def of(cls, params: Any) -> "ReportModel":
        kind = family(params)
        if kind is None:
            raise ValueError(f"{getattr(params, 'name', params)!r} declares no report_family: the attacks cannot "
                             f"read its reports")
        return cls(kind, bool(getattr(params, "memoized", False)), float(params.epsilon),
                   float(getattr(params, "gamma", 0.0)), float(params.max_value), int(getattr(params, "buckets", 0)))

    @property
    def column(self) -> str:
        """The transcript column that holds the report."""
        return FAMILY_COLUMNS[self.family]

    @property
    def e(self) -> float:
        """e^eps for one bit, E = e^(eps/2) for a dBitFlip bit."""
        return math.exp(self.epsilon / 2 if self.family == "bitflip" else self.epsilon)

    @property
    def scale(self) -> float:
        """C: an observation is C times a debiased bit plus a constant, so Var[observation] = C^2 Var[bit']:
        m (e^eps + 1)/(e^eps - 1) for one bit, (E + 1)/(E - 1) for a dBitFlip bit, 1 for a Laplace value."""
        if self.family == "value":
            return 1.0
        c = (self.e + 1.0) / (self.e - 1.0)
        return self.max_value * c if self.family == "onebit" else c

    @property
    def flip_variance(self) -> float:
        """kappa = gamma (1 - gamma)/(1 - 2 gamma)^2: the variance that one round's flip adds to a debiased bit
        b' = (b - gamma)/(1 - 2 gamma), whatever the bit (0 for Laplace values)."""
        g = self.gamma
        return 0.0 if self.family == "value" else g * (1.0 - g) / (1.0 - 2.0 * g) ** 2

    def observe(self, reports: np.ndarray) -> np.ndarray:
        """(devices, d) reports of one round -> (devices, d) unbiased observations: one bit gives
        m ((e^eps + 1) b' - 1)/(e^eps - 1), whose mean is the value x (1BitRRPM: the rounded x); a dBitFlip bit
        gives ((E + 1) b' - 1)/(E - 1), whose mean is 1 when J_p holds the value's bucket and 0 otherwise; a
        Laplace report is its own observation (mean x)."""
        if self.family == "value":
            return np.asarray(reports, dtype=np.float64)
        b = (np.asarray(reports, dtype=np.float64) - self.gamma) / (1.0 - 2.0 * self.gamma)
        z = (b * (self.e + 1.0) - 1.0) / (self.e - 1.0)
        return z * self.max_value if self.family == "onebit" else z

    def bit_variance(self, level: np.ndarray, own: np.ndarray | None) -> np.ndarray:
        """(devices, d) variance units w of one round, before flips: Var[observation] = C^2 (w + kappa) for a
        fresh report. One bit: pi (1 - pi) with pi = p_one(level) (level = x, or the rounded x of 1BitRRPM);
        dBitFlip: pi (1 - pi) with pi = E/(E + 1) where ``own`` else 1/(E + 1); Laplace: 2 (m/eps)^2."""
        if self.family == "value":
            return np.full((np.asarray(level).shape[0], 1), 2.0 * (self.max_value / self.epsilon) ** 2)
        if self.family == "onebit":
            pi = np.asarray(p_one(level, self.epsilon, self.max_value))[:, None]
        else:
            pi = np.where(_given(own, "whether each sampled bucket is the device's own"), self.e / (self.e + 1.0),
                          1.0 / (self.e + 1.0))
        return pi * (1.0 - pi)

    def level_score(self, shares: np.ndarray, J: np.ndarray | None) -> np.ndarray:
        """A device's estimated level from its averaged observations (devices, d). One bit and Laplace: the
        average itself. dBitFlip: sum_p f_p c(J_p) + (1 - sum_p f_p) c_out, with f_p the estimated share of
        rounds in bucket J_p, c(v) = (v + 1/2) m/k the bucket's centre and c_out the mean centre of the buckets
        outside J (the report says nothing about where outside J the value is; BinFlip has no outside)."""
        if self.family != "bitflip":
            return shares[:, 0]
        k, width = self.buckets, self.max_value / self.buckets
        J = _given(J, "the reported buckets J")
        centres = (J + 0.5) * width
        inside = (shares * centres).sum(axis=1)
        if J.shape[1] == k:
            return inside
        outside = (k * k * width / 2.0 - centres.sum(axis=1)) / (k - J.shape[1])  # sum of all centres = k^2 w/2
        return inside + (1.0 - shares.sum(axis=1)) * outside


# ------------------------------------------------------------------------------------------- transcript
@dataclass
class Reports:
    """One report column of a transcript, per device and round: ``values`` (devices, rounds, width) (zeros
    where nothing arrived), ``present`` (devices, rounds) bool, ``rounds`` the collection round of each
    column, and ``J`` (devices, d) dBitFlip's sampled buckets (None when the protocol sends none)."""

    rounds: np.ndarray
    present: np.ndarray
    values: np.ndarray
    J: np.ndarray | None = None


def decode(stage: Any, column: str, rounds: np.ndarray) -> Reports:
    """Read ``column`` (and dBitFlip's ``j``) of the stored records of a collector stage (protocols.collecting:
    ``transcript``, ``columns``, ``record_columns``) for the collection ``rounds`` (in that order)."""
    n = int(stage.n_devices)
    by_round = {int(r): rec for r, rec in reversed(stage.transcript)}  # the first record of a round wins
    width = next(c.width for c in stage.columns if c.name == column)
    dtype = np.dtype(next(c.dtype for c in stage.columns if c.name == column))
    j_width = next((c.width for c in stage.columns if c.name == "j"), None)
    present = np.zeros((n, rounds.size), dtype=bool)
    values = np.zeros((n, rounds.size, width), dtype=dtype)
    J = np.zeros((n, j_width), dtype=np.int64) if j_width is not None else None
    have_j = np.zeros(n, dtype=bool)
    for t, rnd in enumerate(rounds.tolist()):
        if rnd not in by_round:
            continue
        present[:, t], cols = stage.record_columns(by_round[rnd], 0, n)
        values[:, t] = cols[column]
        if J is not None:
            new = present[:, t] & ~have_j
            J[new] = cols["j"][new]
            have_j |= new
    return Reports(rounds, present, values, J)


# ------------------------------------------------------------------------------------------- helpers
def midranks(a: np.ndarray) -> np.ndarray:
    """1-based ranks of ``a`` with ties given the mean of their ranks."""
    a = np.asarray(a)
    order = np.argsort(a, kind="mergesort")
    s = a[order]
    starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]]) if s.size else np.zeros(0, dtype=np.int64)
    ends = np.r_[starts[1:], s.size]
    out = np.empty(s.size, dtype=np.float64)
    out[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)
    return out


def auc(scores: np.ndarray, positive: np.ndarray) -> float:
    """Area under the ROC curve of ``scores`` for telling ``positive`` from the rest: the probability that a
    random positive scores above a random negative, ties counting one half (Mann-Whitney). NaN when either
    class is empty."""
    positive = np.asarray(positive, dtype=bool)
    pos, neg = int(positive.sum()), int((~positive).sum())
    if pos == 0 or neg == 0:
        return math.nan
    ranks = midranks(scores)
    return float((ranks[positive].sum() - pos * (pos + 1) / 2.0) / (pos * neg))


def heavy_light_auc(score: np.ndarray, truth: np.ndarray) -> tuple[float, int]:
    """AUC of ``score`` for telling heavy devices (true mean above the median) from light ones (below it);
    devices at the median are left out. Returns (AUC, devices compared)."""
    if truth.size < 2:
        return math.nan, 0
    med = float(np.median(truth))
    keep = truth != med
    return auc(score[keep], truth[keep] > med), int(keep.sum())


def _xlogx_ratio(k: np.ndarray, n: np.ndarray) -> np.ndarray:
    """k ln(k/n), 0 where k = 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(k > 0, k * np.log(np.where(k > 0, k, 1) / np.where(n > 0, n, 1)), 0.0)


def _bernoulli_max_loglik(ones: np.ndarray, n: np.ndarray, low: float = 0.0) -> np.ndarray:
    """max over p in [low, 1 - low] of the log-likelihood of ``ones`` ones in ``n`` Bernoulli(p) draws (per
    position; 0 for n = 0)."""
    if low <= 0:
        return _xlogx_ratio(ones, n) + _xlogx_ratio(n - ones, n)
    p = np.clip(ones / np.maximum(n, 1), low, 1.0 - low)
    return ones * np.log(p) + (n - ones) * np.log1p(-p)


# ------------------------------------------------------------------------------------------- averaging
@dataclass
class Averaging:
    """The averaging attack after t = 1..T rounds: ``rmse`` (empirical), ``theory`` (its expectation given the
    devices' true values and, for memoized protocols, their memo inputs), ``auc`` (heavy vs light) and the
    devices each counts (``devices``: with at least one report; ``compared``: in the AUC)."""

    rmse: np.ndarray
    theory: np.ndarray
    auc: np.ndarray
    devices: np.ndarray
    compared: np.ndarray


def averaging_attack(model: ReportModel, reports: np.ndarray, present: np.ndarray, truth: np.ndarray,
                     J: np.ndarray | None = None, labels: np.ndarray | None = None,
                     rounded: np.ndarray | None = None) -> Averaging:
    """The collector's per-device estimate from the device's own first t reports, for t = 1..T.

    ``reports`` (n, T, d), ``present`` (n, T), ``truth`` (n, T) the true values. The estimate is the mean of the
    device's observations (:meth:`ReportModel.observe`) over the rounds its report arrived. Its target, over the
    same rounds: the mean true value (one bit, Laplace; RMSE in value units), or for dBitFlip the share of rounds
    the value was in bucket J_p, for each p (RMSE in shares of rounds).

    Theory (exact, given the true values): the estimate of a device with n_i reports has
    Var = C^2/n_i^2 (sum over memo inputs g of N_g^2 w_g + n_i kappa), N_g the rounds that used input g (fresh
    protocols: every round is its own input, N = 1), w the variance unit of :meth:`ReportModel.bit_variance` and
    kappa the flip variance; memoized one-bit estimates are also biased by the rounding, mean(rounded x) -
    mean(x), so theory MSE = Var + bias^2. ``labels`` (n, T): memo inputs (any labels that are equal exactly
    when the input is; e.g. :func:`first_occurrence`), None for fresh protocols; ``rounded`` (n, T): 1BitRRPM's
    rounded values (its bits' means), None otherwise. With memoization the N_g^2 term keeps Var from falling
    like 1/n_i: repeats of a memoized bit are not new draws.
    """
    n, T, d = reports.shape
    rmse, theory, aucs = (np.full(T, np.nan) for _ in range(3))
    devices, compared = np.zeros(T, dtype=np.int64), np.zeros(T, dtype=np.int64)
    count = np.zeros(n)
    sum_obs, sum_target, acc = np.zeros((n, d)), np.zeros((n, d)), np.zeros((n, d))
    sum_x, bias = np.zeros(n), np.zeros(n)
    seen_inputs = np.zeros((n, T), dtype=np.int32) if labels is not None else None
    everyone = np.arange(n)
    for t in range(T):
        here = present[:, t]
        all_here = bool(here.all())
        rows = slice(None) if all_here else np.flatnonzero(here)  # a slice is a view: no copies when all report
        x = truth[rows, t]
        count[rows] += 1
        sum_obs[rows] += model.observe(reports[rows, t])
        sum_x[rows] += x
        own = None
        if model.family == "bitflip":
            own = bucket_of(x, model.buckets, model.max_value)[:, None] == _given(J, "the reported buckets J")[rows]
            sum_target[rows] += own
        else:
            sum_target[rows, 0] += x
        level = rounded[rows, t] if rounded is not None else x
        w = model.bit_variance(level, own)
        if seen_inputs is not None:  # N_g -> N_g + 1 adds (2 N_g + 1) w to sum_g N_g^2 w_g
            ids = everyone if all_here else rows
            lab = _given(labels, "the memo inputs' labels")[ids, t]
            acc[rows] += (2.0 * seen_inputs[ids, lab] + 1.0)[:, None] * w
            seen_inputs[ids, lab] += 1
        else:
            acc[rows] += w
        if rounded is not None:
            bias[rows] += level - x
        seen = count > 0
        k = int(np.count_nonzero(seen))
        devices[t] = k
        if not k:
            continue
        sel = slice(None) if k == n else seen
        nn = count[sel][:, None]
        est = sum_obs[sel] / nn
        rmse[t] = math.sqrt(float(np.mean((est - sum_target[sel] / nn) ** 2)))
        mse = model.scale ** 2 * (acc[sel] + model.flip_variance * nn) / nn ** 2 + (bias[sel][:, None] / nn) ** 2
        theory[t] = math.sqrt(float(np.mean(mse)))
        score = model.level_score(est, J[sel] if J is not None else None)
        aucs[t], compared[t] = heavy_light_auc(score, sum_x[sel] / nn[:, 0])
    return Averaging(rmse, theory, aucs, devices, compared)


# ------------------------------------------------------------------------------------------- change detection
def _memo_loglik(ones: np.ndarray, n: np.ndarray, gamma: float) -> np.ndarray:
    """max over the memoized bit of the log-likelihood of a segment whose rounds all repeat one memoized bit, each
    copy flipped with gamma: n ln(1 - gamma) - lambda (minority count), lambda = ln((1 - gamma)/gamma); with
    gamma = 0, 0 for a constant segment and -inf otherwise (per position)."""
    minority = np.minimum(ones, n - ones)
    if gamma <= 0:
        return np.where(minority == 0, 0.0, -np.inf)
    return n * math.log(1.0 - gamma) - minority * flip_log_odds(gamma)


def change_statistic(bits: np.ndarray, present: np.ndarray, memoized: bool,
                     gamma: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """One change point against none, from one device's own bits (n, T, d) where ``present``; per device.

    The score is a generalized log-likelihood ratio, max over tau of l1(rounds < tau) + l2(rounds >= tau) minus
    l1(all rounds), with bits of several positions adding up (they share tau):

    - memoized reports (1BitRRPM, dBitFlipPM): no change means every round repeats the bits of one memo input,
      each flipped with gamma: l1 = n ln(1 - gamma) - lambda m, m the minority count and lambda = ln((1 -
      gamma)/gamma) (:func:`_memo_loglik`). After a change the input may keep moving and reveal new memoized
      bits, so l2 lets the bits be Bernoulli draws of any rate a flipped bit can have, in [gamma, 1 - gamma]
      (maximal Bernoulli log-likelihood; a constant segment fits no better than under l1). With gamma = 0 the
      score is infinite exactly when the bits are not constant: a changed response is certain evidence
      (section 3.2.1), and tau is the first round whose bits differ from the first round's;
    - fresh reports (1BitMean, dBitFlip): l1 = l2 = the maximal Bernoulli log-likelihood, a CUSUM-type test
      for a change of the bits' rate.

    Returns (score, tau): tau is the index of the first round of the second segment, -1 when no split scores
    above no change (score 0).
    """
    n, T, d = bits.shape
    if memoized and gamma <= 0:  # infinite exactly when not constant; tau: the first round that differs
        first_here = np.argmax(present, axis=1)
        ref = bits[np.arange(n), first_here]
        differs = present & (bits != ref[:, None, :]).any(axis=2)
        moved = differs.any(axis=1)
        return np.where(moved, np.inf, 0.0), np.where(moved, differs.argmax(axis=1), -1).astype(np.int64)
    y = bits.astype(np.int32) * present[:, :, None]
    ones_all, n_all = y.sum(axis=1), present.sum(axis=1).astype(np.int64)[:, None]
    # every log-likelihood is a function of two counts 0 <= ones <= reports <= T: tabulated once, then looked up
    # (the same numbers as evaluating it element by element, at a fraction of the cost when d is large)
    first = _table(_memo_loglik if memoized else (lambda k, m, _: _bernoulli_max_loglik(k, m)), T, gamma)
    second = _table(_bernoulli_max_loglik, T, gamma if memoized else 0.0)
    base = _look(first, ones_all, n_all).sum(axis=1)
    best, tau = base.copy(), np.full(n, -1, dtype=np.int64)
    ones_b, n_b = np.zeros((n, d), dtype=np.int64), np.zeros((n, 1), dtype=np.int64)
    for t in range(1, T):  # segments: rounds [0, t) and [t, T)
        ones_b += y[:, t - 1]
        n_b += present[:, t - 1:t]
        value = _look(first, ones_b, n_b).sum(axis=1) + _look(second, ones_all - ones_b, n_all - n_b).sum(axis=1)
        better = value > best + 1e-9 * np.maximum(1.0, np.abs(best))
        best[better] = value[better]
        tau[better] = t
    return np.maximum(best - base, 0.0), tau


def _table(loglik: Any, T: int, gamma: float) -> np.ndarray:
    """``loglik(ones, n, gamma)`` for every 0 <= ones <= n <= T, as a flat array indexed ones + (T + 1) n."""
    ones, n = np.meshgrid(np.arange(T + 1), np.arange(T + 1))  # [n, ones]
    with np.errstate(invalid="ignore"):  # ones > n: never looked up
        return np.asarray(loglik(ones, n, gamma), dtype=np.float64).ravel()


def _look(table: np.ndarray, ones: np.ndarray, n: np.ndarray) -> np.ndarray:
    """The tabulated log-likelihood (:func:`_table`) of each (ones, n), n broadcast against ones."""
    T1 = math.isqrt(table.size)
    return table.take(ones + T1 * n)


def flip_log_odds(gamma: float) -> float:
    """lambda = ln((1 - gamma)/gamma): the log-likelihood a memoized report pays for each flip (inf at 0)."""
    return math.inf if gamma <= 0 else math.log((1.0 - gamma) / gamma)


#: change detection's decision rule: flag a device when its score is above the (1 - FALSE_ALARM) quantile of the
#: score of NULL_DEVICES simulated devices with the same number of reports that never changed
FALSE_ALARM = 0.05
NULL_DEVICES = 2000


def null_threshold(model: ReportModel, reports: int, d: int, seed: int = 0) -> float:
    """The (1 - FALSE_ALARM) quantile of :func:`change_statistic` for a device with ``reports`` reports of d bits
    whose value never changed (Monte Carlo over NULL_DEVICES devices, seeded by (seed, reports, d), so the rule is
    the same on every run of a scenario). The null device: memoized, one memo bit per position flipped with gamma
    each round (with gamma = 0 its score is always 0, so any device whose bits are not constant is flagged);
    fresh, Bernoulli bits at the sent-bit probability of the middle of the range (one bit: 1/2) or of a bucket
    outside the device's own (dBitFlip: gamma + (1 - 2 gamma)/(E + 1)). Infinite (never flag) below two
    reports."""
    if reports < 2:
        return math.inf
    rng = np.random.default_rng([int(seed), int(reports), int(d)])
    if model.memoized:
        q = model.gamma
    elif model.family == "onebit":
        q = 0.5
    else:
        q = model.gamma + (1.0 - 2.0 * model.gamma) / (model.e + 1.0)
    bits = (rng.random((NULL_DEVICES, reports, d)) < q).astype(np.uint8)
    score, _ = change_statistic(bits, np.ones((NULL_DEVICES, reports), dtype=bool), model.memoized, model.gamma)
    return float(np.quantile(score, 1.0 - FALSE_ALARM, method="higher"))


def detect(model: ReportModel, score: np.ndarray, reports: np.ndarray, d: int, seed: int = 0) -> np.ndarray:
    """The decision "this device changed": its score is above :func:`null_threshold` for its number of reports,
    so a device that never changed is flagged with probability at most FALSE_ALARM (0 for memoized reports
    without output perturbation, where a changed response is certain evidence)."""
    out = np.zeros(score.shape, dtype=bool)
    for k in np.unique(reports).tolist():
        here = reports == k
        out[here] = score[here] > null_threshold(model, int(k), d, seed)
    return out


def first_change_round(world: "World", first: int, last: int) -> np.ndarray:
    """Per device, the first collection round in [first, last] at which a scripted change hit it (0: none): a
    [[changes]] entry, or a behavior whose change reached it (``step``, ``trigger``: World.behavior_changed)."""
    out = np.zeros(world.n, dtype=np.int64)
    for number, ch in enumerate(world.changes, start=1):
        if first <= ch.round <= last:
            ids = world.affected(number)
            ids = ids[out[ids] == 0]
            out[ids] = ch.round
    if world.behavior_changed is not None:
        b = world.behavior_changed.astype(np.int64)
        earlier = (first <= b) & (b <= last) & ((out == 0) | (b < out))
        out[earlier] = b[earlier]
    return out


# ------------------------------------------------------------------------------------------- behavior patterns
def first_occurrence(inputs: np.ndarray) -> np.ndarray:
    """Definition 2's behavior pattern in canonical form: entry (i, t) is the first round (0-based) at which
    device i had the same memo input as at round t, or -1 where its input is -1 (absent). Renaming the distinct
    inputs does not change it, and two devices share a pattern exactly when their rows are equal; a prefix of a
    row is the pattern of the first rounds."""
    inputs = np.asarray(inputs)
    n, T = inputs.shape
    if inputs.size and -1 <= inputs.min() and inputs.max() < 2**31:
        inputs = inputs.astype(np.int32, copy=False)  # a narrower key sorts about twice as fast
    order = np.argsort(inputs, axis=1, kind="stable")  # equal inputs keep round order: a group's first is its start
    s = np.take_along_axis(inputs, order, axis=1)
    new = np.ones((n, T), dtype=bool)
    new[:, 1:] = s[:, 1:] != s[:, :-1]
    start = np.maximum.accumulate(np.where(new, np.arange(T), 0), axis=1)
    out = np.empty((n, T), dtype=np.int32)
    np.put_along_axis(out, order, np.take_along_axis(order, start, axis=1).astype(np.int32), axis=1)
    out[inputs < 0] = -1
    return out


def pattern_width(canon: np.ndarray) -> np.ndarray:
    """Number of distinct memo inputs of each device (its pattern's width; absent rounds not counted)."""
    return (canon == np.arange(canon.shape[1])).sum(axis=1)


@dataclass
class Patterns:
    """``support`` (n,): devices sharing each device's pattern over all rounds; ``alone`` (T,) and ``count``
    (T,): share of devices alone in their pattern, and the number of distinct patterns, over rounds 1..t."""

    support: np.ndarray
    alone: np.ndarray
    count: np.ndarray


def pattern_support(canon: np.ndarray) -> Patterns:
    """Pattern supports, for every prefix length at once: the rows are sorted lexicographically once, so equal
    prefixes are neighbours, and two neighbours share the pattern of the first t rounds exactly when their
    common prefix is at least t long."""
    n, T = canon.shape
    order = np.lexsort(canon.T[::-1])
    s = canon[order]
    diff = s[1:] != s[:-1]
    common = np.where(diff.any(axis=1), diff.argmax(axis=1), T)  # common prefix with the previous row
    alone, count = np.zeros(T), np.zeros(T, dtype=np.int64)
    sizes, group = np.ones(min(n, 1), dtype=np.int64), np.zeros(n, dtype=np.int64)
    for t in range(1, T + 1):
        group = np.cumsum(np.r_[True, common < t]) - 1
        sizes = np.bincount(group)
        alone[t - 1] = np.count_nonzero(sizes == 1) / max(n, 1)
        count[t - 1] = sizes.size
    support = np.empty(n, dtype=np.int64)
    support[order] = sizes[group]
    return Patterns(support, alone, count)


def memo_inputs(params: Any, seed: int, truth: np.ndarray, rounds: np.ndarray) -> np.ndarray:
    """Every device's memo input in each round (n, T), computed by the protocol's own device side from the true
    values (1BitRRPM: the grid index from the device's keyed alpha-point rounding; dBitFlipPM: the position of
    the value's bucket in J plus one, or 0); -1 where the device was absent (NaN value)."""
    n = truth.shape[0]
    devices = params.make_devices(seed, np.arange(n))
    out = np.full(truth.shape, -1, dtype=np.int64)
    for t, rnd in enumerate(rounds.tolist()):
        x = truth[:, t]
        here = ~np.isnan(x)
        _, inputs = devices.report_bits(int(rnd), np.where(here, x, 0.0))
        out[here, t] = inputs[here]
    return out


# ------------------------------------------------------------------------------------------- a run
Row = tuple[str, int | None, float | None, float | None, int | None, float | None]


@dataclass
class AttackReport:
    """What :func:`write` puts in the run directory: ``summary`` (summary.json's ``attacks``), ``rows``
    (attacks.csv: metric, round, x, value, devices, theory) and ``plot`` (what attacks.png draws)."""

    summary: dict
    rows: list[Row] = field(default_factory=list)
    plot: dict = field(default_factory=dict)


def _num(x: float) -> float | None:
    """A JSON number, or null when unknown (never a made-up 0)."""
    return float(x) if x is not None and np.isfinite(x) else None


def _not(why: str) -> dict:
    return {"applies": False, "why": why}


def analyze(result: "RunResult") -> AttackReport:
    """The attack metrics of a finished run (summary.json ``attacks``, attacks.csv, attacks.png)."""
    sc = result.scenario
    head: dict[str, Any] = {"enabled": sc.attacks, "why": sc.attacks_why}
    if not sc.attacks:
        return AttackReport(head)
    why = not_applicable(sc.protocol)
    stage = dict(getattr(getattr(result.collector, "protocol", None), "stages", lambda: [])()).get("report")
    truth = result.true_values
    if why is None and (truth is None or stage is None):
        why = "this run kept no true values or no report transcript"
    if why is None and truth is not None and stage is not None:
        rounds = np.arange(1, truth.shape[1] + 1)
        model = ReportModel.of(sc.protocol)
        names = [c.name for c in stage.columns]
        if model.column not in names:  # a plugin's family, its report column named otherwise
            why = (f"report_family {model.family!r} reads a report column named {model.column!r}, which this "
                   f"protocol's report stage does not have (its columns: {', '.join(names) or 'none'})")
        else:
            rep = decode(stage, model.column, rounds)
            if np.any(rep.present & np.isnan(truth)):
                why = "the true values of some rounds were not kept (a resumed run)"
    if why is not None or truth is None:
        why = why or "this run kept no true values"
        return AttackReport({**head, "averaging": _not(why), "change_detection": _not(why), "patterns": _not(why)})
    if model.family == "bitflip" and rep.J is None:  # BinFlip: every bucket, in order
        rep.J = np.broadcast_to(np.arange(model.buckets), (sc.devices, model.buckets))
    report = AttackReport(head)
    labels = rounded = canon = None
    if model.memoized:
        inputs = memo_inputs(sc.protocol, sc.seed, truth, rounds)
        canon = first_occurrence(inputs)
        labels = np.maximum(canon, 0)
        if model.family == "onebit":
            rounded = inputs * float(getattr(sc.protocol, "granularity"))  # 1BitRRPM's rounding step
        del inputs
    report.summary["averaging"] = _averaging(report, model, rep, truth, labels, rounded, rounds)
    report.summary["change_detection"] = _changes(report, model, rep, result.world, rounds, sc)
    report.summary["patterns"] = _patterns(report, canon, rounds, sc) if canon is not None else _not(
        "reports are fresh every round: there are no memoized inputs, so behavior patterns (Definition 2) do not "
        "describe what the collector can link (each report is charged on its own)")
    return report


def _averaging(report: AttackReport, model: ReportModel, rep: Reports, truth: np.ndarray,
               labels: np.ndarray | None, rounded: np.ndarray | None, rounds: np.ndarray) -> dict:
    """The averaging attack of a run: its attacks.csv rows and plot series, and summary.json's block."""
    av = averaging_attack(model, rep.values, rep.present, truth, rep.J, labels, rounded)
    units = "share of rounds in bucket J_p" if model.family == "bitflip" else "value units (as max_value)"
    for t, rnd in enumerate(rounds.tolist()):
        report.rows.append(("averaging_rmse", rnd, None, _num(av.rmse[t]), int(av.devices[t]), _num(av.theory[t])))
        report.rows.append(("averaging_auc_heavy_light", rnd, None, _num(av.auc[t]), int(av.compared[t]), None))
    report.plot["averaging"] = {"rounds": rounds, "rmse": av.rmse, "theory": av.theory, "auc": av.auc,
                                "units": units, "memoized": model.memoized}
    last = len(rounds) - 1
    ratio = av.rmse[last] / av.rmse[0] if av.rmse[0] > 0 else math.nan
    return {
        "applies": True,
        "estimator": ("mean of the device's debiased reports over its first t rounds: one bit "
                      "m((e^eps+1)b'-1)/(e^eps-1), dBitFlip ((E+1)b'-1)/(E-1) per position, Laplace the report; "
                      "b' = (b - gamma)/(1 - 2 gamma)"),
        "target": ("the device's share of rounds in each bucket of J" if model.family == "bitflip"
                   else "the device's mean true value over the same rounds"),
        "units": units,
        "rounds": int(rounds[last]),
        "rmse_round_1": _num(av.rmse[0]), "rmse_final": _num(av.rmse[last]),
        "theory_rmse_round_1": _num(av.theory[0]), "theory_rmse_final": _num(av.theory[last]),
        "rmse_ratio_final_to_round_1": _num(ratio),
        "fresh_ratio_would_be": _num(1.0 / math.sqrt(len(rounds))),
        "auc_heavy_light_round_1": _num(av.auc[0]), "auc_heavy_light_final": _num(av.auc[last]),
        "heavy_light": "AUC of the estimated level for devices above vs below the median true mean",
    }


def _changes(report: AttackReport, model: ReportModel, rep: Reports, world: "World", rounds: np.ndarray,
             sc: Any) -> dict:
    """Change detection of a run against its scripted changes: rows, plot series and summary.json's block."""
    if model.family == "value":
        return _not("Laplace reports are continuous values: no change detector is implemented for them")
    changed_at = first_change_round(world, int(rounds[0]) + 1, int(rounds[-1]))
    score, tau = change_statistic(rep.values, rep.present, model.memoized, model.gamma)
    reports = rep.present.sum(axis=1)
    seen = reports > 0
    changed = (changed_at > 0) & seen
    unchanged = (changed_at == 0) & seen
    hit = detect(model, score, reports, rep.values.shape[2], sc.seed)
    auc_value = auc(score[seen], changed[seen])
    tpr = float(hit[changed].mean()) if changed.any() else math.nan
    fpr = float(hit[unchanged].mean()) if unchanged.any() else math.nan
    last = int(rounds[-1])
    report.rows += [("change_auc", last, None, _num(auc_value), int(seen.sum()), None),
                    ("change_tpr", last, None, _num(tpr), int(changed.sum()), None),
                    ("change_fpr", last, None, _num(fpr), int(unchanged.sum()), None)]
    located = changed & hit & (tau >= 0)
    err = rounds[np.maximum(tau[located], 0)] - changed_at[located]
    values, counts = np.unique(err, return_counts=True)
    for v, c in zip(values.tolist(), counts.tolist()):
        report.rows.append(("change_location_error", last, float(v), c / err.size, int(c), None))
    lam = flip_log_odds(model.gamma)
    if model.memoized:
        privacy = {"bound": "Theorem 5: change rounds t and t' give output probabilities within a factor "
                            "((1 - gamma)/gamma)^|t - t'|",
                   "log_ratio_per_round_of_shift": _num(lam),
                   "rounds_of_shift_within_factor_e": _num(1.0 / lam) if model.gamma > 0 else 0.0}
    else:
        privacy = {"bound": "basic composition: value sequences that differ in |t - t'| rounds give output "
                            "probabilities within a factor e^(|t - t'| eps_round)",
                   "log_ratio_per_round_of_shift": _num(float(sc.protocol.round_epsilon)),
                   "rounds_of_shift_within_factor_e": _num(1.0 / float(sc.protocol.round_epsilon))}
    report.plot["changes"] = {"errors": values, "shares": counts / max(err.size, 1), "auc": auc_value, "tpr": tpr,
                              "fpr": fpr, "gamma": model.gamma, "bound": privacy["log_ratio_per_round_of_shift"],
                              "bound_source": "Theorem 5" if model.memoized else "basic composition"}
    out = {
        "applies": True,
        "detector": ("generalized log-likelihood ratio of one change point: before it one memoized response "
                     "flipped with gamma, from it on Bernoulli bits of any rate (with gamma = 0: the bits are not "
                     "constant)" if model.memoized else
                     "generalized log-likelihood ratio of one change of the bits' Bernoulli rate (CUSUM-type)"),
        "rule": (f"flag a device when its score is above the {1 - FALSE_ALARM:.0%} quantile of the score of a "
                 f"device with as many reports that never changed (null false-alarm rate <= {FALSE_ALARM:g}; "
                 f"Monte Carlo, {NULL_DEVICES:,} null devices)"
                 + ("; with gamma = 0 that is D >= 1: a changed response is certain" if model.memoized
                    and model.gamma <= 0 else "")),
        "truth": ("changed: hit by a scripted [[changes]] entry or reached by a behavior's change (step, trigger) "
                  "in rounds 2..last; location truth: the first of them"),
        "gamma": model.gamma,
        "changed": int(changed.sum()), "unchanged": int(unchanged.sum()),
        "auc": _num(auc_value), "tpr": _num(tpr), "fpr": _num(fpr),
        # the null is a device whose memo input never moves; an unchanged device whose jitter crosses grid cells
        # does move it, so fpr can exceed the null's rate without the rule being wrong
        "fpr_meaning": (f"share of the unchanged devices flagged; above {FALSE_ALARM:g} when their own jitter "
                        "or their behaviors (weekly, trend, burst) move their memo input across grid cells (the "
                        "detector sees that as a change)"
                        if model.memoized else f"share of the unchanged devices flagged (the null's rate: "
                        f"{FALSE_ALARM:g})"),
        "location_error": {"detected": int(err.size),
                           "mean": _num(float(err.mean())) if err.size else None,
                           "mean_abs": _num(float(np.abs(err).mean())) if err.size else None,
                           "median": _num(float(np.median(err))) if err.size else None,
                           "exact_share": _num(float(np.mean(err == 0))) if err.size else None,
                           "within_1_share": _num(float(np.mean(np.abs(err) <= 1))) if err.size else None,
                           "meaning": "located round - true change round, over changed devices detected"},
        "location_privacy": privacy,
    }
    if not changed.any() or not unchanged.any():
        out["note"] = ("no device with a report was hit by a scripted change or a behavior's in rounds 2..last"
                       if not changed.any() else
                       "every device with a report was hit by a scripted change or a behavior's") + ": AUC undefined"
    return out


def _patterns(report: AttackReport, canon: np.ndarray, rounds: np.ndarray, sc: Any) -> dict:
    """Behavior patterns of a memoized run (canonical rows of :func:`first_occurrence`): rows, plot series and
    summary.json's block."""
    n = canon.shape[0]
    width = pattern_width(canon)
    pats = pattern_support(canon)
    last = int(rounds[-1])
    w_vals, w_counts = np.unique(width, return_counts=True)
    s_vals, s_counts = np.unique(pats.support, return_counts=True)
    for v, c in zip(w_vals.tolist(), w_counts.tolist()):
        report.rows.append(("pattern_width", last, float(v), c / n, int(c), None))
    for v, c in zip(s_vals.tolist(), s_counts.tolist()):
        report.rows.append(("pattern_support", last, float(v), c / n, int(c), None))
    for t, rnd in enumerate(rounds.tolist()):
        report.rows.append(("pattern_alone", rnd, None, float(pats.alone[t]), n, None))
        report.rows.append(("pattern_count", rnd, None, float(pats.count[t]), n, None))
    report.plot["patterns"] = {"widths": w_vals, "width_shares": w_counts / n, "supports": s_vals,
                               "support_shares": s_counts / n, "rounds": rounds, "alone": pats.alone}
    p = sc.protocol
    inputs = (f"grid values of s = {p.granularity:g} by the device's own alpha-point rounding"
              if family(p) == "onebit" else
              f"memo input s = position of the value's bucket in J plus one, or 0 (k = {p.buckets}, d = {p.bits})")
    return {
        "applies": True,
        "inputs": inputs,
        "rounds": last,
        "devices": n,
        "patterns": int(pats.count[-1]),
        "width": {"mean": float(width.mean()), "max": int(width.max(initial=0)),
                  "shares": {str(v): c / n for v, c in zip(w_vals.tolist(), w_counts.tolist())}},
        "support": {"median": float(np.median(pats.support)), "max": int(pats.support.max(initial=0))},
        "share_alone": float(pats.alone[-1]),
        "share_support_at_most_2": float(np.mean(pats.support <= 2)),
        "meaning": "pattern: the rounds that shared a memo input (Definition 2); support: devices sharing it; a "
                   "device alone in its pattern blends with nobody under Theorem 4",
    }


# ------------------------------------------------------------------------------------------- files
def write(report: AttackReport, out: Path) -> dict:
    """attacks.csv and attacks.png (atomically); returns summary.json ``files`` entries for them."""
    from scenarios.tables import atomic_path

    with atomic_path(out / CSV) as tmp, open(tmp, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(CSV_HEADER)
        for row in report.rows:
            w.writerow(["" if v is None or (isinstance(v, float) and not math.isfinite(v)) else v for v in row])
    draw(report, out / PNG)
    return {CSV: {"written": True, "rows": len(report.rows)}, PNG: {"written": True}}


def _say(ax: Any, text: str) -> None:
    import textwrap

    ax.text(0.5, 0.5, textwrap.fill(text, 40), ha="center", va="center", transform=ax.transAxes, fontsize=8)
    ax.set_xticks([])
    ax.set_yticks([])


def draw(report: AttackReport, path: Path) -> None:
    """attacks.png: averaging RMSE and heavy/light AUC against rounds, the change-location error, and the
    pattern width, support and lone-device share; a panel whose metric does not apply says why."""
    from matplotlib.ticker import MaxNLocator

    from scenarios import plots

    s = report.summary
    fig, axes = plots.subplots(2, 3, figsize=(15, 8.5))
    (rm, au, ch), (wd, sp, al) = axes
    av = report.plot.get("averaging")
    if av is not None:
        r = av["rounds"]
        rm.loglog(r, av["rmse"], "o", ms=3.5, color="tab:orange", label="empirical")
        rm.loglog(r, av["theory"], "-", color="tab:blue", label="theory (given true values)")
        if np.isfinite(av["theory"][0]):
            rm.loglog(r, av["theory"][0] / np.sqrt(r), ":", color="grey", label="1/sqrt(t) from round 1")
        rm.set_xlabel("rounds of reports averaged, t")
        rm.set_ylabel(f"RMSE of per-device estimate\n({av['units']})")
        rm.legend(fontsize=8)
        au.plot(r, av["auc"], "o-", ms=3, color="tab:green")
        au.axhline(0.5, color="grey", lw=0.8, ls=":")
        au.set_ylim(0.4, 1.01)
        au.set_xlabel("rounds of reports averaged, t")
        au.xaxis.set_major_locator(MaxNLocator(integer=True))  # whole rounds
        au.set_ylabel("AUC, heavy vs light (above vs below median)")
    else:
        _say(rm, f"averaging attack: not applicable: {s.get('averaging', {}).get('why', s.get('why'))}")
        _say(au, "heavy vs light: not applicable")
    rm.set_title("Averaging attack: error of a device's own estimate")
    au.set_title("Averaging attack: telling heavy from light users")
    cd = report.plot.get("changes")
    if cd is not None:
        if len(cd["errors"]):
            ch.bar(cd["errors"], cd["shares"], width=0.8, color="tab:purple")
        else:
            _say(ch, "no changed device was detected")
        ch.axvline(0, color="grey", lw=0.8, ls=":")
        ch.set_xlabel("located round − true change round (rounds)")
        ch.xaxis.set_major_locator(MaxNLocator(integer=True))  # whole rounds
        ch.set_ylabel("share of detected changed devices")
        bound = cd["bound"]
        ch.set_title(f"Change detection, γ = {cd['gamma']:g}: AUC {cd['auc']:.3f}, TPR {cd['tpr']:.3f}, "
                     f"FPR {cd['fpr']:.3f}\nlog-ratio bound per round of shift: "
                     + ("none (γ = 0)" if bound is None else f"{bound:.3g} ({cd['bound_source']})"), fontsize=9)
    else:
        _say(ch, f"change detection: not applicable: {s.get('change_detection', {}).get('why', s.get('why'))}")
        ch.set_title("Change detection")
    pt = report.plot.get("patterns")
    if pt is not None:
        wd.bar(pt["widths"], pt["width_shares"], width=0.8, color="tab:cyan")
        wd.xaxis.set_major_locator(MaxNLocator(integer=True))
        wd.set_xlabel("pattern width (distinct memo inputs)")
        wd.set_ylabel("share of devices")
        at_least = np.cumsum(pt["support_shares"][::-1])[::-1]
        sp.step(pt["supports"], at_least, "o-", where="pre", ms=3, color="tab:red")
        sp.set_xscale("log")
        sp.set_ylim(0, 1.02)
        sp.set_xlabel("pattern support x (devices sharing the pattern)")
        sp.set_ylabel("share of devices in patterns with support ≥ x")
        al.plot(pt["rounds"], pt["alone"], "o-", ms=3, color="tab:brown")
        al.set_ylim(0, 1.02)
        al.set_xlabel("rounds, t")
        al.xaxis.set_major_locator(MaxNLocator(integer=True))  # whole rounds
        al.set_ylabel("share of devices alone in their pattern\n(of rounds 1..t)")
    else:
        why = s.get("patterns", {}).get("why", s.get("why"))
        for ax in (wd, sp, al):
            _say(ax, f"behavior patterns: not applicable: {why}")
    wd.set_title("Behavior patterns (Definition 2): width")
    sp.set_title("Pattern support (as in the paper's Figure 3)")
    al.set_title("Devices alone in their pattern")
    fig.subplots_adjust(left=0.07, right=0.985, bottom=0.07, top=0.95, wspace=0.33, hspace=0.36)  # (not tight_layout:
    plots.save(fig, path)                                                                          # it doubles the time)
