"""The doctor's gathering layer on real files, sockets, the fake NVML and the registry's
manifests; and the doctor job's script and sbatch options."""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
from pathlib import Path

import pytest

from hpcserve.config import HealthConfig, parse_config
from hpcserve.doctor import checks
from hpcserve.doctor.gather import (
    ModelToCheck,
    allocated_gpus,
    file_facts,
    gather_cache,
    gather_clock,
    gather_endpoint,
    gather_model,
    gather_nvml,
    models_to_check,
    mount_of,
    needed_cache_bytes,
    nvidia_hardware,
    parse_chrony_tracking,
)
from hpcserve.doctor.node_job import doctor_job_args, doctor_script
from hpcserve.modelcache.manifest import build_manifest
from hpcserve.modelcache.registry import Registry

MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
30 22 0:40 / /home rw,relatime shared:20 - nfs4 fs1:/home rw,vers=4.2
31 22 259:1 / /local rw,relatime shared:21 - xfs /dev/nvme0n1 rw
32 31 0:50 / /local/scratch\\040space rw - tmpfs tmpfs rw
"""


@pytest.mark.parametrize(
    ("path", "mount"),
    [
        ("/home/svc/cache", ("/home", "nfs4")),
        ("/local/cache", ("/local", "xfs")),
        ("/localx", ("/", "ext4")),
        ("/local/scratch space/c", ("/local/scratch space", "tmpfs")),
        ("/", ("/", "ext4")),
    ],
)
def test_mount_of(path: str, mount: tuple[str, str]) -> None:
    assert mount_of(path, MOUNTINFO) == mount


@pytest.mark.parametrize(
    ("text", "offset"),
    [
        ("System time     : 0.000012345 seconds slow of NTP time\n", -0.000012345),
        ("System time     : 1.5 seconds fast of NTP time\n", 1.5),
        ("506 Cannot talk to daemon\n", None),
    ],
)
def test_parse_chrony_tracking(text: str, offset: float | None) -> None:
    assert parse_chrony_tracking(text) == offset


@pytest.mark.parametrize(
    ("env", "count"),
    [
        ({"SLURM_GPUS_ON_NODE": "4", "CUDA_VISIBLE_DEVICES": "0,1"}, 4),
        ({"SLURM_JOB_GPUS": "2,3"}, 2),
        ({"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b,GPU-c"}, 3),
        ({}, 0),
    ],
)
def test_allocated_gpus(env: dict[str, str], count: int) -> None:
    assert allocated_gpus(env) == count


def test_nvidia_hardware_from_the_pci_bus(tmp_path: Path) -> None:
    def device(name: str, vendor: str, klass: str) -> None:
        d = tmp_path / "sys/bus/pci/devices" / name
        d.mkdir(parents=True)
        (d / "vendor").write_text(vendor + "\n")
        (d / "class").write_text(klass + "\n")

    device("0000:00:01.0", "0x1af4", "0x020000")
    device("0000:00:02.0", "0x10de", "0x068000")  # an NVIDIA bridge, not a GPU
    assert not nvidia_hardware(str(tmp_path))
    device("0000:3b:00.0", "0x10de", "0x030200")  # 3D controller
    assert nvidia_hardware(str(tmp_path))


def test_clock_is_read_without_systemd() -> None:
    clock = gather_clock()
    assert clock.source == "adjtimex"
    assert clock.synchronized is not None and clock.max_error_s is not None
    assert checks.check_clock(clock).status in ("ok", "warn")


def test_cache_on_a_local_disk_and_unwritable(tmp_path: Path) -> None:
    facts = gather_cache(str(tmp_path / "not-yet" / "cache"))  # made by the first staging
    assert facts.writable and not facts.exists and facts.free_bytes > 0 and facts.fstype
    assert (
        checks.check_cache(
            parse_config({"engine": {"cache_dir": facts.path}}), facts, 1, "node n1"
        ).status
        == "ok"
        or facts.fstype in checks.NETWORK_FS
    )
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert "not a directory" in gather_cache(str(blocker)).error


def test_cache_that_the_service_account_cannot_write() -> None:
    """Probed as an unprivileged user (root ignores permission bits)."""
    from tests.unprivileged import run_python_as

    base = Path(tempfile.mkdtemp(prefix="doctor-cache-", dir="/tmp"))
    try:
        base.chmod(0o755)
        locked = base / "locked"
        locked.mkdir(mode=0o555)
        locked.chmod(0o555)
        code = (
            "import sys\nfrom hpcserve.doctor.gather import gather_cache\n"
            "print(gather_cache(sys.argv[1]).writable)"
        )
        probe = run_python_as(code, str(locked))
        assert probe.stdout.strip() == "False", probe.stderr
    finally:
        shutil.rmtree(base)


def test_endpoint_reached_refused_loopback_and_unresolvable() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        ok = gather_endpoint("k", f"tcp://127.0.0.1:{port}", here="ctl", control_host="ctl")
        assert ok.ok
    refused = gather_endpoint("k", f"tcp://127.0.0.1:{port}", here="ctl", control_host="ctl")
    assert (refused.ok, refused.problem) == (False, "refused")
    far = gather_endpoint("k", f"tcp://127.0.0.1:{port}", here="n1", control_host="ctl")
    assert (far.ok, far.problem) == (False, "loopback")
    lost = gather_endpoint("k", "tcp://no-such-host.invalid:5560", here="n1", control_host="ctl")
    assert (lost.ok, lost.problem) == (False, "resolve")
    ipc = gather_endpoint("k", "ipc:///tmp/x.sock", here="n1", control_host="ctl")
    assert ipc.problem == "ipc"


def test_file_facts_of_a_loose_secret(tmp_path: Path) -> None:
    secret = tmp_path / "router.key_secret"
    secret.write_text("k")
    secret.chmod(0o644)
    facts = file_facts(str(secret), os.geteuid())
    assert facts.exists and facts.readable and facts.mode & 0o777 == 0o644
    assert not file_facts(str(tmp_path / "gone"), os.geteuid()).exists


def test_nvml_through_the_fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = tmp_path / "nvml.json"
    state.write_text(json.dumps({"gpus": [{"name": "Fake H200"}, {"uuid": "GPU-b"}]}))
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "2")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    facts = gather_nvml(str(state), HealthConfig())
    assert facts.loaded and facts.allocated == 2 and not facts.findings
    assert facts.gpus == ["0 Fake H200 GPU-fake-0", "1 Fake GPU GPU-b"]
    state.write_text(json.dumps({"gpus": [{}, {"lost": True}]}))
    lost = gather_nvml(str(state), HealthConfig())
    assert any("gpu 1 lost" in f for f in lost.findings), lost
    result = checks.check_nvml(parse_config({}), lost, "node n1")
    assert result.status == "fail" and "GPU health" in result.detail


def test_models_sizes_on_the_node_and_digests_on_the_control_node(tmp_path: Path) -> None:
    source = tmp_path / "m"
    source.mkdir()
    (source / "config.json").write_text("{}")
    (source / "model.safetensors").write_bytes(b"w" * 1000)
    state = tmp_path / "state"
    with Registry(state / "registry.sqlite3") as registry:
        registry.add_version("m", str(source), build_manifest(source))
    cfg = parse_config({"state_dir": str(state), "engine": {"cache_dir": str(tmp_path / "c")},
                        "pools": [{"name": "p", "model_ref": "m@1", "engine": "vllm-cpu"},
                                  {"name": "q", "model_ref": "m@7", "engine": "vllm-cpu"}]})  # fmt: skip
    wanted, broken = models_to_check(cfg)
    assert [m.ref for m in wanted] == ["m@1"] and needed_cache_bytes(wanted) == 1002
    assert "m@7" in broken[0].ref and broken[0].error
    good = gather_model(wanted[0], digests=True, config=cfg)
    assert good.digests_checked and not good.problems and good.files == 2
    # Same size, other bytes: only the digest sees it.
    (source / "model.safetensors").write_bytes(b"x" * 1000)
    assert not gather_model(wanted[0], digests=False, config=None).problems
    bad = gather_model(wanted[0], digests=True, config=cfg)
    assert (
        bad.problems == [bad.problems[0]]
        and "model.safetensors: digest mismatch" in bad.problems[0]
    )
    (source / "config.json").unlink()
    assert gather_model(wanted[0], digests=False, config=None).problems == ["config.json: missing"]
    plain = gather_model(ModelToCheck("r", str(source)), digests=True, config=cfg)
    assert plain.problems == ["no config.json (not a Hugging Face model)"]
    gone = gather_model(ModelToCheck("r", str(tmp_path / "gone")), digests=True, config=cfg)
    assert "not a readable directory" in gone.error


def test_the_doctor_job_looks_like_the_largest_pool(tmp_path: Path) -> None:
    cfg = parse_config({
        "state_dir": str(tmp_path),
        "slurm": {"partition": "gpu", "account": "ml", "qos": "high", "extra_args": ["--exclusive"]},
        "engine": {"launch_prefix": ["apptainer", "exec", "--nv", "/img/hs.sif"],
                   "modules": ["cuda/12.4"], "hpcserve_bin": "hpcserve"},
        "pools": [{"name": "small", "model_path": "/m", "engine": "vllm-cpu"},
                  {"name": "big", "model_path": "/m", "gpus_per_replica": 8,
                   "tensor_parallel": 8}],
    })  # fmt: skip
    args = doctor_job_args(cfg, "/s/job-%j.out", "n3")
    assert args == [
        "--job-name=hpcserve-doctor", "--ntasks=1", "--output=/s/job-%j.out", "--nodes=1",
        "--partition=gpu", "--account=ml", "--qos=high", "--gres=gpu:8", "--exclusive",
        "--time=10", "--nodelist=n3",
    ]  # fmt: skip
    script = doctor_script(cfg, "/venv/bin/hpcserve", Path("/s/req.json"), Path("/s/res.json"))
    assert script.startswith("#!/bin/bash\n")
    assert "module load cuda/12.4 || exit 1\n" in script
    assert script.endswith(
        "exec apptainer exec --nv /img/hs.sif hpcserve doctor --node-request /s/req.json "
        "--node-result /s/res.json\n"
    )


def test_with_the_local_launcher_the_node_checks_run_on_this_host(tmp_path: Path) -> None:
    from hpcserve.doctor.run import host_name, run_doctor

    cfg = parse_config({
        "state_dir": str(tmp_path / "state"),
        "poolmgr": {"launcher": "local"},
        "router": {"registry_bind": "tcp://127.0.0.1:9", "allow_plain_loopback": True},
        "engine": {"cache_dir": str(tmp_path / "cache")},
        "pools": [{"name": "p", "model_path": str(tmp_path), "engine": "vllm-cpu"}],
    })  # fmt: skip
    (tmp_path / "config.json").write_text("{}")
    said: list[str] = []
    results = run_doctor(cfg, service_user="root", quick=True, node_targets=[""],
                         node_timeout_s=60, hpcserve_bin="hpcserve", say=said.append)  # fmt: skip
    status = {(r.host, r.check): r.status for r in results}
    here = f"node {host_name()}"
    assert [status[("control", c)] for c in ("slurm", "slurm_access", "gres")] == ["skip"] * 3
    assert status[(here, "cache_dir")] == "ok" and status[(here, "vllm_import")] == "ok"
    assert status[(here, "clock_skew")] == "skip" and status[(here, "nvml")] == "skip"
    # Nothing listens on the registry's port: named, with the fix.
    (endpoint,) = [r for r in results if r.check == "router_endpoint"]
    assert endpoint.status == "fail" and "start the router" in endpoint.fix
    assert said == ["poolmgr.launcher is 'local': running the node checks on this host"]
