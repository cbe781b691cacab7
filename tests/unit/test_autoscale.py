"""The autoscaler's rules (poolmgr/autoscale.py), one table per rule, on a fake clock."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from hpcserve.config import AutoscaleConfig
from hpcserve.poolmgr.autoscale import (
    AutoscaleState,
    Decision,
    ReplicaSignal,
    Signals,
    decide,
    initial_state,
)

CFG = AutoscaleConfig(
    min=1,
    max=6,
    target_in_flight=4,
    max_waiting_per_replica=2,
    scale_up_window_s=10,
    scale_up_cooldown_s=30,
    scale_down_window_s=60,
    scale_down_cooldown_s=120,
)


def replicas(
    n: int, *, running: int = 0, waiting: int = 0, kv: float = 0.0, in_flight: int = 0
) -> list[ReplicaSignal]:
    return [ReplicaSignal(in_flight, running, waiting, kv)] * n


@dataclass
class Pool:
    """Drives decide() over time, as the pool manager does each poll."""

    cfg: AutoscaleConfig = CFG
    state: AutoscaleState = field(default_factory=lambda: AutoscaleState(target=2))
    now: float = 1000.0
    log: list[Decision] = field(default_factory=list)

    def poll(self, sig: Signals, after_s: float = 1.0) -> Decision:
        self.now += after_s
        decision = decide(self.cfg, sig, self.state, self.now)
        self.state = decision.state
        self.log.append(decision)
        return decision

    def hold_for(self, sig: Signals, seconds: float, step: float = 1.0) -> Decision:
        decision = self.poll(sig, 0)
        waited = 0.0
        while waited < seconds:
            decision = self.poll(sig, step)
            waited += step
        return decision

    @property
    def changes(self) -> list[str]:
        return [d.reason for d in self.log if d.changed]


def test_initial_target_is_the_jobs_found_else_replicas_within_min_max() -> None:
    assert initial_state(CFG, replicas=2, live=0).target == 2
    assert initial_state(CFG, replicas=2, live=5).target == 5  # a restart at a peak keeps them
    assert initial_state(CFG, replicas=2, live=9).target == 6


@pytest.mark.parametrize(
    ("sig", "target", "why"),
    [
        # 9 waiting per replica: the load (2 x (2 running + 9 waiting) = 22) at the measured
        # 2 per replica (a queueing replica runs 2) needs 11, capped at max 6.
        (
            Signals(replicas(2, running=2, waiting=9)),
            6,
            "up 2->6: 9.0 waiting per replica > 2; 22 in flight needs 11 at 2 per replica (max 6)",
        ),
        # The router's in-flight count is the load where it is larger: 13 / 4 -> 4.
        (
            Signals(replicas(2, in_flight=6, running=1) + replicas(1, in_flight=1)),
            4,
            "up 2->4: 13 in flight needs 4 at 4 per replica for 10 s",
        ),
        # A full KV cache with all replicas in: one more.
        (Signals(replicas(2, running=3, kv=0.95)), 3, "up 2->3: KV cache 95% full > 90%"),
    ],
)
def test_up_fast_to_what_the_load_needs_after_the_window(
    sig: Signals, target: int, why: str
) -> None:
    pool = Pool()
    first = pool.poll(sig)
    assert first.direction == "hold" and "for 0 s of 10 s" in first.reason
    decision = pool.hold_for(sig, 10)
    assert (decision.direction, decision.target) == ("up", target)
    assert decision.reason.startswith(why)
    assert pool.changes == [decision.reason]


def test_a_blip_shorter_than_the_window_does_not_scale() -> None:
    pool = Pool()
    busy, calm = Signals(replicas(2, running=2, waiting=9)), Signals(replicas(2, running=2))
    pool.hold_for(busy, 8)
    pool.poll(calm)
    decision = pool.hold_for(busy, 8)
    assert decision.target == 2 and pool.changes == []


def test_up_waits_for_starting_replicas_that_cover_the_need_and_for_the_cooldown() -> None:
    pool = Pool()
    busy = Signals(replicas(2, running=2, waiting=9))
    assert pool.hold_for(busy, 10).target == 6
    # Two serve, four start: the queue is still there but the capacity is on its way.
    waiting = Signals(replicas(2, running=2, waiting=3), starting=4)
    decision = pool.hold_for(waiting, 60)
    assert decision.target == 6 and "4 replica(s) starting" in decision.reason
    assert (
        "at autoscale.max (6)"
        in pool.hold_for(Signals(replicas(6, running=2, waiting=5)), 60).reason
    )
    # The cooldown: a second rise right after the first waits scale_up_cooldown_s.
    pool = Pool(cfg=AutoscaleConfig(max=10, target_in_flight=4, scale_up_window_s=0,
                                    scale_up_cooldown_s=30))  # fmt: skip
    assert pool.poll(Signals(replicas(2, in_flight=8))).target == 4
    more = Signals(replicas(4, in_flight=8))
    assert "cooldown" in pool.poll(more).reason
    assert pool.hold_for(more, 30).target == 8


def test_down_slowly_one_step_per_cooldown_with_hysteresis() -> None:
    pool = Pool(state=AutoscaleState(target=4))
    # 4 in flight: fits 3 replicas at 50% of 4 (6): slack; waits the 60 s window ...
    idle = Signals(replicas(4, in_flight=1, running=1))
    decision = pool.hold_for(idle, 59)
    assert (
        decision.target == 4 and "4 in flight fits 3 replica(s) at <= 50% of 4" in decision.reason
    )
    decision = pool.hold_for(idle, 1)
    assert decision.reason == "down 4->3: 4 in flight fits 3 replica(s) at <= 50% of 4 for 60 s"
    # ... then one step per scale_down_cooldown_s (120 s), never two at once.
    idle3 = Signals(replicas(3, in_flight=1, running=1))
    assert "cooldown" in pool.hold_for(idle3, 119).reason
    assert pool.state.target == 3
    assert pool.hold_for(idle3, 1).target == 2
    # 3 in flight on 2 replicas does not fit 1 at 50% of 4 (2): it stays (the hysteresis
    # band between needing 1 replica and fitting 1 at half load).
    assert (
        pool.hold_for(
            Signals(replicas(2, in_flight=1, running=1) + replicas(1, in_flight=1)), 600
        ).target
        == 2
    )
    assert [c.split(":")[0] for c in pool.changes] == ["down 4->3", "down 3->2"]


@pytest.mark.parametrize(
    "sig",
    [
        Signals(replicas(1, running=1, waiting=1) + replicas(3)),  # something waits
        Signals(replicas(4, running=1, kv=0.8)),  # 3 replicas would hold 107%
        Signals([]),  # nothing serves yet: nothing to measure
        Signals(replicas(4), measured=False),  # the router did not answer: load unknown
    ],
)
def test_no_scale_down_while_requests_wait_kv_is_full_or_nothing_serves(sig: Signals) -> None:
    pool = Pool(cfg=AutoscaleConfig(max=6, max_waiting_per_replica=5, max_kv_usage=0.99,
                                    scale_down_window_s=0, scale_down_cooldown_s=0),
                state=AutoscaleState(target=4))  # fmt: skip
    assert pool.hold_for(sig, 600).target == 4 and pool.changes == []


def test_never_below_min_or_above_max_and_warm_spares() -> None:
    cfg = AutoscaleConfig(min=2, max=3, scale_up_window_s=0, scale_down_window_s=0,
                          scale_down_cooldown_s=0, warm_spares=1, target_in_flight=4)  # fmt: skip
    pool = Pool(cfg=cfg, state=AutoscaleState(target=2))
    assert pool.poll(Signals(replicas(2, in_flight=40))).target == 3  # needs 11: max 3
    assert pool.hold_for(Signals(replicas(3)), 600).target == 2  # idle: min 2
    # One replica's load plus the spare: 2 replicas, and it does not shrink below that.
    pool = Pool(cfg=AutoscaleConfig(max=5, warm_spares=1, target_in_flight=4, scale_up_window_s=0,
                                    scale_down_window_s=0, scale_down_cooldown_s=0),
                state=AutoscaleState(target=1))  # fmt: skip
    assert pool.poll(Signals(replicas(1, in_flight=3))).reason.startswith(
        "up 1->2: 3 in flight needs 2 at 4 per replica + 1 spare(s)"
    )
    assert pool.hold_for(Signals(replicas(2, in_flight=1)), 600).target == 2
    # A reload that lowers max: the target follows at once.
    pool.cfg = AutoscaleConfig(max=1)
    assert pool.poll(Signals(replicas(2))).reason == "down 2->1: autoscale.min..max is 1..1"


def test_no_flapping_under_a_load_that_swings_around_the_threshold() -> None:
    pool = Pool(state=AutoscaleState(target=3))
    low = Signals(replicas(3, in_flight=2, running=2))  # 6 in flight: 2 at 4 would do
    high = Signals(replicas(3, in_flight=4, running=4))  # 12 in flight: exactly 3 at 4
    for _ in range(100):
        pool.hold_for(low, 20)
        pool.hold_for(high, 20)
    # 6 never fits 2 replicas at 50% of 4 (4), and 12 never needs more than 3.
    assert pool.changes == []


def test_an_admin_override_wins_until_reset() -> None:
    pool = Pool(state=AutoscaleState(target=2))
    busy = Signals(replicas(2, running=2, waiting=9), override=1)
    decision = pool.poll(busy)
    assert (decision.direction, decision.target) == ("override", 1)
    assert decision.reason.startswith("override 2->1: admin's `hpcserve scale`")
    assert pool.hold_for(busy, 600).target == 1 and len(pool.changes) == 1  # logged once
    # Unclamped: the admin may go above max.
    assert pool.poll(Signals(replicas(1), override=9)).target == 9
    # Reset: back within min..max, and from there the load decides again.
    decision = pool.poll(Signals(replicas(9, running=2, waiting=9)))
    assert decision.reason == "override 9->6: override reset: autoscaling resumes at 6"
    assert pool.hold_for(Signals(replicas(6, running=2, waiting=9)), 60).target == 6


ZERO = AutoscaleConfig(min=0, max=3, idle_s=600, scale_down_window_s=60, scale_down_cooldown_s=120,
                       scale_up_window_s=10, target_in_flight=4)  # fmt: skip


def test_scale_to_zero_after_idle_s_only_and_never_while_busy() -> None:
    pool = Pool(cfg=ZERO, state=AutoscaleState(target=1))
    # The ordinary rule stops at one replica, however long it has been quiet ...
    assert pool.hold_for(Signals(replicas(1), idle_s=599), 900).target == 1
    # ... in flight or waiting: never to zero, whatever idle_s says.
    assert pool.poll(Signals(replicas(1, running=1), idle_s=10_000)).target == 1
    assert pool.poll(Signals(replicas(1, waiting=1), idle_s=10_000)).target == 1
    # Unknown (a pool manager that just started): no.
    assert pool.poll(Signals(replicas(1), idle_s=None)).target == 1
    assert pool.changes == []
    decision = pool.poll(Signals(replicas(1), idle_s=600))
    assert decision.reason == "down 1->0: no request for 600 s (scale to zero)"
    # From a larger target too (nothing came at all), and a pending job with no replica yet.
    pool = Pool(cfg=ZERO, state=AutoscaleState(target=3))
    assert pool.poll(Signals([], starting=3, idle_s=700)).reason.startswith("down 3->0: ")
    # Not within the cooldown after a change.
    pool = Pool(cfg=ZERO, state=AutoscaleState(target=1, changed_at=1000))
    assert "cooldown" in pool.poll(Signals(replicas(1), idle_s=700)).reason


def test_a_pool_at_zero_wakes_on_the_first_unserved_request_at_once() -> None:
    pool = Pool(cfg=ZERO, state=AutoscaleState(target=1))
    assert pool.poll(Signals(replicas(1), idle_s=600), 500).target == 0  # at t=1500
    # Demand from before it went to zero, or older than idle_s, does not wake it.
    assert pool.poll(Signals([], unserved_age_s=30, idle_s=30)).target == 0  # 29 s before
    assert pool.poll(Signals([], unserved_age_s=601)).target == 0
    assert pool.poll(Signals([])).reason == "at zero: no request since it scaled to zero"
    # A Route that found no replica after it went to zero: up at once (no window).
    decision = pool.poll(Signals([], unserved_age_s=0.5, idle_s=0.5))
    assert decision.reason == "up 0->1: a request found no replica 0 s ago (woken from zero)"
    # Warm spares wake with it.
    spare = Pool(cfg=AutoscaleConfig(min=0, max=3, warm_spares=1),
                 state=AutoscaleState(target=0, changed_at=900))  # fmt: skip
    assert spare.poll(Signals([], unserved_age_s=1)).target == 2
    # The router did not answer: hold, whatever the last demand said.
    asleep = Pool(cfg=ZERO, state=AutoscaleState(target=0))
    assert asleep.poll(Signals([], unserved_age_s=1, measured=False)).target == 0
    # An admin's override wins over zero too.
    assert asleep.poll(Signals([], override=2)).target == 2


def test_a_scheduled_floor_raises_the_target_at_once_and_holds_scale_downs_and_zero() -> None:
    why = "schedule floor 4 (mon 09:00-18:00), raised 300 s ahead: cold start"
    pool = Pool(state=AutoscaleState(target=1))
    # Nothing serves yet and nothing is measured: a floor is known ahead, it applies anyway.
    decision = pool.poll(Signals([], measured=False, floor=4, floor_reason=why))
    assert decision.reason == f"up 1->4: {why}"
    # Idle under the floor: no scale-down, and the hold says why.
    decision = pool.hold_for(Signals(replicas(4), floor=4, floor_reason=why), 900)
    assert decision.target == 4 and decision.reason == f"steady at 4; {why}"
    # Above the floor, the ordinary rule comes down to it and stops.
    pool = Pool(state=AutoscaleState(target=6))
    assert pool.hold_for(Signals(replicas(6), floor=4, floor_reason=why), 2000).target == 4
    # Capped at max; load above the floor still scales up.
    pool = Pool(state=AutoscaleState(target=2))
    assert pool.poll(Signals(replicas(2), floor=9, floor_reason=why)).target == 6
    # The floor ends: the ordinary, slow rules take it down.
    assert pool.poll(Signals(replicas(6))).target == 6
    # A pool that may scale to zero does not while a floor applies, and wakes for one.
    pool = Pool(cfg=ZERO, state=AutoscaleState(target=1))
    assert pool.poll(Signals(replicas(1), idle_s=10_000, floor=1, floor_reason=why)).target == 1
    asleep = Pool(cfg=ZERO, state=AutoscaleState(target=0))
    assert asleep.poll(Signals([], floor=2, floor_reason=why)).reason == f"up 0->2: {why}"
