"""`hpcserve doctor`'s checks, a table per check: the facts that pass, and each failure with
the fix text it gives (doctor/checks.py is pure: facts and config in, results out)."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

import pytest

from hpcserve.config import PlatformConfig, parse_config
from hpcserve.doctor import checks
from hpcserve.doctor.node_job import _times
from hpcserve.doctor.report import (
    exit_status,
    format_line,
    format_report,
    report_json,
    write_metrics,
)
from hpcserve.doctor.types import (
    CacheFacts,
    CheckResult,
    ClockFacts,
    EndpointFacts,
    FileFacts,
    KeyFacts,
    ModelFacts,
    NodeFacts,
    NvmlFacts,
    PrivateNetFacts,
    SlurmFacts,
    SlurmTimes,
    SubmitProbe,
    VllmFacts,
)
from hpcserve.slurm.parse import JobState, SlurmJob, SlurmNode

NODE = "node n1"


def config(*pools: dict[str, Any], **sections: Any) -> PlatformConfig:
    data: dict[str, Any] = {
        "state_dir": "/srv/hs",
        "slurm": {"partition": "gpu"},
        "pools": list(pools) or [{"name": "p", "model_path": "/m", "engine": "vllm-cpu"}],
    }
    data.update(sections)
    return parse_config(data)


GPU_POOL = {"name": "llm", "model_path": "/m", "engine": "vllm", "gpus_per_replica": 4,
            "tensor_parallel": 4}  # fmt: skip
CPU_POOL = {"name": "p", "model_path": "/m", "engine": "vllm-cpu"}


def node(name: str, gres: str = "gpu:4", state: tuple[str, ...] = ("IDLE",)) -> SlurmNode:
    return SlurmNode(name=name, state=list(state), reason="", gres=gres, gres_used="",
                     cpus=8, alloc_cpus=0, partitions=["gpu"])  # fmt: skip


def one(results: list[CheckResult] | CheckResult) -> CheckResult:
    if isinstance(results, CheckResult):
        return results
    assert len(results) == 1, results
    return results[0]


def expect(result: CheckResult, status: str, detail: str, fix: str = "") -> None:
    assert result.status == status, result
    assert detail in result.detail, result
    if fix:
        assert fix in result.fix, result
    if status == "fail":
        assert result.fix, f"a failure without a fix: {result}"


# -- slurm ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("facts", "status", "detail", "fix"),
    [
        (SlurmFacts(True, release="22.05.8", nodes=[node("n1"), node("n2")]), "ok",
         "Slurm 22.05.8, 2 node(s)", ""),
        (SlurmFacts(True, release="24.11", nodes=[node("n1", state=("DOWN",))]), "ok",
         "down: n1", ""),
        (SlurmFacts(False, error="Unable to contact slurm controller"), "fail",
         "Unable to contact slurm controller", "scontrol ping"),
    ],
)  # fmt: skip
def test_slurm(facts: SlurmFacts, status: str, detail: str, fix: str) -> None:
    expect(checks.check_slurm(facts, "/etc/slurm/slurm.conf"), status, detail, fix)


def probe(ok: bool, message: str, **kw: Any) -> SubmitProbe:
    fields = {"pool": "p", "partition": "gpu", "account": "ml", "qos": "", "gpus": 1, "nodes": 1}
    return SubmitProbe(ok=ok, message=message, **(fields | kw))


@pytest.mark.parametrize(
    ("facts", "status", "detail", "fix"),
    [
        (probe(True, "Job 3 to start at 2026-12-01T22:00:00 using 1 processors on nodes n1 in "
               "partition gpu"), "ok", "on nodes n1", ""),
        (probe(False, "error: Batch job submission failed: Invalid account or "
               "account/partition combination specified"), "fail", "Invalid account",
         "sacctmgr add user <service user> account=ml"),
        (probe(False, "error: Batch job submission failed: Job has invalid qos", qos="gold"),
         "fail", "invalid qos", "set qos+=gold"),
        (probe(False, "error: invalid partition specified: nope", partition="nope"), "fail",
         "invalid partition", "sinfo -s"),
        (probe(False, "error: Batch job submission failed: Requested node configuration is "
               "not available", gpus=16), "fail", "Requested node configuration",
         "16 GPU(s) x 1 node(s): see the gres check"),
        (probe(False, "error: Batch job submission failed: Requested time limit is invalid "
               "(missing or exceeds some limit)"), "fail", "time limit", "MaxTime"),
        (probe(False, "error: something new"), "fail", "something new", "sbatch --test-only"),
    ],
)  # fmt: skip
def test_slurm_access(facts: SubmitProbe, status: str, detail: str, fix: str) -> None:
    expect(one(checks.check_slurm_access([facts])), status, detail, fix)


@pytest.mark.parametrize(
    ("pools", "nodes", "status", "detail", "fix"),
    [
        ([GPU_POOL], [node("n1"), node("n2", "gpu:h100:8(S:0-1)")], "ok", "2 node(s) fit", ""),
        ([GPU_POOL], [node("n1", "gpu:2"), node("n2", "")], "fail",
         "nodes there: n1 (gpu:2), n2 (no gres)", "Gres=gpu:<n>"),
        ([GPU_POOL], [node("n1", state=("DOWN",))], "fail", "n1 (gpu:4)",
         "pools[0].gpus_per_replica"),
        ([GPU_POOL], [node("n1", state=("IDLE", "DRAIN"))], "warn", "only drained nodes fit",
         "hpcserve resume-node"),
        ([CPU_POOL | {"gpus_per_replica": 0}], [node("n1")], "skip", "no pool asks for GPUs", ""),
    ],
)  # fmt: skip
def test_gres(
    pools: list[dict[str, Any]], nodes: list[SlurmNode], status: str, detail: str, fix: str
) -> None:
    facts = SlurmFacts(True, release="22.05", nodes=nodes)
    expect(one(checks.check_gres(config(*pools), facts)), status, detail, fix)


def test_gres_reads_the_batch_partition_for_a_batch_pool() -> None:
    cfg = config(GPU_POOL | {"role": "batch"},
                 slurm={"partition": "gpu", "batch_partition": "scavenge"})  # fmt: skip
    facts = SlurmFacts(True, nodes=[node("n1")])  # n1 is in "gpu" only
    expect(one(checks.check_gres(cfg, facts)), "fail", "in partition scavenge")


def test_gres_is_not_judged_without_slurm() -> None:
    expect(one(checks.check_gres(config(GPU_POOL), SlurmFacts(False))), "skip", "unreachable")


@pytest.mark.parametrize(
    ("gres", "gpus"),
    [("gpu:4", 4), ("gpu:h100:8(S:0-1)", 8), ("gpu:a:2,gpu:b:2", 4), ("", 0), ("mps:100", 0)],
)
def test_gres_gpus(gres: str, gpus: int) -> None:
    assert checks.gres_gpus(gres) == gpus


# -- keys ----------------------------------------------------------------------------------

SVC = 990


def key(path: str, mode: int = 0o600, uid: int = SVC, **kw: Any) -> FileFacts:
    kind = stat.S_IFDIR if path.endswith("/") else stat.S_IFREG
    return FileFacts(path=path, exists=True, mode=kind | mode, uid=uid, owner="hpcserve"
                     if uid == SVC else "alice", readable=True, **kw)  # fmt: skip


GOOD_KEYS = [
    key("/srv/hs/curve/", 0o700),
    key("/srv/hs/curve/router.key_secret"),
    key("/srv/hs/curve/router.key", 0o644),
    key("/srv/hs/secrets/engine-token"),
]


def keys(files: list[FileFacts], curve: str = "/srv/hs/curve", **kw: Any) -> KeyFacts:
    return KeyFacts(curve_dir=curve, service_user="hpcserve", service_uid=SVC, files=files, **kw)


@pytest.mark.parametrize(
    ("facts", "status", "detail", "fix"),
    [
        (keys(GOOD_KEYS), "ok", "secrets owner-only, owned by hpcserve", ""),
        (keys([*GOOD_KEYS[:3], FileFacts("/srv/hs/secrets/engine-token", False, required=False)]),
         "ok", "not made yet: /srv/hs/secrets/engine-token", ""),
        (keys([GOOD_KEYS[0], key("/srv/hs/curve/router.key_secret", 0o644)]), "fail",
         "mode 0644: others may read it", "chmod 600 /srv/hs/curve/router.key_secret"),
        (keys([key("/srv/hs/curve/", 0o755)]), "fail", "/srv/hs/curve is mode 0755",
         "chmod 700 /srv/hs/curve"),
        (keys([key("/srv/hs/curve/router.key_secret", uid=1000)]), "fail",
         "owned by alice, not the service account hpcserve",
         "chown hpcserve /srv/hs/curve/router.key_secret"),
        (keys([FileFacts("/site/keys/engine.key_secret", False)], curve="/site/keys"), "fail",
         "/site/keys/engine.key_secret is missing", "hpcserve keys"),
        (keys([FileFacts("/srv/hs/curve/router.key_secret", True, mode=stat.S_IFREG | 0o200,
                         uid=SVC, readable=False, error="no read permission")]), "fail",
         "cannot be read by hpcserve", "chmod u+r"),
        (keys([], curve=""), "warn", "plain ZeroMQ on loopback by choice",
         "remove router.allow_plain_loopback"),
        (keys([], curve="", plain_remote_binds=["tcp://0.0.0.0:5560"]), "fail",
         "tcp://0.0.0.0:5560", "remove router.allow_plain_remote"),
    ],
)  # fmt: skip
def test_curve_keys(facts: KeyFacts, status: str, detail: str, fix: str) -> None:
    expect(one(checks.check_keys(facts)), status, detail, fix)


@pytest.mark.parametrize(
    ("files", "status", "detail", "fix"),
    [
        ([FileFacts("/srv/hs/curve/engine.key_secret", True, readable=True)], "ok",
         "the job reads /srv/hs/curve/engine.key_secret", ""),
        ([FileFacts("/srv/hs/curve/engine.key_secret", False, error="missing")], "fail",
         "cannot read /srv/hs/curve/engine.key_secret: missing", "shared filesystem"),
        ([FileFacts("/srv/hs/curve/router.key", True, error="Permission denied")], "fail",
         "Permission denied", "readable by the account the jobs run as"),
        ([], "skip", "no engine key or token to read", ""),
    ],
)  # fmt: skip
def test_engine_keys_on_the_node(
    files: list[FileFacts], status: str, detail: str, fix: str
) -> None:
    expect(checks.check_node_keys(files, NODE), status, detail, fix)


# -- clocks --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("clock", "status", "detail", "fix"),
    [
        (ClockFacts(True, 0.012, "adjtimex"), "ok", "NTP-synchronized (adjtimex, max error 12 ms)",
         ""),
        (ClockFacts(True, 0.01, "adjtimex", chrony_offset_s=0.0002), "ok",
         "chrony offset 0.2 ms", ""),
        (ClockFacts(True, 0.5, "adjtimex", chrony_offset_s=-2.0), "warn",
         "chrony offset -2000.0 ms", "chronyc sources"),
        (ClockFacts(False, 16.0, "adjtimex"), "warn", "not NTP-synchronized",
         "systemctl enable --now chrony"),
        (ClockFacts(None, error="adjtimex: not permitted"), "warn", "cannot tell",
         "systemctl enable --now chrony"),
    ],
)  # fmt: skip
def test_clock(clock: ClockFacts, status: str, detail: str, fix: str) -> None:
    expect(checks.check_clock(clock, NODE), status, detail, fix)


def facts_at(start: float, end: float) -> NodeFacts:
    return NodeFacts(host="n1", started_at=start, finished_at=end)


@pytest.mark.parametrize(
    ("node_facts", "times", "status", "detail"),
    [
        # The node's clock agrees: the job started 0.4 s after slurmctld's stamp, ended 0.3
        # s before its end stamp.
        (facts_at(1000.4, 1008.7), SlurmTimes(1000, 1009), "ok", "within [-1.3, +1.4] s"),
        # 30 s ahead: the node says it finished 30 s after slurmctld saw the job end.
        (facts_at(1030.4, 1038.7), SlurmTimes(1000, 1009), "fail", "at least 28.7 s ahead"),
        # 30 s behind: the node says it started 30 s before slurmctld started the job.
        (facts_at(970.4, 978.7), SlurmTimes(1000, 1009), "fail", "at least 28.6 s behind"),
        # No end stamp seen: only the upper bound.
        (facts_at(1000.4, 1008.7), SlurmTimes(1000, None), "ok", "within [?, +1.4] s"),
        (facts_at(1000.4, 1008.7), SlurmTimes(None, None), "skip", "no start time"),
    ],
)  # fmt: skip
def test_clock_skew(node_facts: NodeFacts, times: SlurmTimes, status: str, detail: str) -> None:
    expect(checks.check_clock_skew(node_facts, times, NODE), status, detail,
           "chrony" if status == "fail" else "")  # fmt: skip


# -- the node cache ------------------------------------------------------------------------

CACHE_CFG = config(CPU_POOL, engine={"cache_dir": "/local/cache"})
GIB = 1 << 30


@pytest.mark.parametrize(
    ("cache", "needed", "status", "detail", "fix"),
    [
        (CacheFacts("/local/cache", True, True, "xfs", "/local", 900 * GIB), 20 * GIB, "ok",
         "xfs on /local, writable, 900.0 GiB free, the pools' models need 20.0 GiB", ""),
        (CacheFacts("/home/svc/cache", True, True, "nfs4", "/home", 900 * GIB), 0, "fail",
         "on nfs4 (/home), a network filesystem", "node-local path"),
        (CacheFacts("/lustre/cache", True, True, "lustre", "/lustre", 900 * GIB), 0, "fail",
         "lustre", "engine.cache_dir"),
        (CacheFacts("/local/cache", True, False, "xfs", "/local", 900 * GIB), 0, "fail",
         "not writable", "chown <service user> /local/cache"),
        (CacheFacts("/local/cache", error="/local is not a directory"), 0, "fail",
         "not a directory", "mkdir -p /local/cache"),
        (CacheFacts("/local/cache", True, True, "ext4", "/", 10 * GIB), 140 * GIB, "fail",
         "10.0 GiB free; the pools' models need 140.0 GiB", "hpcserve cache evict"),
    ],
)  # fmt: skip
def test_cache_dir(cache: CacheFacts, needed: int, status: str, detail: str, fix: str) -> None:
    expect(checks.check_cache(CACHE_CFG, cache, needed, NODE), status, detail, fix)


def test_no_cache_dir_is_a_skip() -> None:
    expect(checks.check_cache(config(CPU_POOL), None, 0, NODE), "skip", "not set")


# -- router endpoints ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("facts", "status", "detail", "fix"),
    [
        (EndpointFacts("router.registry_endpoint", "tcp://ctl01:5560", True), "ok", "reached",
         ""),
        (EndpointFacts("router.registry_endpoint", "tcp://ctl01:5560", False, "refused",
                       "connection refused"), "fail", "connection refused", "start the router"),
        (EndpointFacts("router.registry_endpoint", "tcp://ctl01:5560", False, "timeout",
                       "no answer within 5 s"), "fail", "no answer",
         "open TCP port 5560 from the GPU nodes"),
        (EndpointFacts("router.registry_endpoint", "tcp://ctl01:5560", False, "resolve",
                       "cannot resolve ctl01"), "fail", "cannot resolve", "/etc/hosts"),
        (EndpointFacts("router.registry_bind", "tcp://127.0.0.1:5560", False, "loopback",
                       "a loopback address"), "fail", "loopback",
         "set router.registry_bind to the control node's address"),
        (EndpointFacts("router.registry_bind", "ipc:///run/r.sock", False, "ipc", "ipc"),
         "fail", "ipc", "tcp:// address"),
    ],
)  # fmt: skip
def test_router_endpoint(facts: EndpointFacts, status: str, detail: str, fix: str) -> None:
    expect(one(checks.check_endpoints([facts], NODE)), status, detail, fix)


# -- NVML and vLLM -------------------------------------------------------------------------

H200 = ["0 NVIDIA H200 GPU-1", "1 NVIDIA H200 GPU-2", "2 NVIDIA H200 GPU-3", "3 NVIDIA H200 GPU-4"]


@pytest.mark.parametrize(
    ("cfg", "nvml", "status", "detail", "fix"),
    [
        (config(GPU_POOL), NvmlFacts(True, True, gpus=H200, allocated=4), "ok",
         "NVML sees 4 GPU(s) (Slurm allocated 4)", ""),
        (config(CPU_POOL), NvmlFacts(False, False, "NVML Shared Library Not Found"), "skip",
         "skipped: no GPU", ""),
        (config(GPU_POOL), NvmlFacts(False, False, "NVML Shared Library Not Found"), "fail",
         "but pools llm run engine 'vllm' on GPUs", "slurm.partition"),
        (config(GPU_POOL), NvmlFacts(True, False, "Driver Not Loaded"), "fail",
         "NVML does not load: Driver Not Loaded", "nvidia-smi"),
        (config(GPU_POOL), NvmlFacts(True, True, gpus=H200[:2], allocated=4), "fail",
         "Slurm allocated 4 GPU(s) but NVML sees 2", "AutoDetect=nvml"),
        (config(GPU_POOL), NvmlFacts(True, True, gpus=H200, allocated=4,
                                     findings=["drain_reset xid: xid 79 gpu 3"]), "fail",
         "GPU health: drain_reset xid: xid 79 gpu 3", "hpcserve drain-node"),
    ],
)  # fmt: skip
def test_nvml(cfg: PlatformConfig, nvml: NvmlFacts, status: str, detail: str, fix: str) -> None:
    expect(checks.check_nvml(cfg, nvml, NODE), status, detail, fix)


GPU_VLLM = VllmFacts("/srv/venv/bin/python", True, version="0.32.0", torch_version="2.9.0",
                     torch_cuda="12.8", cuda_available=True, device_count=4)  # fmt: skip
CPU_VLLM = VllmFacts("/srv/venv/bin/python", True, version="0.32.0", cpu_build=True,
                     torch_version="2.13.0+cpu")  # fmt: skip
GPUS = NvmlFacts(True, True, gpus=H200, allocated=4)
NO_GPU = NvmlFacts(False, False, "NVML Shared Library Not Found")


@pytest.mark.parametrize(
    ("vllm", "status", "detail", "fix"),
    [
        (GPU_VLLM, "ok", "vLLM 0.32.0, the GPU build, torch 2.9.0", ""),
        (CPU_VLLM, "ok", "the CPU build (vllm-cpu)", ""),
        (VllmFacts("/srv/venv/bin/python", False, "ModuleNotFoundError: No module named "
                   "'vllm'"), "fail", "cannot import vllm: ModuleNotFoundError",
         "install hpcserve[gpu]"),
    ],
)  # fmt: skip
def test_vllm_import(vllm: VllmFacts, status: str, detail: str, fix: str) -> None:
    expect(checks.check_vllm_import(vllm, NODE), status, detail, fix)


REFUSED = PrivateNetFacts(False, "cannot make a user and network namespace: No space left on device")


@pytest.mark.parametrize(
    ("mode", "facts", "status", "detail", "fix"),
    [
        ("auto", PrivateNetFacts(True), "ok", "a network namespace of its own", ""),
        ("auto", REFUSED, "warn", "No space left on device: vLLM will run in the node's "
         "namespace", "user.max_user_namespaces"),
        ("required", REFUSED, "fail", "engines will fail (engine.private_network = required)",
         "docs/deploy.md"),
        ("off", REFUSED, "skip", "engine.private_network is off", ""),
        ("auto", None, "skip", "not gathered", ""),
    ],
)  # fmt: skip
def test_private_network(
    mode: str, facts: PrivateNetFacts | None, status: str, detail: str, fix: str
) -> None:
    cfg = config(engine={"private_network": mode})
    expect(checks.check_private_network(cfg, facts, NODE), status, detail, fix)


def test_private_network_gathered_as_an_engine_runs_it() -> None:
    from hpcserve.doctor.gather import gather_private_network

    assert gather_private_network() == PrivateNetFacts(True)  # the suite's machine allows it


@pytest.mark.parametrize(
    ("cfg", "vllm", "nvml", "status", "detail", "fix"),
    [
        (config(GPU_POOL), GPU_VLLM, GPUS, "ok", "(CUDA 12.8) sees 4 GPU(s)", ""),
        (config(CPU_POOL), CPU_VLLM, NO_GPU, "skip", "skipped: no GPU", ""),
        (config(GPU_POOL), CPU_VLLM, NO_GPU, "fail", "no NVIDIA GPU on this node",
         "partition of GPU nodes"),
        (config(GPU_POOL), CPU_VLLM, GPUS, "fail", "the CPU build (vllm-cpu) on a GPU node",
         "hpcserve[gpu]"),
        (config(GPU_POOL), VllmFacts("py", True, version="0.32.0", torch_version="2.9.0",
                                     torch_cuda="12.8", error="CUDA driver too old"), GPUS,
         "fail", "sees no GPU: CUDA driver too old", "nvidia-smi"),
        (config(GPU_POOL), VllmFacts("py", True, version="0.32.0", torch_version="2.9.0",
                                     torch_cuda="12.8", cuda_available=True, device_count=1),
         GPUS, "fail", "torch sees 1 GPU(s), Slurm allocated 4", "CUDA_VISIBLE_DEVICES"),
        (config(GPU_POOL), VllmFacts("py", False, "ImportError"), GPUS, "skip",
         "does not import", ""),
    ],
)  # fmt: skip
def test_vllm_cuda(
    cfg: PlatformConfig, vllm: VllmFacts, nvml: NvmlFacts, status: str, detail: str, fix: str
) -> None:
    expect(checks.check_vllm_cuda(cfg, vllm, nvml, NODE), status, detail, fix)


# -- models --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("facts", "host", "status", "detail", "fix"),
    [
        (ModelFacts("p", "/shared/m", ref="m@1", total_bytes=4 * GIB, files=5,
                    digests_checked=True), "control", "ok", "m@1 (/shared/m): 5 file(s), 4.0 GiB, "
         "digests right", ""),
        (ModelFacts("p", "/shared/m", ref="m@1", total_bytes=GIB, files=5), "control", "ok",
         "sizes right (digests not read: --quick)", ""),
        (ModelFacts("p", "/shared/m", total_bytes=GIB, files=5), "control", "warn",
         "no digests to check", "hpcserve models add"),
        (ModelFacts("p", "/shared/m", ref="m@1", files=5, problems=[
            "model.safetensors: digest mismatch (expected ab, found cd)"]), "control", "fail",
         "1 problem(s): model.safetensors: digest mismatch", "restore the files"),
        (ModelFacts("p", "", ref="m@9", error="no version 9 of model 'm'"), "control", "fail",
         "no version 9", "hpcserve models show"),
        (ModelFacts("p", "/shared/m", ref="m@1", files=5, total_bytes=GIB), NODE, "ok",
         "readable from the node", ""),
        (ModelFacts("p", "/shared/m", ref="m@1", error="/shared/m is not a readable directory"),
         NODE, "fail", "not a readable directory", "mount the shared filesystem"),
    ],
)  # fmt: skip
def test_models(facts: ModelFacts, host: str, status: str, detail: str, fix: str) -> None:
    expect(one(checks.check_models([facts], host)), status, detail, fix)


def test_many_model_problems_are_shortened() -> None:
    facts = ModelFacts("p", "/m", ref="m@1", problems=[f"f{i}: missing" for i in range(7)])
    result = one(checks.check_models([facts]))
    assert "7 problem(s): f0: missing; f1: missing; f2: missing; and 4 more" in result.detail


# -- the report ----------------------------------------------------------------------------

RESULTS = [
    CheckResult("slurm", "ok", "slurmctld answers"),
    CheckResult("nvml", "skip", "skipped: no GPU (no NVIDIA device)", host=NODE),
    CheckResult("clock", "warn", "not NTP-synchronized", "run chrony", host=NODE),
]


def test_skips_and_warnings_pass_unless_strict() -> None:
    assert exit_status(RESULTS) == 0
    assert exit_status(RESULTS, strict=True) == 1
    failed = [*RESULTS, CheckResult("gres", "fail", "no GPUs", "declare them")]
    assert exit_status(failed) == 1
    report = report_json(failed)
    assert report["summary"] == {"ok": 1, "warn": 1, "fail": 1, "skip": 1}
    assert report["exit_status"] == 1
    assert report["checks"][3] == {"check": "gres", "status": "fail", "detail": "no GPUs",
                                   "fix": "declare them", "host": "control"}  # fmt: skip


def test_one_line_per_check_with_the_fix_on_it() -> None:
    assert format_line(RESULTS[2]) == (
        "WARN node n1: clock: not NTP-synchronized -- fix: run chrony"
    )
    assert format_line(RESULTS[1]) == "skip node n1: nvml: skipped: no GPU (no NVIDIA device)"
    text = format_report(RESULTS)
    assert len(text.splitlines()) == len(RESULTS) + 1
    assert text.splitlines()[-1] == "doctor: 1 ok, 1 warning(s), 1 skipped, 0 failed"


def test_node_results_cover_every_node_check() -> None:
    facts = NodeFacts(host="n1", started_at=1000.2, finished_at=1005.0,
                      clock=ClockFacts(True, 0.01, "adjtimex"),
                      cache=CacheFacts("/local/cache", True, True, "xfs", "/local", 900 * GIB),
                      endpoints=[EndpointFacts("router.registry_endpoint", "tcp://c:1", True)],
                      nvml=GPUS, vllm=GPU_VLLM, private_network=PrivateNetFacts(True),
                      models=[ModelFacts("llm", "/m", ref="m@1", files=1, total_bytes=1)])  # fmt: skip
    cfg = config(GPU_POOL, engine={"cache_dir": "/local/cache"})
    results = checks.node_results(cfg, facts, SlurmTimes(1000, 1006), GIB)
    assert [r.check for r in results] == [
        "clock", "clock_skew", "cache_dir", "router_endpoint", "engine_keys", "nvml",
        "vllm_import", "vllm_cuda", "private_network", "models",
    ]  # fmt: skip
    assert {r.host for r in results} == {"node n1"}
    assert [r.status for r in results if r.status != "ok"] == ["skip"]  # engine_keys: none


def test_metrics_file_counts_results_by_check_host_and_status(tmp_path: Path) -> None:
    path = tmp_path / "doctor.prom"
    write_metrics(str(path), [*RESULTS, CheckResult("models", "fail", "x", "y"),
                              CheckResult("models", "fail", "z", "y")])  # fmt: skip
    text = path.read_text()
    assert 'hpcserve_doctor_checks{check="models",host="control",status="fail"} 2.0' in text
    assert 'hpcserve_doctor_checks{check="nvml",host="node n1",status="skip"} 1.0' in text
    assert "hpcserve_doctor_failed_checks 2.0" in text


def job(state: JobState, start: int | None, end: int | None) -> SlurmJob:
    return SlurmJob(job_id=7, name="hpcserve-doctor", state=state, state_reason="None",
                    nodes=["n1"], partition="gpu", comment="", submit_time=990,
                    start_time=start, time_limit_s=600, end_time=end, batch_host="n1")  # fmt: skip


def test_only_slurms_facts_count_as_the_jobs_times_not_its_estimates() -> None:
    pending = _times(job(JobState.PENDING, 2000, 2600), None)  # the scheduler's guess
    assert pending == SlurmTimes(None, None)
    running = _times(job(JobState.RUNNING, 1000, 1600), pending)  # end = start + limit
    assert running == SlurmTimes(1000, None)
    done = _times(job(JobState.COMPLETED, 1000, 1009), running)
    assert done == SlurmTimes(1000, 1009)
