"""Device-side privacy enforcement: the horizon, the budget, and the only way a device side makes a charge.

Privacy is enforced where the data is (docs/design.md section 6): whatever a collector sends, a device answers
only rounds inside the scenario's horizon, each round once and in order, and never spends past its budget.
Every device side holds one :class:`Guard` per cohort. A cumulative charge is made through
:meth:`Guard.charge`, which adds the amount to the device's own running total *and* returns the
:class:`~protocols.ledger.Charge` the runtime records, so the ledger and what the device believes it spent
cannot drift apart.

Counters (summed into ``summary.json`` -> ``privacy``):
- ``refusals``: device-reports withheld (or replaced by a data-free message) because the report's charge
  would take the device past ``Limits.budget``;
- ``ignored``: collector messages a cohort refused as a whole: rounds outside the horizon, repeated or
  stale rounds, other protocols, absurd broadcasts (e.g. a ToPL threshold <= 0 or a reused version);
  ``ignored_rows``: device-messages refused by some devices of a cohort only (a ToPL threshold no newer
  than the one a device holds); summed as ``device_messages_ignored``: once per device of the cohort for
  the first, once per refusing device for the second, so that the figure does not depend on how the
  devices are split into cohorts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from protocols.ledger import Charge

#: the largest round number a message can carry (wire format: a signed 32-bit round)
MAX_ROUND = 2**31 - 1
SLACK = 1e-9  # float tolerance of the budget test (charges are sums of a few floats)


class BudgetOverrun(RuntimeError):
    """A charge that would take a device past its budget (:meth:`Guard.charge`): a device side that did not ask
    :meth:`Guard.affordable` first. The charge is not made and the cohort's answer is not sent."""


@dataclass(frozen=True)
class Limits:
    """What a device will do at most. ``horizon``: the last collection round (the last epoch for epoch
    protocols) it answers; ``budget``: total epsilon per device, or None for no budget beyond the protocol's
    own guarantee."""

    horizon: int = MAX_ROUND
    budget: float | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.horizon <= MAX_ROUND:
            raise ValueError(f"horizon must be in [1, {MAX_ROUND}], got {self.horizon}")
        if self.budget is not None and not (np.isfinite(self.budget) and self.budget > 0):
            raise ValueError(f"privacy.budget must be a positive number, got {self.budget}")


class Guard:
    """Enforcement state of one cohort: per-device spend, the last round answered, and the counters."""

    def __init__(self, device_ids: np.ndarray, limits: Limits | None = None) -> None:
        self.device_ids = np.ascontiguousarray(device_ids, dtype=np.uint64)
        self.limits = limits or Limits()
        self.spent = np.zeros(self.device_ids.size, dtype=np.float64)
        self.last_round = 0
        self.refusals = 0
        self.ignored = 0
        self.ignored_rows = 0

    # ------------------------------------------------------------------------------------------ snapshots
    def snapshot(self) -> dict:
        """Spend, last round answered and counters (protocols.snapshot)."""
        return {"device_ids": self.device_ids, "spent": self.spent.copy(), "last_round": self.last_round,
                "refusals": self.refusals, "ignored": self.ignored,
                "ignored_rows": self.ignored_rows}

    def restore(self, state: dict) -> None:
        from protocols import snapshot as snap

        snap.same_devices(state, self.device_ids)
        snap.put(self.spent, state, "spent")
        self.last_round = snap.field(state, "last_round", int)
        self.refusals = snap.field(state, "refusals", int)
        self.ignored = snap.field(state, "ignored", int)
        self.ignored_rows = snap.field(state, "ignored_rows", int)

    # ------------------------------------------------------------------------------------------ rounds
    def in_horizon(self, round_: int) -> bool:
        return 1 <= round_ <= self.limits.horizon

    def admit(self, round_: int, current: int | None = None) -> bool:
        """Accept a collection round: inside the horizon, after the last one answered, and equal to the
        devices' own ``current`` round when given. Records it as answered; counts a refusal as ignored."""
        if not self.in_horizon(round_) or round_ <= self.last_round or (current is not None and round_ != current):
            self.ignored += 1
            return False
        self.last_round = round_
        return True

    @property
    def device_messages_ignored(self) -> int:
        """``ignored`` x the cohort's devices + ``ignored_rows``: a message counts once per device that refused
        it, a figure that does not depend on how the devices are split into cohorts (summary.json's
        ``privacy.ignored_messages``)."""
        return self.ignored * int(self.device_ids.size) + self.ignored_rows

    def ignore(self, devices: int | None = None) -> None:
        """Count a collector message refused for a reason the device side checked itself: by the whole cohort
        (``devices`` None), or by ``devices`` of its devices only (a check of per-device state)."""
        if devices is None:
            self.ignored += 1
        else:
            self.ignored_rows += int(devices)

    # ------------------------------------------------------------------------------------------ budget
    def affordable(self, cost: np.ndarray | float, rows: np.ndarray | None = None) -> np.ndarray:
        """Boolean mask over ``rows`` (all devices when None; an index array or a mask) of the devices whose
        spend plus ``cost`` (a scalar or one value per selected row) stays within the budget. The others
        are counted as refusals; a row with cost 0 is always affordable."""
        spent = self.spent if rows is None else self.spent[rows]
        cost = np.broadcast_to(np.asarray(cost, dtype=np.float64), spent.shape)
        if self.limits.budget is None:
            return np.ones(spent.shape, dtype=bool)
        ok = (cost <= 0) | (spent + cost <= self.limits.budget + SLACK)
        self.refusals += int(ok.size - np.count_nonzero(ok))
        return ok

    def charge(self, round_: int, now: float, reason: str, amount: float, rows: np.ndarray) -> Charge:
        """Spend ``amount`` for the devices at ``rows`` (an index array or a boolean mask over the cohort) and
        return the ledger record. The only way a device side makes a cumulative charge.

        With a budget, a device side asks :meth:`affordable` before it computes a report; a charge that would
        still take a device past the budget raises :class:`BudgetOverrun` (a device side that forgot to ask:
        the cohort's answer is not sent), so no protocol, built-in or plugin, spends past it."""
        idx = np.flatnonzero(rows) if rows.dtype == np.bool_ else np.asarray(rows, dtype=np.int64)
        budget = self.limits.budget
        if budget is not None and amount > 0 and idx.size:
            worst = float(self.spent.max() if idx.size == self.spent.size else self.spent[idx].max())
            if worst + amount > budget + SLACK:
                raise BudgetOverrun(f"a device side charged {amount:.6g} ({reason!r}, round {round_}) to a device "
                                    f"that has spent {worst:.6g} of its budget {budget:.6g}: it must ask "
                                    f"Guard.affordable before computing a report (a bug in the protocol)")
        if amount > 0 and idx.size == self.spent.size:  # every device (a fresh round): no gather/scatter
            self.spent += amount
        elif amount > 0 and idx.size:
            self.spent[idx] += amount
        return Charge(round_, now, reason, float(amount), self.device_ids[idx])


@dataclass(frozen=True)
class Guarantee:
    """A protocol's per-device privacy bound for a run of ``horizon`` collection rounds.

    ``value`` is the total epsilon the ledger can reach for any device (what a budget is compared with);
    ``derivation`` says how it follows from the parameters; ``scope`` says what kind of bound it is. For
    memoized protocols ``value`` is the within-pattern figure of Ding et al. 2017, Theorem 4, and
    ``worst_case`` (value, exact, method) is the loss of a device's whole transcript against *any* other
    device's, a different kind of number that is reported beside it, never instead of it.
    """

    value: float
    derivation: str
    scope: str = "eps-LDP of a device's whole transcript against any collector (basic composition)"
    worst_case: tuple[float, bool, str] | None = None
