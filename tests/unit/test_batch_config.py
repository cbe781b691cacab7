"""The [batch] section of the platform config: defaults, and errors that name the key."""

from __future__ import annotations

import pytest

from hpcserve.config import BatchConfig, ConfigError, parse_config


def test_defaults_put_the_batch_state_under_the_state_dir() -> None:
    config = parse_config({"state_dir": "/srv/hpcserve"})
    assert config.batch == BatchConfig()
    assert config.batch_dir() == "/srv/hpcserve/batch"
    assert parse_config({"batch": {"dir": "/data/batch"}}).batch_dir() == "/data/batch"


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        ({"max_attempts": 0}, "batch.max_attempts: expected int >= 1, got 0"),
        ({"completion_window_s": 0}, "batch.completion_window_s: expected float > 0"),
        ({"concurrency_per_replica": "many"}, "batch.concurrency_per_replica: expected int"),
        ({"max_line": 5}, "batch: object contains unknown field max_line"),
    ],
)
def test_bad_values_name_the_key(batch: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config({"batch": batch})
    assert message in str(caught.value)
