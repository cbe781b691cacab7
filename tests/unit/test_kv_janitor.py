"""The storage connector's directory swept by the engines' janitors (engine_launch/
kv_janitor.py): real folders and files laid out as vLLM's ExampleConnector writes them, a
fake clock against their mtimes; the pool's settings from the config to the engine; the
router counting what the sweeps removed."""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from hpcserve.config import ConfigError, parse_config
from hpcserve.contracts import protocol as p
from hpcserve.contracts.engine_args import NIXL_CONNECTOR, kv_transfer_args
from hpcserve.contracts.router_client import list_replicas
from hpcserve.engine_launch.agent import RegistryAgent
from hpcserve.engine_launch.engine import EngineOptions, EngineRunner
from hpcserve.engine_launch.kv_janitor import (
    LOCK_NAME,
    MB,
    TRASH_PREFIX,
    JanitorThread,
    KvJanitor,
    Sweep,
    describe,
)
from hpcserve.poolmgr.spec import build_job_spec
from tests.integration.slurm_helpers import wait_for
from tests.routers import loopback_router_config, running_router

NOW = 1_000_000.0
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


def prompt(root: Path, name: str, age_s: float, layer_bytes: int = 1000) -> Path:
    """A prompt's folder as the connector writes it (one file per layer), written age_s ago."""
    folder = root / name
    folder.mkdir()
    for layer in LAYERS:
        (folder / f"{layer}.safetensors").write_bytes(b"\0" * layer_bytes)
    when = NOW - age_s
    for path in [*folder.iterdir(), folder]:
        os.utime(path, (when, when))
    return folder


def names(root: Path) -> set[str]:
    """The directory's entries but the janitors' lock file."""
    return {entry.name for entry in root.iterdir() if entry.name != LOCK_NAME}


def test_entries_past_the_ttl_go_and_younger_ones_stay(tmp_path: Path) -> None:
    old, young = prompt(tmp_path, "a1", 301), prompt(tmp_path, "b2", 299)
    janitor = KvJanitor(tmp_path, 300, 100 * MB, clock=lambda: NOW)
    sweep = janitor.sweep()
    assert names(tmp_path) == {young.name} and not old.exists()
    assert sweep == Sweep(expired=1, expired_bytes=2000, left=1, left_bytes=2000)
    assert janitor.sweep() == Sweep(left=1, left_bytes=2000)  # nothing more to do


def test_a_file_written_late_into_an_old_folder_keeps_it(tmp_path: Path) -> None:
    folder = prompt(tmp_path, "a1", 400)
    late = folder / "model.layers.9.self_attn.attn.safetensors"
    late.write_bytes(b"x")
    os.utime(late, (NOW - 10, NOW - 10))  # the age is the newest write's
    assert KvJanitor(tmp_path, 300, MB, clock=lambda: NOW).sweep().removed == 0
    assert folder.exists()


@pytest.mark.parametrize(
    ("ages", "cap_bytes", "removed", "left"),
    [
        # oldest first, until what is left fits
        ((200, 100, 50), 4000, {"p200"}, {"p100", "p50"}),
        ((200, 100, 50), 2000, {"p200", "p100"}, {"p50"}),
        ((200, 100, 50), 6000, set(), {"p200", "p100", "p50"}),
        # never one younger than the handoff (30 s): the cap waits for it instead
        ((200, 20, 10), 1000, {"p200"}, {"p20", "p10"}),
        ((25, 20, 10), 1, set(), {"p25", "p20", "p10"}),
    ],
)
def test_the_byte_cap_removes_the_oldest_but_never_a_fresh_entry(
    tmp_path: Path, ages: tuple[int, ...], cap_bytes: int, removed: set[str], left: set[str]
) -> None:
    for age in ages:
        prompt(tmp_path, f"p{age}", age)  # 2000 bytes each
    sweep = KvJanitor(tmp_path, 300, cap_bytes, clock=lambda: NOW).sweep()
    assert names(tmp_path) == left
    assert (sweep.over_cap, sweep.over_cap_bytes) == (len(removed), 2000 * len(removed))
    assert (sweep.expired, sweep.left) == (0, len(left))


def test_leftovers_of_an_interrupted_removal_go_and_odd_entries_are_handled(
    tmp_path: Path,
) -> None:
    leftover = prompt(tmp_path, f"{TRASH_PREFIX}abc-1234", 1)  # a janitor killed mid-delete
    stray = tmp_path / "stray.txt"
    stray.write_bytes(b"12345")
    os.utime(stray, (NOW - 1000, NOW - 1000))
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "nowhere")
    os.utime(link, (NOW - 1000, NOW - 1000), follow_symlinks=False)
    sweep = KvJanitor(tmp_path, 300, MB, clock=lambda: NOW).sweep()
    assert names(tmp_path) == set() and not leftover.exists()
    assert sweep.expired == 2  # the stray file and the link (not its target)


def test_a_missing_directory_is_nothing_to_sweep(tmp_path: Path) -> None:
    assert KvJanitor(tmp_path / "absent", 300, MB, clock=lambda: NOW).sweep() == Sweep()


def test_one_janitor_sweeps_at_a_time(tmp_path: Path) -> None:
    """Replicas share the directory: one holding the lock, the others skip their round."""
    for i in range(3):
        prompt(tmp_path, f"e{i}", 400)
    janitor = KvJanitor(tmp_path, 300, MB, clock=lambda: NOW)
    held = os.open(tmp_path / LOCK_NAME, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another replica's sweep
        assert janitor.sweep() == Sweep() and len(names(tmp_path)) == 3
    finally:
        os.close(held)
    assert janitor.sweep().expired == 3 and names(tmp_path) == set()


def test_a_sweep_that_removed_something_is_logged_once_and_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    prompt(tmp_path, "old", 400)
    clock = [NOW]
    thread = JanitorThread(KvJanitor(tmp_path, 300, MB, clock=lambda: clock[0]), 0.01)
    with caplog.at_level(logging.INFO, logger="hpcserve.engine_launch.kv_janitor"):
        thread.start()
        try:
            reports = wait_for("a sweep's report", thread.reports)
        finally:
            thread.stop()
    assert reports == [Sweep(expired=1, expired_bytes=2000)]
    removed = [r.message for r in caplog.records if ": removed " in r.message]
    assert removed == [describe(tmp_path, reports[0], 300, MB)]  # later sweeps: nothing
    assert "removed 1 entries (0.0 MB): 1 older than 300s, 0 over the 1 MB cap" in removed[0]


def test_the_interval_is_a_quarter_of_the_ttl_at_most_30_s() -> None:
    assert JanitorThread.interval_for(60) == 15 and JanitorThread.interval_for(3600) == 30


# --- the pool's settings ------------------------------------------------------------------

CPU = {"model_path": "/m", "engine": "vllm-cpu", "served_model_name": "chat"}
PREFILL = {**CPU, "name": "chat-prefill", "role": "prefill", "kv_transfer_dir": "/shared/kv"}
DECODE = {**CPU, "name": "chat-decode", "role": "decode", "kv_transfer_dir": "/shared/kv"}


@pytest.mark.parametrize(
    ("pools", "error"),
    [
        ([{**PREFILL, "kv_transfer_ttl_s": 10}, DECODE], r"pools\[0\]\.kv_transfer_ttl_s: .*>= 60"),
        ([{**PREFILL, "kv_transfer_max_mb": 0}, DECODE], r"pools\[0\]\.kv_transfer_max_mb: .*>= 1"),
        (
            [PREFILL, {**DECODE, "kv_transfer_ttl_s": 600}],
            r"pools\[0\]\.kv_transfer_ttl_s: 300.0 differs from its decode pool",
        ),
        (
            [{**CPU, "name": "chat", "kv_transfer_max_mb": 10}],
            r"pools\[0\]\.kv_transfer_max_mb: only a prefill or decode pool",
        ),
    ],
)
def test_the_sweep_settings_are_validated(pools, error):  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=error):
        parse_config({"pools": pools})


def test_the_settings_reach_the_engines_of_a_storage_pair_only():
    config = parse_config(
        {"pools": [{**PREFILL, "kv_transfer_ttl_s": 120}, {**DECODE, "kv_transfer_ttl_s": 120}]}
    )
    for pool in config.pools:
        env = dict(build_job_spec(config, pool).env)
        assert env["HPCSERVE_KV_TRANSFER_TTL_S"] == "120"
        assert env["HPCSERVE_KV_TRANSFER_MAX_MB"] == "4096"
    gpu = {"model_path": "/m", "engine": "vllm", "served_model_name": "big"}
    nixl = parse_config(
        {
            "pools": [
                {**gpu, "name": "b-p", "role": "prefill"},
                {**gpu, "name": "b-d", "role": "decode"},
            ]
        }
    )
    assert "HPCSERVE_KV_TRANSFER_TTL_S" not in dict(build_job_spec(nixl, nixl.pools[0]).env)


@pytest.mark.parametrize(
    ("role", "engine", "sweeps"),
    [
        ("prefill", "vllm-cpu", True),
        ("decode", "vllm-cpu", True),
        ("prefill", "vllm", False),  # NIXL: no files
        ("interactive", "vllm-cpu", False),
    ],
)
def test_which_engines_run_a_janitor(tmp_path: Path, role: str, engine: str, sweeps: bool):
    args = kv_transfer_args(role, engine, [], str(tmp_path / "kv"))
    options = EngineOptions(
        "/m", "m", "tcp://127.0.0.1:1", engine=engine, role=role, extra_args=tuple(args),
        kv_transfer_ttl_s=120, kv_transfer_max_mb=7,
    )  # fmt: skip
    runner = EngineRunner(options)
    try:
        janitor = runner.kv_janitor
        assert (janitor is not None) == sweeps
        if janitor is not None:
            assert janitor.janitor.root == tmp_path / "kv"
            assert (janitor.janitor.ttl_s, janitor.janitor.max_bytes) == (120, 7 * MB)
            assert janitor.interval_s == 30
        else:
            assert runner.kv_connector in ("", NIXL_CONNECTOR)
    finally:
        runner.release_ports()


# --- the router's count ---------------------------------------------------------------------


def test_the_router_counts_what_the_sweeps_removed_by_pool_and_reason() -> None:
    prom = CollectorRegistry()
    config = loopback_router_config(lease_s=600.0)
    with running_router(config, metrics_registry=prom):
        reg = p.Register("r1", "m", "http://127.0.0.1:1", pool="chat-decode", role="decode")
        agent = RegistryAgent(config.registry_bind, reg)
        try:
            agent.register()
            wait_for("the replica", lambda: len(list_replicas(config.routing_bind)) == 1)

            def count(name: str, reason: str) -> float:
                labels = {"pool": "chat-decode", "reason": reason}
                return prom.get_sample_value(f"hpcserve_router_{name}_total", labels) or 0

            agent.send(p.KvCleanupReport("r1", expired=2, expired_bytes=300, left_bytes=10))
            agent.send(p.KvCleanupReport("r1", over_cap=1, over_cap_bytes=50))
            wait_for("both reports", lambda: count("kv_transfer_removed", "cap") == 1)
            assert count("kv_transfer_removed", "ttl") == 2
            assert count("kv_transfer_removed_bytes", "ttl") == 300
            assert count("kv_transfer_removed_bytes", "cap") == 50
        finally:
            agent.close()
    back = p.registry_message_decoder.decode(p.encode(p.KvCleanupReport("r", expired=1)))
    assert back == p.KvCleanupReport("r", expired=1)
