"""The Xid table, the finding -> action policy, drain reasons, and the health config."""

from __future__ import annotations

import pytest

from hpcserve.config import ConfigError, HealthConfig, parse_config
from hpcserve.contracts.health_policy import (
    CHECKS,
    drain_reason,
    drained_by_hpcserve,
    worst_action,
)
from hpcserve.contracts.protocol import HealthFinding
from hpcserve.health.policy import Policy


@pytest.mark.parametrize(
    ("xid", "cls", "action"),
    [
        (79, "fault", "drain"),  # fell off the bus
        (48, "fault", "drain"),  # double-bit ECC
        (63, "fault", "drain"),  # row remapping
        (74, "fault", "drain"),  # NVLink
        (94, "fault", "drain"),  # contained ECC
        (119, "fault", "drain"),  # GSP timeout
        (120, "fault", "drain"),
        (13, "application", "log"),  # graphics engine exception
        (31, "application", "log"),  # MMU fault from the application
        (43, "application", "log"),
        (45, "application", "log"),  # preemptive cleanup
        (8, "unknown", "log"),
        (999, "unknown", "log"),
    ],
)
def test_default_xid_table(xid: int, cls: str, action: str) -> None:
    policy = Policy()
    assert policy.xid_class(xid) == cls
    assert policy.xid_action(xid) == action
    assert policy.xid_finding(xid, 3).action == action


def test_xid_table_and_checks_are_configurable() -> None:
    policy = Policy(
        HealthConfig(
            xid_actions={"79": "drain_reset", "13": "stop_routing"},
            xid_default="stop_routing",
            actions={"temperature": "drain", "engine_probe": "log"},
            reset_hook=["/bin/true"],
        )
    )
    assert policy.xid_action(79) == "drain_reset"
    assert policy.xid_action(13) == "stop_routing"
    assert policy.xid_action(48) == "drain"  # not overridden
    assert policy.xid_action(8) == "stop_routing"  # the default for unknown Xids
    assert policy.action("temperature") == "drain"
    assert policy.action("engine_probe") == "log"
    assert policy.action("engine_stall") == "stop_routing"
    with pytest.raises(ValueError, match="unknown health check 'nope'"):
        policy.action("nope")


def test_findings_read_like_an_admin_would_write_them() -> None:
    policy = Policy()
    assert policy.xid_finding(79, 3) == HealthFinding("xid", "xid 79 gpu 3", "drain", 3)
    assert policy.xid_finding(13, 0).detail == "xid 13 gpu 0 (application error)"
    findings = [
        policy.finding("temperature", "temperature 95C gpu 1", gpu=1),
        policy.xid_finding(79, 3),
        policy.xid_finding(79, 3),
    ]
    assert worst_action(findings) == "drain"
    assert worst_action([]) == "log"
    assert drain_reason(findings) == "hpcserve: xid 79 gpu 3; temperature 95C gpu 1"
    long = [policy.finding("gpu_lost", f"gpu {i} lost (GPU is lost)") for i in range(20)]
    assert len(drain_reason(long)) == 200 and drain_reason(long).endswith("...")
    assert drained_by_hpcserve("hpcserve: xid 79 gpu 3")
    assert not drained_by_hpcserve("bad DIMM, ticket 42")
    assert not drained_by_hpcserve("")


def test_every_default_action_is_known() -> None:
    assert set(CHECKS.values()) <= {"log", "stop_routing", "drain", "drain_reset"}


@pytest.mark.parametrize(
    ("health", "message"),
    [
        ({"xid_actions": {"x79": "drain"}}, "health.xid_actions: key 'x79' is not an Xid number"),
        ({"actions": {"gpu_on_fire": "drain"}}, "health.actions: unknown check 'gpu_on_fire'"),
        ({"xid_actions": {"79": "reboot"}}, "invalid enum value 'reboot'"),
        (
            {"xid_actions": {"79": "drain_reset"}},
            "health.reset_hook: an action is 'drain_reset' but no reset hook is configured",
        ),
        ({"probe_deadline_s": 0}, "health.probe_deadline_s"),
        ({"auto_resume_after": -1}, "health.auto_resume_after"),
    ],
)
def test_bad_health_config_names_the_key(health: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_config({"health": health})


def test_health_config_round_trips_through_toml(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from hpcserve.config import dump_config, load_config

    cfg = parse_config(
        {
            "health": {
                "xid_actions": {"79": "drain_reset"},
                "reset_hook": ["/usr/local/sbin/gpu-reset", "{node}", "{reason}"],
                "auto_resume_after": 3,
            }
        }
    )
    path = tmp_path / "hpcserve.toml"
    path.write_text(dump_config(cfg))
    assert load_config(path).health == cfg.health
