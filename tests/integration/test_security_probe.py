"""Issue 18, as another cluster user sees it: `hpcserve up` on the two-node Slurm cluster
with a real vLLM CPU engine (LoRA on), and a second, unprivileged Unix user (tests/
unprivileged.py) who can reach the engine's port, run `ps` and `scontrol`, and look at the
file system. Its direct calls to the engine get 401 (chat, completions, LoRA load and
unload, the routes vLLM's own --api-key check leaves open); it can read none of the
secrets and state files; no `ps`, `scontrol show job`, job script, job output or service
log holds a secret. Tenant B sees none of tenant A's batch files, batches or outputs.
(The socket half, KV events and the router's sockets, is tested beside this one.)
"""

from __future__ import annotations

import io
import json
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import openai
import pytest

from hpcserve.config import PlatformConfig, PoolConfig, dump_config, load_config
from hpcserve.contracts.engine_token import auth_headers, read_token
from hpcserve.contracts.private_files import write_private
from hpcserve.contracts.router_client import list_replicas
from hpcserve.stack import Stack
from hpcserve.tinymodels import make_tiny_model
from tests.integration.slurm_helpers import free_port_block
from tests.services import stack_config
from tests.unprivileged import (
    listable_by_probe,
    probe_user,
    readable_by_probe,
    run_as,
    run_python_as,
)

pytestmark = [pytest.mark.slurm, pytest.mark.vllm]

MODEL = "tiny-chat"
ADAPTER = "docs-a"
KEYS = {"team-a": "sk-security-team-a-5d1f", "team-b": "sk-security-team-b-9c2e"}
ENGINE_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "512"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, PlatformConfig]]:
    probe_user()  # skips unless root, before anything starts
    state = tmp_path_factory.mktemp("security") / "state"
    state.mkdir()
    _register_model_and_adapter(state)
    # No curve_dir: CURVE by default, keys made in <state>/curve (issue 18).
    config = stack_config(
        state,
        api_keys=KEYS,
        pools=[
            PoolConfig(
                name=MODEL,
                model_ref=f"{MODEL}@1",
                engine="vllm-cpu",
                engine_args=ENGINE_ARGS,
                env={"VLLM_CPU_KVCACHE_SPACE": "1"},
                max_loras=1,
                max_lora_rank=8,
            )
        ],
    )
    # Engines listen on every address (engine.bind_host's default), not on loopback alone.
    engine = msgspec.structs.replace(config.engine, bind_host="0.0.0.0")
    config = msgspec.structs.replace(config, engine=engine)
    write_private(state / "hpcserve.toml", dump_config(config).encode())
    config = load_config(state / "hpcserve.toml")  # what the services read: <state>/curve
    up = Stack(state, slurm_port=free_port_block())
    try:
        assert up.up(launcher="slurm", timeout_s=600) == 0, "hpcserve up failed (see output)"
        yield up, config
    finally:
        up.down()


def _register_model_and_adapter(state: Path) -> None:
    from hpcserve.modelcache.manifest import build_manifest
    from hpcserve.modelcache.registry import Registry

    chat = make_tiny_model("chat", state / "models" / MODEL)
    adapter = make_tiny_model("lora", state / "adapters" / ADAPTER, seed=1)
    with Registry(state / "registry.sqlite3") as registry:
        registry.add_version(MODEL, str(chat), build_manifest(chat))
        registry.add_adapter(ADAPTER, MODEL, str(adapter), build_manifest(adapter), rank=8)


def _client(config: PlatformConfig, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{config.gateway.port}/v1",
        api_key=KEYS[tenant],
        max_retries=0,
        timeout=120,
    )


def _engine_url(config: PlatformConfig) -> str:
    replicas = list_replicas(config.router.routing_bind, curve_dir=config.router.curve_dir)
    (url,) = [r.url for r in replicas if r.model == MODEL]
    return url


# What the probe user sends straight to the engine's port: (path, body).
DIRECT_CALLS = [
    ("/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
    ("/v1/load_lora_adapter", {"lora_name": "planted", "lora_path": "/tmp"}),
    ("/v1/unload_lora_adapter", {"lora_name": ADAPTER}),
    # Outside /v1, where vLLM's own --api-key check does not look: SageMaker's route runs
    # chat and completions; the others tokenize or pool for anyone.
    ("/invocations",
     {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("/tokenize", {"model": MODEL, "prompt": "hi"}),
    ("/detokenize", {"model": MODEL, "tokens": [1, 2]}),
    ("/pooling", {"model": MODEL, "input": "hi"}),
]  # fmt: skip

POST_AS_PROBE = """
import json, sys, urllib.error, urllib.request
base, calls = sys.argv[1], json.loads(sys.argv[2])
for path, body in calls:
    request = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            print(path, resp.status)
    except urllib.error.HTTPError as err:
        print(path, err.code)
"""


def test_a_direct_call_to_the_engine_is_refused_for_another_user(
    stack: tuple[Stack, PlatformConfig],
) -> None:
    _, config = stack
    url = _engine_url(config)
    run = run_python_as(POST_AS_PROBE, url, json.dumps(DIRECT_CALLS))
    assert run.returncode == 0, run.stderr
    answers = dict(line.rsplit(" ", 1) for line in run.stdout.splitlines())
    assert answers == {path: "401" for path, _ in DIRECT_CALLS}
    # Nothing was loaded or unloaded; the stack's own callers are served.
    token = read_token(config.engine_token_path())
    listed = httpx.get(url + "/v1/models", headers=auth_headers(token), timeout=30).json()
    assert "planted" not in {m["id"] for m in listed["data"]}
    reply = _client(config, "team-a").chat.completions.create(
        model=ADAPTER, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )  # the router had the engine load it, with the token
    assert reply.model == ADAPTER
    assert httpx.get(url + "/health", timeout=30).status_code == 200  # open: no tenant data


GET_AS_PROBE = """
import sys, urllib.error, urllib.request
for url in sys.argv[1:]:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            print(url, resp.status, resp.read().decode()[:40].strip())
    except urllib.error.HTTPError as err:
        print(url, err.code, err.read().decode()[:40].strip())
"""


def test_the_control_planes_metrics_are_closed_to_another_user(
    stack: tuple[Stack, PlatformConfig],
) -> None:
    _, config = stack
    ports = (config.router.metrics_port, config.poolmgr.metrics_port)
    urls = [f"http://127.0.0.1:{port}/{path}" for port in ports for path in ("metrics", "healthz")]
    run = run_python_as(GET_AS_PROBE, *urls)
    assert run.returncode == 0, run.stderr
    answers = {line.split(" ", 1)[0]: line.split(" ", 2)[1:] for line in run.stdout.splitlines()}
    for port in ports:
        status, body = answers[f"http://127.0.0.1:{port}/metrics"]
        assert status == "401" and "hpcserve_" not in body
        assert answers[f"http://127.0.0.1:{port}/healthz"] == ["200", "ok"]
    # The stack's own scraper, with the metrics token, reads them.
    token = read_token(config.metrics_token_path())
    for port in ports:
        text = httpx.get(
            f"http://127.0.0.1:{port}/metrics", headers=auth_headers(token), timeout=30
        ).text
        assert "hpcserve_metrics_auth_failures_total 1.0" in text


def test_secrets_and_state_are_owner_only_and_unreadable_to_another_user(
    stack: tuple[Stack, PlatformConfig],
) -> None:
    _, config = stack
    state = Path(config.state_dir)
    secrets = [
        Path(config.engine_token_path()),
        state / "hpcserve.toml",
        state / "registry.sqlite3",
        state / "batch" / "batch.sqlite3",
        *sorted((state / "curve").glob("*.key_secret")),
        *sorted((state / "logs").glob("*.log")),
        *sorted((state / "jobs").glob("*.out")),
    ]
    assert len([p for p in secrets if p.suffix == ".key_secret"]) >= 2
    assert any(p.suffix == ".out" for p in secrets) and any(p.suffix == ".log" for p in secrets)
    for path in secrets:
        assert not readable_by_probe(path), path
    for directory in (state, state / "secrets", state / "batch", state / "curve", state / "jobs"):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory
        assert not listable_by_probe(directory), directory
    for path in (Path(config.engine_token_path()), state / "registry.sqlite3"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    # The control: the probe does read what is world-readable.
    assert readable_by_probe("/etc/passwd")


@pytest.fixture
def probe_slurm_env(stack: tuple[Stack, PlatformConfig]) -> Iterator[dict[str, str]]:
    """SLURM_CONF for the probe: the cluster's slurm.conf copied where it can read it (it
    sits in the 0700 state dir; a site's lives in /etc/slurm, readable by every user)."""
    _, config = stack
    where = Path(tempfile.mkdtemp(prefix="hpcserve-probe-slurm-"))
    try:
        where.chmod(0o755)
        conf = where / "slurm.conf"
        shutil.copy(config.slurm.conf, conf)
        conf.chmod(0o644)
        yield {"SLURM_CONF": str(conf)}
    finally:
        shutil.rmtree(where)


def test_ps_scontrol_job_script_job_output_and_logs_hold_no_secret(
    stack: tuple[Stack, PlatformConfig], probe_slurm_env: dict[str, str]
) -> None:
    _, config = stack
    state = Path(config.state_dir)
    token = read_token(config.engine_token_path())
    secrets = [token, *KEYS.values()]
    ps = run_as(["ps", "-eww", "-o", "user,pid,args"])
    # vLLM's API server, on the HTTP socket the engine made (engine_launch/vllm_api.py)
    api_server = "hpcserve.engine_launch.vllm_api"
    assert ps.returncode == 0 and api_server in ps.stdout
    vllm_pids = [line.split()[1] for line in ps.stdout.splitlines() if api_server in line]
    # Environments are the owner's: the probe cannot read vLLM's (VLLM_API_KEY is there).
    for pid in vllm_pids:
        assert not readable_by_probe(f"/proc/{pid}/environ")
    show = run_as(["scontrol", "show", "job", "-d"], env=probe_slurm_env)
    assert show.returncode == 0, show.stderr
    assert f"JobName=hpcserve-{MODEL}" in show.stdout  # it sees the job, and no secret
    job_ids = [w.split("=")[1] for w in show.stdout.split() if w.startswith("JobId=")]
    own = subprocess.run(
        ["scontrol", "show", "job", "-dd", *job_ids[:1]],
        env={"SLURM_CONF": config.slurm.conf, "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    script = subprocess.run(
        ["scontrol", "write", "batch_script", job_ids[0], "-"],
        env={"SLURM_CONF": config.slurm.conf, "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "HPCSERVE_ENGINE_TOKEN_FILE" in script.stdout  # the path goes, never the token
    outputs = [p.read_text(errors="replace") for p in (state / "jobs").glob("*.out")]
    logs = [p.read_text(errors="replace") for p in (state / "logs").glob("*.log")]
    assert any("vLLM ready" in text for text in outputs)
    for name, text in [("ps", ps.stdout), ("scontrol (another user)", show.stdout),
                       ("scontrol -dd (the owner)", own.stdout), ("job script", script.stdout),
                       *(("job output", t) for t in outputs), *(("service log", t) for t in logs)]:  # fmt: skip
        for secret in secrets:
            assert secret not in text, f"a secret in the {name}"
    assert any(line.startswith("audit {") for t in logs for line in t.splitlines())


def test_tenant_b_sees_none_of_tenant_as_batch_files_batches_or_outputs(
    stack: tuple[Stack, PlatformConfig],
) -> None:
    _, config = stack
    a, b = _client(config, "team-a"), _client(config, "team-b")
    lines = b"".join(
        json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"model": MODEL, "max_tokens": 2,
                             "messages": [{"role": "user", "content": f"hi {i}"}]}}).encode()
        + b"\n"
        for i in range(2)
    )  # fmt: skip
    upload = a.files.create(file=("requests.jsonl", io.BytesIO(lines)), purpose="batch")
    batch = a.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 300
    while (batch := a.batches.retrieve(batch.id)).status not in ("completed", "failed"):
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(1)
    assert batch.status == "completed" and batch.output_file_id
    for attempt in (
        lambda: b.files.retrieve(upload.id),
        lambda: b.files.content(upload.id),
        lambda: b.files.delete(upload.id),
        lambda: b.batches.retrieve(batch.id),
        lambda: b.batches.cancel(batch.id),
        lambda: b.files.retrieve(batch.output_file_id),
        lambda: b.files.content(batch.output_file_id),
        lambda: b.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            attempt()
    assert b.batches.list().data == [] and b.files.list().data == []
    assert len(a.files.content(batch.output_file_id).text.splitlines()) == 2
