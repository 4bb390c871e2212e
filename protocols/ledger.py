"""The privacy ledger: per-device charges (round, time, reason, amount), kept where the guarantee is enforced.

docs/design.md section 6. Device-side protocol objects return :class:`Charge` records; the runtime appends them
here. Charges are stored in chunks (one per cohort and reason per round); a chunk whose devices are one
contiguous id range is kept as that range, so charging every device every round (naive repetition) costs
no per-device memory. ``cumulative`` charges add to a device's spend (the protocol's own accounting, e.g.
pattern width x eps for memoization, Theorem 4 of Ding et al. 2017); non-cumulative ones record a per-report
guarantee (e.g. eps' of output perturbation, Theorem 6) without adding to it.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, TypedDict

import numba as nb
import numpy as np

# Reasons a device is charged. Stable strings: they appear in ledger files and digests.
FRESH_REPORT = "fresh_report"  # naive repetition: a report with fresh randomness
MEMO_REVEAL = "memo_reveal"  # the first report of a memoized response not revealed before
ROUND_GUARANTEE = "round_guarantee"  # per-report instantaneous guarantee (output perturbation), not cumulative

QUANTILES = (0.5, 0.9, 0.99)


def exceeds(spend: Any, bound: float) -> Any:
    """Whether ``spend`` (a number or an array) is above ``bound`` by more than float noise (1e-9 relative,
    1e-12 absolute): the one test of "within the guarantee / budget" that summaries, audits and checks share."""
    return np.asarray(spend) > bound * (1 + 1e-9) + 1e-12


class ChargeRows(TypedDict):
    """One chunk of charges as :meth:`Ledger.rows` yields it: one reason and amount charged to ``devices``."""

    round: int
    time: float
    reason: str
    amount: float
    cumulative: bool
    devices: np.ndarray


@dataclass(frozen=True)
class Charge:
    """``amount`` charged to each of ``devices`` (strictly increasing ids) in ``round`` at ``time``."""

    round: int
    time: float
    reason: str
    amount: float
    devices: np.ndarray
    cumulative: bool = True

    def __post_init__(self) -> None:
        if not np.isfinite(self.amount) or self.amount < 0:
            raise ValueError(f"charge amount must be finite and >= 0, got {self.amount}")


def id_runs(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Maximal runs of consecutive ids as (starts, stops), stops exclusive (in sorted ids, a repeated id starts
    a run of its own)."""
    if ids.size == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    if ids.dtype != np.uint32:  # the ledger's listed ids; any other integers are compared as int64
        ids = ids.astype(np.int64, copy=False)
    return _id_runs(np.ascontiguousarray(ids))


@nb.njit(cache=True, nogil=True)
def _id_runs(ids):  # pragma: no cover (compiled)
    """:func:`id_runs` of non-empty ``ids`` in one pass (numpy's diff, nonzero and gathers take five)."""
    starts = np.empty(ids.shape[0], np.int64)
    stops = np.empty(ids.shape[0], np.int64)
    k, prev = 0, np.int64(ids[0])
    starts[0] = prev
    for i in range(1, ids.shape[0]):
        v = np.int64(ids[i])
        if v != prev + 1:
            stops[k] = prev + 1
            k += 1
            starts[k] = v
        prev = v
    stops[k] = prev + 1
    return starts[:k + 1].copy(), stops[:k + 1].copy()


def _merge_touching(starts: np.ndarray, stops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Runs sorted by start with ``[a, b) + [b, c)`` merged into ``[a, c)``."""
    if starts.size > 1 and not increasing(starts):  # runs of chunks charged in id order need no sort
        order = np.argsort(starts, kind="stable")
        starts, stops = starts[order], stops[order]
    if starts.size > 1:
        starts, stops = _merge_sorted(starts.astype(np.int64, copy=False), stops.astype(np.int64, copy=False))
    return starts, stops


@nb.njit(cache=True, nogil=True)
def _merge_sorted(starts, stops):  # pragma: no cover (compiled)
    """:func:`_merge_touching` of runs already in order, in one pass: a run starting where the one before it
    stopped extends the current merged run."""
    out_starts = np.empty(starts.shape[0], np.int64)
    out_stops = np.empty(starts.shape[0], np.int64)
    k = 0
    out_starts[0], out_stops[0] = starts[0], stops[0]
    for i in range(1, starts.shape[0]):
        if starts[i] != stops[i - 1]:
            k += 1
            out_starts[k] = starts[i]
        out_stops[k] = stops[i]
    return out_starts[:k + 1].copy(), out_stops[:k + 1].copy()


#: first bytes hashed by :func:`rows_digest` (the version of its canonical form)
ROWS_DIGEST_TAG = b"ldpsim-ledger-rows/1\n"

#: a group of ledger rows as :func:`rows_digest` takes it: (round, time.hex(), reason, amount.hex()) and the
#: runs (starts, stops) of its devices' sorted ids
RowGroup = tuple[tuple[int, str, str, str], np.ndarray, np.ndarray]


def rows_digest(groups: Iterable[RowGroup]) -> str:
    """sha256 of a ledger's cumulative rows (one per device and charge, as ledger.parquet holds them) in
    canonical form, so that it does not depend on the order or the cohorts they were charged in: the version
    tag, then for each (round, time, reason, amount) in sorted order (floats as ``float.hex``, so exact), its
    repr, the number of runs and the runs' starts and stops (little-endian int64) of its devices' sorted ids.
    :meth:`Ledger.rows_digest` computes it from the charges kept, ``scenarios.tables.ledger_rows_digest_of_table``
    from ledger.parquet alone; each key must come once."""
    h = hashlib.sha256(ROWS_DIGEST_TAG)
    for key, starts, stops in sorted(groups, key=lambda g: g[0]):
        h.update(repr(key).encode())
        h.update(np.int64(starts.size).astype("<i8").tobytes())
        h.update(np.ascontiguousarray(starts, "<i8").data)  # the buffer itself: no copies
        h.update(np.ascontiguousarray(stops, "<i8").data)
    return h.hexdigest()


def quantiles(values: np.ndarray, cumulative: np.ndarray, qs: tuple[float, ...]) -> np.ndarray:
    """``np.quantile(a, qs)`` (its default, linear method) of the multiset ``a`` given as sorted distinct
    ``values`` with ``cumulative`` counts: the same interpolation between the same two order statistics, in
    O(len(qs) log distinct)."""
    n = int(cumulative[-1])
    out = np.empty(len(qs))
    for i, q in enumerate(qs):
        virtual = q * (n - 1)
        below = int(np.floor(virtual))
        above = min(below + 1, n - 1)
        out[i] = np.quantile(order_statistics(values, cumulative, np.array([below, above])), virtual - below)
    return out


@nb.njit(cache=True, nogil=True)
def increasing(ids):  # pragma: no cover (compiled)
    """Whether ``ids`` are strictly increasing: one pass without an early exit, which the compiler turns into
    vector instructions (5-10x a loop that stops at the first fault; a valid charge is read whole anyway)."""
    if ids.shape[0] < 2:
        return True
    later, earlier = ids[1:], ids[:-1]
    bad = False
    for i in range(later.shape[0]):
        bad |= later[i] <= earlier[i]
    return not bad


@nb.njit(cache=True, nogil=True)
def _tally(x, limit):  # pragma: no cover (compiled)
    """The distinct values of ``x`` (float64) with how many times each occurs, in order of first appearance, in
    one pass over an open-addressing table keyed by the values' bits (-0.0 counted as 0.0); (empty, empty, False)
    as soon as more than ``limit`` values are distinct or one is NaN. O(len(x)), where np.unique sorts."""
    cap = 2
    while cap < 2 * (limit + 1):
        cap *= 2
    shift, mask = np.uint64(64 - int(np.log2(cap))), cap - 1
    keys = np.empty(cap, np.uint64)
    counts = np.zeros(cap, np.int64)
    first = np.empty(limit + 1, np.int64)  # the slots in order of first appearance
    bits = x.view(np.uint64)
    distinct, last_bits, last_slot = 0, np.uint64(0), np.int64(-1)
    for i in range(x.shape[0]):
        v = x[i]
        if v != v:
            return np.empty(0), np.empty(0, np.int64), False
        b = bits[i] if v != 0.0 else np.uint64(0)
        if last_slot >= 0 and b == last_bits:  # runs of equal values (a cohort charged alike): no probe
            counts[last_slot] += 1
            continue
        h = np.int64((b * np.uint64(0x9E3779B97F4A7C15)) >> shift)
        while counts[h] != 0 and keys[h] != b:
            h = (h + 1) & mask
        if counts[h] == 0:
            if distinct == limit:
                return np.empty(0), np.empty(0, np.int64), False
            keys[h] = b
            first[distinct] = h
            distinct += 1
        counts[h] += 1
        last_bits, last_slot = b, h
    slots = first[:distinct]
    return keys[slots].view(np.float64), counts[slots], True


def distinct_counts(x: np.ndarray, limit: int) -> tuple[np.ndarray, np.ndarray] | None:
    """``np.unique(x, return_counts=True)`` of a float64 array in one pass (:func:`_tally`), or None when more
    than ``limit`` values are distinct or one is NaN."""
    values, counts, ok = _tally(np.ascontiguousarray(x, dtype=np.float64), int(limit))
    if not ok:
        return None
    order = np.argsort(values, kind="stable")
    return values[order], counts[order]


@nb.njit(cache=True, nogil=True)
def _add_at(target, ids, amount):  # pragma: no cover (compiled)
    """target[ids] += amount for distinct ``ids`` (no temporaries)."""
    for i in range(ids.shape[0]):
        target[ids[i]] += amount


@nb.njit(cache=True, nogil=True)
def _max_at(target, ids, amount):  # pragma: no cover (compiled)
    """target[ids] = max(target[ids], amount) for distinct ``ids``."""
    for i in range(ids.shape[0]):
        if target[ids[i]] < amount:
            target[ids[i]] = amount


class _SpendOrder:
    """The devices' spend as a sorted multiset (its distinct values and how many devices hold each), maintained
    across rounds while a round charges at most 1/8 of the devices (memoized protocols after their first
    rounds): each round's changed values are tallied by hashing (:func:`distinct_counts`), netted and merged,
    so a round's order statistics cost no pass over the devices. Spend is a sum of a protocol's few charge
    amounts, so it takes few distinct values (1BitRRPM: one per pattern width); past :attr:`LIMIT` of them the
    multiset is given up for the run and the quantiles are numpy's selection on the spend. A round that charges
    more drops it; it is rebuilt at that round's close by one pass over the spend (:func:`distinct_counts`, 4-5x
    cheaper than np.quantile's selection)."""

    LIMIT = 1 << 16  # distinct spend values beyond which np.quantile on the spend is cheaper

    def __init__(self, n: int) -> None:
        self.n = n
        self.values: np.ndarray | None = None  # sorted distinct spend values
        self.counts = np.empty(0, np.int64)  # devices holding each
        self.old: list[np.ndarray] = []  # values removed by this round's charges
        self.new: list[np.ndarray] = []  # values they became
        self.count = 0  # devices charged this round (with repeats)
        self.fresh = True  # no charge since the multiset was last brought up to date
        self.too_many = False  # more than LIMIT distinct values were seen: numpy's selection from then on

    def charged(self, spend: np.ndarray, where: np.ndarray | slice, count: int, amount: float) -> None:
        """Called before ``amount`` is added to ``spend[where]`` (``count`` devices)."""
        self.fresh = False
        self.count += count
        if self.values is None or self.count > self.n // 8:
            self.values, self.old, self.new = None, [], []
            return
        before = spend[where]
        if isinstance(where, slice):  # a view: keep the values as they stand now (an index array copies already)
            before = before.copy()
        self.old.append(before)
        self.new.append(before + amount)

    def sorted(self, spend: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """(distinct values, cumulative counts) of the spend, or None when the spend holds (or once held) more than
        :attr:`LIMIT` distinct values (np.quantile instead). A multiset dropped this round is rebuilt here."""
        self.count = 0
        if self.values is not None and not self.fresh:
            # the values the charges removed and those they made, each tallied in one hashing pass (a device
            # charged twice this round left a value that never stood in the multiset: the netting removes it)
            gone = distinct_counts(np.concatenate(self.old), self.LIMIT)
            came = distinct_counts(np.concatenate(self.new), self.LIMIT)
            self.old, self.new = [], []
            if gone is None or came is None:  # too many values passed through this round: rebuilt below
                self.values = None
            else:
                merged = np.union1d(np.union1d(self.values, gone[0]), came[0])
                counts = np.zeros(merged.size, np.int64)
                counts[np.searchsorted(merged, self.values)] = self.counts
                counts[np.searchsorted(merged, came[0])] += came[1]
                counts[np.searchsorted(merged, gone[0])] -= gone[1]
                if np.any(counts < 0):
                    raise ValueError("the spend multiset lost track of a device's value")
                keep = counts > 0
                self.values, self.counts = merged[keep], counts[keep]
                if self.values.size > self.LIMIT:
                    self.values, self.too_many = None, True
        if self.values is None and not self.too_many:  # one pass: cheaper than np.quantile's selection
            tally = distinct_counts(spend, self.LIMIT)
            if tally is None:
                self.too_many = True
            else:
                self.values, self.counts = tally
        self.fresh = True
        return None if self.values is None else (self.values, np.cumsum(self.counts))

    def current(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(distinct values, counts) of the spend if the multiset is up to date (no charge since the last
        :meth:`sorted`), else None; changes nothing."""
        return (self.values, self.counts) if self.values is not None and self.fresh else None


def order_statistics(values: np.ndarray, cumulative: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """The ``ranks``-th smallest (0-based) of the multiset holding ``values`` (sorted, distinct) with
    ``cumulative`` counts."""
    return values[np.searchsorted(cumulative, ranks, side="right")]


@dataclass(frozen=True)
class Entry:
    """A checked charge (:meth:`Ledger.check`): devices ``lo``..``hi - 1``, all of them (``ids`` None) or the
    listed ``ids`` (strictly increasing, stored compactly)."""

    charge: Charge
    lo: int
    hi: int
    ids: np.ndarray | None


class Ledger:
    """Per-device privacy ledger for a population of ``n_devices`` (ids 0..n-1)."""

    def __init__(self, n_devices: int) -> None:
        self.n_devices = int(n_devices)
        self.spend = np.zeros(self.n_devices, dtype=np.float64)  # cumulative spend per device
        self.round_epsilon = np.zeros(self.n_devices, dtype=np.float64)  # largest per-report guarantee seen
        # chunk: (round, time, reason, amount, cumulative, start, stop, ids or None)
        self._chunks: list[tuple[int, float, str, float, bool, int, int, np.ndarray | None]] = []
        self.history: list[dict[str, float]] = []  # spend distribution after each round
        # the spend in sorted order, kept up to date while few devices are charged a round (close_round)
        self._order = _SpendOrder(self.n_devices)
        # per id range [lo, hi): the largest per-report guarantee already raised over all of it, so the same
        # guarantee charged to the same cohort every round (output perturbation) costs no pass over its devices
        self._floors: dict[tuple[int, int], float] = {}
        self._ahead: Any = None  # the spend distribution being computed ahead of close_round (a future)

    def record(self, charge: Charge) -> None:
        """Check ``charge`` and add it to the devices' spend (:meth:`check`, then :meth:`add`)."""
        entry = self.check(charge)
        if entry is not None:
            self.add(entry)

    def check(self, charge: Charge) -> "Entry | None":
        """The checks of :meth:`record`, without touching the ledger: ``charge``'s ids must be a one-dimensional
        array of strictly increasing integers within the population (ValueError otherwise). Returns the entry to
        :meth:`add` (None for a charge of no device). Reads nothing the ledger changes, so a runtime may check a
        cohort's charges on the thread that computed them while the run's thread adds earlier ones."""
        ids = np.asarray(charge.devices)
        if ids.size == 0:
            return None
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise ValueError("charge devices must be a one-dimensional array of integer ids")
        lo, hi = int(ids[0]), int(ids[-1])
        if lo < 0 or hi >= self.n_devices:
            raise ValueError(f"charge names devices outside [0, {self.n_devices})")
        if not increasing(ids):  # one compiled pass; then first and last bound them all
            raise ValueError("charge devices must be strictly increasing")
        if hi - lo + 1 == ids.size:
            return Entry(charge, lo, hi + 1, None)
        return Entry(charge, lo, hi + 1, ids.astype(np.uint32 if hi < 2**32 else np.int64))

    def add(self, entry: "Entry") -> None:
        """Add a checked charge (:meth:`check`) to the spend (or the per-report guarantees) and the charge log."""
        self._settle()
        charge, lo, hi, stored = entry.charge, entry.lo, entry.hi, entry.ids
        target = self.spend if charge.cumulative else None
        if target is not None and charge.amount != 0.0:
            where = slice(lo, hi) if stored is None else stored
            self._order.charged(target, where, hi - lo if stored is None else stored.size, charge.amount)
        self._chunks.append((charge.round, charge.time, charge.reason, charge.amount, charge.cumulative,
                             lo, hi, stored))
        if stored is None:
            if target is not None:
                target[lo:hi] += charge.amount
            elif self._floors.get((lo, hi), -1.0) < charge.amount:  # else every device holds it already
                np.maximum(self.round_epsilon[lo:hi], charge.amount, out=self.round_epsilon[lo:hi])
                self._floors[(lo, hi)] = charge.amount
        elif target is not None:
            _add_at(target, stored, float(charge.amount))
        else:
            _max_at(self.round_epsilon, stored, float(charge.amount))

    def snapshot(self) -> dict:
        """Every charge recorded, the spend, the per-report guarantees and the spend history, as arrays
        (protocols.snapshot): chunk columns, and the non-contiguous chunks' ids concatenated."""
        ch = self._chunks
        reasons = sorted({c[2] for c in ch})
        code = {r: i for i, r in enumerate(reasons)}
        ids = [c[7] for c in ch if c[7] is not None]
        keys = sorted({k for h in self.history for k in h})
        return {"n_devices": self.n_devices, "spend": self.spend.copy(), "round_epsilon": self.round_epsilon.copy(),
                "reasons": reasons,
                "round": np.array([c[0] for c in ch], dtype=np.int64),
                "time": np.array([c[1] for c in ch], dtype=np.float64),
                "reason": np.array([code[c[2]] for c in ch], dtype=np.int64),
                "amount": np.array([c[3] for c in ch], dtype=np.float64),
                "cumulative": np.array([c[4] for c in ch], dtype=np.bool_),
                "lo": np.array([c[5] for c in ch], dtype=np.int64), "hi": np.array([c[6] for c in ch], dtype=np.int64),
                "listed": np.array([c[7] is not None for c in ch], dtype=np.bool_),
                "ids": np.concatenate(ids).astype(np.int64) if ids else np.empty(0, np.int64),
                "id_counts": np.array([i.size for i in ids], dtype=np.int64),
                "history_keys": keys,
                "history": np.array([[h.get(k, np.nan) for k in keys] for h in self.history],
                                    dtype=np.float64).reshape(len(self.history), len(keys))}

    def restore(self, state: dict) -> None:
        """Restore :meth:`snapshot` into an empty ledger of the same population."""
        from protocols import snapshot as snap

        self._settle()
        if snap.field(state, "n_devices", int) != self.n_devices:
            raise snap.SnapshotError(f"a ledger of {state['n_devices']} devices does not fit {self.n_devices}")
        n = snap.array(state, "round", np.int64, (None,)).size
        cols = {k: snap.array(state, k, dt, (n,)).tolist() for k, dt in
                (("round", np.int64), ("time", np.float64), ("reason", np.int64), ("amount", np.float64),
                 ("cumulative", np.bool_), ("lo", np.int64), ("hi", np.int64), ("listed", np.bool_))}
        reasons = snap.field(state, "reasons", list)
        counts = snap.array(state, "id_counts", np.int64, (sum(cols["listed"]),))
        ids = snap.array(state, "ids", np.int64, (int(counts.sum()),))
        if any(not isinstance(r, str) for r in reasons) or any(not 0 <= c < len(reasons) for c in cols["reason"]):
            raise snap.SnapshotError("ledger snapshot names an unknown charge reason")
        if any(not 0 <= lo < hi <= self.n_devices for lo, hi in zip(cols["lo"], cols["hi"])):
            raise snap.SnapshotError("ledger snapshot charges devices outside the population")
        bounds = np.concatenate(([0], np.cumsum(counts))).tolist()
        chunks, k = [], 0
        for i in range(n):
            listed = None
            if cols["listed"][i]:
                listed = ids[bounds[k]:bounds[k + 1]]
                listed = listed.astype(np.uint32 if self.n_devices <= 2**32 else np.int64)
                k += 1
            chunks.append((cols["round"][i], cols["time"][i], reasons[cols["reason"][i]], cols["amount"][i],
                           bool(cols["cumulative"][i]), cols["lo"][i], cols["hi"][i], listed))
        keys = snap.field(state, "history_keys", list)
        history = snap.array(state, "history", np.float64, (None, len(keys)))
        self.spend = snap.array(state, "spend", np.float64, (self.n_devices,)).copy()
        self._order = _SpendOrder(self.n_devices)
        self.round_epsilon = snap.array(state, "round_epsilon", np.float64, (self.n_devices,)).copy()
        self._floors = {}
        self._chunks = chunks
        self.history = [{k: (int(v) if k == "round" else float(v)) for k, v in zip(keys, row) if not np.isnan(v)}
                        for row in history.tolist()]

    def close_round(self, round_: int, time: float) -> dict[str, float]:
        """Snapshot the distribution of cumulative spend over devices (for the event log and the plot)."""
        ahead, self._ahead = self._ahead, None
        # a job not started yet (its thread busy) is cancelled and computed here instead of waited for
        cancelled = ahead is None or bool(getattr(ahead, "cancel", lambda: False)())
        figures = self._distribution() if cancelled else ahead.result()
        snap = {"round": round_, "time": time, **figures}
        self.history.append(snap)
        return snap

    def distribution_ahead(self, submit: Callable[[Callable[[], dict[str, float]]], Any]) -> None:
        """Start computing the spend distribution that :meth:`close_round` reports, as a job given to
        ``submit`` (an executor's, so on another core), when a runtime has recorded the charges of a broadcast
        and expects no more before the round closes: its thread then takes the reports in meanwhile. A charge
        added (or a restore) before the round closes waits for the job and drops it; the round's figures are
        then computed again at close, from the spend as it stands, so they never depend on this call."""
        self._settle()
        self._ahead = submit(self._distribution)

    def _settle(self) -> None:
        """No distribution job running (called before anything changes the spend or its order)."""
        if self._ahead is not None:
            ahead, self._ahead = self._ahead, None
            ahead.result()

    def _distribution(self) -> dict[str, float]:
        """min, mean, max and the QUANTILES of the spend (nothing for a population of none). Reads the spend
        and updates only the spend's sorted order (so a job running it may overlap :meth:`check`)."""
        s = self.spend
        if not s.size:
            return {}
        lo, hi, qs = self._figures(QUANTILES, self._order.sorted(s))
        return {"min": float(lo), "mean": float(s.mean()), "max": float(hi),
                **{f"p{round(q * 100)}": float(v) for q, v in zip(QUANTILES, qs)}}

    def _figures(self, qs: tuple[float, ...], multiset: tuple[np.ndarray, np.ndarray] | None
                 ) -> tuple[float, float, np.ndarray]:
        """min, max and the ``qs`` quantiles of the spend: from the sorted multiset (distinct values, cumulative
        counts) when there is one, without a pass over the devices; else numpy's selection on the spend. (The
        mean is numpy's on the spend either way, so that it never depends on which one it came from.)"""
        s = self.spend
        if multiset is not None:
            return multiset[0][0], multiset[0][-1], quantiles(*multiset, qs)
        return s.min(), s.max(), np.quantile(s, qs)

    def spend_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """The distinct values of the spend, sorted, and how many devices hold each: the sorted multiset that
        :meth:`close_round` keeps, when it is up to date (no charge since the last close), else np.unique."""
        self._settle()
        kept = self._order.current()
        if kept is not None:
            return kept[0].copy(), kept[1].copy()
        return np.unique(self.spend, return_counts=True)

    def summary(self) -> dict[str, float]:
        """Per-device cumulative spend at the end: max, mean, p50, p99."""
        s = self.spend
        if not s.size:
            return {"max": 0.0, "mean": 0.0, "p50": 0.0, "p99": 0.0}
        self._settle()
        kept = self._order.current()
        _, top, (p50, p99) = self._figures((0.5, 0.99), None if kept is None else (kept[0], np.cumsum(kept[1])))
        return {"max": float(top), "mean": float(s.mean()), "p50": float(p50), "p99": float(p99)}

    def rows(self, cumulative_only: bool = True) -> Iterator[ChargeRows]:
        """The charges chunk by chunk, device ids expanded: dicts of round, time, reason, amount, devices."""
        for rnd, time, reason, amount, cumulative, lo, hi, ids in self._chunks:
            if cumulative_only and not cumulative:
                continue
            devices = np.arange(lo, hi, dtype=np.int64) if ids is None else ids.astype(np.int64)
            yield {"round": rnd, "time": time, "reason": reason, "amount": amount,
                   "cumulative": cumulative, "devices": devices}

    def device_charges(self, device: int) -> list[tuple[int, float, str, float, bool]]:
        """Every charge of one device, in the order recorded: (round, time, reason, amount, cumulative)."""
        out = []
        for rnd, time, reason, amount, cumulative, lo, hi, ids in self._chunks:
            if lo <= device < hi and (ids is None or ids[np.searchsorted(ids, device)] == device):
                out.append((rnd, time, reason, amount, cumulative))
        return out

    def digest(self) -> str:
        """sha256 of the canonical form: charges grouped by (round, time, reason, amount, cumulative), each
        group's device set as its sorted maximal runs of consecutive ids. Independent of cohort split."""
        return self._digests(full=True, rows=False)[0]

    def rows_digest(self) -> str:
        """:func:`rows_digest` of the cumulative charges: what ledger.parquet's rows digest to."""
        return self._digests(full=False, rows=True)[1]

    def digests(self) -> tuple[str, str]:
        """(:meth:`digest`, :meth:`rows_digest`), from one pass over the charges' device runs."""
        return self._digests(full=True, rows=True)

    def _digests(self, full: bool, rows: bool) -> tuple[str, str]:
        """The digests asked for ("" for the other). The charges are grouped by (round, time, reason, amount,
        cumulative) and each group's device runs merged once, for both digests. A group whose charges name
        disjoint id ranges costs no pass over its devices beyond their runs, and its merged runs are also its
        rows; overlapping ones (a device charged twice the same in one round) are expanded and sorted for
        the rows digest."""
        groups: dict[tuple, list[tuple[int, int, np.ndarray | None]]] = defaultdict(list)
        for rnd, time, reason, amount, cumulative, lo, hi, ids in self._chunks:
            if full or (rows and cumulative):
                groups[(rnd, float(time).hex(), reason, float(amount).hex(), cumulative)].append((lo, hi, ids))
        merged: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        disjoint: dict[tuple, bool] = {}
        for key, parts in groups.items():
            by_lo = sorted(parts, key=lambda p: p[0])
            disjoint[key] = all(a[1] <= b[0] for a, b in zip(by_lo, by_lo[1:]))
            # disjoint parts in id order give the same merged runs as in charge order, without a sort
            runs = [(np.array([lo], np.int64), np.array([hi], np.int64)) if ids is None else id_runs(ids)
                    for lo, hi, ids in (by_lo if disjoint[key] else parts)]
            merged[key] = _merge_touching(np.concatenate([r[0] for r in runs]), np.concatenate([r[1] for r in runs]))
        full_digest = rows_digest_ = ""
        if full:
            h = hashlib.sha256()
            for key in sorted(groups):
                starts, stops = merged[key]
                h.update(repr(key).encode())
                h.update(np.ascontiguousarray(starts, "<i8").data)
                h.update(np.ascontiguousarray(stops, "<i8").data)
            full_digest = h.hexdigest()
        if rows:
            keyed = []
            for key, parts in groups.items():
                if not key[4]:
                    continue
                if disjoint[key]:
                    starts, stops = merged[key]
                else:
                    starts, stops = id_runs(np.sort(np.concatenate(
                        [np.arange(lo, hi, dtype=np.int64) if ids is None else ids.astype(np.int64)
                         for lo, hi, ids in parts])))
                keyed.append(((int(key[0]), key[1], str(key[2]), key[3]), starts, stops))
            rows_digest_ = rows_digest(keyed)
        return full_digest, rows_digest_
