"""Progress of a long copy or hash: bytes/s and ETA, for a terminal or a job's log file."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import TextIO

log = logging.getLogger(__name__)

BAR_WIDTH = 24


class Progress:
    """Thread-safe byte counter that reports rate and ETA while work goes on.

    On a terminal (the stream is a TTY) one line is redrawn in place, at most every
    `redraw_s`. Elsewhere, which includes a Slurm job whose output is a file, an INFO log
    line is written every `interval_s` so the output stays readable. The rate is the mean
    since the first byte: a copy from a shared filesystem that stalls and resumes gets an
    ETA that moves slowly rather than one that jumps. `close` writes one summary line.
    Workers call `advance(n)` from any thread; reporting happens on the caller's thread.
    """

    def __init__(
        self,
        label: str,
        total_bytes: int,
        *,
        stream: TextIO | None = None,
        interval_s: float = 10.0,
        redraw_s: float = 0.2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.label = label
        self.total = total_bytes
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = redraw_s if self.tty else interval_s
        self.clock = clock
        self.done = 0
        self._start = clock()
        self._next_report = self._start + self.every
        self._lock = threading.Lock()

    def advance(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes
            now = self.clock()
            if now < self._next_report:
                return
            self._next_report = now + self.every
            self._report(self.line(now))

    def line(self, now: float) -> str:
        elapsed = max(now - self._start, 1e-9)
        rate = self.done / elapsed
        pct = min(100.0, 100.0 * self.done / self.total) if self.total else 100.0
        eta = max(0.0, self.total - self.done) / rate if rate > 0 else None
        text = (
            f"{self.label}: {human_bytes(self.done)}/{human_bytes(self.total)} {pct:.0f}% "
            f"{human_bytes(rate)}/s ETA {format_duration(eta)}"
        )
        if self.tty:
            filled = int(BAR_WIDTH * pct / 100)
            text = f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {text}"
        return text

    def close(self) -> None:
        elapsed = max(self.clock() - self._start, 1e-9)
        summary = (
            f"{self.label}: {human_bytes(self.done)} in {elapsed:.1f}s "
            f"({human_bytes(self.done / elapsed)}/s)"
        )
        if self.tty:
            self.stream.write("\r\x1b[2K" + summary + "\n")
            self.stream.flush()
        else:
            log.info("%s", summary)

    def _report(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r\x1b[2K" + text)
            self.stream.flush()
        else:
            log.info("%s", text)

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = round(seconds)
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"
