import random

from hpcserve.router.policy import LeastLoad
from hpcserve.router.protocol import Register, ReplicaLoad
from hpcserve.router.registry import Registry


def reg(rid: str, model: str = "m") -> Register:
    return Register(rid, model, f"http://{rid}")


def test_register_heartbeat_expire():
    r = Registry(lease_s=6.0)
    r.register(reg("a"), now=0.0)
    r.register(reg("b"), now=0.0)
    assert r.models() == {"m": 2}
    assert r.heartbeat("a", ReplicaLoad(running=2), now=5.0)
    assert r.expire(now=6.5) == ["b"]
    assert [x.replica_id for x in r.for_model("m")] == ["a"]
    assert r.get("a").load.running == 2
    assert r.expire(now=11.5) == ["a"]
    assert r.models() == {} and len(r) == 0


def test_heartbeat_of_unknown_replica_asks_for_registration():
    r = Registry(lease_s=6.0)
    assert r.heartbeat("ghost", ReplicaLoad(), now=1.0) is False


def test_deregister_removes_at_once_and_is_idempotent():
    r = Registry(lease_s=6.0)
    r.register(reg("a"), now=0.0)
    assert r.deregister("a", "SIGTERM") is True
    assert r.deregister("a", "again") is False
    assert r.for_model("m") == []


def test_re_registration_keeps_in_flight_count_but_a_changed_spec_replaces():
    r = Registry(lease_s=6.0)
    r.register(reg("a"), now=0.0).in_flight = 3
    assert r.register(reg("a"), now=1.0).in_flight == 3
    moved = r.register(Register("a", "other", "http://a"), now=2.0)
    assert moved.in_flight == 0 and r.models() == {"other": 1}


def test_least_load_prefers_idle_and_spreads_ties():
    r = Registry(lease_s=6.0)
    for rid in "abc":
        r.register(reg(rid), now=0.0)
    policy = LeastLoad(random.Random(1))
    r.get("a").in_flight = 2
    picks = {policy.pick(r.for_model("m")).replica_id for _ in range(50)}
    assert picks == {"b", "c"}
    r.get("b").load = ReplicaLoad(waiting=5)
    assert {policy.pick(r.for_model("m")).replica_id for _ in range(20)} == {"c"}
    assert policy.pick([]) is None
