"""1BitMean and 1BitRRPM (Ding, Kulkarni, Yekhanin, NIPS 2017): mean estimation, one bit per device and round.

- ``1bitmean``: a fresh 1BitMean bit every round (the naive repeated baseline): P[b = 1] = 1/(e^eps + 1)
  + (x/m)(e^eps - 1)/(e^eps + 1) (paper eq. 1), charged eps every round (eps' with output perturbation).
- ``1bitrrpm``: alpha-point rounding to the grid {0, s, ..., m} and permanent memoization of one bit per grid
  value (section 3, Theorems 3-4); charged eps when a device first reveals a grid value's bit.
- Output perturbation (section 3.2): each sent bit flips with probability gamma, fresh every round; one round
  is then eps'-LDP (Theorem 6, :func:`epsilon_prime`); the collector debiases by (b - gamma)/(1 - 2 gamma).
Formulas: docs/algorithms.md sections 1.1 and 2.1-2.4.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numba as nb
import numpy as np

from protocols import config
from protocols import keyed
from protocols import likelihood as lik
from protocols.base import Estimate, MisuseError, ProtocolParams, check_params
from protocols.collecting import Column, ReportCollector
from protocols.device import OneReportDevices, at_rows
from protocols.guard import Guarantee, Guard, Limits
from protocols.keyed import Purpose, stream_key
from protocols.ledger import Charge, increasing
from protocols.memo import RevealSet, admit_reports, report_charges
from protocols.messages import ReportBatch
from protocols.round_mechanism import NoRoundMechanism, RoundMechanism, randomized_response
from protocols.wire import bits as wire_bits

NAIVE, MEMOIZED = "1bitmean", "1bitrrpm"
#: the most grid steps m/s of 1bitrrpm: memo inputs (grid points) are int64 and a reveal set keys on
#: (device, input) in 64 bits (protocols/memo.py)
MAX_STEPS = 2**31


# ------------------------------------------------------------------------------------------- formulas
def p_one(x: np.ndarray | float, epsilon: float, m: float) -> np.ndarray | float:
    """P[b = 1] of 1BitMean for value x in [0, m] (Ding et al. 2017, eq. 1)."""
    e = math.exp(epsilon)
    return 1.0 / (e + 1.0) + (np.asarray(x, dtype=np.float64) / m) * (e - 1.0) / (e + 1.0)


def debias(b: np.ndarray, gamma: float) -> np.ndarray:
    """Undo output perturbation: E[(b_hat - gamma)/(1 - 2 gamma)] = b (section 3.2)."""
    return (np.asarray(b, dtype=np.float64) - gamma) / (1.0 - 2.0 * gamma)


def estimate_mean(b: np.ndarray, epsilon: float, m: float, gamma: float = 0.0) -> float:
    """mean_hat = (m/n) sum_i (b_i (e^eps + 1) - 1)/(e^eps - 1), after debiasing (eq. 2). Unbiased."""
    b = np.asarray(b)
    return estimate_mean_of_counts(int(np.count_nonzero(b)), b.size, epsilon, m, gamma)


def estimate_mean_of_counts(ones: int, n: int, epsilon: float, m: float, gamma: float = 0.0) -> float:
    """:func:`estimate_mean` of ``n`` bits of which ``ones`` are 1 (it depends on nothing else)."""
    if n == 0:
        return float("nan")
    e = math.exp(epsilon)
    total = (float(ones) - n * gamma) / (1.0 - 2.0 * gamma)  # = sum of debias(b): affine in the count of ones
    return m / n * (total * (e + 1.0) - n) / (e - 1.0)


@nb.njit(cache=True, nogil=True)
def _sums(x):  # pragma: no cover (compiled)
    """(sum x, sum x^2) in one pass, each over 8 interleaved partial sums (about numpy's own accuracy)."""
    s, q = np.zeros(8), np.zeros(8)
    n8 = x.shape[0] - x.shape[0] % 8
    for i in range(0, n8, 8):
        for j in range(8):
            s[j] += x[i + j]
            q[j] += x[i + j] * x[i + j]
    for i in range(n8, x.shape[0]):
        s[0] += x[i]
        q[0] += x[i] * x[i]
    return s.sum(), q.sum()


def mean_variance(x: np.ndarray, epsilon: float, m: float, gamma: float = 0.0) -> float:
    """Exact Var[mean_hat] for true values x (one round, fresh or memoized: the marginal of a memoized
    bit is the same Bernoulli because rounding is unbiased and p_one is linear in x).

    Var = (1/n^2) sum_i m^2 ((e^eps + 1)/(e^eps - 1))^2 q_i (1 - q_i) / (1 - 2 gamma)^2, with
    q_i = gamma + (1 - 2 gamma) p_i the probability that the sent bit is 1.

    The same formula is exact for one round of 1BitRRPM: the sent bit is Bernoulli with mean
    E_alpha[q(round(x))] = q(x) (q is affine in the rounded value and rounding is unbiased), and a
    Bernoulli's variance is fixed by its mean.
    """
    x = np.ascontiguousarray(x, dtype=np.float64).ravel()
    n = x.size
    e = math.exp(epsilon)
    # q_i = A + B x_i is affine, so sum q(1 - q) = n A(1 - A) + B(1 - 2A) sum x - B^2 sum x^2 (one compiled
    # pass, no temporary; not np.dot: OpenBLAS threads started by it keep spinning on the other cores).
    a = gamma + (1.0 - 2.0 * gamma) / (e + 1.0)
    b = (1.0 - 2.0 * gamma) * (e - 1.0) / (e + 1.0) / m
    total, squares = _sums(x)
    sum_q = n * a * (1 - a) + b * (1 - 2 * a) * total - b * b * squares
    c = m * (e + 1.0) / (e - 1.0) / (1.0 - 2.0 * gamma)
    return c * c * max(sum_q, 0.0) / n**2


def epsilon_prime(epsilon: float, gamma: float) -> float:
    """Per-round guarantee of 1BitMean + output perturbation (Ding et al. 2017, Theorem 6):
    eps' = ln( ((1 - 2g) e^eps/(e^eps + 1) + g) / ((1 - 2g)/(e^eps + 1) + g) )."""
    e = math.exp(epsilon)
    return math.log(((1 - 2 * gamma) * e / (e + 1) + gamma) / ((1 - 2 * gamma) / (e + 1) + gamma))


def hoeffding_radius(n: int, epsilon: float, m: float, delta: float) -> float:
    """With prob >= 1 - delta, |mean_hat - mean| <= m (e^eps + 1)/(e^eps - 1) sqrt(ln(2/delta)/(2n))."""
    e = math.exp(epsilon)
    return m * (e + 1) / (e - 1) * math.sqrt(math.log(2 / delta) / (2 * n))


# ------------------------------------------------------------------------------------------- parameters
@dataclass(frozen=True)
class OneBitParams:
    """Parameters of the 1BitMean family. ``granularity`` (s) is used by 1bitrrpm only."""

    name: str
    epsilon: float
    max_value: float
    granularity: float | None = None
    gamma: float = 0.0
    #: what the table held that this protocol does not use (the scenario prints each as a warning)
    warnings: list[str] = field(default_factory=list, compare=False, repr=False)

    #: ``ldpsim protocols``' line for each name this class runs
    summaries = {"1bitmean": "1BitMean (Ding, Kulkarni, Yekhanin, NIPS 2017): mean estimation, one bit per device and "
                             "round, randomized afresh every round.",
                 "1bitrrpm": "1BitRRPM (Ding et al. 2017): 1BitMean on alpha-point rounded values with permanent "
                             "memoization, optionally output perturbation (gamma)."}
    #: an example [protocol] table per name this class runs (ldpsim privacy-audit NAME, the conformance tests)
    examples = {'1bitmean': {'epsilon': 1.0, 'max_value': 1.0}, '1bitrrpm': {'epsilon': 1.0, 'max_value': 1.0, 'granularity': 0.25}}

    report_family = "onebit"  # how run-time attack metrics read the reports (scenarios/attacks.py)

    @classmethod
    def from_table(cls, name: str, table: "config.Table", ctx: "config.Context") -> "OneBitParams":
        """[protocol] keys: epsilon, max_value, granularity (1bitrrpm; it must divide max_value), gamma."""
        epsilon = config.epsilon(table)
        max_value = config.max_value(table)
        notes: list[str] = []
        if name == NAIVE and "granularity" in table.data:  # e.g. a 1bitrrpm scenario run with --set protocol.name
            table.get("granularity", (int, float))
            notes.append(f"granularity is not used by {NAIVE} (it does not round; 1bitrrpm does), so it is ignored")
            gran = None
        else:
            gran = table.get("granularity", float, None if name == NAIVE else ..., check=config.positive,
                             what="> 0")
        if gran is not None:
            k = max_value / gran
            if not math.isfinite(k):  # a granularity so small that m / granularity overflows
                raise table.fail("granularity", f"{gran:g} cuts protocol.max_value {max_value:g} into more steps "
                                                f"than a float holds (at most {MAX_STEPS:,}: the memo inputs' range)")
            if gran > max_value or abs(k - round(k)) > 1e-9 * k:
                raise table.fail("granularity", f"{gran:g} must divide protocol.max_value {max_value:g}")
            if k > MAX_STEPS:
                raise table.fail("granularity", f"{gran:g} cuts protocol.max_value {max_value:g} into {k:.3g} steps, "
                                                f"more than {MAX_STEPS:,} (the memo inputs' range)")
        return cls(name, epsilon, max_value, gran, table.get("gamma", float, 0.0, **config.GAMMA), notes)

    def __post_init__(self) -> None:
        if self.name not in (NAIVE, MEMOIZED):
            raise ValueError(f"protocol.name must be {NAIVE!r} or {MEMOIZED!r}, got {self.name!r}")
        check_params(self.epsilon, self.max_value, self.gamma)
        if self.name == MEMOIZED:
            s = self.granularity
            if s is None or not (math.isfinite(s) and 0 < s <= self.max_value):
                raise ValueError(f"protocol.granularity must be in (0, max_value], got {s}")
            k = self.max_value / s
            if abs(k - round(k)) > 1e-9 * k:
                raise ValueError(f"protocol.granularity {s} must divide protocol.max_value {self.max_value}")
            if k > MAX_STEPS:
                raise ValueError(f"protocol.granularity {s} gives {k:.3g} steps, more than {MAX_STEPS}")

    @property
    def memoized(self) -> bool:
        return self.name == MEMOIZED

    @property
    def step(self) -> float:
        """The grid step s (``granularity``) of 1bitrrpm; a ValueError for 1bitmean, which has no grid."""
        if self.granularity is None:
            raise ValueError(f"{self.name} has no grid (protocol.granularity)")
        return self.granularity

    @property
    def grid_size(self) -> int:
        """Number of grid values |G| = m/s + 1."""
        return int(round(self.max_value / self.step)) + 1

    @property
    def round_epsilon(self) -> float:
        """The per-report guarantee: eps, or eps' of Theorem 6 with output perturbation."""
        return epsilon_prime(self.epsilon, self.gamma) if self.gamma > 0 else self.epsilon

    def guarantee(self, horizon: int) -> Guarantee:
        """1BitMean: every report is charged eps (eps' with output perturbation), R reports. 1BitRRPM: eps per
        distinct grid value revealed, at most min(R, |G|) of them (Theorem 4, within a behavior pattern)."""
        if not self.memoized:
            return Guarantee(horizon * self.round_epsilon, f"R x eps_round = {horizon} x {self.round_epsilon:.6g}")
        from protocols.worst_case import memo_bit_worst_case

        width = min(horizon, self.grid_size)
        wc = memo_bit_worst_case(self.epsilon, self.gamma, horizon, self.grid_size)
        return Guarantee(width * self.epsilon,
                         f"min(R, |G|) x eps = min({horizon}, {self.grid_size}) x {self.epsilon:g}",
                         "within a behavior pattern (Ding et al. 2017, Theorem 4)",
                         (wc.value, wc.exact, wc.method))

    def round_mechanism(self, round_: int = 1) -> RoundMechanism | NoRoundMechanism:
        """One round for a PLD accountant (protocols/round_mechanism.py). 1BitMean: the sent bit is 1 with
        q(x) = gamma + (1 - 2 gamma) p(x), p(x) = 1/(e^eps + 1) + (x/m)(e^eps - 1)/(e^eps + 1) (Ding et al. 2017,
        eq. 1; output perturbation, section 3.2). The pair x = m against x' = 0 gives q(m) = gamma + (1 - 2 gamma)
        e^eps/(e^eps + 1) and q(0) = 1 - q(m), whose ratio is e^eps' (Theorem 6; e^eps for gamma = 0): binary
        randomized response at round_epsilon. Every other pair has q(x), q(x') inside [q(0), q(m)], a
        post-processing of it, so this pair dominates and is attained. 1BitRRPM: the bits are memoized, so
        rounds are not independent mechanisms."""
        if self.memoized:
            return NoRoundMechanism("memoized: a device resends the same memoized bit whenever its rounded value "
                                    "repeats, so rounds are not fresh mechanisms to compose (see worst_case_loss)")
        return randomized_response(self.round_epsilon, "x = max_value against x' = 0",
                                   "Ding et al. 2017, eq. 1; with gamma > 0, Theorem 6 (eps')")

    def log_likelihood(self, values: np.ndarray, reports: list[dict[str, np.ndarray]],
                       present: np.ndarray) -> np.ndarray:
        """log P[each device's bits | its values were ``values`` (one per round)], the attacker's model
        (protocols.likelihood). 1BitMean: independent bits, P[1] = g + (1 - 2g) p(x) (eq. 1, section 3.2).
        1BitRRPM: the unknown alpha ~ U[0, s) is integrated out exactly: alpha's segments between the rounding
        cut points fix every round's grid value, and within a segment each grid value's memoized bit
        (Bernoulli(p(grid)), Theorem 3) explains all the rounds that use it."""
        x = np.clip(np.asarray(values, dtype=np.float64), 0.0, self.max_value)
        y = lik.column(reports, "bit")[:, :, 0].astype(np.float64) * present
        zeros = (1.0 - y) * present
        if not self.memoized:
            q = lik.sent_one_probability(p_one(x, self.epsilon, self.max_value), self.gamma)
            return (lik.bernoulli_loglik(y, zeros, q)).sum(axis=1)
        s, top = float(self.step), self.grid_size - 1
        low = np.floor(x / s)
        cuts = (low + 1.0) * s - x  # alpha >= cut rounds x up
        edges = np.unique(np.concatenate(([0.0, s], cuts[(cuts > 0) & (cuts < s)])))
        total = np.full(y.shape[0], -np.inf)
        for a, b in zip(edges[:-1], edges[1:]):
            grid = np.clip(low + (0.5 * (a + b) >= cuts), 0, top)
            seg = np.full(y.shape[0], np.log((b - a) / s))
            for g in np.unique(grid):
                used = grid == g
                seg += lik.memo_bit_loglik(y[:, used].sum(axis=1), zeros[:, used].sum(axis=1),
                                           p_one(g * s, self.epsilon, self.max_value), self.gamma)
            total = np.logaddexp(total, seg)
        return total

    # the protocol descriptor used by the runtimes (protocols.base.ProtocolParams)
    kind = "mean"

    def make_devices(self, seed: int, device_ids: np.ndarray, limits: Limits | None = None) -> "OneBitDevices":
        return OneBitDevices(self, seed, device_ids, limits)

    def make_collector(self, n_devices: int) -> "OneBitCollector":
        return OneBitCollector(self, n_devices)

    def truth(self, values: np.ndarray) -> float:
        return float(values.mean())

    def estimate_sd(self, values: np.ndarray, reports: int) -> float:
        """Closed-form sd of the estimate when ``reports`` of the devices with ``values`` report."""
        return math.sqrt(mean_variance(values, self.epsilon, self.max_value, self.gamma) * values.size / reports)


# ------------------------------------------------------------------------------------------- kernels
@nb.njit(cache=True, nogil=True)
def _memo_kernel(ids, values, alpha, s, m, top, p0, slope, memo_key, flip_key, gamma, out_bits, out_grid):
    for i in range(ids.shape[0]):
        x = values[i]
        low = math.floor(x / s)
        g = int(low) + (1 if x + alpha[i] >= (low + 1.0) * s else 0)
        g = min(max(g, 0), top)
        out_grid[i] = g
        b = keyed.uniform2(memo_key, ids[i], np.uint64(g)) < p0 + slope * (g * s / m)
        if gamma > 0.0 and keyed.uniform1(flip_key, ids[i]) < gamma:
            b = not b
        out_bits[i] = b


@nb.njit(cache=True, nogil=True)
def _fresh_kernel(ids, values, m, p0, slope, report_key, flip_key, gamma, out_bits):
    for i in range(ids.shape[0]):
        b = keyed.uniform1(report_key, ids[i]) < p0 + slope * (values[i] / m)
        if gamma > 0.0 and keyed.uniform1(flip_key, ids[i]) < gamma:
            b = not b
        out_bits[i] = b


# ------------------------------------------------------------------------------------------- device side
class OneBitDevices(OneReportDevices):
    """Device side for a cohort: answers each round at most once, memo state and reveals kept per device."""

    def __init__(self, params: OneBitParams, seed: int, device_ids: np.ndarray, limits: Limits | None = None) -> None:
        self.params = params
        self.seed = int(seed)
        self.device_ids = np.ascontiguousarray(device_ids, dtype=np.uint64)
        if not increasing(self.device_ids):  # one compiled pass, no temporaries
            raise MisuseError("device ids must be strictly increasing")
        self.guard = Guard(self.device_ids, limits)
        self.reveals: RevealSet | None = None
        e = math.exp(params.epsilon)
        self._p0, self._slope = 1.0 / (e + 1.0), (e - 1.0) / (e + 1.0)
        if params.memoized:
            self.alpha = keyed.uniform(stream_key(seed, Purpose.ALPHA), self.device_ids) * params.granularity
            self.reveals = RevealSet(self.device_ids.size, params.grid_size)
            self._memo_key = np.uint64(stream_key(seed, Purpose.MEMO))

    def report_bits(self, round_: int, values: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """The bits the cohort sends for ``round_`` given clipped values, and the grid indices (memoized)."""
        p = self.params
        x = np.ascontiguousarray(values, dtype=np.float64)
        out = np.empty(x.shape[0], dtype=np.uint8)
        flip_key = np.uint64(stream_key(self.seed, Purpose.FLIP, round_))
        if p.memoized:
            grid = np.empty(x.shape[0], dtype=np.int64)
            _memo_kernel(self.device_ids, x, self.alpha, float(p.step), float(p.max_value),
                         p.grid_size - 1, self._p0, self._slope, self._memo_key, flip_key, float(p.gamma),
                         out, grid)
            return out, grid
        report_key = np.uint64(stream_key(self.seed, Purpose.REPORT, round_))
        _fresh_kernel(self.device_ids, x, float(p.max_value), self._p0, self._slope, report_key, flip_key,
                      float(p.gamma), out)
        return out, None

    def report_batch(self, round_: int, values: np.ndarray, rows: np.ndarray,
                     now: float) -> tuple[ReportBatch | None, list[Charge]]:
        """The accepted round's bits of the devices at ``rows``; memo reveals charged eps, through the guard."""
        p = self.params
        bits, grid = self.report_bits(round_, values)
        rows, new = admit_reports(self.guard, p, rows, self.reveals, grid, positions=True)
        charges = report_charges(self.guard, p, round_, now, rows, new)
        batch = ReportBatch(round=round_, protocol=p.name, devices=self.wire_ids(rows),
                            columns={"bit": wire_bits(at_rows(bits, rows))})
        return batch, charges


# ------------------------------------------------------------------------------------------- collector side
class OneBitCollector(ReportCollector):
    """Collector side: one bit per device and round; the estimate uses the reports that arrived (eq. 2)."""

    columns = (Column("bit", np.uint8, high=1),)

    def __init__(self, params: OneBitParams, n_devices: int) -> None:
        self.params = params
        self.name = params.name
        super().__init__(n_devices)

    def estimate(self, reports: dict[str, np.ndarray]) -> float:
        p = self.params
        return estimate_mean(reports["bit"][:, 0], p.epsilon, p.max_value, p.gamma)

    def estimate_stored(self, data: dict[str, np.ndarray], present: np.ndarray, count: int) -> Estimate:
        """:meth:`estimate` from the stored column: its ones are the reports' ones (rows without a report hold
        0), so the reports need not be selected first."""
        if type(self).estimate is not OneBitCollector.estimate:  # a subclass's own estimate sees the reports
            return super().estimate_stored(data, present, count)
        p = self.params
        return estimate_mean_of_counts(int(np.count_nonzero(data["bit"])), count, p.epsilon, p.max_value, p.gamma)


if TYPE_CHECKING:  # mypy: the descriptor, and through it the device and collector sides, match protocols.base
    _OneBitParams: type[ProtocolParams] = OneBitParams
