"""Subprocess services for tests (gateways, simulated engines): started, waited on until
their /health answers, and always stopped, even when the wait fails; and the config of a
whole stack that `hpcserve up` starts (`stack_config`)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import msgspec
from prometheus_client.parser import text_string_to_metric_families

from hpcserve.config import (
    ApiKey,
    BatchConfig,
    EngineHostConfig,
    GatewayConfig,
    Launcher,
    PlatformConfig,
    PoolConfig,
    PoolMgrConfig,
    RouterConfig,
    SlurmConfig,
    dump_config,
    hash_api_key,
    parse_config,
)
from tests.ports import free_port


def wait_healthy(
    url: str,
    proc: subprocess.Popen[bytes],
    timeout_s: float = 60,
    *,
    http: httpx.Client | None = None,
    log: Path | None = None,
) -> None:
    """Until `url`/health answers; fails at once if the process has exited, with the end of
    its `log` (where its stderr goes) when given. `http`: the client to ask with (e.g. one
    trusting a test certificate)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            (http.get if http is not None else httpx.get)(url + "/health", timeout=1)
            return
        except httpx.TransportError:
            assert proc.poll() is None, (
                f"{proc.args!r} exited with {proc.returncode}{_log_tail(log)}"
            )
            assert time.monotonic() < deadline, f"{url} not healthy after {timeout_s:g} s"
            time.sleep(0.1)


def _log_tail(log: Path | None, lines: int = 30) -> str:
    if log is None or not log.exists():
        return ""
    tail = log.read_text(errors="replace").splitlines()[-lines:]
    return "; the end of its stderr:\n" + "\n".join(tail)


def stop(proc: subprocess.Popen[bytes], timeout_s: float = 20) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait(10)


@contextmanager
def service(argv: list[str], url: str, timeout_s: float = 60) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(url, proc, timeout_s)
        yield proc
    finally:
        stop(proc)


def gateway_argv(config_path: object) -> list[str]:
    return [sys.executable, "-m", "hpcserve.cli", "gateway", "--config", str(config_path)]


@contextmanager
def gateways(
    router: RouterConfig,
    gateway: dict[str, Any],
    work: Path,
    *,
    count: int = 2,
    model: str = "tiny",
    timeout_s: float = 30,
) -> Iterator[list[str]]:
    """`count` gateway processes of one router, each from its own config file in `work` (the
    `gateway` settings and a port of its own; `model` a pool of simulated engines), `work`
    their shared state dir and where their stderr goes (gateway<i>.log); yields their URLs
    once every one answers /health; always stopped."""
    procs: list[subprocess.Popen[bytes]] = []
    urls: list[str] = []
    logs = [work / f"gateway{i}.log" for i in range(count)]
    try:
        for i in range(count):
            port = free_port()
            config = parse_config({
                "state_dir": str(work),
                "router": {"registry_bind": router.registry_bind,
                           "routing_bind": router.routing_bind,
                           "lease_s": router.lease_s, "heartbeat_s": router.heartbeat_s,
                           "curve_dir": router.curve_dir,
                           "allow_plain_loopback": router.allow_plain_loopback},
                "gateway": {**gateway, "port": port},
                "pools": [{"name": model, "model_path": "/nonexistent", "engine": "sim"}],
            })  # fmt: skip
            path = work / f"gateway{i}.toml"
            path.write_text(dump_config(config))
            with logs[i].open("wb") as log:
                procs.append(
                    subprocess.Popen(gateway_argv(path), stdout=subprocess.DEVNULL, stderr=log)
                )
            urls.append(f"http://127.0.0.1:{port}")
        for url, proc, log_path in zip(urls, procs, logs, strict=True):
            wait_healthy(url, proc, timeout_s, log=log_path)
        yield urls
    finally:
        for proc in procs:
            stop(proc)


def sim_engine_argv(port: int, model: str, decode_ms: float, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "hpcserve.sim.launch", "--port", str(port),
        "--served-model-name", model, "--decode-ms-per-token", str(decode_ms), *extra,
    ]  # fmt: skip


@contextmanager
def sim_engine(model: str, decode_ms: float = 1, *extra: str) -> Iterator[str]:
    """A simulated engine serving `model` on a free loopback port; yields its URL once its
    /health answers; always stopped."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with service(sim_engine_argv(port, model, decode_ms, *extra), url):
        yield url


def per_worker(text: str, name: str, **labels: str) -> dict[str, float]:
    """In a gateway's /metrics `text`: the sample `name` with `labels`, summed by worker
    (gateway.workers > 1 labels each worker's series)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                worker = sample.labels["worker"]
                out[worker] = out.get(worker, 0.0) + sample.value
    return out


def metrics_headers(config_path: object) -> dict[str, str]:
    """The Authorization header a gateway started with this config asks /metrics for."""
    from hpcserve.config import load_config
    from hpcserve.contracts.engine_token import read_token

    token = read_token(load_config(Path(str(config_path))).metrics_token_path())
    return {"Authorization": f"Bearer {token}"}


def stack_config(
    state: Path,
    *,
    api_keys: Mapping[str, str],
    pools: Sequence[PoolConfig],
    launcher: Launcher = "slurm",
    drain_s: int = 20,
) -> PlatformConfig:
    """The config of a whole test stack in `state`, as `hpcserve up` starts it: router,
    gateway, pool manager and batch runner on free ports (none on a fixed port another stack
    may hold), a 1 s heartbeat and poll, the gateway's `api_keys` (tenant -> key), `pools`;
    engines on loopback, the node cache in <state>/nodecache, job output in <state>/jobs.
    With `launcher` "slurm", jobs go to partition gpu of the two-node cluster `up` starts
    from <state>/slurm (60 min limit); `drain_s`, the engines' drain on stop. No curve_dir:
    CURVE by default in <state>/curve, as loading the written config (or
    `with_default_curve_dir`) gives. What else a test varies it sets on the result with
    `msgspec.structs.replace`."""
    slurm = SlurmConfig(time_limit_min=60, drain_s=drain_s, log_dir=str(state / "jobs"))
    if launcher == "slurm":
        slurm = msgspec.structs.replace(
            slurm, partition="gpu", conf=str(state / "slurm" / "slurm.conf")
        )
    return PlatformConfig(
        state_dir=str(state),
        router=RouterConfig(
            registry_bind=f"tcp://127.0.0.1:{free_port()}",
            routing_bind=f"tcp://127.0.0.1:{free_port()}",
            lease_s=6.0,
            heartbeat_s=1.0,
            metrics_port=free_port(),
        ),
        gateway=GatewayConfig(
            port=free_port(),
            api_keys=[ApiKey(tenant=t, sha256=hash_api_key(k)) for t, k in api_keys.items()],
        ),
        slurm=slurm,
        poolmgr=PoolMgrConfig(launcher=launcher, poll_s=1.0, metrics_port=free_port()),
        batch=BatchConfig(metrics_port=free_port()),
        engine=EngineHostConfig(
            bind_host="127.0.0.1", advertise_host="127.0.0.1", cache_dir=str(state / "nodecache")
        ),
        pools=list(pools),
    )
