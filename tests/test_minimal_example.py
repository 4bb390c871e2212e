"""examples/minimal_protocol/rr_mean.py, the README's shortest complete protocol: it passes the conformance kit
(its device side, collector side and reference model agree on every runtime), and its estimate is unbiased
with the spread its estimate_sd claims."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from scenarios import conformance, runner, schema

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "minimal_protocol"


@pytest.fixture(autouse=True)
def importable(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))


def test_the_minimal_protocol_passes_the_conformance_kit():
    sc = conformance.scenario_for({"name": "rr_mean:RRMeanParams", "epsilon": 1.0, "max_value": 86400.0})
    assert set(conformance.run_conformance(sc, keep_going=True)) == set(conformance.CHECKS)


def test_the_minimal_protocol_estimates_the_mean_without_bias_and_with_its_claimed_spread():
    """40 rounds of 20,000 devices: each round's error over the sd that estimate_sd gives is about N(0, 1), so
    the mean of 40 such z is within 4/sqrt(40) of 0 and their mean square within [0.4, 1.9] (the 1e-4 tails of
    chi-square with 40 degrees of freedom, over 40); a biased estimator (one without the - q, say) or a
    device side at another epsilon is far outside both."""
    sc = schema.load(str(EXAMPLE / "rr_mean.toml"), ["population.devices=20000", "rounds=40"])
    result = runner.run(sc)
    z = np.array([(r.estimate - r.truth) / r.sd_theory for r in result.rounds])
    assert z.size == 40 and np.all(np.isfinite(z))
    assert abs(z.mean()) < 4 / math.sqrt(40), z.mean()
    assert 0.4 < float(np.mean(z**2)) < 1.9, np.mean(z**2)
    assert result.ledger.spend.max() == pytest.approx(40 * 1.0)  # eps a report, every round
