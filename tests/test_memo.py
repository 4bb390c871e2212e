"""RevealSet: which memoized responses each device has revealed, against a plain Python set."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.memo import RevealSet


@settings(max_examples=80, deadline=None, derandomize=True)
@given(size=st.integers(1, 40), width=st.sampled_from([1, 5, 64, 65, 256, 257, 100_000]),
       steps=st.lists(st.lists(st.integers(0, 10**9), min_size=1, max_size=40), min_size=1, max_size=12))
def test_reveal_set_matches_a_reference_set(size: int, width: int, steps: list[list[int]]) -> None:
    rs = RevealSet(size, width)
    seen: set[tuple[int, int]] = set()
    for raw in steps:
        rows = np.unique(np.array(raw) % size)  # distinct rows in one insert, like a cohort's round
        items = (np.array(raw[: rows.size]) * 7919) % width
        twin = RevealSet(size, width)  # the same set, asked for the positions of the new pairs instead
        twin.restore(rs.snapshot())
        new = rs.insert(rows, items)
        expect = [(int(r), int(i)) not in seen for r, i in zip(rows, items)]
        assert new.tolist() == expect
        at = twin.insert(rows, items, positions=True)
        assert at.dtype == np.int64 and at.tolist() == np.flatnonzero(expect).tolist()
        np.testing.assert_array_equal(twin.snapshot()["table"], rs.snapshot()["table"])
        seen.update((int(r), int(i)) for r, i in zip(rows, items))
    counts = np.zeros(size, dtype=np.int64)
    for r, _ in seen:
        counts[r] += 1
    np.testing.assert_array_equal(rs.counts(), counts)


def test_hash_mode_grows_past_its_initial_capacity() -> None:
    rs = RevealSet(5000, 10_000)
    assert not rs.dense
    rows = np.arange(5000)
    for k in range(3):
        assert rs.insert(rows, (rows * 3 + k) % 10_000).all()
        assert not rs.insert(rows, (rows * 3 + k) % 10_000).any()
    np.testing.assert_array_equal(rs.counts(), np.full(5000, 3))


def test_an_input_out_of_range_is_refused_before_anything_is_recorded() -> None:
    for width in (25, 1000):  # the bitset and the hash table
        rs = RevealSet(4, width)
        for bad in (-1, width):
            for positions in (False, True):
                try:
                    rs.insert(np.arange(4), np.array([0, 1, bad, 2]), positions)
                except ValueError as exc:
                    assert "out of range" in str(exc)
                else:
                    raise AssertionError("an input out of range was taken")
        np.testing.assert_array_equal(rs.counts(), np.zeros(4))
