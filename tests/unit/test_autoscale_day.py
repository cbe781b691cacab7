"""bench/autoscale_day.py's pure parts and the rehearsal knobs it runs on: the compressed
day's arrivals, the HPA rules of the reactive policy, the per-policy figures, the local
launcher's queue wait, the simulated engine's load time and the autoscaler's clock."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.autoscale_day import (
    ColdStart,
    Hpa,
    Policy,
    Sample,
    arrivals,
    cold_start_figures,
    estimate_reactive,
    expand_policies,
    parse_targets,
    summarize,
    table_rows,
)
from bench.autoscale_replay import gpu_figures, rate
from bench.workload import RequestResult
from hpcserve.config import ConfigError, parse_config
from hpcserve.poolmgr.launchers import LocalLauncher, queue_wait
from hpcserve.poolmgr.rehearsal_clock import RehearsalClock
from hpcserve.sim.startup import LoadSpecError, draw_load_s, parse_load_s, process_start
from hpcserve.slurm.parse import JobState


def wait_for(what: str, condition: Callable[[], bool], timeout: float = 60.0) -> None:
    """Polls until `condition` holds; a generous deadline, not a timed assertion."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)


def test_the_compressed_day_keeps_the_rate_and_shortens_the_time() -> None:
    # 09:00-13:00 of the day at 120x: two minutes of real time, at the day's rate.
    times = arrivals(7, 2.0, 9 * 3600, 13 * 3600, 120.0)
    assert times == sorted(times) and times[0] >= 0 and times[-1] < 120
    expected = sum(rate(9 * 3600 + t * 120, 2.0) for t in range(120))  # per real second
    assert abs(len(times) - expected) < 4 * expected**0.5
    assert times == arrivals(7, 2.0, 9 * 3600, 13 * 3600, 120.0)  # seeded


def test_cold_start_draws_follow_the_stated_distribution() -> None:
    draws = ColdStart(120.0, 480.0, 840.0).samples(1, 2000)
    queue = [q for q, _ in draws]
    assert abs(sum(queue) / len(queue) - 120) < 10
    assert all(480 <= load <= 840 for _, load in draws)


@pytest.mark.parametrize(
    ("steps", "sizes"),
    [
        # (day s, running + waiting summed): target 1.5 per replica
        ([(0, 1.5)], [1]),  # within the tolerance: no change
        ([(0, 9.0)], [5]),  # ceil(9 / 1.5) = 6, but at most max(2x, +4) = 5 at once
        ([(0, 9.0), (10, 9.0), (15, 9.0)], [5, 5, 6]),  # the next rise 15 s after
        # down only to the highest recommendation of the last 300 s
        ([(0, 6.0), (100, 1.5), (299, 1.5), (301, 1.5)], [4, 4, 4, 1]),
    ],
)
def test_the_reactive_policy_is_the_hpa(steps: list[tuple[float, float]], sizes: list[int]) -> None:
    hpa = Hpa(1.5, 1, 8, 1)
    assert [hpa.step(t, total) for t, total in steps] == sizes


def test_the_reactive_policy_runs_once_per_target_side_by_side() -> None:
    # Without --reactive-targets: one reactive stack at the default target, as before.
    default = expand_policies(["static-peak", "reactive", "hpcserve"], [], 3.0)
    assert default == [
        Policy("static-peak", "static-peak"),
        Policy("reactive", "reactive", 3.0),
        Policy("hpcserve", "hpcserve"),
    ]
    assert [p.slug for p in default] == ["static-peak", "reactive", "hpcserve"]
    # With them: "reactive" stands for one stack per target, in its place.
    matched = expand_policies(["reactive", "hpcserve"], parse_targets("3, 2.5"), 3.0)
    assert [(p.label, p.hpa_target) for p in matched] == [
        ("reactive (target 3)", 3.0),
        ("reactive (target 2.5)", 2.5),
        ("hpcserve", None),
    ]
    assert [p.slug for p in matched] == ["reactive-t3", "reactive-t2.5", "hpcserve"]
    assert {p.kind for p in matched} == {"reactive", "hpcserve"}


@pytest.mark.parametrize(
    ("names", "targets", "error"),
    [
        (["reactive", "keda"], "", "unknown keda"),
        (["hpcserve", "hpcserve"], "", "named twice"),
        (["hpcserve"], "2", "needs the reactive policy"),
        (["reactive"], "3,x", "not a list of numbers"),
        (["reactive"], "3,0", "must be a number > 0, not 0"),
        (["reactive"], "3,3.0", "given twice"),
    ],
)
def test_bad_policies_and_targets_are_refused(names: list[str], targets: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        expand_policies(names, parse_targets(targets), 3.0)


def test_a_lower_hpa_target_buys_attainment_with_gpu_hours() -> None:
    # The replay's model of the pool over the morning hump and the 11:00 burst: the same
    # arrivals and cold starts for each target; a lower target holds more replicas.
    out = estimate_reactive(
        [3.0, 1.5],
        seed=19,
        peak_rps=2.5,
        window_s=(9.5 * 3600, 11.5 * 3600),
        cold=ColdStart(120.0, 600.0, 1200.0),
        slots=4,
        service_s=5.9,
        max_replicas=12,
        dt=1.0,
    )
    assert [e["hpa_target"] for e in out] == [3.0, 1.5]
    default, tight = out
    assert tight["gpu_hours"] > default["gpu_hours"] > 2.0  # more than one replica's 2 hours
    assert tight["ttft_attainment"] >= default["ttft_attainment"]
    assert 0 < tight["utilisation"] < default["utilisation"] <= 1
    assert default["changes"] > 0


def test_figures_per_policy() -> None:
    def ok(at: float, ttft: float, tpot: float) -> RequestResult:
        return RequestResult(at, "", status=200, ttft_s=ttft, tpot_s=tpot, e2e_s=1.0)

    results = [
        ok(0.1, 0.2, 0.02),
        ok(0.2, 1.5, 0.02),
        ok(0.3, 0.3, 0.09),
        RequestResult(0.4, "", status=503, error="busy"),
        RequestResult(0.5, "", error="TimeoutError: "),
    ]
    # Two replicas for 10 real s, one request running on average: at 120x, 40 min held.
    samples = [Sample(float(t), 2, 2, 1) for t in range(-2, 14)]  # outside 0..10 s: left out
    out = summarize(results, samples, speedup=120, slots=2, day_start_s=9 * 3600, duration_s=10.0)
    assert (out["requests"], out["failed"], out["timed_out"]) == (5, 1, 1)
    assert out["errors"] == {"503 busy": 1, "0 TimeoutError: ": 1}
    assert out["slo_attainment"] == 0.2  # one of five within TTFT 0.8 s and TPOT 50 ms
    assert out["gpu_hours"] == pytest.approx(2 * 10 * 120 / 3600)
    assert out["utilisation"] == pytest.approx(0.25)  # 1 of 2 x 2 slots
    first = out["series"][0]
    assert first["hour"] == 9.0 and first["holding"] == 2 and first["ttft_p95_s"] > 1.0
    # the replay's arithmetic: replica-seconds of the day held, slot-seconds busy
    day_s = 10 * 120
    held, busy = gpu_figures(2 * day_s, 1 * day_s, slots=2).values()
    assert (out["gpu_hours"], out["utilisation"]) == (pytest.approx(held), pytest.approx(busy))


@pytest.mark.parametrize(
    ("held_s", "busy_s", "slots", "gpus", "hours", "utilisation"),
    [
        (3600.0, 1800.0, 1, 1, 1.0, 0.5),  # one replica an hour, busy half of it
        (7200.0, 14400.0, 4, 1, 2.0, 0.5),  # 2 of 4 slots busy on average
        (7200.0, 14400.0, 4, 2, 4.0, 0.5),  # two GPUs a replica: twice the GPU-hours
        (0.0, 0.0, 4, 1, 0.0, 0.0),  # nothing held
    ],
)
def test_gpu_hours_and_utilisation_one_definition(
    held_s: float, busy_s: float, slots: int, gpus: int, hours: float, utilisation: float
) -> None:
    out = gpu_figures(held_s, busy_s, slots, gpus)
    assert out == {"gpu_hours": pytest.approx(hours), "utilisation": pytest.approx(utilisation)}


def test_the_table_and_the_cold_starts_per_policy() -> None:
    rows = [
        {"policy": p, "gpu_hours": h, "slo_attainment": 0.99, "utilisation": 0.5, "changes": 0}
        | {"ttft_p50_s": 0.1, "ttft_p95_s": None, "tpot_p50_s": 0.02, "tpot_p95_s": 0.03}
        | {"failed": 0, "timed_out": 1}
        for p, h in (("static-peak", 100.0), ("hpcserve", 40.0))
    ]
    table = table_rows(rows)
    assert [r["vs static peak"] for r in table] == [1.0, 0.4]
    assert rows[1]["gpu_hours_vs_static_peak"] == pytest.approx(0.4)
    assert table[1]["TTFT p50 / p95 (s)"] == "0.1 / -" and table[1]["within SLO"] == "99.00%"
    assert table[1]["TPOT p50 / p95 (ms)"] == "20 / 30"
    assert cold_start_figures([], 60.0) == {"cold_starts": 0}
    starts = [{"queue_s": q, "startup_s": s} for q, s in ((1.0, 10.0), (2.0, 12.0), (3.0, 20.0))]
    assert cold_start_figures(starts, 60.0) == {
        "cold_starts": 3,
        "cold_start_day_s": {
            "queue_median": 120,
            "load_median": 720,
            "total_median": 840,
            "total_p90": 1380,
        },
    }


def test_the_local_launcher_holds_a_job_for_its_queue_wait(tmp_path: Path) -> None:
    waits = [queue_wait(0.5, 3, job) for job in range(1, 200)]
    assert waits == [queue_wait(0.5, 3, job) for job in range(1, 200)]  # seeded per job
    assert 0.4 < sum(waits) / len(waits) < 0.6 and queue_wait(0.0, 3, 1) == 0.0
    launcher = LocalLauncher(tmp_path, queue_wait_s=1000.0, queue_seed=3)
    script = "#!/bin/bash\n#SBATCH --job-name=t-q\nexit 0\n"
    held = launcher.submit(script)
    (job,) = launcher.jobs().jobs
    assert (job.state, job.state_reason, job.start_time) == (JobState.PENDING, "Priority", None)
    launcher.cancel([held])  # cancelled in the queue: it never runs
    assert [j.state for j in launcher.jobs().jobs] == [JobState.CANCELLED]
    assert launcher.jobs().jobs == [] and not (tmp_path / "t-q-local1.out").exists()
    launcher.queue_wait_s = 0.0
    launcher.submit(script)  # no wait: runs at once, and completes
    wait_for("the job to complete", lambda: launcher.jobs().jobs[0].state is JobState.COMPLETED)


def test_a_cancelled_local_job_ends_cancelled_not_failed(tmp_path: Path) -> None:
    launcher = LocalLauncher(tmp_path)
    job_id = launcher.submit("#!/bin/bash\n#SBATCH --job-name=t-c\nsleep 60\n")
    launcher.cancel([job_id])
    seen: list[JobState] = []

    def ended() -> bool:
        seen.extend(j.state for j in launcher.jobs().jobs)
        return seen[-1] is not JobState.RUNNING

    wait_for("the job to end", ended)
    # as scancel: no failure counted against the pool (poolmgr/failures.py)
    assert seen[-1] is JobState.CANCELLED


def test_the_local_queue_wait_is_for_the_local_launcher_only() -> None:
    with pytest.raises(ConfigError, match=r"poolmgr\.local_queue_wait_s: .* needs"):
        parse_config({"poolmgr": {"local_queue_wait_s": 1.0}})
    parse_config({"poolmgr": {"launcher": "local", "local_queue_wait_s": 1.0}})


def test_the_sim_load_time_is_drawn_per_job_and_counted_from_the_job_start() -> None:
    assert parse_load_s("2") == (2.0, 2.0) and parse_load_s("1,3.5") == (1.0, 3.5)
    for bad in ("", "a", "3,1", "-1", "1,2,3"):
        with pytest.raises(LoadSpecError, match="--sim-load-s"):
            parse_load_s(bad)
    draws = [draw_load_s(1.0, 3.0, 19, str(job)) for job in range(1, 100)]
    assert draws == [draw_load_s(1.0, 3.0, 19, str(job)) for job in range(1, 100)]
    assert all(1.0 <= d <= 3.0 for d in draws) and len(set(draws)) == len(draws)
    started = process_start(os.getpid())
    assert started is not None and 0 <= time.time() - started < 3600


def test_the_rehearsal_clock_compresses_the_day() -> None:
    with pytest.raises(ConfigError, match=r"poolmgr\.rehearsal_real_start: "):
        parse_config({"poolmgr": {"rehearsal_speedup": 120.0}})
    config = parse_config(
        {
            "poolmgr": {
                "rehearsal_speedup": 120.0,
                "rehearsal_real_start": 1000.0,
                "rehearsal_day_start": 5000.0,
            }
        }
    )
    clock = RehearsalClock.of(config.poolmgr)
    assert clock.now(1000.0) == 5000.0 and clock.now(1030.0) == 5000.0 + 3600
    assert clock.stretch(7.5) == 900.0
    off = RehearsalClock.of(parse_config({}).poolmgr)
    assert off.now(1234.5) == 1234.5 and off.stretch(3.0) == 3.0
