"""The runner lock (gateway/batch/lock.py) on real flock(2) files: one holder at a time, its
name readable by the others, a standby gateway that keeps off while a runner process is up
and hands the lock back when one appears, and a gateway of batch.runner "process" that never
takes it. (flock locks belong to an open file, so two RunnerLocks in one process contend as
two processes do.)"""

from __future__ import annotations

from pathlib import Path

from hpcserve.gateway.batch.lock import RunnerLock


def test_one_holder_at_a_time_and_the_others_see_who(tmp_path: Path) -> None:
    first = RunnerLock(tmp_path, "gateway", name="gateway")
    second = RunnerLock(tmp_path, "gateway", name="gateway")
    assert second.holder() is None  # free
    assert first.try_take() and first.held
    assert not second.try_take() and not second.held
    assert second.holder() == first.identity
    assert first.holder() == first.identity
    first.release()
    assert second.holder() is None
    assert second.try_take()
    assert not first.try_take()
    second.close()
    assert first.try_take()  # the kernel frees it with the file, as for a killed holder
    first.close()


def test_a_standby_gateway_keeps_off_while_a_runner_process_is_up(tmp_path: Path) -> None:
    standby = RunnerLock(tmp_path, "standby", name="gateway")
    process = RunnerLock(tmp_path, "process", name="batch-runner")
    assert process.announce()
    assert standby.runner_present()
    assert not standby.try_take(), "a runner process is up: it runs the batches"
    assert process.try_take()
    process.close()
    assert not standby.runner_present()
    assert standby.try_take(), "no runner process: the standby gateway runs them"
    assert not standby.should_hand_back()
    standby.close()


def test_a_standby_gateway_hands_back_once_a_runner_process_appears(tmp_path: Path) -> None:
    standby = RunnerLock(tmp_path, "standby", name="gateway")
    process = RunnerLock(tmp_path, "process", name="batch-runner")
    assert standby.try_take()
    assert not process.try_take()  # announced itself, waits for the lock
    # Seen twice in a row: one sighting may be another gateway testing the file.
    assert not standby.should_hand_back()
    assert standby.should_hand_back()
    standby.release()
    assert process.try_take()
    assert standby.holder() == process.identity
    assert not standby.try_take()
    # A gateway that runs batches whatever (batch.runner = "gateway") does not hand back.
    process.release()
    eager = RunnerLock(tmp_path, "gateway", name="gateway")
    assert eager.try_take()
    assert not eager.should_hand_back() and not eager.should_hand_back()
    eager.close()
    process.close()
    standby.close()


def test_a_gateway_of_a_process_runner_never_takes_the_lock(tmp_path: Path) -> None:
    watcher = RunnerLock(tmp_path, "never", name="gateway")
    assert not watcher.try_take()
    assert watcher.holder() is None  # ... and can tell that nobody runs the batches
    process = RunnerLock(tmp_path, "process", name="batch-runner")
    assert process.try_take()
    assert watcher.holder() == process.identity
    process.close()


def test_two_runner_processes_one_runs_the_other_waits(tmp_path: Path) -> None:
    active = RunnerLock(tmp_path, "process", name="batch-runner")
    spare = RunnerLock(tmp_path, "process", name="batch-runner")
    assert active.try_take()
    assert not spare.try_take() and spare.announce()  # present, waiting
    active.close()
    assert spare.try_take()
    spare.close()
