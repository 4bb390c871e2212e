"""The ledger: totals, interval storage, and a digest independent of how charges were chunked."""

from __future__ import annotations

import numpy as np
import pytest

from protocols.ledger import MEMO_REVEAL, ROUND_GUARANTEE, Charge, Ledger


def _charges(split: list[int]) -> list[Charge]:
    """The same charges for devices 0..99, cut into cohorts at ``split``."""
    out = []
    bounds = [0, *split, 100]
    for rnd in (1, 2):
        for lo, hi in zip(bounds, bounds[1:]):
            ids = np.arange(lo, hi)
            out.append(Charge(rnd, 0.05, MEMO_REVEAL, 1.0, ids[(ids % 3 == 0) | (rnd == 1)]))
            out.append(Charge(rnd, 0.05, ROUND_GUARANTEE, 0.7, ids, cumulative=False))
    return out


def test_digest_and_totals_do_not_depend_on_chunking() -> None:
    ledgers = []
    for split in ([], [1, 2, 3, 50], list(range(1, 100, 7))):
        led = Ledger(100)
        for c in _charges(split):
            led.record(c)
        ledgers.append(led)
    assert len({led.digest() for led in ledgers}) == 1
    for led in ledgers[1:]:
        np.testing.assert_array_equal(led.spend, ledgers[0].spend)
    expected = 1.0 + (np.arange(100) % 3 == 0)
    np.testing.assert_array_equal(ledgers[0].spend, expected)
    np.testing.assert_array_equal(ledgers[0].round_epsilon, np.full(100, 0.7))


def test_digest_changes_with_any_charge() -> None:
    base = Ledger(100)
    for c in _charges([]):
        base.record(c)
    for change in (Charge(2, 0.05, MEMO_REVEAL, 1.0, np.array([1])),  # one more device charged
                   Charge(3, 0.05, MEMO_REVEAL, 1.0, np.array([0]))):  # another round
        other = Ledger(100)
        for c in _charges([]):
            other.record(c)
        other.record(change)
        assert other.digest() != base.digest()


def test_rows_expand_to_one_row_per_device_and_charge() -> None:
    led = Ledger(10)
    led.record(Charge(1, 0.0, MEMO_REVEAL, 0.5, np.arange(10)))
    led.record(Charge(2, 1.0, MEMO_REVEAL, 0.5, np.array([2, 5])))
    rows = list(led.rows())
    assert [r["devices"].tolist() for r in rows] == [list(range(10)), [2, 5]]
    assert led.device_charges(5) == [(1, 0.0, MEMO_REVEAL, 0.5, True), (2, 1.0, MEMO_REVEAL, 0.5, True)]
    assert led.device_charges(4) == [(1, 0.0, MEMO_REVEAL, 0.5, True)]


@pytest.mark.parametrize("bad", [np.array([3, 2]), np.array([1, 1]), np.array([10]), np.array([-1, 0])])
def test_bad_device_sets_are_refused(bad: np.ndarray) -> None:
    with pytest.raises(ValueError):
        Ledger(10).record(Charge(1, 0.0, MEMO_REVEAL, 1.0, bad))


def test_negative_or_nan_amounts_are_refused() -> None:
    for amount in (-0.1, float("nan")):
        with pytest.raises(ValueError):
            Charge(1, 0.0, MEMO_REVEAL, amount, np.array([0]))
