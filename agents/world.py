"""The devices' true counters: population groups, per-device levels, per-round jitter, scripted changes.

A device draws its own level from its group's counter distribution at setup and again when a change hits
its group; each round its value is level + jitter, clipped to [0, max_value] (docs/algorithms.md,
"Notation and conventions": values are clipped before any mechanism sees them, and the clipping is
counted). Every draw is keyed (docs/design.md section 3), so a device's values are a pure function of
(seed, device, round).

A group may also carry behaviors (agents/behavior.py, docs/behaviors.md): keyed functions of the day that
shape its devices' level + jitter each round (weekly seasonality, trends, bursts, changes at a simulated time
or on a condition, or a user's own function) before the values are clipped and the clipping counted. A world
with behaviors computes every day's values, in order, whichever days it is asked about, so that behaviors with
state see the same history in every process that holds the world.
"""

from __future__ import annotations

import functools
import math
import os
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import numba as nb
import numpy as np

from agents.behavior import Behavior, Bound
from protocols import keyed
from protocols.keyed import Purpose, stream_key

if "NUMBA_THREADING_LAYER" not in os.environ:
    # numba's own pool: OpenMP's spinning threads slowed the serial work between parallel kernels by a third
    # (THRESH benchmark: 42 s against 29 s)
    nb.config.THREADING_LAYER = "workqueue"


@nb.njit(cache=True, nogil=True)
def _truncated_normal_kernel(key, ids, mean, sd, lo, hi, out):
    """Exact inverse-CDF sampling of N(mean, sd) restricted to [lo, hi]."""
    a = 0.5 * math.erfc(-(lo - mean) / (sd * math.sqrt(2.0)))
    b = 0.5 * math.erfc(-(hi - mean) / (sd * math.sqrt(2.0)))
    for i in range(ids.shape[0]):
        u = a + (b - a) * ((np.float64(keyed.uniform1(key, np.uint64(ids[i]))) * (1.0 - 2e-16)) + 1e-16)
        v = mean + sd * keyed.inverse_normal_cdf(min(max(u, 1e-300), 1.0 - 1e-16))
        out[i] = min(max(v, lo), hi)


@dataclass(frozen=True)
class Dist:
    """A counter distribution: ``constant`` (value), ``uniform`` (low, high), ``normal`` (mean, sd;
    ``truncate`` restricts it to [0, max_value] exactly instead of clipping values to the range), or
    ``bernoulli`` (value = p: the level is p and each round's value a fresh keyed Bernoulli(p) bit), or
    ``data`` (each round's value a fresh keyed draw from an empirical data set, e.g. POS transaction
    lengths; values above max_value are clipped and counted)."""

    kind: str
    value: float = 0.0
    low: float = 0.0
    high: float = 0.0
    mean: float = 0.0
    sd: float = 0.0
    truncate: bool = False
    data: np.ndarray | None = field(default=None, compare=False, repr=False)  # kind "data": the values
    path: str = ""

    def sample(self, key: int, ids: np.ndarray, max_value: float = math.inf) -> np.ndarray:
        if self.kind in ("constant", "bernoulli", "data"):
            return np.full(ids.shape[0], self.value, dtype=np.float64)
        if self.kind == "uniform":
            return self.low + (self.high - self.low) * keyed.uniform(key, ids)
        if self.kind == "normal" and self.truncate and self.sd > 0:
            out = np.empty(ids.shape[0], dtype=np.float64)
            _truncated_normal_kernel(np.uint64(key), np.ascontiguousarray(ids, dtype=np.int64), self.mean,
                                     self.sd, 0.0, max_value, out)
            return out
        if self.kind == "normal":  # mean + sd z, in place (the same operations, without two temporaries)
            z = keyed.normal(key, ids)
            z *= self.sd
            z += self.mean
            return z
        raise ValueError(f"unknown distribution {self.kind!r}")


@dataclass(frozen=True)
class Group:
    """A population group. With ``apps`` (weights of c apps), a device's counter is its total over c
    counters (time in c apps): it splits as w_j (0.5 + u_j), normalized, with keyed per-device u_j."""

    name: str
    share: float
    counter: Dist
    jitter_sd: float = 0.0
    apps: tuple[float, ...] | None = None
    joins: int = 1  # first round the group's devices are present
    leaves: int | None = None  # first round they are gone (None: never)
    behavior: Behavior | None = None  # scripted behaviors shaping its values each round (agents/behavior.py)


@dataclass(frozen=True)
class Change:
    """From ``round`` on, the devices of ``group`` (a ``fraction`` of them, keyed) redraw their level from
    ``counter`` and/or take the new jitter sd."""

    round: int
    group: str
    counter: Dist | None = None
    jitter_sd: float | None = None
    fraction: float = 1.0


def split_shares(n: int, shares: list[float]) -> np.ndarray:
    """Group boundaries: contiguous id blocks with sizes by largest remainder, so sizes sum to n exactly."""
    weights = np.asarray(shares, dtype=np.float64)
    raw = weights / weights.sum() * n  # normalized: shares that sum to 1 within tolerance still cover all n
    sizes = np.floor(raw).astype(np.int64)
    short = n - int(sizes.sum())
    if short > 0:
        sizes[np.argsort(-(raw - sizes), kind="stable")[:short]] += 1
    return np.concatenate(([0], np.cumsum(sizes)))


@nb.njit(inline="always")
def _values_range(levels, sds, binary, source, pool, offsets, key, m, free, base, out, start, stop):
    """out[i] for i in start..stop-1 (see :func:`_values_kernel`); returns how many of them were clipped."""
    k = 0
    for i in range(start, stop):
        if binary[i]:
            out[i] = 1.0 if keyed.uniform1(key, np.uint64(base + i)) < levels[i] else 0.0
            continue
        if source[i] >= 0:  # a fresh draw from an empirical data set each round
            lo, hi = offsets[source[i]], offsets[source[i] + 1]
            v = pool[lo + min(int(keyed.uniform1(key, np.uint64(base + i)) * (hi - lo)), hi - lo - 1)]
            if v > m and not free[i]:
                v = m
                k += 1
            out[i] = v
            continue
        v = levels[i]
        if sds[i] > 0.0:
            v += sds[i] * keyed.normal1(key, np.uint64(base + i))
        if free[i]:
            out[i] = v
            continue
        if v < 0.0:
            v = 0.0
            k += 1
        elif v > m:
            v = m
            k += 1
        out[i] = v
    return k


_BLOCK = 1024  # devices per block of :func:`_plain_range`


@nb.njit(cache=True, nogil=True, error_model="numpy")
def _plain_range(levels, sds, key, m, base, out, start, stop):
    """:func:`_values_range` where no device is binary, reads a data set or is free (the common case), in blocks
    of three passes the compiler turns into vector instructions (2x the element-wise loop): every device's
    normal by the central branch of the inverse CDF, the tails (about 5%) redone by the whole function, then
    level + sd N clipped. The same operations on the same numbers, so the same bits; the numpy error model
    only lets the division vectorize (the denominator is never 0)."""
    k = np.int64(0)
    p = np.empty(_BLOCK)
    z = np.empty(_BLOCK)
    for b0 in range(start, stop, _BLOCK):
        size = min(_BLOCK, stop - b0)
        for j in range(size):
            p[j] = keyed.normal_uniform(key, np.uint64(base + b0 + j))
            z[j] = keyed.central_normal(p[j])
        for j in range(size):
            if keyed.normal_tail(p[j]):
                z[j] = keyed.inverse_normal_cdf(p[j])
        for j in range(size):
            i = b0 + j
            v = levels[i] + sds[i] * z[j] if sds[i] > 0.0 else levels[i]
            low, high = v < 0.0, v > m
            k += np.int64(low) + np.int64(high)
            v = 0.0 if low else v
            out[i] = m if high else v
    return k


@nb.njit(inline="always")
def _range(plain, levels, sds, binary, source, pool, offsets, key, m, free, base, out, start, stop):
    if plain:
        return _plain_range(levels, sds, key, m, base, out, start, stop)
    return _values_range(levels, sds, binary, source, pool, offsets, key, m, free, base, out, start, stop)


@nb.njit(cache=True, parallel=True)
def _values_kernel(plain, levels, sds, binary, source, pool, offsets, key, m, free, base, out):
    """out[i] = clip(levels[i] + sds[i] N_i, 0, m) with N_i keyed by (key, base + i) (the arrays: devices
    base, base + 1, ...); returns how many were clipped. ``plain``: no device is binary, reads a data set or is
    free (:func:`_plain_range`).
    Devices with ``free[i]`` get the unclipped base value (their group's behaviors shape it, then it is
    clipped and counted). Element-wise in fixed chunks on all cores: the same bits as a serial loop."""
    chunks = 64
    n = levels.shape[0]
    counts = np.zeros(chunks, np.int64)
    for c in nb.prange(chunks):
        counts[c] = _range(plain, levels, sds, binary, source, pool, offsets, key, m, free, base, out,
                           n * c // chunks, n * (c + 1) // chunks)
    return counts.sum()


@nb.njit(cache=True, nogil=True)
def _values_kernel_serial(plain, levels, sds, binary, source, pool, offsets, key, m, free, base, out, start, stop):
    """:func:`_values_kernel` for positions start..stop-1 on the calling thread alone, releasing the GIL: a
    world's values computed in the background (World.prefetch), a part on each spare thread, where the parallel
    kernel would contend with the run's thread for the cores."""
    return _range(plain, levels, sds, binary, source, pool, offsets, key, m, free, base, out, start, stop)


_CHUNK = 1 << 16  # devices whose levels are drawn at once: their ids and draws (1.5 MB) stay in the cache and
# are reused from chunk to chunk, where a day's worth of temporaries would be fresh memory to fault in


class World:
    """Counters of ``n`` devices over rounds 1, 2, ...; call :meth:`advance_to` at each round start. Each group's
    behaviors (``Group.behavior``) run in a copy of their own per world."""

    def __init__(self, seed: int, n: int, groups: list[Group], changes: list[Change], max_value: float,
                 span: tuple[int, int] | None = None, last_day: int | None = None) -> None:
        """``span = (lo, hi)``: hold and compute devices lo..hi-1 only (a shard's world, agents/shard.py): every
        per-device array is hi - lo long, so N shards of a population hold it once between them, and the clipped
        count is the span's. A world with behaviors holds everyone (they may read the population's mean).
        ``last_day``: the last day a run means to ask for (its rounds); :meth:`prefetch` computes no day after
        it, which is still computed when asked for (a hostile collector's extra rounds)."""
        self.seed, self.n, self.max_value = int(seed), int(n), float(max_value)
        # the live clients hosted on this world share its days (agents/client.DeviceDays; set by the first)
        self.device_days: Any = None
        self.last_day = last_day
        self.groups = list(groups)
        self.changes = sorted(changes, key=lambda c: c.round)
        self.bounds = split_shares(self.n, [g.share for g in self.groups])
        self._index = {g.name: i for i, g in enumerate(self.groups)}
        lo, hi = (0, self.n) if span is None or any(g.behavior is not None for g in self.groups) else span
        if not 0 <= lo <= hi <= self.n:
            raise ValueError(f"span [{lo}, {hi}) is outside the population of {self.n}")
        self.span = (int(lo), int(hi))  # the devices this world holds and computes
        size = self.span[1] - self.span[0]
        # levels, jitter sds, Bernoulli and data-set flags: built on first use (_hold), so a world that takes
        # its values from elsewhere (use_values) and is never asked for levels holds none
        self._levels: np.ndarray | None = None
        self._sds = np.empty(0)
        self.binary, self.free, self.source = np.empty(0, np.bool_), np.empty(0, np.bool_), np.empty(0, np.int16)
        self._pools: list[np.ndarray] = []
        self._group_sources: list[int] = []  # each group's data set (an index into _pools, -1: none): _hold_start
        self.counters = len(self.groups[0].apps) if self.groups and self.groups[0].apps else None
        if self.counters is not None:
            if any(g.apps is None or len(g.apps) != self.counters for g in self.groups):
                raise ValueError("every group needs apps weights of the same length")
            self.split = np.empty((size, self.counters), dtype=np.float64)
            for g in self.groups:
                ids = self._held_ids(g.name)
                u = np.stack([keyed.uniform(stream_key(seed, Purpose.SPLIT, j), ids) for j in range(self.counters)],
                             axis=1)
                w = np.asarray(g.apps) * (0.5 + u)
                self.split[ids - lo] = w / w.sum(axis=1, keepdims=True)
        self.churn = any(g.joins > 1 or g.leaves is not None for g in self.groups)
        if self.churn:
            self.joins = np.empty(size, dtype=np.int64)
            self.leaves = np.empty(size, dtype=np.int64)
            for g in self.groups:
                at = self._held_ids(g.name) - lo
                self.joins[at] = g.joins
                self.leaves[at] = g.leaves if g.leaves is not None else np.iinfo(np.int64).max
        self.day = 0
        self._applied = 0
        self._cache_day = -1
        self._cache = np.empty(0)
        self._clipped = 0
        # scripted behaviors (agents/behavior.py): per group, its id range and a running copy for this world
        self._scripts: list[tuple[int, int, Bound]] = []
        for gi, g in enumerate(self.groups):
            if g.behavior is None:
                continue
            if g.counter.kind == "bernoulli" or any(c.group == g.name and c.counter is not None
                                                   and c.counter.kind == "bernoulli" for c in self.changes):
                raise ValueError(f"group {g.name!r}: behaviors shape counter values, not private bits (bernoulli)")
            glo, ghi = int(self.bounds[gi]), int(self.bounds[gi + 1])
            self._scripts.append((glo, ghi, g.behavior.bind(self.seed, gi, self.max_value)))
        self._mean = math.nan  # the previous round's mean value over the population (behaviors' Day.mean)
        #: (round, group, behavior, devices) each time a behavior's change first reached devices (its changed hook)
        self.behavior_fired: list[tuple[int, str, str, int]] = []
        #: per device, the first round a behavior's change reached it (0: none did); None until one fired
        self.behavior_changed: np.ndarray | None = None
        self._source: Any = None  # values computed elsewhere (use_values)
        self._ahead: World | None = None  # a twin computing a later day in the background (prefetch)
        self._pending: tuple[int, Any] | None = None  # (day, future) of the twin's computation

    def twin(self) -> "World":
        """A world of the same scenario and span, sharing this one's fixed per-device arrays (the split over apps,
        the churn days), that computes its own days: at day 0, or, where this world holds its levels, at this
        world's day with a copy of them (cheaper than drawing them again). A shard or a run computes the next day
        in it ahead of time (agents/shard.py, :meth:`prefetch`)."""
        other = World.__new__(World)
        other.__dict__.update(self.__dict__)
        other._levels, other._sds = None, np.empty(0)
        other.binary, other.free, other.source = np.empty(0, np.bool_), np.empty(0, np.bool_), np.empty(0, np.int16)
        other._pools, other._group_sources = [], []
        other.day, other._applied, other._cache_day, other._cache, other._clipped = 0, 0, -1, np.empty(0), 0
        other._ahead, other._pending = None, None
        if self._scripts:
            raise ValueError("a world with behaviors has no twin: its behaviors keep state from day to day")
        if self._levels is not None:  # a copy of the levels as of the changes applied so far, not a redraw
            other._levels, other._sds = self._levels.copy(), self._sds.copy()
            other.binary, other.free, other.source = self.binary.copy(), self.free.copy(), self.source.copy()
            other._pools = list(self._pools)
            other.day, other._applied = self.day, self._applied
        return other

    def prefetch(self, day: int, submit: Callable[[Callable[[], Any]], Future], parts: int = 1) -> bool:
        """Start computing ``day``'s values in a twin of this world through ``submit`` (an executor's), while this
        world keeps serving its own day: a later :meth:`values` for ``day`` takes the twin's values (the same
        numbers: they are a pure function of the seed, the changes and the day). ``parts``: jobs that share the
        devices (one per thread of the executor: none of them waits alone for a long one), submitted after the
        job that moves the twin to ``day``; a twin's first levels are drawn, and its devices' sds and flags
        filled, in as many parts before it. Returns
        whether it started; worlds with behaviors (state from day to day) or with values from elsewhere are left
        alone. Only the background jobs touch the twin, and this world waits for them before anything else reads
        the twin."""
        if self._scripts or self._source is not None or day <= self.day or (self.last_day is not None
                                                                            and day > self.last_day):
            return False
        self.settle()
        if self._ahead is None:
            self._ahead = self.twin()
        ahead = self._ahead
        if ahead.day > day:
            return False

        size = ahead.span[1] - ahead.span[0]
        parts = max(1, min(int(parts), size))
        # a twin without levels yet (the first day) draws them first, in parts too: jobs submitted in the
        # order they wait for one another, so that no job waits on one still queued
        held = submit(ahead._hold_start) if ahead._levels is None and parts > 1 else None

        def draw(k: int) -> None:
            assert held is not None
            lo = ahead.span[0]
            ahead._draw_levels(held.result(), lo + size * k // parts, lo + size * (k + 1) // parts)

        drawn = [] if held is None else [submit(functools.partial(draw, k)) for k in range(parts)]

        def start() -> tuple | None:  # the twin at ``day``, and its kernel's arguments if it has to compute
            if held is not None:
                for job in drawn:
                    job.result()
                ahead._hold_finish(held.result())
            ahead.advance_to(day)
            return None if ahead._cache_day == day else ahead._kernel_args(day)

        first = submit(start)

        def part(k: int) -> int:
            args = first.result()  # submitted before, so already taken by a thread: no job waits on a queued one
            return 0 if args is None else int(_values_kernel_serial(*args, size * k // parts,
                                                                     size * (k + 1) // parts))

        self._pending = (day, [first] + [submit(functools.partial(part, k)) for k in range(parts)])
        return True

    def settle(self) -> None:
        """Wait for the twin's computation in flight, if any, and take its values if they are this world's day."""
        if self._pending is None:
            return
        day, futures = self._pending
        self._pending = None
        computed, clipped = futures[0].result() is not None, sum(f.result() for f in futures[1:])
        ahead = self._ahead
        assert ahead is not None
        if computed:
            ahead._clipped, ahead._cache_day = clipped, day
        if day == self.day and self._cache_day != day and ahead._cache_day == day:
            self._cache, self._clipped, self._cache_day = ahead._cache, ahead._clipped, day

    @property
    def levels(self) -> np.ndarray:
        """Each held device's current level (the span's devices, in id order)."""
        return self._hold()

    @property
    def sds(self) -> np.ndarray:
        """Each held device's current per-round jitter sd."""
        self._hold()
        return self._sds

    def _hold(self) -> np.ndarray:
        """Build the per-device levels, sds and flags as of the changes applied so far (once)."""
        if self._levels is None:
            levels = self._hold_start()
            self._draw_levels(levels, *self.span)
            self._hold_finish(levels)
        assert self._levels is not None
        return self._levels

    def _hold_start(self) -> np.ndarray:
        """The per-device arrays (levels, sds, flags), allocated but not yet filled, and the groups' data sets
        registered (:meth:`_hold` in steps: :meth:`World.prefetch` fills and draws them in parts, one on each
        thread, by :meth:`_draw_levels`)."""
        lo, hi = self.span
        levels = np.empty(hi - lo, dtype=np.float64)
        self._sds = np.empty(hi - lo, dtype=np.float64)
        self.binary = np.empty(hi - lo, dtype=np.bool_)  # Bernoulli counters: the level is the probability
        self.source = np.empty(hi - lo, dtype=np.int16)  # empirical data set of each device (-1: none)
        self.free = np.empty(hi - lo, dtype=np.bool_)  # devices whose base value a behavior shapes
        self._group_sources = [self._pool_index(g.counter) for g in self.groups]
        return levels

    def _draw_levels(self, levels: np.ndarray, first: int, stop: int) -> None:
        """The per-device arrays of devices first..stop-1 (held ones) filled as the groups set them, and their
        initial levels drawn into ``levels``: keyed draws, the same whichever part of the span a call draws."""
        lo = self.span[0]
        for g, k in zip(self.groups, self._group_sources):
            a, b = self._held_range(g.name)
            a, b = max(a, first), min(b, stop)
            if a >= b:
                continue
            at = slice(a - lo, b - lo)
            self._sds[at] = g.jitter_sd
            self.binary[at] = g.counter.kind == "bernoulli"
            self.source[at] = k
            self.free[at] = g.behavior is not None  # base values its behaviors shape
            for start in range(a, b, _CHUNK):  # keyed draws: the same in chunks, with bounded temporaries
                end = min(start + _CHUNK, b)
                levels[start - lo:end - lo] = g.counter.sample(stream_key(self.seed, Purpose.LEVEL, 0),
                                                              np.arange(start, end, dtype=np.int64), self.max_value)

    def _hold_finish(self, levels: np.ndarray) -> None:
        """The levels drawn: held from now on, with the changes applied so far redrawn over them."""
        self._levels = levels
        for number in range(1, self._applied + 1):
            self._redraw(number)
        self._plain = self._is_plain()

    def _is_plain(self) -> bool:
        """Whether no held device is binary, reads a data set or is shaped by a behavior (the values kernel's
        vectorized path, :func:`_plain_range`)."""
        return not (self.binary.any() or self.free.any() or int(self.source.max(initial=-1)) >= 0)

    def _redraw(self, number: int) -> None:
        """The ``number``-th change (1-based, in round order) applied to the held devices it hits."""
        ch = self.changes[number - 1]
        ids = self.affected(number, held=True)
        lo = self.span[0]
        # increasing ids: a run of consecutive ones (a whole group) is a slice, not an index array
        at = slice(int(ids[0]) - lo, int(ids[-1]) - lo + 1) if ids.size and ids[-1] - ids[0] + 1 == ids.size \
            else ids - lo
        if ch.counter is not None:
            self.binary[at] = ch.counter.kind == "bernoulli"
            self._set_source(at, ch.counter)
            levels = self._levels
            assert levels is not None
            levels[at] = ch.counter.sample(stream_key(self.seed, Purpose.LEVEL, number), ids, self.max_value)
        if ch.jitter_sd is not None:
            self._sds[at] = ch.jitter_sd
        self._plain = self._is_plain()

    def _held_range(self, name: str) -> tuple[int, int]:
        """The ids a..b-1 of group ``name`` that this world holds (its span)."""
        gi = self._index[name]
        a, b = max(int(self.bounds[gi]), self.span[0]), min(int(self.bounds[gi + 1]), self.span[1])
        return a, max(a, b)

    def _held_ids(self, name: str) -> np.ndarray:
        return np.arange(*self._held_range(name), dtype=np.int64)

    def use_values(self, source: Any) -> None:
        """Take every day's values from ``source(day) -> (values of all devices, clipped count)`` instead of
        computing them (a sharded run's process, whose workers compute them anyway: scenarios/parallel.py).
        Not for a world with behaviors, whose own copies must see every day, nor for a span-sized world."""
        if not self._scripts and self.span == (0, self.n):
            self._source = source
            self._cache_day = -1

    def _set_source(self, at: np.ndarray | slice, dist: Dist) -> None:
        """Point the devices at positions ``at`` of this world's arrays to ``dist``'s data set, if it has one."""
        self.source[at] = self._pool_index(dist)

    def _pool_index(self, dist: Dist) -> int:
        """The index of ``dist``'s data set among this world's (registered on first sight), or -1 for none."""
        if dist.kind != "data":
            return -1
        for k, pool in enumerate(self._pools):
            if pool is dist.data:
                return k
        if len(self._pools) == np.iinfo(self.source.dtype).max:
            raise ValueError(f"more than {len(self._pools)} data sets in one scenario")
        assert dist.data is not None  # a "data" distribution always carries its values
        self._pools.append(dist.data)
        self._pool = np.concatenate(self._pools).astype(np.float64)
        self._offsets = np.concatenate(([0], np.cumsum([p.size for p in self._pools]))).astype(np.int64)
        return len(self._pools) - 1

    def group_ids(self, name: str) -> np.ndarray:
        gi = self._index[name]
        return np.arange(self.bounds[gi], self.bounds[gi + 1], dtype=np.int64)

    def group_of(self, ids: np.ndarray) -> np.ndarray:
        """Index of each device's group."""
        return np.searchsorted(self.bounds, np.asarray(ids), side="right") - 1

    def advance_to(self, day: int) -> list[Change]:
        """Apply every change whose round has come; returns those applied now."""
        if day < self.day:
            raise ValueError("the world does not go back in time")
        if self._scripts:
            # behaviors may keep state and read the previous round's mean: every day is computed, in order,
            # whichever days the caller asks for (the same in every process that holds this world)
            applied = []
            while self.day < day:
                if self.day >= 1 and self._cache_day != self.day:
                    self.values(np.empty(0, dtype=np.int64))
                applied += self._apply_changes(self.day + 1)
            return applied
        return self._apply_changes(day)

    def _apply_changes(self, day: int) -> list[Change]:
        self.day = day
        applied = []
        while self._applied < len(self.changes) and self.changes[self._applied].round <= day:
            ch = self.changes[self._applied]
            self._applied += 1
            if self._levels is not None:
                self._redraw(self._applied)
            applied.append(ch)
        if applied:
            self._cache_day = -1
        return applied

    def affected(self, number: int, held: bool = False) -> np.ndarray:
        """Ids of the devices that the ``number``-th scripted change (1-based, in round order) hits: its group's
        devices, or the keyed ``fraction`` of them (``held``: only those this world holds). A pure function of the
        seed, so it can be asked after a run."""
        ch = self.changes[number - 1]
        ids = self._held_ids(ch.group) if held else self.group_ids(ch.group)
        if ch.fraction < 1.0:
            ids = ids[keyed.uniform(stream_key(self.seed, Purpose.AFFECTED, number), ids) < ch.fraction]
        return ids

    def present(self, ids: np.ndarray) -> np.ndarray | None:
        """Which of ``ids`` are present on the current day (None: everyone, no churn in this world)."""
        if not self.churn:
            return None
        at = np.asarray(ids) - self.span[0]
        self._check_held(at)
        return (self.joins[at] <= self.day) & (self.day < self.leaves[at])

    def _kernel_args(self, day: int) -> tuple:
        """The values kernel's arguments for ``day``, its output a new cache (not yet labelled as ``day``'s)."""
        lo, hi = self.span
        self._hold()
        self._cache = np.empty(hi - lo, dtype=np.float64)
        key = np.uint64(stream_key(self.seed, Purpose.JITTER, day))
        pool = getattr(self, "_pool", np.zeros(1))
        offsets = getattr(self, "_offsets", np.zeros(2, np.int64))
        return (self._plain, self._levels, self._sds, self.binary, self.source, pool, offsets, key, self.max_value,
                self.free, lo, self._cache)

    def values(self, ids: np.ndarray, day: int | None = None) -> tuple[np.ndarray, int]:
        """Clipped values of devices ``ids`` on ``day`` (default: the current day), and how many of the
        world's values (its span's) were clipped that day. With apps: one row of c counters per device.

        The day's values are computed once for the world's span and shared by every cohort (and by the
        truth), a contiguous id range being served as a view, on all cores (or ahead of time: :meth:`prefetch`).
        """
        day = self.day if day is None else day
        if day != self.day:
            raise ValueError(f"the world is at round {self.day}, not {day}")
        if self._pending is not None and self._cache_day != day:
            self.settle()
        if self._cache_day != day and self._source is not None:
            self._cache, self._clipped = self._source(day)
            self._cache_day = day
        if self._cache_day != day:
            self._clipped = int(_values_kernel(*self._kernel_args(day)))
            if self._scripts:
                self._behave(day)
            self._cache_day = day
        ids = np.asarray(ids)
        if not ids.size:
            ids = ids.astype(np.int64)
        where: slice | np.ndarray
        if ids.size and ids.ndim == 1 and int(ids[-1]) - int(ids[0]) + 1 == ids.size:  # a cohort: a view
            first = int(ids[0]) - self.span[0]
            where = slice(first, first + ids.size)
            self._check_held(np.array([first, first + ids.size - 1]))
        else:
            where = ids - self.span[0]
            self._check_held(where)
        if self.counters is not None:  # (devices, c): the day's total split over the apps
            return self._cache[where][:, None] * self.split[where], self._clipped
        return self._cache[where], self._clipped

    def totals(self, lo: int, hi: int) -> tuple[np.ndarray, int]:
        """The current day's values of devices lo..hi-1 before any split over apps (one total per device, what
        :meth:`values` splits), and the clipped count: what a shard hands the run's world (agents/shard.py)."""
        _, clipped = self.values(np.empty(0, dtype=np.int64))
        self._check_held(np.array([lo, hi - 1]) - self.span[0] if hi > lo else np.empty(0, np.int64))
        return self._cache[lo - self.span[0]:hi - self.span[0]], clipped

    def _check_held(self, at: np.ndarray) -> None:
        """Refuse positions outside this world's span (ids of devices another shard holds)."""
        if at.size and (int(at.min()) < 0 or int(at.max()) >= self.span[1] - self.span[0]):
            raise IndexError(f"device ids outside this world's span [{self.span[0]}, {self.span[1]})")

    def _fired(self, day: int, lo: int, hi: int, group: str, name: str, mask: np.ndarray) -> None:
        """Record that behavior ``name`` of ``group`` (devices lo..hi-1) changed the devices of ``mask`` on ``day``
        (a world with behaviors holds every device, so ids are positions)."""
        if self.behavior_changed is None:
            self.behavior_changed = np.zeros(self.n, dtype=np.int32)
        first = self.behavior_changed[lo:hi]
        first[mask & (first == 0)] = day
        self.behavior_fired.append((day, group, name, int(np.count_nonzero(mask))))

    def _behave(self, day: int) -> None:
        """The groups' behaviors on ``day``: their base values (unclipped in the cache) shaped, then clipped
        to [0, max_value] and counted; then each behavior observes its group's final values."""
        m, cache = self.max_value, self._cache
        for lo, hi, bound in self._scripts:
            ids = np.arange(lo, hi, dtype=np.int64)
            ids.flags.writeable = False
            out = bound.apply(day, ids, cache[lo:hi], self._mean)
            for name, mask in bound.changed(day, ids, self._mean):
                self._fired(day, lo, hi, self.groups[bound.group].name, name, mask)
            self._clipped += int(np.count_nonzero(out < 0.0)) + int(np.count_nonzero(out > m))
            np.clip(out, 0.0, m, out=cache[lo:hi])
        for lo, hi, bound in self._scripts:
            ids = np.arange(lo, hi, dtype=np.int64)
            ids.flags.writeable = False
            view = cache[lo:hi]
            view.flags.writeable = False
            bound.observe(day, ids, view, self._mean)
        self._mean = float(cache.mean()) if cache.size else math.nan
