"""Engine checks: vLLM's /health is not enough (its API server answers while the engine
core is dead or stopped), so the engine must really produce a token, and its token
counters must move while it has running requests.

- GenerationProbe: a one-token greedy request with a deadline. A model that does not
  generate (embedding, reranking) is probed with the smallest request it serves; which
  kind the engine takes is learnt on the first answer.
- TokenProgress (pure): fed vLLM's /metrics text; a finding when requests run and the
  prompt + generation token counters have not moved for `stall_s`.
- busy_not_broken (pure): a probe that timed out behind a queue while tokens flow is an
  overloaded engine, not a broken one (taking it out of routing would fail its clients).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from hpcserve.contracts.engine_token import auth_headers

# (path, body) per kind, tried in this order until one is not refused with a 4xx.
_PROBES = (
    ("/v1/completions", {"prompt": "ok", "max_tokens": 1, "temperature": 0}),
    ("/v1/embeddings", {"input": "ok"}),
    ("/rerank", {"query": "ok", "documents": ["ok"]}),
)


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    detail: str  # why not, e.g. "no answer within 5s"; when ok, why it could not probe
    seconds: float
    timed_out: bool = False  # no answer within the deadline (not an error answer)


class GenerationProbe:
    def __init__(self, base_url: str, model: str, *, engine_token: str = "") -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        # The deployment's engine token (contracts/engine_token.py): engines refuse others.
        self.headers = {"Content-Type": "application/json", **auth_headers(engine_token)}
        self.kind: int | None = None  # index into _PROBES once known

    def run(self, deadline_s: float) -> ProbeResult:
        started = time.monotonic()
        kinds = [self.kind] if self.kind is not None else list(range(len(_PROBES)))
        refused = ""
        for kind in kinds:
            path, body = _PROBES[kind]
            left = deadline_s - (time.monotonic() - started)
            if left <= 0:
                break
            status, error = self._post(path, {"model": self.model, **body}, left)
            spent = time.monotonic() - started
            if status == 200:
                self.kind = kind
                return ProbeResult(True, "", spent)
            if status is not None and 400 <= status < 500 and self.kind is None:
                refused = f"{path} answered {status}"
                continue  # this model does not serve that kind of request
            if status is None and error.startswith("no answer"):
                return ProbeResult(False, f"no answer within {deadline_s:g}s", spent, True)
            return ProbeResult(False, error, spent)
        spent = time.monotonic() - started
        if refused and spent < deadline_s:
            # It answered, so its API is up, but no probe fits this model: only the token
            # counters can tell whether its core works.
            return ProbeResult(True, f"cannot probe: engine refused every probe ({refused})", spent)
        return ProbeResult(False, f"no answer within {deadline_s:g}s", spent, True)

    def _post(self, path: str, body: dict[str, object], timeout_s: float) -> tuple[int | None, str]:
        request = urllib.request.Request(
            self.base_url + path,
            data=json.dumps(body).encode(),
            headers=self.headers,
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as resp:
                resp.read()
                return resp.status, ""
        except urllib.error.HTTPError as err:
            return err.code, f"{path} answered {err.code}"
        except TimeoutError:
            return None, f"no answer within {timeout_s:g}s"
        except (urllib.error.URLError, OSError) as err:
            reason = getattr(err, "reason", err)
            if isinstance(reason, TimeoutError):
                return None, f"no answer within {timeout_s:g}s"
            return None, f"{path} unreachable: {reason}"


@dataclass(frozen=True)
class Counters:
    tokens: float  # prompt + generation tokens, summed over label sets
    running: int
    waiting: int = 0


def parse_counters(metrics_text: str) -> Counters:
    tokens = 0.0
    running = 0.0
    waiting = 0.0
    for line in metrics_text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        if name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
            tokens += value
        elif name == "vllm:num_requests_running":
            running += value
        elif name == "vllm:num_requests_waiting":
            waiting += value
    return Counters(tokens=tokens, running=int(running), waiting=int(waiting))


def busy_not_broken(before: Counters | None, after: Counters | None) -> bool:
    """Whether a probe that timed out between these two readings waited behind a queue of
    an engine that makes progress: requests wait, and the token counters moved. A hung
    engine's counters do not move (TokenProgress reports it after stall_s)."""
    if before is None or after is None:
        return False
    return after.waiting > 0 and after.tokens > before.tokens


class TokenProgress:
    """Stall detection from successive /metrics readings (the caller passes the clock)."""

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s
        self._tokens: float | None = None
        self._moved_at: float | None = None

    def update(self, counters: Counters, now: float) -> str:
        """ "" while fine; else what is wrong, e.g. "no tokens for 31s with 2 running"."""
        moved = self._tokens is None or counters.tokens != self._tokens
        self._tokens = counters.tokens
        if moved or counters.running == 0 or self._moved_at is None:
            self._moved_at = now
            return ""
        still = now - self._moved_at
        if still >= self.stall_s:
            return f"no tokens for {still:.0f}s with {counters.running} running"
        return ""
