"""gateway/replica_view.py: the last known replica set the gateway routes on while the
router is away."""

from __future__ import annotations

import random

from hpcserve.contracts import protocol as p
from hpcserve.gateway.replica_view import ReplicaView


def info(rid: str, model: str = "m") -> p.ReplicaInfo:
    return p.ReplicaInfo(rid, model, f"http://{rid}", "pool", 0, "n1", 0.0, 0.0, 0, p.ReplicaLoad())


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_nothing_known_nothing_picked() -> None:
    view = ReplicaView(300, clock=Clock())
    assert view.pick("m") is None


def test_picks_spread_by_this_gateways_own_in_flight_count() -> None:
    view = ReplicaView(300, clock=Clock(), rng=random.Random(1))
    view.update([info("a"), info("b"), info("x", model="other")])
    first, second = view.pick("m"), view.pick("m")
    assert first is not None and second is not None
    assert {first.replica_id, second.replica_id} == {"a", "b"}
    assert first.url == f"http://{first.replica_id}"
    view.released(first.replica_id)
    third = view.pick("m")
    assert third is not None and third.replica_id == first.replica_id, "the idle one"


def test_excluded_replicas_and_other_models_are_never_picked() -> None:
    view = ReplicaView(300, clock=Clock())
    view.update([info("a"), info("b")])
    for _ in range(5):
        picked = view.pick("m", exclude=["a"])
        assert picked is not None and picked.replica_id == "b"
    assert view.pick("m", exclude=["a", "b"]) is None
    assert view.pick("unknown") is None


def test_a_set_older_than_the_max_age_is_not_trusted() -> None:
    clock = Clock()
    view = ReplicaView(300, clock=clock)
    view.update([info("a")])
    clock.now = 299.0
    assert view.pick("m") is not None
    clock.now = 301.0
    assert view.pick("m") is None


def test_the_router_answering_again_ends_the_away_state() -> None:
    view = ReplicaView(300, clock=Clock())
    view.update([info("a")])
    view.router_lost("no answer")
    assert view.router_away
    view.pick("m")
    view.update([info("a")])
    assert not view.router_away
    view.released("a")  # a request routed while away ends after the router is back: harmless


def test_an_alias_routes_to_its_target_versions_replicas_under_their_served_name() -> None:
    view = ReplicaView(300, clock=Clock())
    docs = [
        p.ReplicaInfo(rid, "docs", f"http://{rid}", "pool", 0, "n1", 0.0, 0.0, 0,
                      p.ReplicaLoad(), model_ref=ref)
        for rid, ref in (("d1", "docs@1"), ("d2", "docs@2"))
    ]  # fmt: skip
    view.update([*docs, info("x", model="extraction")], {"extraction": "docs@1", "qa": "docs@1"})
    picked = view.pick("qa")
    assert picked is not None and (picked.replica_id, picked.model) == ("d1", "docs")
    assert view.pick("qa", exclude=["d1"]) is None
    assert view.served_as("qa") == "docs" and view.served_as("docs") == "docs"
    # A served model name wins over an alias of the same name, as in the router.
    plain = view.pick("extraction")
    assert plain is not None and (plain.replica_id, plain.model) == ("x", "")
    assert view.served_as("extraction") == "extraction"
    view.update(docs, {})  # the alias is gone from the router's map
    assert view.pick("qa") is None and view.served_as("qa") == "qa"
