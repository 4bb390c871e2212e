"""The live collector's buffer budget: bytes it holds for its peers, shared fairly between their hosts.

A connection's incomplete frame (and, before its Hello is accepted, the Hello waiting for its MAC check) is held
in memory; :class:`BufferPool` counts those bytes by connection and by host. When the pool is over its budget,
the connection to drop is one of the host holding the most: the connection whose bytes crossed the line if it is
of that host, else that host's largest. A host holding no more than its fair share (the budget over the number
of hosts holding bytes) is therefore never dropped for the budget, whatever other hosts send: a peer flooding
the pool with incomplete frames from a few addresses loses its own connections, not an honest client's Hello
(before, whichever connection crossed the line was dropped, so 4,200 such frames from 8 addresses kept two
honest shards out for 8.5 s instead of 0.8).
"""

from __future__ import annotations

from typing import Generic, Hashable, TypeVar

C = TypeVar("C", bound=Hashable)

__all__ = ["BufferPool"]


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
