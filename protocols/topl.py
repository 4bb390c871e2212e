"""ToPL (Wang et al., CCS 2021, section 6): threshold optimizer + Hybrid Mechanism reports, event-level LDP.

Devices report one value per round (their counter). In a threshold round (round 1 and every
``rethreshold_every`` rounds after) a keyed holdout of devices sends Square Wave reports of v/m at
``threshold_epsilon``; the collector estimates the value density with EM (SW-W pruning, or EMS smoothing),
chooses theta, and broadcasts it (a :class:`~protocols.messages.Threshold` message that applies from its
round on). The other devices truncate to [0, theta] and report t = 2 min(x, theta)/theta - 1 with HM at
``epsilon``; each report names the theta version it used, so a device that missed a broadcast is decoded
with the theta it really used, and a theta never applies to a round before its own. The collector's
estimate of the round's sum over devices is n x mean((y + 1) theta_v/2).

Threshold choice (docs/algorithms.md section 4.3, adapted to many devices a round): a random range query over R
rounds has E[len] = R/3 and E[len^2] = R^2/6 (both ~), so per device
MSE(theta) = (R/3) Var_HM(theta)/r + (R^2/6) B(theta)^2, Var_HM(theta) = theta^2/4 x (HM's worst-case
variance), B(theta) = sum_x f(x) max(x - theta, 0), with r the reports a round (the paper streams one value
per time step, r = 1). MSE(theta) = (R/r) [Var_HM(theta)/3 + (R r/6) B(theta)^2], so theta depends on R x r
only: the paper's theta for a stream of R x r values. Candidates are the EM domain's bin edges.
``objective = "authors"`` weighs the two terms as the authors' published code does (variance x 4, squared
bias / 4: :func:`range_mse`); ``integer = true`` evaluates B at the integers the unit-width bins hold instead
of at bin centres (:func:`support_points`). Each report is charged its epsilon (event-level): the ledger
states the cumulative per-device spend this implies.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable
import math
from dataclasses import dataclass

import numpy as np

from protocols import config
from protocols import keyed, numeric
from protocols import snapshot as snap
from protocols.base import MisuseError, ProtocolError, ProtocolParams, RoundResult, check_params
from protocols.collecting import Column
from protocols.device import GuardedDevices
from protocols.guard import Guarantee, Guard, Limits
from protocols.keyed import Purpose, stream_key
from protocols.ledger import Charge
from protocols.messages import CollectionRequest, CollectorMessage, ReportBatch, Threshold
from protocols.round_mechanism import DiscretePair, RoundMechanism, upper_envelope
from protocols.staged import ADVANCE, CLOSE, IDLE, REQUEST, StageGraph, StagedCollector

TOPL = "topl"
EVENT_REPORT = "event_report"
METHODS = ("sw-w", "ems", "oracle")


def hm_bound(eps: float) -> float:
    """Largest |output| of HM: the larger of PM's C and SR's C."""
    return max((math.exp(eps / 2) + 1) / (math.exp(eps / 2) - 1), (math.exp(eps) + 1) / (math.exp(eps) - 1))


OBJECTIVES = ("paper", "authors")


def range_mse(theta: np.ndarray, density: np.ndarray, centers: np.ndarray, eps: float, rounds: int,
              reports: int, objective: str = "paper") -> np.ndarray:
    """The optimizer's objective for each candidate theta, per device and round.

    ``objective = "paper"`` (Wang et al. CCS 2021, section 4.1, Eq. 8, with the per-round aggregation of the
    module docstring): (R/3) Var_HM(theta)/r + (R^2/6) B(theta)^2, where Var_HM(theta) = theta^2/4 x HM's
    worst-case variance on [-1, 1] (the paper's Eq. 22, scaled from [-1, 1] to [0, theta]) and
    B(theta) = sum_x f(x) max(x - theta, 0) with the mass of bin x at ``centers[x]``.

    ``objective = "authors"``: the weighting of the authors' published code (``exact_mse`` in
    percentile_estimator/sw_mse.py of the GitHub repository dp-cont/dp-cont), which writes the noise term as
    (std x theta)^2 x n/3 with std^2 the worst-case variance on [-1, 1], i.e. without the 1/4 of the change of
    scale (4 Var_HM), and the bias term as n^2/24 x B^2 instead of n^2/6. Here: (R/3) 4 Var_HM(theta)/r +
    (R^2/24) B(theta)^2, so squared bias counts 16 times less against variance than in the paper's text, and
    the minimizer is never larger (the objective is the paper's with B^2 weighed by 1/16, then scaled by 4).
    The authors' code also evaluates B at its grid points rather than at bin centres; that difference is not
    part of this option (see :func:`support_points` for exact integer support)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {list(OBJECTIVES)}, got {objective!r}")
    theta = np.asarray(theta, dtype=np.float64)
    var = theta**2 / 4 * numeric.hm_worst_variance(eps) / max(reports, 1)
    bias = truncation_bias(theta, density, centers)
    if objective == "authors":
        return rounds / 3 * 4 * var + rounds**2 / 24 * bias**2
    return rounds / 3 * var + rounds**2 / 6 * bias**2


def truncation_bias(theta: np.ndarray, density: np.ndarray, support: np.ndarray) -> np.ndarray:
    """B(theta) = sum_k f_k max(x_k - theta, 0) for each theta: the expected amount a value loses when it is
    truncated to [0, theta], with the (normalized) mass f_k of bin k at ``support[k]`` (:func:`support_points`)."""
    theta = np.asarray(theta, dtype=np.float64)
    excess = np.maximum(np.asarray(support, dtype=np.float64)[None, :] - theta.reshape(-1)[:, None], 0.0)
    return (excess @ (density / density.sum())).reshape(theta.shape)


def support_points(bins: int, max_value: float, integer: bool = False) -> np.ndarray:
    """Where the truncation bias B(theta) = sum_x f(x) max(x - theta, 0) puts each bin's mass.

    Default: the bin centres (k + 1/2) max_value/bins, as for a density spread evenly over each bin.
    ``integer``: the data are integers and the bins have unit width (bins == max_value), so bin k = [k, k + 1)
    holds exactly the integer k, and its mass sits at k. At an integer theta the centres overstate B by
    exactly 1/2 P(X >= theta) (every bin k >= theta adds 1/2, the bin of theta itself included, whose true
    excess is 0); the exact value is the sum over the integer support. The top value max_value falls in the
    last bin with max_value - 1 (the histogram's last bin is closed), so set max_value one above the data's
    largest value to give it a bin of its own."""
    if integer:
        if bins != max_value:
            raise ValueError(f"integer = true needs unit-width bins: bins must equal max_value, got bins = {bins}, "
                             f"max_value = {max_value:g}")
        return np.arange(bins, dtype=np.float64)
    return (np.arange(bins) + 0.5) * (max_value / bins)


def choose_threshold(density: np.ndarray, max_value: float, eps: float, rounds: int, reports: int,
                     objective: str = "paper", integer: bool = False) -> float:
    """theta among the bin edges of the density's domain [0, max_value] that minimizes :func:`range_mse`, with
    the bias evaluated at :func:`support_points`."""
    d = density.size
    edges = np.arange(1, d + 1) * (max_value / d)
    centers = support_points(d, max_value, integer)
    return float(edges[int(np.argmin(range_mse(edges, density, centers, eps, rounds, reports, objective)))])


@functools.lru_cache(maxsize=64)
def threshold_round_pair(eps: float, threshold_eps: float) -> DiscretePair:
    """One pair that dominates both HM at ``eps`` and SW at ``threshold_eps`` (a threshold round's device sends
    one or the other; :func:`upper_envelope`); cached, since a run asks for it every threshold round."""
    return upper_envelope(hm_pair(eps), sw_pair(threshold_eps),
                          "either SW at threshold_epsilon (holdout) or HM at eps: dominates both",
                          "Wang et al. CCS 2021 section 6; N. Wang et al. ICDE 2019 (HM); Li et al. SIGMOD 2020 (SW)")


@functools.lru_cache(maxsize=64)
def hm_pair(eps: float) -> DiscretePair:
    """The Hybrid Mechanism's round for a PLD accountant: t = 1 against t = -1 (N. Wang et al. ICDE 2019;
    docs/algorithms.md sections 1.5-1.7). With probability alpha (:func:`numeric.hm_alpha`) HM runs PM, else SR,
    and the output shows which (SR's two atoms against PM's density). PM's high-density windows are
    [l(t), r(t)] = [1, C] for t = 1 and [-C, -1] for t = -1 (C = (E + 1)/(E - 1), E = e^(eps/2)), disjoint; the
    window holds E/(E + 1), and outside it the density is p/e^eps, p = (e^eps - E)/(2E + 2). So PM's outputs
    fall in three classes: [1, C] (E/(E + 1) against (C - 1) p/e^eps, loss eps), (-1, 1) (2 p/e^eps under both)
    and [-C, -1] (the mirror). SR sends +C_SR with e^eps/(e^eps + 1) for t = 1 and 1/(e^eps + 1) for t = -1.
    Any other pair (t, t') has PM windows overlapping in part, which only moves mass from loss +-eps to loss
    0 (a post-processing), and SR probabilities in between: this pair dominates every pair and is attained."""
    a = numeric.hm_alpha(eps)
    e2 = math.exp(eps / 2.0)
    c, p = numeric.pm_c(eps), numeric.pm_p(eps)
    win, mid, far = e2 / (e2 + 1.0), 2.0 * p * math.exp(-eps), (c - 1.0) * p * math.exp(-eps)
    hi = 1.0 / (1.0 + math.exp(-eps))
    return DiscretePair(("PM in [1, C]", "PM in (-1, 1)", "PM in [-C, -1]", "SR +C", "SR -C"),
                        (a * win, a * mid, a * far, (1 - a) * hi, (1 - a) * (1 - hi)),
                        (a * far, a * mid, a * win, (1 - a) * (1 - hi), (1 - a) * hi),
                        "t = 1 against t = -1", "N. Wang et al. ICDE 2019: PM, SR and HM")


@functools.lru_cache(maxsize=64)
def sw_pair(eps: float) -> DiscretePair:
    """Square Wave's round for a PLD accountant: v = 0 against v = 1 (Li et al. SIGMOD 2020; docs/algorithms.md
    section 1.8). The output density is p within b of v and q elsewhere on [-b, 1 + b] (p/q = e^eps). The
    window of v = 1 minus the window of v = 0 has length L = min(2b, 1): there the law is p under v = 1 and q
    under v = 0; the mirror set the reverse; elsewhere the densities agree. For any pair (v, v') the
    differing sets have length min(2b, |v - v'|) <= L, a post-processing of this pair, so it dominates every
    pair and is attained."""
    b = numeric.sw_b(eps)
    p, q = numeric.sw_pq(eps)
    length = min(2.0 * b, 1.0)
    rest = 1.0 - (p + q) * length
    return DiscretePair(("window of v only", "window of v' only", "elsewhere"), (p * length, q * length, rest),
                        (q * length, p * length, rest), "v = 1 against v' = 0", "Li et al. SIGMOD 2020: Square Wave")


@dataclass(frozen=True)
class ToplParams:
    name: str
    epsilon: float  # HM, per report
    threshold_epsilon: float  # SW, per holdout report
    max_value: float
    holdout: float  # share of devices in the holdout (keyed per device)
    rethreshold_every: int  # 0: choose theta once, in round 1
    rounds: int
    devices: int
    method: str = "sw-w"  # "sw-w", "ems", or "oracle" (the true density, a reference baseline)
    bins: int = 1024
    rethreshold_at: tuple[int, ...] = ()  # extra threshold rounds on demand (published, like the period)
    objective: str = "paper"  # the optimizer's weighting: "paper" (Eq. 8) or "authors" (their code): range_mse
    integer: bool = False  # integer data on unit-width bins: truncation bias at the integers (support_points)

    kind = "stream"

    def run_summary(self, rounds: list, spend_by_reason: dict[str, np.ndarray], devices: int) -> dict:
        """ToPL's part of summary.json: the thresholds chosen, each beside the oracle's (from the true values),
        and the event-level accounting. ``rounds`` are the run's round records (``round``, ``info``)."""
        return {
            "threshold": [{"round": r.round, "theta": r.info.get("theta"), "oracle_theta": r.info["oracle_theta"],
                           "pruned_share": r.info.get("pruned_share")}
                          for r in rounds if "oracle_theta" in r.info],
        "event_level": {"epsilon_per_report": self.epsilon, "threshold_epsilon": self.threshold_epsilon,
                        "cumulative_per_device": "see epsilon: each report is charged its epsilon"}}

    def before_collect(self, t: int, values: "Callable[[], np.ndarray]", collector: "ToplCollector") -> dict:
        """Round t's reference figures from the true values (not seen by the protocol): in a threshold round the
        oracle's theta, the threshold the optimizer would choose from the true value distribution; with method
        "oracle" the collector is handed the values to choose it from."""
        if not self.threshold_round(t):
            return {}
        x = values()
        if self.method == "oracle":
            collector.oracle_values = x.copy()
        dens = np.histogram(x, bins=self.bins, range=(0, self.max_value))[0].astype(np.float64)
        return {"oracle_theta": choose_threshold(dens, self.max_value, self.epsilon, self.rounds, self.devices,
                                                 self.objective, self.integer)}

    def broadcast_stages(self, t: int) -> int:
        """Collector broadcasts in round t: a threshold round has the holdout's request, then the threshold."""
        return 2 if self.threshold_round(t) else 1

    #: an example [protocol] table per name this class runs (ldpsim privacy-audit NAME, the conformance tests)
    #: estimates.csv's per-round columns beyond the common ones: round info key, value when missing
    round_columns = (("theta", None), ("holdout_reports", 0), ("pruned_share", None))
    examples = {'topl': {'epsilon': 1.0, 'threshold_epsilon': 1.0, 'max_value': 1.0, 'holdout': 0.05, 'rethreshold_every': 0, 'method': 'sw-w'}}

    @classmethod
    def from_table(cls, name: str, table: "config.Table", ctx: "config.Context") -> "ToplParams":
        """[protocol] keys: epsilon, threshold_epsilon, max_value, holdout, rethreshold_every, rethreshold_at,
        method, bins, objective ("paper" or "authors", :func:`range_mse`), integer (true: integer data on
        unit-width bins, bins == max_value; :func:`support_points`)."""
        epsilon = config.epsilon(table)
        max_value = config.max_value(table)
        share = config.holdout_share(table, ctx.devices)
        rounds = ctx.rounds
        on_demand = table.get("rethreshold_at", list, [], check=lambda v: all(
            isinstance(r, int) and not isinstance(r, bool) and 1 <= r <= rounds for r in v),
            what=f"an array of rounds in [1, {rounds}]")
        bins = table.get("bins", int, 1024, check=lambda v: 16 <= v <= 4096, what="an integer in [16, 4096]")
        integer = table.get("integer", bool, False)
        if integer and bins != max_value:
            raise table.fail("integer", f"true needs unit-width bins (protocol.bins equal to protocol.max_value), "
                                        f"got bins = {bins}, max_value = {max_value:g}")
        return cls(
            name, epsilon, config.epsilon(table, "threshold_epsilon", epsilon), max_value, share,
            table.get("rethreshold_every", int, 0, check=lambda v: v >= 0, what="an integer >= 0 (0: never)"),
            rounds, ctx.devices,
            table.get("method", str, "sw-w", check=lambda v: v in METHODS, what=f"one of {list(METHODS)}"),
            bins, tuple(sorted(set(on_demand))),
            table.get("objective", str, "paper", check=lambda v: v in OBJECTIVES, what=f"one of {list(OBJECTIVES)}"),
            integer)

    def __post_init__(self) -> None:
        check_params(self.epsilon, self.max_value)
        check_params(self.threshold_epsilon, self.max_value)
        if not 0 < self.holdout < 1:
            raise ValueError(f"protocol.holdout must be a share in (0, 1), got {self.holdout}")
        if self.method not in METHODS:
            raise ValueError(f"protocol.method must be one of {METHODS}, got {self.method!r}")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"protocol.objective must be one of {list(OBJECTIVES)}, got {self.objective!r}")
        if self.integer and self.bins != self.max_value:
            raise ValueError(f"protocol.integer = true needs unit-width bins: bins must equal max_value, got "
                             f"bins = {self.bins}, max_value = {self.max_value:g}")

    @property
    def round_epsilon(self) -> float:
        return max(self.epsilon, self.threshold_epsilon)

    def threshold_round(self, r: int) -> bool:
        """Round 1, every ``rethreshold_every`` rounds after it, and the rounds in ``rethreshold_at``."""
        return (r == 1 or (self.rethreshold_every > 0 and (r - 1) % self.rethreshold_every == 0)
                or r in self.rethreshold_at)

    def guarantee(self, horizon: int) -> Guarantee:
        """One report a round, each eps-LDP on its own (event level): HM at eps, or SW at threshold_epsilon for
        a device in a threshold round's holdout; the worst device is in every holdout."""
        k = sum(1 for r in range(1, horizon + 1) if self.threshold_round(r))
        top = max(self.epsilon, self.threshold_epsilon)
        return Guarantee((horizon - k) * self.epsilon + k * top,
                         f"(R - K) x eps + K x max(eps, eps_threshold) = {horizon - k} x {self.epsilon:g} + "
                         f"{k} x {top:g} (K threshold rounds)")

    def round_mechanism(self, round_: int = 1) -> RoundMechanism:
        """Round ``round_`` for a PLD accountant (protocols/round_mechanism.py). Reports are fresh keyed draws
        every round. Outside threshold rounds a device sends HM at eps (:func:`hm_pair`, attained by t = 1
        against t = -1 whatever theta is, so also against an adaptive collector's theta). In a threshold round
        a device sends either SW at threshold_epsilon (holdout) or HM at eps (the others; nothing in round 1):
        the round is described by one pair that dominates both (:func:`upper_envelope`), whose pure eps is
        max(eps, threshold_epsilon), as in the ledger."""
        if not self.threshold_round(round_):
            return hm_pair(self.epsilon)
        return threshold_round_pair(self.epsilon, self.threshold_epsilon)

    def make_devices(self, seed: int, device_ids: np.ndarray, limits: Limits | None = None) -> "ToplDevices":
        return ToplDevices(self, seed, device_ids, limits)

    def threshold_version(self, r: int) -> int:
        """The version a threshold chosen in round ``r`` carries: how many threshold rounds there are in 1..r
        (a public schedule, so a device can tell a genuine broadcast's version from a reused or invented one)."""
        every = self.rethreshold_every
        count = 1 + ((r - 1) // every if every > 0 else 0)
        return count + sum(1 for t in self.rethreshold_at if t <= r and not (t == 1 or every > 0 and (t - 1) % every == 0))

    def plausible_theta(self, theta: float) -> bool:
        """A threshold a device accepts: finite and in [max_value x 1e-9, max_value]. (Privacy never depends on
        theta, since HM is eps-LDP for any input in [-1, 1]; an absurd theta only ruins the estimates.)"""
        return math.isfinite(theta) and self.max_value * 1e-9 <= theta <= self.max_value

    def make_collector(self, n_devices: int) -> "ToplCollector":
        return ToplCollector(self, n_devices)

    def truth(self, values: np.ndarray) -> float:
        return float(values.sum())

    def estimate_sd(self, values: np.ndarray, reports: int) -> float:
        """Upper bound: n x theta/2 x sqrt(worst-case HM variance / r) with theta = max_value."""
        return self.devices * self.max_value / 2 * math.sqrt(numeric.hm_worst_variance(self.epsilon) / reports)


class ToplDevices(GuardedDevices):
    """Device side: the thetas received with the round each applies from, one report per round. A fresh
    keyed holdout is drawn for every threshold round: its devices send Square Wave in that round and HM
    reports like everyone else in the other rounds."""

    def in_holdout(self, r: int) -> np.ndarray:
        """Whether each device is in the holdout of threshold round ``r`` (keyed by the round: fresh each time)."""
        u = keyed.uniform(stream_key(self.seed, Purpose.HOLDOUT, r), self.device_ids)
        return u < self.params.holdout

    def __init__(self, params: ToplParams, seed: int, device_ids: np.ndarray, limits: Limits | None = None) -> None:
        self.params, self.seed = params, int(seed)
        self.device_ids = np.ascontiguousarray(device_ids, dtype=np.uint64)
        n = self.device_ids.size
        self.guard = Guard(self.device_ids, limits)
        self.theta = np.zeros(n)  # latest theta received (0: none)
        self.version = np.zeros(n, dtype=np.int64)
        self.last_round = np.zeros(n, dtype=np.int64)  # last round each device reported

    _ARRAYS = ("theta", "version", "last_round")

    def snapshot(self) -> dict:
        """The guard and, per device, the theta it holds, its version and the last round it reported
        (protocols.snapshot)."""
        return {**snap.header(self), "guard": self.guard.snapshot(),
                **{k: getattr(self, k).copy() for k in self._ARRAYS}}

    def restore(self, state: dict) -> None:
        snap.check_header(state, self)
        self.guard.restore(snap.field(state, "guard", dict))
        for k in self._ARRAYS:
            snap.put(getattr(self, k), state, k)

    def _report(self, r: int, rows: np.ndarray, values: np.ndarray, now: float, holdout_stage: bool
                ) -> tuple[ReportBatch | None, list[Charge]]:
        p = self.params
        idx = np.flatnonzero(rows & (self.last_round < r))
        idx = idx[self.guard.affordable(p.threshold_epsilon if holdout_stage else p.epsilon, idx)]
        if not idx.size:
            return None, []
        self.last_round[idx] = r
        sel = self.device_ids[idx]
        x = np.asarray(values, dtype=np.float64)[idx]
        key = lambda k: keyed.uniform(stream_key(self.seed, Purpose.REPORT, r, k), sel)  # noqa: E731
        if holdout_stage:
            y = numeric.sw_randomize(np.clip(x / p.max_value, 0.0, 1.0), p.threshold_epsilon, key(0), key(1))
            b = numeric.sw_b(p.threshold_epsilon)
            y = numeric.snap(y, -b, 1.0 + b, key(5))  # on a grid: float bits would leak x (numeric.snap)
            cols, eps = {"s": y}, p.threshold_epsilon
        else:
            theta = self.theta[idx]
            t = 2.0 * np.minimum(x, theta) / theta - 1.0  # truncate to [0, theta], map to [-1, 1]
            y = numeric.hm_randomize(t, p.epsilon, key(2), key(3), key(4))
            c = hm_bound(p.epsilon)
            y = numeric.snap(y, -c, c, key(6))  # on a grid: float bits would leak x (numeric.snap)
            cols = {"y": y, "v": self.version[idx].astype(np.uint32)}
            eps = p.epsilon
        return (ReportBatch(r, p.name, sel.astype(np.uint32), cols),
                [self.guard.charge(r, now, EVENT_REPORT, eps, idx)])

    answers = (CollectionRequest, Threshold)

    def admit_stage(self, msg: CollectorMessage, day: int) -> bool:
        """A threshold is taken only in a threshold round that is the current day, inside the horizon, under
        that round's version (:meth:`ToplParams.threshold_version`) and plausible."""
        p, r = self.params, msg.round
        assert isinstance(msg, Threshold)
        return (r == day and self.guard.in_horizon(r) and p.threshold_round(r)
                and msg.version == p.threshold_version(r) and p.plausible_theta(msg.theta))

    def answer(self, msg: CollectorMessage, values: np.ndarray, here: np.ndarray,
               now: float) -> tuple[ReportBatch | None, list[Charge]]:
        """A request: the holdout's SW reports in a threshold round, else HM reports of the devices holding a
        theta. A threshold: applies from its round on to the devices ``here`` holding an older version (the
        others keep theirs, and say so in ``v``), which then send HM reports unless in the holdout."""
        p, r = self.params, msg.round
        holdout = self.in_holdout(r) if p.threshold_round(r) else np.zeros(self.device_ids.size, bool)
        if isinstance(msg, Threshold):
            newer = here & (msg.version > self.version)
            stale = int(np.count_nonzero(here)) - int(np.count_nonzero(newer))
            if stale:  # the devices that received it holding this version or a newer one refuse it
                self.guard.ignore(stale)
            if not newer.any():
                return None, []
            self.theta[newer], self.version[newer] = msg.theta, msg.version
            return self._report(r, newer & ~holdout, values, now, holdout_stage=False)
        if p.threshold_round(r):
            return self._report(r, here & holdout, values, now, holdout_stage=True)
        return self._report(r, here & (self.version > 0), values, now, holdout_stage=False)


class ToplCollector(StagedCollector):
    """Collector side: holdout stage (SW + EM + threshold) in threshold rounds, then HM reports. A threshold
    round is ``idle -> holdout -> report -> idle``, any other ``idle -> report -> idle`` (protocols.staged)."""

    GRAPH = StageGraph(("holdout", "report"), {(IDLE, REQUEST): ("holdout", "report"),
                                               ("holdout", ADVANCE): ("report",), ("report", CLOSE): (IDLE,)})

    def __init__(self, params: ToplParams, n_devices: int) -> None:
        b = numeric.sw_b(params.threshold_epsilon)
        c = hm_bound(params.epsilon)
        super().__init__(params.name, n_devices, {
            "holdout": (Column("s", np.float64, low=-b, high=1 + b),),
            "report": (Column("y", np.float64, low=-c - 1e-9, high=c + 1e-9), Column("v", np.uint32, low=1))})
        self.params = params
        self.holdout, self.reports = self.stage("holdout"), self.stage("report")
        self.thetas: dict[int, float] = {}  # version -> theta
        self.history: list[tuple[int, float]] = []  # (round, theta chosen)
        self.oracle_values: np.ndarray | None = None  # method "oracle": the round's true values (reference)
        self._m: np.ndarray | None = None
        self._holdout_reports = 0
        self._pruned: float | None = None  # the share of EM's mass SW-W moved choosing this round's theta
        self.pinned: dict[int, float] = {}  # version -> theta already broadcast (by an earlier instance)

    def pin_threshold(self, version: int, theta: float) -> None:
        """A theta this collector (an earlier instance of it) already broadcast under ``version``: when that
        version's threshold round runs again (a collector resumed mid-round), the same theta is broadcast, so
        no device ever holds a version that decodes with another theta."""
        if version in self.thetas and self.thetas[version] != theta:
            raise MisuseError(f"threshold version {version} is {self.thetas[version]}, not {theta}")
        self.pinned[int(version)] = float(theta)

    def extra_snapshot(self) -> dict:
        """The thetas by version, the threshold history, the pinned thetas and the round."""
        versions = sorted(self.thetas)
        return {"round": self.round, "versions": np.array(versions, dtype=np.int64),
                "thetas": np.array([self.thetas[v] for v in versions], dtype=np.float64),
                "history_rounds": np.array([r for r, _ in self.history], dtype=np.int64),
                "history_thetas": np.array([t for _, t in self.history], dtype=np.float64),
                "pinned_versions": np.array(sorted(self.pinned), dtype=np.int64),
                "pinned_thetas": np.array([self.pinned[v] for v in sorted(self.pinned)], dtype=np.float64),
                "holdout_reports": int(self._holdout_reports),
                "pruned_share": math.nan if self._pruned is None else float(self._pruned)}

    def extra_restore(self, state: dict) -> None:
        versions = snap.array(state, "versions", np.int64, (None,))
        thetas = snap.array(state, "thetas", np.float64, versions.shape)
        if versions.tolist() != list(range(1, versions.size + 1)):
            raise snap.SnapshotError(f"topl threshold versions {versions.tolist()} are not 1..{versions.size}")
        rounds = snap.array(state, "history_rounds", np.int64, (None,))
        pinned = snap.array(state, "pinned_versions", np.int64, (None,))
        self.thetas = dict(zip(versions.tolist(), thetas.tolist()))
        history = snap.array(state, "history_thetas", np.float64, rounds.shape)
        self.history = list(zip(rounds.tolist(), history.tolist()))
        self.pinned = dict(zip(pinned.tolist(), snap.array(state, "pinned_thetas", np.float64, pinned.shape).tolist()))
        self.round = snap.field(state, "round", int)
        self._holdout_reports = snap.field(state, "holdout_reports", int)
        pruned = snap.field(state, "pruned_share", float) if "pruned_share" in state else math.nan  # older journals
        self._pruned = None if math.isnan(pruned) else pruned
        if state.get("open_stage") and not (self.params.threshold_round(self.round) and self.history
                                            and self.history[-1][0] == self.round):
            raise snap.SnapshotError("topl snapshot with the report stage open but no threshold chosen this round")

    def boundary_message(self, stage: str, deadline: float) -> Threshold:
        """The round's threshold, which opened the report stage."""
        version = len(self.thetas)
        return Threshold(round=self.round, protocol=self.name, theta=self.thetas[version], version=version,
                         deadline=deadline)

    def first_stage(self, round_: int) -> str:
        return "holdout" if self.params.threshold_round(round_) else "report"

    def check_batch(self, stage: str, batch: ReportBatch) -> None:
        if stage == "report" and batch.columns.get("v") is not None:
            v = batch.columns["v"]
            if v.size and (int(v.max()) not in self.thetas or int(v.min()) < 1):
                raise ProtocolError("report names a threshold version that was never broadcast")

    def density(self, s: np.ndarray) -> np.ndarray:
        """The value density over ``bins`` bins of [0, max_value] from SW reports (EM; SW-W or EMS)."""
        return self._density(s)[0]

    def _density(self, s: np.ndarray) -> tuple[np.ndarray, float | None]:
        """:meth:`density` and the share of EM's mass SW-W's pruning moved (None for EMS): on data that is not
        skewed towards 0 the pruning cuts inside the support (numeric.sw_w_prune), and this says how much."""
        p = self.params
        if self._m is None:
            self._m = numeric.sw_transition_matrix(p.threshold_epsilon, p.bins, p.bins)
        b = numeric.sw_b(p.threshold_epsilon)
        counts = np.histogram(s, bins=p.bins, range=(-b, 1 + b))[0].astype(np.float64)
        theta, _ = numeric.em_estimate(counts, self._m, smoothing=p.method == "ems")
        if p.method != "sw-w":
            return theta, None
        pruned = numeric.sw_w_prune(theta)
        return pruned, float(np.abs(pruned - theta).sum() / 2 / theta.sum())

    def on_stage_closed(self, stage: str, result: RoundResult, deadline: float) -> tuple[str, Threshold]:
        """The holdout closed: estimate the density, choose theta (a pinned one if resumed) and broadcast it."""
        p = self.params
        assert isinstance(result.estimate, dict)  # a Stage's reports by column
        self._holdout_reports = result.reports
        moved: float | None = None  # no SW-W pruning this round (method, or no holdout report)
        if p.method == "oracle" and self.oracle_values is not None:
            dens = np.histogram(self.oracle_values, bins=p.bins, range=(0, p.max_value))[0].astype(np.float64)
        elif result.reports:
            dens, moved = self._density(result.estimate["s"])
        else:
            dens = np.ones(p.bins)
        version = len(self.thetas) + 1
        theta = self.pinned.get(version)
        self._pruned = moved if theta is None else None  # a pinned theta came from another holdout's density
        if theta is None:
            theta = choose_threshold(dens, p.max_value, p.epsilon, p.rounds, self.n_devices, p.objective, p.integer)
        self.thetas[version] = theta
        self.history.append((self.round, theta))
        return "report", self.boundary_message("report", deadline)

    def finish(self, stage: str, result: RoundResult) -> RoundResult:
        """The HM reports closed: each decoded with the theta of the version it names, scaled to the total."""
        assert isinstance(result.estimate, dict)  # a Stage's reports by column
        y, v = result.estimate["y"], result.estimate["v"].astype(np.int64)
        if result.reports:
            by_version = np.array([0.0] + [self.thetas[k] for k in range(1, len(self.thetas) + 1)])
            theta = by_version[v]
            est = self.n_devices * float(((y + 1.0) * theta / 2.0).mean())  # back to [0, theta], unbiased
        else:
            est = math.nan
        info = {"theta": self.history[-1][1] if self.history else math.nan,
                "holdout_reports": self._holdout_reports, "pruned_share": self._pruned}
        self._holdout_reports, self._pruned = 0, None
        return RoundResult(round=self.round, estimate=est, reports=result.reports, info=info)


if TYPE_CHECKING:  # mypy: the descriptor, and through it the device and collector sides, match protocols.base
    _ToplParams: type[ProtocolParams] = ToplParams
