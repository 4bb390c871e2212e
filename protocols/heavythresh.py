"""HeavyTHRESH (Joseph, Roth, Ullman, Waggoner 2018, section 5): THRESH's votes and caps over a dictionary of D items.

A frequency oracle for evolving data: it tracks the share of each of D dictionary items, collecting fresh
estimates only when enough devices vote that their own distribution over the items has changed. The paper
gives HeavyTHRESH only in outline (its constants and pseudocode are in a supplement that was not
recoverable); this is a faithful design on THRESH's rules, documented in docs/heavythresh.md.

Dictionary: D = ``buckets`` equal-width items of [0, max_value] (a value x is item min(floor(x D/m), D - 1),
as the histogram protocols bucket it). Rounds form T epochs of l rounds; a device's epoch histogram
h_t(v) is the share of the epoch's l rounds in which its value fell in item v (it keeps the counts). At the
end of epoch t:

1. VOTE (device): d = max_v |h_t(v) - h_f(v)|, the largest change of one item's local frequency since h_f,
   its histogram at the last global update it took part in. Before any, it has no reference and d = +inf
   (THRESH's reference -1: every device votes). j* = the largest j in {-1, 0, ..., L = floor(log2 T)} with
   d > tau_j, tau_j = 2 (j + 1) sqrt(ln(12 D n T/delta)/(2 l)) x tau_scale; it votes yes iff its vote cap
   is open and 2^(L - j*) divides t, exactly as THRESH. A yes adds a to c_V and sends Bernoulli(e^a/(e^a +
   1)); anything else Bernoulli(1/(e^a + 1)).
2. The collector updates iff the mean vote exceeds 1/(e^a + 1) + sqrt(ln(10 T/delta)/(2 n)) (THRESH's test)
   and broadcasts the decision; ``[collector] behavior = "always_update"`` forces an update every epoch.
3. EST (device), on an update: if its estimate cap is open, it adds b to c_E, draws one item from h_t (a
   keyed uniform day of the epoch) and sends it through D-ary randomized response at b: the item with
   p = e^b/(e^b + D - 1), each other item with q = 1/(e^b + D - 1). Otherwise, and on every epoch without an
   update, it sends the data-free message: a uniform item. The collector publishes
   f_hat(v) = (share of reports equal to v - q)/(p - q) on an update (unbiased for the mean of the devices'
   epoch histograms; a data-free report debiases to 1/D), and carries the last estimate otherwise.

Privacy (docs/heavythresh.md derives it; the tests enumerate it). Fix the collector's decisions (an adaptive
collector is covered: a transcript's probability factors the same way). A device's state (c_V, c_E, h_f) is
then a function of its data and its messages are independent given the state. The estimate's randomizer is
a mixture over items of D-ary randomized response, so for any two histograms and any report the ratio is at
most p/q = e^b; whether an estimate is truthful depends only on c_E and the decisions. Votes differ only
where one side votes yes and the other no (log-ratio a each), at most K_V - f yes votes a side after the f
forced ones. The first vote, with no reference, is a forced yes. So a device's whole transcript is
(2a (K_V - 1) + b K_E)-LDP against any collector (K_V, K_E: the yes votes and truthful estimates the cap
rule allows: ceil(eps/4a) under the paper's rule, floor under the strict one), and the ledger books it as
THRESH's does: one vote reserve 2a (K_V - f) at the device's first data-dependent vote
(``HEAVY_VOTE_RESERVE``), and b per truthful estimate (``HEAVY_ESTIMATE``).

Its baseline at equal total privacy (``ldpsim compare``) is ``epochkrr`` (protocols/epochkrr.py), which shares
the epoch histograms and the report of this module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from protocols import config
from protocols import keyed
from protocols import snapshot as snap
from protocols.base import MisuseError, ProtocolParams, RoundResult, check_params
from protocols.baselines import estimate_kflip, kflip_pq
from protocols.collecting import Column
from protocols.dbitflip import bucket_of, histogram
from protocols.guard import Guard, Limits
from protocols.keyed import Purpose, stream_key
from protocols.ledger import Charge
from protocols.messages import ReportBatch
from protocols.thresh import VotingCaps, VotingCollector, VotingDevices, _vote_kernel
from protocols.wire import bits as wire_bits

HEAVYTHRESH = "heavythresh"
HEAVY_VOTE_RESERVE = "heavythresh_vote_reserve"  # 2a (K_V - f), once, at a device's first data-dependent vote
HEAVY_ESTIMATE = "heavythresh_estimate"  # b per truthful estimate
HEAVY_DUMMY = "heavythresh_dummy"  # a data-free estimate, recorded at zero cost (not cumulative)
MAX_ITEMS = 256  # items travel as one byte

# sub-indices of the keyed uniforms of one report (stream ESTIMATE for HeavyTHRESH, REPORT for epochkrr)
SUB_DAY, SUB_KEEP, SUB_OTHER, SUB_DUMMY = 0, 1, 2, 3


def derived_constants(n: int, groups: int, smallest: int, epochs: int, epoch_length: int, items: int,
                      delta: float) -> dict[str, float]:
    """a, b and the threshold scale from (n, M, L, T, l, D, delta) (log base 2 for floor(log T)).

    a: THRESH's (Algorithm 1, line 4): the vote is THRESH's vote.
    tau_unit = sqrt(ln(12 D n T/delta)/(2 l)): Hoeffding for one item's local frequency over l rounds, with
    the union bound over the D items as well as THRESH's n devices and T epochs (ours; the paper's
    HeavyTHRESH thresholds were not recoverable).
    b: THRESH's algebra (Algorithm 1, line 5) for D-ary randomized response. The published frequencies
    deviate by dev/(p - q), dev = sqrt(ln(12 D T/delta)/(2 n)) (Hoeffding over the n reports, union over D
    items and T epochs); b makes p - q = (e^b - 1)/(e^b + D - 1) equal to r = dev/(L tau_unit - dev):
    b = ln((1 + r (D - 1))/(1 - r)). At D = 2 this is 2 artanh(r), where THRESH's b = 2r is its
    linearization. Infinite when r >= 1 or the denominator is <= 0.
    """
    lm = math.log(12 * groups * epochs / delta)
    denom_a = smallest - 3 / math.sqrt(2) * math.sqrt(n * lm)
    a = 4 * math.sqrt(2 * n * lm) / denom_a if denom_a > 0 else math.inf
    unit = math.sqrt(math.log(12 * items * n * epochs / delta) / (2 * epoch_length))
    levels = int(math.floor(math.log2(epochs))) if epochs >= 1 else 0
    dev = math.sqrt(math.log(12 * items * epochs / delta) / (2 * n))
    denom = levels * unit - dev
    r = dev / denom if denom > 0 else math.inf
    b = math.log((1 + r * (items - 1)) / (1 - r)) if r < 1 else math.inf
    return {"a": a, "b": b, "tau_unit": unit, "levels": levels}


def krr_variance(h: np.ndarray, reports: int, items: int, epsilon: float) -> np.ndarray:
    """Var[f_hat(v)] of the debiased D-ary randomized response of ``reports`` devices whose items are drawn
    from the histogram ``h`` (each report is v with f = q + (p - q) h(v)): f (1 - f)/(r (p - q)^2). For fixed
    per-device histograms h_i the exact variance is sum_i f_i (1 - f_i)/(r^2 (p - q)^2) (:func:`exact_variance`),
    at most this (f (1 - f) is concave)."""
    p, q = kflip_pq(epsilon, items)
    f = q + (p - q) * np.asarray(h, dtype=np.float64)
    return f * (1 - f) / (reports * (p - q) ** 2)


def exact_variance(histograms: np.ndarray, epsilon: float) -> np.ndarray:
    """Var[f_hat(v)] for fixed per-device epoch histograms (rows summing to 1), one truthful report each:
    each report is v with probability f_i(v) = q + (p - q) h_i(v), independently, so
    Var = sum_i f_i (1 - f_i) / (r (p - q))^2."""
    h = np.asarray(histograms, dtype=np.float64)
    p, q = kflip_pq(epsilon, h.shape[1])
    f = q + (p - q) * h
    return (f * (1 - f)).sum(axis=0) / (h.shape[0] * (p - q)) ** 2


def item_column(items: int) -> Column:
    return Column("y", np.uint8, high=items - 1)


def sample_items(key: int, device_ids: np.ndarray, counts: np.ndarray, epoch_length: int) -> np.ndarray:
    """One item per device drawn from its epoch counts (rows summing to l): the item of a keyed uniform day
    of the epoch, ``day = min(floor(u l), l - 1)``, counting the days item by item."""
    n = device_ids.size
    u = keyed.uniform_sub(key, device_ids, np.full(n, SUB_DAY))
    day = np.minimum((u * epoch_length).astype(np.int64), epoch_length - 1)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    return np.argmax(np.cumsum(counts, axis=1) > day[:, None], axis=1).astype(np.int64)


def randomize(key: int, device_ids: np.ndarray, items: np.ndarray, k: int, epsilon: float) -> np.ndarray:
    """D-ary randomized response of ``items`` (Kairouz et al.): the item with p = e^eps/(e^eps + k - 1), else
    one of the k - 1 others uniformly (keyed uniforms SUB_KEEP and SUB_OTHER)."""
    n = device_ids.size
    p, _ = kflip_pq(epsilon, k)
    keep = keyed.uniform_sub(key, device_ids, np.full(n, SUB_KEEP)) < p
    other = np.minimum((keyed.uniform_sub(key, device_ids, np.full(n, SUB_OTHER)) * (k - 1)).astype(np.int64), k - 2)
    other = np.where(other >= items, other + 1, other)
    return np.where(keep, items, other)


def uniform_items(key: int, device_ids: np.ndarray, k: int) -> np.ndarray:
    """The data-free report: a uniform item (keyed uniform SUB_DUMMY)."""
    u = keyed.uniform_sub(key, device_ids, np.full(device_ids.size, SUB_DUMMY))
    return np.minimum((u * k).astype(np.int64), k - 1)


def items_table(table: "config.Table") -> tuple[int, float]:
    buckets = table.get("buckets", int, check=lambda v: 2 <= v <= MAX_ITEMS, what=f"an integer in [2, {MAX_ITEMS}]")
    max_value = config.max_value(table)
    return buckets, max_value


def check_items(buckets: int) -> None:
    if not 2 <= buckets <= MAX_ITEMS:
        raise ValueError(f"protocol.buckets must be in [2, {MAX_ITEMS}], got {buckets}")


# ------------------------------------------------------------------------------------------- parameters
@dataclass(frozen=True)
class HeavyThreshParams(VotingCaps):
    """HeavyTHRESH parameters. ``buckets`` (D) and ``max_value`` define the dictionary; ``devices``, ``groups``,
    ``smallest_group`` and ``epochs`` describe the population and run; ``a``, ``b`` (None: derived) and
    ``tau_scale`` override the derived constants."""

    name: str
    epsilon: float
    delta: float
    epoch_length: int
    epochs: int
    devices: int
    buckets: int
    max_value: float
    groups: int = 1
    smallest_group: int = 0
    a: float | None = None
    b: float | None = None
    tau_scale: float = 1.0
    cap_rule: str = "paper"
    behavior: str = "honest"  # collector behavior: "honest" or "always_update" (an adversary, for audits)
    derived: dict = field(default_factory=dict, compare=False, repr=False)
    warnings: list = field(default_factory=list, compare=False, repr=False)

    kind = "histogram"  # one frequency per item, published once per epoch
    label = "HeavyTHRESH"
    tau_too_high = ("no item's frequency can move that far, so no device would ever vote after the first "
                    "update")

    #: an example [protocol] table per name this class runs (ldpsim privacy-audit NAME, the conformance tests)
    examples = {"heavythresh": {"epsilon": 4.0, "delta": 0.1, "epoch_length": 2, "buckets": 4, "max_value": 1.0,
                                "a": 0.25, "b": 0.25, "tau_scale": 0.12}}

    def baseline_table(self) -> dict[str, object]:
        """``ldpsim compare``'s baseline: per-epoch D-ary randomized response (``epochkrr``) spending this run's
        exact guarantee evenly over the epochs (Joseph et al. 2018, section 1)."""
        return {"name": "epochkrr", "epsilon": self.total_epsilon, "epoch_length": self.epoch_length,
                "buckets": self.buckets, "max_value": self.max_value}

    def run_summary(self, rounds: list, spend_by_reason: dict[str, np.ndarray], devices: int) -> dict:
        """HeavyTHRESH's part of summary.json: updates, caps and constants (as THRESH's)."""
        zeros = np.zeros(devices)
        return {
            **self.updates_and_caps(rounds, spend_by_reason.get(HEAVY_VOTE_RESERVE, zeros),
                                    spend_by_reason.get(HEAVY_ESTIMATE, zeros)),
            "heavythresh": {"a": self.vote_noise, "b": self.estimate_noise, "items": self.buckets,
                            "taus": self.taus.tolist(), "vote_threshold": self.vote_threshold,
                            "guarantee": float(self.total_epsilon),
                            "guarantee_derivation": self.guarantee_derivation, "problems": self.problems()},
        }

    @classmethod
    def from_table(cls, name: str, table: "config.Table", ctx: "config.Context") -> "HeavyThreshParams":
        """[protocol] keys: epsilon, delta, epoch_length, buckets (D), max_value, a, b, tau_scale, cap_rule,
        allow_infeasible. Infeasible derived constants are an error naming them, unless a, b or tau_scale are
        given explicitly (or allow_infeasible = true): then the problems become warnings."""
        def items(t: "config.Table") -> dict[str, Any]:
            buckets, max_value = items_table(t)
            return {"buckets": buckets, "max_value": max_value}

        return cls.from_voting_table(name, table, ctx, items)

    def __post_init__(self) -> None:
        check_params(self.epsilon, self.max_value, total=True)
        check_items(self.buckets)
        self.check_caps()
        smallest = self.smallest_group or self.devices
        object.__setattr__(self, "derived", derived_constants(self.devices, self.groups, smallest, self.epochs,
                                                              self.epoch_length, self.buckets, self.delta))

    @property
    def _forced(self) -> int:
        """The first yes vote is forced (no reference: d = +inf) whenever the cap allows a yes vote at all."""
        return int(self.vote_cap_count >= 1)

    @property
    def guarantee_derivation(self) -> str:
        """The guarantee's formula with this run's numbers, in one line."""
        a, b, kv, ke = self.vote_noise, self.estimate_noise, self.vote_cap_count, self.estimate_cap_count
        rule = "ceil" if self.cap_rule == "paper" else "floor"
        total = 2 * a * (kv - self._forced) + b * ke
        why = ("the first vote, with no reference, is a forced yes" if self._forced
               else "K_V = 0: no yes vote is ever allowed")
        return (f"2a(K_V - 1) + b K_E = 2 x {a:.6g} x {kv - self._forced} + {b:.6g} x {ke} = {total:.6g} ({why}; "
                f"D-ary randomized response at b on an item drawn from the epoch histogram; "
                f"K_V = {rule}(eps/4a) = {kv}, K_E = {rule}(eps/4b) = {ke})")

    def make_devices(self, seed: int, device_ids: np.ndarray, limits: Limits | None = None) -> "HeavyThreshDevices":
        return HeavyThreshDevices(self, seed, device_ids, limits)

    def make_collector(self, n_devices: int) -> "HeavyThreshCollector":
        return HeavyThreshCollector(self, n_devices)

    def truth(self, values: np.ndarray) -> np.ndarray:
        """The item frequencies of the values of the collection day (the epoch's last round): an unbiased
        draw of the epoch's distribution when rounds are i.i.d. within an epoch (docs/heavythresh.md)."""
        return histogram(values, self.buckets, self.max_value)

    def estimate_sd(self, values: np.ndarray, reports: int) -> np.ndarray:
        """sd of an update's estimate with every report truthful: :func:`krr_variance` at b for the items'
        frequencies among ``values``."""
        return np.sqrt(krr_variance(self.truth(values), reports, self.buckets, self.estimate_noise))


# ------------------------------------------------------------------------------------------- device side
class EpochHistograms:
    """Mixin: ``observe`` days in order; each device counts the days its value fell in each item; after an
    epoch, ``current`` holds the counts (rows summing to l), ``valid`` who observed every day of it, and
    ``complete_epoch`` the epoch they belong to. A device absent on any day of the epoch sits it out."""

    epoch_length: int
    buckets: int

    def init_histograms(self, n: int, epoch_length: int, buckets: int, max_value: float) -> None:
        self.epoch_length, self.buckets, self._max_value = int(epoch_length), int(buckets), float(max_value)
        self.current = np.zeros((n, buckets), dtype=np.int32)  # item counts of the last complete epoch
        self.valid = np.zeros(n, dtype=np.bool_)
        self.complete_epoch = 0
        self._counts = np.zeros((n, buckets), dtype=np.int32)
        self._days = np.zeros(n, dtype=np.int64)  # days observed in the current epoch
        self._day = 0

    def observe(self, day: int, values: np.ndarray, present: np.ndarray | None = None) -> None:
        """Record the day's item of each device ``present`` (days in order, each once)."""
        if day != self._day + 1:
            raise MisuseError(f"days are observed in order: expected {self._day + 1}, got {day}")
        self._day = day
        x = np.clip(np.nan_to_num(np.asarray(values, dtype=np.float64)), 0.0, self._max_value)
        items = bucket_of(x, self.buckets, self._max_value)
        rows = np.arange(items.size) if present is None else np.flatnonzero(present)
        self._counts[rows, items[rows]] += 1
        self._days[rows] += 1
        if day % self.epoch_length == 0:
            self.valid = self._days == self.epoch_length
            self.current = np.where(self.valid[:, None], self._counts, self.current)
            self._counts[:] = 0
            self._days[:] = 0
            self.complete_epoch = day // self.epoch_length

    def histogram_snapshot(self) -> dict:
        """The epoch counts (protocols.snapshot)."""
        return {"epoch_length": self.epoch_length, "current": self.current.copy(), "valid": self.valid.copy(),
                "complete_epoch": self.complete_epoch, "counts": self._counts.copy(), "days": self._days.copy(),
                "day": self._day}

    def histogram_restore(self, state: dict) -> None:
        if snap.field(state, "epoch_length", int) != self.epoch_length:
            raise snap.SnapshotError(f"epoch length {state['epoch_length']} is not {self.epoch_length}")
        shape = self._counts.shape
        self.current = snap.array(state, "current", np.int32, shape).copy()
        self.valid = snap.array(state, "valid", np.bool_, shape[:1]).copy()
        self._counts = snap.array(state, "counts", np.int32, shape).copy()
        self._days = snap.array(state, "days", np.int64, shape[:1]).copy()
        self.complete_epoch = snap.field(state, "complete_epoch", int)
        self._day = snap.field(state, "day", int)


class HeavyThreshDevices(EpochHistograms, VotingDevices):
    """Device side for a cohort: epoch item counts, the counts of the last update it took part in (its
    reference), the caps c_V and c_E, whether its vote reserve is booked, and the
    :class:`~protocols.guard.Guard`. Refuses repeats, other epochs and incomplete epochs, whatever the
    collector sends. ``sent_distribution``: the output distribution of each device's last message (votes:
    (P[0], P[1]); estimates: P[item v] for v < D; a row of NaN: nothing sent), for audits and tests."""

    def __init__(self, params: HeavyThreshParams, seed: int, device_ids: np.ndarray,
                 limits: Limits | None = None) -> None:
        self.params, self.seed = params, int(seed)
        self.device_ids = np.ascontiguousarray(device_ids, dtype=np.uint64)
        n = self.device_ids.size
        self.guard = Guard(self.device_ids, limits)
        self.cV = np.zeros(n)
        self.cE = np.zeros(n)
        self.reference = np.zeros((n, params.buckets), dtype=np.int32)  # counts at f(t)
        self.has_reference = np.zeros(n, dtype=np.bool_)  # took part in a global update
        self.reserved = np.zeros(n, dtype=np.bool_)  # vote reserve booked
        self._voted = np.zeros(n, dtype=np.bool_)  # sent a vote in the last epoch voted on
        self.sent_distribution = np.full((n, params.buckets), np.nan)
        self.init_histograms(n, params.epoch_length, params.buckets, params.max_value)
        self.voted_epoch = 0
        self.estimated_epoch = 0
        self._k_vote = params.vote_cap_count
        self._dependence: dict[int, bool] = {}

    _ARRAYS = ("cV", "cE", "reference", "has_reference", "reserved", "_voted", "sent_distribution")

    def snapshot(self) -> dict:
        """The guard, the caps, the references, the booked vote reserves, who voted in the last epoch, the
        epochs voted and estimated, and the epoch counts (protocols.snapshot)."""
        return {**snap.header(self), "guard": self.guard.snapshot(), "epochs": self.histogram_snapshot(),
                **{k.lstrip("_"): getattr(self, k).copy() for k in self._ARRAYS},
                "voted_epoch": self.voted_epoch, "estimated_epoch": self.estimated_epoch}

    def restore(self, state: dict) -> None:
        snap.check_header(state, self)
        self.guard.restore(snap.field(state, "guard", dict))
        self.histogram_restore(snap.field(state, "epochs", dict))
        for k in self._ARRAYS:
            snap.put(getattr(self, k), state, k.lstrip("_"))
        self.voted_epoch = snap.field(state, "voted_epoch", int)
        self.estimated_epoch = snap.field(state, "estimated_epoch", int)

    # ------------------------------------------------------------------ the vote rule
    def distances(self) -> np.ndarray:
        """d = max_v |h_t(v) - h_f(v)| of each device (+inf without a reference)."""
        d = np.abs(self.current - self.reference).max(axis=1) / self.epoch_length
        return np.where(self.has_reference, d, np.inf)

    def vote_depends_on_data(self, t: int) -> bool:
        """Whether a device with an open vote cap and a reference can vote both yes and no in epoch t depending
        on its data. Between two histograms of l rounds over D >= 2 items, d takes exactly the values m/l,
        m = 0..l (move m rounds from one item to another), so the vote rule is evaluated on that grid with the
        vote kernel itself. Without a reference the vote is a forced yes: never."""
        if t not in self._dependence:
            p = self.params
            grid = np.arange(p.epoch_length + 1) / p.epoch_length
            yes = np.empty(grid.size, dtype=np.bool_)
            _vote_kernel(grid, p.taus, p.levels, t, np.ones(grid.size, dtype=np.bool_), yes)
            self._dependence[t] = bool(yes.any() and not yes.all())
        return self._dependence[t]

    def votes_yes(self, t: int) -> np.ndarray:
        """Who votes yes in epoch t from the current state (no state change, no budget test)."""
        p = self.params
        yes = np.empty(self.device_ids.size, dtype=np.bool_)
        _vote_kernel(self.distances(), p.taus, p.levels, t, self.params.spendable(self.cV, p.vote_noise), yes)
        return yes

    def _vote(self, t: int, rows: np.ndarray, now: float) -> tuple[ReportBatch, list[Charge]]:
        p, g = self.params, self.guard
        a = p.vote_noise
        yes = self.votes_yes(t) & rows
        open_ = p.spendable(self.cV, a) & rows
        charges = []
        if self.vote_depends_on_data(t):
            need = np.flatnonzero(open_ & ~self.reserved & self.has_reference)
            if need.size:
                forced = np.rint(self.cV[need] / a).astype(np.int64)  # yes votes so far: all forced
                cost = 2 * a * (self._k_vote - forced)
                ok = g.affordable(cost, need)
                yes[need[~ok]] = False  # cannot afford it: the cap counts as closed this epoch (a data-free no)
                for f in np.unique(forced[ok]):
                    sel = need[ok & (forced == f)]
                    charges.append(g.charge(t, now, HEAVY_VOTE_RESERVE, 2 * a * (self._k_vote - int(f)), sel))
                    self.reserved[sel] = True
        self.cV[yes] += a
        self._voted = rows.copy()
        e = math.exp(a)
        q = np.where(yes, e / (e + 1), 1 / (e + 1))
        self.sent_distribution = np.full((rows.size, p.buckets), np.nan)
        self.sent_distribution[rows, 0], self.sent_distribution[rows, 1] = 1 - q[rows], q[rows]
        bits = keyed.uniform(stream_key(self.seed, Purpose.VOTE, t), self.device_ids) < q
        ids = self.device_ids[rows]
        return ReportBatch(t, p.name, ids.astype(np.uint32), {"vote": wire_bits(bits[rows])}), charges

    def _estimate(self, t: int, update: bool, rows: np.ndarray, now: float) -> tuple[ReportBatch, list[Charge]]:
        p, g = self.params, self.guard
        b, k = p.estimate_noise, p.buckets
        send = p.spendable(self.cE, b) & rows if update else np.zeros(self.device_ids.size, bool)
        idx = np.flatnonzero(send)
        if idx.size:
            send[idx[~g.affordable(b, idx)]] = False  # over budget: the data-free estimate instead
        self.cE[send] += b
        charges = [g.charge(t, now, HEAVY_ESTIMATE, b, send)]
        if update:  # f(t) = t for the devices that took part: voted this epoch and hear the decision
            took = rows & self._voted
            self.reference[took] = self.current[took]
            self.has_reference |= took
        key = stream_key(self.seed, Purpose.ESTIMATE, t)
        ids = self.device_ids[rows]
        truthful = randomize(key, ids, sample_items(key, ids, self.current[rows], p.epoch_length), k, b)
        y = np.where(send[rows], truthful, uniform_items(key, ids, k))
        hi, lo = kflip_pq(b, k)
        dist = np.where(send[:, None], lo + (hi - lo) * self.current / p.epoch_length, 1.0 / k)
        self.sent_distribution = np.where(rows[:, None], dist, np.nan)
        if not update:
            charges.append(Charge(t, now, HEAVY_DUMMY, 0.0, ids, cumulative=False))
        return ReportBatch(t, p.name, ids.astype(np.uint32), {"y": y.astype(np.uint8)}), charges


# ------------------------------------------------------------------------------------------- collector side
class HeavyThreshCollector(VotingCollector):
    """Collector side (THRESH's stages and update test): the estimate is the items' frequencies, carried
    forward without an update."""

    def __init__(self, params: HeavyThreshParams, n_devices: int) -> None:
        super().__init__(params, n_devices, item_column(params.buckets), np.full(params.buckets, np.nan))
        self.params: HeavyThreshParams = params

    def _kept_estimate(self) -> np.ndarray:
        return self.estimate.copy()

    def _restored_estimate(self, state: dict) -> np.ndarray:
        return snap.array(state, "estimate", np.float64, (self.params.buckets,)).copy()

    def finish(self, stage: str, result: RoundResult) -> RoundResult:
        """The estimates closed: debias them if the epoch updated, else carry the frequencies forward."""
        assert isinstance(result.estimate, dict)
        p = self.params
        if self._update and result.reports:
            self.estimate = estimate_kflip(np.ravel(result.estimate["y"]), p.buckets, p.estimate_noise)
        return RoundResult(round=self.round, estimate=self.estimate.copy(), reports=result.reports,
                           info=self.decision_info())


if TYPE_CHECKING:  # mypy: the descriptor, and through it the device and collector sides, match protocols.base
    _HeavyThreshParams: type[ProtocolParams] = HeavyThreshParams
