"""Helpers for tests against a real Slurm cluster."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from hpcserve.config import PlatformConfig, parse_config
from hpcserve.localslurm import LocalSlurm, LocalSlurmSpec, preflight
from hpcserve.port_reservations import is_reserved

if TYPE_CHECKING:
    from hpcserve.router.server import RouterServer

T = TypeVar("T")


def _ports_free(first: int, count: int = 3) -> bool:
    """Bindable now, and reserved by no engine that will bind them later (hpcserve.ports
    draws engines' ports from a range that includes these blocks)."""
    for port in range(first, first + count):
        if is_reserved(port):
            return False
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                return False
    return True


_blocks_handed_out: set[int] = set()


def free_port_block() -> int:
    """The first of 3 free ports for a cluster's daemons (tests/ports.py keeps out of this
    range), never one handed out before by this process: a cluster that has not bound its
    ports yet looks free."""
    for first in range(26817, 27817, 10):
        if first not in _blocks_handed_out and _ports_free(first):
            _blocks_handed_out.add(first)
            return first
    raise AssertionError("no free block of 3 ports in 26817..27817")


# How long a job's processes may take to go once it has ended: Slurm's KillWait (10 s,
# hpcserve/localslurm.py) between its SIGTERM and SIGKILL, plus what a loaded 2-core machine
# adds. Waited for with wait_for: it returns as soon as they are gone.
PROCESSES_GONE_S = 45


# A state change in the cluster or a service that is seconds here: what a loaded 2-core
# machine may stretch it to. Waited for with wait_for: it returns as soon as it happened.
STATE_CHANGE_S = 60


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = STATE_CHANGE_S) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)


def conf_processes(conf: Path) -> list[str]:
    """Live processes of the cluster whose config is `conf`: its daemons and job scripts
    (the path of its state dir in their command line) and anything that has its SLURM_CONF
    in the environment (slurmstepd, job processes)."""
    found = []
    env_entry = f"SLURM_CONF={conf}".encode()
    for pid in (p for p in Path("/proc").iterdir() if p.name.isdigit()):
        try:
            argv = (pid / "cmdline").read_bytes().split(b"\0")
            environ = (pid / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        line = " ".join(a.decode(errors="replace") for a in argv if a)
        if str(conf.parent) in line or env_entry in environ:
            found.append(f"{pid.name}: {line}")
    return found


def running_cluster(state_dir: Path, **spec_args: Any) -> Iterator[LocalSlurm]:
    """A two-node cluster started in `state_dir`, stopped after, leaving no process behind;
    `spec_args`: more LocalSlurmSpec settings."""
    assert preflight() == [], preflight()
    spec = LocalSlurmSpec(state_dir=state_dir, ctld_port=free_port_block(), **spec_args)
    assert spec.ctld_port != 16817
    local = LocalSlurm(spec)
    local.start()
    try:
        yield local
    finally:
        local.stop()
    assert conf_processes(local.conf_path) == []


def cluster_config(
    cluster: LocalSlurm,
    router: RouterServer,
    tmp_path: Path,
    prefix: str,
    pool: dict[str, Any],
    **sections: dict[str, Any],
) -> PlatformConfig:
    """A platform config for one pool "p" on the test cluster and router; `sections`
    override keys of a top-level section (e.g. slurm={"time_limit_min": 2})."""
    data: dict[str, Any] = {
        "state_dir": str(tmp_path),
        "router": {
            "registry_bind": router.config.registry_bind,
            "routing_bind": router.config.routing_bind,
            "lease_s": router.config.lease_s,
            "heartbeat_s": router.config.heartbeat_s,
            "allow_plain_loopback": True,  # the test's own router in this process: plain
        },
        "slurm": {
            "conf": str(cluster.conf_path),
            "log_dir": str(tmp_path / "jobs"),
            "partition": "gpu",
            "time_limit_min": 10,
            "drain_s": 10,
        },
        "poolmgr": {
            "poll_s": 0.5,
            "min_submit_interval_s": 0.5,
            "job_name_prefix": prefix,
            "handover_lead_s": 0,
        },
        "engine": {"bind_host": "127.0.0.1", "advertise_host": "127.0.0.1"},
        "pools": [{"name": "p", "replicas": 1, **pool}],
    }
    for name, values in sections.items():
        data[name] = data[name] | values
    return parse_config(data)
