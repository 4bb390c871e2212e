"""Permanent memoization: alpha-point rounding and the set of memoized responses a device has revealed.

Ding, Kulkarni, Yekhanin (NIPS 2017), section 3 (docs/algorithms.md section 2). A device fixes one response per
memoization input (a grid value for 1BitRRPM, a position of J for dBitFlipPM); the memo table is never stored
because the response is a keyed pure function of (seed, device, input). What must be stored is which inputs a
device has already revealed, because the ledger charges eps the first time each is revealed (Theorem 4:
spend = pattern width x eps).
"""

from __future__ import annotations

from typing import Protocol

import numba as nb
import numpy as np

from protocols.base import MisuseError
from protocols.device import at_rows
from protocols.guard import Guard
from protocols.ledger import FRESH_REPORT, MEMO_REVEAL, ROUND_GUARANTEE, Charge


def alpha_round(x: np.ndarray, alpha: np.ndarray, s: float) -> np.ndarray:
    """Alpha-point rounding to the grid {0, s, 2s, ...}: ``L = floor(x/s) s``; ``L`` if ``x + alpha < L + s``.

    With ``alpha`` uniform on [0, s) this rounds up with probability ``(x - L)/s`` exactly, so
    ``E[rounded] = x`` (Theorem 3). Integer counters with integer ``alpha`` in {0..s-1} give the same
    probability, so one continuous ``alpha`` serves both. Returns the grid index ``rounded / s``.
    """
    x = np.asarray(x, dtype=np.float64)
    low = np.floor(x / s)
    return (low + (x + alpha >= (low + 1.0) * s)).astype(np.int64)


@nb.njit(inline="always")
def _bitset_add(table, words, row, item):
    """Mark (row, item) in a dense reveal bitset (``words`` uint64 words a row); whether it was not marked
    before."""
    w = row * words + (item >> 6)
    bit = np.uint64(1) << np.uint64(item & 63)
    if table[w] & bit:
        return False
    table[w] |= bit
    return True


@nb.njit(cache=True, nogil=True)
def _in_range(items, width):
    """Whether every item is in [0, width): one pass without an early exit (vector instructions)."""
    bad = False
    for i in range(items.shape[0]):
        bad |= (items[i] < 0) | (items[i] >= width)
    return not bad


@nb.njit(cache=True, nogil=True)
def _bitset_insert(table, words, rows, items, new):
    for i in range(rows.shape[0]):
        new[i] = _bitset_add(table, words, rows[i], items[i])


@nb.njit(cache=True, nogil=True)
def _bitset_insert_at(table, words, rows, items, at):
    """:func:`_bitset_insert` writing the positions i of the new pairs to ``at`` in order (a mask and then
    numpy's selection by it took twice as long when few are new); returns how many. Without a branch on
    whether a pair is new (every position is written, the count moves on by 0 or 1): 1.2 ns a pair whatever
    the share of new ones, where the branch took 1.7 ns at 5% new and 4.3 ns at 30%."""
    count = 0
    for i in range(rows.shape[0]):
        w = rows[i] * words + (items[i] >> 6)
        bit = np.uint64(1) << np.uint64(items[i] & 63)
        old = table[w]
        table[w] = old | bit
        at[count] = i
        count += (old & bit) == np.uint64(0)
    return count


@nb.njit(cache=True, nogil=True)
def _hash_insert(table, width, rows, items, new):
    mask = np.uint64(table.shape[0] - 1)
    added = 0
    for i in range(rows.shape[0]):
        key = np.uint64(rows[i]) * np.uint64(width) + np.uint64(items[i]) + np.uint64(1)
        h = (key * np.uint64(0x9E3779B97F4A7C15)) & mask
        while True:
            cur = table[h]
            if cur == key:
                new[i] = False
                break
            if cur == 0:
                table[h] = key
                new[i] = True
                added += 1
                break
            h = (h + np.uint64(1)) & mask
    return added


@nb.njit(cache=True, nogil=True)
def _bitset_contains(table, words, rows, items, out):
    for i in range(rows.shape[0]):
        w = rows[i] * words + (items[i] >> 6)
        out[i] = (table[w] >> np.uint64(items[i] & 63)) & np.uint64(1) == np.uint64(1)


@nb.njit(cache=True, nogil=True)
def _hash_contains(table, width, rows, items, out):
    mask = np.uint64(table.shape[0] - 1)
    for i in range(rows.shape[0]):
        key = np.uint64(rows[i]) * np.uint64(width) + np.uint64(items[i]) + np.uint64(1)
        h = (key * np.uint64(0x9E3779B97F4A7C15)) & mask
        out[i] = False
        while table[h] != 0:
            if table[h] == key:
                out[i] = True
                break
            h = (h + np.uint64(1)) & mask


class RevealSet:
    """Which (device row, memo input) pairs a cohort has revealed; ``insert`` reports the new ones.

    ``rows`` index the cohort's devices (0..size-1) and ``items`` the memoization inputs (0..width-1).
    A dense bitset when the inputs are few (at most 256: 32 bytes a device), otherwise an open-addressing
    hash set whose memory grows with what was revealed, not with the grid.
    """

    DENSE_MAX = 256

    def __init__(self, size: int, width: int) -> None:
        if size < 0 or width < 1:
            raise ValueError("RevealSet needs size >= 0 and width >= 1")
        self.size, self.width = int(size), int(width)
        self.dense = width <= self.DENSE_MAX
        if self.dense:
            self._words = (width + 63) // 64
            self._table = np.zeros(self.size * self._words, dtype=np.uint64)
        else:
            self._table = np.zeros(1024, dtype=np.uint64)
            self._count = 0

    def insert(self, rows: np.ndarray, items: np.ndarray, positions: bool = False) -> np.ndarray:
        """Mark (rows[i], items[i]) revealed; True where it was not revealed before. Rows must be distinct.
        ``positions``: instead of the mask, the positions i (increasing, int64) where it is True."""
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        items = np.ascontiguousarray(items, dtype=np.int64)
        if not _in_range(items, self.width):  # one compiled pass (numpy's min and max took two)
            raise ValueError(f"memo input out of range [0, {self.width})")
        if self.dense and positions:
            at = np.empty(rows.shape[0], dtype=np.int64)
            return at[:_bitset_insert_at(self._table, self._words, rows, items, at)]
        new = np.empty(rows.shape[0], dtype=np.bool_)
        if self.dense:
            _bitset_insert(self._table, self._words, rows, items, new)
        else:
            need = 2 * (self._count + rows.shape[0])
            if need > self._table.shape[0]:
                self._grow(need)
            self._count += _hash_insert(self._table, self.width, rows, items, new)
        return np.flatnonzero(new) if positions else new

    def contains(self, rows: np.ndarray, items: np.ndarray) -> np.ndarray:
        """True where (rows[i], items[i]) was revealed before (no state change)."""
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        items = np.ascontiguousarray(items, dtype=np.int64)
        out = np.empty(rows.shape[0], dtype=np.bool_)
        if self.dense:
            _bitset_contains(self._table, self._words, rows, items, out)
        else:
            _hash_contains(self._table, self.width, rows, items, out)
        return out

    def _grow(self, need: int) -> None:
        capacity = 1 << max(10, int(need - 1).bit_length())
        old = self._table[self._table != 0] - np.uint64(1)
        self._table = np.zeros(capacity, dtype=np.uint64)
        scratch = np.empty(old.shape[0], dtype=np.bool_)
        rows = (old // np.uint64(self.width)).astype(np.int64)
        items = (old % np.uint64(self.width)).astype(np.int64)
        _hash_insert(self._table, self.width, rows, items, scratch)

    def snapshot(self) -> dict:
        """The revealed (row, input) pairs: the bitset, or the hash table and its count (protocols.snapshot)."""
        out = {"size": self.size, "width": self.width, "table": self._table.copy()}
        if not self.dense:
            out["count"] = self._count
        return out

    def restore(self, state: dict) -> None:
        from protocols import snapshot as snap

        if snap.field(state, "size", int) != self.size or snap.field(state, "width", int) != self.width:
            raise snap.SnapshotError(f"reveal set of {state['size']} x {state['width']} does not fit "
                                     f"{self.size} x {self.width}")
        if self.dense:
            snap.put(self._table, state, "table")
            return
        table = snap.array(state, "table", np.uint64, (None,))
        count = snap.field(state, "count", int)
        if table.size < 1024 or table.size & (table.size - 1) or int(np.count_nonzero(table)) != count:
            raise snap.SnapshotError("reveal hash table is malformed")
        self._table, self._count = table.copy(), count

    def counts(self) -> np.ndarray:
        """How many distinct inputs each row has revealed (the behavior-pattern width of Definition 2)."""
        if self.dense:
            table = self._table.reshape(self.size, self._words)
            return np.bitwise_count(table).sum(axis=1).astype(np.int64)
        keys = self._table[self._table != 0] - np.uint64(1)
        return np.bincount((keys // np.uint64(self.width)).astype(np.int64), minlength=self.size)


class ChargedParams(Protocol):
    """What :func:`admit_reports` and :func:`report_charges` read of a protocol's parameters."""

    @property
    def epsilon(self) -> float: ...

    @property
    def gamma(self) -> float: ...

    @property
    def round_epsilon(self) -> float: ...


def admit_reports(guard: Guard, params: ChargedParams, rows: np.ndarray, reveals: RevealSet | None,
                  inputs: np.ndarray | None, positions: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
    """The rows (cohort indices) whose report this round fits the budget, and for memoized protocols which
    of them reveal a memoized response for the first time (recorded as revealed): a mask over the rows, or
    with ``positions`` their positions in the rows (increasing; what :func:`report_charges` takes either
    way). Fresh reports cost ``params.round_epsilon``; a memoized report costs eps when new and nothing when
    repeated (Theorem 4)."""
    if reveals is None:
        return rows[guard.affordable(params.round_epsilon, rows)], None
    if inputs is None:
        raise MisuseError("memoized reports need the memoization input of every device")
    if guard.limits.budget is None:
        return rows, reveals.insert(rows, at_rows(inputs, rows), positions)
    new = ~reveals.contains(rows, inputs[rows])
    ok = guard.affordable(np.where(new, params.epsilon, 0.0), rows)
    rows, new = rows[ok], new[ok]
    reveals.insert(rows, inputs[rows])
    return rows, np.flatnonzero(new) if positions else new


def report_charges(guard: Guard, params: ChargedParams, round_: int, now: float, rows: np.ndarray,
                   new: np.ndarray | None) -> list[Charge]:
    """The ledger charges of one round's reports (``rows``: cohort indices that report). Memoized: eps for
    each device revealing a memoized response for the first time (``new``: a mask over ``rows``, or the
    increasing positions in ``rows`` of those devices), plus the per-report guarantee
    under output perturbation (not cumulative). Fresh: the per-report loss ``params.round_epsilon``."""
    if new is None:
        return [guard.charge(round_, now, FRESH_REPORT, params.round_epsilon, rows)]
    charges = [guard.charge(round_, now, MEMO_REVEAL, params.epsilon, rows[new])]
    if params.gamma > 0:
        charges.append(Charge(round_, now, ROUND_GUARANTEE, params.round_epsilon, at_rows(guard.device_ids, rows),
                              cumulative=False))
    return charges
