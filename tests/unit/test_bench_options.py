"""``BenchOptions`` refuses bad values with a clear ``ValueError`` naming the field
(the ``bench`` command turns it into a usage error, exit 2)."""

from __future__ import annotations

from typing import Any

import pytest

from fleetlease.ops.bench import BenchOptions


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("tasks", 0),
        ("hosts", True),
        ("renew_leases", -1),
        ("calibration_s", 0),
        ("paced_rate", 0),
        ("paced_rate", -5.0),
        ("paced_rate", float("nan")),
        ("paced_rate", True),
        ("paced_rate", "fast"),
        ("cancel_backlog", -1),
        ("cancel_backlog", True),
        ("cancel_count", 0),
        ("cancel_lease_s", 0),
        ("cancel_lease_s", float("nan")),
    ],
)
def test_bad_options_are_refused_naming_the_field(name: str, value: Any) -> None:
    with pytest.raises(ValueError, match=name):
        BenchOptions(**{name: value})


def test_a_paced_rate_is_kept_and_defaults_to_none() -> None:
    assert BenchOptions().paced_rate is None
    assert BenchOptions(paced_rate=80).paced_rate == 80


def test_the_cancel_reach_cell_is_on_by_default_and_zero_skips_it() -> None:
    assert BenchOptions().cancel_backlog == 2000
    assert BenchOptions(cancel_backlog=0).cancel_backlog == 0
