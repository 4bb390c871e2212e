"""The reference models (protocols/reference.py) against the vectorized device sides (protocols/).

Both are driven with the same collector messages, private values, presence and downlink loss, for a few
dozen devices over several rounds, for every protocol: reports (every column) and charges (round, reason,
amount, cumulative) must agree exactly, floats to 1e-9 relative. Hostile messages (repeats, other
protocols, future and stale rounds, rounds past the horizon, absurd ToPL thresholds) are mixed in, and a
budget is set in some cases, so the guard's rules are compared too.
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import pytest

from protocols import keyed
from protocols.baselines import KFlipParams, LaplaceParams
from protocols.dbitflip import DBitFlipParams
from protocols.epochrr import EpochRRParams
from protocols.guard import Limits
from protocols.keyed import Purpose, stream_key
from protocols.messages import CollectionRequest, Decision, Threshold
from protocols.multicounter import MultiParams
from protocols.onebit import OneBitParams
from protocols.thresh import ThreshParams
from protocols.topl import ToplParams
from protocols.tops_protocol import TopsParams
from protocols import reference as ref

N = 40
SEED = 1234
IDS = np.arange(100, 100 + N)  # not starting at 0: ids are keys, not indices


def close(a, b) -> bool:
    if isinstance(a, tuple) or isinstance(b, tuple):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))
    return a == b


def _py(v):
    v = np.asarray(v)
    if v.ndim == 1:
        return tuple(float(x) if v.dtype.kind == "f" else int(x) for x in v)
    return float(v) if v.dtype.kind == "f" else int(v)


def _stage(name: str, columns: dict) -> str:
    if name == "thresh":
        return "vote" if "vote" in columns else "estimate"
    if name == "topl":
        return "holdout" if "s" in columns else "report"
    return "report"


class Pair:
    """A real device side for IDS and one reference model per device, fed the same inputs."""

    def __init__(self, params, limits: Limits | None = None, seed: int = SEED) -> None:
        self.params = params
        self.dev = params.make_devices(seed, IDS, limits)
        self.refs = [ref.reference_device(params, seed, int(i), limits) for i in IDS]
        self.reports = 0
        self.charges = 0

    def observe(self, day: int, values: np.ndarray, present: np.ndarray | None = None) -> None:
        self.dev.observe(day, values, present)
        for i, r in enumerate(self.refs):
            r.observe(day, float(values[i]), True if present is None else bool(present[i]))

    def message(self, msg, day: int, values: np.ndarray, present: np.ndarray | None = None,
                now: float = 10.0) -> None:
        batch, charges = self.dev.respond(msg, day, values, now, present)
        got: dict[int, tuple] = {}
        if batch is not None:
            stage = _stage(self.params.name, batch.columns)
            for k, d in enumerate(batch.devices):
                got[int(d)] = (stage, batch.round, {c: _py(np.asarray(v)[k]) for c, v in batch.columns.items()})
        got_charges: dict[int, list] = defaultdict(list)
        for c in charges:
            for d in c.devices:
                got_charges[int(d)].append((c.round, c.reason, c.amount, c.cumulative))
        for i, r in enumerate(self.refs):
            dev_id = int(IDS[i])
            value = tuple(values[i]) if np.ndim(values) == 2 else float(values[i])
            rep, chs = r.on_message(msg, day, value, True if present is None else bool(present[i]), now)
            want = None if rep is None else (rep.stage, rep.round, rep.columns)
            have = got.get(dev_id)
            assert (want is None) == (have is None), (msg, dev_id, want, have)
            if want is not None:
                assert want[:2] == have[:2] and want[2].keys() == have[2].keys(), (msg, dev_id, want, have)
                for col in want[2]:
                    assert close(want[2][col], have[2][col]), (msg, dev_id, col, want, have)
                self.reports += 1
            mine = sorted((c.round, c.reason, c.amount, c.cumulative) for c in chs)
            theirs = sorted(got_charges.get(dev_id, []))
            assert len(mine) == len(theirs), (msg, dev_id, mine, theirs)
            for x, y in zip(mine, theirs):
                assert x[0] == y[0] and x[1] == y[1] and x[3] == y[3] and close(x[2], y[2]), (msg, dev_id, mine,
                                                                                              theirs)
            self.charges += len(mine)
        for i, r in enumerate(self.refs):  # the device's own running total agrees too
            assert close(r.spent, float(self.dev.guard.spent[i])), (dev_id, r.spent, self.dev.guard.spent[i])


def _hostile(name: str, r: int, deadline: float = 99.0) -> list:
    """Messages every device must refuse (or, for repeats, answer at most once)."""
    return [CollectionRequest(r, name, deadline), CollectionRequest(r, "not-" + name, deadline),
            CollectionRequest(r + 3, name, deadline), CollectionRequest(0, name, deadline),
            CollectionRequest(2**31 - 1, name, deadline), Decision(r, name, True, deadline)]


def _values(rng: np.random.Generator, m: float, shape) -> np.ndarray:
    """Values on [0, m] with the edges, repeats and grid points that exercise clipping and memoization."""
    x = rng.uniform(0, m, shape)
    pick = rng.random(shape)
    x = np.where(pick < 0.15, 0.0, x)
    x = np.where((pick >= 0.15) & (pick < 0.3), m, x)
    x = np.where((pick >= 0.3) & (pick < 0.45), np.round(x / (m / 8)) * (m / 8), x)
    return x


def _single_round_protocol(params, rounds: int = 9, limits: Limits | None = None, downlink: float = 0.2,
                           churn: bool = True, values=None) -> Pair:
    pair = Pair(params, limits)
    rng = np.random.default_rng(7)
    m = params.max_value
    base = _values(rng, m, (N,))
    for r in range(1, rounds + 1):
        x = np.where(rng.random(N) < 0.5, base, _values(rng, m, (N,))) if values is None else values(rng, r)
        present = np.ones(N, bool)
        if churn:
            present &= rng.random(N) >= downlink
        msgs = [CollectionRequest(r, params.name, 99.0)] + _hostile(params.name, r)
        for msg in msgs:
            pair.message(msg, r, x, present if churn else None, now=100.0 * r)
    assert pair.reports > 0 and pair.charges > 0
    return pair


# ------------------------------------------------------------------------------------------- keyed draws
def test_pure_python_uniforms_equal_keyed() -> None:
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 2**32, 2000)
    subs = rng.integers(0, 10_000, 2000)
    for purpose in (Purpose.MEMO, Purpose.FLIP, Purpose.VOTE):
        k = stream_key(99, purpose, 5)
        assert list(keyed.uniform(k, ids)) == [ref.uniform1(k, int(i)) for i in ids]
        assert list(keyed.uniform_sub(k, ids, subs)) == [ref.uniform2(k, int(i), int(s)) for i, s in zip(ids, subs)]


# ------------------------------------------------------------------------------------------- Ding et al.
@pytest.mark.parametrize("gamma", [0.0, 0.2])
@pytest.mark.parametrize("budget", [None, 4.0])
def test_1bitmean(gamma, budget) -> None:
    _single_round_protocol(OneBitParams("1bitmean", 1.0, 86400.0, gamma=gamma), limits=Limits(horizon=7,
                                                                                               budget=budget))


@pytest.mark.parametrize("gamma", [0.0, 0.1])
@pytest.mark.parametrize("granularity", [3600.0, 86400.0 / 7])
@pytest.mark.parametrize("budget", [None, 2.5])
def test_1bitrrpm(gamma, granularity, budget) -> None:
    _single_round_protocol(OneBitParams("1bitrrpm", 1.0, 86400.0, granularity, gamma),
                           limits=Limits(horizon=8, budget=budget))


def test_1bitrrpm_large_grid() -> None:
    """A grid of more than 256 values (the device side's hash set instead of its bitset)."""
    _single_round_protocol(OneBitParams("1bitrrpm", 0.5, 86400.0, 60.0, 0.0), limits=Limits(budget=3.0))


@pytest.mark.parametrize("name,k,d", [("dbitflip", 8, 1), ("dbitflip", 8, 3), ("dbitflippm", 8, 1),
                                      ("dbitflippm", 10, 2), ("dbitflippm", 300, 4), ("binflip", 4, 4),
                                      ("dbitflip", 5, 5)])
@pytest.mark.parametrize("gamma", [0.0, 0.15])
@pytest.mark.parametrize("budget", [None, 3.0])
def test_dbitflip_family(name, k, d, gamma, budget) -> None:
    _single_round_protocol(DBitFlipParams(name, 1.0, 24.0, k, d, gamma), limits=Limits(horizon=8, budget=budget))


@pytest.mark.parametrize("k", [2, 7, 300])
def test_kflip(k) -> None:
    _single_round_protocol(KFlipParams("kflip", 1.5, 100.0, k), limits=Limits(budget=5.0))


def test_laplace() -> None:
    _single_round_protocol(LaplaceParams("laplace", 0.7, 100.0), limits=Limits(horizon=6, budget=3.0))


@pytest.mark.parametrize("c", [1, 2, 3])
def test_1bitmulti(c) -> None:
    def values(rng, r):
        total = _values(rng, 3600.0, (N,))
        w = rng.dirichlet(np.ones(c), N)
        return total[:, None] * w

    _single_round_protocol(MultiParams("1bitmulti", 1.0, 3600.0, c), limits=Limits(budget=8.0), values=values)


def test_no_presence_mask() -> None:
    """present=None: every device answers."""
    _single_round_protocol(OneBitParams("1bitrrpm", 1.0, 100.0, 10.0, 0.1), churn=False)


# ------------------------------------------------------------------------------------------- epochs
def _bits(rng, probs: np.ndarray) -> np.ndarray:
    return (rng.random(probs.size) < probs).astype(np.float64)


def _epoch_run(params, decisions: list[bool] | None, limits: Limits | None, downlink: float = 0.0,
               absent: float = 0.05, extra_epochs: int = 1) -> Pair:
    """Days in order (some devices miss days), then each epoch's vote request and (THRESH) its decision,
    with hostile messages in between, and epochs past the horizon at the end. Downlink loss is keyed like
    the network's: one receipt mask per (epoch, message kind), whatever is sent under it."""
    pair = Pair(params, limits)
    rng = np.random.default_rng(11)
    probs = rng.uniform(0.1, 0.9, N)
    l, T = params.epoch_length, params.epochs
    masks: dict[tuple[int, str], np.ndarray] = {}

    def got(t: int, kind: str) -> np.ndarray:
        if (t, kind) not in masks:
            masks[t, kind] = rng.random(N) >= downlink
        return masks[t, kind]

    day = 0
    zeros = np.zeros(N)
    for t in range(1, T + 1 + extra_epochs):
        if t in (3, 6):
            probs = np.clip(probs + rng.choice([-0.6, 0.6], N), 0, 1)
        for _ in range(l):
            day += 1
            present = rng.random(N) >= absent
            pair.observe(day, _bits(rng, probs), present)
        pair.message(Decision(t, params.name, True, 9.0), day, zeros, got(t, "decision"))  # before its vote
        pair.message(CollectionRequest(t - 1, params.name, 9.0), day, zeros, got(t - 1, "collect"))  # stale
        pair.message(CollectionRequest(t, params.name, 9.0), day, zeros, got(t, "collect"))
        pair.message(CollectionRequest(t, params.name, 9.0), day, zeros, got(t, "collect"))  # a repeat
        pair.message(CollectionRequest(t, "1bitmean", 9.0), day, zeros)
        if decisions is not None:
            update = decisions[(t - 1) % len(decisions)]
            pair.message(Decision(t, params.name, update, 9.0), day, zeros, got(t, "decision"))
            pair.message(Decision(t, params.name, not update, 9.0), day, zeros, got(t, "decision"))  # again
            pair.message(Decision(t + 1, params.name, True, 9.0), day, zeros, got(t + 1, "decision"))
    assert pair.reports > 0
    return pair


@pytest.mark.parametrize("budget", [None, 0.15])
def test_epochrr(budget) -> None:
    _epoch_run(EpochRRParams("epochrr", 0.4, 4, 6), None, Limits(horizon=6, budget=budget))


def _thresh(**kw) -> ThreshParams:
    base = dict(name="thresh", epsilon=2.0, delta=0.1, epoch_length=4, epochs=8, devices=N, a=0.3, b=0.4,
                tau_scale=0.1)
    base.update(kw)
    return ThreshParams(**base)


@pytest.mark.parametrize("cap_rule", ["paper", "strict"])
@pytest.mark.parametrize("tau_scale", [0.05, 0.1, 0.6])
@pytest.mark.parametrize("decisions", [[True], [False], [True, False, False], [False, True]])
@pytest.mark.parametrize("budget", [None, 1.1])
def test_thresh(cap_rule, tau_scale, decisions, budget) -> None:
    """Update and no-update decisions; tau_L < 1 (forced first votes) and >= 1; both cap rules; a budget."""
    params = _thresh(cap_rule=cap_rule, tau_scale=tau_scale)
    pair = _epoch_run(params, decisions, Limits(horizon=params.epochs, budget=budget))
    assert pair.charges > 0


def test_thresh_forced_first_vote_is_data_free() -> None:
    """With tau_L < 1 every device's first vote (against -1) is a forced yes: no reserve is booked for it,
    and the reserve booked later is 2a (K_V - 1)."""
    params = _thresh(tau_scale=0.05, a=0.3)
    assert params.taus[-1] < 1
    pair = _epoch_run(params, [True], Limits(horizon=params.epochs))
    reserves = [r.spent for r in pair.refs]
    assert max(reserves) > 0


def test_thresh_downlink_loss() -> None:
    """Downlink loss of the vote request and of the decision: a device that did not receive the decision of
    an update cannot take part in it, so it keeps its reference mean."""
    params = _thresh(tau_scale=0.1)
    _epoch_run(params, [True, False], Limits(horizon=params.epochs), downlink=0.3)


# ------------------------------------------------------------------------------------------- ToPL, ToPS
def _topl(**kw) -> ToplParams:
    base = dict(name="topl", epsilon=1.0, threshold_epsilon=0.5, max_value=100.0, holdout=0.3,
                rethreshold_every=4, rounds=10, devices=N, rethreshold_at=(7,))
    base.update(kw)
    return ToplParams(**base)


@pytest.mark.parametrize("epsilon", [1.0, 0.5])
@pytest.mark.parametrize("budget", [None, 4.2])
def test_topl(epsilon, budget) -> None:
    """Threshold rounds (holdout SW, then a broadcast theta), HM rounds, downlink loss of thresholds (devices
    keep their version), absurd and stale thresholds, repeats, a horizon."""
    params = _topl(epsilon=epsilon)
    pair = Pair(params, Limits(horizon=9, budget=budget))
    rng = np.random.default_rng(3)
    version = 0
    for r in range(1, params.rounds + 2):
        x = np.where(rng.random(N) < 0.2, 100.0, rng.exponential(20.0, N))
        x = np.minimum(x, params.max_value)
        present = rng.random(N) >= 0.1
        pair.message(CollectionRequest(r, "topl", 9.0), r, x, present)
        if params.threshold_round(r):
            version += 1
            theta = float(rng.uniform(10, 100))
            pair.message(Threshold(r, "topl", theta, version, 9.0), r, x, present & (rng.random(N) >= 0.3))
        for bad in (0.0, -1.0, 1e-300, 1e308, math.inf):
            pair.message(Threshold(r, "topl", bad, 2**31 - 1, 9.0), r, x, present)
        pair.message(Threshold(r, "topl", 50.0, max(version, 1), 9.0), r, x, present)  # a reused version
        pair.message(Threshold(r + 1, "topl", 50.0, 2**31 - 1, 9.0), r, x, present)  # another day
        pair.message(CollectionRequest(r, "topl", 9.0), r, x, present)  # a repeat
    assert pair.reports > 0


@pytest.mark.parametrize("budget", [None, 2.0])
def test_tops(budget) -> None:
    params = TopsParams("tops", 1.0, 0.5, 165.0, 0.3, 8, N, seed=SEED)
    _single_round_protocol(params, rounds=8, limits=Limits(horizon=7, budget=budget))


def test_every_protocol_has_a_model() -> None:
    """Every built-in has a reference model: in ref.MODELS, or its own (``reference_model``, as a plugin's)."""
    from protocols import registry
    from scenarios.schema import PROTOCOLS

    own = {n for n in PROTOCOLS if getattr(registry.lookup(n).params, "reference_model", None) is not None}
    assert set(PROTOCOLS) == set(ref.MODELS) | own and not set(ref.MODELS) & own
