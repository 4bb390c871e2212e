"""Collector sides with several report stages a round, as explicit stage machines: states and transitions as data.

A round of a multi-stage protocol moves through named states (modelled on h11's ``_state.py``): ``idle``
between rounds, then one state per open report stage. Three events move it, each allowed only where the
protocol's :class:`StageGraph` lists it:

- ``request`` (the runtime opens round t): ``idle`` -> the round's first stage;
- ``advance`` (the open stage's deadline passed): stage -> the next stage, with the message that opens it
  (THRESH's decision, ToPL's threshold);
- ``close`` (the round's last stage's deadline passed): stage -> ``idle``, with the round's result.

:class:`StagedCollector` is the driver every multi-stage collector side shares: it walks the graph, refuses an
event the graph does not allow (:class:`~protocols.base.MisuseError`: a runtime bug) or a batch with no stage
open (:class:`~protocols.base.ProtocolError`: a peer's doing), keeps each stage's transcript
(:class:`~protocols.collecting.Stage`), and snapshots and restores between rounds or at a stage boundary (a
stage entered by ``advance`` and still empty). A protocol supplies the graph, the stages' columns and four
decisions: which stage opens a round (:meth:`StagedCollector.first_stage`), what a closed stage leads to
(:meth:`StagedCollector.on_stage_closed`), the round's result (:meth:`StagedCollector.finish`) and the message
of a stage restored open (:meth:`StagedCollector.boundary_message`). collector.stages walks any collector
side, one-stage or many, for both runtimes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from protocols import snapshot as snap
from protocols import transcript
from protocols.base import LateBatch, MisuseError, ProtocolError, RoundResult
from protocols.collecting import Column, Stage
from protocols.messages import CollectionRequest, ReportBatch

__all__ = ["IDLE", "REQUEST", "ADVANCE", "CLOSE", "StageGraph", "StagedCollector"]

IDLE = "idle"
REQUEST, ADVANCE, CLOSE = "request", "advance", "close"


@dataclass(frozen=True)
class StageGraph:
    """A round's states and transitions: ``transitions[(state, event)]`` lists the states that event may lead
    to from that state (``idle``, or a stage's name). An event missing from the table is not allowed there."""

    stages: tuple[str, ...]
    transitions: Mapping[tuple[str, str], tuple[str, ...]]

    def __post_init__(self) -> None:
        states = {IDLE, *self.stages}
        for (state, event), targets in self.transitions.items():
            if state not in states or event not in (REQUEST, ADVANCE, CLOSE) or not set(targets) <= states:
                raise ValueError(f"stage graph: ({state!r}, {event!r}) -> {targets} names an unknown state/event")

    def allows(self, state: str, event: str) -> bool:
        return (state, event) in self.transitions

    def move(self, state: str, event: str, target: str) -> str:
        """``target`` if the graph allows ``event`` from ``state`` to it; MisuseError otherwise."""
        if target not in self.transitions.get((state, event), ()):
            raise MisuseError(f"stage machine: {event!r} from {state!r} to {target!r} is not a transition")
        return target

    def entered_by_advance(self) -> set[str]:
        """The stages a round reaches only after another stage closed (where a snapshot may stop)."""
        return {t for (_, e), targets in self.transitions.items() if e == ADVANCE for t in targets}

    @classmethod
    def chain(cls, *stages: str, first: tuple[str, ...] | None = None) -> "StageGraph":
        """Stages in a line, each advancing to the next, the last closing the round; ``first``: the stages a
        round may open with (default the first one)."""
        trans: dict[tuple[str, str], tuple[str, ...]] = {(IDLE, REQUEST): first or stages[:1]}
        for a, b in zip(stages, stages[1:]):
            trans[(a, ADVANCE)] = (b,)
        trans[(stages[-1], CLOSE)] = (IDLE,)
        return cls(tuple(stages), trans)


class StagedCollector:
    """The driver of a multi-stage collector side (module docstring). Subclasses set ``GRAPH`` and call
    ``super().__init__(name, n_devices, {stage: columns})`` with the stages in protocol order."""

    GRAPH: ClassVar[StageGraph]

    def __init__(self, name: str, n_devices: int, stages: Mapping[str, tuple[Column, ...]]) -> None:
        if tuple(stages) != self.GRAPH.stages:
            raise MisuseError(f"{name}: stages {list(stages)} are not the graph's {list(self.GRAPH.stages)}")
        self.name, self.n_devices = name, int(n_devices)
        self._stages = {s: Stage(name, cols, n_devices) for s, cols in stages.items()}
        self._column_names = {s: frozenset(c.name for c in cols) for s, cols in stages.items()}
        self.state = IDLE
        self.round = 0

    # -------------------------------------------------------------------------------- protocol decisions
    def first_stage(self, round_: int) -> str:
        """The stage that opens ``round_`` (default: the graph's only choice)."""
        (first,) = self.GRAPH.transitions[(IDLE, REQUEST)]
        return first

    def on_stage_closed(self, stage: str, result: RoundResult, deadline: float) -> tuple[str, Any]:
        """Stage ``stage`` closed with ``result`` (its reports by column): the next stage and the message that
        opens it, closing at ``deadline``. Called only where the graph has an ``advance`` from ``stage``."""
        raise NotImplementedError(f"{type(self).__name__}.on_stage_closed")

    def finish(self, stage: str, result: RoundResult) -> RoundResult:
        """The round's result from its last stage's ``result``."""
        raise NotImplementedError(f"{type(self).__name__}.finish")

    def boundary_message(self, stage: str, deadline: float) -> Any:
        """The message that opened ``stage`` (entered by advance), for a collector restored at that boundary."""
        raise NotImplementedError(f"{type(self).__name__}.boundary_message")

    def check_batch(self, stage: str, batch: ReportBatch) -> None:
        """Protocol checks of a batch for ``stage`` beyond its columns (raise ProtocolError); none by default."""

    def extra_snapshot(self) -> dict:
        """Protocol state beyond the stages' transcripts (none by default)."""
        return {}

    def extra_restore(self, state: dict) -> None:
        return None

    # -------------------------------------------------------------------------------- the machine
    def stage(self, name: str) -> Stage:
        return self._stages[name]

    def request(self, round_: int, deadline: float) -> CollectionRequest:
        first = self.GRAPH.move(self.state, REQUEST, self.first_stage(round_))
        req = self._stages[first].request(round_, deadline)
        self.state, self.round = first, round_
        return req

    def receive(self, batch: ReportBatch) -> int:
        if self.state == IDLE:
            raise ProtocolError("no stage is open")
        names = self._column_names
        if batch.round == self.round and set(batch.columns) != names[self.state]:
            other = next((s for s in names if s != self.state and set(batch.columns) == names[s]), None)
            if other is not None:  # an answer to a stage of this round that closed before it arrived
                raise LateBatch(f"a {self.name} batch of stage {other!r} of round {batch.round}, which is not open "
                                f"(stage {self.state!r} is)")
        self.check_batch(self.state, batch)
        return self._stages[self.state].receive(batch)

    def advance(self, deadline: float) -> Any:
        """The open stage's deadline passed: close it and open the next (returning its message), or None when
        the open stage is the round's last (the runtime then calls :meth:`close_round`)."""
        if not self.GRAPH.allows(self.state, ADVANCE):
            return None
        closing = self.state
        result = self._stages[closing].close_round()
        target, message = self.on_stage_closed(closing, result, deadline)
        self.state = self.GRAPH.move(closing, ADVANCE, target)
        self._stages[target].request(self.round, deadline)
        return message

    def close_round(self) -> RoundResult:
        last = self.state
        self.GRAPH.move(last, CLOSE, IDLE)
        result = self._stages[last].close_round()
        self.state = IDLE
        return self.finish(last, result)

    def is_open(self) -> bool:
        """Whether a round is open (some stage is)."""
        return self.state != IDLE

    def at_boundary(self) -> bool:
        """Whether the open stage was entered by advance and has received nothing (a snapshot may stop here)."""
        s = self.state
        return s in self.GRAPH.entered_by_advance() and not self._stages[s].received_any()

    def open_message(self, deadline: float) -> Any:
        """The message that opened the open stage when advance opened it (a collector restored at that
        boundary broadcasts it again), else None."""
        return self.boundary_message(self.state, deadline) if self.state in self.GRAPH.entered_by_advance() \
            else None

    def stages(self) -> list[tuple[str, Stage]]:
        """The report stages in protocol order, each with its stored transcript."""
        return list(self._stages.items())

    def transcript_digest(self) -> str:
        """The canonical digest of every stage (protocols.transcript)."""
        return transcript.digest(self.stages())

    # -------------------------------------------------------------------------------- snapshots
    def snapshot(self, records: bool = True) -> dict:
        """Every stage's transcript, the open stage (``open_stage``: "" between rounds, else the stage open at
        a boundary) and the protocol's own state (protocols.snapshot)."""
        boundary = self.at_boundary()
        if self.state != IDLE and not boundary:
            raise MisuseError(f"{self.name}: a collector is snapshotted between rounds, not with a stage open")
        stages = {n: s.stage_snapshot(records, boundary=boundary) for n, s in self._stages.items()}
        return {"protocol": self.name, "stages": stages, "open_stage": self.state if boundary else "",
                **self.extra_snapshot()}

    def restore(self, state: dict) -> None:
        if snap.field(state, "protocol", str) != self.name:
            raise snap.SnapshotError(f"a {state['protocol']!r} snapshot cannot be restored into {self.name!r}")
        stages = snap.field(state, "stages", dict)
        if list(stages) != list(self._stages):
            raise snap.SnapshotError(f"{self.name} snapshot stages {list(stages)} are not {list(self._stages)}")
        for n, s in self._stages.items():
            s.stage_restore(snap.field(stages, n, dict))
        self.extra_restore(state)
        open_stage = state.get("open_stage", "")
        opened = [n for n, s in self._stages.items() if s.is_open()]
        if (open_stage and open_stage not in self.GRAPH.entered_by_advance()) or opened != ([open_stage] if open_stage
                                                                                             else []):
            raise snap.SnapshotError(f"{self.name} snapshot with open stage {open_stage!r:.20} does not fit its "
                                     "stages")
        self.state = open_stage or IDLE
