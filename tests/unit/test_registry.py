from hpcserve.contracts.protocol import Register, ReplicaLoad
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


def test_a_repeated_register_with_new_load_or_adapters_keeps_the_replica():
    r = Registry(lease_s=6.0)
    removed: list[str] = []
    r.on_remove.append(removed.append)
    first = r.register(reg("a"), now=0.0)
    first.in_flight = 2
    again = r.register(
        Register("a", "m", "http://a", load=ReplicaLoad(running=4), adapters=["x"]), now=1.0
    )
    assert again is first and removed == []
    assert again.in_flight == 2 and again.load.running == 4 and again.spec.adapters == ["x"]
    assert again.queued == 2
