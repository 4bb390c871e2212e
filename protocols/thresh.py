"""THRESH (Joseph, Roth, Ullman, Waggoner, NeurIPS 2018, Algorithms 1-3): devices vote on whether the
population mean changed; the collector runs a global update only when enough vote; per-device caps bound
the privacy spent whatever the collector does. docs/thresh_accounting.md explains the accounting.

Each device receives a private bit per round; rounds form T epochs of l rounds. At the end of epoch t:
1. VOTE (device): p_t = its epoch mean; j* = the largest j in {-1, 0, ..., L = floor(log2 T)} with
   |p_t - p_f| > tau_j (p_f: its mean at the last global update it took part in, -1 before any); it votes
   yes iff its vote cap is open (paper rule c_V < eps/4, strict rule c_V + a <= eps/4) and 2^(L - j*)
   divides t; a yes adds a to c_V and sends Bernoulli(e^a/(e^a + 1)), anything else Bernoulli(1/(e^a + 1)).
2. The collector updates iff the mean vote exceeds 1/(e^a + 1) + sqrt(ln(10 T/delta)/(2 n)) and broadcasts
   the decision.
3. EST (device), on an update: if its estimate cap is open, add b to c_E and send
   Bernoulli((1 + p_t (e^b - 1))/(e^b + 1)); otherwise, and on every epoch without an update, the data-free
   Bernoulli(1/(e^b + 1)). The collector averages (y (e^b + 1) - 1)/(e^b - 1), or carries the last estimate.

Privacy accounting (Theorem 4.1, made exact; docs/thresh_accounting.md). Fix the collector's decisions
(enough against an adaptive collector too: a transcript's probability factors the same way). A device's
state (c_V, c_E, p_f) is then a function of its data, and its messages are independent given the state.
Two data sequences give different vote distributions only in epochs where one votes yes and the other no
(log-ratio a each); whether an estimate is truthful depends only on c_E and the decisions, the same for
both, and a truthful estimate costs at most b. So a "no" sent while the cap is open costs as much as a
"yes". With K_V (K_E) the yes votes (truthful estimates) the cap rule allows, the ledger books one vote
reserve 2a (K_V - f) (``THRESH_VOTE_RESERVE``) at the first epoch whose vote depends on the data (f: the
yes votes cast before, all forced), nothing for later votes, and b per truthful estimate
(``THRESH_ESTIMATE``). A vote depends on the data iff the device sends it, its cap is open, and some epoch
means give yes and others no against its reference (-1, or an earlier mean;
:meth:`ThreshDevices.vote_depends_on_data`). With tau_L < 1 every vote against -1 is a forced yes. A device
takes the update of epoch t as its reference only if it voted in t and hears the decision. The exact worst
case (:attr:`ThreshParams.total_epsilon`) is 2a K_V + b K_E when tau_L >= 1 and 2a (K_V - 1) + b K_E when
tau_L < 1. ``Limits`` (protocols.guard): epochs past the horizon are refused; a device that cannot afford
the reserve or an estimate within the budget sends the data-free message instead. Costs and spend depend
on the decisions, the epochs and the device's presence, never on its bits, so that refusal is data-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Self, overload

import numba as nb
import numpy as np

from protocols import config
from protocols import keyed
from protocols import snapshot as snap
from protocols.base import ProtocolParams, RoundResult, check_params
from protocols.collecting import Column
from protocols.device import GuardedDevices
from protocols.epochs import EpochMeans
from protocols.guard import Guarantee, Guard, Limits
from protocols.keyed import Purpose, stream_key
from protocols.ledger import Charge
from protocols.messages import CollectionRequest, CollectorMessage, Decision, ReportBatch
from protocols.round_mechanism import NoRoundMechanism
from protocols.staged import StageGraph, StagedCollector
from protocols.wire import bits as wire_bits

THRESH = "thresh"
THRESH_VOTE_RESERVE = "thresh_vote_reserve"  # 2a (K_V - f), once, at a device's first data-dependent vote
THRESH_ESTIMATE = "thresh_estimate"  # b per truthful estimate
THRESH_DUMMY = "thresh_dummy"  # a data-free estimate, recorded at zero cost (not cumulative)


def derived_constants(n: int, groups: int, smallest: int, epochs: int, epoch_length: int, epsilon: float,
                      delta: float) -> dict[str, float]:
    """The paper's a, b and threshold scale from (n, M, L, T, l, eps, delta) (Algorithm 1, lines 4-5; log base 2).

    a = 4 sqrt(2 n ln(12 M T/delta)) / (L - (3/sqrt 2) sqrt(n ln(12 M T/delta)))
    b = 2 sqrt(ln(12 T/delta)/(2 n)) / (floor(log T) sqrt(ln(12 n T/delta)/(2 l)) - sqrt(ln(12 T/delta)/(2 n)))
    tau_j = 2 (j + 1) sqrt(ln(12 n T/delta)/(2 l)), j = -1, ..., floor(log T)
    b's numerator follows Algorithm 1, line 5: 2 sqrt(ln(12T/delta)/(2n)) = sqrt(2 ln(12T/delta)/n), sqrt 2
    above the sqrt(ln(12T/delta)/n) used here before. It is what Theorem 4.3's proof needs: the randomized
    response average deviates by coth(b/2) sqrt(ln(12T/delta)/(2n)) ~ (2/b) sqrt(ln(12T/delta)/(2n)), and
    b sets that equal to the denominator. Either value is private: the caps bound the total at b K_E.
    Either denominator can be <= 0 for small populations: the constant is then reported as infinite.
    """
    lm = math.log(12 * groups * epochs / delta)
    denom_a = smallest - 3 / math.sqrt(2) * math.sqrt(n * lm)
    a = 4 * math.sqrt(2 * n * lm) / denom_a if denom_a > 0 else math.inf
    lt = math.log(12 * epochs / delta)
    unit = math.sqrt(math.log(12 * n * epochs / delta) / (2 * epoch_length))
    levels = int(math.floor(math.log2(epochs))) if epochs >= 1 else 0
    denom_b = levels * unit - math.sqrt(lt / (2 * n))
    b = 2 * math.sqrt(lt / (2 * n)) / denom_b if denom_b > 0 else math.inf
    return {"a": a, "b": b, "tau_unit": unit, "levels": levels}


def theorem_4_3_bound(n: int, epochs: int, epoch_length: int, delta: float) -> float:
    """Accuracy bound of Theorem 4.3: 4 (floor(log T) + 2) sqrt(ln(12 n T/delta)/(2 l))."""
    levels = int(math.floor(math.log2(epochs)))
    return 4 * (levels + 2) * math.sqrt(math.log(12 * n * epochs / delta) / (2 * epoch_length))


class VotingCaps:
    """THRESH's voting rule, caps and guarantee, shared by every protocol that votes on change under them
    (THRESH, HeavyTHRESH): the constants actually used (a, b, tau_j), the cap rule, the cap counts K_V and
    K_E, and the whole-transcript guarantee 2a (K_V - f) + b K_E, f = 1 when a device's first vote is a
    forced yes (its ``_forced``). A frozen dataclass with the fields below inherits it."""

    #: estimates.csv's per-round columns beyond the common ones (VotingCollector.decision_info): round info
    #: key, value when missing
    round_columns: ClassVar[tuple[tuple[str, Any], ...]] = (
        ("global_update", False), ("vote_mean", None), ("votes", 0), ("vote_threshold", None))

    name: str
    epsilon: float
    delta: float
    epoch_length: int
    epochs: int
    devices: int
    groups: int
    smallest_group: int | None
    a: float | None
    b: float | None
    tau_scale: float
    cap_rule: str
    behavior: str
    derived: dict
    warnings: list
    label: ClassVar[str]  # the protocol's name in messages

    @property
    def _forced(self) -> int:
        """1 when a device's first vote is a forced yes (it then carries no data), else 0."""
        raise NotImplementedError(f"{type(self).__name__}._forced")

    @property
    def guarantee_derivation(self) -> str:
        """The guarantee's formula with the run's numbers, in one line."""
        raise NotImplementedError(f"{type(self).__name__}.guarantee_derivation")

    #: why no device would vote when the lowest threshold is >= 1 (the protocol's words, for :meth:`problems`)
    tau_too_high: ClassVar[str]

    def check_caps(self) -> None:
        """The checks shared by every voting protocol's parameters (ValueError naming the bad one)."""
        if not 0 < self.delta < 1:
            raise ValueError(f"protocol.delta must be in (0, 1), got {self.delta}")
        if self.epoch_length < 1 or self.epochs < 1:
            raise ValueError("protocol.epoch_length and the number of epochs must be >= 1")
        if self.cap_rule not in ("paper", "strict"):
            raise ValueError(f"protocol.cap_rule must be 'paper' or 'strict', got {self.cap_rule!r}")
        if self.behavior not in ("honest", "always_update"):
            raise ValueError(f"collector.behavior must be 'honest' or 'always_update', got {self.behavior!r}")

    def problems(self) -> list[str]:
        """Why the derived constants cannot work as the paper intends (empty: feasible): Assumption 4.2 on the
        smallest group, vote and estimate noise below the cap eps/4, and a lowest threshold below 1."""
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
            out.append(f"the lowest threshold tau_0 = {self.taus[1]:.3g} is >= 1: {self.tau_too_high} "
                       f"(set protocol.tau_scale below {1 / self.taus[1]:.3g})")
        return out

    def updates_and_caps(self, rounds: list, reserve: np.ndarray, estimate_spend: np.ndarray) -> dict:
        """The run summary's updates (how many, which epochs) and caps: the share of devices that booked a vote
        reserve (their first data-dependent vote), the share whose estimate cap is reached (K_E truthful
        estimates), the largest reserve and the largest estimate spend, from the ledger's spend by reason."""
        full = self.estimate_noise * self.estimate_cap_count
        return {
            "updates": int(sum(bool(r.info.get("global_update")) for r in rounds)),
            "update_epochs": [r.round for r in rounds if r.info.get("global_update")],
            "caps": {"cap": self.cap, "vote_cap_count": self.vote_cap_count,
                     "estimate_cap_count": self.estimate_cap_count,
                     "vote_reserve_booked": float(np.mean(reserve > 0)) if reserve.size else 0.0,
                     "estimate_cap_reached": (float(np.mean(estimate_spend >= full - 1e-9))
                                              if estimate_spend.size else 0.0),
                     "vote_reserve_max": float(reserve.max(initial=0.0)),
                     "estimate_spend_max": float(estimate_spend.max(initial=0.0))}}

    def round_mechanism(self, round_: int = 1) -> NoRoundMechanism:
        """Whether an epoch's vote or estimate depends on the data at all is decided by the caps, the reference
        and the collector's decisions, and the transcript is accounted as a whole (at most K_V differing votes
        per side and K_E truthful estimates: total_epsilon). A PLD over those capped messages would need
        composition with adaptively chosen, capped mechanisms (a privacy filter), not a fixed per-epoch
        mechanism composed T times; not done here."""
        return NoRoundMechanism("whole-transcript accounting: which epochs carry data depends on the caps and the "
                                "collector's decisions, so there is no fixed per-epoch mechanism to compose "
                                "(the exact bound is privacy.guarantee)")

    @classmethod
    def from_voting_table(cls, name: str, table: "config.Table", ctx: "config.Context",
                          own: Callable[["config.Table"], dict[str, Any]] | None = None) -> Self:
        """Parameters from a [protocol] table: the keys every voting protocol reads (epsilon, delta,
        epoch_length, a, b, tau_scale, cap_rule), the population and the collector's behavior from ``ctx``, and
        the protocol's other fields read by ``own`` (after epoch_length, so that the first bad key named is
        the same as ever). Infeasible derived constants go through :meth:`feasible`: explicit when a, b or
        tau_scale is given."""
        epsilon = config.epsilon(table, total=True)
        rounds = ctx.rounds
        length = table.get("epoch_length", int, check=lambda v: 1 <= v <= rounds and rounds % v == 0,
                           what=f"a divisor of rounds ({rounds})")
        fields = own(table) if own is not None else {}
        overrides = {k: config.optional_epsilon(table, k) for k in ("a", "b")}  # the noise of a vote, an estimate
        tau_scale = table.get("tau_scale", float, None, check=config.positive, what="> 0")
        make: Any = cls  # a frozen dataclass deriving from this class
        params = make(
            name=name, epsilon=epsilon,
            delta=table.get("delta", float, 0.1, check=lambda v: 0 < v < 1, what="a number in (0, 1)"),
            epoch_length=length, epochs=rounds // length, devices=ctx.devices, groups=ctx.groups,
            smallest_group=ctx.smallest_group, a=overrides["a"], b=overrides["b"],
            tau_scale=1.0 if tau_scale is None else tau_scale,
            cap_rule=table.get("cap_rule", str, "paper", check=lambda v: v in ("paper", "strict"),
                               what='"paper" or "strict"'),
            behavior="always_update" if ctx.behavior == "always_update" else "honest", **fields)
        explicit = tau_scale is not None or any(v is not None for v in overrides.values())
        return params.feasible(table, explicit)

    def feasible(self, table: "config.Table", explicit: bool) -> Self:
        """These parameters parsed from ``table``, their problems (:meth:`problems`) kept as warnings; an error
        naming them when the constants are all derived (``explicit``: a, b or tau_scale given) unless the table
        sets allow_infeasible."""
        allow = table.get("allow_infeasible", bool, False)
        problems = self.problems()
        if problems and not (explicit or allow):
            raise table.error(f"protocol: {self.label}'s derived constants are infeasible for this population:\n"
                              "  - " + "\n  - ".join(problems) + "\nSet protocol.a, protocol.b and/or "
                              "protocol.tau_scale (or allow_infeasible = true) to run anyway.")
        self.warnings.extend(problems)
        return self

    #: the collector behaviors this protocol implements beyond the common ones (scenarios' [collector] behavior)
    collector_behaviors = ("always_update",)

    def broadcast_stages(self, t: int) -> int:
        """Collector broadcasts in each epoch: the vote request, then the decision (estimates)."""
        return 2

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

    def threshold_for(self, votes: int) -> float:
        """The update test's threshold on the mean of ``votes`` votes (Joseph et al. 2018, Algorithm 1): the
        randomized response's no-change mean 1/(e^a + 1) plus the deviation sqrt(ln(10T/delta) / (2 votes))."""
        return 1 / (math.exp(self.vote_noise) + 1) + math.sqrt(math.log(10 * self.epochs / self.delta) / (2 * votes))

    @property
    def vote_threshold(self) -> float:
        """The threshold when every device's vote arrives (:meth:`threshold_for` the population); an epoch
        whose votes were lost or withheld is tested at the threshold for the votes it received (its round
        record's ``vote_threshold``)."""
        return self.threshold_for(self.devices)

    @property
    def cap(self) -> float:
        return self.epsilon / 4

    @overload
    def spendable(self, spent: np.ndarray, step: float) -> np.ndarray: ...

    @overload
    def spendable(self, spent: float, step: float) -> bool: ...

    def spendable(self, spent: np.ndarray | float, step: float) -> np.ndarray | bool:
        """Whether a cap with ``spent`` so far is open for another ``step`` (paper: c < eps/4; strict:
        c + step <= eps/4)."""
        if self.cap_rule == "strict":
            return spent + step <= self.cap + 1e-12
        return spent < self.cap - 1e-12

    def cap_count(self, step: float) -> int:
        """K: how many increments of ``step`` the cap rule allows, counted with the devices' own arithmetic
        (repeated float addition): K_V for a, K_E for b; ceil(eps/(4 step)) under the paper's rule, floor
        under the strict one."""
        if not step < math.inf:
            return 1 if self.spendable(0.0, step) else 0
        n = int(self.cap / step) + 3
        spent = np.concatenate(([0.0], np.cumsum(np.full(n, step))))  # sequential sums, as the devices add
        return int(np.argmin(self.spendable(spent, step)))

    @property
    def vote_cap_count(self) -> int:
        return self.cap_count(self.vote_noise)

    @property
    def estimate_cap_count(self) -> int:
        return self.cap_count(self.estimate_noise)

    def guarantee(self, horizon: int | None = None) -> Guarantee:
        """The shared per-run record (protocols.guard.Guarantee) of :attr:`total_epsilon`; it does not depend on
        the horizon: the caps bound every device's ledger however many epochs the run has."""
        return Guarantee(self.total_epsilon, self.guarantee_derivation,
                         scope="eps-LDP of a device's whole transcript against any collector, adaptive or not "
                               "(exact worst case: vote reserve + truthful estimates)")

    @property
    def total_epsilon(self) -> float:
        """The LDP level of a device's whole transcript against any collector, adaptive or not (module
        docstring): 2a K_V + b K_E, or 2a (K_V - 1) + b K_E when the first vote is a forced yes (THRESH: when
        tau_L < 1; HeavyTHRESH: always). No ledger exceeds it. Exact (attained by some pair of data sequences
        and decisions; the tests enumerate it) when the run has epochs enough for the votes and estimates to
        differ wherever the caps allow; an upper bound otherwise (a short run, or THRESH with tau_L >= 2,
        where no odd epoch can carry a yes vote)."""
        a, b = self.vote_noise, self.estimate_noise
        kv = self.vote_cap_count - self._forced
        return 2 * a * kv + b * self.estimate_cap_count

    @property
    def round_epsilon(self) -> float:
        return max(self.vote_noise, self.estimate_noise)


@dataclass(frozen=True)
class ThreshParams(VotingCaps):
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
    label = "THRESH"
    tau_too_high = "an epoch mean can never move that far, so no device would ever vote"

    collects_bits = True  # a device's daily value is a bit (a Bernoulli counter)

    def run_summary(self, rounds: list, spend_by_reason: dict[str, np.ndarray], devices: int) -> dict:
        """THRESH's part of summary.json: updates and caps (:meth:`updates_and_caps`) and constants. ``rounds``
        are the run's round records (``round``, ``info``)."""
        zeros = np.zeros(devices)
        return {
            **self.updates_and_caps(rounds, spend_by_reason.get(THRESH_VOTE_RESERVE, zeros),
                                    spend_by_reason.get(THRESH_ESTIMATE, zeros)),
            "thresh": {"a": self.vote_noise, "b": self.estimate_noise, "taus": self.taus.tolist(),
                       "vote_threshold": self.vote_threshold, "guarantee": float(self.total_epsilon),
                       "guarantee_derivation": self.guarantee_derivation,
                       "theorem_4_3_bound": theorem_4_3_bound(self.devices, self.epochs, self.epoch_length,
                                                              self.delta),
                       "problems": self.problems()},
        }

    #: an example [protocol] table per name this class runs (ldpsim privacy-audit NAME, the conformance tests)
    examples = {'thresh': {'epsilon': 4.0, 'delta': 0.1, 'epoch_length': 1, 'a': 0.25, 'b': 0.25, 'tau_scale': 0.12}}

    def baseline_table(self) -> dict[str, object]:
        """``ldpsim compare``'s baseline: naive per-epoch randomized response (epochrr) spending this run's
        exact guarantee, evenly over the epochs (Joseph et al. 2018, section 1)."""
        return {"name": "epochrr", "epsilon": self.total_epsilon, "epoch_length": self.epoch_length}

    @classmethod
    def from_table(cls, name: str, table: "config.Table", ctx: "config.Context") -> "ThreshParams":
        """[protocol] keys: epsilon, delta, epoch_length, a, b, tau_scale, cap_rule, allow_infeasible.
        Infeasible derived constants are an error naming them, unless a, b or tau_scale are given explicitly
        (or allow_infeasible = true): then the problems become warnings."""
        return cls.from_voting_table(name, table, ctx)

    def __post_init__(self) -> None:
        check_params(self.epsilon, self.max_value, total=True)
        self.check_caps()
        smallest = self.smallest_group or self.devices
        object.__setattr__(self, "derived", derived_constants(self.devices, self.groups, smallest, self.epochs,
                                                              self.epoch_length, self.epsilon, self.delta))

    @property
    def forced_first_vote(self) -> bool:
        """tau_L < 1: against the reference -1 every epoch mean exceeds the top threshold, so a device's votes
        before the first update it takes part in are yes whatever its data (2^0 divides every t)."""
        return bool(self.taus[-1] < 1)

    @property
    def _forced(self) -> int:
        return int(self.forced_first_vote and self.vote_cap_count >= 1)

    @property
    def guarantee_derivation(self) -> str:
        """The guarantee's formula with this run's numbers, in one line."""
        a, b, kv, ke = self.vote_noise, self.estimate_noise, self.vote_cap_count, self.estimate_cap_count
        rule = "ceil" if self.cap_rule == "paper" else "floor"
        total = 2 * a * (kv - self._forced) + b * ke
        if self._forced:
            head = f"2a(K_V - 1) + b K_E = 2 x {a:.6g} x {kv - 1} + {b:.6g} x {ke} = {total:.6g}"
            why = f"tau_L = {self.taus[-1]:.4g} < 1: the first vote is a forced yes"
        else:
            head = f"2a K_V + b K_E = 2 x {a:.6g} x {kv} + {b:.6g} x {ke} = {total:.6g}"
            why = (f"tau_L = {self.taus[-1]:.4g} >= 1: the first vote can depend on the data"
                   if not self.forced_first_vote else "K_V = 0: no yes vote is ever allowed")
        return f"{head} ({why}; K_V = {rule}(eps/4a) = {kv}, K_E = {rule}(eps/4b) = {ke})"

    def make_devices(self, seed: int, device_ids: np.ndarray, limits: Limits | None = None) -> "ThreshDevices":
        return ThreshDevices(self, seed, device_ids, limits)

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
        m1, m2 = float(v.mean()), float((v * v).sum()) / v.size  # not np.dot: BLAS threads spin after it
        mean_q1q = c0 * (1 - c0) + c1 * (1 - 2 * c0) * m1 - c1 * c1 * m2
        return (e + 1) / (e - 1) * math.sqrt(max(mean_q1q, 0.0) / reports)


# ------------------------------------------------------------------------------------------- device side
@nb.njit(cache=True, nogil=True)
def _vote_kernel(diff, taus, levels, t, cap_ok, out_yes):
    for i in range(diff.shape[0]):
        jstar = -2  # no threshold exceeded (difference 0)
        for j in range(taus.shape[0] - 1, -1, -1):
            if diff[i] > taus[j]:
                jstar = j - 1
                break
        out_yes[i] = cap_ok[i] and jstar >= 0 and t % (1 << (levels - jstar)) == 0


class VotingDevices(GuardedDevices):
    """The stage rules of a device side that votes on change, then estimates (THRESH, HeavyTHRESH; Joseph et
    al. 2018, Algorithm 2): a vote only for the epoch just completed, one estimate an epoch after that epoch's
    vote, only devices that observed the whole epoch. Subclasses keep ``complete_epoch``, ``valid``,
    ``voted_epoch`` and ``estimated_epoch`` and implement :meth:`_vote` and :meth:`_estimate`."""

    complete_epoch: int
    valid: np.ndarray
    voted_epoch: int
    estimated_epoch: int

    answers = (CollectionRequest, Decision)

    def current_round(self, day: int) -> int:
        """Votes are asked only for the epoch just completed."""
        return self.complete_epoch

    def admit_stage(self, msg: CollectorMessage, day: int) -> bool:
        """One estimate an epoch, after that epoch's vote, never for a closed or stale epoch."""
        t = msg.round
        return (self.guard.in_horizon(t) and t == self.voted_epoch and t == self.complete_epoch
                and t > self.estimated_epoch)

    def eligible(self) -> np.ndarray:
        """The devices that observed the whole epoch."""
        return self.valid

    def answer(self, msg: CollectorMessage, values: np.ndarray, here: np.ndarray,
               now: float) -> tuple[ReportBatch | None, list[Charge]]:
        """Votes (on a CollectionRequest) or estimates (on the epoch's Decision) of the devices ``here``."""
        t = msg.round
        if isinstance(msg, Decision):
            self.estimated_epoch = t
            return self._estimate(t, msg.update, here, now)
        self.voted_epoch = t
        return self._vote(t, here, now)

    def _vote(self, t: int, rows: np.ndarray, now: float) -> tuple[ReportBatch, list[Charge]]:
        raise NotImplementedError(f"{type(self).__name__}._vote")

    def _estimate(self, t: int, update: bool, rows: np.ndarray,
                  now: float) -> tuple[ReportBatch | None, list[Charge]]:
        raise NotImplementedError(f"{type(self).__name__}._estimate")


class ThreshDevices(EpochMeans, VotingDevices):
    """Device side for a cohort: epoch sums of private bits, the reference mean of the last update it took part
    in, the caps c_V and c_E, whether its vote reserve is booked, and the :class:`~protocols.guard.Guard`
    (horizon, budget, spend). Refuses repeats, other epochs and incomplete epochs, whatever the collector
    sends. ``sent_probabilities``: P[bit = 1] of each device's last message (NaN: none sent), for audits."""

    def __init__(self, params: ThreshParams, seed: int, device_ids: np.ndarray, limits: Limits | None = None) -> None:
        self.params, self.seed = params, int(seed)
        self.device_ids = np.ascontiguousarray(device_ids, dtype=np.uint64)
        n = self.device_ids.size
        self.guard = Guard(self.device_ids, limits)
        self.cV = np.zeros(n)
        self.cE = np.zeros(n)
        self.reference = np.full(n, -1.0)  # p_i^{f(t)}; -1 before any global update it took part in
        self.reserved = np.zeros(n, dtype=np.bool_)  # vote reserve booked
        self._voted = np.zeros(n, dtype=np.bool_)  # sent a vote in the last epoch voted on
        self.sent_probabilities = np.full(n, np.nan)
        self.init_epochs(n, params.epoch_length)
        self.voted_epoch = 0
        self.estimated_epoch = 0
        self._k_vote = params.vote_cap_count
        self._dependence: dict[int, tuple[bool, bool]] = {}

    def _spendable(self, spent: np.ndarray, step: float) -> np.ndarray:
        return self.params.spendable(spent, step)

    _ARRAYS = ("cV", "cE", "reference", "reserved", "_voted", "sent_probabilities")

    def snapshot(self) -> dict:
        """The guard, the caps c_V and c_E, the reference means, the booked vote reserves, who voted in the last
        epoch, the epochs voted and estimated, and the epoch sums and means (protocols.snapshot)."""
        return {**snap.header(self), "guard": self.guard.snapshot(), "epochs": self.epoch_snapshot(),
                **{k.lstrip("_"): getattr(self, k).copy() for k in self._ARRAYS},
                "voted_epoch": self.voted_epoch, "estimated_epoch": self.estimated_epoch}

    def restore(self, state: dict) -> None:
        snap.check_header(state, self)
        self.guard.restore(snap.field(state, "guard", dict))
        self.epoch_restore(snap.field(state, "epochs", dict))
        for k in self._ARRAYS:
            snap.put(getattr(self, k), state, k.lstrip("_"))
        self.voted_epoch = snap.field(state, "voted_epoch", int)
        self.estimated_epoch = snap.field(state, "estimated_epoch", int)

    def vote_depends_on_data(self, t: int) -> tuple[bool, bool]:
        """Whether a device with an open vote cap can vote both yes and no in epoch t, depending on its data:
        (reference -1, reference an earlier epoch mean). Epoch means are k/l; against -1 the difference is
        1 + k/l, against an earlier mean any |k - k'|/l (the two means are of different epochs, so every
        pair is possible). Evaluated with the vote kernel itself, so it is exact for these thresholds."""
        if t not in self._dependence:
            p = self.params
            grid = np.arange(p.epoch_length + 1) / p.epoch_length
            out = []
            for diff in (np.abs(grid - (-1.0)), np.abs(grid[:, None] - grid[None, :]).ravel()):
                yes = np.empty(diff.size, dtype=np.bool_)
                _vote_kernel(diff, p.taus, p.levels, t, np.ones(diff.size, dtype=np.bool_), yes)
                out.append(bool(yes.any() and not yes.all()))
            self._dependence[t] = (out[0], out[1])
        return self._dependence[t]

    def vote_probabilities(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        """(P[vote = 1], votes yes) for epoch t from the current state (no state change, no budget test)."""
        p = self.params
        a = p.vote_noise
        yes = np.empty(self.device_ids.size, dtype=np.bool_)
        _vote_kernel(np.abs(self.current - self.reference), p.taus, p.levels, t, self._spendable(self.cV, a), yes)
        e = math.exp(a)
        return np.where(yes, e / (e + 1), 1 / (e + 1)), yes

    def _vote(self, t: int, rows: np.ndarray, now: float) -> tuple[ReportBatch, list[Charge]]:
        p, g = self.params, self.guard
        a = p.vote_noise
        _, yes = self.vote_probabilities(t)
        yes &= rows
        open_ = self._spendable(self.cV, a) & rows
        fresh, updated = self.vote_depends_on_data(t)
        need = np.flatnonzero(open_ & ~self.reserved & np.where(self.reference < 0, fresh, updated))
        charges = []
        if need.size:
            forced = np.rint(self.cV[need] / a).astype(np.int64)  # yes votes so far: all data-free (forced)
            cost = 2 * a * (self._k_vote - forced)
            ok = g.affordable(cost, need)
            yes[need[~ok]] = False  # cannot afford it: the cap counts as closed this epoch (a data-free no)
            for f in np.unique(forced[ok]):
                sel = need[ok & (forced == f)]
                charges.append(g.charge(t, now, THRESH_VOTE_RESERVE, 2 * a * (self._k_vote - int(f)), sel))
                self.reserved[sel] = True
        self.cV[yes] += p.vote_noise
        self._voted = rows.copy()
        e = math.exp(a)
        q = np.where(yes, e / (e + 1), 1 / (e + 1))
        self.sent_probabilities = np.where(rows, q, np.nan)
        bits = keyed.uniform(stream_key(self.seed, Purpose.VOTE, t), self.device_ids) < q
        ids = self.device_ids[rows]
        return ReportBatch(t, p.name, ids.astype(np.uint32), {"vote": wire_bits(bits[rows])}), charges

    def _estimate(self, t: int, update: bool, rows: np.ndarray, now: float) -> tuple[ReportBatch, list[Charge]]:
        p, g = self.params, self.guard
        b = p.estimate_noise
        send = self._spendable(self.cE, b) & rows if update else np.zeros(self.device_ids.size, bool)
        idx = np.flatnonzero(send)
        if idx.size:
            send[idx[~g.affordable(b, idx)]] = False  # over budget: the data-free estimate instead
        self.cE[send] += b
        charges = [g.charge(t, now, THRESH_ESTIMATE, b, send)]
        if update:  # f(t) = t for the devices that took part: voted this epoch and hear the decision
            self.reference = np.where(rows & self._voted, self.current, self.reference)
        e = math.exp(b)
        q = np.where(send, (1 + self.current * (e - 1)) / (e + 1), 1 / (e + 1))
        self.sent_probabilities = np.where(rows, q, np.nan)
        bits = keyed.uniform(stream_key(self.seed, Purpose.ESTIMATE, t), self.device_ids) < q
        ids = self.device_ids[rows]
        if not update:
            charges.append(Charge(t, now, THRESH_DUMMY, 0.0, ids, cumulative=False))
        return ReportBatch(t, p.name, ids.astype(np.uint32), {"est": wire_bits(bits[rows])}), charges


# ------------------------------------------------------------------------------------------- collector side
def _mean(bits: np.ndarray) -> float:
    """The mean of the reported bits (NaN when none arrived)."""
    return float(bits.mean()) if bits.size else math.nan


class VotingCollector(StagedCollector):
    """The collector side of a protocol that votes on change (THRESH, HeavyTHRESH; Joseph et al. 2018,
    Algorithm 2): vote stage, decision, estimate stage, an epoch being ``idle -> vote -> estimate -> idle``
    (protocols.staged). The votes' close decides the update, by the paper's test on the votes that arrived;
    subclasses say what the estimates' close does (:meth:`finish`) and how the carried estimate is kept in a
    snapshot (:meth:`_kept_estimate`, :meth:`_restored_estimate`)."""

    GRAPH = StageGraph.chain("vote", "estimate")

    def __init__(self, params: VotingCaps, n_devices: int, estimate_column: Column, estimate: Any) -> None:
        super().__init__(params.name, n_devices, {"vote": (Column("vote", np.uint8, high=1),),
                                                  "estimate": (estimate_column,)})
        self.params = params
        self.votes, self.estimates = self.stage("vote"), self.stage("estimate")
        self.estimate = estimate  # no estimate before the first global update
        self._vote_mean = math.nan
        self._update = False
        self._vote_reports = 0

    @property
    def epoch(self) -> int:
        return self.round

    def _kept_estimate(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__}._kept_estimate")

    def _restored_estimate(self, state: dict) -> Any:
        raise NotImplementedError(f"{type(self).__name__}._restored_estimate")

    def extra_snapshot(self) -> dict:
        """The epoch, the carried-forward estimate and the last epoch's decision figures."""
        return {"epoch": self.round, "estimate": self._kept_estimate(), "vote_mean": float(self._vote_mean),
                "update": bool(self._update), "vote_reports": int(self._vote_reports)}

    def extra_restore(self, state: dict) -> None:
        self.round = snap.field(state, "epoch", int)
        self.estimate = self._restored_estimate(state)
        self._vote_mean = snap.field(state, "vote_mean", float)
        self._update = snap.field(state, "update", bool)
        self._vote_reports = snap.field(state, "vote_reports", int)

    def boundary_message(self, stage: str, deadline: float) -> Decision:
        """The epoch's decision, which opened the estimate stage."""
        return Decision(round=self.round, protocol=self.name, update=self._update, deadline=deadline)

    def on_stage_closed(self, stage: str, result: RoundResult, deadline: float) -> tuple[str, Decision]:
        """The votes closed: decide whether to update, and ask for estimates."""
        assert isinstance(result.estimate, dict)  # a Stage's reports by column
        self._vote_mean, self._vote_reports = _mean(result.estimate["vote"]), result.reports
        # the update test on the votes that arrived (lost votes: the threshold for the count received)
        honest = result.reports > 0 and self._vote_mean > self.params.threshold_for(result.reports)
        self._update = honest or self.params.behavior == "always_update"
        return "estimate", self.boundary_message("estimate", deadline)

    def decision_info(self) -> dict[str, Any]:
        """The epoch's decision figures for its round record: whether it updated, the votes' mean, how many
        votes arrived and the threshold they were tested against (None without votes)."""
        votes = self._vote_reports
        return {"global_update": self._update, "vote_mean": self._vote_mean, "votes": votes,
                "vote_threshold": self.params.threshold_for(votes) if votes else None}


class ThreshCollector(VotingCollector):
    """Collector side: the estimate is a mean, carried forward without update."""

    def __init__(self, params: ThreshParams, n_devices: int) -> None:
        super().__init__(params, n_devices, Column("est", np.uint8, high=1), math.nan)
        self.params: ThreshParams = params

    def _kept_estimate(self) -> float:
        return float(self.estimate)

    def _restored_estimate(self, state: dict) -> float:
        return snap.field(state, "estimate", float)

    def finish(self, stage: str, result: RoundResult) -> RoundResult:
        """The estimates closed: debias them if the epoch updated, else carry the estimate forward."""
        assert isinstance(result.estimate, dict)  # a Stage's reports by column
        if self._update:
            e = math.exp(self.params.estimate_noise)
            if result.reports:
                self.estimate = (_mean(result.estimate["est"]) * (e + 1) - 1) / (e - 1)
        return RoundResult(round=self.round, estimate=self.estimate, reports=result.reports,
                           info=self.decision_info())


if TYPE_CHECKING:  # mypy: the descriptor, and through it the device and collector sides, match protocols.base
    _ThreshParams: type[ProtocolParams] = ThreshParams
