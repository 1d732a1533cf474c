"""NATS URL lists and the JetStream replica setting (pure parsing)."""

from __future__ import annotations

import pytest

from fleetlease.ops.config import ENV_JS_REPLICAS, ConfigError, js_replicas
from fleetlease.transport.nats_connect import server_list
from fleetlease.transport.staging import StagingLimits


def test_a_single_url_is_passed_unchanged() -> None:
    assert server_list("nats://127.0.0.1:4222") == "nats://127.0.0.1:4222"


def test_a_comma_separated_list_becomes_the_server_pool() -> None:
    assert server_list("nats://a:4222, nats://b:4222,,nats://c:4222 ") == [
        "nats://a:4222",
        "nats://b:4222",
        "nats://c:4222",
    ]


def test_a_list_of_nothing_is_refused() -> None:
    with pytest.raises(ValueError, match="no NATS URL"):
        server_list(" , ,")


def test_js_replicas_flag_over_environment_over_default() -> None:
    assert js_replicas(None, env={}) == 1
    assert js_replicas(None, env={ENV_JS_REPLICAS: "3"}) == 3
    assert js_replicas(5, env={ENV_JS_REPLICAS: "3"}) == 5


@pytest.mark.parametrize("bad", [0, 6, -1])
def test_js_replicas_out_of_range_is_refused(bad: int) -> None:
    with pytest.raises(ConfigError, match="1 to 5"):
        js_replicas(bad, env={})


def test_js_replicas_not_a_number_is_refused() -> None:
    with pytest.raises(ConfigError, match="integer"):
        js_replicas(None, env={ENV_JS_REPLICAS: "three"})


def test_staging_limits_refuse_a_zero_replica_count() -> None:
    with pytest.raises(ValueError, match="replicas"):
        StagingLimits(replicas=0)
    assert StagingLimits(replicas=3).replicas == 3
