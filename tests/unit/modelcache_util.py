"""Helpers for the modelcache tests: small model directories and a child process runner."""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

FILES = {
    "model-00001-of-00002.safetensors": 3_000_000,
    "model-00002-of-00002.safetensors": 2_500_001,
    "config.json": 0,  # written as text below
    "tokenizer/tokenizer.json": 100_000,
    "empty.txt": 0,
}
CHUNK = 256 << 10  # small chunks: every file is cut into several


def make_model(directory: Path, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    for name, size in FILES.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.bytes(size))
    (directory / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}\n')
    return directory


def tree_bytes(directory: Path) -> dict[str, bytes]:
    return {
        p.relative_to(directory).as_posix(): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and not p.name.startswith(".hpcserve")
    }


class Child:
    """A Python child running `code`; its stdout and stderr lines are gathered by a thread,
    so a test can wait for a line with a timeout instead of blocking on the pipe."""

    def __init__(self, code: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self._pump_thread = threading.Thread(target=self._pump, daemon=True)
        self._pump_thread.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def wait_for(self, needle: str, timeout_s: float = 20.0) -> str:
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            self.seen.append(line)
            if needle in line:
                return line
        raise AssertionError(f"child never printed {needle!r}; it printed: {self.seen}")

    def finish(self, timeout_s: float = 20.0) -> int:
        """Wait for the child to exit and close its pipe."""
        code = self.proc.wait(timeout_s)
        self._pump_thread.join(timeout_s)
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        return code
