"""The hosts' fair shares of the live collector's limits: its buffer budget and its connection slots.

Both limits are shared by every peer, honest or not, so each is given out by host (collector/server.py's
``peer_key``: an IPv4 address, an IPv6 /64), and a peer that takes more than its share loses its own:

- :class:`BufferPool`: bytes held for connections (incomplete frames, Hellos waiting for their MAC check). When
  the pool is over its budget, the connection to drop is one of the host holding the most: the connection whose
  bytes crossed the line if it is of that host, else that host's largest. A host holding no more than its fair
  share (the budget over the number of hosts holding bytes) is therefore never dropped for the budget, whatever
  other hosts send (before, whichever connection crossed the line was dropped, so 4,200 incomplete frames from
  8 addresses kept two honest 50,000-device shards out for 5.2 s instead of 0.5).
- :class:`Pending`: the connections that have said no Hello, oldest first, in all and by host, with the host
  holding the most at hand in constant time, so that a newcomer at the connection limit can take the place of
  a crowded host's connection (LiveCollector._make_room).
- :class:`Turns`: the turns at the MAC check (one Hello at a time) in two classes: first registrations before
  the Hellos that name devices registered before or named by a Hello that failed its full MAC, or that come
  from a host one of whose Hellos failed it (LiveCollector._verify); within a class, groups take turns, each
  first come first served: a host, or a network whose Hellos failed (LiveCollector._turn_group).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, Hashable, TypeVar

C = TypeVar("C", bound=Hashable)

__all__ = ["BufferPool", "Pending", "Turns"]


class BufferPool(Generic[C]):
    """Bytes held for connections (``C``: any hashable handle), by host, against ``budget``."""

    def __init__(self, budget: int) -> None:
        self.budget = int(budget)
        self.total = 0
        self._of: dict[str, dict[C, int]] = {}  # host -> connection -> bytes (> 0 only)
        self._host_total: dict[str, int] = {}

    def held(self, conn: C, host: str) -> int:
        """Bytes ``conn`` holds in the pool."""
        return self._of.get(host, {}).get(conn, 0)

    def host_bytes(self, host: str) -> int:
        """Bytes the connections of ``host`` hold in the pool."""
        return self._host_total.get(host, 0)

    def add(self, conn: C, host: str, change: int) -> None:
        """Count ``change`` more bytes for ``conn`` (less when negative; never below none)."""
        conns = self._of.get(host)
        old = conns.get(conn, 0) if conns is not None else 0
        new = max(old + int(change), 0)
        if new == old:
            return
        if conns is None:
            conns = self._of[host] = {}
        if new:
            conns[conn] = new
        else:
            del conns[conn]
        self.total += new - old
        left = self._host_total.get(host, 0) + new - old
        if left:
            self._host_total[host] = left
        else:
            self._host_total.pop(host, None)
            if not conns:
                del self._of[host]

    def remove(self, conn: C, host: str) -> int:
        """Take every byte of ``conn`` out of the pool; how many there were."""
        held = self.held(conn, host)
        self.add(conn, host, -held)
        return held

    @property
    def over(self) -> bool:
        return self.total > self.budget

    def victim(self, conn: C, host: str) -> tuple[C, str]:
        """The connection to drop, the pool being over budget after ``conn`` (of ``host``) added bytes: ``conn``
        itself when its host holds the most (ties included), else the largest connection of the host that
        does; with that host."""
        top = max(self._host_total, key=self._host_total.__getitem__)
        if self._host_total.get(host, 0) >= self._host_total[top]:
            return conn, host
        conns = self._of[top]
        return max(conns, key=conns.__getitem__), top


class Pending(Generic[C]):
    """Connections (``C``) waiting to say their Hello, oldest first: in all, by host, and hosts by how many they
    have (so :meth:`crowded` is constant time: counts change by one at a time)."""

    def __init__(self) -> None:
        self.all: dict[C, None] = {}
        self._of: dict[str, dict[C, None]] = {}
        self._with: dict[int, dict[str, None]] = {}  # count -> the hosts with that many, in the order they got it
        self._top = 0

    def __len__(self) -> int:
        return len(self.all)

    def of(self, host: str) -> dict[C, None]:
        """The connections of ``host``, oldest first (do not modify)."""
        return self._of.get(host, {})

    def count(self, host: str) -> int:
        return len(self._of.get(host, ()))

    def _move(self, host: str, old: int, new: int) -> None:
        if old:
            hosts = self._with[old]
            del hosts[host]
            if not hosts:
                del self._with[old]
                if self._top == old:
                    self._top = new
        if new:
            self._with.setdefault(new, {})[host] = None
            self._top = max(self._top, new)

    def add(self, conn: C, host: str) -> None:
        conns = self._of.setdefault(host, {})
        if conn in conns:
            return
        conns[conn] = None
        self.all[conn] = None
        self._move(host, len(conns) - 1, len(conns))

    def discard(self, conn: C, host: str) -> None:
        conns = self._of.get(host)
        if conns is None or conn not in conns:
            return
        del conns[conn]
        del self.all[conn]
        self._move(host, len(conns) + 1, len(conns))
        if not conns:
            del self._of[host]

    def crowded(self) -> tuple[str, int] | None:
        """A host with the most connections (the first to get that many), and how many; None when none."""
        if not self._top:
            return None
        return next(iter(self._with[self._top])), self._top


class Turns:
    """One holder at a time; waiters are served in two classes, ``urgent`` ones first (an asyncio.Lock with a
    second, lower queue), but never more than ``burst`` urgent turns in a row while a waiter of the lower class
    waits, and a waiter of the lower class joins the urgent ones after ``promote_after`` seconds: a stream of
    urgent ones (forged Hellos, refused after one key derivation each, from a peer without credentials) never
    starves the others (an honest client reconnecting waited 15 s).

    Within a class, waiters are grouped (``group``: a host, or a network that sent failing Hellos) and the
    groups take turns, first come first served within a group: waiters from many hosts of one such network
    delay another group's by one turn, not by one turn each (a peer on 100 addresses, demoting a shard by
    marking its devices, held it behind 100 full MAC checks: 3.3 s)."""

    def __init__(self, burst: int = 4) -> None:
        self._busy = False
        #: per class (urgent, other): waiters by group, the groups in the order they are served
        self._classes: tuple[dict[str, deque[asyncio.Future[None]]], dict[str, deque[asyncio.Future[None]]]] = \
            ({}, {})
        self.burst = int(burst)
        self._run = 0  # urgent turns given in a row while the lower class had a waiter

    @property
    def waiting(self) -> int:
        return sum(self._waiting(c) for c in (0, 1))

    def _waiting(self, cls: int) -> int:
        return sum(1 for queue in self._classes[cls].values() for f in queue if not f.done())

    def _leave(self, cls: int, group: str, turn: asyncio.Future[None]) -> bool:
        """Take ``turn`` out of its group's queue in class ``cls``; whether it was there."""
        queue = self._classes[cls].get(group)
        if queue is None or turn not in queue:
            return False
        queue.remove(turn)
        if not queue:
            del self._classes[cls][group]
        return True

    async def acquire(self, urgent: bool, promote_after: float | None = None, group: str = "") -> None:
        """Wait for the turn (cancellable: a waiter cancelled as its turn came passes the turn on)."""
        if not self._busy and not self.waiting:
            self._busy = True
            return
        loop = asyncio.get_running_loop()
        turn: asyncio.Future[None] = loop.create_future()
        self._classes[0 if urgent else 1].setdefault(group, deque()).append(turn)

        def promote() -> None:
            if self._leave(1, group, turn):  # (not handed the turn meanwhile) to its group's urgent ones
                self._classes[0].setdefault(group, deque()).append(turn)

        # a timer, not a wait_for on the turn: a waiter cancelled as it is handed the turn must see the
        # cancellation here, to pass the turn on (an inner wait_for swallowed it and lost the turn for good)
        timer = loop.call_later(promote_after, promote) if not urgent and promote_after is not None else None
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():  # handed the turn as it was cancelled: pass it on
                self.release()
            raise
        finally:
            if timer is not None:
                timer.cancel()
            self._leave(0, group, turn) or self._leave(1, group, turn)

    def _next(self, cls: int) -> asyncio.Future[None] | None:
        """The first waiter of the first group of class ``cls``, whose group then goes last; None: none."""
        groups = self._classes[cls]
        while groups:
            group = next(iter(groups))
            queue = groups.pop(group)
            while queue:
                turn = queue.popleft()
                if not turn.done():
                    if queue:
                        groups[group] = queue  # its group's next waiter after every other group's
                    return turn
        return None

    def release(self) -> None:
        """End the holder's turn: the next urgent waiter's (but the next other's after ``burst`` of them in a row),
        else the next other's, else nobody's."""
        for cls in ((1, 0) if self._run >= self.burst else (0, 1)):
            turn = self._next(cls)
            if turn is not None:
                turn.set_result(None)
                self._run = self._run + 1 if cls == 0 and self._waiting(1) else 0
                return
        self._busy = False
        self._run = 0
