"""The [batch] section of the platform config: defaults, and errors that name the key."""

from __future__ import annotations

import pytest

from hpcserve.config import BatchConfig, ConfigError, parse_config


def test_defaults_put_the_batch_state_under_the_state_dir() -> None:
    config = parse_config({"state_dir": "/srv/hpcserve"})
    assert config.batch == BatchConfig()
    assert config.batch_dir() == "/srv/hpcserve/batch"
    assert parse_config({"batch": {"dir": "/data/batch"}}).batch_dir() == "/data/batch"
    assert (config.batch.runner, config.batch.metrics_port) == ("standby", 9103)


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        ({"max_attempts": 0}, "batch.max_attempts: expected int >= 1, got 0"),
        ({"completion_window_s": 0}, "batch.completion_window_s: expected float > 0"),
        ({"concurrency_per_replica": "many"}, "batch.concurrency_per_replica: expected int"),
        ({"max_line": 5}, "batch: object contains unknown field max_line"),
        (
            {"runner": "both"},
            "batch.runner: invalid enum value 'both'; allowed: standby, process, gateway",
        ),
        ({"metrics_port": 70000}, "batch.metrics_port: expected int <= 65535"),
    ],
)
def test_bad_values_name_the_key(batch: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config({"batch": batch})
    assert message in str(caught.value)


def _job_args(pool: dict[str, object]) -> tuple[str, ...]:
    from hpcserve.poolmgr.spec import build_job_spec

    config = parse_config({"pools": [{"name": "chat", "model_path": "/m", **pool}]})
    return build_job_spec(config, config.pools[0]).engine_args


def test_pools_start_their_engines_with_priority_scheduling_unless_told_otherwise() -> None:
    assert _job_args({}) == ("--scheduling-policy", "priority")
    assert _job_args({"scheduling_policy": "fcfs"}) == ()
    own = ("--scheduling-policy=fcfs",)
    assert _job_args({"engine_args": list(own)}) == own  # the pool's own flag wins
    with pytest.raises(ConfigError, match=r"pools\[0\]\.scheduling_policy"):
        parse_config({"pools": [{"name": "chat", "model_path": "/m", "scheduling_policy": "x"}]})
