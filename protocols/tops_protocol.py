"""ToPS as a protocol: the central-DP baseline of Wang et al. (CCS 2021), run by a trusted collector.

Devices send raw values (no local randomization: the collector is trusted). In round 1 the values of a keyed
holdout of devices pick the threshold theta by report-noisy-max at ``threshold_epsilon`` (those values are
used for nothing else). Every round the collector clips each device's value to [0, theta] and feeds the sum,
whose sensitivity to one device's report is theta, to the fan-out-16 hierarchy with online consistency at
``epsilon`` (protocols.tops.ToPS; its Recent smoother is off here, see TopsCollector); the round's released value is the estimate of the
sum over reporting devices, scaled to the population. Event-level central DP: the ledger charges each device
``epsilon`` per report (``central_release``), the guarantee of the public release, not of what the trusted
collector sees.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from protocols import config
from protocols import keyed
from protocols.base import ProtocolParams, RoundResult, check_params
from protocols.collecting import Column, ReportCollector
from protocols.device import OneReportDevices
from protocols.guard import Guarantee, Guard, Limits
from protocols.keyed import Purpose, stream_key
from protocols.ledger import Charge
from protocols.messages import ReportBatch
from protocols.round_mechanism import NoRoundMechanism
from protocols.tops import MAX_CANDIDATES, ToPS, candidate_steps

TOPS = "tops"
CENTRAL_RELEASE = "central_release"
CENTRAL_THRESHOLD = "central_threshold"  # a round-1 holdout value, used only to choose theta


@dataclass(frozen=True)
class TopsParams:
    name: str
    epsilon: float
    threshold_epsilon: float
    max_value: float
    holdout: float
    rounds: int
    devices: int
    seed: int = 0
    threshold_step: float = 1.0  # the spacing of theta's candidates {0, step, 2 step, ...} (1: the integers)

    kind = "stream"
    method = "tops"

    def run_summary(self, rounds: list, spend_by_reason: dict[str, np.ndarray], devices: int) -> dict:
        """ToPS's part of summary.json: the threshold released in round 1 and the accounting."""
        return {"threshold": [{"round": 1, "theta": rounds[0].info.get("theta")}] if rounds else [],
        "event_level": {"epsilon_per_report": self.epsilon, "threshold_epsilon": self.threshold_epsilon,
                        "cumulative_per_device": "see epsilon: each report is charged its epsilon"}}

    #: the trust model: devices hand raw values to a trusted curator (central DP); a device's transcript is
    #: not private on its own, so local audits (scenarios/privacy_audit.py) do not apply
    central = True

    #: an example [protocol] table per name this class runs (ldpsim privacy-audit NAME, the conformance tests)
    examples = {'tops': {'epsilon': 1.0, 'threshold_epsilon': 1.0, 'max_value': 1.0, 'holdout': 0.05}}

    @classmethod
    def from_table(cls, name: str, table: "config.Table", ctx: "config.Context") -> "TopsParams":
        """[protocol] keys: epsilon, threshold_epsilon, max_value, holdout, threshold_step (default 1: theta
        among the integers, as in the paper; at most 2^22 candidates up to max_value)."""
        epsilon = config.epsilon(table)
        max_value = config.max_value(table)
        step = table.get("threshold_step", float, 1.0, check=config.positive, what="> 0")
        steps = candidate_steps(max_value, step)
        if steps > MAX_CANDIDATES - 2:
            raise table.fail("threshold_step", f"{step:g}{' (the default)' if 'threshold_step' not in table.data else ''}"
                                               f" gives {steps + 1:,} candidates up to max_value {max_value:g}; at "
                                               f"most {MAX_CANDIDATES - 1:,}: set a larger step")
        return cls(name, epsilon, config.epsilon(table, "threshold_epsilon", epsilon), max_value,
                   config.holdout_share(table, ctx.devices), ctx.rounds, ctx.devices, ctx.seed, step)

    def __post_init__(self) -> None:
        check_params(self.epsilon, self.max_value)
        check_params(self.threshold_epsilon, self.max_value)
        if not 0 < self.holdout < 1:
            raise ValueError(f"protocol.holdout must be a share in (0, 1), got {self.holdout}")
        if not (math.isfinite(self.threshold_step) and self.threshold_step > 0):
            raise ValueError(f"protocol.threshold_step must be a positive number, got {self.threshold_step}")

    @property
    def round_epsilon(self) -> float:
        return self.epsilon

    def threshold_round(self, r: int) -> bool:
        return r == 1

    def guarantee(self, horizon: int) -> Guarantee:
        top = max(self.epsilon, self.threshold_epsilon)
        return Guarantee((horizon - 1) * self.epsilon + top,
                         f"(R - 1) x eps + max(eps, eps_threshold) = {horizon - 1} x {self.epsilon:g} + {top:g}",
                         "event-level central DP of the public release (the collector is trusted and sees raw values)")

    def round_mechanism(self, round_: int = 1) -> NoRoundMechanism:
        """ToPS is central DP: devices send raw values and the trusted collector adds noise to the nodes of a
        hierarchy, each node covering many rounds, so one round's value meets the same noise draws as its
        neighbours'. There is no fresh per-round mechanism on the device to compose."""
        return NoRoundMechanism("central DP: the collector's hierarchy noise is shared by the rounds under each "
                                "node, not a fresh per-round mechanism on the device")

    def make_devices(self, seed: int, device_ids: np.ndarray, limits: Limits | None = None) -> "TopsDevices":
        return TopsDevices(self, seed, device_ids, limits)

    def make_collector(self, n_devices: int) -> "TopsCollector":
        return TopsCollector(self, n_devices)

    def truth(self, values: np.ndarray) -> float:
        return float(values.sum())

    def estimate_sd(self, values: np.ndarray, reports: int) -> float:
        return math.nan


def in_holdout(params: TopsParams, device_ids: np.ndarray) -> np.ndarray:
    """The keyed round-1 holdout whose values choose theta (the collector draws the same)."""
    return keyed.uniform(stream_key(params.seed, Purpose.HOLDOUT, 1), device_ids) < params.holdout


class TopsDevices(OneReportDevices):
    """Raw values to the trusted collector, one a round. Charged the event-level guarantee of what is released
    from each value: ``epsilon`` (``central_release``), or ``threshold_epsilon`` for a round-1 holdout value,
    which only the noisy-max threshold choice sees (``central_threshold``)."""

    def __init__(self, params: TopsParams, seed: int, device_ids: np.ndarray, limits: Limits | None = None) -> None:
        self.params, self.seed = params, int(seed)
        self.device_ids = np.ascontiguousarray(device_ids, dtype=np.uint64)
        self.guard = Guard(self.device_ids, limits)

    def report_batch(self, round_: int, values: np.ndarray, rows: np.ndarray,
                     now: float) -> tuple[ReportBatch | None, list[Charge]]:
        """The raw values of the devices at ``rows`` the budget can pay, each charged its release."""
        p = self.params
        hold = in_holdout(p, self.device_ids[rows]) if round_ == 1 else np.zeros(rows.size, bool)
        ok = self.guard.affordable(np.where(hold, p.threshold_epsilon, p.epsilon), rows)
        rows, hold = rows[ok], hold[ok]
        x = np.clip(np.asarray(values, dtype=np.float64)[rows], 0.0, p.max_value)
        charges = [self.guard.charge(round_, now, CENTRAL_RELEASE, p.epsilon, rows[~hold])]
        if hold.any():
            charges.append(self.guard.charge(round_, now, CENTRAL_THRESHOLD, p.threshold_epsilon, rows[hold]))
        return ReportBatch(round_, p.name, self.wire_ids(rows), {"x": x}), charges


class TopsCollector(ReportCollector):
    """The trusted collector: raw values in, the ToPS release out."""

    def __init__(self, params: TopsParams, n_devices: int) -> None:
        self.params, self.name = params, params.name
        self.columns = (Column("x", np.float64, low=0.0, high=params.max_value),)
        super().__init__(n_devices)
        # smooth_levels = 0: the Recent smoother predicts a step from the previous block (and guesses theta/2
        # per step at first), which pays off when a step's value is comparable to the noise; a round's sum over
        # many devices is 1e4-1e5 times the noise scale theta/eps here, so smoothing would only add error
        self.tops = ToPS(params.max_value, params.epsilon, params.threshold_epsilon, range_limit=params.rounds,
                         seed=params.seed, smooth_levels=0, threshold_step=params.threshold_step)
        self.history: list[tuple[int, float]] = []
        self.fallback = False  # theta = max_value because round 1 had no holdout value

    def extra_snapshot(self) -> dict:
        return {"tops": self.tops.snapshot(), "fallback": self.fallback,
                "history_rounds": np.array([r for r, _ in self.history], dtype=np.int64),
                "history_thetas": np.array([t for _, t in self.history], dtype=np.float64)}

    def extra_restore(self, state: dict) -> None:
        from protocols import snapshot as snap

        self.tops.restore(snap.field(state, "tops", dict))
        self.fallback = snap.field(state, "fallback", bool)
        rounds = snap.array(state, "history_rounds", np.int64, (None,))
        thetas = snap.array(state, "history_thetas", np.float64, rounds.shape)
        self.history = list(zip(rounds.tolist(), thetas.tolist()))

    def estimate(self, reports: dict[str, np.ndarray]) -> float:
        x = reports["x"][:, 0]
        if self.round == 1:  # round 1: the keyed holdout's values choose theta, then sit this round out
            hold = in_holdout(self.params, self._present_ids.astype(np.uint64))
            self._choose_threshold(x[hold], x.size)
            x = x[~hold]
        theta = self.tops.threshold
        assert theta is not None  # chosen in round 1, above
        released = self.tops.add(float(np.minimum(x, theta).sum()), clip=False)
        return released * self.n_devices / x.size if x.size else math.nan  # no report: no estimate

    def _choose_threshold(self, holdout: np.ndarray, reports: int) -> None:
        """NM-E on the holdout; with no holdout value at all (a tiny or lossy round 1), theta = max_value, a
        choice that depends on no data (no truncation; the noise is the largest it can be).

        The score constant's N - h counts the *values* a range query's truncation bias adds up, not the
        steps of the released stream: each step here is the sum of a round's m reports (round 1's
        ``reports``, the holdout included, stands for every round's), so N - h = R x m - h (the paper's
        stream has one value a step, m = 1). With N - h = R, as for a stream of single values, a short run
        picked theta = 0 on any data (R <= 7 on POS) and released only zeros."""
        if holdout.size:
            span = max(1, self.params.rounds * reports - holdout.size)
            theta = self.tops.choose_threshold(holdout, span=span)
        else:
            theta = self.params.max_value
            self.tops.set_threshold(theta)
            self.fallback = True
        self.history.append((self.round, theta))

    def close_round(self) -> RoundResult:
        self._present_ids = np.flatnonzero(self._present) if self._present is not None else np.empty(0, np.int64)
        res = super().close_round()
        if res.reports == 0:  # a round without reports has no estimate, but the release stream keeps its step
            if self.tops.threshold is None:
                self._choose_threshold(np.empty(0), 0)
            self.tops.add(0.0, clip=False)
        return RoundResult(res.round, res.estimate, res.reports,
                           info={"theta": self.tops.threshold if self.tops.threshold is not None else math.nan})


if TYPE_CHECKING:  # mypy: the descriptor, and through it the device and collector sides, match protocols.base
    _TopsParams: type[ProtocolParams] = TopsParams
