"""Empirical privacy audits: lower bounds on epsilon measured on canary devices (``ldpsim privacy-audit``).

The ledger says what a device was charged; an audit measures what its transcript actually reveals. This
is the distinguishing game of black-box LDP auditing (Arcolezi and Gambs, PETS 2024), played on the
simulator's own device objects and extended to whole transcripts of interactive, stateful protocols:

1. Canary devices, ``trials`` per input, run through the real runtime (scenarios.runner: the same device
   sides, collector and network as ``ldpsim run``) with one of two inputs: a pair of values for one report,
   or a pair of value sequences over T collections (light against heavy usage, a change against none, two
   different change rounds). THRESH runs against the ``always_update`` collector, its worst case.
2. A test decides, from each canary's whole transcript, which input it had. Where the protocol writes its
   transcript likelihood down (``log_likelihood`` on its parameters, protocols/likelihood.py) the test is
   the exact likelihood ratio, the most powerful one (Neyman-Pearson); otherwise an empirical likelihood
   ratio learned on a calibration split (the joint histogram of whole transcripts when they take few
   values, else a product of per-field histograms).
3. The test's threshold is chosen on the calibration split (20% of the canaries) and applied once to the
   rest. With TPR = P[guess 1 | input 1] and FPR = P[guess 1 | input 0] measured there, any eps-LDP
   mechanism has TPR <= e^eps FPR, so eps_lb = ln(TPR_low / FPR_high), with two-sided 99% Clopper-Pearson
   intervals on each rate (one end of each: 0.5% to fail apiece), is a lower bound on the true epsilon with
   confidence at least 99%. eps_hat = ln(TPR / FPR) is
   the point estimate. A lower bound above the protocol's claim is a bug in the protocol's code or its
   accounting.

The claim a row is checked against: the canaries' largest ledger spend (what the system claims about
these devices); for the one-report game the per-report guarantee ``round_epsilon`` where it is smaller
(output perturbation: 0.776 against a charge of 1 for 1BitRRPM at eps = 1, gamma = 0.1); and for
memoized protocols when the two inputs have different behavior patterns: the
ledger's pattern width x eps only holds within a pattern (Ding et al. 2017, Theorem 4), so the claim is
then the protocol's worst-case loss over the horizon (protocols/worst_case.py; infinite without output
perturbation). docs/privacy_audit.md has the derivations and the table for every protocol.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from protocols.ledger import exceeds
from scenarios import jsonout, schema
from scenarios.schema import PROTOCOLS, Scenario, ScenarioError

LEVEL = 0.99  # confidence of each Clopper-Pearson interval
CALIBRATION = 0.2  # share of each input's canaries that chooses the test's threshold
CHUNK = 65_536  # canaries whose transcripts are decoded at once
MAX_CANDIDATES = 4_096  # thresholds tried on the calibration split
BINS = 32  # quantile bins of a real-valued report field (empirical test)


def _protocol_class(name: str) -> type | None:
    """The parameter class registered under ``name``, or None."""
    from protocols import registry

    try:
        return registry.lookup(name).params
    except registry.RegistryError:
        return None


def default_table(name: str) -> dict[str, Any] | None:
    """The [protocol] table an audit uses when given a protocol name: the example its parameter class gives
    (``examples``; epsilon 1 unless the protocol's own accounting needs more), or None."""
    cls = _protocol_class(name)
    if cls is None:
        return None
    examples = getattr(cls, "examples", {})
    table = examples.get(name)
    if table is None and ":" in name and len(examples) == 1:  # module:Class: its example, under the wire name
        (table,) = examples.values()
    return None if table is None else {"name": name, **table}




# ------------------------------------------------------------------------------------------------ games
@dataclass(frozen=True)
class Game:
    """Two inputs over ``collections`` collection rounds: each a step function given as (first collection,
    value as a fraction of max_value) steps, the first at collection 1."""

    name: str
    collections: int
    input0: tuple[tuple[int, float], ...]
    input1: tuple[tuple[int, float], ...]

    def described(self, bits: bool = False) -> dict[str, str]:
        """The two inputs in words, for privacy_audit.json and .csv: e.g. ``"0 from collection 1, max_value
        from collection 16"`` (daily-bit protocols: ``"bit 0 ..."``; other levels as a fraction of max_value)."""
        def value(frac: float) -> str:
            if bits:
                return f"bit {frac:g}" if frac in (0.0, 1.0) else f"bit 1 with probability {frac:g}"
            return {0.0: "0", 1.0: "max_value"}.get(frac, f"{frac:g} x max_value")

        return {f"input{k}": ", ".join(f"{value(frac)} from collection {c}" for c, frac in steps)
                for k, steps in ((0, self.input0), (1, self.input1))}

    def values(self, which: int, max_value: float) -> np.ndarray:
        """The input's value at each collection round 1..T."""
        out = np.empty(self.collections)
        for start, frac in (self.input1 if which else self.input0):
            out[start - 1:] = frac * max_value
        return out

    def same_pattern(self) -> bool:
        """Whether the two inputs have the same behavior pattern (Ding et al. 2017, Definition 2): the same
        sequence up to renaming its distinct values."""
        def pattern(seq: np.ndarray) -> tuple[int, ...]:
            names: dict[float, int] = {}
            return tuple(names.setdefault(float(v), len(names)) for v in seq)
        return pattern(self.values(0, 1.0)) == pattern(self.values(1, 1.0))


def games(rounds: int) -> list[Game]:
    """The games of an audit: one report (lowest against highest value), then, for ``rounds`` > 1, light
    against heavy usage, a change at mid-run against none, and a change at a third against one at two thirds
    (the values are 0 and max_value, so memoized protocols round them without noise)."""
    out = [Game("one report", 1, ((1, 0.0),), ((1, 1.0),))]
    if rounds > 1:
        mid, early, late = rounds // 2 + 1, rounds // 3 + 1, (2 * rounds) // 3 + 1
        out += [Game("light vs heavy", rounds, ((1, 0.0),), ((1, 1.0),)),
                Game("change vs none", rounds, ((1, 0.0),), ((1, 0.0), (mid, 1.0))),
                Game("change round", rounds, ((1, 0.0), (early, 1.0)), ((1, 0.0), (late, 1.0)))]
        if late == early:  # too few rounds for two different change rounds
            out.pop()
    return out


# ------------------------------------------------------------------------------------------------ canaries
def canary_scenario(table: dict[str, Any], game: Game, trials: int, seed: int,
                    overrides: Sequence[str] = ()) -> Scenario:
    """The scenario that runs ``trials`` canaries per input: group ``input0`` (ids 0..N-1) and ``input1``
    (N..2N-1), each starting at its input's first value, with scripted changes for its later steps."""
    from protocols import registry

    name = table["name"]
    cls = registry.lookup(name).params
    bits = bool(getattr(cls, "collects_bits", False))  # daily bits: a Bernoulli level of 0 or 1 is a fixed bit
    epoch = int(table.get("epoch_length", 1))
    counters = int(table.get("counters", 0))

    def counter(frac: float) -> dict[str, Any]:
        if bits:
            return {"dist": "bernoulli", "p": frac}
        return {"dist": "constant", "value": frac * float(table.get("max_value", 1.0))}

    groups, changes = [], []
    for which, steps in ((0, game.input0), (1, game.input1)):
        group: dict[str, Any] = {"name": f"input{which}", "share": 0.5, "counter": counter(steps[0][1])}
        if counters:  # several counters: the whole value in the first one (weights must be positive)
            group["apps"] = [1.0] + [1e-12] * (counters - 1)
        groups.append(group)
        changes += [{"round": (start - 1) * epoch + 1, "group": f"input{which}", "counter": counter(frac)}
                    for start, frac in steps[1:]]
    data: dict[str, Any] = {
        "name": f"privacy-audit-{name}", "seed": seed, "rounds": game.collections * epoch,
        "population": {"devices": 2 * trials, "groups": groups}, "changes": changes,
        "protocol": dict(table), "simulation": {"cohort_size": min(2 * trials, 262_144)},
    }
    if "always_update" in getattr(cls, "collector_behaviors", ()):  # the worst case of a voting protocol
        data["collector"] = {"behavior": "always_update"}
    data = schema.apply_overrides(data, list(overrides))
    data.setdefault("analysis", {"attacks": False})  # canaries need no attack metrics
    return schema.parse(data)


# ------------------------------------------------------------------------------------------------ transcripts
@dataclass
class StageRecords:
    """One report stage of a finished run: its column layout and stored round records."""

    name: str
    columns: tuple[Any, ...]
    collector: Any

    def rounds(self) -> int:
        return len(self.collector.transcript)

    def decode(self, lo: int, hi: int) -> tuple[np.ndarray, list[dict[str, np.ndarray]]]:
        """Canaries lo..hi-1 (lo a multiple of 8): presence (devices, rounds) and each round's columns."""
        present, reports = [], []
        for _, record in self.collector.transcript:
            here, cols = self.collector.record_columns(record, lo, hi)
            present.append(here)
            reports.append(cols)
        return np.stack(present, axis=1) if present else np.zeros((hi - lo, 0), bool), reports


def stages_of(result: Any) -> list[StageRecords]:
    return [StageRecords(name, tuple(s.columns), s) for name, s in result.collector.protocol.stages()]


def _chunks(lo: int, hi: int) -> list[tuple[int, int]]:
    start = lo - lo % 8
    return [(max(a, lo), min(a + CHUNK, hi)) for a in range(start, hi, CHUNK)]


def exact_scores(params: Any, game: Game, stage: StageRecords, n: int) -> np.ndarray:
    """log P[transcript | input 1] - log P[transcript | input 0] for every canary, from the protocol's own
    likelihood (the most powerful test)."""
    v0, v1 = game.values(0, params.max_value), game.values(1, params.max_value)
    out = np.empty(n)
    for lo, hi in _chunks(0, n):
        a = lo - lo % 8
        present, reports = stage.decode(a, hi)
        present, reports = present[lo - a:], [{k: v[lo - a:] for k, v in r.items()} for r in reports]
        out[lo:hi] = params.log_likelihood(v1, reports, present) - params.log_likelihood(v0, reports, present)
    return out


LOW_BITS = 4  # a real-valued field also contributes its lowest mantissa bits (floating-point leaks)


def _features(stages: list[StageRecords], lo: int, hi: int, low_bits: bool = True) -> np.ndarray:
    """Every field of canaries lo..hi-1's transcripts as columns: presence and each column value, for every
    stage and round (real values as float64, the rest as integers in float64). A real value also gives the
    integer of its LOW_BITS lowest mantissa bits: a mechanism computed in floating point can leak its input
    there (Mironov, CCS 2012), and an honest one makes them a function of what it means to send."""
    a = lo - lo % 8
    parts = []
    for st in stages:
        present, reports = st.decode(a, hi)
        parts.append(present[lo - a:].astype(np.float64))
        for r in reports:
            for name, col in r.items():
                col = col[lo - a:]
                parts.append(col.astype(np.float64))
                if low_bits and col.dtype.kind == "f":
                    bits = np.ascontiguousarray(col, dtype=np.float64).view(np.uint64)
                    parts.append((bits & np.uint64(2**LOW_BITS - 1)).astype(np.float64))
    return np.concatenate(parts, axis=1) if parts else np.zeros((hi - lo, 0))


class EmpiricalTest:
    """An empirical log-likelihood ratio learned on calibration transcripts: the joint histogram of whole
    transcripts when they take few distinct values, else a product of per-field histograms (exact when the
    fields are independent given the input, as for fresh randomized response and THRESH's messages)."""

    def __init__(self, f0: np.ndarray, f1: np.ndarray, real: np.ndarray) -> None:
        self.real = real
        pooled = np.concatenate([f0, f1])
        self.edges = [np.unique(np.quantile(pooled[:, j], np.linspace(0, 1, BINS + 1)[1:-1]))
                      if real[j] else None for j in range(pooled.shape[1])]
        c0, c1 = self._codes(f0), self._codes(f1)
        self.n0, self.n1 = c0.shape[0], c1.shape[0]
        h0, h1 = self._hash(c0), self._hash(c1)
        distinct = np.unique(np.concatenate([h0, h1])).size
        self.joint = distinct <= max(64, (self.n0 + self.n1) // 50)
        if self.joint:
            self.keys, self.table = self._table(h0, h1)
        else:
            self.fields = [self._table(c0[:, j], c1[:, j]) for j in range(c0.shape[1])]
        self.method = ("empirical likelihood ratio of whole transcripts" if self.joint
                       else "empirical likelihood ratio, product over report fields")

    def _codes(self, f: np.ndarray) -> np.ndarray:
        out = np.empty(f.shape, dtype=np.int64)
        for j, e in enumerate(self.edges):
            out[:, j] = np.searchsorted(e, f[:, j]) if e is not None else f[:, j].astype(np.int64)
        return out

    @staticmethod
    def _hash(codes: np.ndarray) -> np.ndarray:
        h = np.zeros(codes.shape[0], dtype=np.uint64)
        with np.errstate(over="ignore"):
            for j in range(codes.shape[1]):
                mult = np.uint64(((j + 1) * 0xBF58476D1CE4E5B9 & (2**64 - 1)) | 1)
                h = (h ^ (codes[:, j].astype(np.uint64) * mult)) * np.uint64(0x9E3779B97F4A7C15)
                h ^= h >> np.uint64(29)
        return h

    def _table(self, x0: np.ndarray, x1: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Sorted distinct values and their smoothed log ratio log(P1/P0) (add-half smoothing)."""
        keys = np.unique(np.concatenate([x0, x1]))
        k0 = np.bincount(np.searchsorted(keys, x0), minlength=keys.size)
        k1 = np.bincount(np.searchsorted(keys, x1), minlength=keys.size)
        v = keys.size
        return keys, np.log((k1 + 0.5) / (self.n1 + 0.5 * v)) - np.log((k0 + 0.5) / (self.n0 + 0.5 * v))

    @staticmethod
    def _lookup(keys: np.ndarray, table: np.ndarray, x: np.ndarray) -> np.ndarray:
        at = np.minimum(np.searchsorted(keys, x), keys.size - 1)
        return np.where(keys[at] == x, table[at], 0.0)  # a value never seen in calibration: no evidence

    def score(self, f: np.ndarray) -> np.ndarray:
        codes = self._codes(f)
        if self.joint:
            return self._lookup(self.keys, self.table, self._hash(codes))
        return sum((self._lookup(k, t, codes[:, j]) for j, (k, t) in enumerate(self.fields)),
                   np.zeros(f.shape[0]))


def empirical_scores(stages: list[StageRecords], trials: int, calib: int) -> tuple[np.ndarray, str]:
    """Empirical log-likelihood ratios of every canary (input 0: ids 0..trials-1, input 1: the rest). Two
    tests are learned on the first half of each input's calibration canaries, with and without the low
    mantissa bits of real values (they find floating-point leaks but dilute a histogram that has none); the
    one whose threshold does better on the second half is kept. The held-out canaries play no part."""
    fit = max(1, calib // 2)
    best: tuple[float, np.ndarray, str] | None = None
    for low_bits in (False, True):
        f0 = _features(stages, 0, fit, low_bits)
        f1 = _features(stages, trials, trials + fit, low_bits)
        if low_bits and f0.shape[1] == _features(stages, 0, min(8, fit), False).shape[1]:
            break  # no real-valued field: the second test would be the first
        real = np.array([np.any(f != np.round(f)) for f in np.concatenate([f0, f1]).T], dtype=bool)
        test = EmpiricalTest(f0, f1, real)
        scores = np.empty(2 * trials)
        for lo, hi in _chunks(0, 2 * trials):
            scores[lo:hi] = test.score(_features(stages, lo, hi, low_bits))
        c0, c1 = scores[fit:calib], scores[trials + fit:trials + calib]
        if c0.size == 0 or c1.size == 0:
            return scores, test.method
        d = choose_test(c0, c1)
        quality = evaluate(d, c0, c1).eps_lb
        method = test.method + (" (with low mantissa bits)" if low_bits else "")
        if best is None or quality > best[0]:
            best = (quality, scores, method)
    assert best is not None
    return best[1], best[2]


# ------------------------------------------------------------------------------------------------ statistics
def clopper_pearson(k: np.ndarray | int, n: int, level: float = LEVEL) -> tuple[np.ndarray, np.ndarray]:
    """Two-sided Clopper-Pearson interval of a binomial proportion: k successes in n trials."""
    from scipy.stats import beta

    k = np.asarray(k, dtype=np.float64)
    a = (1.0 - level) / 2
    with np.errstate(invalid="ignore"):
        lo = np.where(k > 0, beta.ppf(a, k, n - k + 1), 0.0)
        hi = np.where(k < n, beta.ppf(1 - a, k + 1, n - k), 1.0)
    return lo, hi


def _log_ratio(num: np.ndarray | float, den: np.ndarray | float) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(num > 0, np.log(num) - np.log(den), -np.inf)


@dataclass(frozen=True)
class Decision:
    """Guess input 1 when the score is >= threshold (direction +1), or guess input 0 when it is <= the
    threshold (direction -1: the roles of the inputs swap in TPR and FPR)."""

    direction: int
    threshold: float


def choose_test(s0: np.ndarray, s1: np.ndarray) -> Decision:
    """The threshold and direction whose Clopper-Pearson lower bound on the calibration split is largest."""
    s0, s1 = np.sort(s0), np.sort(s1)
    cand = np.unique(np.concatenate([s0, s1]))
    if cand.size > MAX_CANDIDATES:
        cand = np.unique(np.quantile(cand, np.linspace(0, 1, MAX_CANDIDATES)))
    best, out = -np.inf, Decision(1, float(cand[0]) if cand.size else 0.0)
    for direction in (1, -1):
        if direction == 1:
            tp, fp = s1.size - np.searchsorted(s1, cand, "left"), s0.size - np.searchsorted(s0, cand, "left")
            n_t, n_f = s1.size, s0.size
        else:
            tp, fp = np.searchsorted(s0, cand, "right"), np.searchsorted(s1, cand, "right")
            n_t, n_f = s0.size, s1.size
        lb = _log_ratio(clopper_pearson(tp, n_t)[0], clopper_pearson(fp, n_f)[1])
        i = int(np.argmax(lb))
        if lb[i] > best:
            best, out = float(lb[i]), Decision(direction, float(cand[i]))
    return out


@dataclass(frozen=True)
class Outcome:
    tpr: float
    fpr: float
    eps_hat: float
    eps_lb: float
    eps_ub: float
    tpr_interval: tuple[float, float]
    fpr_interval: tuple[float, float]


def evaluate(decision: Decision, s0: np.ndarray, s1: np.ndarray) -> Outcome:
    """TPR, FPR and epsilon with its 99% Clopper-Pearson bounds for ``decision`` on held-out scores."""
    if decision.direction == 1:
        tp, n_t = int(np.count_nonzero(s1 >= decision.threshold)), s1.size
        fp, n_f = int(np.count_nonzero(s0 >= decision.threshold)), s0.size
    else:
        tp, n_t = int(np.count_nonzero(s0 <= decision.threshold)), s0.size
        fp, n_f = int(np.count_nonzero(s1 <= decision.threshold)), s1.size
    (t_lo, t_hi), (f_lo, f_hi) = clopper_pearson(tp, n_t), clopper_pearson(fp, n_f)
    tpr, fpr = tp / n_t, fp / n_f
    return Outcome(tpr, fpr, float(_log_ratio(np.float64(tpr), np.float64(fpr))),
                   max(0.0, float(_log_ratio(t_lo, f_hi))), float(_log_ratio(t_hi, f_lo)),
                   (float(t_lo), float(t_hi)), (float(f_lo), float(f_hi)))


# ------------------------------------------------------------------------------------------------ one audit
@dataclass
class Row:
    """One line of an audit: a protocol, a game, the claim and what the canaries showed."""

    protocol: str
    game: str
    rounds: int
    claimed: float | None
    claim_source: str
    guarantee: float | None
    eps_hat: float | None
    eps_lb: float | None
    eps_ub: float | None
    tpr: float | None
    fpr: float | None
    tpr_interval: tuple[float, float] | None
    fpr_interval: tuple[float, float] | None
    trials: int
    test_trials: int
    statistic: str
    collector: str
    seconds: float
    transcripts_per_second: float | None
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def exceeds(self) -> bool:
        """Whether the lower bound is above the claim: the implementation leaks more than it charges."""
        return (self.eps_lb is not None and self.claimed is not None
                and bool(exceeds(self.eps_lb, self.claimed)))

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for k in ("claimed", "guarantee", "eps_hat", "eps_lb", "eps_ub"):
            v = out[k]
            out[k] = None if v is None or not math.isfinite(v) else v
        out["exceeds_claim"] = self.exceeds
        out.update(out.pop("extra"))
        return out


def _claim(params: Any, game: Game, ledger_max: float) -> tuple[float, str]:
    """The claim the game is checked against (module docstring): the ledger, or the worst-case loss for a
    memoized protocol whose two inputs fall in different behavior patterns."""
    g = params.guarantee(game.collections)
    if g.worst_case is not None and not game.same_pattern():
        value = g.worst_case[0]
        return float(value), f"worst-case loss over {game.collections} rounds (different behavior patterns)"
    per_report = float(params.round_epsilon)
    if game.collections == 1 and params.kind != "epoch" and per_report < ledger_max:
        # one report: the per-report guarantee, tighter than the charge where output perturbation (or a fresh
        # layer over a memoized one) makes a report cheaper than the reveal it is charged for
        return per_report, "the per-report guarantee (round_epsilon), below the ledger's charge"
    return ledger_max, "largest ledger spend of the canaries"


def audit_game(table: dict[str, Any], game: Game, trials: int, seed: int = 1,
               overrides: Sequence[str] = (), transform: Callable[[Scenario], Scenario] | None = None) -> Row:
    """Run the canaries of one game and measure epsilon. ``transform`` edits the canary scenario before it
    runs (tests use it to plant a device that spends more than it charges)."""
    from scenarios.runner import run

    t0 = time.perf_counter()
    sc = canary_scenario(table, game, trials, seed, overrides)
    if transform is not None:
        sc = transform(sc)
    params = sc.protocol
    result = run(sc)
    n = sc.devices
    stages = stages_of(result)
    calib = max(1, int(round(CALIBRATION * trials)))
    idx0, idx1 = np.arange(0, trials), np.arange(trials, n)
    exact = getattr(params, "log_likelihood", None) is not None and len(stages) == 1
    if exact:
        scores = exact_scores(params, game, stages[0], n)
        statistic = "exact likelihood ratio"
    else:
        scores, statistic = empirical_scores(stages, trials, calib)
    s0, s1 = scores[idx0], scores[idx1]
    decision = choose_test(s0[:calib], s1[:calib])
    outcome = evaluate(decision, s0[calib:], s1[calib:])
    ledger_max = float(result.ledger.spend.max()) if result.ledger.spend.size else 0.0
    claimed, source = _claim(params, game, ledger_max)
    seconds = time.perf_counter() - t0
    return Row(table["name"], game.name, game.collections, claimed, source,
               float(params.guarantee(game.collections).value), outcome.eps_hat, outcome.eps_lb, outcome.eps_ub,
               outcome.tpr, outcome.fpr, outcome.tpr_interval, outcome.fpr_interval, trials, trials - calib,
               statistic, sc.behavior, seconds, n / seconds,
               extra={"threshold": decision.threshold, "direction": decision.direction,
                      "ledger_max": ledger_max, **game.described(bool(getattr(params, "collects_bits", False)))})


def is_central(name: str) -> bool:
    """Whether the protocol is a central-model one (``central`` on its parameter class): a device's report is
    its raw value, and there is nothing to audit locally."""
    from protocols import registry

    return bool(getattr(registry.lookup(name).params, "central", False))


def central_row(name: str, game: Game) -> Row:
    return Row(name, game.name, game.collections, None, "", None, None, None, None, None, None, None, None, 0, 0,
               "not audited", "honest", 0.0, None,
               note="central model: a device hands its raw value to a trusted curator; the guarantee is on the "
                    "released estimates, not on a device's transcript", extra=game.described())


def require_target(target: str, also: str = "") -> None:
    """ScenarioError unless ``target`` is a protocol with an example table, or a scenario file or shipped name
    (``also``: other accepted words, for the message)."""
    if default_table(target) is not None:
        return
    try:
        schema.resolve_path(target)
    except ScenarioError:
        if _protocol_class(target) is not None:
            raise ScenarioError(f"protocol {target!r} gives no example [protocol] table (its parameter class's "
                                f"`examples`): name a scenario file that uses it instead") from None
        raise ScenarioError(f"{target!r} is neither a protocol ({', '.join(PROTOCOLS)}), {also}nor a scenario "
                            f"file or shipped scenario name") from None


def protocol_table(target: str) -> tuple[dict[str, Any], int]:
    """The [protocol] table and seed an audit of ``target`` uses: a protocol name (its parameter class's example table), or a
    scenario file or shipped name whose [protocol] table (and seed) is taken as it is."""
    table = default_table(target)
    if table is not None:
        return table, 1
    _, data = schema.read(target)
    table = data.get("protocol")
    if not isinstance(table, dict) or "name" not in table:
        raise ScenarioError(f"{target}: the scenario has no [protocol] table with a name")
    seed = data.get("seed", 1)
    return dict(table), int(seed) if isinstance(seed, int) and not isinstance(seed, bool) else 1


def audit(target: str, trials: int, rounds: int, seed: int | None = None, overrides: Sequence[str] = (),
          progress: Callable[[str], None] | None = None) -> list[Row]:
    """Every game of ``target`` (a protocol name, scenario, or ``all``)."""
    targets = list(PROTOCOLS) if target == "all" else [target]
    rows: list[Row] = []
    # --set protocol.* first: the protocol audited (its name in every row, its class, its epoch length) is the
    # one the overrides make, not the target's own (a --set protocol.name=1bitmean on a 1BitRRPM scenario
    # audited 1BitMean in rows labelled 1bitrrpm)
    on_protocol = [o for o in overrides if o.split("=", 1)[0].strip().split(".", 1)[0].split("[", 1)[0] == "protocol"]
    for t in targets:
        table, default_seed = protocol_table(t)
        if on_protocol:
            table = schema.apply_overrides({"protocol": table}, on_protocol)["protocol"]
            if not isinstance(table, dict) or not isinstance(table.get("name"), str):
                raise ScenarioError("--set protocol: must leave a [protocol] table with a name")
        for game in games(rounds):
            if progress is not None:
                progress(f"{table['name']}: {game.name} ({game.collections} round{'s' * (game.collections != 1)}, "
                         f"{trials:,} canaries per input)")
            if is_central(table["name"]):
                rows.append(central_row(table["name"], game))
                continue
            rows.append(audit_game(table, game, trials, default_seed if seed is None else seed, overrides))
    return rows


# ------------------------------------------------------------------------------------------------ output
def _f(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "n/a"
    return "inf" if math.isinf(x) else f"{x:.{digits}f}"


def format_table(rows: Sequence[Row]) -> str:
    head = ("protocol", "game", "rounds", "claimed", "eps_hat", "eps_lb", "trials", "test", "verdict")
    lines = [head]
    for r in rows:
        verdict = ("not audited" if r.eps_lb is None else "EXCEEDS CLAIM" if r.exceeds else "ok")
        lines.append((r.protocol, r.game, str(r.rounds), _f(r.claimed), _f(r.eps_hat), _f(r.eps_lb),
                      f"{r.trials:,}", r.statistic.split(",")[0], verdict))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def markdown_table(rows: Sequence[Row]) -> str:
    """The rows as a Markdown table (docs/privacy_audit.md): the claim, eps_hat and its bounds (each end a 99%
    one-sided bound, the interval as a whole at least 98%)."""
    out = ["| protocol | game | rounds | claimed | eps_hat | [eps_lb, eps_ub] (each end 99%) | canaries per input | test |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.eps_lb is None:
            out.append(f"| {r.protocol} | {r.game} | {r.rounds} | n/a | n/a | not audited: central model | | |")
            continue
        out.append(f"| {r.protocol} | {r.game} | {r.rounds} | {_f(r.claimed)} | {_f(r.eps_hat)} | "
                   f"[{_f(r.eps_lb)}, {_f(r.eps_ub)}] | {r.trials:,} | {r.statistic} |")
    return "\n".join(out)


def draw(rows: Sequence[Row], path: Path) -> None:
    """One protocol's games: the claim, eps_hat and the 99% lower bound, in nats."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [(r, r.eps_lb) for r in rows if r.eps_lb is not None]
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * max(1, len(shown)), 3.8))
    x = np.arange(len(shown))
    finite = [r.claimed for r, _ in shown if r.claimed is not None and math.isfinite(r.claimed)]
    top = max([*(r.eps_hat for r, _ in shown if r.eps_hat is not None and math.isfinite(r.eps_hat)),
               *(lb for _, lb in shown), *finite, 0.1]) * 1.25
    for i, (r, lb) in enumerate(shown):
        claim = r.claimed if r.claimed is not None and math.isfinite(r.claimed) else top
        ax.bar(i, claim, width=0.6, color="none", edgecolor="tab:gray", hatch="//" if claim == top else None,
               label="claimed (ledger or worst case)" if i == 0 else None)
        over = r.exceeds  # a lower bound above the claim: the protocol leaks more than it says
        ax.bar(i, lb, width=0.35, color="tab:red" if over else "tab:blue",
               label="eps_lb (99% lower bound)" if i == 0 else None)
        ax.annotate(f"{lb:.2f}" + ("\nEXCEEDS CLAIM" if over else ""), (i + 0.18, lb), ha="left", va="bottom",
                    fontsize=7, color="tab:red" if over else "black", fontweight="bold" if over else "normal")
        if r.eps_hat is not None and math.isfinite(r.eps_hat):
            ax.plot(i, r.eps_hat, "o", color="tab:red", label="eps_hat (point estimate)" if i == 0 else None)
    ax.set_xticks(x, [f"{r.game}\n({r.rounds} rd)" for r, _ in shown], fontsize=8)
    ax.set_ylim(0, top)
    ax.set_ylabel("epsilon (nats)")
    title = shown[0][0].protocol if shown else (rows[0].protocol if rows else "")
    trials = shown[0][0].trials if shown else 0
    ax.set_title(f"{title}: empirical epsilon, {trials:,} canaries per input (hatched: unbounded claim)",
                 fontsize=9)
    if ax.get_legend_handles_labels()[0]:  # no labelled artist (e.g. every claim unbounded): no empty legend
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


def write(rows: Sequence[Row], out: Path) -> None:
    """privacy_audit.json, privacy_audit.csv and one <protocol>.png per protocol in ``out`` (atomic writes)."""
    out.mkdir(parents=True, exist_ok=True)
    records = [r.as_dict() for r in rows]
    tmp = out / "privacy_audit.json.tmp"
    tmp.write_text(jsonout.write_document(records, indent=1) + "\n")
    tmp.replace(out / "privacy_audit.json")
    keys = list(records[0]) if records else []
    tmp = out / "privacy_audit.csv.tmp"
    with tmp.open("w", newline="") as fh:
        w = csv.DictWriter(fh, keys)
        w.writeheader()
        for rec in records:
            w.writerow({k: ("" if v is None else v) for k, v in rec.items()})
    tmp.replace(out / "privacy_audit.csv")
    for name in dict.fromkeys(r.protocol for r in rows):
        draw([r for r in rows if r.protocol == name], out / f"{name}.png")


def main(target: str, trials: int, rounds: int, as_json: bool, out: str | None, seed: int | None,
         overrides: Sequence[str], quiet: bool = False) -> int:
    """The command: audit, print the table (or the JSON rows), write the files; exit 1 if a lower bound
    exceeds its claim."""
    if trials < 10:
        raise ScenarioError(f"--trials {trials}: at least 10 canaries per input are needed")
    if not 1 <= rounds <= 10_000:
        raise ScenarioError(f"--rounds {rounds}: must be in [1, 10000]")
    if target != "all":
        require_target(target, "nor 'all', ")
    say = None if (as_json or quiet) else (lambda msg: print(f"auditing {msg}", file=sys.stderr, flush=True))
    rows = audit(target, trials, rounds, seed, overrides, say)
    # a file: its name without the suffix; a protocol or module:Class: itself; only [A-Za-z0-9._-] in a folder name
    label = Path(target).stem if target.endswith((".toml", ".json")) else target
    label = re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("._") or "target"
    folder = Path(out) if out else Path("runs") / f"privacy-audit-{label}-{time.strftime('%Y%m%d-%H%M%S')}"
    write(rows, folder)
    if as_json:
        print(jsonout.write_document([r.as_dict() for r in rows], indent=1))
    else:
        print(format_table(rows))
        print(f"\nwrote {folder}/privacy_audit.json, privacy_audit.csv and one plot per protocol")
    return 1 if any(r.exceeds for r in rows) else 0
