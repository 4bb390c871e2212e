"""One collection round as a stage machine, shared by the simulated collector and the live server.

A collector side (protocols.base.CollectorSide) is a stage machine (a multi-stage one declares its states and
transitions as data, protocols.staged): ``request(t, close_at)`` opens round t's
first stage and returns the message to broadcast; ``advance(close_at)`` is called when a stage's deadline
passes and returns the next stage's message (THRESH: the decision that asks for estimates; ToPL: the
threshold) or None; ``close_round()`` turns the round into its result. :func:`round_stages` walks that
machine as a generator of :class:`StageStep`: the runtime broadcasts each step's messages, waits for the
stage to close (simulated time, or every connection's acknowledgement), and sends the generator on; the
generator's return value is the round's result. A hostile collector's extra messages
(collector.hostile.Hostility) are placed in the steps here, once, for both runtimes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generator

from protocols.base import CollectorSide, RoundResult

__all__ = ["StageStep", "round_stages"]


@dataclass
class StageStep:
    """One open stage: broadcast ``before``, then ``message``, then ``after``; it opened at ``opens_at`` and
    closes at ``closes_at`` (simulated seconds). ``first``: the round's first stage (opened by request)."""

    message: Any
    opens_at: float
    closes_at: float
    first: bool
    before: list[Any] = field(default_factory=list)
    after: list[Any] = field(default_factory=list)

    def broadcasts(self) -> list[Any]:
        return [*self.before, self.message, *self.after]


def round_stages(protocol: CollectorSide, t: int, close_at: float, deadline: float, hostility: Any = None,
                 resume: tuple[Any, float] | None = None) -> Generator[StageStep, float | None, RoundResult]:
    """Round t's stages: the first closes at ``close_at``, each next one ``deadline`` after the previous one
    closed (the runtime sends the time it closed, or None for the nominal time). ``resume``: the open stage's
    (message, close_at) of a round resumed at a stage boundary (no request, no start-of-round hostility)."""
    if resume is not None:
        message, close_at = resume
        first, before = False, []
    else:
        message = protocol.request(t, close_at)
        first, before = True, list(hostility.start_round()) if hostility is not None else []
    while message is not None:
        after = list(hostility.after(message)) if hostility is not None else []
        closed = yield StageStep(message, close_at - deadline, close_at, first, before, after)
        first, before = False, []
        close_at = (close_at if closed is None else closed) + deadline
        message = protocol.advance(close_at)
    return protocol.close_round()
