"""What issue 18's per-request work costs, in process on one core: the gateway's audit line
(request id, encode, one write) and the engine token guard's check inside vLLM.

    taskset -c 0 .venv/bin/python bench/security_costs.py [--calls 100000]

Prints microseconds per request, min and median of 5 runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hpcserve.config import ApiKey, GatewayConfig, hash_api_key  # noqa: E402
from hpcserve.contracts.engine_token import EngineTokenGuard, bearer  # noqa: E402
from hpcserve.gateway.app import Gateway  # noqa: E402


def per_call_us(step: Callable[[], None], calls: int) -> tuple[float, float]:
    runs = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(calls):
            step()
        runs.append((time.perf_counter() - started) / calls * 1e6)
    return min(runs), statistics.median(runs)


class _Relayed:
    model, replica_id, prompt, completion = "llama-8b", "llama-8b-j4711-a1b2c3", 1234, 56


def audit_step(destination: str) -> tuple[Callable[[], None], Gateway]:
    config = GatewayConfig(
        api_keys=[ApiKey(tenant="team", sha256=hash_api_key("sk-bench"))], audit_log=destination
    )
    gateway = Gateway(config, routing_endpoint="tcp://127.0.0.1:9", configured_models={"m"})
    tenant = gateway.keys.tenant_for("Bearer sk-bench")
    scope = {
        "type": "http", "method": "POST", "path": "/v1/chat/completions",
        "client": ("10.1.2.3", 40000), "headers": [], "hpcserve.key": tenant,
        "hpcserve.tenant": tenant.name, "hpcserve.model": "llama-8b",
    }  # fmt: skip
    exchange = _Relayed()

    def step() -> None:
        scope["hpcserve.request_id"] = os.urandom(12).hex()  # as the relay path makes one
        gateway.audit_request(scope, 200, exchange)  # type: ignore[arg-type]

    return step, gateway


def guard_step() -> Callable[[], None]:
    token = "t" * 43
    guard = EngineTokenGuard(lambda *a: None, token=token)  # type: ignore[arg-type,return-value]
    scope = {
        "type": "http", "method": "POST", "path": "/v1/chat/completions", "root_path": "",
        "headers": [(b"host", b"n1:8000"), (b"content-type", b"application/json"),
                    (b"x-vllm-priority", b"0"), (b"x-request-id", b"0123456789abcdef01234567"),
                    (b"authorization", bearer(token).encode()), (b"content-length", b"1300")],
    }  # fmt: skip
    return lambda: guard.allowed(scope) or None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        for name, destination in (("audit line to a file", f"{work}/audit.log"),
                                  ("audit line to a discarding file", f"{work}/null")):  # fmt: skip
            if destination.endswith("null"):
                os.symlink("/dev/null", destination)
            step, gateway = audit_step(destination)
            low, mid = per_call_us(step, args.calls)
            gateway.audit.close()
            print(f"{name}: {low:.2f} us per request (median {mid:.2f})")
    low, mid = per_call_us(guard_step(), args.calls)
    print(f"engine token guard: {low:.2f} us per request (median {mid:.2f})")


if __name__ == "__main__":
    main()
