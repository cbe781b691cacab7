"""Host-wide port reservations (hpcserve/port_reservations.py, hpcserve/ports.py)."""

import os
import random
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hpcserve.port_reservations import (
    Holder,
    format_holder,
    holder_alive,
    is_reserved,
    parse_holder,
    process_start,
    sweep,
    try_reserve,
)
from hpcserve.ports import free_ports, reserve_ports


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1234 98765\n", Holder(1234, "98765")),
        ("1234\n", Holder(1234, "")),
        ("", None),
        ("   \n", None),
        ("0 5", None),
        ("12 ab", None),
        ("-3 5", None),
        ("1 2 3", None),
    ],
)
def test_parse_holder(text: str, expected: Holder | None) -> None:
    assert parse_holder(text) == expected


@pytest.mark.parametrize("holder", [Holder(7, "123"), Holder(7, "")])
def test_format_holder_round_trips(holder: Holder) -> None:
    assert parse_holder(format_holder(holder)) == holder


@pytest.mark.parametrize(
    ("holder", "start_now", "alive"),
    [
        (Holder(7, "100"), "100", True),
        (Holder(7, "100"), "250", False),  # the pid was reused by a later process
        (Holder(7, "100"), None, False),  # no such process
        (Holder(7, ""), "250", True),  # start unknown when reserved: trust the pid
        (Holder(7, "100"), "", True),  # start unknown now: trust the pid
    ],
)
def test_holder_alive(holder: Holder, start_now: str | None, alive: bool) -> None:
    assert holder_alive(holder, start_now) is alive


def test_process_start_tells_a_live_process_from_a_gone_one() -> None:
    assert process_start(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert process_start(child.pid) is None


# A second process that reserves ports with the same random sequence as the test and holds
# them until its stdin closes.
HOLDER = textwrap.dedent(
    """
    import random, sys
    from pathlib import Path
    from hpcserve.ports import reserve_ports
    held = reserve_ports(int(sys.argv[2]), "127.0.0.1", random.Random(42), Path(sys.argv[1]))
    print(" ".join(str(r.port) for r in held), flush=True)
    sys.stdin.read()
    """
)


def _start_holder(directory: Path, count: int) -> tuple[subprocess.Popen[str], list[int]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(directory), str(count)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"the holder process exited with {proc.wait()}"
    return proc, [int(p) for p in line.split()]


def test_two_processes_never_hand_out_the_same_port(tmp_path: Path) -> None:
    other, theirs = _start_holder(tmp_path, 10)
    try:
        # The same random sequence: without reservations these would be the same ports.
        mine = reserve_ports(10, "127.0.0.1", random.Random(42), tmp_path)
        assert len(set(theirs)) == 10
        assert not {r.port for r in mine} & set(theirs)
        for port in theirs:
            assert is_reserved(port, tmp_path)
            assert try_reserve(port, tmp_path) is None
        assert not set(free_ports(10, "127.0.0.1", random.Random(42), tmp_path)) & set(theirs)
        for reservation in mine:
            reservation.release()
    finally:
        other.kill()
        other.communicate()


def test_a_reservation_whose_holder_died_is_free_again(tmp_path: Path) -> None:
    other, theirs = _start_holder(tmp_path, 2)
    other.kill()  # no release: the kernel drops the lock, the file stays behind
    other.communicate()
    assert all((tmp_path / str(port)).exists() for port in theirs)
    assert not any(is_reserved(port, tmp_path) for port in theirs)
    reclaimed = try_reserve(theirs[0], tmp_path)
    assert reclaimed is not None
    assert parse_holder((tmp_path / str(theirs[0])).read_text()) == Holder(
        os.getpid(), process_start(os.getpid()) or ""
    )
    reclaimed.release()


def test_a_released_port_is_free_and_its_file_gone(tmp_path: Path) -> None:
    [reservation] = reserve_ports(1, "127.0.0.1", directory=tmp_path)
    assert try_reserve(reservation.port, tmp_path) is None  # not even twice in one process
    reservation.release()
    reservation.release()
    assert not (tmp_path / str(reservation.port)).exists()
    again = try_reserve(reservation.port, tmp_path)
    assert again is not None
    again.release()


def test_a_bound_port_is_not_reserved_for_anyone(tmp_path: Path) -> None:
    rng = random.Random(5)
    [first] = reserve_ports(1, "127.0.0.1", random.Random(5), tmp_path)
    first.release()
    with socket.socket() as foreign:
        foreign.bind(("127.0.0.1", first.port))
        foreign.listen()
        [other] = reserve_ports(1, "127.0.0.1", rng, tmp_path)
        assert other.port != first.port
        assert not (tmp_path / str(first.port)).exists()
        other.release()


def test_a_port_handed_over_stays_reserved_until_that_process_exits(tmp_path: Path) -> None:
    shell = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)  # fmt: skip
    [reservation] = reserve_ports(1, "127.0.0.1", directory=tmp_path)
    reservation.hand_over(shell.pid)
    assert not reservation.held
    assert is_reserved(reservation.port, tmp_path)
    assert try_reserve(reservation.port, tmp_path) is None
    shell.communicate(b"")
    assert not is_reserved(reservation.port, tmp_path)
    again = try_reserve(reservation.port, tmp_path)
    assert again is not None
    again.release()


def test_handing_over_to_a_gone_process_is_refused(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    [reservation] = reserve_ports(1, "127.0.0.1", directory=tmp_path)
    with pytest.raises(ValueError, match=f"pid {gone.pid}: no such process"):
        reservation.hand_over(gone.pid)
    assert reservation.held
    reservation.release()


def test_free_ports_cli_holds_for_the_given_process(tmp_path: Path) -> None:
    env = {**os.environ, "HPCSERVE_PORTS_DIR": str(tmp_path)}
    shell = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)  # fmt: skip
    try:
        out = subprocess.run(
            [sys.executable, "-m", "hpcserve.cli", "free-ports", "2", "--hold-for", str(shell.pid)],
            env=env, capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        ports = [int(p) for p in out.split()]
        assert len(set(ports)) == 2
        assert all(is_reserved(port, tmp_path) for port in ports)
    finally:
        shell.communicate(b"")
    assert not any(is_reserved(port, tmp_path) for port in ports)


def test_sweep_removes_only_the_files_of_holders_that_are_gone(tmp_path: Path) -> None:
    live, kept = _start_holder(tmp_path, 1)
    try:
        killed, _ = _start_holder(tmp_path, 2)
        killed.kill()
        killed.communicate()
        mine = try_reserve(free_ports(1, "127.0.0.1", directory=tmp_path)[0], tmp_path)
        assert mine is not None
        assert sweep(tmp_path) == 2
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            str(port) for port in [*kept, mine.port]
        )
        assert is_reserved(kept[0], tmp_path) and is_reserved(mine.port, tmp_path)
        mine.release()
    finally:
        live.kill()
        live.communicate()


def test_reserving_first_sweeps_what_killed_holders_left(tmp_path: Path) -> None:
    killed, _ = _start_holder(tmp_path, 2)
    killed.kill()
    killed.communicate()
    [mine] = reserve_ports(1, "127.0.0.1", directory=tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [str(mine.port)]
    mine.release()
