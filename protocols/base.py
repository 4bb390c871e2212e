"""What every protocol provides: a device side for a cohort and a collector side (sans-IO, docs/design.md sections 1-2).

The runtime (SimPy or asyncio) hands the device side each decoded collector message together with the
devices' current private values and ``now``; it gets back the messages to send and the ledger charges.
The collector side opens rounds, takes report batches (raising :class:`ProtocolError` for a batch it must
reject) and closes rounds into estimates. Neither side reads a clock, sleeps or does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Sequence, runtime_checkable

import numpy as np

from protocols import config
from protocols.guard import Guarantee, Guard, Limits
from protocols.ledger import Charge
from protocols.messages import CollectionRequest, CollectorMessage, Decision, ReportBatch, Threshold

if TYPE_CHECKING:
    from protocols.collecting import ReportCollector


def check_params(epsilon: float, max_value: float, gamma: float = 0.0, total: bool = False) -> None:
    """The checks every protocol's parameters share (ValueError naming the scenario key); ``total``: epsilon is
    a run's total that the protocol divides (config.TOTAL_EPSILON_RANGE)."""
    low, high = config.TOTAL_EPSILON_RANGE if total else config.EPSILON_RANGE
    if not low <= epsilon <= high:
        raise ValueError(f"protocol.epsilon must be a number in [{low:g}, {high:g}], got {epsilon}")
    low, high = config.MAX_VALUE_RANGE
    if not low <= max_value <= high:
        raise ValueError(f"protocol.max_value must be a number in [{low:g}, {high:g}], got {max_value}")
    if not 0.0 <= gamma < 0.5:
        raise ValueError(f"protocol.gamma must be in [0, 0.5), got {gamma}")


def epoch_epsilon_problem(epsilon: float, epochs: int) -> str | None:
    """A total epsilon spread evenly over ``epochs`` epochs: each epoch's share is a privacy parameter too, so
    it must stay in range; what is wrong with it, or None."""
    low, high = config.EPSILON_RANGE
    if epochs >= 1 and not low <= epsilon / epochs <= high:
        return f"{epsilon:g} over {epochs} epochs is {epsilon / epochs:.3g} an epoch, outside [{low:g}, {high:g}]"
    return None


def check_epoch_epsilon(epsilon: float, epochs: int) -> None:
    """:func:`epoch_epsilon_problem` as a ValueError naming the scenario key."""
    problem = epoch_epsilon_problem(epsilon, epochs)
    if problem:
        raise ValueError(f"protocol.epsilon {problem}")


class ProtocolError(ValueError):
    """A peer's doing: a well-formed message the protocol must reject (wrong round, unknown device, bad
    column...). Runtimes count it against the peer and carry on."""


class LateBatch(ProtocolError):
    """A report batch that arrived after its round's or stage's deadline (a runtime counts it as late, not as
    a batch the protocol refuses)."""


class DefinitionError(ValueError):
    """A protocol class that declares what no runtime can run (a report column of a dtype the wire does not
    carry, say): the plugin author's to fix; the command line says it in one line."""


class MisuseError(ValueError):
    """Local misuse, a programming error in the runtime or a test, never a peer's doing: rounds that do not
    increase, closing a round that is not open, a snapshot with a stage open, days observed out of order,
    the wrong number of values for a cohort. Runtimes let it propagate."""


#: A round's estimate: a mean, or one value per bucket / counter; a report stage inside a multi-stage collector
#: (ToPL's) may instead hand its collector the round's reports by column.
Estimate = float | np.ndarray | dict[str, np.ndarray]


@dataclass(frozen=True)
class RoundResult:
    """The collector's output for one round."""

    round: int
    estimate: Estimate
    reports: int
    info: dict = field(default_factory=dict)  # protocol-specific figures (THRESH: global_update, vote_mean)


class DeviceSide(Protocol):
    """The device side of a cohort: ``respond`` answers one collector message with a report batch (or nothing)
    and the charges it made through ``guard``; ``snapshot``/``restore`` carry its state (protocols.snapshot).
    Epoch protocols also have ``observe(day, values, present)``, which the runtimes call every day."""

    device_ids: np.ndarray
    guard: Guard

    def respond(self, msg: CollectorMessage, day: int, values: np.ndarray, now: float,
                present: np.ndarray | None = None, /) -> tuple[ReportBatch | None, list[Charge]]: ...

    def snapshot(self) -> dict[str, Any]: ...

    def restore(self, state: dict[str, Any], /) -> None: ...


@runtime_checkable
class Observer(DeviceSide, Protocol):
    """A device side with epoch state (THRESH, HeavyTHRESH, the epoch protocols): the runtimes call ``observe``
    every day with the cohort's counters and which of its devices are present (None: all)."""

    def observe(self, day: int, values: np.ndarray, present: np.ndarray | None = None, /) -> None: ...


class CollectorSide(Protocol):
    """The collector side: ``request`` opens a round (or epoch) and returns its broadcast, ``receive`` takes a
    batch (ProtocolError: rejected whole), ``advance`` at a stage's deadline returns the next stage's broadcast
    or None when the round can close, ``close_round`` returns the round's estimate, ``is_open`` says whether a
    round is open (protocols.staged drives one with several stages). ``stages`` are its report
    stages with their stored transcripts, in protocol order; ``snapshot``/``restore`` carry its state."""

    name: str
    n_devices: int

    def request(self, round_: int, deadline: float, /) -> CollectionRequest: ...

    def receive(self, batch: ReportBatch, /) -> int: ...

    def advance(self, deadline: float, /) -> Decision | Threshold | None: ...

    def close_round(self) -> RoundResult: ...

    def is_open(self) -> bool: ...

    def stages(self) -> Sequence[tuple[str, ReportCollector]]: ...

    def transcript_digest(self) -> str: ...

    def snapshot(self, records: bool = True) -> dict[str, Any]: ...

    def restore(self, state: dict[str, Any], /) -> None: ...


#: what a protocol estimates (ProtocolParams.kind): the runtimes' outputs and plots follow it
KINDS = ("mean", "histogram", "counters", "epoch", "stream")


class ProtocolParams(Protocol):
    """A protocol's parameters double as its descriptor for the runtimes.

    ``kind`` is "mean" (one number per round), "histogram" (one frequency per bucket), "counters" (one mean per
    counter), "epoch" (THRESH-like: one estimate per epoch of days) or "stream" (ToPL, ToPS); ``truth`` and
    ``estimate_sd`` take the round's true (clipped) values; ``guarantee(horizon)`` is the largest total any
    device's ledger can reach in a run of ``horizon`` rounds (protocols.guard.Guarantee). A protocol module
    checks its parameter class against this (``_: type[ProtocolParams] = XParams`` under TYPE_CHECKING), and
    through it its device and collector sides against :class:`DeviceSide` and :class:`CollectorSide`.
    """

    @classmethod
    def from_table(cls, name: str, table: config.Table, ctx: config.Context, /) -> ProtocolParams:
        """The parameters of a scenario's [protocol] table (errors name the key)."""
        ...

    @property
    def name(self) -> str: ...

    @property
    def epsilon(self) -> float: ...

    @property
    def max_value(self) -> float: ...

    @property
    def kind(self) -> str: ...

    @property
    def round_epsilon(self) -> float: ...

    def guarantee(self, horizon: int, /) -> Guarantee: ...

    def make_devices(self, seed: int, device_ids: np.ndarray, limits: Limits | None = None, /) -> DeviceSide: ...

    def make_collector(self, n_devices: int, /) -> CollectorSide: ...

    def truth(self, values: np.ndarray, /) -> float | np.ndarray:
        """The round's true figure from the devices' values: a pure function of them (a runtime may call it on
        another thread, while the round's reports come in)."""
        ...

    def estimate_sd(self, values: np.ndarray, reports: int, /) -> float | np.ndarray:
        """The estimate's theoretical sd when ``reports`` of the devices report: a pure function of its
        arguments, like :meth:`truth`."""
        ...
