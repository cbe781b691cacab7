"""The router's unserved demand (router/unserved.py): a Route that finds no replica is
recorded per model, and the pool manager reads it in ListReplicas to wake a pool at zero;
each replica's routed count tells it whether requests came between its polls."""

from __future__ import annotations

from hpcserve.contracts import protocol as p
from hpcserve.contracts.router_client import list_replicas, replica_list
from hpcserve.router.unserved import UnservedModels
from tests.routers import router_with_one_replica


def test_the_book_keeps_the_last_miss_per_model_bounded_in_names_and_time() -> None:
    book = UnservedModels(keep_s=60, max_models=2)
    book.missed("a", 100)
    book.missed("b", 110)
    book.missed("a", 120)  # a is now the newest: b goes first when a third name comes
    assert book.ages(121) == {"a": 1.0, "b": 11.0}
    book.missed("c", 130)
    assert book.ages(130) == {"a": 10.0, "c": 0.0}
    assert book.ages(185) == {"c": 55.0}  # a's miss is over keep_s old
    assert book.ages(191) == {}


def test_routes_without_a_replica_are_listed_with_their_age_and_routed_requests_counted() -> None:
    with router_with_one_replica(lease_s=5.0) as (config, router):
        assert router.route(p.Route(1, "sleeping")).error == "no_replica"
        assert router.route(p.Route(2, "docs")).replica_id == "a"
        assert router.route(p.Route(3, "docs", released=["a"])).replica_id == "a"
        # Every replica excluded (a failover) is no replica either.
        assert router.route(p.Route(4, "docs", exclude=["a"])).error == "no_replica"
        listing = replica_list(config.routing_bind)
        assert set(listing.unserved) == {"sleeping", "docs"}
        assert all(0 <= age < 60 for age in listing.unserved.values())
        (replica,) = list_replicas(config.routing_bind)
        assert (replica.routed, replica.in_flight) == (2, 1)
