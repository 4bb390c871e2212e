"""(eps, delta) accounting beside pure eps: a privacy-loss-distribution (PLD) accountant over the rounds of a
fresh-report protocol (issue 11, part 3; docs/privacy_accounting.md, "(eps, delta) accounting beside pure eps").

Each fresh-report protocol describes one round by a dominating pair (``params.round_mechanism(round_)``,
protocols/round_mechanism.py). This module turns each round's pair into a PLD of Google's ``dp-accounting``
package, composes the PLDs round by round (``pld = pld.compose(round_pld)`` after each round t = 1..T) and
reads eps(delta) after every round for delta = 1e-6 and 1e-9, beside the basic-composition ledger
(``params.guarantee(t)``, t x eps_round). Every figure is an upper bound:

- dp-accounting's *pessimistic* estimates: each privacy loss is rounded *up* to a multiple of the
  discretization interval, and tail mass cut off after a composition (``TAIL_TRUNCATION`` each time) is moved
  to an infinite loss, which can only raise delta;
- the interval (:func:`choose_discretization`):
  * lattice: when every loss of every round's pair is an integer multiple of one unit u (randomized
    response: +-eps; k-ary RR, dBitFlip, HM: +-eps and 0), the interval is u itself and the rounding is exact;
  * Laplace: the pessimistic connect-the-dots PLD (Doroshenko et al. 2022, in dp-accounting) at interval
    eps/100 (eps/1000 changes eps(1e-6) after 400 rounds by 0.001);
  * otherwise (the 1BitMulti envelope for c >= 3; ToPL when a threshold round's envelope bends off the
    lattice) interval eps_round/1000, eps_round the smallest per-round pure eps: each round's losses move up by
    less than one interval, so after t rounds eps(delta) is at most t x interval (0.1% of basic composition)
    above the exact figure for the dominating pairs;
  * no grid puts the largest loss more than ``MAX_LATTICE_STEPS`` intervals out: rounds whose pure eps differ
    10^7-fold (1e-6 and 10) get the interval largest loss/1e5 instead of a unit or a thousandth of 1e-6.
  A loss within 1e-9 intervals above a grid point is rounded down to it (float noise in ln(p/q) would
  otherwise cost a whole interval); the reported eps adds t x 1e-9 x interval back, so it stays an upper bound.
- the pure eps of the pairs composed (the sum of each round's largest loss; the ledger's basic composition
  where the two agree up to rounding) holds with delta = 0, so eps(delta) is never reported above it: the
  rounding above put 1BitMean's eps(1e-9) after 2 rounds at 2.0000000001 against basic composition's 2.

dp-accounting is an optional dependency (``pip install 'ldpsim[accounting]'``): it is imported lazily, and when
it is missing the run summary says so instead of failing. The accountant depends only on the parameters and the
number of rounds, so a run computes it once (cached). Cost of 400 rounds on the project machine: about 0.2 s
on a lattice, 0.6 s for Laplace, 4 s for 1BitMulti with c = 3; a run's summary skips it past ``MAX_ROUNDS``
(``MAX_FINE_ROUNDS`` on a fine grid) and says so.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from protocols.round_mechanism import DiscretePair, LaplacePair, NoRoundMechanism, RoundMechanism

if TYPE_CHECKING:
    from scenarios.schema import Scenario

DELTAS: tuple[float, ...] = (1e-6, 1e-9)
CSV = "eps_delta.csv"
TAIL_TRUNCATION = 1e-15  # dp-accounting's default: mass cut from the tails per composition (pessimistically)
LAPLACE_STEPS = 100  # Laplace: interval = eps/100 (connect the dots)
FINE_STEPS = 1000  # pairs off a lattice: interval = eps_round/1000
LATTICE_TOL = 1e-9  # losses within this (relative) of integer multiples of the unit are on the lattice
MAX_LATTICE_STEPS = 100_000  # no grid (lattice or fine) puts the largest loss more intervals than this out
ROUND_SLACK = 1e-9  # in intervals: float noise allowed below a grid point before rounding up past it
MAX_ROUNDS = 5_000  # a run's summary skips the accountant beyond this (5,000 rounds of 1BitMean: about 7 s)
MAX_FINE_ROUNDS = 1_000  # the same on a fine grid (1,000 rounds of 1BitMulti with c = 3: about 20 s)


def dependency_problem() -> str | None:
    """None when dp-accounting can be imported, else a sentence saying how to get it."""
    try:
        import dp_accounting.pld.privacy_loss_distribution  # noqa: F401
    except ImportError as exc:  # pragma: no cover - the test extra installs it
        from scenarios.extras import install_command

        return f"dp-accounting is not installed ({install_command('accounting')}): {exc}"
    return None


def accountant_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("dp-accounting")
    except metadata.PackageNotFoundError:  # pragma: no cover
        return "unknown"


@dataclass(frozen=True)
class Discretization:
    """The PLD grid: losses are multiples of ``interval``; ``exact`` when no loss is moved by the rounding."""

    interval: float
    exact: bool
    rule: str


@dataclass(frozen=True)
class EpsDeltaTable:
    """eps(delta) after each round t = 1..T (``epsilon[i][t - 1]`` for ``deltas[i]``) beside the basic
    composition ``basic[t - 1]`` (the ledger's guarantee after t rounds)."""

    deltas: tuple[float, ...]
    basic: tuple[float, ...]
    epsilon: tuple[tuple[float, ...], ...]
    discretization: Discretization
    mechanisms: tuple[str, ...]
    attained: bool
    truncation: float
    seconds: float

    @property
    def rounds(self) -> int:
        return len(self.basic)

    def final(self, delta: float) -> float:
        return self.epsilon[self.deltas.index(delta)][-1]

    def summary(self) -> dict[str, Any]:
        """summary.json -> privacy -> eps_delta."""
        return {
            "applies": True,
            "rounds": self.rounds,
            "deltas": {delta_key(d): {"epsilon": _finite(self.final(d)), "basic": self.basic[-1]} for d in self.deltas},
            "accountant": f"dp-accounting {accountant_version()}: privacy loss distributions, pessimistic "
                          "estimates, composed round by round",
            "mechanism": list(self.mechanisms),
            "attained": self.attained,
            "discretization": {"interval": self.discretization.interval, "exact": self.discretization.exact,
                               "rule": self.discretization.rule},
            "tail_mass_truncation": self.truncation,
            "meaning": "eps such that a device's whole transcript after the final round is (eps, delta)-LDP, an "
                       "upper bound; basic is the ledger's pure-eps guarantee (basic composition) beside it",
            "table": CSV,
            "seconds": round(self.seconds, 3),
        }


def delta_key(delta: float) -> str:
    return f"{delta:.0e}"


def _finite(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


# ------------------------------------------------------------------------------------------- mechanisms
def round_mechanisms(params: Any, horizon: int) -> list[RoundMechanism] | NoRoundMechanism:
    """Each round's description, rounds 1..horizon, or the protocol's reason why rounds do not compose."""
    describe = getattr(params, "round_mechanism", None)
    if describe is None:
        return NoRoundMechanism(f"{getattr(params, 'name', 'this protocol')} does not describe its rounds")
    first = describe(1)
    if isinstance(first, NoRoundMechanism):
        return first
    return [first] + [describe(r) for r in range(2, horizon + 1)]


def _finite_losses(pair: DiscretePair) -> np.ndarray:
    ell = pair.losses()
    return ell[np.isfinite(ell)]


def choose_discretization(mechanisms: list[RoundMechanism] | tuple[RoundMechanism, ...]) -> Discretization:
    """The grid for a chain of rounds (module docstring): lattice, Laplace or fine."""
    distinct = list(dict.fromkeys(mechanisms))
    smallest = min(m.max_loss for m in distinct)
    pairs = [m for m in distinct if isinstance(m, DiscretePair)]
    if len(pairs) < len(distinct):  # a Laplace round
        return Discretization(smallest / LAPLACE_STEPS, False,
                              f"eps_round/{LAPLACE_STEPS}, pessimistic connect-the-dots (Laplace)")
    losses = np.concatenate([_finite_losses(m) for m in pairs])
    top = float(np.max(np.abs(losses)))
    nonzero = np.abs(losses)[np.abs(losses) > 1e-12 * top]
    if nonzero.size and top / float(nonzero.min()) <= MAX_LATTICE_STEPS:  # else a dense grid of 1e9 points
        unit = float(nonzero.min())
        ratio = nonzero / unit
        if np.all(np.abs(ratio - np.round(ratio)) <= LATTICE_TOL * np.maximum(1.0, ratio)):
            return Discretization(unit, True, "every loss is a multiple of the interval: exact")
    if smallest / FINE_STEPS >= top / MAX_LATTICE_STEPS:
        return Discretization(smallest / FINE_STEPS, False,
                              f"eps_round/{FINE_STEPS}, pessimistic rounding up: after t rounds at most "
                              f"t x interval above the exact value")
    # rounds of very different eps (1e-6 and 10): the smallest's thousandth would be 1e10 points a round
    return Discretization(top / MAX_LATTICE_STEPS, False,
                          f"largest loss/{MAX_LATTICE_STEPS:,}, pessimistic rounding up: after t rounds at most "
                          f"t x interval above the exact value")


def round_pld(mechanism: RoundMechanism, interval: float) -> Any:
    """dp-accounting's PLD of one round's pair on the grid ``interval`` (pessimistic)."""
    from dp_accounting.pld import privacy_loss_distribution as pld

    if isinstance(mechanism, LaplacePair):
        if mechanism.discrete is None:
            return pld.from_laplace_mechanism(mechanism.scale, mechanism.sensitivity, pessimistic_estimate=True,
                                              value_discretization_interval=interval, use_connect_dots=True)
        parameter, steps = mechanism.discrete
        return pld.from_discrete_laplace_mechanism(parameter, steps, pessimistic_estimate=True,
                                                   value_discretization_interval=interval, use_connect_dots=True)
    p, q = mechanism.arrays()

    def rounded(upper: np.ndarray, lower: np.ndarray) -> tuple[dict[int, float], float]:
        both = (upper > 0) & (lower > 0)
        infinity = float(upper[(upper > 0) & (lower == 0)].sum())
        ell = np.log(upper[both]) - np.log(lower[both])
        index = np.ceil(ell / interval - ROUND_SLACK).astype(np.int64)
        pmf: dict[int, float] = {}
        for k, mass in zip(index.tolist(), upper[both].tolist()):
            pmf[k] = pmf.get(k, 0.0) + mass
        return pmf, infinity

    remove, inf_remove = rounded(p, q)
    if mechanism.symmetric:
        return pld.PrivacyLossDistribution.create_from_rounded_probability(remove, inf_remove, interval, True)
    add, inf_add = rounded(q, p)
    return pld.PrivacyLossDistribution.create_from_rounded_probability(remove, inf_remove, interval, True, add,
                                                                      inf_add, symmetric=False)


def epsilon_for_delta(pld: Any, delta: float) -> float:
    """The smallest eps >= 0 with delta(eps) <= ``delta`` for a dp-accounting PLD: what its
    get_epsilon_for_delta returns, computed with numpy (its loop over the grid is pure Python and took three
    quarters of a 400-round run). Reads the PLD's probability mass functions; falls back to the library's
    method if their layout differs (another dp-accounting version)."""
    try:
        pmfs = [pld._pmf_remove] if pld._symmetric else [pld._pmf_remove, pld._pmf_add]
        dense = [pmf.to_dense_pmf() for pmf in pmfs]
        return max(_dense_epsilon(np.asarray(d._probs, dtype=np.float64), int(d._lower_loss),
                                  float(d._discretization), float(d._infinity_mass), delta) for d in dense)
    except AttributeError:  # pragma: no cover - a dp-accounting without these internals
        return float(pld.get_epsilon_for_delta(delta))


def _dense_epsilon(probs: np.ndarray, lower: int, interval: float, infinity: float, delta: float) -> float:
    """eps(delta) of losses (lower + j) x interval with ``probs`` and an infinite loss with ``infinity``.

    delta(eps) = infinity + sum over losses l > eps of p (1 - e^(eps - l)), decreasing in eps. With the
    positive losses sorted down, l_0 > l_1 > ..., let U_r and L_r be the sums of p and of p e^(-l) over the
    losses above l_r: delta(l_r) = U_r - e^(l_r) L_r. The answer lies in [l_r, l_(r-1)) for the first r with
    delta(l_r) > delta, where delta(eps) = U_r - e^eps L_r gives eps = ln((U_r - delta)/L_r); if no grid loss
    qualifies it lies in [0, smallest positive loss). delta(l_r) <= U_r, so the search starts at the first r
    with U_r > delta and looks at windows of losses from there. L is kept as W = e^c L with c the loss where
    the search starts (no overflow near the answer, however large the losses); terms that underflow are
    dropped and terms beyond e^700 capped, which can only raise delta(eps) (pessimistic)."""
    if infinity > delta:
        return math.inf
    p = probs[max(0, 1 - lower):][::-1]  # the positive losses, largest first
    n = p.size
    if n == 0:
        return 0.0
    ell = (lower + probs.size - 1 - np.arange(n)) * interval
    upper = infinity + np.concatenate([[0.0], np.cumsum(p)])  # U_0 .. U_n
    start = min(int(np.searchsorted(upper, delta, side="right")), n)
    c = float(ell[min(start, n - 1)])
    w_r = float(np.sum(p[:start] * np.exp(c - ell[:start])))  # W_start = e^c L_start
    r, window = n, 512
    while start < n:
        stop = min(start + window, n)
        # capped at e^700: a capped term only lowers W, which raises delta(eps) (pessimistic); such terms lie
        # 700 below where the search started, past the answer in practice
        w = w_r + np.concatenate([[0.0], np.cumsum(p[start:stop] * np.exp(np.minimum(c - ell[start:stop], 700.0)))])
        with np.errstate(divide="ignore"):
            at_grid = upper[start:stop] - np.exp(ell[start:stop] - c + np.log(w[:-1]))  # delta(l_r)
        hit = np.flatnonzero(at_grid > delta)
        if hit.size:
            r, w_r = start + int(hit[0]), float(w[hit[0]])
            break
        w_r, start, window = float(w[-1]), stop, window * 4
    u = float(upper[r])
    if w_r <= 0:  # no mass above, or all of it underflowed: delta(eps) = U_r > delta up to l_(r-1)
        return max(0.0, float(ell[r - 1])) if r > 0 else 0.0
    if u <= w_r * math.exp(-c) + delta:  # delta(0) <= delta
        return 0.0
    return max(0.0, c + math.log((u - delta) / w_r))


@functools.lru_cache(maxsize=32)
def _compose(mechanisms: tuple[RoundMechanism, ...], deltas: tuple[float, ...], truncation: float,
             interval: float | None) -> tuple[tuple[tuple[float, ...], ...], Discretization, float]:
    start = time.perf_counter()
    grid = choose_discretization(mechanisms)
    if interval is not None:
        grid = Discretization(interval, False, "set by the caller")
    plds: dict[RoundMechanism, Any] = {}
    out = [[0.0] * len(mechanisms) for _ in deltas]
    acc = None
    for t, mechanism in enumerate(mechanisms, start=1):
        if mechanism not in plds:
            plds[mechanism] = round_pld(mechanism, grid.interval)
        one = plds[mechanism]
        acc = one if acc is None else acc.compose(one, tail_mass_truncation=truncation)
        for i, delta in enumerate(deltas):
            out[i][t - 1] = epsilon_for_delta(acc, delta) + t * ROUND_SLACK * grid.interval
    return tuple(tuple(row) for row in out), grid, time.perf_counter() - start


@functools.lru_cache(maxsize=32)
def _capped(eps: tuple[tuple[float, ...], ...], mechanisms: tuple[RoundMechanism, ...],
            basic: tuple[float, ...]) -> tuple[tuple[float, ...], ...]:
    """eps(delta) after each round, never above the pure eps of the rounds' pairs composed (the sum of their
    largest losses: it holds with delta = 0). Where that sum and the ledger's basic composition agree up to
    rounding (1e-9), the cap is the ledger's figure (a pair's ln(p/q) carries an ulp or two)."""
    caps, pure = [], 0.0
    for t, mechanism in enumerate(mechanisms):
        pure += float(mechanism.max_loss)
        caps.append(basic[t] if abs(basic[t] - pure) <= 1e-9 * max(1.0, pure) else pure)
    return tuple(tuple(min(v, cap) for v, cap in zip(row, caps)) for row in eps)


def account(params: Any, horizon: int, deltas: tuple[float, ...] = DELTAS, truncation: float = TAIL_TRUNCATION,
            interval: float | None = None) -> EpsDeltaTable:
    """Compose ``params``' rounds 1..horizon round by round; eps(delta) after each, beside basic composition.
    Raises ValueError for a protocol whose rounds do not compose and ImportError without dp-accounting.
    ``interval`` overrides the grid (tests); results are cached per (rounds' descriptions, deltas, grid)."""
    mechanisms = round_mechanisms(params, horizon)
    if isinstance(mechanisms, NoRoundMechanism):
        raise ValueError(mechanisms.why)
    problem = dependency_problem()
    if problem:
        raise ImportError(problem)
    eps, grid, seconds = _compose(tuple(mechanisms), tuple(deltas), float(truncation), interval)
    basic = tuple(float(params.guarantee(t).value) for t in range(1, horizon + 1))
    eps = _capped(eps, tuple(mechanisms), basic)
    distinct = tuple(dict.fromkeys(mechanisms))
    return EpsDeltaTable(tuple(deltas), basic, eps, grid, tuple(m.describe() for m in distinct),
                         all(m.attained for m in distinct), float(truncation), seconds)


def summary_entry(params: Any, horizon: int) -> tuple[dict[str, Any], EpsDeltaTable | None]:
    """summary.json's ``privacy.eps_delta`` and the table behind it (None when it does not apply)."""
    mechanisms = round_mechanisms(params, horizon)
    if isinstance(mechanisms, NoRoundMechanism):
        return {"applies": False, "why": mechanisms.why}, None
    problem = dependency_problem()
    if problem:
        return {"applies": False, "why": problem}, None
    grid = choose_discretization(mechanisms)
    limit = MAX_ROUNDS if grid.exact or isinstance(mechanisms[0], LaplacePair) else MAX_FINE_ROUNDS
    if horizon > limit:
        return {"applies": False, "why": f"{horizon:,} rounds: more than {limit:,} on this grid "
                                         f"({grid.rule}), not computed (scenarios.accounting.account can)"}, None
    try:
        table = account(params, horizon)
    except ValueError as exc:  # a pair the accountant cannot take (none within the parameter ranges): said, and
        # the run directory is still written, rather than a finished simulation lost to a traceback
        return {"applies": False, "why": f"the accountant could not describe these rounds: {exc}"}, None
    return table.summary(), table


def write_table(table: EpsDeltaTable, path: Path) -> int:
    """eps_delta.csv: round, basic_eps, then eps_at_delta_<delta> per delta; returns the number of rows."""
    header = ["round", "basic_eps"] + [f"eps_at_delta_{delta_key(d)}" for d in table.deltas]
    lines = [",".join(header)]
    for t in range(table.rounds):
        cells = [str(t + 1), repr(table.basic[t])] + [repr(table.epsilon[i][t]) for i in range(len(table.deltas))]
        lines.append(",".join(cells))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return table.rounds


def promises(sc: Scenario) -> dict[str, Any]:
    """summary.json's ``privacy`` figures that follow from the scenario alone, whatever the devices spent: the
    protocol's guarantee for the run (with its derivation and scope), the per-report epsilon, the budget and
    horizon the devices enforce, the collector's behavior, (eps, delta) for fresh-report protocols and, for
    memoized ones, the worst-case loss. ``ldpsim audit`` recomputes them to check the summary's."""
    g = sc.protocol.guarantee(sc.collections)
    out: dict[str, Any] = {
        "guarantee": g.value, "derivation": g.derivation, "scope": g.scope,
        "round_epsilon": float(sc.protocol.round_epsilon),
        "budget": sc.budget, "horizon": sc.collections, "collector_behavior": sc.behavior,
        "eps_delta": summary_entry(sc.protocol, sc.collections)[0],
    }
    if g.worst_case is not None:
        value, exact, method = g.worst_case
        # an unbounded loss stays inf here: summary.json writes null and names it in non_finite ("inf")
        out["worst_case_loss"] = {"value": float(value), "bounded": bool(np.isfinite(value)), "exact": exact,
                                  "method": method,
                                  "meaning": "largest log-ratio between this transcript's probability under any two "
                                             "devices' inputs over the whole run (not within a behavior pattern)"}
    return out
