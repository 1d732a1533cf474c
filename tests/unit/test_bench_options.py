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
    ],
)
def test_bad_options_are_refused_naming_the_field(name: str, value: Any) -> None:
    with pytest.raises(ValueError, match=name):
        BenchOptions(**{name: value})


def test_a_paced_rate_is_kept_and_defaults_to_none() -> None:
    assert BenchOptions().paced_rate is None
    assert BenchOptions(paced_rate=80).paced_rate == 80
