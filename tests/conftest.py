"""Shared test setup. The scenario builders several modules use live in tests/support.py (a plain module, not
a test module: a test module never imports another); they are offered here as fixtures too."""

from __future__ import annotations

from typing import Callable

import pytest

from scenarios import schema
from tests import support


@pytest.fixture
def protocol_scenario() -> Callable[..., schema.Scenario]:
    """tests.support.protocol_scenario: ``protocol_scenario("1bitmean", **{"population.devices": 400})``."""
    return support.protocol_scenario


@pytest.fixture
def live_scenarios() -> dict[str, schema.Scenario]:
    """tests.support.live_scenarios(): one small lossless scenario for every protocol, by name."""
    return support.live_scenarios()
