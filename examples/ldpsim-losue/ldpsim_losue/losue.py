"""L-OSUE: longitudinal Optimized-then-Symmetric Unary Encoding, a memoized histogram protocol (ldpsim plugin).

Arcolezi, Couchot, Al Bouna, Xiao, "Improving the utility of locally differentially private protocols for
longitudinal and multidimensional frequency estimates", Digital Communications and Networks (2022),
arXiv:2111.04636. Unary encodings: Wang, Blocki, Li, Jha, "Locally differentially private protocols for
frequency estimation", USENIX Security 2017 (OUE, SUE); memoization: Erlingsson et al., RAPPOR (CCS 2014).

[0, max_value] is cut into k equal-width buckets; bucket(x) = min(floor(x k/m), k - 1). A device with bucket v:

1. **Permanent memoization (OUE at eps_perm).** Once per distinct bucket v it ever reports, it fixes a k-bit
   vector B(v): B(v)_v = 1 with p1 = 1/2, every other B(v)_j = 1 with q1 = 1/(e^eps_perm + 1). No table is
   stored: B(v)_j is a keyed pure function of (seed, device, v, j) (``Purpose.MEMO``, sub-index v k + j).
2. **Instantaneous randomization (SUE), fresh every round.** Each bit of B(v) is kept with p2 and flipped with
   q2 = 1 - p2 (``Purpose.REPORT`` keyed by the round, sub-index j), where
   p2 = (1 - e^(eps_1 + eps_perm)) / (e^eps_1 - e^eps_perm - e^(eps_1 + eps_perm) + 1),
   the value that makes one report (OUE then SUE) exactly eps_1-LDP: the report's bit at the device's own
   bucket is 1 with p* = p1 p2 + (1 - p1) q2 = 1/2, any other with q* = q1 p2 + (1 - q1) q2 = 1/(e^eps_1 + 1),
   and p*(1 - q*)/((1 - p*) q*) = e^eps_1. 0 < eps_1 < eps_perm makes 1/2 < p2 < 1.
3. **Collector (the paper's two-step unbiased estimator).** With C(v) the number of reports whose bit v is 1
   and n the reports received, f_hat(v) = (C(v)/n - q1 (p2 - q2) - q2) / ((p1 - q1)(p2 - q2)). Unbiased; it
   can be negative and is reported raw (multi-freq-ldpy's MI_long clips at 0 and renormalizes: post-processing).
4. **Variance for fixed inputs (derived here).** The n h devices in bucket v send bit v = 1 with p*, the
   others with q*, independently, so Var[f_hat(v)] = (h p*(1 - p*) + (1 - h) q*(1 - q*)) / (n (p* - q*)^2),
   with p* - q* = (p1 - q1)(p2 - q2). (multi-freq-ldpy's VAR_Long_Pure, sig(1 - sig)/(n (p1 - q1)^2 (p2 - q2)^2)
   with sig = q* + h (p* - q*), also counts the sampling variance of inputs drawn from h.)

Privacy, as the ledger charges it:
- eps_perm the first time a device reveals a bucket's memoized vector (``memo_reveal``), nothing when it
  repeats one: the reports are a post-processing of the distinct vectors B(v) revealed, each OUE at eps_perm,
  so a device's spend is (pattern width) x eps_perm, at most min(R, k) eps_perm, within a behavior pattern
  (Ding, Kulkarni, Yekhanin, NIPS 2017, Definition 2 and Theorem 4, as for dBitFlipPM);
- each report is eps_1-LDP on its own (item 2), recorded as a non-cumulative ``round_guarantee``;
- against a device of another behavior pattern the loss grows with the rounds (the fresh SUE layer blurs the
  memoized vectors the way output perturbation does); ``LosueParams.worst_case_bound`` is an upper bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numba as nb
import numpy as np

from protocols import config, keyed
from protocols import likelihood as lik
from protocols.base import ProtocolParams, check_params
from protocols.collecting import Column, ReportCollector
from protocols.device import OneReportDevices
from protocols.guard import Guarantee, Guard, Limits
from protocols.keyed import Purpose, stream_key
from protocols.ledger import MEMO_REVEAL, ROUND_GUARANTEE, Charge
from protocols.memo import RevealSet, admit_reports
from protocols.messages import ReportBatch
from protocols.round_mechanism import NoRoundMechanism
from protocols.wire import bits as wire_bits

__all__ = ["LOSUE", "LosueCollector", "LosueDevices", "LosueParams", "bucket_of", "estimate_frequencies",
           "losue_probabilities", "losue_variance"]

LOSUE = "losue"  # the protocol's name on the wire (a short lowercase name), whatever the scenario calls it
MAX_BUCKETS = 1024  # k bits travel in every report


def bucket_of(x: np.ndarray, k: int, m: float) -> np.ndarray:
    """Bucket index of values in [0, m] for k equal-width buckets; x = m goes to k - 1."""
    return np.minimum((np.asarray(x, dtype=np.float64) * (k / m)).astype(np.int64), k - 1)


def histogram(x: np.ndarray, k: int, m: float) -> np.ndarray:
    """True bucket frequencies (summing to 1)."""
    return np.bincount(bucket_of(x, k, m), minlength=k) / max(np.asarray(x).size, 1)


def losue_probabilities(eps_perm: float, eps_1: float) -> tuple[float, float, float, float]:
    """(p1, q1, p2, q2): OUE at eps_perm for the memoized vector, then SUE with p2 chosen so that one report
    is eps_1-LDP (module docstring, item 2; the expressions of Arcolezi et al. and multi-freq-ldpy)."""
    if not 0 < eps_1 < eps_perm:
        raise ValueError(f"L-OSUE needs 0 < eps_1 < eps_perm, got eps_1 = {eps_1}, eps_perm = {eps_perm}")
    p1 = 0.5
    q1 = 1.0 / (math.exp(eps_perm) + 1.0)
    p2 = (1.0 - math.exp(eps_1 + eps_perm)) / (math.exp(eps_1) - math.exp(eps_perm) - math.exp(eps_1 + eps_perm) + 1.0)
    return p1, q1, p2, 1.0 - p2


def report_probabilities(eps_perm: float, eps_1: float) -> tuple[float, float]:
    """(p*, q*): P[a report's bit is 1] at the device's own bucket and at any other bucket."""
    p1, q1, p2, q2 = losue_probabilities(eps_perm, eps_1)
    return p1 * p2 + (1 - p1) * q2, q1 * p2 + (1 - q1) * q2


def losue_variance(h: np.ndarray, n: int, eps_perm: float, eps_1: float) -> np.ndarray:
    """Exact Var[f_hat(v)] for fixed inputs with true frequencies h and n reports (module docstring, item 4)."""
    ps, qs = report_probabilities(eps_perm, eps_1)
    h = np.asarray(h, dtype=np.float64)
    return (h * ps * (1 - ps) + (1 - h) * qs * (1 - qs)) / (n * (ps - qs) ** 2)


def estimate_frequencies(b: np.ndarray, eps_perm: float, eps_1: float) -> np.ndarray:
    """f_hat(v) = (C(v)/n - q1 (p2 - q2) - q2) / ((p1 - q1)(p2 - q2)) from the (n, k) report bits."""
    n, k = b.shape
    if n == 0:
        return np.full(k, np.nan)
    p1, q1, p2, q2 = losue_probabilities(eps_perm, eps_1)
    counts = b.sum(axis=0, dtype=np.int64)
    return (counts / n - q1 * (p2 - q2) - q2) / ((p1 - q1) * (p2 - q2))


@dataclass(frozen=True)
class LosueParams:
    """L-OSUE: ``epsilon`` eps_perm (per distinct bucket revealed), ``eps_1`` (one report), ``buckets`` k."""

    name: str
    epsilon: float
    eps_1: float
    max_value: float
    buckets: int

    kind = "histogram"
    memoized = True
    #: the [protocol] table `ldpsim privacy-audit losue` audits when given the protocol's name
    examples = {LOSUE: {"epsilon": 2.0, "eps_1": 1.0, "max_value": 24.0, "buckets": 8}}

    @classmethod
    def from_table(cls, name: str, table: "config.Table", ctx: "config.Context") -> "LosueParams":
        """[protocol] keys: epsilon (eps_perm), eps_1 (< epsilon), max_value, buckets (k in [2, 1024]). Whatever
        ``name`` the scenario used (``losue``, or ``ldpsim_losue:LosueParams``), the protocol is ``losue``."""
        epsilon = config.epsilon(table)
        eps_1 = table.get("eps_1", float, check=lambda v: 0 < v < epsilon,
                          what=f"a number in (0, epsilon = {epsilon:g}) (one report's guarantee, below eps_perm)")
        max_value = config.max_value(table)
        k = table.get("buckets", int, check=lambda v: 2 <= v <= MAX_BUCKETS, what=f"an integer in [2, {MAX_BUCKETS}]")
        return cls(LOSUE, epsilon, eps_1, max_value, k)

    def __post_init__(self) -> None:
        check_params(self.epsilon, self.max_value)
        if not 0 < self.eps_1 < self.epsilon:
            raise ValueError(f"protocol.eps_1 must be in (0, epsilon = {self.epsilon}), got {self.eps_1}")
        if not 2 <= self.buckets <= MAX_BUCKETS:
            raise ValueError(f"protocol.buckets must be in [2, {MAX_BUCKETS}], got {self.buckets}")

    # ------------------------------------------------------------------------------------------- privacy
    @property
    def gamma(self) -> float:
        """No output perturbation (protocols.memo reads it); the SUE layer is this protocol's own."""
        return 0.0

    @property
    def round_epsilon(self) -> float:
        """One report is eps_1-LDP (module docstring, item 2)."""
        return self.eps_1

    def worst_case_bound(self, horizon: int) -> float:
        """An upper bound on the loss of a whole transcript of ``horizon`` reports against *any* other input
        sequence, of any behavior pattern (derived here). Positions are independent; per position j and round t
        the transcript's probability is at most p2 (the best memo bit for every round), and by Jensen over the
        memo bit at least q2 (p2/q2)^pi, pi = P[memo bit = 1] (p1 = 1/2 at the device's bucket, q1 elsewhere).
        So the log-ratio is at most R ((k - 1)(1 - q1) + 1/2) ln(p2/q2). Not exact (``exact`` False)."""
        _, q1, p2, q2 = losue_probabilities(self.epsilon, self.eps_1)
        return horizon * ((self.buckets - 1) * (1 - q1) + 0.5) * math.log(p2 / q2)

    def guarantee(self, horizon: int) -> Guarantee:
        """eps_perm per distinct memoized vector revealed, at most min(R, k) x eps_perm, within a behavior
        pattern; each report eps_1-LDP; the loss against other patterns bounded by :meth:`worst_case_bound`."""
        width = min(horizon, self.buckets)
        return Guarantee(
            width * self.epsilon,
            f"min(R, k) x eps_perm = min({horizon}, {self.buckets}) x {self.epsilon:g}; each report "
            f"eps_1 = {self.eps_1:g}-LDP (OUE at eps_perm, then SUE with p2 = {losue_probabilities(self.epsilon, self.eps_1)[2]:.6g})",
            "within a behavior pattern: eps_perm per distinct bucket revealed (L-OSUE, Arcolezi et al. 2022; "
            "Ding et al. 2017, Theorem 4); each single report eps_1-LDP",
            (self.worst_case_bound(horizon), False,
             "upper bound R ((k - 1)(1 - q1) + 1/2) ln(p2/q2) (per position: max over memo bits against Jensen "
             "over them; ldpsim_losue.losue.LosueParams.worst_case_bound)"))

    def round_mechanism(self, round_: int = 1) -> NoRoundMechanism:
        return NoRoundMechanism("memoized: a device's reports of a bucket all randomize the same permanent OUE "
                                "vector, so rounds are not fresh mechanisms to compose (see worst_case_loss)")

    def log_likelihood(self, values: np.ndarray, reports: list[dict[str, np.ndarray]],
                       present: np.ndarray) -> np.ndarray:
        """log P[each device's reports | its values were ``values`` (one per round)], the attacker's model
        (protocols.likelihood), from the paper's probabilities: the rounds that share a bucket v share the
        memoized vector B(v), whose bit j is 1 with p1 (j = v) or q1; every report bit then equals the memo bit
        with p2 and differs with q2, fresh. Bits, and buckets' vectors, are independent."""
        p1, q1, _, q2 = losue_probabilities(self.epsilon, self.eps_1)
        k = self.buckets
        y = lik.column(reports, "b").astype(np.float64) * present[:, :, None]  # (n, T, k)
        zeros = (1.0 - y) * present[:, :, None]
        buckets = bucket_of(np.asarray(values, dtype=np.float64), k, self.max_value)
        total = np.zeros(y.shape[0])
        for v in np.unique(buckets):
            rounds = buckets == v
            ones_v, zeros_v = y[:, rounds, :].sum(axis=1), zeros[:, rounds, :].sum(axis=1)  # (n, k)
            prob = np.where(np.arange(k) == v, p1, q1)
            # a bit repeating the memo bit b ~ Bern(prob), each report flipped with q2 afresh
            total += lik.memo_bit_loglik(ones_v, zeros_v, prob[None, :], q2).sum(axis=1)
        return total

    @property
    def reference_model(self) -> type:
        """The plain per-device model ``ldpsim audit`` replays (ldpsim_losue.reference)."""
        from ldpsim_losue.reference import LosueReference

        return LosueReference

    # ------------------------------------------------------------------------------------------- runtime
    def make_devices(self, seed: int, device_ids: np.ndarray, limits: Limits | None = None) -> "LosueDevices":
        return LosueDevices(self, seed, device_ids, limits)

    def make_collector(self, n_devices: int) -> "LosueCollector":
        return LosueCollector(self, n_devices)

    def truth(self, values: np.ndarray) -> np.ndarray:
        return histogram(values, self.buckets, self.max_value)

    def estimate_sd(self, values: np.ndarray, reports: int) -> np.ndarray:
        return np.sqrt(losue_variance(self.truth(values), reports, self.epsilon, self.eps_1))


# ------------------------------------------------------------------------------------------- device side
@nb.njit(cache=True)
def _report_kernel(ids, buckets, k, p1, q1, p2, q2, memo_key, round_key, out):
    """Each device's report: memo bit j of its bucket v (keyed by (device, v k + j), round-free), then kept with
    p2 or flipped (keyed by (device, j) with the round's key)."""
    for i in range(ids.shape[0]):
        v = buckets[i]
        for j in range(k):
            c = keyed.uniform2(memo_key, ids[i], np.uint64(v * k + j)) < (p1 if j == v else q1)
            out[i, j] = keyed.uniform2(round_key, ids[i], np.uint64(j)) < (p2 if c else q2)


class LosueDevices(OneReportDevices):
    """Device side of a cohort: the guard, and which buckets' memoized vectors each device has revealed. The
    template (protocols.device) applies the acceptance rule before :meth:`report_batch` is asked."""

    def __init__(self, params: LosueParams, seed: int, device_ids: np.ndarray, limits: Limits | None = None) -> None:
        self.params, self.seed = params, int(seed)
        self.device_ids = np.ascontiguousarray(device_ids, dtype=np.uint64)
        self.guard = Guard(self.device_ids, limits)
        self.reveals = RevealSet(self.device_ids.size, params.buckets)
        self._probs = losue_probabilities(params.epsilon, params.eps_1)

    def report_bits(self, round_: int, rows: np.ndarray, buckets: np.ndarray) -> np.ndarray:
        """The (len(rows), k) report bits of the devices at ``rows`` for ``round_``."""
        p = self.params
        out = np.empty((rows.size, p.buckets), dtype=np.uint8)
        _report_kernel(self.device_ids[rows], buckets[rows], p.buckets, *self._probs,
                       np.uint64(stream_key(self.seed, Purpose.MEMO)),
                       np.uint64(stream_key(self.seed, Purpose.REPORT, round_)), out)
        return out

    def report_batch(self, round_: int, values: np.ndarray, rows: np.ndarray,
                     now: float) -> tuple[ReportBatch | None, list[Charge]]:
        """The accepted round's reports of the devices at ``rows``: a reveal is charged eps_inf once per bucket
        (through the guard, which refuses what the budget cannot pay); every report costs eps_1 per round."""
        p = self.params
        buckets = bucket_of(values, p.buckets, p.max_value)
        rows, new = admit_reports(self.guard, p, rows, self.reveals, buckets)
        assert new is not None
        charges = [self.guard.charge(round_, now, MEMO_REVEAL, p.epsilon, rows[new]),
                   Charge(round_, now, ROUND_GUARANTEE, p.eps_1, self.device_ids[rows], cumulative=False)]
        batch = ReportBatch(round=round_, protocol=p.name, devices=self.device_ids[rows].astype(np.uint32),
                            columns={"b": wire_bits(self.report_bits(round_, rows, buckets))})
        return batch, charges


# ------------------------------------------------------------------------------------------- collector side
class LosueCollector(ReportCollector):
    """One report stage: the k bits of every report (protocols.collecting checks and stores them)."""

    def __init__(self, params: LosueParams, n_devices: int) -> None:
        self.params, self.name = params, params.name
        self.columns = (Column("b", np.uint8, width=params.buckets, high=1),)
        super().__init__(n_devices)

    def estimate(self, reports: dict[str, np.ndarray]) -> np.ndarray:
        return estimate_frequencies(reports["b"], self.params.epsilon, self.params.eps_1)

    def empty_estimate(self) -> np.ndarray:
        return np.full(self.params.buckets, np.nan)


if TYPE_CHECKING:  # a type checker holds the descriptor, and through it both sides, to protocols.base
    _LosueParams: type[ProtocolParams] = LosueParams
