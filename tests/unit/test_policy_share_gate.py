"""The share gate scales with the fleet: min(max_share, share_factor / n) of the recent
requests, so one shared prompt spreads over 64 replicas as it does over 3, and 3 replicas
route exactly as with the absolute 40% gate."""

from __future__ import annotations

from collections import Counter

import pytest

from hpcserve.contracts.prefix_hash import prompt_block_hashes
from hpcserve.router.policies.scorers import NewPrefill
from hpcserve.router.replica_table import ReplicaTable
from tests.unit.test_policy_routing import BS, Fleet, _open, prompt


@pytest.fixture(autouse=True)
def _close_subscribers():
    yield
    while _open:
        _open.pop().close()


@pytest.mark.parametrize(
    ("n", "max_share", "factor", "limit"),
    [
        (1, 0.4, 2.0, None),  # no gate below 3 replicas
        (2, 0.4, 2.0, None),
        (3, 0.4, 2.0, 0.4),  # small fleets: the absolute limit, as before
        (5, 0.4, 2.0, 0.4),
        (8, 0.4, 2.0, 0.25),
        (64, 0.4, 2.0, 2 / 64),  # twice the fair share
        (64, 0.4, 1.0, 1 / 64),
        (64, 1.0, 2.0, None),  # max_share 1: the gate is off
    ],
)
def test_share_limit(n, max_share, factor, limit) -> None:
    assert NewPrefill(max_share=max_share, share_factor=factor).share_limit(n) == limit


def test_the_share_window_grows_with_the_fleet_past_eight_replicas() -> None:
    table = ReplicaTable()
    assert [table.share_window() for table.replicas in ([0] * 3, [0] * 8, [0] * 64)] == [
        32,
        32,
        256,
    ]


def shared_prompt_routes(fleet: Fleet, requests: int) -> tuple[list[str], int]:
    """One request at a time (no queue: only the share gate spreads), every one starting
    with the same 1,024-token system prompt; where each went, and how many found the
    prompt cached there."""
    routes: list[str] = []
    hits = 0
    for i in range(requests):
        tokens = prompt(1024, 64, i)
        held = fleet.decider.index.match(prompt_block_hashes(tokens, BS))
        rid = fleet.route(tokens)
        hits += held.get(rid, 0) > 0
        routes.append(rid)
        fleet.release(rid)
    return routes, hits


def test_one_shared_prompt_spreads_over_64_replicas() -> None:
    requests = 640
    absolute, _ = shared_prompt_routes(Fleet(64, share_factor=0.4 * 64), requests)
    scaled, hits = shared_prompt_routes(Fleet(64), requests)
    # The absolute 40% gate lets one replica take half of all traffic ...
    assert max(Counter(absolute).values()) > requests * 0.5, Counter(absolute).most_common(3)
    # ... the scaled one (8 / 64 = 12.5%, about twice that through the estimate's fair-share
    # prior) spreads the prompt over several replicas.
    assert max(Counter(scaled).values()) <= requests * 0.3, Counter(scaled).most_common(3)
    # Spreading costs each replica that takes the prompt one miss, no more.
    assert hits >= requests - len(set(scaled)), (hits, len(set(scaled)))


def test_three_replicas_route_as_with_the_absolute_gate() -> None:
    # min(0.4, factor / 3) is 0.4 for each factor, and the window stays 32 decisions.
    picks = [shared_prompt_routes(Fleet(3, share_factor=f), 300) for f in (1.2, 2.0, 100.0)]
    assert picks[0] == picks[1] == picks[2]
    assert max(Counter(picks[0][0]).values()) <= 300 * 0.45
