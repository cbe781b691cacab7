"""pools[].autoscale: typed, validated at start, errors naming the key."""

from pathlib import Path

import pytest

from hpcserve.config import AutoscaleConfig, ConfigError, dump_config, load_config, parse_config

POOL = {"name": "chat", "model_path": "/models/llama"}


@pytest.mark.parametrize(
    ("pool", "message"),
    [
        ({"autoscale": {}}, "pools[0].autoscale: object missing required field max"),
        ({"autoscale": {"max": 0}}, "pools[0].autoscale.max: expected int >= 1, got 0"),
        (
            {"autoscale": {"max": 4, "min": 0, "wake_budget_s": 7200}},
            "pools[0].autoscale.wake_budget_s: expected float <= 3600",
        ),
        (
            {"autoscale": {"max": 4, "min": 0, "idle_s": 0}},
            "pools[0].autoscale.idle_s: expected float > 0",
        ),
        (
            {"autoscale": {"max": 4, "schedule": [{"start": "9:00", "end": "18:00", "min": 2}]}},
            "pools[0].autoscale.schedule[0].start: expected str matching regex",
        ),
        (
            {"autoscale": {"max": 4, "schedule": [{"start": "22:00", "end": "06:00", "min": 2}]}},
            "pools[0].autoscale.schedule[0].end: 06:00 is not after start (22:00); a floor "
            "through midnight is two entries",
        ),
        (
            {"autoscale": {"max": 4, "schedule": [{"start": "09:00", "end": "18:00", "min": 5}]}},
            "pools[0].autoscale.schedule[0].min: 5 is above autoscale.max (4)",
        ),
        (
            {"autoscale": {"max": 4, "schedule": [
                {"start": "09:00", "end": "18:00", "min": 2, "days": ["monday"]}]}},
            "pools[0].autoscale.schedule[0].days[0]: invalid enum value 'monday'",
        ),
        ({"autoscale": {"max": 2, "min": 3}}, "pools[0].autoscale.min: 3 is above autoscale.max"),
        (
            {"autoscale": {"max": 4, "min": 2}, "replicas": 1},
            "pools[0].replicas: 1 is outside autoscale.min..max (2..4)",
        ),
        (
            {"autoscale": {"max": 4}, "replicas": 5},
            "pools[0].replicas: 5 is outside autoscale.min..max (1..4)",
        ),
        (
            {"autoscale": {"max": 2, "warm_spares": 2}},
            "pools[0].autoscale.warm_spares: 2 leaves no room below autoscale.max (2)",
        ),
        (
            {"autoscale": {"max": 4, "max_kv_usage": 1.5}},
            "pools[0].autoscale.max_kv_usage: expected float <= 1",
        ),
        (
            {"autoscale": {"max": 4, "scale_down_window_s": -1}},
            "pools[0].autoscale.scale_down_window_s: expected float >= 0",
        ),
        (
            {"autoscale": {"max": 4, "ttft_p95": 1}},
            "pools[0].autoscale: object contains unknown field ttft_p95",
        ),
        (
            {"autoscale": {"max": 4}, "role": "batch"},
            "pools[0].autoscale: pool 'chat' has role 'batch'",
        ),
    ],
)
def test_bad_autoscale_names_the_key(pool: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"pools": [{**POOL, **pool}]}, source="site.toml")
    assert message in str(err.value).replace("`", "")


def test_defaults_and_round_trip(tmp_path: Path) -> None:
    cfg = parse_config(
        {
            "pools": [
                {**POOL, "replicas": 2, "autoscale": {"min": 2, "max": 6, "ttft_p95_s": 1.5}},
                {**POOL, "name": "fixed", "served_model_name": "other"},
            ]
        }
    )
    auto = cfg.pools[0].autoscale
    assert auto == AutoscaleConfig(min=2, max=6, ttft_p95_s=1.5)
    assert (auto.target_in_flight, auto.warm_spares, auto.tpot_p95_s) == (8, 0, 0.05)
    assert cfg.pools[1].autoscale is None
    path = tmp_path / "hpcserve.toml"
    path.write_text(dump_config(cfg))  # a pool without autoscale writes no key for it
    assert load_config(path).pools == cfg.pools


def test_scale_to_zero_starts_asleep_with_replicas_zero() -> None:
    cfg = parse_config({"pools": [{**POOL, "replicas": 0, "autoscale": {"min": 0, "max": 2}}]})
    auto = cfg.pools[0].autoscale
    assert auto is not None and (auto.min, auto.idle_s, auto.wake_budget_s) == (0, 900.0, 60.0)
    assert cfg.pools[0].replicas == 0
