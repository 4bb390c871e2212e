"""Reference models: one device at a time, written straight from the formulas, for audits.

Every protocol's device side (protocols/) is vectorized over a cohort and compiled with numba. This module
restates what *one* device does, with plain Python loops and the math module, so that an audit
(scenarios/audit.py) can replay any device of a finished run and compare what it should have sent and been
charged with what the run recorded. It shares no code with the device sides: the only things taken from
protocols/ are the stream keys (:func:`protocols.keyed.stream_key`, :class:`protocols.keyed.Purpose`), the
message classes, and the parameter records (read as plain numbers). The keyed uniforms themselves are
restated here in pure Python (:func:`uniform1`, :func:`uniform2`; the tests check them bit for bit against
protocols.keyed), and every draw uses the key and sub-index the device side uses for it.

A device model:

    dev = reference_device(params, seed, device_id, limits)
    dev.observe(day, value, present)          # epoch protocols (thresh, epochrr, heavythresh, epochkrr): every day
    report, charges = dev.on_message(msg, day, value, present, now)

``msg`` is a :class:`~protocols.messages.CollectionRequest`, :class:`~protocols.messages.Decision` or
:class:`~protocols.messages.Threshold` broadcast by the collector. Every broadcast is passed to every device,
in order; ``present`` is False when it did not reach the device (downlink loss) or the device is not there
(churn): the device then sends nothing, spends nothing and learns nothing from it, but, as with the device
sides, the round counts as opened (a later copy of it is a repeat, and THRESH's decision of an epoch follows
that epoch's vote request whether or not this device heard it). ``day`` is the device's own round counter;
``value`` its private value of the day (a float, or c floats for 1bitmulti; epoch protocols use what they
observed). ``report`` is a :class:`Report` (stage, round, columns) or None; ``charges`` a list of
:class:`Charge` (round, reason, amount, cumulative).

What every device enforces (the guard; formulas in docs/algorithms.md, rules in protocols/guard.py's docstring):
- it answers only messages of its own protocol, for rounds in 1..horizon, for its current day (epoch
  protocols: the epoch it just completed), each round once and in order;
- ToPL: a threshold must come in a threshold round under that round's version (the number of threshold rounds
  so far), be finite, in [max_value x 1e-9, max_value] and of a newer version than its own;
- with a budget, a report whose charge would take its total past the budget (with 1e-9 slack) is not sent
  (THRESH: the data-free message is sent instead).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, NamedTuple

from protocols.keyed import Purpose, stream_key
from protocols.messages import CollectionRequest, Decision, Threshold

MAX_ROUND = 2**31 - 1
BUDGET_SLACK = 1e-9  # charges are sums of a few floats
CAP_SLACK = 1e-12  # THRESH's caps compare sums of a few floats with eps/4

# ledger reasons (stable strings, as they appear in ledger.parquet)
FRESH_REPORT = "fresh_report"
MEMO_REVEAL = "memo_reveal"
ROUND_GUARANTEE = "round_guarantee"
JOINT_REPORT = "joint_report"
EVENT_REPORT = "event_report"
CENTRAL_RELEASE = "central_release"
CENTRAL_THRESHOLD = "central_threshold"
THRESH_VOTE_RESERVE = "thresh_vote_reserve"
THRESH_ESTIMATE = "thresh_estimate"
THRESH_DUMMY = "thresh_dummy"

# ------------------------------------------------------------------------------------ keyed uniforms
_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_TWO_M53 = 2.0**-53


def _mix(z: int) -> int:
    """SplitMix64's output function (Steele, Lea, Flood 2014) on a 64-bit word."""
    z = ((z ^ (z >> 30)) * _M1) & _MASK
    z = ((z ^ (z >> 27)) * _M2) & _MASK
    return z ^ (z >> 31)


def uniform1(key: int, device: int) -> float:
    """The uniform in [0, 1) of stream ``key`` for ``device``: the top 53 bits of mix(device x golden + key)."""
    return (_mix((device * _GOLDEN + key) & _MASK) >> 11) * _TWO_M53


def uniform2(key: int, device: int, sub: int) -> float:
    """The uniform of stream ``key``, ``device`` and sub-index ``sub`` (a grid value, a bit position...)."""
    z = _mix((device * _GOLDEN + key) & _MASK)
    return (_mix((z + (sub + 1) * _GOLDEN) & _MASK) >> 11) * _TWO_M53


_KEYS: dict[tuple[int, ...], int] = {}


def key(seed: int, purpose: int, *context: int) -> int:
    """stream_key, remembered (a replay asks for the same few keys for every device)."""
    k = (seed, purpose, *context)  # an IntEnum hashes and compares as its int
    got = _KEYS.get(k)
    if got is None:
        if len(_KEYS) > 1_000_000:
            _KEYS.clear()
        got = _KEYS[k] = stream_key(seed, purpose, *context)
    return got


# ------------------------------------------------------------------------------------ records
class Report(NamedTuple):
    """One report: its transcript stage, round and column values (a bit as int, d values as a tuple)."""

    stage: str
    round: int
    columns: dict[str, Any]


class Charge(NamedTuple):
    round: int
    reason: str
    amount: float
    cumulative: bool = True


@lru_cache(maxsize=None)
def epsilon_prime(eps: float, gamma: float) -> float:
    """A bit of randomized response at eps whose sent value flips with probability gamma: the largest ratio
    of P[sent = y] between two inputs, ((1 - 2g) e^eps/(e^eps + 1) + g) / ((1 - 2g)/(e^eps + 1) + g)
    (Ding et al. 2017, Theorem 6)."""
    e = math.exp(eps)
    high = (1 - 2 * gamma) * e / (e + 1) + gamma
    low = (1 - 2 * gamma) / (e + 1) + gamma
    return math.log(high / low)


@lru_cache(maxsize=None)
def _response(eps: float) -> tuple[float, float]:
    e = math.exp(eps)
    return 1 / (e + 1), (e - 1) / (e + 1)


def bit_probability(x: float, eps: float, m: float) -> float:
    """1BitMean: P[b = 1] = 1/(e^eps + 1) + (x/m)(e^eps - 1)/(e^eps + 1) (Ding et al. 2017, eq. 1)."""
    low, slope = _response(eps)
    return low + (x / m) * slope


def clip(x: float, low: float, high: float) -> float:
    return min(max(x, low), high)


# ------------------------------------------------------------------------------------ the device
class ReferenceDevice:
    """What every device keeps: its id, the seed, its limits, its spend and the last round it answered, and two
    counters that summary.json's ``privacy`` adds up over the devices: ``refusals`` (reports its budget
    refused) and ``ignored`` (``ignored_messages``: collector messages it refused, of another type or protocol
    than it answers, outside its horizon, repeated, stale or not plausible)."""

    stages: tuple[str, ...] = ("report",)
    memoized = False  # the 1BitMean and dBitFlip families: whether reports are memoized (report_charges)
    revealed: set[int]  # their memo inputs revealed so far

    def round_epsilon(self) -> float:
        """The per-report loss (the families of report_charges define it)."""
        raise NotImplementedError(f"{type(self).__name__}.round_epsilon")

    def __init__(self, params: Any, seed: int, device_id: int, limits: Any = None) -> None:
        self.params, self.seed, self.id = params, int(seed), int(device_id)
        self.horizon = int(getattr(limits, "horizon", MAX_ROUND) if limits is not None else MAX_ROUND)
        self.budget = getattr(limits, "budget", None) if limits is not None else None
        self.spent = 0.0
        self.last_round = 0
        self.refusals = 0
        self.ignored = 0

    # the budget: a report is sent only if its charge fits
    def affordable(self, cost: float) -> bool:
        ok = self.budget is None or cost <= 0 or self.spent + cost <= self.budget + BUDGET_SLACK
        if not ok:
            self.refusals += 1
        return ok

    def ignore(self) -> bool:
        """Count a refused collector message; False, for ``return self.ignore()`` in a check."""
        self.ignored += 1
        return False

    def report_charges(self, r: int, memo_input: int) -> list[Charge] | None:
        """The charges of one report of the 1BitMean and dBitFlip families, or None when the budget refuses it.
        Memoized (``self.memoized``): eps the first time ``memo_input`` is revealed (Theorem 4), plus the
        per-report guarantee under output perturbation (not cumulative); fresh: the per-report loss."""
        p = self.params
        if self.memoized:
            new = memo_input not in self.revealed
            if not self.affordable(p.epsilon if new else 0.0):
                return None
            charges = []
            if new:
                self.revealed.add(memo_input)
                charges.append(self.charge(r, MEMO_REVEAL, p.epsilon))
            if p.gamma > 0:
                charges.append(Charge(r, ROUND_GUARANTEE, self.round_epsilon(), False))
            return charges
        if not self.affordable(self.round_epsilon()):
            return None
        return [self.charge(r, FRESH_REPORT, self.round_epsilon())]

    def charge(self, round_: int, reason: str, amount: float) -> Charge:
        self.spent += amount
        return Charge(round_, reason, amount)

    def in_horizon(self, round_: int) -> bool:
        return 1 <= round_ <= self.horizon

    def admit(self, msg: Any, current: int) -> bool:
        """A collection request of this protocol, inside the horizon, for the round the device is at, after
        the last one it answered. Remembers it as answered."""
        if not isinstance(msg, CollectionRequest) or msg.protocol != self.params.name:
            return self.ignore()
        if not self.in_horizon(msg.round) or msg.round <= self.last_round or msg.round != current:
            return self.ignore()
        self.last_round = msg.round
        return True

    def observe(self, day: int, value: float, present: bool = True) -> None:
        """A day's private value (only epoch protocols keep anything)."""

    def on_message(self, msg: Any, day: int, value: Any, present: bool = True, now: float = 0.0
                   ) -> tuple[Report | None, list[Charge]]:
        raise NotImplementedError(f"{type(self).__name__}.on_message")


# ------------------------------------------------------------------------------------ 1BitMean, 1BitRRPM
class OneBitReference(ReferenceDevice):
    """1BitMean (fresh bit each round) and 1BitRRPM (alpha-point rounding, memoized bit per grid value),
    both with output perturbation gamma (Ding et al. 2017; docs/algorithms.md sections 1.1 and 2)."""

    def __init__(self, params: Any, seed: int, device_id: int, limits: Any = None) -> None:
        super().__init__(params, seed, device_id, limits)
        self.memoized = bool(params.memoized)
        if self.memoized:
            self.s = params.granularity
            self.top = round(params.max_value / self.s)  # grid {0, s, ..., m}: indices 0..m/s
            self.alpha = uniform1(key(self.seed, Purpose.ALPHA), self.id) * self.s  # once, uniform on [0, s)
            self.revealed: set[int] = set()

    def round_epsilon(self) -> float:
        p = self.params
        return epsilon_prime(p.epsilon, p.gamma) if p.gamma > 0 else p.epsilon

    def grid_index(self, x: float) -> int:
        """Alpha-point rounding: L = floor(x/s) s; x goes to L if x + alpha < L + s, else to L + s."""
        s = self.s
        low = math.floor(x / s) * s
        rounded = low if x + self.alpha < low + s else low + s
        return min(max(round(rounded / s), 0), self.top)

    def on_message(self, msg, day, value, present=True, now=0.0):
        p = self.params
        if not self.admit(msg, day) or not present:
            return None, []
        r = msg.round
        x = clip(float(value), 0.0, p.max_value)
        if self.memoized:
            g = self.grid_index(x)
            # the memo table: one bit per grid value, a pure function of (seed, device, g)
            bit = int(uniform2(key(self.seed, Purpose.MEMO), self.id, g) < bit_probability(g * self.s, p.epsilon,
                                                                                            p.max_value))
        else:
            bit = int(uniform1(key(self.seed, Purpose.REPORT, r), self.id) < bit_probability(x, p.epsilon,
                                                                                            p.max_value))
        if p.gamma > 0 and uniform1(key(self.seed, Purpose.FLIP, r), self.id) < p.gamma:
            bit = 1 - bit
        charges = self.report_charges(r, g if self.memoized else 0)
        return (Report("report", r, {"bit": bit}), charges) if charges is not None else (None, [])


# ------------------------------------------------------------------------------------ dBitFlip family
class DBitFlipReference(ReferenceDevice):
    """dBitFlip, dBitFlipPM and BinFlip: d distinct buckets J of k sampled once (Floyd), a bit per bucket of J
    (1 w.p. e^(eps/2)/(e^(eps/2) + 1) for the device's own bucket, 1/(e^(eps/2) + 1) otherwise); PM memoizes
    one report per memo input s (position of the bucket in J plus 1, or 0)."""

    def __init__(self, params: Any, seed: int, device_id: int, limits: Any = None) -> None:
        super().__init__(params, seed, device_id, limits)
        k, d = params.buckets, params.bits
        self.memoized = bool(params.memoized)
        if d == k:
            self.J = list(range(k))
        else:  # Floyd's algorithm: for j = k - d .. k - 1, t uniform in 0..j; take t, or j if t is taken
            chosen: set[int] = set()
            for j in range(k - d, k):
                t = int(uniform2(key(self.seed, Purpose.BUCKETS), self.id, j) * (j + 1))
                chosen.add(j if t in chosen else t)
            self.J = sorted(chosen)
        self.revealed: set[int] = set()

    def round_epsilon(self) -> float:
        """Two inputs change at most min(d, 2) bits, each an eps/2 randomized response (eps'(eps/2, gamma)
        with output perturbation)."""
        p = self.params
        per_bit = epsilon_prime(p.epsilon / 2, p.gamma) if p.gamma > 0 else p.epsilon / 2
        return min(p.bits, 2) * per_bit

    def on_message(self, msg, day, value, present=True, now=0.0):
        p = self.params
        if not self.admit(msg, day) or not present:
            return None, []
        r, k, d = msg.round, p.buckets, p.bits
        x = clip(float(value), 0.0, p.max_value)
        bucket = min(int(x * k / p.max_value), k - 1)  # k equal-width buckets; x = m in the last
        s = self.J.index(bucket) + 1 if bucket in self.J else 0
        e = math.exp(p.epsilon / 2)
        stream = key(self.seed, Purpose.MEMO) if self.memoized else key(self.seed, Purpose.REPORT, r)
        bits = []
        for pos in range(d):
            prob = e / (e + 1) if pos == s - 1 else 1 / (e + 1)
            sub = s * d + pos if self.memoized else pos  # memoized: one bit per (memo input, position)
            b = int(uniform2(stream, self.id, sub) < prob)
            if p.gamma > 0 and uniform2(key(self.seed, Purpose.FLIP, r), self.id, pos) < p.gamma:
                b = 1 - b
            bits.append(b)
        charges = self.report_charges(r, s)
        if charges is None:
            return None, []
        columns: dict[str, Any] = {"b": tuple(bits)}
        if d < k:
            columns["j"] = tuple(self.J)
        return Report("report", r, columns), charges


# ------------------------------------------------------------------------------------ KFlip, Laplace
class KFlipReference(ReferenceDevice):
    """k-ary randomized response: the true bucket w.p. e^eps/(e^eps + k - 1), else a uniform other bucket."""

    def on_message(self, msg, day, value, present=True, now=0.0):
        p = self.params
        if not self.admit(msg, day) or not present:
            return None, []
        r, k = msg.round, p.buckets
        bucket = min(int(clip(float(value), 0.0, p.max_value) * k / p.max_value), k - 1)
        e = math.exp(p.epsilon)
        stream = key(self.seed, Purpose.REPORT, r)
        if uniform2(stream, self.id, 0) < e / (e + k - 1):
            y = bucket
        else:
            other = int(uniform2(stream, self.id, 1) * (k - 1))  # one of the k - 1 other buckets, in order
            y = other + 1 if other >= bucket else other
        if not self.affordable(p.epsilon):
            return None, []
        return Report("report", r, {"y": y}), [self.charge(r, FRESH_REPORT, p.epsilon)]


class LaplaceReference(ReferenceDevice):
    """Grid Laplace: x/step (step = m/1024) rounded up with probability its fractional part (uniform 0 of
    the round's noise stream), plus G1 - G2 with G = floor(ln(1 - u)/ln(alpha)), alpha = e^(-eps/1024)
    (uniforms 1 and 2), clamped to [-c, 1024 + c] steps, c = ceil(12 x 1024/eps); the report is n x step."""

    def on_message(self, msg, day, value, present=True, now=0.0):
        p = self.params
        if not self.admit(msg, day) or not present:
            return None, []
        r = msg.round
        step, log_alpha = p.max_value / 1024, -p.epsilon / 1024
        clamp = math.ceil(12.0 * 1024 / p.epsilon)
        stream = key(self.seed, Purpose.NOISE, r)
        f = clip(float(value), 0.0, p.max_value) / step
        k = math.floor(f) + (1 if uniform2(stream, self.id, 0) < f - math.floor(f) else 0)
        g1 = math.floor(math.log(1.0 - uniform2(stream, self.id, 1)) / log_alpha)
        g2 = math.floor(math.log(1.0 - uniform2(stream, self.id, 2)) / log_alpha)
        y = min(max(k + g1 - g2, -clamp), 1024 + clamp) * step
        if not self.affordable(p.epsilon):
            return None, []
        return Report("report", r, {"y": y}), [self.charge(r, FRESH_REPORT, p.epsilon)]


# ------------------------------------------------------------------------------------ several counters
class MultiReference(ReferenceDevice):
    """c counters, each a fresh 1BitMean bit at eps; a report costs the joint worst case
    eps + (c - 1) ln(1 + (e^eps - 1)/(c - 1)) (c >= 2; derived in protocols/multicounter.py's docstring)."""

    def joint_epsilon(self) -> float:
        c, eps = self.params.counters, self.params.epsilon
        return eps if c == 1 else eps + (c - 1) * math.log(1 + (math.exp(eps) - 1) / (c - 1))

    def on_message(self, msg, day, value, present=True, now=0.0):
        p = self.params
        if not self.admit(msg, day) or not present:
            return None, []
        r = msg.round
        stream = key(self.seed, Purpose.REPORT, r)
        bits = tuple(int(uniform2(stream, self.id, j) < bit_probability(clip(float(x), 0.0, p.max_value),
                                                                         p.epsilon, p.max_value))
                     for j, x in enumerate(value))
        if not self.affordable(self.joint_epsilon()):
            return None, []
        return Report("report", r, {"b": bits}), [self.charge(r, JOINT_REPORT, self.joint_epsilon())]


# ------------------------------------------------------------------------------------ epoch protocols
class EpochReference(ReferenceDevice):
    """A device that adds up its daily bits over epochs of l days; after an epoch's last day, ``mean`` is the
    epoch's mean if the device was there every day of it (``valid``)."""

    def __init__(self, params: Any, seed: int, device_id: int, limits: Any = None) -> None:
        super().__init__(params, seed, device_id, limits)
        self.l = int(params.epoch_length)
        self.day = 0
        self.ones = 0
        self.days_seen = 0
        self.mean = 0.0
        self.valid = False
        self.complete_epoch = 0

    def observe(self, day: int, value: float, present: bool = True) -> None:
        if day != self.day + 1:
            raise ValueError(f"days are observed in order: expected {self.day + 1}, got {day}")
        self.day = day
        if present:
            self.days_seen += 1
            self.ones += 1 if value > 0.5 else 0
        if day % self.l == 0:
            self.valid = self.days_seen == self.l
            if self.valid:
                self.mean = self.ones / self.l
            self.ones = self.days_seen = 0
            self.complete_epoch = day // self.l


class EpochRRReference(EpochReference):
    """One fresh 1BitMean bit (m = 1) of each epoch's mean at eps/T (Joseph et al. 2018's naive baseline)."""

    def on_message(self, msg, day, value=None, present=True, now=0.0):
        p = self.params
        if not self.admit(msg, self.complete_epoch) or not present:
            return None, []
        t = msg.round
        if not self.valid:
            return None, []
        eps_t = p.epsilon / p.epochs
        bit = int(uniform1(key(self.seed, Purpose.REPORT, t), self.id) < bit_probability(self.mean, eps_t, 1.0))
        if not self.affordable(eps_t):
            return None, []
        return Report("report", t, {"bit": bit}), [self.charge(t, FRESH_REPORT, eps_t)]


_DEPENDENCE: dict[tuple, bool] = {}


class ThreshReference(EpochReference):
    """THRESH (Joseph, Roth, Ullman, Waggoner 2018, Algorithms 1-3; docs/algorithms.md section 3), one device.

    After epoch t: VOTE on the collection request (the largest j in -1..L = floor(log2 T) with
    |p_t - p_f| > tau_j, tau_j = 2 (j + 1) sqrt(ln(12 n T/delta)/(2 l)) x tau_scale; yes iff the vote cap is
    open and 2^(L - j) divides t; P[1] = e^a/(e^a + 1) for yes, 1/(e^a + 1) otherwise); ESTIMATE on the
    decision (on an update with the estimate cap open: P[1] = (1 + p_t (e^b - 1))/(e^b + 1), charged b; else
    the data-free 1/(e^b + 1)). Caps: the paper's rule allows a step while the spend is < eps/4, the strict
    rule while spend + step <= eps/4. The vote reserve: at the first epoch whose vote could go either way
    depending on the data (the cap open, and among the possible epoch means k/l some give yes and some no,
    against its reference -1 or any earlier mean), the device is charged 2a (K_V - f) once (K_V: the yes votes
    the cap allows; f: the yes votes it already cast, all forced); later votes cost nothing. A device that
    cannot afford the reserve or an estimate under its budget sends the data-free message.

    Messages: a vote request only for the epoch the device has just completed, inside the horizon, once; a
    decision only for the epoch whose vote was just requested, once. A device votes and estimates only if it
    observed every day of the epoch and receives the message. On an update, a device that voted in the epoch
    and receives the decision takes the epoch's mean as its reference (it took part in the update)."""

    stages = ("vote", "estimate")

    def __init__(self, params: Any, seed: int, device_id: int, limits: Any = None) -> None:
        super().__init__(params, seed, device_id, limits)
        p = params
        self.a, self.b = float(p.vote_noise), float(p.estimate_noise)
        self.levels = int(p.epochs).bit_length() - 1  # floor(log2 T)
        unit = math.sqrt(math.log(12 * p.devices * p.epochs / p.delta) / (2 * p.epoch_length))
        self.tau = {j: 2 * (j + 1) * unit * p.tau_scale for j in range(-1, self.levels + 1)}
        self.k_vote = self.cap_count(self.a)
        self.k_estimate = self.cap_count(self.b)
        self.yes_votes = 0  # f
        self.estimates = 0
        self.reference = -1.0  # the epoch mean at the last global update it took part in; -1 before any
        self.reserved = False
        self.voted = 0  # last epoch whose vote was requested
        self.took_part = False  # sent a vote in that epoch
        self.estimated = 0  # last epoch whose decision it answered

    def cap_open(self, count: int, step: float) -> bool:
        spent = 0.0
        for _ in range(count):  # the spend as the device adds it up
            spent += step
        if self.params.cap_rule == "strict":
            return spent + step <= self.params.epsilon / 4 + CAP_SLACK
        return spent < self.params.epsilon / 4 - CAP_SLACK

    def cap_count(self, step: float) -> int:
        """K: how many steps the cap allows."""
        count = 0
        while self.cap_open(count, step):
            count += 1
        return count

    def votes_yes(self, diff: float, t: int) -> bool:
        """The vote rule without the cap: the largest j with diff > tau_j, and 2^(L - j) divides t (j >= 0)."""
        for j in range(self.levels, -2, -1):
            if diff > self.tau[j]:
                return j >= 0 and t % 2 ** (self.levels - j) == 0
        return False

    def depends_on_data(self, t: int) -> bool:
        """Whether an open-cap vote in epoch t can go either way with the data: epoch means are k/l; against
        the reference -1, |k/l + 1|; against an earlier epoch mean k'/l (any k'), |k - k'|/l."""
        fresh = self.reference < 0
        memo = (tuple(self.tau.values()), self.levels, self.l, t, fresh)
        if memo not in _DEPENDENCE:
            means = [k / self.l for k in range(self.l + 1)]
            refs = [-1.0] if fresh else means
            votes = {self.votes_yes(abs(mean - ref), t) for mean in means for ref in refs}
            _DEPENDENCE[memo] = len(votes) == 2
        return _DEPENDENCE[memo]

    def on_message(self, msg, day, value=None, present=True, now=0.0):
        p = self.params
        if msg.protocol != p.name or not isinstance(msg, (CollectionRequest, Decision)):
            self.ignore()
            return None, []
        t = msg.round
        if isinstance(msg, CollectionRequest):
            if not self.admit(msg, self.complete_epoch):
                return None, []
            self.voted, self.took_part = t, False
            if not present or not self.valid:
                return None, []
            self.took_part = True
            return self.vote(t)
        # the decision of the epoch whose vote was just requested, once, inside the horizon
        if not self.in_horizon(t) or t != self.voted or t != self.complete_epoch or t <= self.estimated:
            self.ignore()
            return None, []
        self.estimated = t
        return self.estimate(t, msg.update) if present and self.valid else (None, [])

    def vote(self, t: int) -> tuple[Report, list[Charge]]:
        a = self.a
        open_ = self.cap_open(self.yes_votes, a)
        yes = open_ and self.votes_yes(abs(self.mean - self.reference), t)
        charges = []
        if open_ and not self.reserved and self.depends_on_data(t):
            reserve = 2 * a * (self.k_vote - self.yes_votes)
            if self.affordable(reserve):
                charges.append(self.charge(t, THRESH_VOTE_RESERVE, reserve))
                self.reserved = True
            else:
                yes = False  # cannot afford it: a data-free no
        if yes:
            self.yes_votes += 1
        e = math.exp(a)
        q = e / (e + 1) if yes else 1 / (e + 1)
        bit = int(uniform1(key(self.seed, Purpose.VOTE, t), self.id) < q)
        return Report("vote", t, {"vote": bit}), charges

    def estimate(self, t: int, update: bool) -> tuple[Report, list[Charge]]:
        b = self.b
        truthful = update and self.cap_open(self.estimates, b) and self.affordable(b)
        charges = []
        if truthful:
            self.estimates += 1
            charges.append(self.charge(t, THRESH_ESTIMATE, b))
        elif not update:
            charges.append(Charge(t, THRESH_DUMMY, 0.0, False))
        if update and self.took_part:  # f(t) = t: it voted this epoch and hears the update
            self.reference = self.mean
        e = math.exp(b)
        q = (1 + self.mean * (e - 1)) / (e + 1) if truthful else 1 / (e + 1)
        bit = int(uniform1(key(self.seed, Purpose.ESTIMATE, t), self.id) < q)
        return Report("estimate", t, {"est": bit}), charges


# ------------------------------------------------------------------------------------ HeavyTHRESH, epochkrr
HEAVY_VOTE_RESERVE = "heavythresh_vote_reserve"
HEAVY_ESTIMATE = "heavythresh_estimate"
HEAVY_DUMMY = "heavythresh_dummy"


class ItemDays:
    """A device's days over epochs of l days, counted per item of a dictionary of k equal-width items of
    [0, m] (x is item min(floor(x (k/m)), k - 1)). After an epoch's last day, ``counts`` are that epoch's
    item counts if the device was there every day of it (``valid``)."""

    def __init__(self, l: int, k: int, m: float) -> None:
        self.l, self.k, self.m = l, k, m
        self.day = 0
        self.running = [0] * k
        self.days_seen = 0
        self.counts = [0] * k
        self.valid = False
        self.complete_epoch = 0

    def observe(self, day: int, value: float, present: bool) -> None:
        if day != self.day + 1:
            raise ValueError(f"days are observed in order: expected {self.day + 1}, got {day}")
        self.day = day
        if present:
            self.days_seen += 1
            self.running[min(int(clip(float(value), 0.0, self.m) * (self.k / self.m)), self.k - 1)] += 1
        if day % self.l == 0:
            self.valid = self.days_seen == self.l
            if self.valid:
                self.counts = list(self.running)
            self.running = [0] * self.k
            self.days_seen = 0
            self.complete_epoch = day // self.l

    def report(self, stream: int, device: int, eps: float) -> int:
        """An item drawn from the epoch's counts (the item of day floor(u0 l), counting the days item by item),
        then k-ary randomized response at eps: kept with e^eps/(e^eps + k - 1) (u1), else the (floor(u2 (k - 1)))-th
        of the other items in order."""
        day = min(int(uniform2(stream, device, 0) * self.l), self.l - 1)
        item, seen = 0, self.counts[0]
        while seen <= day:
            item += 1
            seen += self.counts[item]
        e = math.exp(eps)
        if uniform2(stream, device, 1) < e / (e + self.k - 1):
            return item
        other = min(int(uniform2(stream, device, 2) * (self.k - 1)), self.k - 2)
        return other + 1 if other >= item else other

    def uniform_item(self, stream: int, device: int) -> int:
        """The data-free report: a uniform item (u3)."""
        return min(int(uniform2(stream, device, 3) * self.k), self.k - 1)


class HeavyThreshReference(ThreshReference):
    """HeavyTHRESH (Joseph et al. 2018, section 5, as designed in protocols/heavythresh.py; docs/heavythresh.md),
    one device: THRESH's messages, caps, vote rule and vote reserve (:class:`ThreshReference`) over its epoch
    item counts. The vote compares d = max_v |c_t(v) - c_f(v)|/l (c_f: the counts at the last update it took
    part in; none before: d = +inf, a forced yes) with tau_j = 2 (j + 1) sqrt(ln(12 D n T/delta)/(2 l)) x
    tau_scale. A vote depends on the data only with a reference (d then takes every value m/l). The estimate on
    an update with the cap open is D-ary randomized response at b of an item drawn from the epoch's counts,
    charged b; every other estimate a uniform item."""

    def __init__(self, params: Any, seed: int, device_id: int, limits: Any = None) -> None:
        super().__init__(params, seed, device_id, limits)
        p = params
        self.items = ItemDays(int(p.epoch_length), int(p.buckets), float(p.max_value))
        unit = math.sqrt(math.log(12 * p.buckets * p.devices * p.epochs / p.delta) / (2 * p.epoch_length))
        self.tau = {j: 2 * (j + 1) * unit * p.tau_scale for j in range(-1, self.levels + 1)}
        self.ref_counts: list[int] | None = None

    def observe(self, day: int, value: float, present: bool = True) -> None:
        self.items.observe(day, value, present)
        self.valid, self.complete_epoch = self.items.valid, self.items.complete_epoch

    def depends_on_data(self, t: int) -> bool:
        if self.ref_counts is None:
            return False
        return len({self.votes_yes(m / self.l, t) for m in range(self.l + 1)}) == 2

    def vote(self, t: int) -> tuple[Report, list[Charge]]:
        a = self.a
        open_ = self.cap_open(self.yes_votes, a)
        c, r = self.items.counts, self.ref_counts
        diff = math.inf if r is None else max(abs(x - y) for x, y in zip(c, r)) / self.l
        yes = open_ and self.votes_yes(diff, t)
        charges = []
        if open_ and not self.reserved and self.depends_on_data(t):
            reserve = 2 * a * (self.k_vote - self.yes_votes)
            if self.affordable(reserve):
                charges.append(self.charge(t, HEAVY_VOTE_RESERVE, reserve))
                self.reserved = True
            else:
                yes = False
        if yes:
            self.yes_votes += 1
        e = math.exp(a)
        q = e / (e + 1) if yes else 1 / (e + 1)
        bit = int(uniform1(key(self.seed, Purpose.VOTE, t), self.id) < q)
        return Report("vote", t, {"vote": bit}), charges

    def estimate(self, t: int, update: bool) -> tuple[Report, list[Charge]]:
        b = self.b
        truthful = update and self.cap_open(self.estimates, b) and self.affordable(b)
        charges = []
        if truthful:
            self.estimates += 1
            charges.append(self.charge(t, HEAVY_ESTIMATE, b))
        elif not update:
            charges.append(Charge(t, HEAVY_DUMMY, 0.0, False))
        if update and self.took_part:
            self.ref_counts = list(self.items.counts)
        stream = key(self.seed, Purpose.ESTIMATE, t)
        y = self.items.report(stream, self.id, b) if truthful else self.items.uniform_item(stream, self.id)
        return Report("estimate", t, {"y": y}), charges


class EpochKRRReference(ReferenceDevice):
    """Per-epoch D-ary randomized response at eps/T of an item drawn from the epoch's counts (HeavyTHRESH's
    naive baseline), charged eps/T."""

    def __init__(self, params: Any, seed: int, device_id: int, limits: Any = None) -> None:
        super().__init__(params, seed, device_id, limits)
        self.items = ItemDays(int(params.epoch_length), int(params.buckets), float(params.max_value))

    def observe(self, day: int, value: float, present: bool = True) -> None:
        self.items.observe(day, value, present)

    def on_message(self, msg, day, value=None, present=True, now=0.0):
        p = self.params
        if not self.admit(msg, self.items.complete_epoch) or not present or not self.items.valid:
            return None, []
        t = msg.round
        eps_t = p.epsilon / p.epochs
        y = self.items.report(key(self.seed, Purpose.REPORT, t), self.id, eps_t)
        if not self.affordable(eps_t):
            return None, []
        return Report("report", t, {"y": y}), [self.charge(t, FRESH_REPORT, eps_t)]


# ------------------------------------------------------------------------------------ ToPL, ToPS
def square_wave(v: float, eps: float, u1: float, u2: float) -> float:
    """Square Wave (Li et al. SIGMOD 2020) of v in [0, 1]: b = (eps e^eps - e^eps + 1)/(2 e^eps (e^eps - 1 - eps)),
    p = e^eps/(2 b e^eps + 1); with probability 2 b p uniform on [v - b, v + b], else uniform on the rest of
    [-b, 1 + b] (length 1): u2 - b below v, u2 + b above."""
    e = math.exp(eps)
    b = sw_half_width(eps)
    p = e / (2 * b * e + 1)
    if u1 < 2 * b * p:
        return v - b + 2 * b * u2
    return u2 - b if u2 < v else u2 + b


def sw_half_width(eps: float) -> float:
    """Square Wave's b = (eps e^eps - e^eps + 1)/(2 e^eps (e^eps - 1 - eps))."""
    e = math.exp(eps)
    return (eps * e - e + 1.0) / (2.0 * e * (math.expm1(eps) - eps))


def hybrid_bound(eps: float) -> float:
    """The bound of the Hybrid Mechanism's output range: the larger of PM's (e^(eps/2) + 1)/(e^(eps/2) - 1)
    and SR's (e^eps + 1)/(e^eps - 1)."""
    e, h = math.exp(eps), math.exp(eps / 2)
    return max((h + 1) / (h - 1), (e + 1) / (e - 1))


def to_grid(y: float, low: float, high: float, u: float) -> float:
    """A report leaves the device on the grid low + n (high - low)/2^16, y rounded up with probability its
    fractional position (the float bits of y would otherwise leak the input)."""
    step = (high - low) / 2.0**16
    f = (y - low) / step
    n = math.floor(f)
    n = min(max(n + (1 if u < f - n else 0), 0), 2**16)
    return min(low + n * step, high)


def hybrid(t: float, eps: float, u_choice: float, u1: float, u2: float) -> float:
    """Hybrid Mechanism (Wang et al. ICDE 2019) of t in [-1, 1]: for eps > 0.61, the Piecewise Mechanism with
    probability alpha = 1 - e^(-eps/2), else Stochastic Rounding; SR only for eps <= 0.61.
    SR: +C w.p. 1/2 + t (e^eps - 1)/(2 (e^eps + 1)), else -C, C = (e^eps + 1)/(e^eps - 1) (uses u1).
    PM: C = (e^(eps/2) + 1)/(e^(eps/2) - 1), l = (C + 1)/2 t - (C - 1)/2, r = l + C - 1; w.p.
    e^(eps/2)/(e^(eps/2) + 1) (u1) uniform on [l, r] (at l + u2 (C - 1)), else uniform on [-C, l) U (r, C]
    (u2 (C + 1) along the two pieces)."""
    alpha = 1 - math.exp(-eps / 2) if eps > 0.61 else 0.0
    if alpha > 0 and u_choice < alpha:
        h = math.exp(eps / 2)
        c = (h + 1) / (h - 1)
        left = (c + 1) / 2 * t - (c - 1) / 2
        right = left + c - 1
        if u1 < h / (h + 1):
            return left + u2 * (c - 1)
        pos = u2 * (c + 1)
        return pos - c if pos < left + c else right + (pos - (left + c))
    e = math.exp(eps)
    c = (e + 1) / (e - 1)
    return c if u1 < 0.5 + t * (e - 1) / (2 * (e + 1)) else -c


class ToplReference(ReferenceDevice):
    """ToPL (Wang et al. CCS 2021): in a threshold round (round 1, every K rounds after it, the rounds named in
    rethreshold_at) a keyed holdout (fresh each such round) sends Square Wave of x/m at threshold_epsilon;
    the device takes a broadcast threshold theta (plausible and newer than its own) from its round on; every
    round it reports HM at eps of t = 2 min(x, theta)/theta - 1 with the version of its theta. One report a
    round; each charged its epsilon (event level)."""

    stages = ("holdout", "report")

    def __init__(self, params: Any, seed: int, device_id: int, limits: Any = None) -> None:
        super().__init__(params, seed, device_id, limits)
        self.theta = 0.0
        self.version = 0
        self.reported = 0  # last round it sent a report

    def threshold_round(self, r: int) -> bool:
        p = self.params
        return r == 1 or (p.rethreshold_every > 0 and (r - 1) % p.rethreshold_every == 0) or r in p.rethreshold_at

    def in_holdout(self, r: int) -> bool:
        return self.threshold_round(r) and uniform1(key(self.seed, Purpose.HOLDOUT, r), self.id) < self.params.holdout

    def on_message(self, msg, day, value, present=True, now=0.0):
        p = self.params
        r = msg.round
        if not isinstance(msg, (CollectionRequest, Threshold)) or msg.protocol != p.name:
            self.ignore()
            return None, []
        if isinstance(msg, CollectionRequest) and not self.admit(msg, day):
            return None, []
        if isinstance(msg, Threshold):
            plausible = math.isfinite(msg.theta) and p.max_value * 1e-9 <= msg.theta <= p.max_value
            expected = sum(1 for t in range(1, r + 1) if self.threshold_round(t))  # the public version schedule
            if (r != day or not self.in_horizon(r) or not plausible or not self.threshold_round(r)
                    or msg.version != expected):
                self.ignore()
                return None, []
            if not present:
                return None, []
            if msg.version <= self.version:  # received, but it holds this version already
                self.ignore()
                return None, []
            self.theta, self.version = msg.theta, msg.version
            if self.in_holdout(r):
                return None, []
            return self.report(r, value, holdout=False)
        if not present:
            return None, []
        if self.threshold_round(r):
            return self.report(r, value, holdout=True) if self.in_holdout(r) else (None, [])
        return self.report(r, value, holdout=False) if self.version > 0 else (None, [])

    def report(self, r: int, value: float, holdout: bool) -> tuple[Report | None, list[Charge]]:
        p = self.params
        eps = p.threshold_epsilon if holdout else p.epsilon
        if self.reported >= r or not self.affordable(eps):
            return None, []
        self.reported = r
        u = [uniform1(key(self.seed, Purpose.REPORT, r, k), self.id) for k in range(7)]
        x = float(value)
        if holdout:
            y = square_wave(clip(x / p.max_value, 0.0, 1.0), p.threshold_epsilon, u[0], u[1])
            b = sw_half_width(p.threshold_epsilon)
            rep = Report("holdout", r, {"s": to_grid(y, -b, 1 + b, u[5])})
        else:
            t = 2 * min(x, self.theta) / self.theta - 1
            c = hybrid_bound(p.epsilon)
            rep = Report("report", r, {"y": to_grid(hybrid(t, p.epsilon, u[2], u[3], u[4]), -c, c, u[6]),
                                       "v": self.version})
        return rep, [self.charge(r, EVENT_REPORT, eps)]


class TopsReference(ReferenceDevice):
    """ToPS (central DP): the raw value, clipped to [0, m], to the trusted collector every round; charged eps
    (the release), or threshold_epsilon for a round-1 holdout value (it only chooses theta)."""

    def on_message(self, msg, day, value, present=True, now=0.0):
        p = self.params
        if not self.admit(msg, day) or not present:
            return None, []
        r = msg.round
        hold = r == 1 and uniform1(key(p.seed, Purpose.HOLDOUT, 1), self.id) < p.holdout
        cost = p.threshold_epsilon if hold else p.epsilon
        if not self.affordable(cost):
            return None, []
        charge = self.charge(r, CENTRAL_THRESHOLD if hold else CENTRAL_RELEASE, cost)
        return Report("report", r, {"x": clip(float(value), 0.0, p.max_value)}), [charge]


MODELS: dict[str, type[ReferenceDevice]] = {
    "1bitmean": OneBitReference, "1bitrrpm": OneBitReference,
    "dbitflip": DBitFlipReference, "dbitflippm": DBitFlipReference, "binflip": DBitFlipReference,
    "kflip": KFlipReference, "laplace": LaplaceReference, "1bitmulti": MultiReference,
    "epochrr": EpochRRReference, "thresh": ThreshReference, "topl": ToplReference, "tops": TopsReference,
    "heavythresh": HeavyThreshReference, "epochkrr": EpochKRRReference,
}


def model_of(params: Any) -> Any:
    """The reference model class of ``params``: its own ``reference_model`` (a plugin protocol brings one,
    written against this module's ReferenceDevice), else the built-in one of its name."""
    own = getattr(params, "reference_model", None)
    if own is not None:
        return own
    try:
        return MODELS[params.name]
    except KeyError:
        raise ValueError(f"no reference model for protocol {params.name!r}: give its parameter class a "
                         f"reference_model (a ReferenceDevice subclass) to audit it") from None


def reference_device(params: Any, seed: int, device_id: int, limits: Any = None) -> ReferenceDevice:
    """The reference model of one device of ``params``'s protocol."""
    return model_of(params)(params, seed, device_id, limits)


def stages_of(params: Any) -> tuple[str, ...]:
    """The transcript stages of a protocol, in order."""
    return model_of(params).stages
