"""THRESH (Joseph, Roth, Ullman, Waggoner, NeurIPS 2018, Algorithms 1-3): devices vote on whether the
population mean changed; the collector runs a global update only when enough vote; per-device caps bound
the privacy spent whatever the collector does. ALGORITHMS.md section 3.

Each device receives a private bit per round; rounds form T epochs of l rounds. At the end of epoch t:
1. VOTE (device): p_t = its epoch mean; j* = the largest j in {-1, 0, ..., floor(log2 T)} with
   |p_t - p_f| > tau_j (p_f: its mean at the last global update, -1 before any); it votes yes iff
   c_V < eps/4 and 2^(floor(log2 T) - j*) divides t; a yes adds a to c_V and sends Bernoulli(e^a/(e^a + 1)),
   anything else sends Bernoulli(1/(e^a + 1)).
2. The collector updates iff the mean vote exceeds 1/(e^a + 1) + sqrt(ln(10 T/delta)/(2 n)) and broadcasts
   the decision.
3. EST (device), on an update: if c_E < eps/4, add b and send Bernoulli((1 + p_t (e^b - 1))/(e^b + 1)); else,
   and on every epoch without an update, a data-free Bernoulli(1/(e^b + 1)). The collector averages
   (y (e^b + 1) - 1)/(e^b - 1), or carries the last estimate forward.

Privacy (Theorem 4.1), exactly: a vote's distribution differs between two data sequences only in an epoch
where one votes yes and the other does not (loss a), and each sequence has at most ceil(eps/(4a)) yes votes,
in epochs of its own: 2a ceil(eps/(4a)). Whether an estimate is truthful depends only on c_E and the
collector's decisions, which are the same for both sequences given the transcript so far, so both send
truthful estimates in the same epochs, each costing at most b: b ceil(eps/(4b)). A device's transcript is
therefore eps_total-LDP against any collector, adaptive or not, with
eps_total = 2a ceil(eps/(4a)) + b ceil(eps/(4b)) <= 3 eps/4 + 2a + b: 3 eps/4 when eps/(4a) and eps/(4b) are
integers (the paper's proof bounds it by eps), above eps when a and b are large and the caps do not divide
evenly. ``cap_rule = "strict"`` (spend only while c + a <= eps/4) makes it <= 3 eps/4 always. The tests
check this against an exact enumeration of transcripts.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import numba as nb
import numpy as np

from protocols import keyed
from protocols.base import ProtocolError, RoundResult, check_params
from protocols.collecting import Column, ReportCollector
from protocols.epochs import EpochMeans
from protocols.keyed import Purpose, stream_key
from protocols.ledger import Charge
from protocols.messages import CollectionRequest, Decision, ReportBatch
from protocols.wire import bits as wire_bits

THRESH = "thresh"
THRESH_VOTE = "thresh_vote"
THRESH_ESTIMATE = "thresh_estimate"
THRESH_DUMMY = "thresh_dummy"  # a data-free message, recorded at zero cost


def derived_constants(n: int, groups: int, smallest: int, epochs: int, epoch_length: int, epsilon: float,
                      delta: float) -> dict[str, float]:
    """The paper's a, b and threshold scale from (n, M, L, T, l, eps, delta) (ALGORITHMS.md section 3; log base 2).

    a = 4 sqrt(2 n ln(12 M T/delta)) / (L - (3/sqrt 2) sqrt(n ln(12 M T/delta)))
    b = sqrt(ln(12 T/delta)/n) / (floor(log T) sqrt(ln(12 n T/delta)/(2 l)) - sqrt(ln(12 T/delta)/(2 n)))
    tau_j = 2 (j + 1) sqrt(ln(12 n T/delta)/(2 l)), j = -1, ..., floor(log T)
    Either denominator can be <= 0 for small populations: the constant is then reported as infinite.
    """
    lm = math.log(12 * groups * epochs / delta)
    denom_a = smallest - 3 / math.sqrt(2) * math.sqrt(n * lm)
    a = 4 * math.sqrt(2 * n * lm) / denom_a if denom_a > 0 else math.inf
    lt = math.log(12 * epochs / delta)
    unit = math.sqrt(math.log(12 * n * epochs / delta) / (2 * epoch_length))
    levels = int(math.floor(math.log2(epochs))) if epochs >= 1 else 0
    denom_b = levels * unit - math.sqrt(lt / (2 * n))
    b = math.sqrt(lt / n) / denom_b if denom_b > 0 else math.inf
    return {"a": a, "b": b, "tau_unit": unit, "levels": levels}


def theorem_4_3_bound(n: int, epochs: int, epoch_length: int, delta: float) -> float:
    """Accuracy bound of Theorem 4.3: 4 (floor(log T) + 2) sqrt(ln(12 n T/delta)/(2 l))."""
    levels = int(math.floor(math.log2(epochs)))
    return 4 * (levels + 2) * math.sqrt(math.log(12 * n * epochs / delta) / (2 * epoch_length))


@dataclass(frozen=True)
class ThreshParams:
    """THRESH parameters. ``devices``, ``groups``, ``smallest_group`` and ``epochs`` describe the population
    and run; ``a``, ``b`` (None: derived) and ``tau_scale`` override the paper's constants."""

    name: str
    epsilon: float
    delta: float
    epoch_length: int
    epochs: int
    devices: int
    groups: int = 1
    smallest_group: int = 0
    a: float | None = None
    b: float | None = None
    tau_scale: float = 1.0
    cap_rule: str = "paper"
    behavior: str = "honest"  # collector behavior: "honest" or "always_update" (an adversary, for audits)
    max_value: float = 1.0
    derived: dict = field(default_factory=dict, compare=False, repr=False)
    warnings: list = field(default_factory=list, compare=False, repr=False)

    kind = "epoch"

    def __post_init__(self) -> None:
        check_params(self.epsilon, self.max_value)
        if not 0 < self.delta < 1:
            raise ValueError(f"protocol.delta must be in (0, 1), got {self.delta}")
        if self.epoch_length < 1 or self.epochs < 1:
            raise ValueError("protocol.epoch_length and the number of epochs must be >= 1")
        if self.cap_rule not in ("paper", "strict"):
            raise ValueError(f"protocol.cap_rule must be 'paper' or 'strict', got {self.cap_rule!r}")
        if self.behavior not in ("honest", "always_update"):
            raise ValueError(f"collector.behavior must be 'honest' or 'always_update', got {self.behavior!r}")
        smallest = self.smallest_group or self.devices
        object.__setattr__(self, "derived", derived_constants(self.devices, self.groups, smallest, self.epochs,
                                                              self.epoch_length, self.epsilon, self.delta))

    # ---------------------------------------------------------------- constants actually used
    @property
    def vote_noise(self) -> float:
        return self.a if self.a is not None else self.derived["a"]

    @property
    def estimate_noise(self) -> float:
        return self.b if self.b is not None else self.derived["b"]

    @property
    def levels(self) -> int:
        return int(self.derived["levels"])

    @property
    def taus(self) -> np.ndarray:
        """tau_j for j = -1, 0, ..., floor(log T) (tau_-1 = 0), times tau_scale."""
        j = np.arange(-1, self.levels + 1)
        return 2 * (j + 1) * self.derived["tau_unit"] * self.tau_scale

    @property
    def vote_threshold(self) -> float:
        a = self.vote_noise
        return 1 / (math.exp(a) + 1) + math.sqrt(math.log(10 * self.epochs / self.delta) / (2 * self.devices))

    @property
    def cap(self) -> float:
        return self.epsilon / 4

    @property
    def guarantee(self) -> float:
        """The exact LDP level of a device's whole transcript against any collector (module docstring)."""
        a, b, cap = self.vote_noise, self.estimate_noise, self.cap
        if self.cap_rule == "strict":
            return 2 * a * math.floor(cap / a + 1e-12) + b * math.floor(cap / b + 1e-12)
        return 2 * a * math.ceil(cap / a - 1e-12) + b * math.ceil(cap / b - 1e-12)

    @property
    def round_epsilon(self) -> float:
        return max(self.vote_noise, self.estimate_noise)

    def problems(self) -> list[str]:
        """Why the derived parameters cannot work as the paper intends (empty: feasible)."""
        out = []
        n, lm = self.devices, math.log(12 * self.groups * self.epochs / self.delta)
        need = (3 / math.sqrt(2) + math.sqrt(32) / self.epsilon) * math.sqrt(n * lm)
        smallest = self.smallest_group or n
        if smallest <= need:
            out.append(f"Assumption 4.2 fails: the smallest group has {smallest:,} devices, it needs more than "
                       f"(3/sqrt 2 + sqrt 32/eps) sqrt(n ln(12 M T/delta)) = {need:,.0f}")
        a, b = self.vote_noise, self.estimate_noise
        if not math.isfinite(a) or a >= self.cap:
            out.append(f"vote noise a = {a:.4g} is not below the cap eps/4 = {self.cap:.4g}: at most one vote")
        if not math.isfinite(b) or b >= self.cap:
            out.append(f"estimate noise b = {b:.4g} is not below the cap eps/4 = {self.cap:.4g}")
        if self.taus[1] >= 1:
            out.append(f"the lowest threshold tau_0 = {self.taus[1]:.3g} is >= 1: an epoch mean can never move that "
                       f"far, so no device would ever vote (set protocol.tau_scale below {1 / self.taus[1]:.3g})")
        return out

    def make_devices(self, seed: int, device_ids: np.ndarray) -> "ThreshDevices":
        return ThreshDevices(self, seed, device_ids)

    def make_collector(self, n_devices: int) -> "ThreshCollector":
        return ThreshCollector(self, n_devices)

    def truth(self, values: np.ndarray) -> float:
        return float(values.mean())

    def estimate_sd(self, values: np.ndarray, reports: int) -> float:
        """sd of an update's estimate: the randomized response of the local means (each in [0, 1]):
        Var = ((e^b + 1)/(e^b - 1))^2 mean(q (1 - q)) / r, q = (1 + p (e^b - 1))/(e^b + 1)."""
        e = math.exp(self.estimate_noise)
        v = np.asarray(values, dtype=np.float64)
        c0, c1 = 1 / (e + 1), (e - 1) / (e + 1)  # q = c0 + c1 p, so mean q(1 - q) needs mean p and mean p^2
        m1, m2 = float(v.mean()), float(np.dot(v, v)) / v.size
        mean_q1q = c0 * (1 - c0) + c1 * (1 - 2 * c0) * m1 - c1 * c1 * m2
        return (e + 1) / (e - 1) * math.sqrt(max(mean_q1q, 0.0) / reports)


# ------------------------------------------------------------------------------------------- device side
@nb.njit(cache=True)
def _vote_kernel(diff, taus, levels, t, cap_ok, out_yes):
    for i in range(diff.shape[0]):
        jstar = -2  # no threshold exceeded (difference 0)
        for j in range(taus.shape[0] - 1, -1, -1):
            if diff[i] > taus[j]:
                jstar = j - 1
                break
        out_yes[i] = cap_ok[i] and jstar >= 0 and t % (1 << (levels - jstar)) == 0


class ThreshDevices(EpochMeans):
    """Device side for a cohort: epoch sums of private bits, the reference mean of the last update, and the
    caps c_V and c_E. Refuses repeats, other epochs and incomplete epochs, whatever the collector sends."""

    def __init__(self, params: ThreshParams, seed: int, device_ids: np.ndarray) -> None:
        self.params, self.seed = params, int(seed)
        self.device_ids = np.ascontiguousarray(device_ids, dtype=np.uint64)
        n = self.device_ids.size
        self.cV = np.zeros(n)
        self.cE = np.zeros(n)
        self.reference = np.full(n, -1.0)  # p_i^{f(t)}; -1 before any global update
        self.init_epochs(n, params.epoch_length)
        self.voted_epoch = 0
        self.estimated_epoch = 0

    def _spendable(self, spent: np.ndarray, step: float) -> np.ndarray:
        cap = self.params.cap
        return spent + step <= cap + 1e-12 if self.params.cap_rule == "strict" else spent < cap - 1e-12

    def vote_probabilities(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        """(P[vote = 1], voted yes) for epoch t from the current state (no state change)."""
        p = self.params
        a = p.vote_noise
        yes = np.empty(self.device_ids.size, dtype=np.bool_)
        _vote_kernel(np.abs(self.current - self.reference), p.taus, p.levels, t, self._spendable(self.cV, a), yes)
        e = math.exp(a)
        return np.where(yes, e / (e + 1), 1 / (e + 1)), yes

    def estimate_probabilities(self, update: bool) -> tuple[np.ndarray, np.ndarray]:
        """(P[estimate bit = 1], truthful) for the last complete epoch (no state change)."""
        p = self.params
        e = math.exp(p.estimate_noise)
        send = self._spendable(self.cE, p.estimate_noise) if update else np.zeros(self.device_ids.size, bool)
        return np.where(send, (1 + self.current * (e - 1)) / (e + 1), 1 / (e + 1)), send

    def respond(self, msg: CollectionRequest | Decision, day: int, values: np.ndarray, now: float,
                present: np.ndarray | None = None) -> tuple[ReportBatch | None, list[Charge]]:
        """Votes or estimates of the devices that observed the whole epoch and are present now."""
        p = self.params
        t = msg.round
        if msg.protocol != p.name or t != self.complete_epoch:
            return None, []
        rows = self.valid if present is None else self.valid & present
        if isinstance(msg, CollectionRequest):
            if t <= self.voted_epoch:
                return None, []
            self.voted_epoch = t
            q, yes = self.vote_probabilities(t)
            yes &= rows
            self.cV[yes] += p.vote_noise
            bits = keyed.uniform(stream_key(self.seed, Purpose.VOTE, t), self.device_ids) < q
            charges = [Charge(t, now, THRESH_VOTE, p.vote_noise, self.device_ids[yes])]
            ids = self.device_ids[rows]
            return ReportBatch(t, p.name, ids.astype(np.uint32), {"vote": wire_bits(bits[rows])}), charges
        if t <= self.estimated_epoch or t > self.voted_epoch:
            return None, []  # one estimate an epoch, and only after that epoch's vote
        self.estimated_epoch = t
        q, send = self.estimate_probabilities(msg.update)
        send &= rows
        self.cE[send] += p.estimate_noise
        if msg.update:
            self.reference = np.where(self.valid, self.current, self.reference)  # f(t) = t
        bits = keyed.uniform(stream_key(self.seed, Purpose.ESTIMATE, t), self.device_ids) < q
        ids = self.device_ids[rows]
        charges = [Charge(t, now, THRESH_ESTIMATE, p.estimate_noise, self.device_ids[send])]
        if not msg.update:
            charges.append(Charge(t, now, THRESH_DUMMY, 0.0, ids, cumulative=False))
        return ReportBatch(t, p.name, ids.astype(np.uint32), {"est": wire_bits(bits[rows])}), charges


# ------------------------------------------------------------------------------------------- collector side
class _Stage(ReportCollector):
    """One of THRESH's two report stages: a bit per device, kept with its own transcript."""

    def __init__(self, name: str, column: str, n_devices: int) -> None:
        self.name, self.columns = name, (Column(column, np.uint8, high=1),)
        self.column = column
        super().__init__(n_devices)

    def estimate(self, reports: dict[str, np.ndarray]) -> float:
        return float(reports[self.column].mean())


class ThreshCollector:
    """Collector side: vote stage, decision, estimate stage; the estimate is carried forward without update."""

    def __init__(self, params: ThreshParams, n_devices: int) -> None:
        self.params, self.name = params, params.name
        self.n_devices = int(n_devices)
        self.votes = _Stage(params.name, "vote", n_devices)
        self.estimates = _Stage(params.name, "est", n_devices)
        self.stage: _Stage | None = None
        self.epoch = 0
        self.estimate = math.nan  # no estimate before the first global update
        self.updates: list[int] = []
        self._vote_mean = math.nan
        self._update = False
        self._vote_reports = 0

    def request(self, epoch: int, deadline: float) -> CollectionRequest:
        self.epoch = epoch
        self.stage = self.votes
        return self.votes.request(epoch, deadline)

    def receive(self, batch: ReportBatch) -> int:
        if self.stage is None:
            raise ProtocolError("no stage is open")
        return self.stage.receive(batch)

    def advance(self, deadline: float) -> Decision | None:
        """At a stage's deadline: after the votes, decide and ask for estimates; after the estimates, done."""
        if self.stage is self.votes:
            res = self.votes.close_round()
            self._vote_mean, self._vote_reports = res.estimate, res.reports
            honest = res.reports > 0 and res.estimate > self._threshold(res.reports)
            self._update = honest or self.params.behavior == "always_update"
            self.stage = self.estimates
            self.estimates.request(self.epoch, deadline)
            return Decision(round=self.epoch, protocol=self.name, update=self._update, deadline=deadline)
        return None

    def _threshold(self, reports: int) -> float:
        """The update test on the votes that arrived (lost votes: the test uses the count received)."""
        a = self.params.vote_noise
        return 1 / (math.exp(a) + 1) + math.sqrt(math.log(10 * self.params.epochs / self.params.delta) / (2 * reports))

    def close_round(self) -> RoundResult:
        res = self.estimates.close_round()
        self.stage = None
        if self._update:
            self.updates.append(self.epoch)
            e = math.exp(self.params.estimate_noise)
            if res.reports:
                self.estimate = (res.estimate * (e + 1) - 1) / (e - 1)
        return RoundResult(round=self.epoch, estimate=self.estimate, reports=res.reports,
                           info={"global_update": self._update, "vote_mean": self._vote_mean,
                                 "votes": self._vote_reports})

    def transcript_digest(self) -> str:
        return hashlib.sha256((self.votes.transcript_digest() + self.estimates.transcript_digest()).encode()
                              ).hexdigest()
