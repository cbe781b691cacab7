"""Progress: log lines every interval off a terminal, a redrawn bar on one."""

from __future__ import annotations

import io
import logging

import pytest

from hpcserve.modelcache.progress import Progress, format_duration, human_bytes


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_non_tty_logs_rate_and_eta_every_interval(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="hpcserve.modelcache.progress")
    clock, stream = Clock(), io.StringIO()
    p = Progress("staging llama@3", 10_000_000_000, stream=stream, interval_s=10, clock=clock)
    for _ in range(4):  # 1 GB per 5 s: a line at 10 s and at 20 s only
        clock.t += 5
        p.advance(1_000_000_000)
    p.close()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "staging llama@3: 2.00 GB/10.00 GB 20% 200.00 MB/s ETA 0:40",
        "staging llama@3: 4.00 GB/10.00 GB 40% 200.00 MB/s ETA 0:30",
        "staging llama@3: 4.00 GB in 20.0s (200.00 MB/s)",
    ]
    assert stream.getvalue() == ""  # nothing raw in a job's output file


def test_tty_redraws_one_line_with_a_bar() -> None:
    clock, stream = Clock(), Tty()
    p = Progress("staging m@1", 1000, stream=stream, redraw_s=0.2, clock=clock)
    clock.t += 1
    p.advance(500)
    p.close()
    out = stream.getvalue()
    assert out.startswith("\r\x1b[2K[############............] staging m@1: 500 B/1.00 kB 50%")
    assert "ETA 0:01" in out and out.endswith("staging m@1: 500 B in 1.0s (500 B/s)\n")


def test_formatting() -> None:
    assert [human_bytes(n) for n in (999, 1000, 1_234_567, 16e9, 2.5e12)] == [
        "999 B", "1.00 kB", "1.23 MB", "16.00 GB", "2.50 TB",
    ]  # fmt: skip
    assert [format_duration(s) for s in (None, 0.4, 75, 3725)] == ["?", "0:00", "1:15", "1:02:05"]
